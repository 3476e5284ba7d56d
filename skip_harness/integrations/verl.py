"""skip_harness inside verl's own V1 trainer, on with one line::

    VERL_USE_EXTERNAL_MODULES=skip_harness.integrations.verl python -m verl.trainer.main_ppo \\
        skip.rollout_tq.enable=true skip.rollout_tq.steps='[1,2,3]' +skip_harness.cleanup=quarantine ...

verl imports every module named in ``VERL_USE_EXTERNAL_MODULES`` in every process (``verl/__init__.py``);
importing this one registers :class:`HarnessRolloutTqSkip` as verl's ``rollout_tq`` skip class
(``verl.utils.skip.base_skip.register_skip``), so verl's own ``SkipManager.init`` builds it and verl's
own decorators call it -- ``PPOTrainer._add_batch_to_generate`` (``annotate_tq(phase="submit")``) and
``ReplayBuffer.sample`` / ``ReplayBufferAsync.sample`` (``phase="sample"``). What those decorators do not
reach is patched in memory (verl's files untouched): seven methods of ``PPOTrainer``, ``ReplayBuffer`` and
``ReplayBufferAsync`` (:mod:`verl_hooks`) and two more of ``ReplayBuffer`` (:mod:`verl_discards`: what the
sampler dropped), both when verl builds the plug-in, ``Tracking.log`` (:mod:`verl_values`, on import) and, with a TRL >= 1.13, one import verl 0.9.x needs (a ``sys.meta_path`` finder). Each is a row
of :data:`verl_patches.PATCHES`, and a verl of another version, or whose methods take other parameters,
is refused by name before anything is touched (docs/design.md, "Third-party code we patch").

What it does in verl's calls
    submit (``maybe_load_and_inject``): the step is decided once (hit, repeat or miss, after the
    harness's startup: lock, scan, cleanup, fingerprint check). A hit puts cached mini-batch 0 into
    TransferQueue for this step's fresh prompt uids and tells verl not to dispatch the rollout; a miss
    lets verl dispatch it. sample (``should_save`` / ``prepare_data``): on a miss, the i-th sampled
    mini-batch is read from TransferQueue and handed to the harness as inner index i (counted from the
    calls); on a hit, after the i-th sample the (i+1)-th cached mini-batch is put into TransferQueue for
    the next call. Validation (partition ``val``) is never cached.

Roles
    ``rollout_tq`` (V1) is replaced. ``rollout`` (V0 ``AgentLoopManager.generate_sequences``, a
    ``DataProto`` saved as ``{step}/gen_batch.dp`` with pickle) and ``async_rollout`` (the fully async
    rollouter, whose "step" is a per-sample feed index, with no step or K to key by) stay verl's own
    classes: verl's own tests pin their on-disk format (``gen_batch.dp``) and call them several times per
    step, which the harness's (step, inner index) contract refuses. Enabling either with this module
    loaded logs a WARNING saying verl's own class runs it.

Lifecycle
    verl's trainer has no end-of-run hook for skip classes, and Ray may end the trainer's process without
    running exit handlers (``main_ppo``'s TaskRunner is force-exited after a replay). So at the last
    ``sample`` of the last step it will ever see -- the run's last step (``trainer.total_training_steps``)
    or the last step of ``skip.rollout_tq.steps``, whichever comes first, hit or miss -- that step's
    commit is made durable, and the harness closes (summary logged, namespace released) as soon as verl
    has logged that step's metrics through its ``Tracking.log`` (``fit`` does so before it may return;
    :mod:`skip_harness.integrations.verl_values` hands them to the replay check first), or at the next
    step verl starts, whichever comes first. Steps after that run as verl's own, uncached. A new ``SkipManager.init`` in the same process closes the previous
    harness (its pending writes flushed, its lock released) before the new one starts. Process exit
    closes whatever is still open; :func:`close_all` does so explicitly.
"""
from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from skip_harness.integrations.verl_patches import (  # noqa: F401 - importable from here as before
    SUPPORTED_VERL, TRL_VALUE_HEAD, _ValueHeadFinder, check_verl_version, provide_trl_value_head,
    trl_value_head_missing,
)


def loaded_by() -> str:
    """How verl loaded the plug-in, for its one startup line."""
    import os

    modules = [m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")]
    if __name__ in modules:
        return "VERL_USE_EXTERNAL_MODULES"
    return "verl's verl.plugins entry point; VERL_USE_EXTERNAL_PLUGINS=none turns it off"


try:
    from verl import __version__ as _verl_version
except ImportError as _exc:  # pragma: no cover - depends on the installed verl
    raise ImportError(f"skip_harness.integrations.verl needs verl (pip install 'skip_harness[verl]'): {_exc}") from _exc
check_verl_version(_verl_version)
_TRL_NOTE = provide_trl_value_head()   # in every process verl loads the plug-in in: its FSDP workers too

try:
    from verl.utils.skip import rollout_skip as _verl_rollout_skip  # noqa: F401 - verl's classes register first
    from verl.utils.skip.base_skip import SKIP_REGISTRY, BaseSkip, SkipAction, register_skip
    from verl.utils.skip.skip_manager import SkipManager as _SkipManager
except ImportError as _exc:  # pragma: no cover - depends on the installed verl
    raise ImportError(f"skip_harness.integrations.verl needs verl 0.9.x with its V1 skip manager "
                      f"(pip install 'skip_harness[verl]'): {_exc}") from _exc
if not hasattr(_SkipManager, "annotate_tq") or "rollout_tq" not in SKIP_REGISTRY:  # pragma: no cover
    raise ImportError("skip_harness.integrations.verl needs verl 0.9.x: this verl has no skip.rollout_tq "
                      "(SkipManager.annotate_tq, verl #6897); pip install 'skip_harness[verl]'")

from skip_harness.errors import HarnessUsageError  # noqa: E402 - after the verl version check above
from skip_harness.run.stats import HIT, MISS, REPEAT  # noqa: E402
from skip_harness.integrations import verl_config, verl_discards, verl_hooks, verl_live, verl_patches, verl_tier, verl_tq  # noqa: E402

log = logging.getLogger("skip_harness")

ROLE = "rollout_tq"


class _Generation:
    """What the harness wraps: verl's two phases as plain methods, so the harness counts and caches them.

    ``prepare_data(step)`` returns whether the rollout must be dispatched (the harness calls it with
    ``dispatch=False`` on a hit). ``sample(step, batch)`` reads the mini-batch verl sampled from
    TransferQueue (a miss); on a hit the harness returns cached mini-batch i instead and never calls it.
    """

    def prepare_data(self, step: int, dispatch: bool = True) -> bool:
        return bool(dispatch)

    def sample(self, step: int, batch: Any = None) -> Dict[str, Any]:
        if batch is None:
            raise HarnessUsageError(f"step {step}: skip_harness was asked to generate a mini-batch it can only "
                                    "read after verl's sampler ran (a hit whose cache could not be served?)")
        if isinstance(batch, dict):
            return batch   # read from TransferQueue already, with the sampler's metrics and submissions
        return verl_tq.read_minibatch(batch, step)


@dataclass
class _Step:
    uids: List[str]
    serving: bool
    source_step: int
    sampled: int = 0
    injected: int = 0
    returned: int = 0      # served sample calls whose recorded metrics were returned
    trajectories: List[int] = field(default_factory=list)
    metrics: List[Any] = field(default_factory=list)     # served: the recorded sampler metrics per mini-batch
    refills: List[List[int]] = field(default_factory=list)   # served: refill sizes recorded per mini-batch


@register_skip(ROLE)
class HarnessRolloutTqSkip(BaseSkip):
    """verl's ``skip.rollout_tq`` backed by a :class:`skip_harness.SkipHarness`.

    verl's four keys keep their meaning (``enable``, ``dump_dir``, ``steps``: verl's list of steps to
    cache, ``action``: cache or repeat); skip_harness's other settings come from the top-level
    ``skip_harness`` node (:mod:`skip_harness.integrations.verl_config`). Same namespace directory as
    verl's (``{dump_dir}/{exp}_{proj}/GBS{gbs}_N{n}_in{p}_out{r}``, plus ``_K{K}_W1`` when K > 1).
    """

    support_actions = [SkipAction.CACHE, SkipAction.REPEAT]
    support_online_step = False
    steps: Any   # verl's list of steps to cache (BaseSkip sets it), or verl_config.EVERY_STEP with all_steps

    def __init__(self, local_config: Any, global_config: Any):
        super().__init__(local_config, global_config)
        self.harness = None
        self.finished = False   # closed after the last step it serves or records
        self._close_after: Optional[int] = None   # that last step, once sampled: closed when verl logs it
        self.plan: Optional[verl_config.VerlPlan] = None
        self._steps: Dict[int, _Step] = {}
        self._decided: Dict[int, bool] = {}          # step -> served (decided once, at its first call)
        self._extras: List[List[Any]] = []           # recording: extra submissions since the last sample
        self._extra_index: Dict[int, int] = {}       # step -> extra submissions seen so far
        self._pending: Optional[Any] = None          # recording: (step, batch) sampled, waiting for its metrics
        self._tier_keys: Optional[verl_tier.Keys] = None   # the second tier's validity keys, once computed
        for role in ("rollout", "async_rollout"):
            if verl_config.role_enabled(global_config, role):
                log.warning("skip.%s is enabled: skip_harness.integrations.verl handles skip.rollout_tq (the V1 "
                            "TransferQueue trainer) only; verl's own %s class runs skip.%s (its pickled "
                            "{step}/gen_batch.dp files, no lock, no cleanup, no verification)",
                            role, SKIP_REGISTRY[role].__name__, role)
        if not self.enable:
            return
        if log.level == logging.NOTSET:
            # verl configures the root logger at WARNING when imported: keep the per-step lines and the
            # startup and summary lines visible unless the user set a level for `skip_harness`
            log.setLevel(logging.INFO)
        from skip_harness.run.harness import SkipHarness

        if _TRL_NOTE:
            log.warning("%s", _TRL_NOTE)
        self.plan = verl_config.plan_of(local_config, global_config)   # a refused config leaves verl as it is
        install_hooks()
        if self.plan.all_steps:
            self.steps = verl_config.EVERY_STEP
        self._generation = _Generation()
        close_all()   # verl built a new skip class: the previous harness ends first, its lock released
        harness = SkipHarness(self.plan.run)
        harness.wrap(self._generation, sample="sample", prepare_data="prepare_data", dispatch_kwarg="dispatch")
        self.harness = harness
        verl_live.add(self)   # verl_values hands verl's logged metrics to it
        log.info("skip_harness serves verl's skip.rollout_tq (loaded by %s): %s", loaded_by(),
                 verl_config.describe(self.plan, self.steps))

    # ---------------------------------------------------------------- verl's calls (annotate_tq)
    def maybe_load_and_inject(self, step: int, new_prompt_uids: Sequence[str], partition_id: str = "train") -> bool:
        """phase="submit": decide the step; on a hit put mini-batch 0 into TransferQueue and return True
        (verl then dispatches nothing); on a miss return False (verl dispatches the rollout)."""
        if self.harness is not None and partition_id == verl_tq.PARTITION:
            self.step_logged(int(step) - 1)   # verl moved past the last cached step without logging it
        if self.harness is None or self.finished or partition_id != verl_tq.PARTITION:
            return False
        step = int(step)
        if step in self._steps:
            raise HarnessUsageError(f"step {step}: verl submitted a training batch twice for one step")
        uids = [str(u) for u in new_prompt_uids]
        if len(uids) != self.plan.train_batch_size:
            raise HarnessUsageError(f"step {step}: verl submitted {len(uids)} prompts, data.train_batch_size is "
                                    f"{self.plan.train_batch_size}")
        serving = self._decide(step)
        self._steps[step] = _Step(uids, serving, step)
        self._forget_before(step)
        if serving:
            cleared = verl_tq.clear_partition()
            if cleared:
                log.info("step %d: served from the cache; %d training keys already in TransferQueue (restored from "
                         "verl's checkpoint, or left by an uncached step) removed first", step, cleared)
            self._inject_next(step)
        return serving

    def should_save(self, step: int, partition_id: str = "train") -> bool:
        """phase="sample", after verl's sampler ran: True on a miss (verl then calls prepare_data); on a hit
        the next cached mini-batch goes into TransferQueue for the next sample call."""
        if self.harness is None or self.finished or partition_id != verl_tq.PARTITION:
            return False  # validation is never cached
        state = self._steps.get(int(step))
        if state is None:
            return False
        if not state.serving:
            return self.harness.outcome(int(step)) == MISS
        state.sampled += 1
        if state.sampled < self.plan.K:
            self._inject_next(int(step))
        elif self._is_last(int(step)):
            self._last_step_sampled(int(step))   # served: verl may end this process without exit handlers
        return False

    def prepare_data(self, step: int, batch: Any = None, global_steps: Any = None, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """phase="sample" on a miss: the sampled mini-batch becomes the next inner index once ``sample``
        returned (:meth:`sampled` adds what it returned beside the batch)."""
        if self.harness is None or self.finished:
            return
        self._record_pending(None)   # a sampler the plug-in does not wrap: recorded without its metrics
        self._pending = (int(step), batch)

    # ---------------------------------------------------------------- the plug-in's own hooks (verl_hooks)
    def handles(self, step: int) -> bool:
        return self.harness is not None and not self.finished and step in self.steps

    def tier_phase(self, phase: str, trainer: Any, batch: Any, metrics: Any, original: Any) -> Any:
        """verl's reference forward (``phase`` "reference") or colocated reward ("reward") on a training
        mini-batch: served from the second tier on a served step whose key matches, else run (and stored on
        a generated step): :mod:`verl_tier`."""
        if self._tier_keys is None:
            self._tier_keys = verl_tier.Keys(self.global_config)
        run = verl_tier.reference if phase == "reference" else verl_tier.reward
        return run(self.harness, self._tier_keys, trainer, batch, metrics, original)

    def sampled(self, result: Any) -> Any:
        """After verl's (decorated) ``sample`` returned `result` = (batch, metrics): on a miss the mini-batch
        is stored with those metrics and the extra submissions made since the last sample; on a hit the
        recorded metrics are returned in place of this run's, and the refills recorded with the mini-batch
        advance the dataloader (this run's sampler had nothing to refill)."""
        batch, metrics = (result[0], result[1]) if isinstance(result, tuple) and len(result) == 2 else (result, None)
        if getattr(batch, "partition_id", None) != verl_tq.PARTITION or self.harness is None:
            return result
        step = int(_SkipManager.step)
        if self._pending is not None and self._pending[0] == step:
            self._record_pending(metrics)
            return result
        state = self._steps.get(step)
        if self.finished or state is None or not state.serving or state.returned >= state.sampled:
            return result
        index = state.returned
        state.returned += 1
        for prompts in state.refills[index] if index < len(state.refills) else []:
            self._draw(prompts)
        recorded = state.metrics[index] if index < len(state.metrics) else None
        if recorded is None or not isinstance(result, tuple):
            return result   # a mini-batch recorded before the plug-in stored the sampler's metrics
        return (batch, verl_hooks.decode_metrics(recorded))

    def extra_submission(self, trainer: Any, prompts: int, submit: Any, kind: str) -> int:
        """verl's ``_add_prompts_to_generate(prompts)`` (a warm-up batch or a refill) during a cached step:
        recorded as the step's next extra submission on a miss; on a served step the dataloader advances by
        the same prompts and nothing is generated (the mini-batches that sampled them are served)."""
        step = int(_SkipManager.step)
        if not self.handles(step):
            return int(submit())
        index = self._extra_index.get(step, 0)
        self._extra_index[step] = index + 1
        if not self._decide(step):
            out = int(submit())
            self._extras.append([step, index, kind, int(prompts)])
            return out
        state = self._steps.get(step)
        if kind == "refill" and state is not None:
            pending = state.refills[state.returned] if state.returned < len(state.refills) else []
            if prompts in pending:
                pending.remove(prompts)   # this run's sampler asked for a recorded refill itself
        return self._draw(prompts, trainer)

    def _draw(self, prompts: int, trainer: Any = None) -> int:
        trainer = trainer if trainer is not None else verl_hooks.current_trainer()
        if trainer is None:
            raise HarnessUsageError("skip_harness: a served step's recorded prompts must be drawn from verl's "
                                    "dataloader, but no PPOTrainer called the plug-in yet")
        return len(trainer._next_train_batch(int(prompts)))

    def _decide(self, step: int) -> bool:
        """Hit, repeat or miss for `step`, decided once (at verl's first call for it)."""
        if step not in self._decided:
            self._generation.prepare_data(step)   # the harness decides the step (and starts on the first one)
            self._decided[step] = self.harness.outcome(step) in (HIT, REPEAT)
            for old in [s for s in self._decided if s < step - 1]:
                del self._decided[old]
        return self._decided[step]

    def _record_pending(self, metrics: Any) -> None:
        """Hand the mini-batch sampled on a miss to the harness as the next inner index."""
        if self._pending is None:
            return
        step, batch = self._pending
        self._pending = None
        payload = verl_tq.read_minibatch(batch, step)
        payload["sampler_metrics"] = verl_hooks.encode_metrics(metrics)
        payload["submissions"] = [list(e) for e in self._extras]
        self._extras = []
        state = self._steps.get(step)
        self._generation.sample(step, payload)
        if state is not None:
            state.sampled += 1
            if state.sampled == self.plan.K and self._is_last(step):
                self._last_step_sampled(step)  # committed before verl's trainer may end the process

    def meet_precondition(self, step: int, *args: Any, **kwargs: Any) -> bool:
        """Whether `step` is (or would be) served from the cache, once decided."""
        return self.harness is not None and self.harness.outcome(int(step)) in (HIT, REPEAT)

    def has_v1_cache(self, step: int) -> bool:
        return self.meet_precondition(step)

    # ---------------------------------------------------------------- internals
    def _inject_next(self, step: int) -> None:
        state = self._steps[step]
        inner = state.injected
        P = self.plan.prompts_per_sample
        payload = self._generation.sample(step)
        rewrite = self.harness.outcome(step) == REPEAT
        n = verl_tq.inject(payload, state.uids[inner * P:(inner + 1) * P], step, rewrite_steps=rewrite)
        state.injected += 1
        state.trajectories.append(n)
        state.metrics.append(payload.get("sampler_metrics"))
        state.refills.append([int(e[3]) for e in payload.get("submissions") or [] if e[2] == "refill"])

    def _is_last(self, step: int) -> bool:
        """The run's last step, or the last step verl's list asks to cache."""
        listed = None if self.plan.all_steps else [int(s) for s in self.steps]
        return step == self.plan.total_training_steps or (bool(listed) and step >= max(listed))

    def _forget_before(self, step: int) -> None:
        for old in [s for s in self._steps if s < step - 1]:
            del self._steps[old]

    # ---------------------------------------------------------------- lifecycle
    def summary(self) -> Any:
        return None if self.harness is None else self.harness.summary()

    def _last_step_sampled(self, step: int) -> None:
        """The last step this run caches had its last sample: its commit is made durable now; the harness
        stays open until verl logs the step's metrics (:meth:`step_logged`), so the replay check hears them."""
        self.harness.commit_finished()
        self._close_after = step

    def step_logged(self, step: int) -> None:
        """verl logged `step`'s metrics (``Tracking.log``, after they reached the replay check): past the
        last step this run caches, the harness closes."""
        if self._close_after is not None and int(step) >= self._close_after and not self.finished:
            self.finish()

    def finish(self) -> Any:
        """After the last step this run caches: close now; later steps run as verl's own, uncached."""
        self.finished = True
        return self.close()

    def close(self) -> Any:
        """Finish writes and commits, log the summary, release the namespace lock (idempotent)."""
        verl_live.remove(self)
        if self.harness is None:
            return None
        return self.harness.close()


def close_all() -> None:
    """Close every live harness this module built (also run at process exit, when the process gets one)."""
    for skip in verl_live.instances():
        try:
            skip.close()
        except Exception:  # noqa: BLE001 - at exit: report, never raise
            log.exception("skip_harness: closing the verl rollout cache failed")


atexit.register(close_all)


def _active() -> "Optional[HarnessRolloutTqSkip]":
    """The enabled skip_harness instance verl's SkipManager built, else None (the wrappers pass through)."""
    skip = _SkipManager.skip_instances.get(ROLE)
    if isinstance(skip, HarnessRolloutTqSkip) and skip.enable and skip.harness is not None and not skip.finished:
        return skip
    return None


def _verl_classes() -> Dict[str, type]:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return {"PPOTrainer": PPOTrainer, "ReplayBuffer": ReplayBuffer, "ReplayBufferAsync": ReplayBufferAsync}


def install_hooks() -> None:
    """Wrap the V1 trainer's calls verl's decorators miss (:mod:`verl_hooks`), once verl's trainer is
    importable: when verl builds the plug-in (``SkipManager.init``, in the trainer's process). Not at import:
    the plug-in is imported before other external modules (a platform) are registered."""
    classes = _verl_classes()
    off = verl_patches.check_shapes(classes, _verl_version)       # a changed verl refused; what turns off, said
    verl_hooks.install(_active, classes)
    if verl_patches.DISCARDS not in off:                          # what the sampler dropped, and why
        verl_discards.install(_active, classes["ReplayBuffer"], lambda: _SkipManager.step)
from skip_harness.integrations import verl_values  # noqa: E402,F401 - verl's logged metrics reach the replay check
