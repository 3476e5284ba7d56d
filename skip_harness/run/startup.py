"""What happens before the first `sample`: lock the namespace, scan it, handle what an earlier run left.

Orchestration only: the namespace is held through its namespace (`store.open`) and scanned by `scan`. A namespace that cannot
be written (a finished cache on a read-only mount) is scanned only: no lock, no cleanup, no writes.
A Hydra callback that did the startup before the task function hands its result over here
(:func:`hand_over`); the harness then takes it (:func:`take_over`) instead of locking a second time.
"""
from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Dict, FrozenSet, Optional, Tuple

from skip_harness.config import Cleanup, OnMismatch, RolloutTQConfig
from skip_harness.run.dist import DistContext
from skip_harness.errors import ConfigError, FingerprintMismatchError, LockHeldError, SkipHarnessError
from skip_harness.store.api import (CleanupItem, CleanupPlan, CleanupResult, Fingerprint, HeldByThisProcess, Hold,
                                    Layout, Namespace, NamespaceReport, StepStatus, new_run_token, open_namespace,
                                    plan_cleanup, scan_namespace, stale_temporaries)
from skip_harness.units import human_bytes

logger = logging.getLogger("skip_harness.run.startup")


@dataclass(frozen=True)
class StartupResult:
    """The namespace as found at startup and what was done about it. Holds the lock until released."""

    layout: Layout
    namespace: Namespace = field(repr=False, compare=False)   # opened once for the run: its lock or lease, its writes
    report: NamespaceReport
    cleanup: Optional[CleanupResult]
    cleanup_action: str
    lock: Optional[Hold] = field(default=None, repr=False, compare=False)
    read_only: bool = False
    read_only_reason: str = ""
    shared_with: str = ""     # a reader: the live run that holds the namespace (its holder, described)
    # a reader: whether that run records the namespace (True), only replays it so far (False), or unknown (None)
    shared_records: Optional[bool] = None

    @property
    def reader(self) -> bool:
        """Whether this run reads beside another run that records the namespace (it writes no rollouts
        unless it takes the hold later: docs/design.md, "Many runs on one namespace")."""
        return bool(self.shared_with)

    def release(self) -> None:
        if self.lock is not None:
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
            if s.status == StepStatus.UNVERIFIED:
                out.add(s.step)
            elif s.status == StepStatus.COMPLETE and (fingerprint is None or fingerprint.matches(s.fingerprint)):
                out.add(s.step)
        return frozenset(out)

    def present_steps(self) -> Optional[FrozenSet[int]]:
        """Every step something of it may be found for: an entry the scan found, whatever its status and
        whatever cleanup did with it, or records beside the steps that name it (values, discards, second
        tier). A step outside them has nothing to clear before it is written, as long as this run has
        held the namespace since (`StepRunner`: no listing on the trainer's thread before a miss). None
        when the records cannot be listed: every miss clears its step first."""
        try:
            records = self.namespace.steps_with_records()
        except (OSError, SkipHarnessError):
            return None
        return frozenset(s.step for s in self.report.steps) | frozenset(records)

    def mismatched_steps(self, fingerprint: Fingerprint) -> Tuple[Tuple[int, Fingerprint], ...]:
        return tuple(
            (s.step, s.fingerprint)
            for s in self.report.steps
            if s.status == StepStatus.COMPLETE and s.fingerprint is not None and not fingerprint.matches(s.fingerprint)
        )

    def faults(self) -> Tuple[Tuple[str, str], ...]:
        """(path, reason) of every corrupt step found and every cleanup error: each gets a WARNING."""
        out = [(str(s.path), f"corrupt step: {s.reason}") for s in self.report.steps if s.status == StepStatus.CORRUPT]
        if self.cleanup is not None:
            out += [(str(self.layout.root), f"cleanup failed: {e}") for e in self.cleanup.errors]
        return tuple(out)

    def describe(self) -> str:
        """The one startup line: namespace, complete/unverified steps, what was handled (which, how, bytes)."""
        steps = self.report.steps
        complete = sum(1 for s in steps if s.status == StepStatus.COMPLETE)
        unverified = sum(1 for s in steps if s.status == StepStatus.UNVERIFIED)
        incomplete = [s.step for s in steps if s.status == StepStatus.INCOMPLETE]
        corrupt = [s.step for s in steps if s.status == StepStatus.CORRUPT]
        line = (
            f"rollout cache {self.layout.root}: {complete} complete, {unverified} unverified steps; "
            f"{len(incomplete)} incomplete{_steps(incomplete)}, {len(corrupt)} corrupt{_steps(corrupt)}"
        )
        if self.reader:
            role = {True: "which records it", False: "which replays it (it has recorded no step of it so far)",
                    None: "which holds it"}[self.shared_records]
            return line + (f" -> read beside {self.shared_with}, {role}: committed steps are "
                           "served, nothing is cleaned; a step not committed yet is generated by this run "
                           "and not written, unless the recording ends first (skip.rollout_tq.follow_timeout)")
        if self.read_only:
            use = "compared with what this run generates" if "action=compare" in self.read_only_reason else "served"
            return line + (f" -> read-only ({self.read_only_reason}): complete steps are {use}; nothing is "
                           "locked, cleaned or written")
        if self.cleanup is not None and self.cleanup.items:
            if self.cleanup_action == Cleanup.delete.value:
                line += f" -> deleted {len(self.cleanup.items)} ({human_bytes(self.cleanup.freed_bytes)})"
            else:
                line += (
                    f" -> quarantined {len(self.cleanup.items)} ({human_bytes(self.cleanup.moved_bytes)}) "
                    f"under {self.layout.quarantine_dir}"
                )
        elif incomplete or corrupt:
            line += " -> left in place (skip.rollout_tq.cleanup=off; rewritten when generated)"
        if self.cleanup is not None and self.cleanup.leftovers:
            n = len(self.cleanup.leftovers)
            line += (f"; removed {n} leftover{'s' if n != 1 else ''} of interrupted writes "
                     f"({human_bytes(self.cleanup.leftover_bytes)})")
        return line


def _steps(steps) -> str:
    if not steps:
        return ""
    shown = ", ".join(str(s) for s in steps[:10])
    return f" [{shown}{', ...' if len(steps) > 10 else ''}]"


def prepare_namespace(layout: Layout, settings: RolloutTQConfig, *, timeout: Optional[float] = None,
                      namespace: Optional[Namespace] = None) -> StartupResult:
    """Lock, scan, and clean (per `skip.rollout_tq.cleanup`) one namespace, through its `Namespace` (a
    lock file on POSIX, a lease object on an object store).

    Raises HeldByThisProcess (another harness of this process holds it) and ConfigError for a
    dump_dir that cannot be used at all. A namespace this process may only read (a read-only mount,
    a read-only credential) is scanned only: no lock, no cleanup, no writes. A namespace another live
    run holds (after `lock_timeout` seconds) makes this run a reader: scanned only, its committed
    steps served, nothing cleaned or written (`StartupResult.reader`)."""
    timeout = settings.lock_timeout if timeout is None else timeout
    action = settings.cleanup.value
    try:
        namespace = open_namespace(layout) if namespace is None else namespace
        hold = namespace.lock(timeout)
    except HeldByThisProcess:
        raise
    except LockHeldError as exc:            # another live run holds it: read beside it
        holder = _holder(namespace) or _who(str(exc))
        return StartupResult(layout, namespace, scan_namespace(layout, namespace, rewrite_index=False), None, action,
                             None, True, f"another run holds it: {holder}", holder, _holder_records(namespace))
    except ConfigError:
        raise
    except (SkipHarnessError, OSError) as exc:   # not a directory, no flock there, a link as .lock, ...
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError("skip.rollout_tq.dump_dir", f"cannot use {layout.url} for the rollout cache: {why}") from None
    if hold.read_only:
        why = hold.why or namespace.writable() or "this process may only read it"
        return StartupResult(layout, namespace, scan_namespace(layout, namespace, rewrite_index=False), None, action,
                             None, True, why)
    return _scan_and_clean(layout, namespace, action, hold)


def _holder(namespace: Namespace) -> Optional[str]:
    try:
        return namespace.holder()
    except (SkipHarnessError, OSError):
        return None


def _holder_records(namespace: Namespace) -> Optional[bool]:
    try:
        return namespace.holder_records()
    except (SkipHarnessError, OSError):
        return None


def _who(message: str) -> str:
    """The holder named in a LockHeldError's message (what follows 'in use by' / 'locked by')."""
    for marker in (" in use by ", " locked by "):
        if marker in message:
            return message.split(marker, 1)[1].split(" (", 1)[0].split(";", 1)[0]
    return "another run"


def _scan_and_clean(layout: Layout, namespace: Namespace, action: str, lock: Hold) -> StartupResult:
    """With the namespace held (a file lock or a lease): scan it and handle its incomplete and corrupt
    steps as `skip.rollout_tq.cleanup` says. The hold is released if anything here fails."""
    try:
        report = scan_namespace(layout, namespace)
        cleanup = None
        if action != Cleanup.off.value:
            plan = plan_cleanup(report, action)
            # what killed readers left beside the steps (old enough, its writer gone: never a live one's)
            plan = replace(plan, leftovers=plan.leftovers + stale_temporaries(layout, namespace))
            if plan.items or plan.leftovers:
                cleanup = plan.execute(namespace)
        return StartupResult(layout, namespace, report, cleanup, action, lock)
    except BaseException:
        lock.release()
        raise


def set_aside(layout: Layout, namespace: Namespace, step: int, reason: str, action: str) -> CleanupResult:
    """A step that failed verification at run time, handled as `skip.rollout_tq.cleanup` says before it is
    regenerated: `quarantine` moves it under .quarantine/, otherwise it is removed."""
    how = Cleanup.quarantine.value if action == Cleanup.quarantine.value else Cleanup.delete.value
    item = CleanupItem(step, layout.step_dir(step), StepStatus.CORRUPT, reason, 0, how)
    return CleanupPlan(layout, how, (item,)).execute(namespace)


# ---------------------------------------------------------------------------- a run's startup
@dataclass(frozen=True)
class StartedRun:
    """What every rank knows after the startup: rank 0 also holds the StartupResult (and the lock). Every
    rank has the namespace it opened once (rank 0's is the startup's): its steps are written through it."""

    namespace: Namespace
    startup: Optional[StartupResult]
    servable: FrozenSet[int]
    read_only: bool
    quiet: bool  # the Hydra callback already reported this startup
    faults: Tuple[Tuple[str, str], ...] = ()
    shared_with: str = ""   # a reader: the run that records the namespace (StartupResult.shared_with)
    deferred: bool = False  # replay_from: this run's own namespace not created yet (run.deferred)


def start_namespace(layout: Layout, settings: RolloutTQConfig, fingerprint: Optional[Fingerprint],
                    dist: DistContext, opened_namespace: Optional[Namespace] = None) -> StartedRun:
    """Every rank calls this together: rank 0 takes over the Hydra callback's startup or does its own
    (lock, scan, cleanup), checks the fingerprint and, with W > 1, writes a marker every rank must
    see; the outcome (or rank 0's error, as the same class) reaches every rank. `opened_namespace`: the namespace
    this rank already opened (run.recording.start_run), else it is opened here."""
    startup: Optional[StartupResult] = None
    quiet = False
    faults: Tuple[Tuple[str, str], ...] = ()
    namespace: Optional[Namespace] = None

    def start() -> Tuple[Any, ...]:
        nonlocal startup, quiet, faults, namespace
        try:
            startup = take_over(layout)
            quiet = startup is not None
            if startup is None:
                startup = prepare_namespace(layout, settings, namespace=opened_namespace)
            namespace = startup.namespace
            servable, warning = _servable(startup, fingerprint, settings)
            # taken over from the Hydra callback: it already warned of the faults its startup found (not twice)
            faults = (() if quiet else startup.faults()) + ((warning,) if warning else ())
            token = None
            if dist.world_size > 1 and not startup.read_only:
                token = new_run_token()
                namespace.put_run_marker(token)
            return sorted(servable), startup.read_only, token, startup.shared_with
        except BaseException:
            if startup is not None:
                startup.release()
            raise

    servable, read_only, token, shared_with = dist.from_main(start, "during startup")
    try:
        if namespace is None:                 # the other ranks: their own opening of the namespace rank 0 holds
            namespace = open_namespace(layout) if opened_namespace is None else opened_namespace
        _check_shared(dist, layout, namespace, token)
    except BaseException:
        if startup is not None:
            startup.release()
        raise
    return StartedRun(namespace, startup, frozenset(servable), read_only, quiet, faults, shared_with)


def _servable(startup: StartupResult, fingerprint: Optional[Fingerprint],
              settings: RolloutTQConfig) -> Tuple[FrozenSet[int], Optional[Tuple[str, str]]]:
    """The servable steps for this generator, and the warning to give when others are regenerated."""
    if fingerprint is None:
        return startup.servable_steps(None), None
    mismatched = startup.mismatched_steps(fingerprint)
    if not mismatched:
        return startup.servable_steps(fingerprint), None
    difference = fingerprint.describe_difference(mismatched[0][1])
    if settings.on_mismatch == OnMismatch.error:
        steps = [s for s, _ in mismatched]
        shown = ", ".join(str(s) for s in steps[:8]) + (", ..." if len(steps) > 8 else "")
        raise FingerprintMismatchError(
            f"rollout cache {startup.layout.root}: {len(steps)} committed steps ({shown}) were generated with "
            f"another config: {difference}. Either choose another trainer.experiment_name for this run, or set "
            "skip.rollout_tq.on_mismatch=regenerate to replace those steps as they come."
        )
    warning = (str(startup.layout.root), f"{len(mismatched)} committed steps were generated with another config "
               f"({difference}); they are regenerated as they come (skip.rollout_tq.on_mismatch=regenerate)")
    return startup.servable_steps(fingerprint), warning


def _check_shared(dist: DistContext, layout: Layout, namespace: Namespace, token: Optional[str]) -> None:
    """W > 1: every rank must see the marker rank 0 wrote, or commits would never see every shard (a rank
    that sees it follows rank 0's hold through `namespace`: its writes are fenced by it)."""
    if token is None:
        return
    try:
        sees, why = namespace.sees_run_marker(token, wait=2.0), ""
    except (SkipHarnessError, OSError) as exc:      # said in the stop below, after every rank gathered
        sees, why = False, f" ({exc})"
    seen = dist.gather((sees, socket.gethostname(), why))
    if dist.is_main:
        try:
            namespace.remove_run_marker(token)
        except (SkipHarnessError, OSError) as exc:
            logger.warning("%s: could not remove the run marker: %s", layout.root, exc)
    blind = [f"rank {r} on {host}{why}" for r, (ok, host, why) in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(
            "skip.rollout_tq.dump_dir",
            f"{', '.join(blind)} cannot see the rollout cache that rank 0 writes at {layout.root}: every node "
            "must mount one shared filesystem there (set skip.rollout_tq.dump_dir, or SKIP_HARNESS_DUMP_DIR, "
            "to a path all nodes share), or share an object store instead of a filesystem "
            "(skip.rollout_tq.dump_dir=s3://bucket/prefix, extra [s3]; docs/storage.md), or turn caching off "
            "with skip.rollout_tq.enable=false",
        )


# ---------------------------------------------------------------------------- Hydra hand-over
_HANDED: Dict[str, StartupResult] = {}
_HANDED_GUARD = threading.Lock()


def hand_over(result: StartupResult) -> None:
    """Offer a startup done before the harness exists (the Hydra callback) to the harness of this process."""
    with _HANDED_GUARD:
        _HANDED[str(result.layout.root)] = result


def take_over(layout: Layout) -> Optional[StartupResult]:
    """The startup handed over for `layout`, now owned by the caller (it releases the lock); else None."""
    with _HANDED_GUARD:
        return _HANDED.pop(str(layout.root), None)
