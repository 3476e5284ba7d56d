"""Where a served step comes from: a :class:`StepSource`.

Two kinds: this run's own namespace (:class:`OwnSteps`, a hit read as it was written) and a recording of
the same batch at any K and W (`run.recording.Recording`: `skip.rollout_tq.replay_from`, a namespace or a
pack file, re-chunked and re-sharded). :class:`StepSources` holds the run's own and, with replay_from,
the recording, and says which one serves a step: its own first. The step runner (`run.steps`) asks it for
the servable steps, loads through it, and drops a step that failed to load; it never asks which kind it is.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, FrozenSet, List, Optional, Set

from skip_harness.errors import HarnessUsageError
from skip_harness.run.prefetch import Loaded, load_step
from skip_harness.store.api import StepStore


class StepSource(ABC):
    """Steps this rank can be served: which (`steps`, a belief a load confirms), and each one loaded."""

    #: a step of it that fails verification is set aside (skip.rollout_tq.cleanup) before it is regenerated;
    #: a recording is read only: nothing of it is set aside
    sets_aside: bool = False

    def __init__(self, steps: Set[int]):
        self.steps = set(steps)

    @abstractmethod
    def load(self, step: int) -> Loaded:
        """This rank's K mini-batches of `step`, verified; never raises for a bad step (`Loaded.reason`)."""

    def batches(self, step: int) -> List[Any]:
        """This rank's K mini-batches of `step` read again (`SkipHarness.merged`); HarnessUsageError when they
        cannot be."""
        loaded = self.load(step)
        if not loaded.ok:
            raise HarnessUsageError(f"step {step}: it cannot be read again: {loaded.reason}")
        return loaded.batches


class OwnSteps(StepSource):
    """This run's own namespace: its committed steps (those it commits join), read as they were written."""

    sets_aside = True

    def __init__(self, store: StepStore, rank: int, steps: Set[int]):
        super().__init__(steps)
        self.store = store
        self.rank = rank

    def load(self, step: int) -> Loaded:
        return load_step(self.store, step, self.rank)

    def batches(self, step: int) -> List[Any]:
        return self.store.reader.read_step(step, self.rank)


class StepSources:
    """This run's own steps, then the recording's (replay_from) where its own lack a step."""

    def __init__(self, own: OwnSteps, recording: Optional[StepSource] = None):
        self.own = own
        self.recording = recording

    @property
    def servable(self) -> FrozenSet[int]:
        """Every step one of them can serve."""
        return frozenset(self.own.steps | (self.recording.steps if self.recording is not None else set()))

    def of(self, step: int) -> StepSource:
        """The source that serves `step`: the run's own when it holds it or there is no recording."""
        if self.recording is not None and step not in self.own.steps and step in self.recording.steps:
            return self.recording
        return self.own

    def load(self, step: int) -> Loaded:
        return self.of(step).load(step)

    def add(self, step: int) -> None:
        """`step` was committed in the run's own namespace (by this run, or by the run it reads beside)."""
        self.own.steps.add(step)

    def drop(self, step: int) -> None:
        """`step` could not be loaded on some rank: served by neither from now on."""
        self.own.steps.discard(step)
        if self.recording is not None:
            self.recording.steps.discard(step)


__all__ = ["OwnSteps", "StepSource", "StepSources"]
