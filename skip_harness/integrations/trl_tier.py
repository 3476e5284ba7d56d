"""TRL's second tier: a ``GRPOTrainer``'s rewards and reference log-probs served on a replay.

:func:`skip_harness.integrations.trl.attach` wraps two more of the trainer's methods (reversibly, on the
instance, as it wraps generation, each checked first: :mod:`trl_patches`), each through
:meth:`SkipHarness.phase`:

- ``_calculate_rewards``, the call of every reward function on a generation's completions: its return,
  the rewards per reward function (columns in ``reward_func_names`` order, gathered over the processes),
  is the ``reward`` phase. Its validity key: each reward function's name and a digest of its source (a
  reward model: its name or path and a digest of its config and weights), and its processing class.
- ``_get_per_token_logps_and_entropies`` when TRL calls it with the reference model (``beta > 0`` and a
  separate ``ref_model``): its return is the ``reference`` phase. Its key: the reference model's name or
  path, a digest of its config and weights, and the settings its forward pass reads (``temperature``,
  the batch size it is chunked by, ``cast_lm_head_to_fp32``). A PEFT reference (adapters disabled on
  the policy itself) and ``sync_ref_model=True`` (the reference follows the policy) are never served.

Only training calls are tiered (the model in training mode): evaluation runs as TRL wrote it. A reward
function's side effects (``log_metric``, ``log_extra``) do not happen when its rewards are served.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Collection, Dict, List

import torch

from skip_harness.integrations.trl_patches import LOGPS_METHOD, REWARD_METHOD
from skip_harness.run.tier import REFERENCE, REWARD, digest_text, source_digest, weights_digest

#: GRPOConfig fields the reference forward pass reads (apart from the rollouts and the reference model).
REFERENCE_ARGS = ("temperature", "per_device_train_batch_size", "cast_lm_head_to_fp32", "bf16", "fp16",
                  "model_init_kwargs")
_WEIGHTS_DIGEST_MAX = 2_000_000_000      # bytes of weights hashed at attach; a bigger model is keyed by config


def model_digest(model: Any) -> Dict[str, str]:
    """A model's name or path, a digest of its config and (up to a size) of its weights."""
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or type(model).__name__)
    out = {"path": name}
    if config is not None and hasattr(config, "to_dict"):
        out["config"] = digest_text(json.dumps(config.to_dict(), sort_keys=True, default=str))
    if hasattr(model, "state_dict"):
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if 0 < total <= _WEIGHTS_DIGEST_MAX:
            out["weights"] = weights_digest(model)
    return out


def reward_key(trainer: Any) -> Dict[str, str]:
    """The reward side's validity key: one component per reward function, by its name."""
    key: Dict[str, str] = {}
    names = list(getattr(trainer, "reward_func_names", []) or [])
    classes = list(getattr(trainer, "reward_processing_classes", []) or [])
    for i, fn in enumerate(trainer.reward_funcs):
        name = names[i] if i < len(names) else getattr(fn, "__name__", f"#{i}")
        comp = f"reward function {name}"
        if comp in key:
            comp = f"{comp} #{i}"
        if isinstance(fn, torch.nn.Module):
            value = json.dumps(model_digest(fn), sort_keys=True)
        else:
            value = source_digest(fn)
        proc = classes[i] if i < len(classes) else None
        if proc is not None:
            value += ":" + str(getattr(proc, "name_or_path", type(proc).__name__))
        key[comp] = value
    return key


def reference_key(trainer: Any) -> Dict[str, str]:
    """The reference side's validity key: the reference model and the settings its forward reads."""
    ref = trainer.ref_model
    unwrapped = getattr(ref, "module", ref)
    key = {f"reference model {k}": v for k, v in model_digest(unwrapped).items()}
    for name in REFERENCE_ARGS:
        key[f"reference setting {name}"] = json.dumps(getattr(trainer.args, name, None), sort_keys=True, default=str)
    return key


def install(trainer: Any, harness: Any, usable: Collection[str]) -> Callable[[], None]:
    """Wrap the trainer's reward and reference computations with the harness's tier; returns the undo.
    `usable`: the methods :func:`trl_patches.check` found in the shape it was checked against (one it did
    not find was said there, with a WARNING: that part of the tier stays off)."""
    installed: List[str] = []
    if REWARD_METHOD in usable:
        rkey = reward_key(trainer)
        original_rewards = getattr(trainer, REWARD_METHOD)

        def _calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            if not trainer.model.training:
                return original_rewards(*args, **kwargs)
            return harness.phase(REWARD, trainer.state.global_step, lambda: original_rewards(*args, **kwargs),
                                 key=rkey)

        setattr(trainer, REWARD_METHOD, _calculate_rewards)
        installed.append(REWARD_METHOD)

    if getattr(trainer, "beta", 0.0) != 0.0 and getattr(trainer, "ref_model", None) is not None \
            and not getattr(trainer.args, "sync_ref_model", False) and LOGPS_METHOD in usable:
        fkey = reference_key(trainer)
        original_logps = getattr(trainer, LOGPS_METHOD)

        def _get_per_token_logps_and_entropies(model: Any, *args: Any, **kwargs: Any) -> Any:
            if model is not trainer.ref_model or not trainer.model.training:
                return original_logps(model, *args, **kwargs)
            out = harness.phase(REFERENCE, trainer.state.global_step,
                                lambda: tuple(original_logps(model, *args, **kwargs)), key=fkey)
            return tuple(out)

        setattr(trainer, LOGPS_METHOD, _get_per_token_logps_and_entropies)
        installed.append(LOGPS_METHOD)

    def undo() -> None:
        for name in installed:
            trainer.__dict__.pop(name, None)

    return undo


__all__ = ["LOGPS_METHOD", "REFERENCE_ARGS", "REWARD_METHOD", "install", "model_digest", "reference_key",
           "reward_key"]
