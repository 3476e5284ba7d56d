"""Loading a step to serve, now or one step ahead in the background.

:func:`load_step` classifies a step once (its listing and commit record: `StepStore.status`), then
verifies this rank's files of it (sizes and checksums against the commit record) and loads its K
mini-batches, reading each file once (`StepReader.read_served`). What the trainer's thread reports
for a served step -- its size on disk among it -- comes with the load, so serving a hit asks the
storage nothing more. :class:`Prefetcher` runs it for the next hit step on one reader thread while
the trainer trains on the current one — bounded to one step ahead, cancelled at close. It only
reads; what it found is reported on the trainer's thread.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from skip_harness.codec import UnregisteredTypeError
from skip_harness.errors import SkipHarnessError
from skip_harness.store.api import StepStatus, StepStore


@dataclass(frozen=True)
class Loaded:
    """A step read for serving: its K mini-batches and metas, or why it cannot be served."""

    step: int
    batches: List[Any] = field(default_factory=list)
    metas: List[Dict[str, Any]] = field(default_factory=list)
    unverified: bool = False
    seconds: float = 0.0
    reason: Optional[str] = None
    unavailable: bool = False     # the storage could not be reached: a miss, but nothing wrong with the step
    step_bytes: Optional[int] = None  # every file of the step and its commit record, as classified (`ls`'s size)
    regrouped: str = ""           # served from another recording: `re-chunked from K=4 to K=2`, ... (run.recording)

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def bytes(self) -> int:
        return sum(int(m.get("bytes", 0) or 0) for m in self.metas)

    @property
    def gen_s(self) -> float:
        return sum(float(m.get("gen_s", 0.0) or 0.0) for m in self.metas)


def load_step(store: StepStore, step: int, rank: int) -> Loaded:
    """Verify and load this rank's K mini-batches of `step`; never raises for a bad step or a storage
    out of reach (an object store down: `unavailable`, the step is not blamed). A step holding a type
    this process has not registered is not bad: UnregisteredTypeError propagates (a usage error)."""
    t0 = time.perf_counter()
    step_bytes = None
    try:
        report = store.status(step)
        step_bytes = report.bytes
        status, reason, batches, metas = store.reader.read_served(step, rank, report=report)
    except UnregisteredTypeError:
        raise
    except (OSError, ValueError) as exc:
        status, reason = StepStatus.CORRUPT, str(exc)
    except SkipHarnessError as exc:     # e.g. ObjectStoreUnavailable, ObjectAccessDenied
        return Loaded(step, seconds=time.perf_counter() - t0, reason=f"cannot be read now: {exc}", unavailable=True)
    if reason is not None:
        return Loaded(step, seconds=time.perf_counter() - t0, reason=reason, step_bytes=step_bytes)
    return Loaded(step, batches, metas, status == StepStatus.UNVERIFIED, time.perf_counter() - t0, step_bytes=step_bytes)


class Prefetcher:
    """At most one step loaded ahead, on one reader thread."""

    def __init__(self, store: StepStore, rank: int, enabled: bool = True):
        self.store = store
        self.rank = rank
        self.enabled = enabled
        self._pool: Optional[ThreadPoolExecutor] = None
        self._ahead: Optional[tuple] = None  # (step, Future[Loaded])
        self._load: Callable[[int], Loaded] = lambda step: load_step(self.store, step, self.rank)

    def route(self, load: Callable[[int], Loaded]) -> None:
        """Load steps with `load(step)` instead (`run.step_source.StepSources.load`: its own, or a recording's)."""
        self._load = load

    def start(self, step: int) -> None:
        """Begin loading `step` in the background (replaces any other step loaded ahead)."""
        if not self.enabled or (self._ahead is not None and self._ahead[0] == step):
            return
        self.cancel()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skip_harness-prefetch")
        self._ahead = (step, self._pool.submit(self._load, step))

    def take(self, step: int) -> Loaded:
        """`step` loaded: the background result when it was loaded ahead, else loaded now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            fut: Future = ahead[1]
            try:
                return fut.result()
            except UnregisteredTypeError:
                raise
            except Exception as exc:  # a bug in loading: treat the step as not servable
                return Loaded(step, reason=f"prefetch failed: {type(exc).__name__}: {exc}")
        if ahead is not None:
            ahead[1].cancel()
        return self._load(step)

    def cancel(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].cancel()

    def close(self) -> None:
        """Cancel what is loaded ahead and stop the reader thread (waits for a load in progress)."""
        self.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
