"""The object a trainer owns: `SkipHarness` caches the mini-batches its `sample` returns.

Its parts: `run.hooks.MethodHooks` wraps the trainer's methods (reversibly), `run.steps.StepRunner` decides
and serves each step, `run.coordinator.CommitCoordinator` owns the writer thread and the commits,
`run.stats.RunStats` keeps the run's records. This module builds them, runs the startup (lock, scan,
cleanup, fingerprint and shared-filesystem checks) and shuts them down; construction only validates."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

from skip_harness import codec
from skip_harness.run.callbacks import CallbackDispatcher, HarnessCallback, LoggingCallback
from skip_harness.run.coordinator import CommitCoordinator, Writer
from skip_harness.run.dist import DistContext
from skip_harness.errors import HarnessUsageError
from skip_harness.store.api import (BufferPool, Fingerprint, Layout, NamespaceKey, StepStore, TierStore,
                                    flatten_config, new_run_id)
from skip_harness.run.hooks import CallReader, MethodHooks, hit_prepare
from skip_harness.run.prefetch import Prefetcher
from skip_harness.run.replay_check import DiscardReporting, ValuesTracker
from skip_harness.run.sharing import Follower
from skip_harness.run.deferred import Deferred
from skip_harness.run.recording import Recording, start_run
from skip_harness.run.startup import StartedRun, StartupResult
from skip_harness.run.step_source import OwnSteps, StepSources
from skip_harness.run.settings import RunSettings, from_parts, from_verl_keys, take, with_fingerprint_keys
from skip_harness.run.stats import HIT, MISS, OFF, REPEAT, Outcome, RunStats, RunSummary
from skip_harness.run.steps import StepRunner
from skip_harness.run.tier import TierPhases
from skip_harness.run.verdict import ReplayReportWriter
from skip_harness.run.weights import weight_digests

_DEFAULT = object()


class SkipHarness(DiscardReporting):   # discard(): run.discards
    """Caches the mini-batches a trainer's `sample` returns, by (step, inner index, rank).

    Typical use::

        harness = SkipHarness.create(settings={"enable": True}, namespace={"experiment_name": "e",
                                     "project_name": "p", "K": 2}, fingerprint={"temperature": 1.0})
        harness.wrap(trainer)      # trainer.prepare_data / trainer.sample are now cached
        for step in range(1, total + 1):
            trainer.prepare_data(step)   # on a hit: called with dispatch=False (advance data only)
            for _ in range(K):
                batch = trainer.sample(step)
        harness.close()            # finish writes and commits, report, release the lock, unwrap
    """

    def __init__(
        self,
        settings: RunSettings,
        *,
        callbacks: Sequence[HarnessCallback] = (),
        dist: Optional[DistContext] = None,
    ):
        """`settings`: the run's settings, resolved once by a front end's adapter (`run.settings`):
        `create` and `from_config` build them for you."""
        if not isinstance(settings, RunSettings):
            raise HarnessUsageError(f"SkipHarness(settings): a RunSettings, got {type(settings).__name__}; build it "
                                    "with SkipHarness.create(...) / from_config(cfg) or skip_harness.run.settings")
        self.run_settings = settings
        self.settings = settings.rollout
        self.fingerprint = settings.fingerprint
        self.K = settings.K
        self._key = settings.namespace
        self._user_callbacks = list(callbacks)
        self._dist = dist
        self._check_world_size: Optional[Callable[[int], None]] = settings.check_world_size
        self._hooks = MethodHooks()
        self._call_digest: Optional[Callable[[tuple, dict], str]] = None
        self._started = self._closed = False
        self._startup: Optional[StartupResult] = None
        self._runner: Optional[StepRunner] = None
        self._coordinator: Optional[CommitCoordinator] = None
        self._prefetcher: Optional[Prefetcher] = None
        self._values: Optional[ValuesTracker] = None
        self._follower: Optional[Follower] = None
        self._tier: Optional[TierPhases] = None
        self._training_config = settings.training_config
        self.callbacks = CallbackDispatcher(self._user_callbacks)

    # ----------------------------------------------------------------- construction
    @classmethod
    def create(
        cls,
        settings: Any = None,
        *,
        namespace: Union[Mapping[str, Any], NamespaceKey],
        fingerprint: Union[Mapping[str, Any], Fingerprint, None] = None,
        callbacks: Sequence[HarnessCallback] = (),
        dist: Optional[DistContext] = None,
        training_config: Any = None,
        w_invariant: bool = False,
    ) -> "SkipHarness":
        """For any trainer: `settings` are `skip.rollout_tq`'s keys (a dict, an OmegaConf node, a
        RolloutTQConfig or None), `namespace` names the cache directly (experiment_name, project_name,
        K and whichever of train_batch_size, n, max_prompt_length, max_response_length the trainer
        has), `fingerprint` the values that shape the rollouts apart from the learned weights, and
        `training_config` the rest (learning rate, loss, ...: a nested mapping, recorded flattened, so
        that a replay's divergence names what changed). `w_invariant`: your training values are the same,
        to float rounding, on any number of ranks sharing a mini-batch (means over the whole mini-batch
        across ranks); then a replay at another W compares them with the recording's within rounding noise,
        else with a baseline replay at that W, as at another K (docs/replay_check.md)."""
        return cls(from_parts(settings, namespace=namespace, fingerprint=fingerprint, training_config=training_config,
                              w_invariant=w_invariant), callbacks=callbacks, dist=dist)

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        *,
        fingerprint_keys: Sequence[str] = (),
        callbacks: Sequence[HarnessCallback] = (),
        dist: Optional[DistContext] = None,
        w_invariant: Optional[bool] = None,
    ) -> "SkipHarness":
        """From a whole config with verl's key names (`skip.rollout_tq`, `trainer.*`, `data.*`, ...):
        a dict, an OmegaConf node or a dataclass. A fingerprint key not in the config is a ConfigError.
        Under the Hydra callback the settings it resolved for this config are taken, not resolved again.
        `w_invariant`: as for :meth:`create` (None: what the settings handed over say, else False)."""
        run = take(cfg)   # integrations/hydra.py's on_job_start hands over what it resolved from this config
        if run is None or run.fingerprint is not None or run.training_config is None:
            return cls(from_verl_keys(cfg, fingerprint_keys=fingerprint_keys, w_invariant=bool(w_invariant)),
                       callbacks=callbacks, dist=dist)
        run = with_fingerprint_keys(run, cfg, fingerprint_keys)
        if w_invariant is not None:       # else kept as the settings handed over say
            run = dataclasses.replace(run, w_invariant=w_invariant)
        return cls(run, callbacks=callbacks, dist=dist)

    @property
    def enabled(self) -> bool:
        return bool(self.settings.enable)

    @property
    def layout(self) -> Layout:
        """Where this run's cache lives (known once started: W comes from the process group)."""
        if self._runner is None:
            raise HarnessUsageError("harness.layout is known after start() (the world size comes from the process group)")
        return self._runner.store.layout

    # ----------------------------------------------------------------- wrapping
    def wrap(
        self,
        trainer: Any,
        *,
        sample: str = "sample",
        prepare_data: Any = _DEFAULT,
        dispatch_kwarg: Optional[str] = "dispatch",
        on_hit_prepare: Union[str, Callable[..., Any], None] = None,
        step_of: Optional[Callable[[], Any]] = None,
        first_step: int = 1,
        is_validation: Optional[Callable[[tuple, dict], bool]] = None,
        call_digest: Optional[Callable[[tuple, dict], str]] = None,
    ) -> "SkipHarness":
        """Wrap `trainer.<sample>` (and `trainer.<prepare_data>` when it has one) with caching.

        On a hit, `prepare_data` still runs to advance the data stream: with ``<dispatch_kwarg>=False``
        (it must then start no generation), or `on_hit_prepare` (a method name or callable taking the
        same arguments) instead, or not at all with ``dispatch_kwarg=None``. `call_digest(args,
        kwargs)` digests a sample call's inputs: a hit whose inputs differ is regenerated."""
        if self._closed:
            raise HarnessUsageError("wrap(): this harness is closed; build a new one")
        if self._hooks.installed:
            raise HarnessUsageError("wrap(): this harness already wraps a trainer; call unwrap() first")
        name = prepare_data if prepare_data is not _DEFAULT else "prepare_data"
        wants_prepare = prepare_data is not None and (prepare_data is not _DEFAULT or hasattr(trainer, name))
        if wants_prepare:
            on_hit = hit_prepare(trainer, name, dispatch_kwarg, on_hit_prepare)
            reader = CallReader(name, step_of, first_step, is_validation)
            self._hooks.install(trainer, name, lambda orig: self._prepare_wrapper(orig, reader, on_hit))
        reader = CallReader(sample, step_of, first_step, is_validation)
        try:
            self._hooks.install(trainer, sample, lambda orig: self._sample_wrapper(orig, reader))
        except BaseException:
            self._hooks.remove()
            raise
        self._call_digest = call_digest
        return self

    def _active(self, reader: CallReader, args: tuple, kwargs: dict) -> Optional[int]:
        """The step of a call the harness handles, or None when the trainer's own code should run."""
        if self._closed or not self.enabled or reader.validation(args, kwargs):
            return None
        step = reader.step(args, kwargs)
        self.start()
        return step

    def _prepare_wrapper(self, original: Callable, reader: CallReader, on_hit: Optional[Callable]) -> Callable:
        def prepare_data(*args: Any, **kwargs: Any) -> Any:
            step = self._active(reader, args, kwargs)
            if step is None:
                return original(*args, **kwargs)
            hit = None if on_hit is None else (lambda: on_hit(original, args, kwargs))
            return self._runner.prepare(step, lambda: original(*args, **kwargs), hit)

        return prepare_data

    def _sample_wrapper(self, original: Callable, reader: CallReader) -> Callable:
        def sample(*args: Any, **kwargs: Any) -> Any:
            step = self._active(reader, args, kwargs)
            if step is None:
                return original(*args, **kwargs)
            return self._runner.sample(step, lambda: original(*args, **kwargs), args, kwargs)

        return sample

    def unwrap(self) -> None:
        """Give the trainer its original methods back (close() does it too)."""
        self._hooks.remove()

    # ----------------------------------------------------------------- startup
    def start(self) -> None:
        """Lock, scan and clean the namespace (rank 0), check the fingerprint and that every rank sees
        the same cache; every rank waits. Raises the same error on every rank. Idempotent."""
        if self._started or not self.enabled:
            return
        if self._closed:
            raise HarnessUsageError("start(): this harness is closed")
        dist = self._dist or DistContext.current()
        if self._check_world_size is not None:
            self._check_world_size(dist.world_size)
        layout = self._key.with_world_size(dist.world_size).layout(self.settings.resolved_dump_dir())
        report = ReplayReportWriter.from_env(self.settings, dist.is_main, lambda: self.run_id, lambda: self._training_config)
        self.callbacks = CallbackDispatcher([LoggingCallback(dist.rank, dist.world_size), *report, *self._user_callbacks])
        # the recording (replay_from) is checked before anything is created; a replay's own namespace waits
        run, recording = start_run(layout, self.settings, self._key.with_world_size(dist.world_size), self.fingerprint,
                                   dist)
        self._startup = run.startup
        self._build(dist, layout, run, recording)
        self._started = True
        if recording is None and not run.servable:
            self._note_recording()   # nothing to replay here: it generates (and records) from its first step
        if run.startup is not None:
            for path, reason in run.faults:
                self.callbacks.on_fault(path=path, reason=reason)
            self.callbacks.on_startup(namespace=str(layout.root), startup=run.startup, quiet=run.quiet)

    def _build(self, dist: DistContext, layout: Layout, run: StartedRun, recording: Optional[Recording]) -> None:
        read_only, shared_with, deferred = run.read_only, run.shared_with, run.deferred
        # Idle buffers worth keeping: a step's K once the trainer lets go of them (the next prefetch
        # takes them), and one per pending write plus the one being staged.
        comparing = self.settings.action == "compare"     # action=compare: values kept, nothing recorded (run.drift)
        pool = BufferPool(max_free=layout.K + self.settings.max_pending_writes + 1)
        store = StepStore(layout, run.namespace, pool=pool,
                          form=codec.stored_form(self.settings.compression, self.settings.compression_level))
        writer = Writer(self.settings.max_pending_writes, background=self.settings.async_write)
        on_write = self.callbacks.on_write

        def wrote(**kwargs: Any) -> None:
            self._note_recording()
            on_write(**kwargs)

        self._coordinator = CommitCoordinator(store.writer, dist, self.fingerprint, writer, self._fault,
                                              report_write=wrote)
        self._prefetcher = Prefetcher(store, dist.rank, enabled=self.settings.prefetch)
        # a reader writes no rollouts, but its values (small JSON files beside the steps: store.values)
        self._values = ValuesTracker(self.settings, store.reader, self._coordinator, self.callbacks,
                                     dist.is_main and (not read_only or bool(shared_with) or deferred or comparing),
                                     self._training_config, self.run_settings.w_invariant,
                                     self.run_settings.workers_from_config)
        self._values.run_id = new_run_id() if dist.is_main else None   # a replay's values go under it
        self._follower = (Deferred(store, self.settings, self.fingerprint, dist, recording.layout.url)
                          if deferred and recording else
                          Follower(store, self.settings, self.fingerprint, dist, shared_with) if shared_with else None)
        follower = self._follower
        if follower is not None and not isinstance(follower, Deferred):   # once it took the hold: what a killed recorder left out
            self._values.holds = lambda: follower.holds
        # like its values, a reader may store a step's second tier where none was stored for its key
        self._tier = TierPhases(bool(self.settings.tier), TierStore(store.namespace), store.reader, dist.rank,
                                self.outcome, self.callbacks, self._fault,
                                writable=not read_only or bool(shared_with) or deferred)
        values, tier = self._values, self._tier

        def committed(step: int, created: Optional[float]) -> None:
            values.committed(step, created)
            tier.committed(step, created)

        self._runner = StepRunner(
            self.settings, store, dist, self._coordinator, self._prefetcher, self.callbacks,
            StepSources(OwnSteps(store, dist.rank, set(run.servable)), recording),
            read_only=read_only, call_digest=self._call_digest, on_committed=committed,
            follower=self._follower,
            # the steps a miss must clear first: known only to a run that holds the namespace from its scan
            present_at_start=(run.startup.present_steps() if run.startup is not None and not read_only
                              and not shared_with and not deferred else None),
            on_compared=lambda step, drift: values.compared(step, drift.values()),
        )
        if recording is not None:
            self._values.serve_from(recording, layout.K, dist.world_size, self._runner.served_from_source, deferred)

    def _note_recording(self) -> None:
        """This run writes steps of its namespace: its holder record says it records it, not only replays
        it (what a run reading beside it is told at startup)."""
        for hold in (self._startup.lock if self._startup is not None else None,
                     self._follower.hold if self._follower is not None else None):
            if hold is not None:
                hold.note_recording()

    def _fault(self, path: str, reason: str) -> None:
        self.callbacks.on_fault(path=path, reason=reason)

    def _release_startup(self) -> None:
        if self._follower is not None:
            self._follower.release()      # a reader that took the hold when the recording ended
        startup, self._startup = self._startup, None
        if startup is not None:
            startup.release()

    # ----------------------------------------------------------------- queries
    @property
    def run_id(self) -> Optional[str]:
        """This run's id (rank 0, once started): its values are kept under `.values/runs/{run_id}/`."""
        return None if self._values is None else self._values.run_id

    def outcome(self, step: int) -> Outcome:
        """What was served for `step`: Outcome.HIT, MISS, REPEAT or OFF (a str enum: equal to 'hit', 'miss',
        'repeat', 'off')."""
        if self._runner is None:
            return OFF
        return self._runner.outcomes.get(step, OFF)

    def merged(self, step: int) -> Any:
        """The whole step as this rank saw it: its K mini-batches (this rank's shards) concatenated in order."""
        kind = self.outcome(step)
        if kind in (HIT, REPEAT):
            return codec.merge(self._runner.served_batches(step))
        if kind == MISS:
            failed = self._runner.flush_local(step)
            if failed:
                raise HarnessUsageError(f"step {step} was not cached: {failed}")
            return codec.merge(self._runner.sources.own.batches(step))
        raise HarnessUsageError(f"step {step} was not cached (caching was off for it)")

    def flush(self) -> None:
        """Wait until this rank's queued writes are durable."""
        if self._coordinator is not None:
            for step in self._coordinator.pending_steps:
                self._coordinator.wait_local(step)

    def commit_finished(self) -> None:
        """One process (W = 1): wait until every step whose K mini-batches were all sampled is committed
        (its commit record durable and its step reported), for a trainer that may end the process right
        after (no close()). With W > 1 steps are committed at the ranks' next common decision point."""
        if self._runner is not None:
            self._runner.settle()

    def summary(self) -> RunSummary:
        """The run's counts so far (this rank's records); `.replay_line`: did the served steps reproduce?"""
        summary = (self._runner.stats if self._runner is not None else RunStats()).summary()
        if self._values is not None:
            summary = dataclasses.replace(summary, replay=self._values.report())
        if self._tier is not None and self._tier.times:
            summary = dataclasses.replace(summary, phases=self._tier.summary())
        if self._runner is not None:
            summary = dataclasses.replace(summary, namespace=str(self._runner.store.layout.root))
            summary = dataclasses.replace(summary, compared=self._runner.compared_line())   # action=compare
        return summary

    # ----------------------------------------------------------------- the second tier
    def phase(self, name: str, step: int, compute: Callable[[], Any], *, key: Mapping[str, Any],
              index: Optional[int] = None) -> Any:
        """Run `compute()` -- a phase computed from `step`'s rollouts by a part training does not change
        (`"reward"`, `"reference"`, or a name of yours) -- or serve what it returned when the step was
        recorded. `key` is the phase's validity key, {component: value} (`{"reward function
        digit_reward": <digest of its source>}`): on a step served from the cache, values stored under
        the same key are verified and returned and `compute` is not called; otherwise `compute` runs
        and, for a generated step (after its commit) or a served step without them, its values are
        stored (tensors, containers, scalars: the payload kinds). `index` numbers the step's calls of
        this phase (by default in call order: 0, 1, ...). With `skip.rollout_tq.tier=false`, caching
        off, before start or after close, `compute` just runs. Call it after the step's `sample`
        calls (the step must be decided). docs/api.md#the-second-tier."""
        if self._tier is None or self._closed or not self.enabled:
            return compute()
        return self._tier.run(str(name), operator.index(step), compute, key, index)

    # ----------------------------------------------------------------- what each step produced
    def observe(self, step: int, /, **values: Any) -> None:
        """Report what the trainer produced for `step` (its metrics), after the step trained: numbers
        (ints, floats, bools, numpy scalars, one-element tensors); anything else is left out. On a step
        generated and committed, they are recorded with it (on the writer thread, after its commit); on a
        step served from the cache, compared with the recorded ones (`skip.rollout_tq.replay_check`):
        the first divergence is a WARNING, or with `error` a ReplayDivergedError raised here. May be
        called several times for one step (values are merged). Does nothing before the harness started,
        after close, when caching is off, or for a step the harness did not decide."""
        if self._values is None or self._closed or not self.enabled:
            return
        step = operator.index(step)
        outcome = self.outcome(step)
        if outcome == OFF:
            return
        self.callbacks.on_values(step=step, outcome=outcome, values=values, machine=self._values.machine)
        self._values.observe(step, outcome, values)

    def weight_values(self, model: Any, *, name: str = "policy") -> Dict[str, int]:
        """`skip.rollout_tq.replay_weights` on: {`weights/{name}.{parameter}`: digest} of `model`'s parameters
        now, for `observe`; else {} (nothing computed). W > 1: a collective, every rank calls it (run.weights)."""
        if not self.settings.replay_weights or self._runner is None or self._closed or not self.enabled:
            return {}
        return weight_digests(model, name=name, gather=self._runner.dist.gather)

    def observe_weights(self, step: int, model: Any, *, name: str = "policy") -> None:  # after the update
        """`observe(step, **weight_values(model))` for a step the harness decided."""
        self.observe(step, **(self.weight_values(model, name=name) if self.outcome(step) != OFF else {}))

    def set_training_config(self, config: Any) -> None:
        """The run's training-side config (what the fingerprint leaves out: learning rate, loss,
        clipping...), a nested mapping recorded flattened once per run, so that a replay's divergence
        names the keys that changed. `from_config` sets it from the whole config."""
        self._training_config = None if config is None else flatten_config(config)
        if self._values is not None:
            self._values.set_training_config(self._training_config)

    # ----------------------------------------------------------------- shutdown
    def close(self) -> RunSummary:
        """Finish writes and commits, report, release the namespace lock, unwrap. Idempotent; always returns."""
        if self._closed:
            return self.summary()
        self._closed = True
        self._hooks.remove()
        if not self._started:
            return self.summary()
        try:
            self._runner.finish()
        finally:
            self._tier.close()
            self._prefetcher.close()
            if not self._coordinator.close():
                self._fault(str(self._runner.store.layout.root), "the writer did not finish in time; "
                            "its unfinished steps stay uncommitted")
            self._runner.store.pool.close()
            self._release_startup()
        summary = self.summary()
        self.callbacks.on_end(summary=summary)
        return summary

    def __enter__(self) -> "SkipHarness":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

