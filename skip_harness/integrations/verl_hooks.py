"""The V1 trainer's calls verl's skip decorators do not reach, wrapped in memory (verl's files untouched).

verl decorates two places for a skip class: ``PPOTrainer._add_batch_to_generate`` (the step's batch) and
``ReplayBuffer.sample`` / ``ReplayBufferAsync.sample`` (each mini-batch). Three things a cached run needs
happen elsewhere, so :func:`install` wraps them -- each wrapper calls verl's own method and hands the plug-in
what it needs; with the plug-in off (or another ``skip.rollout_tq`` class) they pass straight through:

- ``PPOTrainer._add_prompts_to_generate(num_prompts)``: every prompt a V1 trainer submits outside the step's
  batch -- the async warm-up and the sampler's refills of stale, DAPO-filtered or failed groups. Recorded
  as the step's extra submissions (step, index); on a served step the dataloader still advances by the
  same prompts (so later steps draw what they drew) and nothing is sent to the rollout.
- ``PPOTrainer._add_async_warmup_batches(num_warmup_batches)``: verl 0.9.1 returns early whenever
  ``skip.rollout_tq.enable`` is set; with the plug-in its own body runs as with caching off, so a cached
  run keeps its warm-up (recorded, then served).
- the samplers' ``sample`` (outside verl's decorator): what ``sample`` returned beside the batch (the
  off-policy, DAPO filter and eviction counts) is stored with the mini-batch, and returned on a hit.
- ``PPOTrainer._compute_ref_log_prob(batch, metrics)`` and ``_compute_reward_colocate(batch, metrics)``:
  the second tier (:mod:`verl_tier`): on a served step whose validity key matches, what verl's method
  wrote into TransferQueue is put back and the method does not run.

Each wrapped method's shape is checked before :func:`install` runs (:func:`verl_patches.check_shapes`, its
table :data:`verl_patches.PATCHES`): a verl whose methods take other arguments (or whose warm-up no longer
reads ``skip.rollout_tq.enable``) is refused with an ImportError naming the verl version and the method.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

_state = threading.local()

#: the trainer's phases the second tier serves (verl_tier): method -> the harness's phase name
TIER_METHODS = {"_compute_ref_log_prob": "reference", "_compute_reward_colocate": "reward"}
_installed: Dict[Tuple[type, str], Callable[..., Any]] = {}
_shared: Dict[str, Any] = {}


def current_trainer() -> Any:
    """The PPOTrainer whose calls the wrappers saw last (one trainer per process)."""
    return _shared.get("trainer")


def _remember(trainer: Any) -> None:
    _shared["trainer"] = trainer


def in_warmup() -> bool:
    return bool(getattr(_state, "warmup", False))


@contextlib.contextmanager
def _warmup() -> Iterator[None]:
    _state.warmup = True
    try:
        yield
    finally:
        _state.warmup = False


@contextlib.contextmanager
def _gate_open(config: Any) -> Iterator[None]:
    """verl's config with ``skip.rollout_tq.enable`` read as false, for the warm-up's own body only."""
    from omegaconf import open_dict

    node = config.skip.rollout_tq
    with open_dict(node):
        before = node.enable
        node.enable = False
        try:
            yield
        finally:
            node.enable = before


def install(plugin: Callable[[], Any], classes: Dict[str, type]) -> None:
    """Wrap the methods (once). `plugin()` is the enabled skip_harness instance, or None."""
    trainer_cls = classes["PPOTrainer"]

    def wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        if (cls, name) in _installed:
            return
        original = cls.__dict__[name]
        wrapper = functools.wraps(original)(make(original))
        _installed[(cls, name)] = original
        setattr(cls, name, wrapper)

    def add_prompts(original: Callable[..., Any]) -> Callable[..., Any]:
        def _add_prompts_to_generate(self: Any, num_prompts: int) -> int:
            _remember(self)
            skip = plugin()
            if skip is None:
                return original(self, num_prompts)
            return skip.extra_submission(self, int(num_prompts), lambda: original(self, num_prompts),
                                         kind="warmup" if in_warmup() else "refill")
        return _add_prompts_to_generate

    def warmup(original: Callable[..., Any]) -> Callable[..., Any]:
        def _add_async_warmup_batches(self: Any, num_warmup_batches: Any) -> None:
            _remember(self)
            skip = plugin()
            if skip is None or not bool(self.config.skip.rollout_tq.enable):
                return original(self, num_warmup_batches)
            with _warmup(), _gate_open(self.config):
                return original(self, num_warmup_batches)
        return _add_async_warmup_batches

    def add_batch(original: Callable[..., Any]) -> Callable[..., Any]:
        def _add_batch_to_generate(self: Any) -> Any:
            _remember(self)
            return original(self)
        return _add_batch_to_generate

    def sample(original: Callable[..., Any]) -> Callable[..., Any]:
        def sample(self: Any, global_steps: int, partition_id: str, batch_size: int) -> Any:
            result = original(self, global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
            skip = plugin()
            if skip is None:
                return result
            return skip.sampled(result)
        return sample

    def tier(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def method(self: Any, batch: Any, metrics: Any = None) -> Any:
                skip = plugin()
                if skip is None or getattr(batch, "partition_id", None) != "train":
                    return original(self, batch, metrics=metrics)   # validation: verl's own, never tiered
                return skip.tier_phase(phase, self, batch, metrics, original)
            return method
        return make

    wrap(trainer_cls, "_add_prompts_to_generate", add_prompts)
    for name, phase in TIER_METHODS.items():
        wrap(trainer_cls, name, tier(phase))
    wrap(trainer_cls, "_add_async_warmup_batches", warmup)
    wrap(trainer_cls, "_add_batch_to_generate", add_batch)
    for owner in ("ReplayBuffer", "ReplayBufferAsync"):
        wrap(classes[owner], "sample", sample)


def uninstall() -> None:
    """Give verl its own methods back."""
    for (cls, name), original in list(_installed.items()):
        setattr(cls, name, original)
        del _installed[(cls, name)]


# ------------------------------------------------------------------ the sampler's metrics, stored
def encode_metrics(metrics: Any) -> List[List[Any]]:
    """What ``sample`` returned beside the batch, as plain data: ``[[name, value], ...]`` with numbers as
    Python floats / ints, and a dict value (verl's ``_dapo_filtered_reward_counts``: {reward: groups}) as
    ``[[name, [[key, value], ...]]]``."""
    out: List[List[Any]] = []
    for name, value in dict(metrics or {}).items():
        if isinstance(value, dict):
            out.append([str(name), [[_number(k), _number(v)] for k, v in value.items()], "dict"])
        else:
            out.append([str(name), _number(value)])
    return out


def decode_metrics(stored: Optional[List[List[Any]]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in stored or []:
        if len(item) == 3:
            out[str(item[0])] = {k: v for k, v in item[1]}
        else:
            out[str(item[0])] = item[1]
    return out


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    return value
