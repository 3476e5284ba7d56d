"""What the verl plug-in patches in verl (and, beside it, in TRL's import), and the guards on each.

The plug-in reaches verl mostly through verl's own API (``register_skip`` and the skip decorators
``annotate_tq`` calls), and patches the rest in memory, verl's files untouched -- every patch is a row of
:data:`PATCHES`. Before anything is touched: verl's version must be in :data:`SUPPORTED_VERL`
(:func:`check_verl_version`, on import), each replaced or called method must take the parameters listed
(:func:`check_shapes` when verl builds the plug-in, :func:`check_tracking_log` on import), and verl's
warm-up must still read :data:`WARMUP_GATE`. Any other verl is refused with an
:class:`~skip_harness.errors.UnsupportedVersionError` (an ImportError) naming the version and the method.
Every row is required but the two :mod:`verl_discards` wraps: a verl without one of them turns
:data:`DISCARDS` off with a WARNING naming it (what the sampler dropped is a record, never needed to train);
one that takes other parameters is refused like the rest. The TRL import it supplies
(:func:`provide_trl_value_head`) is guarded by TRL's version and answers one module name only.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
from typing import Any, Dict, Set

from skip_harness.errors import UnsupportedVersionError
from skip_harness.integrations.patches import Patch, check_params, check_version, feature_off

WHO = "skip_harness.integrations.verl"

SUPPORTED_VERL = ">=0.9.1,<0.10"
"""verl versions the plug-in is checked against, as a PEP 440 range: pyproject.toml's ``verl`` extra (a test
ties the two). 0.9.1 drives the CI's real ``main_ppo`` runs; every row of :data:`PATCHES` was checked
against it. 0.9.0 and verl main's 0.10.0.dev are refused until run: the plug-in's hooks were once read
against them, but the rows added since (the second tier, the discards, the warm-up) were checked on 0.9.1
only. A later 0.9.x is let in, each method still checked by its parameters (:func:`check_shapes`)."""

TRL_VALUE_HEAD = "trl.experimental.ppo"
#: what verl's warm-up reads to skip itself when caching is on (trainer_base.py, 0.9.1)
WARMUP_GATE = "skip.rollout_tq.enable"
_SAMPLE = ("global_steps", "partition_id", "batch_size")
#: the feature :mod:`verl_discards` gives (off, with a WARNING, when verl lacks a method it wraps)
DISCARDS = "recording discarded groups"

#: Everything the plug-in replaces in verl (or calls and relies on), with the parameters checked.
PATCHES = (
    Patch("PPOTrainer._add_prompts_to_generate", ("num_prompts",),
          "record a cached step's extra submissions (warm-up, refills) and, on a served step, draw them from "
          "the dataloader without generating"),
    Patch("PPOTrainer._add_async_warmup_batches", ("num_warmup_batches",),
          f"keep verl's async warm-up, which verl 0.9.1 skips when {WARMUP_GATE} is set",
          guard=f"its source must still read {WARMUP_GATE}"),
    Patch("PPOTrainer._add_batch_to_generate", (),
          "remember the trainer whose dataloader a served step draws from"),
    Patch("PPOTrainer._compute_ref_log_prob", ("batch", "metrics"),
          "serve the reference log-probs from the second tier"),
    Patch("PPOTrainer._compute_reward_colocate", ("batch", "metrics"),
          "serve the colocated reward from the second tier"),
    Patch("ReplayBuffer.sample", _SAMPLE, "store the sampler's metrics with each mini-batch and return them on a hit"),
    Patch("ReplayBufferAsync.sample", _SAMPLE,
          "store the sampler's metrics with each mini-batch and return them on a hit"),
    Patch("ReplayBuffer._evict_terminal_groups", ("global_steps", "partition_id", "eviction_reasons"),
          "record each group the sampler evicts (DAPO filter_groups, stale, failed) with its reason and, "
          "for a DAPO-filtered group, its samples' shared metric", feature=DISCARDS),
    Patch("ReplayBuffer._clear_groups", ("partition_id", "uids"),
          "record the groups sync DAPO drops once enough were kept (filter_groups surplus)", feature=DISCARDS),
    Patch("PPOTrainer._next_train_batch", ("num_prompts",),
          "draw a served step's recorded prompts from verl's dataloader", how="called"),
    Patch("Tracking.log", ("data", "step", "backend"), "hand each step's logged metrics to the replay check",
          guard="checked and wrapped when the plug-in is imported"),
    Patch("sys.meta_path", None, how="appended to", why=(
          f"answer `import {TRL_VALUE_HEAD}` with an empty AutoModelForCausalLMWithValueHead when the installed "
          "TRL lacks it, so verl 0.9.x builds its FSDP actor"),
          guard="only with a TRL >= 1.13 (read from its metadata, TRL not imported); that one module name "
                "only, consulted after TRL's own modules; TRL's files untouched"),
)
_BY_TARGET = {p.target: p for p in PATCHES}


def check_verl_version(version: str) -> None:
    """Refuse a verl the plug-in was not checked against, naming it and the supported range."""
    from packaging.specifiers import SpecifierSet

    check_version("verl", version, SUPPORTED_VERL, lambda v: v in SpecifierSet(SUPPORTED_VERL), WHO,
                  "pip install 'skip_harness[verl]', or unset VERL_USE_EXTERNAL_MODULES to run verl without "
                  "the plug-in")


def check_shapes(classes: Dict[str, type], version: str) -> Set[str]:
    """Refuse a verl whose wrapped (or called) V1 trainer methods changed shape, naming the version and the
    method; each must be defined on the class itself (the wrappers replace it there). Returns the features
    turned off (a row with a `feature` whose method the class lacks: said with a WARNING)."""
    off: Set[str] = set()
    for patch in PATCHES:
        if patch.owner in classes:
            func = classes[patch.owner].__dict__.get(patch.name)
            if func is None and patch.feature:
                feature_off(patch, patch.owner, WHO)
                off.add(patch.feature)
                continue
            check_params(patch, func, "verl", version, WHO, SUPPORTED_VERL)
    warmup = inspect.unwrap(classes["PPOTrainer"].__dict__["_add_async_warmup_batches"])
    try:
        source = inspect.getsource(warmup)
    except (OSError, TypeError):
        source = ""
    if WARMUP_GATE not in source:
        raise UnsupportedVersionError(f"{WHO}: verl {version}'s PPOTrainer._add_async_warmup_batches no longer "
                                      f"reads {WARMUP_GATE} (checked against verl {SUPPORTED_VERL}); the plug-in "
                                      "cannot keep its warm-up")
    return off


def check_tracking_log(tracking: type, version: str) -> None:
    """Refuse a verl whose ``Tracking.log`` takes other parameters than the replay check's wrapper passes."""
    check_params(_BY_TARGET["Tracking.log"], tracking.__dict__.get("log"), "verl", version, WHO, SUPPORTED_VERL)


# ------------------------------------------------------------------ TRL's value head, for verl 0.9.x
def trl_value_head_missing() -> str:
    """The installed TRL's version when it lacks ``AutoModelForCausalLMWithValueHead`` (TRL >= 1.13 removed
    it), else "". Read from TRL's metadata: TRL itself is not imported."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import InvalidVersion, Version

    try:
        trl = version("trl")
        return trl if Version(trl) >= Version("1.13") else ""
    except (PackageNotFoundError, InvalidVersion):
        return ""


class _ValueHeadFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Supplies ``trl.experimental.ppo`` when the installed TRL has none (a meta-path finder consulted
    after TRL's own modules): a module holding an empty ``AutoModelForCausalLMWithValueHead``, the one name
    verl 0.9.x imports from it, only to set its ``state_dict`` (verl/models/transformers/monkey_patch.py:352;
    verl never builds TRL's value-head model)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != TRL_VALUE_HEAD:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> Any:
        return None

    def exec_module(self, module: Any) -> None:
        trl = trl_value_head_missing()

        class AutoModelForCausalLMWithValueHead:
            """An empty stand-in (skip_harness): TRL {trl} removed this class; verl 0.9.x imports it only
            to patch its ``state_dict``."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(f"AutoModelForCausalLMWithValueHead was removed in TRL 1.13 (this is TRL {trl}); "
                                  "skip_harness supplies this empty class only so that verl 0.9.x can import it")

        module.AutoModelForCausalLMWithValueHead = AutoModelForCausalLMWithValueHead
        module.__doc__ = "skip_harness: an empty AutoModelForCausalLMWithValueHead for verl 0.9.x (see _ValueHeadFinder)"


def provide_trl_value_head() -> str:
    """With a TRL >= 1.13 installed, make ``from trl.experimental.ppo import AutoModelForCausalLMWithValueHead``
    (verl 0.9.x's import, monkey_patch.py:352) find an empty class, so verl builds its FSDP actor beside
    current TRL. Returns the sentence the plug-in logs, or "" when TRL is absent or has the class."""
    import sys

    trl = trl_value_head_missing()
    if not trl:
        return ""
    if not any(isinstance(f, _ValueHeadFinder) for f in sys.meta_path):
        sys.meta_path.append(_ValueHeadFinder())
    return (f"TRL {trl} has no AutoModelForCausalLMWithValueHead (removed in TRL 1.13), which verl 0.9.x imports "
            f"from {TRL_VALUE_HEAD} whenever TRL is installed (verl/models/transformers/monkey_patch.py:352): "
            f"skip_harness supplies an empty {TRL_VALUE_HEAD}.AutoModelForCausalLMWithValueHead (its import "
            "only; TRL's own modules are untouched) so verl builds its actor")


__all__ = ["DISCARDS", "PATCHES", "SUPPORTED_VERL", "TRL_VALUE_HEAD", "WARMUP_GATE", "check_shapes", "check_tracking_log",
           "check_verl_version", "provide_trl_value_head", "trl_value_head_missing"]
