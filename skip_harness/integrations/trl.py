"""Attach skip_harness to a TRL ``GRPOTrainer`` in one call.

    from skip_harness.integrations.trl import attach

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    harness = attach(trainer, dump_dir="/tmp/rollouts", experiment_name="my-run")
    trainer.train()              # first run: generates and caches; a rerun: served from the cache
    print(harness.summary())     # rollout cache summary: 4 steps: 0 hits, ... 4 misses ...; cache in DIR

What is cached
    The return of ``GRPOTrainer._generate_single_turn``: the completion token ids of one generation
    call and, where the generator returns them (vLLM), the sampling log-probs. It is stored as tensors
    (flat ids, per-completion lengths, flat log-probs when there are any) and handed back to TRL as
    the exact lists the generator returned. Beside it, the second tier (``trl_tier``): the rewards per
    reward function (``_calculate_rewards``) and, with ``beta > 0``, the reference model's log-probs,
    each served on a replay while its own key (the reward functions' sources; the reference model and
    its settings) is unchanged, recomputed and said otherwise (``tier=False`` turns it off). The rest
    is recomputed on a replay: advantages, the log-probs under the current weights, the loss and every
    logged metric. So a replay may change the training side (learning rate, ``beta``, loss type,
    clipping, reward weighting): it then trains on the recorded completions, which is what the cache
    is for.

How it is keyed
    step = ``trainer.state.global_step`` (the optimizer step, 0-based: ``first_step=0``; TRL's
    ``log_history`` numbers the same step one higher, and the demo trainer and verl start at 1: kept at
    0 so that ``steps=[...]``, ``outcome(step)`` and every TRL recording's step folders keep meaning
    what they meant; docs/trl.md, "Step numbers"), inner
    index = the generation call's position within that step, rank = the process. K, the number of
    generation calls per optimizer step, comes from TRL's arguments (:func:`generations_per_step`).
    Evaluation generation (the model in eval mode) is never cached. Each call's prompts (token ids,
    plus any images and multimodal fields) are digested: a replay whose prompts for a step differ
    from the recorded ones regenerates that step, with a WARNING naming it.

Fingerprint
    TRL's generation arguments, the seed, the generation backend, the model's name and a digest of
    its config (:func:`generation_fingerprint`). Learning rate, ``beta`` and other training-side
    arguments are left out on purpose. Prompts are checked per generation call (above) rather than
    per namespace, so changing one prompt regenerates only the steps that see it.

RNG
    TRL samples from the global generators, so ``restore_rng`` is on: the generators' states after
    each generation are recorded and restored on a hit, and a hit leaves the process as a miss would.

Lifecycle
    :func:`attach` starts the harness when training begins (lock, scan, cleanup, fingerprint check)
    and closes it when training ends, giving the trainer its own method back; the returned harness
    keeps its summary and outcomes. Not supported: tools / environments (a generation then makes a
    variable number of generator calls) and ``rollout_func``; :func:`attach` refuses them.

Which TRL
    TRL 1.16.x (``trl_patches.SUPPORTED_TRL``). Before it replaces anything, :func:`attach` checks TRL's
    version and the parameters of the three methods it replaces (``trl_patches.PATCHES``) and refuses
    another version, or a changed method, naming both; a trainer class without the reward or reference
    method gets that part of the second tier off, with a WARNING naming it.

Where it lives
    This module wires the harness to the trainer (its generation method, the lifecycle callback that
    starts, feeds the replay check and closes it); ``trl_keys`` says how generations are keyed and
    fingerprinted; ``trl_payload`` what is stored for one. Every name is importable from here.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

from skip_harness.errors import HarnessUsageError, ReplayDivergedError
from skip_harness.integrations.trl_keys import (  # noqa: F401  (re-exported: importable from here as before)
    GENERATION_ARGS, NOT_TRAINING_ARGS, digest, generation_fingerprint, generations_per_step, namespace_for,
    prompt_digest, run_settings, training_config,
)
from skip_harness.integrations import trl_patches, trl_tier
from skip_harness.integrations.trl_patches import GENERATION_METHOD
from skip_harness.integrations.trl_payload import Generation, decode_generation, encode_generation  # noqa: F401

__all__ = [
    "attach", "GENERATION_METHOD", "GENERATION_ARGS", "NOT_TRAINING_ARGS", "generations_per_step", "digest",
    "prompt_digest", "generation_fingerprint", "training_config", "namespace_for", "encode_generation",
    "decode_generation",
]

log = logging.getLogger("skip_harness")

#: How a TRL run's steps are numbered (docs/trl.md, "Step numbers"): said once when attach() is called.
STEP_NUMBERS = ("steps are numbered from 0, as trainer.state.global_step is while the step generates "
                "(TRL's log_history numbers the same step 1: harness step s is log entry step s+1)")


#: Log keys computed from the rollouts and their rewards alone: the replay check compares them first, so a
#: divergence names its earliest cause (a reward that differs, before the loss it moves).
ROLLOUT_SIDE_PREFIXES = ("rewards/", "reward", "completions/", "num_tokens", "frac_reward_zero_std")


def rollout_side_first(logs: Mapping[str, Any]) -> dict:
    """A log entry with the rollout-side values first (in their order), then the rest."""
    first = {k: v for k, v in logs.items() if str(k).startswith(ROLLOUT_SIDE_PREFIXES)}
    return {**first, **{k: v for k, v in logs.items() if k not in first}}


# --------------------------------------------------------------------------- attach
def _check_supported(trainer: Any) -> None:
    if getattr(trainer, "rollout_func", None) is not None:
        raise HarnessUsageError(
            "skip_harness.integrations.trl: GRPOTrainer(rollout_func=...) is not supported: a custom rollout "
            "function returns more than the generator's completions; cache it with SkipHarness.wrap directly"
        )
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise HarnessUsageError(
            "skip_harness.integrations.trl: GRPOTrainer with tools or environments is not supported: one "
            "generation then makes a variable number of generator calls"
        )
    if GENERATION_METHOD in getattr(trainer, "__dict__", {}):
        raise HarnessUsageError(
            f"skip_harness.integrations.trl: trainer.{GENERATION_METHOD} is already replaced on this trainer "
            "(attach() called twice?)"
        )


def attach(
    trainer: Any,
    *,
    dump_dir: Optional[str] = None,
    experiment_name: Optional[str] = None,
    project_name: str = "trl",
    callbacks: Sequence[Any] = (),
    fingerprint: Optional[Mapping[str, Any]] = None,
    **settings: Any,
) -> Any:
    """Cache every generation of a TRL ``GRPOTrainer``; returns the :class:`SkipHarness`.

    `dump_dir`: the cache root (default: ``SKIP_HARNESS_DUMP_DIR`` or a per-user cache directory).
    `experiment_name` (default: ``args.run_name``, else the output directory's name) and
    `project_name` name the namespace. `settings`: any other ``skip.rollout_tq`` setting
    (``action="repeat"``, ``on_mismatch="regenerate"``, ``steps=[0, 1]``, ``enable=False`` ...);
    ``restore_rng`` defaults to True. `fingerprint`: extra values to add to the generation
    fingerprint (a reward-free data version, say). Call before ``trainer.train()``.
    """
    from transformers import TrainerCallback

    from skip_harness.run.harness import SkipHarness

    _check_supported(trainer)
    version = trl_patches.installed_version()
    trl_patches.check_trl_version(version)   # before anything of the trainer is read
    run = run_settings(trainer, dump_dir=dump_dir, experiment_name=experiment_name, project_name=project_name,
                       fingerprint=fingerprint, settings=settings)
    # before anything is replaced; a missing tier method is said only when the tier is asked for
    usable = trl_patches.check(type(trainer), version, tier=run.rollout.enable and run.rollout.tier)
    harness = SkipHarness(run, callbacks=callbacks)
    K, experiment_name = run.K, run.namespace.experiment_name

    original = getattr(trainer, GENERATION_METHOD)
    generation = Generation(original)
    harness.wrap(
        generation,
        sample="generate",
        prepare_data=None,
        step_of=lambda: trainer.state.global_step,
        first_step=0,
        is_validation=lambda args, kwargs: not trainer.model.training,
        call_digest=prompt_digest,
    )
    setattr(trainer, GENERATION_METHOD, generation)
    undo_tier = trl_tier.install(trainer, harness, usable)   # rewards and reference log-probs: the second tier

    def detach() -> None:
        if trainer.__dict__.get(GENERATION_METHOD) is generation:
            del trainer.__dict__[GENERATION_METHOD]
        undo_tier()
        harness.unwrap()

    class _Lifecycle(TrainerCallback):
        """Starts the harness with training, closes it (and gives TRL its method back) at the end.

        It stays registered but inert afterwards: a later ``train()`` runs TRL untouched (attach again
        to cache it)."""

        done = False
        weights: dict = {}       # replay_weights: {step: its digests}, reported after the step's log entry

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.done:
                harness.start()

        def _observe(self, step: int, values: Mapping[str, Any]) -> None:
            try:
                harness.observe(step, **values)
            except ReplayDivergedError:       # replay_check=error: the run stops here, closed and reported
                self.done = True
                try:
                    harness.close()
                finally:
                    detach()
                raise

        def _observe_weights(self, before: Optional[int] = None) -> None:
            for step in sorted(s for s in self.weights if before is None or s < before):
                self._observe(step, self.weights.pop(step))

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            # skip.rollout_tq.replay_weights: the digests after this optimizer step's update (a collective: on
            # every rank), reported after its log entry (its rewards first) or, unlogged, with the next step
            if self.done or model is None:
                return
            step = state.global_step - 1
            self._observe_weights(before=step)
            digests = harness.weight_values(model) if harness.outcome(step) != "off" else {}   # not a step it decided
            if digests:
                self.weights[step] = digests

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            # the log_history entry of an optimizer step (not the end-of-training totals, not an evaluation):
            # recorded with, or checked against, the generation step it trained on (global_step - 1)
            if self.done or not logs or "loss" not in logs or "train_runtime" in logs:
                return
            self._observe(state.global_step - 1, rollout_side_first(logs))
            self._observe_weights()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.done:
                return
            self._observe_weights()
            self.done = True
            try:
                harness.close()
            finally:
                detach()

    trainer.add_callback(_Lifecycle())
    if getattr(getattr(trainer, "accelerator", None), "is_main_process", True):
        log.info(
            "caching GRPOTrainer generations: K = %d generation call(s) per optimizer step (gradient_accumulation_steps"
            " = %s, steps_per_generation = %s, num_iterations = %s), experiment %r; %s",
            K, trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation,
            getattr(trainer.args, "num_iterations", 1), experiment_name, STEP_NUMBERS,
        )
    return harness
