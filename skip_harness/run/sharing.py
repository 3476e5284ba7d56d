"""A run that reads beside the run that records its namespace (docs/design.md, "Many runs on one namespace").

One writer, many readers: the run that holds the namespace (its flock, or its lease on an object store)
records it; a run that found it held by a live run is a reader. A reader serves every committed step,
cleans nothing and writes no rollouts. For a step not committed yet, :meth:`Follower.resolve` (rank 0
looks, every rank gets the answer) says what the reader does:

- `COMMITTED`: the step was committed since the startup (the recorder got there first): serve it;
- `HOLDER`: the recording ended and this run took the hold (one process only, W = 1): from now on it
  records its misses itself, as the holder;
- `OWN`: the recorder still holds the namespace: this run generates the step and trains on its own
  rollouts, writing none of them (its step line says so).

It waits up to `skip.rollout_tq.follow_timeout` seconds for a step to be committed before it answers
`OWN` (a replay following a recording that is still running).
"""
from __future__ import annotations

import time
from typing import Any, Optional

from skip_harness.config import RolloutTQConfig
from skip_harness.errors import LockHeldError, SkipHarnessError
from skip_harness.run.dist import DistContext
from skip_harness.run.stats import OWN_ROLLOUTS
from skip_harness.store.api import Fingerprint, Hold, StepStatus

COMMITTED, HOLDER, OWN = "committed", "holder", "own"
_POLL_S = 0.2


class Follower:
    """What a reader does about a step the recorder has not committed (trainer's thread only)."""

    def __init__(self, store: Any, settings: RolloutTQConfig, fingerprint: Optional[Fingerprint],
                 dist: DistContext, holder: str):
        self.store = store
        self.settings = settings
        self.fingerprint = fingerprint
        self.dist = dist
        self.holder = holder
        self.hold: Optional[Hold] = None

    @property
    def holds(self) -> bool:
        """Whether this run took the hold (the recording ended): it is the recorder now."""
        return self.hold is not None

    def resolve(self, step: int) -> str:
        """COMMITTED, HOLDER or OWN for `step` (a collective with W > 1: every rank calls it)."""
        answer = self._look(step) if self.dist.is_main else None
        return self.dist.broadcast(answer)

    def _look(self, step: int) -> str:
        if self.holds:
            return HOLDER
        deadline = time.monotonic() + float(self.settings.follow_timeout)
        while True:
            if self._committed(step):
                return COMMITTED
            if self.dist.world_size == 1 and self._take():
                return COMMITTED if self._committed(step) else HOLDER
            left = deadline - time.monotonic()
            if left <= 0:
                return OWN
            time.sleep(min(_POLL_S, left))

    def _committed(self, step: int) -> bool:
        try:
            report = self.store.status(step)
        except (SkipHarnessError, OSError):      # out of reach: not known to be committed
            return False
        if report.status != StepStatus.COMPLETE:
            return False
        return self.fingerprint is None or self.fingerprint.matches(report.fingerprint)

    def _take(self) -> bool:
        """Take the hold if the recorder let it go (never waits): a writer of misses from now on."""
        try:
            hold = self.store.namespace.lock(0.0)
        except LockHeldError:
            return False
        except (SkipHarnessError, OSError):
            return False
        if hold.read_only:
            hold.release()
            return False
        self.hold = hold
        return True

    def not_written(self) -> str:
        """Why a step this run generated was not written (its step line)."""
        return f"{OWN_ROLLOUTS}: {self.holder} records this namespace; this run trains on its own rollouts"

    def took_hold(self, step: int) -> str:
        """What is said once this run took the hold, at `step`."""
        return (f"rollout cache {self.store.layout.root}: the run that recorded it ({self.holder}) ended; this run "
                f"holds it now and records the steps it generates, from step {step}")

    def release(self) -> None:
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.release()


__all__ = ["COMMITTED", "HOLDER", "OWN", "Follower"]
