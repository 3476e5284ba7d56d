"""A `replay_from` run's own namespace, created only when the run must write a step.

A run served from another recording (`skip.rollout_tq.replay_from`) is a replay of it: it reads the
recording, and its values are kept beside the recording's, under its run id
(`{recording}/.values/runs/{run_id}/`, where `skip-harness ls` counts the recording's replays). Its own
namespace (this run's K and W) is needed only for a step the recording lacks: when that namespace does not
exist at startup, nothing is created then (no directory, no `.lock`, no index). At its first such step the
run creates it and takes its hold (:class:`Deferred`, a :class:`~skip_harness.run.sharing.Follower` whose
"recorder" is nobody yet) and commits what it generates there, as any holder does. With several ranks
(W > 1), or when another live run took that namespace first, the step is generated and trained on, not
written (its step line says why). A namespace that already exists is started as always (lock, scan, clean).

:func:`start_run` is the startup of every run: the recording is resolved and checked first, before anything
is created; then this run's own namespace is started, or deferred.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

from skip_harness.config import REPLAY_FROM_KEY, Action, Cleanup, RolloutTQConfig
from skip_harness.errors import SkipHarnessError
from skip_harness.run.dist import DistContext
from skip_harness.run.sharing import HOLDER, OWN, Follower
from skip_harness.run.source import Source, batch_fingerprint, start_source
from skip_harness.run.startup import StartedRun, StartupResult, _rebuild, start_namespace
from skip_harness.run.stats import OWN_ROLLOUTS
from skip_harness.store.api import Fingerprint, Layout, Namespace, NamespaceKey, open_namespace, scan_namespace

log = logging.getLogger("skip_harness")


def exists(ns: Namespace) -> bool:
    """Whether anything of the namespace is there (a directory, a `.lock`, an object under its prefix)."""
    try:
        return bool(ns.list_dir(""))
    except (OSError, SkipHarnessError):
        return False


def start_run(layout: Layout, settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
              dist: DistContext) -> Tuple[StartedRun, Optional[Source]]:
    """Every rank calls it together: the recording `replay_from` names (checked before anything is
    created), then this run's own namespace started -- or, when it is served from a recording and its own
    namespace does not exist, deferred (`StartedRun.deferred`: nothing created, read-only until a miss)."""
    comparing = settings.action == Action.compare
    if settings.replay_from is None and not comparing:
        return start_namespace(layout, settings, fingerprint, dist), None
    own = open_namespace(layout)               # opened only: nothing is created by opening
    if comparing:
        return _start_compare(layout, settings, key, fingerprint, dist, own)
    source = start_source(settings, key, fingerprint, layout, own, dist)
    if source is not None and not dist.broadcast(exists(own) if dist.is_main else None):
        if dist.is_main:
            kept = ("a pack file is read only: its values are not kept" if source.layout.packed else
                    "its values are kept there, under its run id")
            log.info("rollout cache %s: not created (this run replays %s; %s); created when the run generates a "
                     "step the recording lacks", layout.root, source.layout.url, kept)
        return StartedRun(own, None, frozenset(), True, False, deferred=True), source
    return start_namespace(layout, settings, fingerprint, dist, own), source


COMPARE_READ = "read by skip.rollout_tq.action=compare"


def _start_compare(layout: Layout, settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
                   dist: DistContext, own: Namespace) -> Tuple[StartedRun, Optional[Source]]:
    """`action=compare` (run.drift): the recording -- this run's namespace, or `replay_from`'s -- is read only:
    no lock, no cleanup, nothing created. Every complete step is compared, whatever generator made it: a
    changed generation fingerprint is what this mode measures, not an error (the log says what differs)."""
    if settings.replay_from is not None:
        source = start_source(settings, key, None, layout, own, dist)   # None: any generator
        if source is not None:
            if dist.is_main:
                _say_generator(source.layout.url, batch_fingerprint(fingerprint),
                               [source.store.reader.read_commit(s) for s in sorted(source.servable)[:1]])
            return StartedRun(own, None, frozenset(), True, False), source
    outcome: Any = None
    startup: Optional[StartupResult] = None
    if dist.is_main:
        try:
            startup = StartupResult(layout, own, scan_namespace(layout, own, rewrite_index=False), None,
                                    Cleanup.off.value, None, True, COMPARE_READ)
            servable = sorted(startup.servable_steps(None))
            outcome = ("ok", servable)
            mismatched = startup.mismatched_steps(fingerprint) if fingerprint is not None else ()
            if mismatched:
                log.info("action=compare: %d of the recording's %d steps were generated with another generation "
                         "config (%s): the drift this run measures", len(mismatched), len(servable),
                         fingerprint.describe_difference(mismatched[0][1]))   # type: ignore[union-attr]
            if not servable:
                log.warning("action=compare: %s holds no complete step: nothing to compare with, every step is "
                            "generated and not written", layout.root)
        except SkipHarnessError as exc:
            outcome = ("error", type(exc).__name__, getattr(exc, "key", None), str(exc))
    outcome = dist.broadcast(outcome)
    if outcome[0] == "error":
        raise _rebuild(*outcome[1:])
    return StartedRun(own, startup, frozenset(outcome[1]), True, False), None


def _say_generator(url: str, fingerprint: Optional[Fingerprint], records: Any) -> None:
    """action=compare from another recording: what differs in its generation config (INFO), if anything."""
    recorded = next((r.fingerprint for r in records if r is not None and r.fingerprint is not None), None)
    if fingerprint is not None and recorded is not None and not fingerprint.matches(recorded):
        log.info("action=compare: %s was generated with another generation config (%s): the drift this run "
                 "measures", url, fingerprint.describe_difference(recorded))


class Deferred(Follower):
    """A `replay_from` run whose own namespace was not created: at its first miss it creates it and takes
    its hold (one process only: W = 1); else the step is its own rollouts, not written."""

    def __init__(self, store: Any, settings: RolloutTQConfig, fingerprint: Optional[Fingerprint],
                 dist: DistContext, source: Source):
        super().__init__(store, settings, fingerprint, dist, holder="")
        self.source = source
        self.why = ""

    def _look(self, step: int) -> str:
        if self.holds:
            return HOLDER
        if self.dist.world_size > 1:
            self.why = (f"{OWN_ROLLOUTS}: the recording ({self.source.layout.url}) lacks the step and this run's "
                        f"own namespace is created by one process only ({self.dist.world_size} ranks); "
                        f"record it with a run without {REPLAY_FROM_KEY}")
            return OWN
        answer = super()._look(step)
        if answer == OWN and not self.why:
            self.why = f"{OWN_ROLLOUTS}: {self.holder or 'another run'} records {self.store.layout.root}"
        return answer

    def _take(self) -> bool:
        taken = super()._take()
        if not taken:
            self.holder = self._described_holder()
        return taken

    def _described_holder(self) -> str:
        try:
            return self.store.backend.holder() or "another run"
        except (SkipHarnessError, OSError):
            return "another run"

    def not_written(self) -> str:
        return self.why or f"{OWN_ROLLOUTS}: {self.store.layout.root} could not be created"

    def took_hold(self, step: int) -> str:
        return (f"rollout cache {self.store.layout.root}: created at step {step}, a step the recording "
                f"({self.source.layout.url}) lacks; this run records the steps it generates there")


__all__ = ["Deferred", "exists", "start_run"]
