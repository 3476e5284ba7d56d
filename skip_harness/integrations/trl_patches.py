"""What :func:`skip_harness.integrations.trl.attach` replaces on a TRL ``GRPOTrainer``, and the guards on each.

``attach`` replaces three of the trainer's private methods, on the instance (its class untouched; undone
when training ends) -- the rows of :data:`PATCHES`. Before it touches any: TRL's version must be in
:data:`SUPPORTED_TRL` (:func:`check_trl_version`), and each method, as the trainer's class resolves it,
must take the parameters listed (:func:`check`; a subclass's override that hands ``*args, **kwargs`` on is
looked through to the method it calls). Another version, or a method taking other parameters, is refused
with an :class:`~skip_harness.errors.UnsupportedVersionError` naming TRL's version and the method. The
generation method is required; a missing reward or reference method turns that part of the second tier
off with a WARNING naming it (docs/design.md, "Third-party code we patch").
"""
from __future__ import annotations

from typing import Any, Optional, Set

from skip_harness.integrations.patches import (
    Patch, check_params, check_version, feature_off, params_of, passes_through,
)

WHO = "skip_harness.integrations.trl"

SUPPORTED_TRL = "1.16.x"
"""TRL versions ``attach`` is checked against: 1.16.0 (tests/test_trl.py runs it); the same range as
pyproject.toml's ``trl>=1.16,<1.17``. TRL changes these private methods between minor releases (1.13
moved the value head, multimodal parameters keep arriving), so 1.17 is refused until checked."""

GENERATION_METHOD = "_generate_single_turn"
REWARD_METHOD = "_calculate_rewards"
LOGPS_METHOD = "_get_per_token_logps_and_entropies"

#: What attach replaces on the trainer, with the parameters (after self) TRL 1.16.0's methods take.
PATCHES = (
    Patch(f"GRPOTrainer.{GENERATION_METHOD}",
          ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
          "cache each generation call's completions (the call's prompts are digested by position)"),
    Patch(f"GRPOTrainer.{REWARD_METHOD}", ("inputs", "prompts", "completions", "completion_ids_list"),
          "serve the rewards per reward function from the second tier", feature="the second tier's rewards"),
    Patch(f"GRPOTrainer.{LOGPS_METHOD}",
          ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
           "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
           "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
           "image_position_ids"),
          "serve the reference model's log-probs from the second tier (calls whose model is the reference)",
          feature="the second tier's reference log-probs"),
)


def check_trl_version(version: str) -> None:
    """Refuse a TRL ``attach`` was not checked against, naming it and the supported range."""
    check_version("TRL", version, SUPPORTED_TRL, lambda v: v.release[:2] == (1, 16), WHO,
                  "pip install 'skip_harness[trl]' (trl>=1.16,<1.17), or train without attach()")


def _definition(cls: type, patch: Patch) -> Optional[Any]:
    """The method `cls` runs for `patch`, looking through overrides that pass every argument on; None when
    the class has none (an attribute set to None, say)."""
    expected = patch.params or ()
    for klass in cls.__mro__:
        if patch.name not in klass.__dict__:
            continue
        func = klass.__dict__[patch.name]
        if callable(func) and passes_through(params_of(func), expected):
            continue
        return func
    return None


def check(cls: type, version: str, *, tier: bool = True) -> Set[str]:
    """Check TRL's `version` and each row of :data:`PATCHES` on the trainer class `cls`; returns the names of
    the methods attach may replace. Refuses (UnsupportedVersionError) a version outside the range, a
    changed method, or a missing generation method; a missing optional method is said (WARNING). `tier`:
    whether the second tier is asked for; when not, its rows are neither checked nor said (nothing of
    them is replaced)."""
    check_trl_version(version)
    usable: Set[str] = set()
    for patch in PATCHES:
        if patch.feature and not tier:
            continue
        func = _definition(cls, patch)
        if func is None and patch.feature:
            feature_off(patch, cls.__name__, WHO)
            continue
        check_params(patch, func, "TRL", version, WHO, SUPPORTED_TRL)
        usable.add(patch.name)
    return usable


def installed_version() -> str:
    import trl

    return str(trl.__version__)


__all__ = ["GENERATION_METHOD", "LOGPS_METHOD", "PATCHES", "REWARD_METHOD", "SUPPORTED_TRL", "check",
           "check_trl_version", "installed_version"]
