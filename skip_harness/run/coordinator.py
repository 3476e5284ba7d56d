"""The commit coordinator: the only owner of the writer thread; commits steps; the W > 1 agreement.

:class:`Writer` is one background thread that runs write jobs and nothing else: no callbacks, no
statistics, no log lines. Each job's outcome comes back as a :class:`concurrent.futures.Future`; a
job that raises anything (BaseException included) sets it on its future and the thread goes on.
Pending jobs are bounded (``skip.rollout_tq.max_pending_writes``): at the bound `submit` waits
(back-pressure). `close()` always returns.

:class:`CommitCoordinator` runs on the trainer's thread. It hands mini-batches to the writer, and at
the trainer's calls (`poll`) turns finished writes into commits and finished steps. With one process
a step's commit is queued behind its K writes when its K-th sample comes, and lands as soon as they are
durable. A mini-batch is staged (encoded into its temporary
file) on the trainer's thread; the writer's jobs are the fsync, rename, meta.json and commit record. With W > 1 the ranks agree at decision points: a
step whose K samples ended two decision points ago (or every step, at close) is gathered, rank 0
commits when every rank's shard is durable, and broadcasts whether the commit landed, so every rank
keeps the same set of servable steps.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from skip_harness.run.dist import DistContext
from skip_harness.errors import CacheWritesStopped, CodecError
from skip_harness.store.api import Fingerprint, StepWriter
from skip_harness.run.stats import COMMIT_FAILED, OTHER_RANK_FAILED, PAYLOAD_REFUSED, SHORT_STEP, WRITE_FAILED

_STOP = object()

WRITER_NICE = 10      # the writer thread's niceness above the trainer's (Linux: per thread)


def _lower_priority() -> None:
    """Give the writer thread a lower scheduling priority than the trainer's threads: its narrowing, dedupe
    and zstd then fill the cores' idle moments instead of stalling the trainer's compute threads (whose
    parallel ops wait for their slowest thread). Linux only; elsewhere, or when not allowed, a no-op."""
    if not sys.platform.startswith("linux"):     # elsewhere a thread id is no process id to setpriority
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE)
    except (AttributeError, OSError):
        pass


class Writer:
    """One thread writing jobs in order; a bounded number pending; inline when not `background`."""

    def __init__(self, max_pending: int, background: bool = True):
        self._background = background
        self._slots = threading.BoundedSemaphore(max(1, max_pending))
        self._jobs: "queue.Queue[Any]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, bounded: bool = True) -> Future:
        """Run ``fn(*args)`` on the writer thread; waits while `max_pending` jobs are pending. An unbounded
        job (a commit queued behind its step's writes) takes no slot and never waits: it is small, and the
        trainer's thread that queues it must not wait for the writes it follows."""
        fut: Future = Future()
        if not self._background or self._closed:
            _run(fut, fn, args)
            return fut
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="skip_harness-writer", daemon=True)
            self._thread.start()
        while bounded and not self._slots.acquire(timeout=0.5):  # back-pressure
            if not self._thread.is_alive():  # cannot happen (the loop catches everything); never hang
                _run(fut, fn, args)
                return fut
        self._jobs.put((fut, fn, args, bounded))
        return fut

    def _loop(self) -> None:
        _lower_priority()
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            fut, fn, args, bounded = item
            try:
                _run(fut, fn, args)
            finally:
                if bounded:
                    self._slots.release()

    def close(self, timeout: Optional[float] = None) -> bool:
        """Let queued jobs finish and stop the thread; True if it stopped within `timeout`."""
        self._closed = True
        if self._thread is None:
            return True
        self._jobs.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _not_written(exc: BaseException) -> str:
    """Why a mini-batch's write failed, for its step's line: a payload the codec refuses -- on the trainer's
    thread, or on the writer's where it lays out a compressed form's header -- or the write's own error."""
    if isinstance(exc, CodecError):
        return f"{PAYLOAD_REFUSED}: {exc}"
    return f"{WRITE_FAILED}: {type(exc).__name__}: {exc}"


def _run(fut: Future, fn: Callable[..., Any], args: tuple) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - every failure is the step's, never the thread's
        fut.set_exception(exc)


class _WritesNotDone(Exception):
    """A commit queued behind its step's writes found them not done or failed: it committed nothing."""


def _committed_nothing(commit: Future) -> bool:
    """Whether a queued commit found its writes not done (the poll then queues it again) or failed."""
    return commit.done() and isinstance(commit.exception(), _WritesNotDone)


@dataclass(frozen=True)
class Finished:
    """A miss step the coordinator is done with: committed, or not and why."""

    step: int
    committed: bool
    reason: str
    bytes: int
    created: Optional[float] = None   # a committed step's commit record time (rank 0), its values bind to it
    step_bytes: Optional[int] = None  # a committed step's size (every rank's files and the record), from its commit


@dataclass
class _Pending:
    step: int
    writes: Dict[int, Future] = field(default_factory=dict)
    failed: Optional[str] = None  # first reason this rank could not write the step
    complete_epoch: Optional[int] = None  # decision epoch at which the K-th sample came
    commit: Optional[Future] = None
    gen_s: float = 0.0
    reported: set = field(default_factory=set)  # inner indices whose write was reported


class CommitCoordinator:
    """Turns a miss step's K mini-batches into durable files and one commit record."""

    def __init__(
        self,
        store: StepWriter,
        dist: DistContext,
        fingerprint: Optional[Fingerprint],
        writer: Writer,
        report_fault: Callable[[str, str], None],
        report_write: Callable[..., None] = lambda **kw: None,
    ):
        self.store = store
        self.dist = dist
        self.K = store.layout.K
        self.fingerprint = fingerprint
        self.writer = writer
        self._fault = report_fault
        self._written = report_write
        self._pending: Dict[int, _Pending] = {}
        self._recordings: List[tuple] = []   # (step, future) of values written after their step's commit
        self._said: set = set()               # the recordings a replay's values could not be kept in (said once)

    # ---- the trainer's calls
    def begin(self, step: int) -> None:
        self._pending[step] = _Pending(step)

    def write(self, step: int, inner: int, batch: Any, meta: Dict[str, Any]) -> None:
        """Stage mini-batch `inner` on this (the trainer's) thread — encoding it into its temporary file is
        the one copy a write needs, so the trainer may change the batch afterwards — and let the writer
        make it durable. A payload the codec refuses, or a failed write, leaves the step uncommitted."""
        p = self._pending[step]
        if p.failed is not None:
            return
        try:
            staged = self.store.stage_inner(step, inner, self.dist.rank, batch, meta)
        except Exception as exc:  # a refused payload, ENOSPC, EACCES, EIO...: it warns and training goes on
            self._set_failed(p, _not_written(exc), str(self.store.layout.inner_dir(step, inner)), exc)
            return
        p.writes[inner] = self.writer.submit(_timed, staged.complete)

    def sampled_all(self, step: int, epoch: int, gen_s: float = 0.0) -> None:
        """The step's K-th sample came. With one process its commit is queued at once behind its K writes
        on the writer thread, which commits as soon as they are durable: not at the trainer's next call,
        where it would run beside the next step's generation, and a step is durable sooner."""
        p = self._pending[step]
        p.complete_epoch = epoch
        p.gen_s = gen_s
        if self.dist.world_size == 1 and p.failed is None and len(p.writes) == self.K:
            self._queue_commit(p, bounded=False)

    def abandon(self, step: int, sampled: int) -> Finished:
        """A step that ended after fewer than K sample calls: never committed."""
        p = self._pending.pop(step)
        self._settle_writes(p, wait=True)
        return Finished(step, False, f"{SHORT_STEP}: {sampled} of K = {self.K} sample calls", self._bytes(p))

    def wait_local(self, step: int) -> Optional[str]:
        """Wait until this rank's writes of `step` are durable; the failure reason, if any."""
        p = self._pending.get(step)
        if p is None:
            return None
        self._settle_writes(p, wait=True)
        return p.failed

    def poll(self, epoch: int, *, wait: bool = False, decision_point: bool = False) -> List[Finished]:
        """The steps finished by now. With W > 1 this is a collective: call it on every rank with
        ``decision_point=True`` at the same points (it then agrees on ready steps), or with W = 1 anywhere."""
        if self.dist.world_size == 1:
            return self._poll_local(wait)
        if not decision_point:
            return []
        return self._poll_agreed(epoch, wait)

    @property
    def pending_steps(self) -> List[int]:
        return sorted(self._pending)

    # ---- one process
    def _poll_local(self, wait: bool) -> List[Finished]:
        out = []
        for step in sorted(self._pending):
            p = self._pending[step]
            if p.complete_epoch is None:
                continue
            if not self._settle_writes(p, wait):
                continue  # even a failed step waits for its writes in flight: they count in its bytes
            if p.failed is not None:
                out.append(self._finish(p, False, p.failed))
                continue
            if p.commit is None or _committed_nothing(p.commit):
                self._queue_commit(p)
            if wait:
                _wait(p.commit)
            if p.commit.done():
                out.append(self._commit_outcome(p))
        return out

    def _commit_outcome(self, p: _Pending) -> Finished:
        exc = p.commit.exception() if p.commit is not None else None
        if exc is None:
            record = p.commit.result()
            return self._finish(p, True, "", record.created, record.nbytes)
        reason = f"{COMMIT_FAILED}: {type(exc).__name__}: {exc}"
        if not isinstance(exc, CacheWritesStopped):
            self._fault(str(self.store.layout.step_dir(p.step)), f"{reason}; step {p.step} stays uncommitted, training goes on")
        return self._finish(p, False, reason)

    # ---- several processes
    def _poll_agreed(self, epoch: int, wait: bool) -> List[Finished]:
        ready = [
            p for _, p in sorted(self._pending.items())
            if p.complete_epoch is not None and (wait or p.complete_epoch <= epoch - 2)
        ]
        out = []
        for p in ready:
            self._settle_writes(p, wait=True)
            local = None if p.failed else [e for i in range(self.K) for e in p.writes[i].result()[0]]
            gathered = self.dist.gather(local)
            committed, reason, step_bytes = False, p.failed or OTHER_RANK_FAILED, None
            if all(g is not None for g in gathered):
                created = None
                if self.dist.is_main:
                    p.commit = self.writer.submit(self._commit, p.step, [e for part in gathered for e in part], p.gen_s)
                    _wait(p.commit)
                    exc = p.commit.exception()
                    created = None if exc is not None else p.commit.result().created
                    outcome = (exc is None, "" if exc is None else f"{COMMIT_FAILED}: {type(exc).__name__}: {exc}",
                               None if exc is not None else p.commit.result().nbytes)
                else:
                    outcome = None
                committed, reason, step_bytes = self.dist.broadcast(outcome)
                if not committed and self.dist.is_main and not isinstance(p.commit.exception(), CacheWritesStopped):
                    self._fault(str(self.store.layout.step_dir(p.step)), f"{reason}; step {p.step} stays uncommitted")
            elif p.failed is None:
                self._fault(str(self.store.layout.step_dir(p.step)),
                            f"{OTHER_RANK_FAILED} to write its shard; step {p.step} is not committed")
            out.append(self._finish(p, committed, reason, created if committed else None,
                                    step_bytes if committed else None))
        return out

    # ---- shared
    def _commit(self, step: int, entries: List[Any], gen_s: float) -> Any:
        return self.store.commit(step, entries, self.fingerprint, gen_s=round(gen_s, 6))

    def _queue_commit(self, p: _Pending, bounded: bool = True) -> None:
        """Queue `p`'s commit on the writer thread, behind its K writes (the thread runs jobs in order)."""
        p.commit = self.writer.submit(self._commit_written, p.step, [p.writes[i] for i in range(self.K)], p.gen_s,
                                      bounded=bounded)

    def _commit_written(self, step: int, writes: List[Future], gen_s: float) -> Any:
        """The commit of `writes`, which ran before it on this thread. A write that failed leaves the step
        uncommitted (the trainer's poll reports the write's failure, not this); one not done (its job still
        queued while this ran inline: the writer thread gone, which cannot happen) is committed by the poll."""
        if not all(w.done() and w.exception() is None for w in writes):
            raise _WritesNotDone()
        return self._commit(step, [e for w in writes for e in w.result()[0]], gen_s)

    def _settle_writes(self, p: _Pending, wait: bool) -> bool:
        """True when every submitted write of `p` is done (waiting if asked); records the first failure."""
        for inner in sorted(p.writes):
            fut = p.writes[inner]
            if wait:
                _wait(fut)
            if not fut.done():
                return False
            exc = fut.exception()
            if exc is not None and p.failed is None:
                self._set_failed(p, _not_written(exc), str(self.store.layout.inner_dir(p.step, inner)), exc)
            elif exc is None and inner not in p.reported:
                p.reported.add(inner)
                entries, seconds = fut.result()
                self._written(step=p.step, inner_index=inner, rank=self.dist.rank, bytes=sum(e.bytes for e in entries), seconds=seconds)
        return True

    def _set_failed(self, p: _Pending, reason: str, path: str, exc: Optional[BaseException] = None) -> None:
        if p.failed is None:
            p.failed = reason
            if not isinstance(exc, CacheWritesStopped):   # said once, where the lock was lost
                self._fault(path, f"{reason}; step {p.step} stays uncommitted, training goes on")

    def _finish(self, p: _Pending, committed: bool, reason: str, created: Optional[float] = None,
                step_bytes: Optional[int] = None) -> Finished:
        self._pending.pop(p.step, None)
        return Finished(p.step, committed, reason, self._bytes(p), created, step_bytes)

    # ---- what a committed step produced (store.values): written after its commit, never part of it
    def record_values(self, step: int, values: Dict[str, float], commit_created: float, config: Optional[str],
                      create_only: bool = False, machine: Optional[Dict[str, str]] = None) -> Future:
        """Write a committed step's reported values on the writer thread (queued behind its commit);
        `create_only`: only where the step has none (the future's result says whether they landed);
        `machine`: what computed them (run.machine)."""
        self._check_recordings()
        fut = self.writer.submit(self.store.write_values, step, values, commit_created, config, create_only, machine)
        self._recordings.append((step, fut))
        return fut

    def record_discards(self, step: int, discarded: Any, commit_created: float, create_only: bool = True) -> Future:
        """Write what a filter discarded from a committed step (store.discards) on the writer thread,
        queued behind its commit, as its values are."""
        self._check_recordings()
        fut = self.writer.submit(self.store.write_discards, step, discarded, commit_created, create_only)
        self._recordings.append((("discarded", step), fut))
        return fut

    def record_run_values(self, run_id: str, step: int, values: Dict[str, float], config: Optional[str],
                          into: Any = None, machine: Optional[Dict[str, str]] = None) -> None:
        """Write a replay's values for `step` under its run id, on the writer thread (`into`: the StepWriter of
        the namespace they are kept in -- the recording a replay_from run replays; this run's by default)."""
        self._check_recordings()
        store = self.store if into is None else into
        mark = step if into is None else f"replay:{into.layout.root}"    # kept in another namespace: said once
        self._recordings.append((mark, self.writer.submit(store.write_run_values, run_id, step, values, config, machine)))

    def record_run_drift(self, run_id: str, step: int, K: int, W: int, firsts: Dict[str, Optional[int]],
                         into: Any = None) -> None:
        """Write an `action=compare` run's per-trajectory drift for `step` under its run id, on the writer thread."""
        store = self.store if into is None else into
        mark = step if into is None else f"replay:{into.layout.root}"
        self._recordings.append((mark, self.writer.submit(store.write_run_drift, run_id, step, K, W, firsts)))

    def record_run(self, run_id: str, doc: Dict[str, Any], into: Any = None) -> None:
        """Write a replay's own document (when, where, its config digest), on the writer thread."""
        store = self.store if into is None else into
        mark = None if into is None else f"replay:{into.layout.root}"
        self._recordings.append((mark, self.writer.submit(store.write_run, run_id, doc)))

    def record_config(self, digest: str, flat: Dict[str, Any]) -> None:
        """Write the run's training-side config (flattened) on the writer thread."""
        self._recordings.append((None, self.writer.submit(self.store.write_training_config, digest, flat)))

    def _check_recordings(self, wait: bool = False) -> None:
        """Report (warn) a values write that failed: the step stays complete, only unchecked later."""
        keep = []
        for step, fut in self._recordings:
            if wait:
                _wait(fut)
            if not fut.done():
                keep.append((step, fut))
                continue
            exc = fut.exception()
            if exc is not None and isinstance(step, str):      # a replay's values in the recording it replays
                if step not in self._said:
                    self._said.add(step)
                    self._fault(step.split(":", 1)[1], f"this replay's values could not be kept beside the "
                                f"recording's: {type(exc).__name__}: {exc}; they are not kept")
            elif exc is not None and not isinstance(exc, CacheWritesStopped):   # a lost lock is said once
                kind, step = ("discarded groups", step[1]) if isinstance(step, tuple) else ("values", step)
                where = self.store.layout.root if step is None else self.store.layout.step_dir(step)
                what = "the training-side config" if step is None else f"step {step}'s {kind}"
                self._fault(str(where), f"could not record {what}: {type(exc).__name__}: {exc}; "
                            "the step stays complete, a replay leaves it unchecked")
        self._recordings = keep

    @staticmethod
    def _bytes(p: _Pending) -> int:
        """Bytes this rank wrote for the step: its mini-batches' files, payload and meta.json (the
        harness counts a committed step by its size on disk, as `skip-harness ls` does)."""
        total = 0
        for fut in p.writes.values():
            if fut.done() and fut.exception() is None:
                total += sum(e.bytes for e in fut.result()[0])
        return total

    def close(self, timeout: Optional[float] = 600.0) -> bool:
        stopped = self.writer.close(timeout)
        if stopped:
            self._check_recordings(wait=True)
        return stopped


def _timed(fn: Callable[..., Any], *args: Any) -> tuple:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def _wait(fut: Future) -> None:
    try:
        fut.exception()  # blocks until done; never raises the job's exception here
    except BaseException:  # noqa: BLE001 - cancelled: nothing to wait for
        pass

