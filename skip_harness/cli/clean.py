"""`skip-harness clean`: handle incomplete and corrupt steps as startup does (checksum-corrupt and
unloadable ones included, found by verifying first), and apply retention rules to complete steps."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rich.markup import escape
from rich.table import Table

from skip_harness.store.api import (CleanupItem, CleanupPlan, Hold, Layout, Namespace, NamespaceReport, RetentionRules,
                                    StepAge, StepReport, StepStatus, StepStore, bytes_left, open_namespace,
                                    plan_cleanup, plan_retention, scan_namespace)
from skip_harness.errors import LockHeldError

from skip_harness.cli._common import (
    EXIT_CORRUPT,
    EXIT_LOCKED,
    EXIT_OK,
    emit_json,
    human_bytes,
    logger,
    progress,
    short_path,
    stdout_console,
    step_written,
)
from skip_harness.cli._verify import verified_steps

RETENTION_STATUS = "retention"   # what a step removed by a retention rule is listed as


@dataclass
class _HeldNamespace:
    layout: Layout
    namespace: Namespace                   # opened once by this command (its lock file, or its lease)
    lock: Optional[Hold] = None
    refused: Optional[str] = None        # locked by a running job
    read_only: Optional[str] = None      # the namespace cannot be written
    report: Optional[NamespaceReport] = None
    failed: List[Tuple[int, str]] = field(default_factory=list)   # servable steps that failed to verify
    verified: Sequence[StepReport] = ()


def _take(layout: Layout, dry_run: bool) -> _HeldNamespace:
    """The namespace held for cleaning, through its backend (its lock file, or its lease on an object
    store); a dry run takes nothing and only asks who holds it."""
    namespace = open_namespace(layout)
    ns = _HeldNamespace(layout, namespace)
    if dry_run:
        holder = namespace.holder()      # touches nothing
        if holder is not None:
            ns.refused = f"namespace {layout.root} is in use by {holder}"
        return ns
    try:
        hold = namespace.lock(0)
    except LockHeldError as exc:
        ns.refused = str(exc)
        return ns
    if hold.read_only:
        ns.read_only = f"{layout.root}: cannot be written ({hold.why or 'this process may only read it'}); nothing can be removed there"
    else:
        ns.lock = hold
    return ns


def _plan(ns: _HeldNamespace, action: str, removals: List[Tuple[int, str]]) -> CleanupPlan:
    """The scan's cleanup plan with the steps that failed verification added as corrupt (the store's
    `plan_cleanup(..., extra=...)`), plus the retention removals."""
    report = ns.report
    plan = plan_cleanup(report, action, extra=list(ns.failed))
    planned = set(plan.steps)
    by_step = {s.step: s for s in report.steps}
    extra = tuple(
        CleanupItem(step, by_step[step].path, RETENTION_STATUS, reason, by_step[step].bytes, action)
        for step, reason in removals if step not in planned and step in by_step
    )
    return dataclasses.replace(plan, items=plan.items + extra) if extra else plan


def _plan_table(ns: _HeldNamespace, plan: CleanupPlan, base: Path, verb: str) -> Table:
    """One row per reason: the steps it takes (as ranges), how many, their size."""
    title = f"{short_path(ns.layout, base)}  (K={ns.layout.K} W={ns.layout.W}): {verb}"
    t = Table(title=escape(title), title_justify="left", min_width=len(title))   # the title on one line
    t.add_column("steps", overflow="fold")
    t.add_column("count", justify="right")
    t.add_column("why")
    t.add_column("size", justify="right")
    t.add_column("reason", overflow="fold")
    groups: Dict[Tuple[str, str], List[CleanupItem]] = {}
    for i in plan.items:
        groups.setdefault((i.status, i.reason), []).append(i)
    for (status, reason), items in groups.items():
        t.add_row(step_ranges([i.step for i in items]), str(len(items)), status,
                  human_bytes(sum(i.bytes for i in items)), escape(reason))
    if plan.leftovers:
        t.add_row("-", str(len(plan.leftovers)), "leftover", human_bytes(sum(x.bytes for x in plan.leftovers)),
                  ".trash-/.tmp- entries left by an interrupted run")
    return t


def step_ranges(steps: Sequence[int]) -> str:
    """[1, 2, 3, 5, 7, 8] -> '1-3, 5, 7-8'."""
    out: List[str] = []
    ordered = sorted(set(steps))
    start = prev = None
    for s in ordered + [None]:
        if s is not None and prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = s
    return ", ".join(out)


def n_steps(n: int) -> str:
    return f"{n} step{'' if n == 1 else 's'}"


def cmd_clean(layouts: List[Layout], base: Path, *, dry_run: bool, quarantine: bool, as_json: bool,
              rules: RetentionRules) -> int:
    action = "quarantine" if quarantine else "delete"
    verb = "quarantine" if quarantine else "remove"
    code = EXIT_OK
    docs: List[Dict[str, Any]] = []
    spaces = [_take(layout, dry_run) for layout in layouts]
    console = stdout_console()
    totals = _Totals()
    try:
        with progress() as bar:
            for ns in spaces:
                if ns.refused is not None or ns.read_only is not None:
                    continue
                ns.report = scan_namespace(ns.layout, ns.namespace)
                bar.start(f"verifying {ns.layout.root}", len(ns.report.steps))
                ns.verified, ns.failed = verified_steps(StepStore(ns.layout, ns.namespace).reader, ns.report, bar.advance)
                bar.finish(f"{len(ns.failed)} corrupt" if ns.failed else "")
        ages = []
        for ns in spaces:
            if ns.report is None:
                continue
            reader = StepStore(ns.layout, ns.namespace).reader
            for s in ns.verified:
                written = step_written(reader, s)
                ages.append(StepAge(str(ns.layout.root), s.step, s.bytes,
                                    written if written is not None else 0.0, s.servable))
        removals = plan_retention(ages, rules, time.time()) if rules.active else {}
        for ns in spaces:
            doc: Dict[str, Any] = {"path": str(ns.layout.root), "K": ns.layout.K, "W": ns.layout.W,
                                   "action": action, "dry_run": dry_run}
            docs.append(doc)
            if ns.refused is not None:
                logger.error("refusing to clean: %s", ns.refused)
                doc["refused"] = ns.refused
                code = EXIT_LOCKED
                continue
            if ns.read_only is not None:
                logger.error("cannot clean: %s", ns.read_only)
                doc["errors"] = [ns.read_only]
                code = code if code != EXIT_OK else EXIT_CORRUPT
                continue
            plan = _plan(ns, action, removals.get(str(ns.layout.root), []))
            doc["steps"] = [{"step": i.step, "status": i.status, "bytes": i.bytes, "reason": i.reason}
                            for i in plan.items]
            doc["expected_freed_bytes"] = plan.expected_freed_bytes
            if not as_json:
                if plan.items or plan.leftovers:
                    console.print(_plan_table(ns, plan, base, "would " + verb if dry_run else verb))
                else:
                    console.print(f"{short_path(ns.layout, base)}: nothing to {verb}")
            if dry_run:
                totals.add(len(plan.items), plan.bytes, plan.expected_freed_bytes)
                if not as_json:
                    console.print(f"  would {verb} {n_steps(len(plan.items))}, {human_bytes(plan.bytes)}; "
                                  f"frees {human_bytes(plan.expected_freed_bytes)}")
                continue
            result = plan.execute(ns.namespace)
            doc["freed_bytes"] = result.freed_bytes
            doc["moved_bytes"] = result.moved_bytes
            doc["errors"] = list(result.errors)
            for item in result.items:
                if item.status == StepStatus.CORRUPT:
                    logger.warning("%s: corrupt step %d %s: %s", ns.layout.root, item.step,
                                   "quarantined" if quarantine else "removed", item.reason)
            totals.add(len(result.items), result.moved_bytes if quarantine else result.freed_bytes,
                       result.freed_bytes)
            if not as_json and (plan.items or plan.leftovers):
                if quarantine:
                    console.print(f"  quarantined {n_steps(len(result.items))}, {human_bytes(result.moved_bytes)}, "
                                  f"under {ns.layout.quarantine_dir}; freed {human_bytes(result.freed_bytes)}")
                else:
                    console.print(f"  removed {n_steps(len(result.items))}, freed {human_bytes(result.freed_bytes)}")
            for e in result.errors:
                logger.error("%s", e)
            if result.errors and code == EXIT_OK:
                code = EXIT_CORRUPT
    finally:
        for ns in spaces:
            if ns.lock is not None:
                ns.lock.release()
    if rules.max_size_bytes is not None:
        left = bytes_left(ages, removals)
        if left > rules.max_size_bytes:
            logger.warning("the steps left hold %s, over --max-size %s: pinned steps and locked namespaces "
                           "are never removed", human_bytes(left), human_bytes(rules.max_size_bytes))
    if as_json:
        emit_json({"namespaces": docs, "total": {"steps": totals.steps, "bytes": totals.bytes,
                                                 "freed_bytes": totals.freed}})
    elif totals.namespaces > 1:
        done = ("would " + verb) if dry_run else ("quarantined" if quarantine else "removed")
        console.print(f"in all: {done} {n_steps(totals.steps)} in {totals.namespaces} namespaces, "
                      f"{human_bytes(totals.bytes)}; {'frees' if dry_run else 'freed'} {human_bytes(totals.freed)}")
    return code


@dataclass
class _Totals:
    """The grand total over the namespaces handled (the last line, or `total` in --json)."""

    namespaces: int = 0
    steps: int = 0
    bytes: int = 0
    freed: int = 0

    def add(self, steps: int, nbytes: int, freed: int) -> None:
        self.namespaces += 1
        self.steps += steps
        self.bytes += nbytes
        self.freed += freed
