"""A `replay_from` run's own namespace, created only when the run must write a step.

A run served from another recording (`skip.rollout_tq.replay_from`, `run.recording`) is a replay of it: it
reads the recording, and its values are kept beside the recording's, under its run id
(`{recording}/.values/runs/{run_id}/`, where `skip-harness ls` counts the recording's replays). Its own
namespace (this run's K and W) is needed only for a step the recording lacks: when that namespace does not
exist at startup, nothing is created then (no directory, no `.lock`, no index; `run.recording.start_run`
decides). At its first such step the run creates it and takes its hold (:class:`Deferred`, a
:class:`~skip_harness.run.sharing.Follower` whose "recorder" is nobody yet) and commits what it generates
there, as any holder does. With several ranks (W > 1), or when another live run took that namespace first,
the step is generated and trained on, not written (its step line says why).
"""
from __future__ import annotations

from typing import Any, Optional

from skip_harness.config import REPLAY_FROM_KEY, RolloutTQConfig
from skip_harness.errors import SkipHarnessError
from skip_harness.run.dist import DistContext
from skip_harness.run.sharing import HOLDER, OWN, Follower
from skip_harness.run.stats import OWN_ROLLOUTS
from skip_harness.store.api import Fingerprint


class Deferred(Follower):
    """A `replay_from` run whose own namespace was not created: at its first miss it creates it and takes
    its hold (one process only: W = 1); else the step is its own rollouts, not written."""

    def __init__(self, store: Any, settings: RolloutTQConfig, fingerprint: Optional[Fingerprint],
                 dist: DistContext, recording_url: str):
        super().__init__(store, settings, fingerprint, dist, holder="")
        self.recording_url = recording_url
        self.why = ""

    def _look(self, step: int) -> str:
        if self.holds:
            return HOLDER
        if self.dist.world_size > 1:
            self.why = (f"{OWN_ROLLOUTS}: the recording ({self.recording_url}) lacks the step and this run's "
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
            return self.store.namespace.holder() or "another run"
        except (SkipHarnessError, OSError):
            return "another run"

    def not_written(self) -> str:
        return self.why or f"{OWN_ROLLOUTS}: {self.store.layout.root} could not be created"

    def took_hold(self, step: int) -> str:
        return (f"rollout cache {self.store.layout.root}: created at step {step}, a step the recording "
                f"({self.recording_url}) lacks; this run records the steps it generates there")


__all__ = ["Deferred"]
