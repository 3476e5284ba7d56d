"""The object a trainer owns: wraps its `prepare_data` and `sample`, caching every mini-batch.

The harness never builds a path or touches a file itself: it asks :mod:`startup` (lock, scan,
cleanup), :mod:`policy` (hit / miss / repeat) and :class:`store.StepStore` (write, commit, verify,
read). Inner indices are counted from the calls the trainer makes, never guessed from the disk.

Writes happen on a background thread (``skip.rollout_tq.async_write``): `sample` hands over an
independent CPU copy of what it returned and goes on. With one process a step is committed by the
writer as soon as its K mini-batches are durable. With W > 1 processes the ranks agree on the commit
at a later decision point (two decision points after the step's last `sample`, or at `close`), so a
commit never waits on a write that the next step's training could have overlapped.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import codec, rng
from .callbacks import CallbackDispatcher, HarnessCallback, LoggingCallback, RunSummary, StepRecord
from .config import Action, RolloutTQConfig, namespace_key_from_config, rollout_tq_from
from .dist import DistContext
from .errors import (
    CorruptStepError,
    FingerprintMismatchError,
    HarnessUsageError,
    LockHeldError,
    SkipHarnessError,
)
from .fingerprint import Fingerprint
from .layout import NamespaceKey
from .policy import HIT, MISS, OFF, REPEAT, Decision, decide
from .startup import StartupResult, prepare_namespace
from .store import FileEntry, StepStore

log = logging.getLogger("skip_harness")


@dataclass
class _StepState:
    """Book-keeping of one step, from its decision to its commit."""

    decision: Decision
    K: int
    epoch: int
    sampled: int = 0
    gen_s: float = 0.0
    load_s: float = 0.0
    bytes: int = 0
    unverified: bool = False
    batches: List[Any] = field(default_factory=list)
    metas: List[Dict[str, Any]] = field(default_factory=list)
    entries: Dict[int, Tuple[FileEntry, ...]] = field(default_factory=dict)
    failed: Optional[str] = None
    completed_epoch: Optional[int] = None
    written: threading.Event = field(default_factory=threading.Event)


class _Writer:
    """One background thread writing queued mini-batches in order."""

    def __init__(self, work: Callable[..., None]):
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._work = work
        self._thread = threading.Thread(target=self._run, name="skip_harness-writer", daemon=True)
        self._thread.start()

    def submit(self, *item: Any) -> None:
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._work(*item)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class SkipHarness:
    """Caches the mini-batches a trainer's `sample` returns, by (step, inner index, rank).

    Typical use::

        harness = SkipHarness.from_config(cfg, fingerprint_keys=[...])
        harness.wrap(trainer)          # trainer.prepare_data / trainer.sample are now cached
        harness.start()                # lock, scan, cleanup, fingerprint check (else: at first call)
        for step in range(1, total + 1):
            trainer.prepare_data(step)  # on a hit: called with dispatch=False (advance data only)
            for _ in range(K):
                batch = trainer.sample(step)
                ...
        harness.close()

    The wrapped methods take the step as their first argument or as ``step=`` (or pass ``step_of``
    to :meth:`wrap`), and ``validate=True`` marks a validation call, which is never cached.
    """

    def __init__(
        self,
        settings: RolloutTQConfig,
        namespace: NamespaceKey,
        *,
        fingerprint: Optional[Fingerprint] = None,
        dist: Optional[DistContext] = None,
        callbacks: Sequence[HarnessCallback] = (),
        log_to: Optional[logging.Logger] = None,
    ):
        self.settings = settings
        self.namespace = namespace
        self.dist = dist or DistContext.current()
        if namespace.W != self.dist.world_size:
            raise HarnessUsageError(
                f"namespace is keyed for W={namespace.W} processes but this run has {self.dist.world_size}"
            )
        self.K = namespace.K
        self.fingerprint = fingerprint
        self.layout = namespace.layout(settings.resolved_dump_dir())
        self.store = StepStore(self.layout)
        self.callbacks = CallbackDispatcher(
            [LoggingCallback(self.dist.rank, self.dist.world_size, log_to), *callbacks]
        )
        self._lock = threading.RLock()
        self._states: Dict[int, _StepState] = {}
        self._open: set = set()  # steps decided but not yet closed (served, committed or abandoned)
        self._outcomes: Dict[int, str] = {}
        self._servable: set = set()
        self._startup: Optional[StartupResult] = None
        self._started = False
        self._closed = False
        self._epoch = 0
        self._writer: Optional[_Writer] = None
        self._wrapped: List[Tuple[Any, str, Any, bool]] = []
        self._dispatch_kwarg = "dispatch"
        self._stats = {"hits": 0, "misses": 0, "repeats": 0, "off": 0, "bytes_read": 0, "bytes_written": 0,
                       "gen_s_spent": 0.0, "gen_s_saved": 0.0, "uncommitted": 0}

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_config(
        cls,
        cfg: Any,
        *,
        fingerprint_keys: Sequence[str] = (),
        callbacks: Sequence[HarnessCallback] = (),
        dist: Optional[DistContext] = None,
    ) -> "SkipHarness":
        """Build from a config with verl's key names (`skip.rollout_tq`, `trainer.*`, `data.*`...)."""
        dist = dist or DistContext.current()
        settings = rollout_tq_from(cfg)
        key = namespace_key_from_config(cfg, dist.world_size)
        fingerprint = Fingerprint.from_config(cfg, fingerprint_keys) if fingerprint_keys else None
        return cls(settings, key, fingerprint=fingerprint, dist=dist, callbacks=callbacks)

    @property
    def enabled(self) -> bool:
        return bool(self.settings.enable)

    # ----------------------------------------------------------------- wrapping
    def wrap(
        self,
        trainer: Any,
        *,
        prepare_data: str = "prepare_data",
        sample: str = "sample",
        step_of: Optional[Callable[[], int]] = None,
        dispatch_kwarg: str = "dispatch",
    ) -> "SkipHarness":
        """Replace `trainer.<prepare_data>` and `trainer.<sample>` with caching wrappers.

        On a hit, the original `prepare_data` is still called (it advances the data stream) but with
        ``<dispatch_kwarg>=False``: it must then start no generation.
        """
        self._dispatch_kwarg = dispatch_kwarg
        for name, make in ((prepare_data, self._wrap_prepare), (sample, self._wrap_sample)):
            original = getattr(trainer, name)
            had_own = name in getattr(trainer, "__dict__", {})
            setattr(trainer, name, make(original, step_of, name))
            self._wrapped.append((trainer, name, original, had_own))
        return self

    def unwrap(self) -> None:
        """Give the trainer its original methods back."""
        while self._wrapped:
            trainer, name, original, had_own = self._wrapped.pop()
            if had_own:
                setattr(trainer, name, original)
            else:
                delattr(trainer, name)

    @staticmethod
    def _call_info(args: tuple, kwargs: dict, step_of: Optional[Callable[[], int]], name: str) -> Tuple[int, bool]:
        validate = bool(kwargs.get("validate", False))
        if step_of is not None:
            step = step_of()
        elif "step" in kwargs:
            step = kwargs["step"]
        elif args:
            step = args[0]
        else:
            raise HarnessUsageError(
                f"{name}() was called without a step: pass the global step as its first argument or step=, "
                "or give wrap(step_of=...)"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            if validate:
                return 0, True
            raise HarnessUsageError(f"{name}(): the step must be an int >= 1, got {step!r}")
        return step, validate

    def _wrap_prepare(self, original: Callable, step_of: Optional[Callable[[], int]], name: str) -> Callable:
        def prepare_data(*args: Any, **kwargs: Any) -> Any:
            step, validate = self._call_info(args, kwargs, step_of, name)
            if validate or not self.enabled:
                return original(*args, **kwargs)
            state = self._state_for(step)
            if state.decision.serves_cache:
                return original(*args, **{**kwargs, self._dispatch_kwarg: False})
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                state.gen_s += time.perf_counter() - t0

        prepare_data.__wrapped__ = original  # type: ignore[attr-defined]
        return prepare_data

    def _wrap_sample(self, original: Callable, step_of: Optional[Callable[[], int]], name: str) -> Callable:
        def sample(*args: Any, **kwargs: Any) -> Any:
            step, validate = self._call_info(args, kwargs, step_of, name)
            if validate or not self.enabled:
                return original(*args, **kwargs)
            self._end_short_steps(before=step)
            state = self._state_for(step)
            kind = state.decision.kind
            if kind == OFF:
                return original(*args, **kwargs)
            inner = state.sampled
            if inner >= self.K:
                raise HarnessUsageError(
                    f"step {step}: sample() called more than K = {self.K} times "
                    "(K is trainer.v1.separate_async.parameter_sync_step in separate_async, else 1)"
                )
            state.sampled += 1
            if state.decision.serves_cache:
                return self._serve(step, inner, state)
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            dt = time.perf_counter() - t0
            spent = dt + (state.gen_s if inner == 0 else 0.0)
            state.gen_s += dt
            self._stash(step, inner, state, out, spent)
            return out

        sample.__wrapped__ = original  # type: ignore[attr-defined]
        return sample

    # ----------------------------------------------------------------- startup
    def start(self) -> None:
        """Lock, scan and clean the namespace (rank 0), check the fingerprint; every rank waits.

        Raises LockHeldError or FingerprintMismatchError on every rank. Idempotent.
        """
        if self._started or not self.enabled:
            return
        outcome: Tuple[Optional[str], Optional[str], List[int]]
        error: Optional[BaseException] = None
        if self.dist.is_main:
            try:
                self._startup = prepare_namespace(self.layout, self.settings)
                outcome = (None, None, sorted(self._check_fingerprint(self._startup)))
            except SkipHarnessError as exc:
                error = exc
                outcome = (type(exc).__name__, str(exc), [])
            except BaseException as exc:  # a bug: make the other ranks stop too, then re-raise
                error = exc
                outcome = ("SkipHarnessError", f"rank 0 failed during startup: {exc!r}", [])
        else:
            outcome = (None, None, [])
        kind, message, servable = self.dist.broadcast(outcome)
        if error is not None:
            raise error
        if kind is not None:
            cls = {"LockHeldError": LockHeldError, "FingerprintMismatchError": FingerprintMismatchError}.get(
                kind, SkipHarnessError
            )
            raise cls(message)
        with self._lock:
            self._servable = set(servable)
        self._started = True
        if self._startup is not None:
            for path, reason in self._startup.faults():
                self.callbacks.on_fault(path=path, reason=reason)
            self.callbacks.on_startup(
                namespace=str(self.layout.root), startup=self._startup, quiet=self._startup.lock_was_held_here
            )

    def _check_fingerprint(self, startup: StartupResult) -> frozenset:
        if self.fingerprint is None:
            return startup.servable_steps(None)
        mismatched = startup.mismatched_steps(self.fingerprint)
        if mismatched and self.settings.on_mismatch.value == "error":
            startup.release()
            self._startup = None
            steps = [s for s, _ in mismatched]
            shown = ", ".join(str(s) for s in steps[:8]) + (", ..." if len(steps) > 8 else "")
            differences = self.fingerprint.describe_difference(mismatched[0][1])
            raise FingerprintMismatchError(
                f"rollout cache {self.layout.root}: {len(steps)} committed steps ({shown}) were generated with "
                f"another config: {differences}. Either choose another trainer.experiment_name for this run, "
                "or set skip.rollout_tq.on_mismatch=regenerate to replace those steps as they come."
            )
        if mismatched:
            log.warning(
                "rollout cache %s: %d committed steps were generated with another config (%s); "
                "they are regenerated as they come (skip.rollout_tq.on_mismatch=regenerate)",
                self.layout.root, len(mismatched), self.fingerprint.describe_difference(mismatched[0][1]),
            )
        return startup.servable_steps(self.fingerprint)

    # ----------------------------------------------------------------- decisions
    def _state_for(self, step: int) -> _StepState:
        state = self._states.get(step)
        if state is None:
            state = self._begin(step)
        return state

    def _begin(self, step: int) -> _StepState:
        """A decision point: every rank calls it for the same steps in the same order."""
        self.start()
        self._epoch += 1
        self._finalize_ready()
        excluded: set = set()
        settled = False
        while True:
            with self._lock:
                servable = frozenset(self._servable - excluded)
            decision = decide(step, self.settings, servable)
            if decision.kind == MISS and self.settings.action == Action.repeat and not settled:
                # `repeat` with nothing to serve yet: let this run's pending commits land first, so
                # the choice never depends on how fast the writer was.
                settled = True
                self.flush()
                self._finalize_ready(everything=True)
                continue
            if not decision.serves_cache:
                break
            ok, loaded = self._load_step(decision.source_step)
            if self.dist.all_true(ok):
                break
            excluded.add(decision.source_step)
            with self._lock:
                self._servable.discard(decision.source_step)
        state = _StepState(decision=decision, K=self.K, epoch=self._epoch)
        if decision.serves_cache:
            state.batches, state.metas, state.unverified, state.load_s, state.bytes = loaded
        elif decision.kind == MISS:
            if self.dist.is_main:
                try:
                    self.store.clear_step(step)
                except OSError as exc:
                    self._fault(str(self.layout.step_dir(step)), f"could not clear the old step: {exc}")
            self.dist.barrier()
        self._states[step] = state
        if decision.kind != OFF:
            with self._lock:
                self._open.add(step)
        self._outcomes[step] = decision.kind
        if decision.kind == OFF:
            self._stats["off"] += 1
        self.callbacks.on_step_start(step=step, decision=decision)
        return state

    def _load_step(self, source: int) -> Tuple[bool, Any]:
        """Verify this rank's files of `source` and load its K mini-batches (memory-mapped)."""
        t0 = time.perf_counter()
        rank = self.dist.rank
        status, reason = self.store.verify_status(source, ranks=[rank])
        path = str(self.layout.step_dir(source))
        if reason is None:
            try:
                batches = self.store.read_step(source, rank)
                metas = [self.store.read_meta(source, i, rank) for i in range(self.K)]
            except (CorruptStepError, OSError, ValueError) as exc:
                reason = str(exc)
        if reason is not None:
            self._fault(path, f"{reason}; step {source} is not served and will be regenerated whole")
            return False, None
        unverified = status == "unverified"
        nbytes = sum(int(m.get("bytes", 0)) for m in metas)
        return True, (batches, metas, unverified, time.perf_counter() - t0, nbytes)

    # ----------------------------------------------------------------- hits
    def _serve(self, step: int, inner: int, state: _StepState) -> Any:
        batch = state.batches[inner]
        state.batches[inner] = None
        meta = state.metas[inner] if inner < len(state.metas) else {}
        if self.settings.restore_rng and isinstance(meta.get("rng"), dict):
            rng.restore(meta["rng"])
        nbytes = int(meta.get("bytes", 0))
        with self._lock:
            self._stats["bytes_read"] += nbytes
            self._stats["gen_s_saved"] += float(meta.get("gen_s", 0.0) or 0.0)
        source = state.decision.source_step
        self.callbacks.on_serve(step=step, inner_index=inner, source_step=source, bytes=nbytes, seconds=0.0)
        if state.sampled == self.K:
            kind = state.decision.kind
            self._stats["hits" if kind == HIT else "repeats"] += 1
            state.metas = []  # keep only the small book-keeping of finished steps
            self._close(step)
            self.callbacks.on_step_end(
                record=StepRecord(step, kind, self.K, source, state.bytes, state.load_s, state.unverified)
            )
        return batch

    # ----------------------------------------------------------------- misses
    def _stash(self, step: int, inner: int, state: _StepState, out: Any, gen_s: float) -> None:
        """Hand an independent copy of `out` to the writer (or write it now)."""
        if state.sampled == self.K:
            state.completed_epoch = self._epoch
        if state.failed:
            return
        try:
            snapshot = codec.snapshot(out)
        except SkipHarnessError as exc:
            self._write_failed(step, inner, state, exc)
            return
        meta: Dict[str, Any] = {"gen_s": round(gen_s, 6)}
        if self.settings.restore_rng:
            meta["rng"] = rng.capture()
        if self.settings.async_write:
            if self._writer is None:
                self._writer = _Writer(self._write)
            self._writer.submit(step, inner, state, snapshot, meta)
        else:
            self._write(step, inner, state, snapshot, meta)

    def _write(self, step: int, inner: int, state: _StepState, payload: Any, meta: Dict[str, Any]) -> None:
        if state.failed:
            return
        t0 = time.perf_counter()
        try:
            entries = self.store.write_inner(step, inner, self.dist.rank, payload, meta)
        except Exception as exc:  # a failed cache write warns and the run goes on
            self._write_failed(step, inner, state, exc)
            return
        seconds = time.perf_counter() - t0
        nbytes = sum(e.bytes for e in entries)
        with self._lock:
            state.entries[inner] = tuple(entries)
            state.bytes += nbytes
            self._stats["bytes_written"] += nbytes
            done = len(state.entries) == self.K
        self.callbacks.on_write(step=step, inner_index=inner, rank=self.dist.rank, bytes=nbytes, seconds=seconds)
        if done:
            state.written.set()
            if self.dist.world_size == 1:
                self._commit(step, state, [e for i in range(self.K) for e in state.entries[i]])

    def _write_failed(self, step: int, inner: int, state: _StepState, exc: BaseException) -> None:
        with self._lock:
            first = state.failed is None
            state.failed = f"{type(exc).__name__}: {exc}"
        state.written.set()
        if first:
            path = str(self.layout.inner_dir(step, inner))
            self._fault(path, f"cache write failed ({state.failed}); step {step} stays uncommitted, training goes on")

    def _commit(self, step: int, state: _StepState, entries: List[FileEntry]) -> bool:
        """Write the commit record (one process, or rank 0); True when it is durable."""
        try:
            self.store.commit(step, entries, self.fingerprint)
        except Exception as exc:
            self._write_failed(step, self.K - 1, state, exc)
            return False
        if self.dist.world_size == 1:
            self._committed(step, state)
        return True

    def _committed(self, step: int, state: _StepState) -> None:
        """Book-keeping once a step is committed; with W > 1 every rank calls it together."""
        with self._lock:
            self._servable.add(step)
            self._stats["misses"] += 1
            self._stats["gen_s_spent"] += state.gen_s
            self._open.discard(step)
        state.entries = {}
        self.callbacks.on_commit(step=step, bytes=state.bytes)
        self.callbacks.on_step_end(record=StepRecord(step, MISS, self.K, None, state.bytes, state.gen_s))

    def _finalize_ready(self, everything: bool = False) -> None:
        """W > 1: commit the steps whose K samples ended two decision points ago (or all, at close).

        Every rank calls this at the same decision points with the same steps, so the collectives
        line up and every rank ends with the same set of servable steps.
        """
        if self.dist.world_size == 1:
            return
        ready = [
            (s, st) for s, st in ((s, self._states[s]) for s in self._open_steps())
            if st.decision.kind == MISS and st.completed_epoch is not None
            and (everything or st.completed_epoch <= self._epoch - 2)
        ]
        for step, state in ready:
            state.written.wait()
            local = None if state.failed else [e for i in range(self.K) for e in state.entries[i]]
            gathered = self.dist.gather(local)
            committed = False
            if all(g is not None for g in gathered):
                if self.dist.is_main:
                    committed = self._commit(step, state, [e for part in gathered for e in part])
                committed = self.dist.broadcast(committed)
            elif state.failed is None:
                self._fault(str(self.layout.step_dir(step)), "another rank failed to write its shard; not committed")
            if committed:
                self._committed(step, state)
            else:
                self._close(step)
                self._stats["uncommitted"] += 1

    def _end_short_steps(self, before: Optional[int] = None) -> None:
        for step in self._open_steps():
            state = self._states[step]
            if before is not None and step >= before:
                continue
            if state.decision.kind == MISS and 0 < state.sampled < self.K:
                self._close(step)
                self._stats["uncommitted"] += 1
                self._fault(
                    str(self.layout.step_dir(step)),
                    f"step ended after {state.sampled} of K = {self.K} sample calls; not committed "
                    "(its files are incomplete and are cleaned at the next startup)",
                )

    def _open_steps(self) -> List[int]:
        """The steps not yet closed, in order (a snapshot: the writer thread closes steps too)."""
        with self._lock:
            return sorted(self._open)

    def _close(self, step: int) -> None:
        with self._lock:
            self._open.discard(step)

    def _fault(self, path: str, reason: str) -> None:
        self.callbacks.on_fault(path=path, reason=reason)

    # ----------------------------------------------------------------- queries
    def outcome(self, step: int) -> str:
        """What was served for `step`: 'hit', 'miss', 'repeat' or 'off'."""
        if not self.enabled:
            return OFF
        return self._outcomes.get(step, OFF)

    def merged(self, step: int) -> Any:
        """The whole committed step: its K mini-batches (this rank's shards) concatenated in order."""
        self.flush()
        return codec.merge(self.store.read_step(step, self.dist.rank))

    def flush(self) -> None:
        """Wait until every queued write is durable (and, with one process, committed)."""
        if self._writer is not None:
            self._writer.flush()

    def summary(self, *, over_ranks: bool = False) -> RunSummary:
        """Counts so far; with `over_ranks` (a collective: every rank must call it) bytes summed over ranks."""
        s = self._stats
        ints = ("hits", "misses", "repeats", "off", "bytes_read", "bytes_written", "uncommitted")
        if over_ranks and self.dist.world_size > 1:
            b = self.dist.sum_floats([float(s["bytes_read"]), float(s["bytes_written"])])
            s = {**s, "bytes_read": b[0], "bytes_written": b[1]}
        return RunSummary(**{k: int(s[k]) for k in ints}, gen_s_spent=s["gen_s_spent"], gen_s_saved=s["gen_s_saved"])

    # ----------------------------------------------------------------- shutdown
    def close(self) -> RunSummary:
        """Finish pending writes and commits, report, release the namespace lock. Idempotent."""
        if self._closed:
            return self.summary()
        self._closed = True
        if not self.enabled or not self._started:
            return self.summary()
        try:
            if self._writer is not None:
                self._writer.flush()
                self._writer.stop()
                self._writer = None
            self._finalize_ready(everything=True)
            self._end_short_steps()
            summary = self.summary(over_ranks=True)
            self.callbacks.on_end(summary=summary)
            return summary
        finally:
            if self._startup is not None:
                self._startup.release()
                self._startup = None

    def __enter__(self) -> "SkipHarness":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
