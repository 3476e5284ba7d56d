"""The per-step decision and serving: what the harness does inside a wrapped call.

:class:`StepRunner` decides each step once (a decision point: every rank reaches the same ones in the
same order), serves hits from the cache, hands misses to the :class:`CommitCoordinator`, and turns
what finished into one :class:`StepRecord` per step, reported in step order on the trainer's thread.
Inner indices are counted from the calls the trainer makes, never guessed from the disk.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from skip_harness import codec
from skip_harness.run import rng
from skip_harness.run.callbacks import CallbackDispatcher
from skip_harness.config import Action, Cleanup, RolloutTQConfig
from skip_harness.run.coordinator import CommitCoordinator, Finished
from skip_harness.run.dist import DistContext
from skip_harness.run.drift import Drift, DriftTotals, combined, compare_batches
from skip_harness.errors import CacheWritesStopped, HarnessUsageError, SkipHarnessError
from skip_harness.run.decision import Decision, decide
from skip_harness.run.prefetch import Loaded, Prefetcher
from skip_harness.run.startup import set_aside
from skip_harness.run.sharing import COMMITTED, Follower
from skip_harness.run.step_source import StepSources
from skip_harness.run.stats import COMPARED, HIT, MISS, OFF, READ_ONLY, Outcome, RunStats, StepRecord
from skip_harness.store.api import StepStore

log = logging.getLogger("skip_harness")


@dataclass
class _StepState:
    decision: Decision
    sampled: int = 0
    gen_s: float = 0.0
    loaded: Optional[Loaded] = None
    batches: List[Any] = field(default_factory=list)
    regenerated: bool = False
    finished: bool = False
    unwritten: int = 0  # a read-only cache: bytes generated that would have been written
    served_from: str = ""  # served from another recording (replay_from): how it was regrouped
    recorded: Optional[Loaded] = None   # action=compare: the recording's mini-batches of the step
    drifts: List[Optional[Drift]] = field(default_factory=list)   # action=compare: each mini-batch's
    drift: Optional[Drift] = None       # action=compare: the step's, every rank's summed


class StepRunner:
    """Decides, serves and accounts for the steps of one run (trainer's thread only)."""

    def __init__(
        self,
        settings: RolloutTQConfig,
        store: StepStore,
        dist: DistContext,
        coordinator: CommitCoordinator,
        prefetcher: Prefetcher,
        callbacks: CallbackDispatcher,
        sources: StepSources,
        *,
        read_only: bool = False,
        call_digest: Optional[Callable[[tuple, dict], str]] = None,
        on_committed: Optional[Callable[[int, Optional[float]], None]] = None,
        follower: Optional[Follower] = None,
        on_compared: Optional[Callable[[int, Drift], None]] = None,
        present_at_start: Optional[FrozenSet[int]] = None,
    ):
        self.settings = settings
        self.comparing = settings.action == Action.compare   # generate every step, compare, write nothing
        self.on_compared = on_compared
        self.drift_totals = DriftTotals()
        self.store = store
        self.dist = dist
        self.K = store.layout.K
        self.coordinator = coordinator
        self.prefetcher = prefetcher
        self.callbacks = callbacks
        self.sources = sources            # this run's own steps (committed ones join), then a recording's
        prefetcher.route(sources.load)
        self.read_only = read_only
        self.call_digest = call_digest
        self.on_committed = on_committed
        self.follower = follower      # a reader: what to do about a step the recorder has not committed
        self.stats = RunStats()
        self.outcomes: Dict[int, Outcome] = {}
        self._states: Dict[int, _StepState] = {}
        self._order: List[int] = []  # decided steps whose record is not reported yet, in order
        self._records: Dict[int, StepRecord] = {}
        self._epoch = 0
        self._failed: Dict[int, str] = {}  # steps that failed verification: why (rank 0 sets them aside)
        # rank 0 of a run that holds the namespace since its startup scan: the steps that may have an entry
        # or records (found then, or written since); a miss of any other step has nothing to clear (None:
        # unknown)
        self._may_exist: Optional[Set[int]] = None if present_at_start is None else set(present_at_start)

    # ------------------------------------------------------------------ wrapped calls
    def prepare(self, step: int, run: Callable[[], Any], run_on_hit: Optional[Callable[[], Any]]) -> Any:
        """A wrapped `prepare_data`: on a hit `run_on_hit` (data only, no dispatch), else `run`."""
        self._collect(self.coordinator.poll(self._epoch))
        state = self._state_for(step)
        if state.decision.serves_cache:
            return run_on_hit() if run_on_hit is not None else None
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            if state.decision.kind == MISS:
                state.gen_s += time.perf_counter() - t0

    def sample(self, step: int, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        """A wrapped `sample`: the i-th call of a step serves or generates mini-batch i."""
        self._end_short_steps(before=step)
        self._collect(self.coordinator.poll(self._epoch))
        state = self._state_for(step)
        if state.decision.kind == OFF:
            return run()
        inner = state.sampled
        if inner >= self.K:
            raise HarnessUsageError(
                f"step {step}: sample() called more than K = {self.K} times "
                "(K is trainer.v1.separate_async.parameter_sync_step in separate_async, else 1)"
            )
        state.sampled += 1
        if state.decision.serves_cache:
            if state.decision.kind == HIT and self.call_digest is not None and not self._inputs_match(state, inner, args, kwargs):
                self._regenerate_from(step, inner, state)
            else:
                return self._serve(step, inner, state)
        return self._generate(step, inner, state, run, args, kwargs)

    # ------------------------------------------------------------------ decisions
    def _state_for(self, step: int) -> _StepState:
        state = self._states.get(step)
        return state if state is not None else self._begin(step)

    def _begin(self, step: int) -> _StepState:
        """A decision point: every rank calls it for the same steps in the same order."""
        self._epoch += 1
        self._collect(self.coordinator.poll(self._epoch, decision_point=True))
        decision, loaded = self._decide(step)
        state = _StepState(decision)
        self._states[step] = state
        self._order.append(step)
        self.outcomes[step] = decision.kind
        if loaded is not None:
            state.loaded = loaded
            state.batches = list(loaded.batches)
            state.served_from = loaded.regrouped
        elif decision.kind == MISS:
            self._start_miss(step)
        self.callbacks.on_step_start(step=step, decision=decision)
        if decision.kind == OFF:
            self._finish(step, StepRecord(step, OFF, self.K, reason=decision.reason))
        self._prefetch_after(step)
        return state

    def _decide(self, step: int) -> Tuple[Decision, Optional[Loaded]]:
        """Hit or repeat (with the step served, loaded on every rank), miss or off: the same on every rank,
        whose collectives run in the same order everywhere. Before a miss, each wait that may make a step
        servable runs once: a reader follows its recorder; `repeat` lets this run's pending commits land
        (the choice never depends on how fast the writer was). A step some rank could not load is dropped."""
        waits = [w for w, wanted in ((self._follow, self.follower is not None),
                                     (self._settle, self.settings.action == Action.repeat)) if wanted]
        dropped: Set[int] = set()
        while True:
            decision = decide(step, self.settings, self.sources.servable - dropped)
            if decision.kind == MISS and waits:
                waits.pop(0)(step)
            elif not decision.serves_cache:
                return decision, None
            else:
                loaded = self.prefetcher.take(decision.source_step)
                if self._loaded_everywhere(decision.source_step, loaded):
                    return decision, loaded
                dropped.add(decision.source_step)

    def _loaded_everywhere(self, step: int, loaded: Loaded) -> bool:
        """Whether every rank loaded `step` (a collective); if not, it is dropped from what is served, and
        set aside by rank 0 (whichever rank found the fault) as skip.rollout_tq.cleanup says, unless it is
        the recording's (read only) or its storage was out of reach (no fault of the step: a plain miss)."""
        if self.dist.all_true(loaded.ok):
            return True
        if not loaded.ok:
            self._fault(str(self.store.layout.step_dir(step)),
                        f"{loaded.reason}; step {step} is not served and is regenerated whole")
        found = self.dist.gather(None if loaded.ok else (loaded.reason, loaded.unavailable))
        faults = [f[0] for f in found if f is not None and not f[1]]
        if faults and self.sources.of(step).sets_aside:
            self._failed[step] = faults[0]
        self.sources.drop(step)
        return False

    def _settle(self, step: int) -> None:
        self._collect(self.coordinator.poll(self._epoch, wait=True, decision_point=True))

    def _follow(self, step: int) -> bool:
        """A reader's miss: True when the step was committed since (serve it). A reader that took the
        hold (the recording ended) writes its misses from now on."""
        answer = self.follower.resolve(step)
        if self.follower.holds and self.read_only:
            self.read_only = False
            if self.dist.is_main:
                log.info("%s", self.follower.took_hold(step))
        if answer == COMMITTED:
            self.sources.add(step)
            return True
        return False

    def _not_written(self) -> str:
        if self.follower is not None:
            return self.follower.not_written()
        return COMPARED if self.comparing else READ_ONLY

    def _start_miss(self, step: int) -> None:
        if self.read_only:
            return
        if self.dist.is_main:
            failed = self._failed.pop(step, None)
            try:
                if failed is not None and self.settings.cleanup == Cleanup.quarantine:
                    # a step that failed verification is handled as skip.rollout_tq.cleanup says
                    for error in set_aside(self.store.layout, self.store.namespace, step, failed, Cleanup.quarantine.value).errors:
                        self._fault(str(self.store.layout.step_dir(step)), f"could not quarantine the step: {error}")
                if self._may_exist is None or step in self._may_exist:
                    self.store.writer.clear_step(step)
                if self._may_exist is not None:
                    self._may_exist.add(step)      # written from now on: a later miss of it clears it
            except CacheWritesStopped:
                pass        # the run lost its lock: said once; its writes of this step fail the same way
            except (OSError, SkipHarnessError) as exc:   # an object store out of reach: warn, go on
                self._fault(str(self.store.layout.step_dir(step)), f"could not clear the old step: {exc}")
        self.dist.barrier()
        self.sources.drop(step)
        self.coordinator.begin(step)

    def served_batches(self, step: int) -> List[Any]:
        """This rank's mini-batches of a served `step`, read again from where they were served."""
        state = self._states[step]
        source_step = state.decision.source_step
        assert source_step is not None
        source = self.sources.recording if self.served_from_source(step) else self.sources.own
        assert source is not None
        return source.batches(source_step)

    def served_from_source(self, step: int) -> bool:
        """Whether `step` was served from the recording (replay_from) in this run."""
        state = self._states.get(step)
        return state is not None and state.decision.serves_cache and state.served_from != ""

    def _prefetch_after(self, step: int) -> None:
        nxt = decide(step + 1, self.settings, self.sources.servable)
        if nxt.serves_cache and nxt.source_step not in self._states:
            self.prefetcher.start(nxt.source_step)

    # ------------------------------------------------------------------ hits
    def _serve(self, step: int, inner: int, state: _StepState) -> Any:
        loaded = state.loaded
        batch = state.batches[inner]
        if self.call_digest is None:
            state.batches[inner] = None  # the trainer holds it now; keep nothing
        meta = loaded.metas[inner]
        if self.settings.restore_rng and state.decision.kind == HIT and isinstance(meta.get("rng"), dict):
            rng.restore(meta["rng"])  # never for `repeat`: another step's state would rewind the RNG
        self.callbacks.on_serve(step=step, inner_index=inner, source_step=state.decision.source_step,
                                bytes=int(meta.get("bytes", 0) or 0), seconds=0.0)
        if state.sampled == self.K:
            self._finish(step, _served_record(step, state, self.K, self._served_bytes(state)))
        return batch

    def _inputs_match(self, state: _StepState, inner: int, args: tuple, kwargs: dict) -> bool:
        recorded = state.loaded.metas[inner].get("call_digest")
        return self.dist.all_true(recorded is None or recorded == self.call_digest(args, kwargs))

    def _regenerate_from(self, step: int, inner: int, state: _StepState) -> None:
        """A hit whose inputs differ from the recorded ones at call `inner`: the step becomes a miss;
        the mini-batches already served are written again as they were, the rest is generated."""
        self._fault(str(self.store.layout.step_dir(step)),
                    f"step {step}: the inputs of sample call {inner} differ from the recorded ones; "
                    "regenerating the step (its cache is replaced)")
        served, metas = state.batches[:inner], state.loaded.metas[:inner]
        state.decision = Decision(MISS, step, reason="inputs differ from the recorded ones")
        state.regenerated = True
        self.outcomes[step] = MISS
        self._start_miss(step)
        for i, (batch, meta) in enumerate(zip(served, metas)):
            keep: Dict[str, Any] = {k: meta[k] for k in ("gen_s", "call_digest", "rng") if k in meta}
            self._stash(step, i, batch, keep)
        state.batches = []

    # ------------------------------------------------------------------ misses
    def _generate(self, step: int, inner: int, state: _StepState, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        t0 = time.perf_counter()
        out = run()
        dt = time.perf_counter() - t0
        spent = dt + (state.gen_s if inner == 0 else 0.0)  # prepare_data's dispatch belongs to batch 0
        state.gen_s += dt
        meta: Dict[str, Any] = {"gen_s": round(spent, 6)}
        if self.call_digest is not None:
            meta["call_digest"] = self.call_digest(args, kwargs)
        if self.settings.restore_rng:
            meta["rng"] = rng.capture()
        if self.comparing:
            self._compare(step, inner, state, out)
        self._stash(step, inner, out, meta)
        if state.sampled == self.K:
            if self.read_only:
                self._finish(step, _miss_record(step, state, self.K, Finished(step, False, self._not_written(), state.unwritten)))
            else:
                self.coordinator.sampled_all(step, self._epoch, state.gen_s)
                self._collect(self.coordinator.poll(self._epoch))
        return out

    def _compare(self, step: int, inner: int, state: _StepState, out: Any) -> None:
        """action=compare: mini-batch `inner` as generated against the recording's (run.drift); once the
        step's K are in, every rank's figures summed (a collective with W > 1), reported to `on_compared`."""
        if inner == 0 and step in self.sources.servable:
            state.recorded = self.sources.load(step)
        loaded = state.recorded
        if step not in self.sources.servable:
            drift = Drift(unpaired=f"the recording has no complete step {step}")
        elif loaded is None or not loaded.ok:
            drift = Drift(unpaired=f"the recorded step cannot be read: {loaded.reason if loaded else 'not loaded'}")
        else:
            try:
                drift = compare_batches(out, loaded.batches[inner])
            except Exception as exc:  # noqa: BLE001 - a batch of an unforeseen shape: said, never fatal
                drift = Drift(unpaired=f"the mini-batches could not be compared: {exc!r}")
        state.drifts.append(drift)
        if state.sampled == self.K:
            state.recorded = None
            state.drift = combined(self.dist.gather(combined(state.drifts)))
            self.drift_totals.add(state.drift)
            if self.on_compared is not None:
                self.on_compared(step, state.drift)

    def _stash(self, step: int, inner: int, out: Any, meta: Dict[str, Any]) -> None:
        """Hand `out` to the coordinator: what sample returned, as it is now (it is encoded into its
        file before this returns, so later in-place changes by the trainer never reach the cache)."""
        if not self.read_only:
            self.coordinator.write(step, inner, out, meta)
            return
        try:  # nothing is written, but the step's line still counts what was generated
            self._states[step].unwritten += codec.plan(out).nbytes
        except Exception:  # noqa: BLE001 - a payload the codec refuses: it would not have been written either
            pass

    def _collect(self, finished: List[Finished]) -> None:
        for done in finished:
            if done.committed:        # its size as committed (no listing on the trainer's thread), as `ls` shows it
                done = dataclasses.replace(done, bytes=done.step_bytes if done.step_bytes else self._step_bytes(done.step))
                self.sources.add(done.step)
                self.callbacks.on_commit(step=done.step, bytes=done.bytes)
                if self.on_committed is not None:
                    self.on_committed(done.step, done.created)
            self._finish(done.step, _miss_record(done.step, self._states[done.step], self.K, done))

    def _end_short_steps(self, before: Optional[int] = None) -> None:
        for step in list(self._order):
            state = self._states[step]
            if state.finished or (before is not None and step >= before) or state.sampled >= self.K:
                continue
            if before is not None and state.sampled == 0:
                continue  # decided by prepare_data, not sampled yet (colocate_async dispatches ahead)
            if state.decision.kind == MISS:
                if self.read_only:
                    done = Finished(step, False, self._not_written(), state.unwritten)
                else:
                    done = self.coordinator.abandon(step, state.sampled)
                    self._fault(str(self.store.layout.step_dir(step)),
                                f"step ended after {state.sampled} of K = {self.K} sample calls; not committed "
                                "(its files are incomplete and are cleaned at the next startup)")
                self._finish(step, _miss_record(step, state, self.K, done))
            elif state.decision.serves_cache:
                self._finish(step, _served_record(step, state, self.K, self._served_bytes(state)))

    # ------------------------------------------------------------------ reporting
    def _finish(self, step: int, record: StepRecord) -> None:
        state = self._states[step]
        if state.finished:
            return
        state.finished = True
        state.batches, state.loaded = [], None
        self._records[step] = record
        while self._order and self._order[0] in self._records:
            rec = self._records.pop(self._order.pop(0))
            self.stats.add(rec)
            self.callbacks.on_step_end(record=rec)

    def _served_bytes(self, state: _StepState) -> int:
        """The size on disk of the step a hit or repeat served, as its load classified it (no second
        listing on the trainer's thread)."""
        loaded = state.loaded
        if loaded is not None and loaded.step_bytes is not None:
            return loaded.step_bytes
        return self._step_bytes(state.decision.source_step)

    def _step_bytes(self, step: int) -> int:
        """A committed step's size on disk: every rank's files and its commit record, the size
        `skip-harness ls` shows for it (per-step lines and the summary count steps this way)."""
        try:
            return self.store.status(step).bytes
        except (OSError, SkipHarnessError):      # an object store out of reach: the size is unknown
            return 0

    def _fault(self, path: str, reason: str) -> None:
        self.callbacks.on_fault(path=path, reason=reason)

    def compared_line(self) -> str:
        """action=compare: `rollouts compared: X of Y trajectories identical (N steps)`; '' otherwise."""
        return self.drift_totals.describe() if self.comparing else ""

    def flush_local(self, step: int) -> Optional[str]:
        return self.coordinator.wait_local(step)

    def settle(self) -> None:
        """W = 1: wait until every fully sampled miss step is durable and committed, and report it."""
        if self.dist.world_size == 1:
            self._collect(self.coordinator.poll(self._epoch, wait=True))

    def finish(self) -> None:
        """At close: every remaining step finished and reported (a collective with W > 1)."""
        self._end_short_steps()
        self._collect(self.coordinator.poll(self._epoch, wait=True, decision_point=True))
        self._end_short_steps()


def _served_record(step: int, state: _StepState, K: int, nbytes: int) -> StepRecord:
    loaded = state.loaded
    served = loaded.metas[: state.sampled]
    return StepRecord(
        step, state.decision.kind, K, state.decision.source_step,
        bytes=nbytes, load_s=loaded.seconds,
        saved_s=sum(float(m.get("gen_s", 0.0) or 0.0) for m in served), unverified=loaded.unverified,
        served_from=state.served_from,
    )


def _miss_record(step: int, state: _StepState, K: int, done: Finished) -> StepRecord:
    return StepRecord(step, MISS, K, bytes=done.bytes, gen_s=state.gen_s, committed=done.committed,
                      reason=done.reason, regenerated=state.regenerated,
                      compared=state.drift.describe() if state.drift is not None else "")
