"""What happens before the first `sample`: lock the namespace, scan it, handle what an earlier run left.

Orchestration only: the disk is touched through :mod:`lock`, :mod:`scan` and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import FrozenSet, Optional, Tuple

from .callbacks import human_bytes
from .config import RolloutTQConfig
from .errors import ConfigError
from .fingerprint import Fingerprint
from .layout import Layout
from .lock import NamespaceLock
from .scan import CleanupResult, NamespaceReport, plan_cleanup, scan_namespace


@dataclass(frozen=True)
class StartupResult:
    """The namespace as found at startup and what was done about it. Holds the lock until released."""

    layout: Layout
    report: NamespaceReport
    cleanup: Optional[CleanupResult]
    cleanup_action: str
    lock: NamespaceLock = field(repr=False, compare=False)
    lock_was_held_here: bool = False

    def release(self) -> None:
        self.lock.release()

    @property
    def handled(self) -> Tuple:
        return self.cleanup.items if self.cleanup is not None else ()

    def servable_steps(self, fingerprint: Optional[Fingerprint] = None) -> FrozenSet[int]:
        """Complete steps made with `fingerprint` (or any, if None), plus unverified legacy steps."""
        handled = {item.step for item in self.handled}
        out = set()
        for s in self.report.steps:
            if s.step in handled:
                continue
            if s.status == "unverified":
                out.add(s.step)
            elif s.status == "complete" and (fingerprint is None or fingerprint.matches(s.fingerprint)):
                out.add(s.step)
        return frozenset(out)

    def mismatched_steps(self, fingerprint: Fingerprint) -> Tuple[Tuple[int, Fingerprint], ...]:
        return tuple(
            (s.step, s.fingerprint)
            for s in self.report.steps
            if s.status == "complete" and s.fingerprint is not None and not fingerprint.matches(s.fingerprint)
        )

    def faults(self) -> Tuple[Tuple[str, str], ...]:
        """(path, reason) of every corrupt step found and every cleanup error: each gets a WARNING."""
        out = [(str(s.path), f"corrupt step: {s.reason}") for s in self.report.steps if s.status == "corrupt"]
        if self.cleanup is not None:
            out += [(str(self.layout.root), f"cleanup failed: {e}") for e in self.cleanup.errors]
        return tuple(out)

    def describe(self) -> str:
        """The one startup line: namespace, complete/unverified steps, what was handled (which, how, bytes)."""
        steps = self.report.steps
        complete = sum(1 for s in steps if s.status == "complete")
        unverified = sum(1 for s in steps if s.status == "unverified")
        incomplete = [s.step for s in steps if s.status == "incomplete"]
        corrupt = [s.step for s in steps if s.status == "corrupt"]
        line = (
            f"rollout cache {self.layout.root}: {complete} complete, {unverified} unverified steps; "
            f"{len(incomplete)} incomplete{_steps(incomplete)}, {len(corrupt)} corrupt{_steps(corrupt)}"
        )
        if self.cleanup is not None and self.cleanup.items:
            if self.cleanup_action == "delete":
                line += f" -> deleted {len(self.cleanup.items)} ({human_bytes(self.cleanup.freed_bytes)})"
            else:
                line += (
                    f" -> quarantined {len(self.cleanup.items)} ({human_bytes(self.cleanup.moved_bytes)}) "
                    f"under {self.layout.quarantine_dir}"
                )
        elif incomplete or corrupt:
            line += " -> left in place (skip.rollout_tq.cleanup=off; rewritten when generated)"
        return line


def _steps(steps) -> str:
    if not steps:
        return ""
    shown = ", ".join(str(s) for s in steps[:10])
    return f" [{shown}{', ...' if len(steps) > 10 else ''}]"


def prepare_namespace(layout: Layout, settings: RolloutTQConfig, *, timeout: Optional[float] = None) -> StartupResult:
    """Lock, scan, and clean (per `skip.rollout_tq.cleanup`) one namespace. Raises LockHeldError."""
    lock = NamespaceLock(layout, timeout=settings.lock_timeout if timeout is None else timeout)
    was_held = lock.held_by_this_process
    try:
        lock.acquire()
    except OSError as exc:  # not a directory, not writable, no flock on this filesystem...
        raise ConfigError(
            "skip.rollout_tq.dump_dir", f"cannot use {layout.root} for the rollout cache: {exc.strerror or exc}"
        ) from None
    try:
        report = scan_namespace(layout)
        action = settings.cleanup.value if hasattr(settings.cleanup, "value") else str(settings.cleanup)
        cleanup = None
        if action != "off":
            plan = plan_cleanup(report, action)
            if plan.items or plan.leftovers:
                cleanup = plan.execute()
        return StartupResult(layout, report, cleanup, action, lock, was_held)
    except BaseException:
        lock.release()
        raise
