"""What cleanup will do about what the scan found, and doing it: plan -> frozen plan with its expected
freed size; `plan.execute()` -> result. Nothing changes on disk until a plan is executed; steps are
removed (commit record first) or moved under `{namespace}/.quarantine/`, never following a link."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

from skip_harness.choices import Cleanup
from skip_harness.errors import ConfigError, SkipHarnessError
from skip_harness.store import index as _index
from skip_harness.store.layout import Layout, UrlPath
from skip_harness.store.namespace import Namespace
from skip_harness.store.scan import LeftoverEntry, NamespaceReport
from skip_harness.store.status import StepStatus

__all__ = ["CleanupItem", "CleanupPlan", "CleanupResult", "plan_cleanup"]


@dataclass(frozen=True)
class CleanupItem:
    step: int
    path: Path
    status: str
    reason: str
    bytes: int
    action: str          # "delete" | "quarantine"


@dataclass(frozen=True)
class CleanupResult:
    items: Tuple[CleanupItem, ...]      # the items handled
    freed_bytes: int                     # bytes deleted (steps and leftovers)
    errors: Tuple[str, ...]
    moved_bytes: int = 0                 # bytes moved under .quarantine/
    quarantined: Tuple[Path, ...] = ()   # where each quarantined step went
    leftovers: Tuple[Path, ...] = ()     # debris removed: '.trash-'/'.tmp-' entries of interrupted writes
    leftover_bytes: int = 0              # their bytes (part of freed_bytes)


@dataclass(frozen=True)
class CleanupPlan:
    """What cleanup will do; nothing happens until `execute()`."""

    layout: Layout
    action: str
    items: Tuple[CleanupItem, ...]
    leftovers: Tuple[LeftoverEntry, ...] = ()

    @property
    def bytes(self) -> int:
        """Bytes of the steps the plan handles (deleted or moved)."""
        return sum(i.bytes for i in self.items)

    @property
    def expected_freed_bytes(self) -> int:
        """Bytes that executing the plan frees (quarantined steps are moved, not freed)."""
        steps = self.bytes if self.action == "delete" else 0
        return steps + sum(x.bytes for x in self.leftovers)

    @property
    def steps(self) -> Tuple[int, ...]:
        return tuple(i.step for i in self.items)

    def describe(self) -> str:
        verb = {"delete": "remove", "quarantine": "quarantine"}.get(self.action, "leave")
        return f"{verb} {len(self.items)} steps, {self.bytes} bytes"

    def execute(self, namespace: Namespace) -> CleanupResult:
        """Do it, through `namespace` (the layout's, as the run or command opened it)."""
        layout = self.layout
        root = layout.root
        done: List[CleanupItem] = []
        errors: List[str] = []
        quarantined: List[Path] = []
        freed = moved = 0
        for item in self.items:
            if item.path.parent != root or item.path != layout.step_dir(item.step):
                errors.append(f"{item.path}: not a step of namespace {root}; left alone")
                continue
            try:
                if item.action == Cleanup.delete.value:
                    freed += namespace.remove_step(item.step)
                elif item.action == Cleanup.quarantine.value:
                    dst = _quarantine(layout, namespace, item.step)
                    moved += item.bytes
                    quarantined.append(dst)
                else:
                    errors.append(f"{item.path}: unknown action {item.action!r}")
                    continue
                done.append(item)
            except (OSError, SkipHarnessError) as exc:
                errors.append(f"{item.path}: {item.action} failed: {exc}")
        _index.drop(layout, namespace, (i.step for i in done))
        removed: List[Path] = []
        removed_bytes = 0
        for lo in self.leftovers:    # the namespace's own debris, and the recorded values' and tier's
            try:
                n = namespace.remove(str(lo.path.relative_to(root)))
            except (OSError, SkipHarnessError, ValueError) as exc:
                errors.append(f"{lo.path}: removal failed: {exc}")
                continue
            freed += n
            removed_bytes += n
            removed.append(lo.path)
        return CleanupResult(tuple(done), freed, tuple(errors), moved, tuple(quarantined), tuple(removed),
                             removed_bytes)


def _quarantine(layout: Layout, namespace: Namespace, step: int) -> Path:
    """Move a step entry (directory, file or link: never followed) under {namespace}/.quarantine/."""
    where = namespace.set_aside(step, "")
    return UrlPath(where) if layout.is_url else Path(where)  # type: ignore[return-value]  # a UrlPath on a bucket


def plan_cleanup(report: NamespaceReport, action, extra: Iterable[Tuple[int, str]] = ()) -> CleanupPlan:
    """Plan to handle every incomplete and corrupt step: `Cleanup.delete`, `Cleanup.quarantine`, or
    `Cleanup.off` (an empty plan); the action's value ("delete", ...) works too. `extra` holds
    (step, reason) pairs of steps to handle as corrupt although the scan found them servable --
    checksum failures found by `StepReader.verify` or at run time. Leftover '.trash-'/'.tmp-'
    debris is deleted by both delete and quarantine."""
    try:
        action = Cleanup(action)
    except ValueError:
        choices = ", ".join(c.value for c in Cleanup)
        raise ConfigError("skip.rollout_tq.cleanup", f"unknown value {action!r}; expected one of {choices}") from None
    if action is Cleanup.off:
        return CleanupPlan(report.layout, action.value, ())
    reasons: Dict[int, str] = {}
    for step, reason in extra:
        reasons.setdefault(step, reason)
    items = tuple(
        CleanupItem(s.step, s.path, StepStatus.CORRUPT if s.servable else s.status,
                    reasons[s.step] if s.servable else s.reason, s.bytes, action.value)
        for s in report.steps
        if s.status in (StepStatus.INCOMPLETE, StepStatus.CORRUPT) or (s.servable and s.step in reasons)
    )
    return CleanupPlan(report.layout, action.value, items, report.leftovers)
