"""A run's settings, resolved once: the one object :class:`SkipHarness` accepts, and one adapter per front end.

Each front end turns what it has into one frozen :class:`RunSettings`, validated when built (a ConfigError
naming the key), and hands it to ``SkipHarness(settings)``:

- :func:`from_verl_keys` -- a whole config with verl's key names (``skip.rollout_tq``, ``trainer.*``,
  ``data.*``): ``SkipHarness.from_config``, the Hydra startup callback, the verl plug-in
  (``integrations.verl_config.plan_of``) and the demo (``demo.run.validate``);
- :func:`from_parts` -- ``skip.rollout_tq``'s keys and a namespace mapping: ``SkipHarness.create`` and TRL's
  ``attach`` (``integrations.trl_keys.run_settings``).

A config's walk goes down, never back up: front end -> this module -> :mod:`skip_harness.config` (the K
rule, the namespace key, the batch split) -> the store's leaves. K is computed once per build
(``config.k_of``), and the batch split checked once (for the world size known then; again at start only
when the process group's differs). docs/design.md, "How a run's settings are resolved".
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from skip_harness.config import (DUMP_DIR_ENV, NAMED_BY, REPLAY_CHECK_ENV, REPLAY_FROM_ENV, RolloutTQConfig, as_node,
                                 check_batch_split, k_of, namespace_key_from, namespace_key_from_config, plain,
                                 rollout_tq_from, select_int, settings_from)
from skip_harness.errors import HarnessUsageError
from skip_harness.run.recording import check_replay_from
from skip_harness.run.training import training_side
from skip_harness.store.api import Fingerprint, NamespaceKey, flatten_config


@dataclass(frozen=True)
class RunSettings:
    """Everything a :class:`SkipHarness` needs at construction, validated: `rollout` (``skip.rollout_tq``),
    `namespace` (W = 1: the harness sets W from the process group at start; K is in it), the `fingerprint`,
    the flattened `training_config` (what a replay may change), the trainer `mode` and the global
    `train_batch_size` (None for a trainer without them: its batch split is its own), the world size the
    batch split was checked for, `config`: the front end's own validated config (the demo's DemoConfig), and
    how the replay check meets another W (`w_invariant`, `workers_from_config`: run.shape)."""

    rollout: RolloutTQConfig
    namespace: NamespaceKey
    fingerprint: Optional[Fingerprint] = None
    training_config: Optional[Dict[str, Any]] = None
    mode: Optional[str] = None
    train_batch_size: Optional[int] = None
    checked_world_size: int = 1
    config: Any = None
    # run.shape: whether the trainer's training values are the same on any W (how many ranks share a
    # mini-batch) to rounding -- the demo's are; not known of a trainer, so False unless it says -- and
    # whether W is read from the training config (verl's workers: trainer.nnodes x trainer.n_gpus_per_node)
    w_invariant: bool = False
    workers_from_config: bool = False

    def __post_init__(self) -> None:
        for name, kind in (("rollout", RolloutTQConfig), ("namespace", NamespaceKey)):
            if not isinstance(getattr(self, name), kind):
                raise HarnessUsageError(f"RunSettings.{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}"
                                        " (build RunSettings with skip_harness.run.settings.from_parts or from_verl_keys)")
        if self.fingerprint is not None and not isinstance(self.fingerprint, Fingerprint):
            raise HarnessUsageError(f"RunSettings.fingerprint must be a Fingerprint, got {type(self.fingerprint).__name__}")
        if self.rollout.enable:
            check_replay_from(self.rollout, self.namespace)   # the recording, before any run directory is created

    @property
    def K(self) -> int:
        """Sample calls per step."""
        return self.namespace.K

    def check_world_size(self, world_size: int) -> None:
        """The batch split for `world_size` ranks, unless it was checked for it when built (ConfigError)."""
        if self.train_batch_size is not None and world_size != self.checked_world_size:
            check_batch_split(self.train_batch_size, self.K, world_size, self.mode or "separate_async")


def launched_world_size() -> int:
    """The world size a launcher (torchrun, accelerate) set for this process: $WORLD_SIZE, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def from_verl_keys(cfg: Any, *, fingerprint_keys: Sequence[str] = (), rollout: Optional[RolloutTQConfig] = None,
                   training: bool = True, world_size: Optional[int] = None, config: Any = None,
                   fingerprint_of: Optional[Callable[[int], Mapping[str, Any]]] = None, w_invariant: bool = False,
                   workers_from_config: bool = False) -> RunSettings:
    """The adapter for a whole config with verl's key names (an OmegaConf node, a dict or a dataclass).

    `rollout`: the settings when they do not come from its ``skip.rollout_tq`` node (the verl plug-in's);
    `fingerprint_keys`: the keys whose values make the fingerprint (one not in the config is a ConfigError),
    or `fingerprint_of(K)`: its values, computed by the front end (the verl plug-in's);
    `training`: record the training side (the whole config less those keys and the harness's own);
    `world_size`: the ranks the batch split is checked for now (default: $WORLD_SIZE, else 1);
    `w_invariant`, `workers_from_config`: how the replay check meets another W (`RunSettings`, run.shape)."""
    node = as_node(cfg)
    settings = rollout if rollout is not None else rollout_tq_from(node)
    mode, K = k_of(node)                                  # the one K rule
    key = namespace_key_from_config(node, K)              # the one namespace key
    train_batch_size = select_int(node, "data.train_batch_size", minimum=1, why=NAMED_BY)
    assert train_batch_size is not None   # required
    W = launched_world_size() if world_size is None else world_size
    check_batch_split(train_batch_size, K, W, mode)       # the one batch-split check
    keys = tuple(fingerprint_keys)
    if fingerprint_of is not None:
        fingerprint: Optional[Fingerprint] = Fingerprint.from_values(fingerprint_of(K))
    else:
        fingerprint = Fingerprint.from_config(node, keys) if keys else None
    return RunSettings(
        rollout=settings, namespace=key, mode=mode, train_batch_size=train_batch_size, checked_world_size=W,
        fingerprint=fingerprint,
        training_config=training_side(node, keys) if training else None, config=config,
        w_invariant=w_invariant, workers_from_config=workers_from_config,
    )


def with_fingerprint_keys(run: RunSettings, cfg: Any, fingerprint_keys: Sequence[str]) -> RunSettings:
    """`run` (resolved from `cfg` without fingerprint keys, as the Hydra callback hands it over) with the
    fingerprint of `fingerprint_keys` and the training side less them: what `from_verl_keys` would give,
    K and the namespace not resolved again."""
    node, keys = as_node(cfg), tuple(fingerprint_keys)
    return dataclasses.replace(run, fingerprint=Fingerprint.from_config(node, keys) if keys else None,
                               training_config=training_side(node, keys))


def from_parts(settings: Any = None, *, namespace: Union[Mapping[str, Any], NamespaceKey],
               fingerprint: Union[Mapping[str, Any], Fingerprint, None] = None, training_config: Any = None,
               config: Any = None, w_invariant: bool = False) -> RunSettings:
    """The adapter for a trainer without verl's keys: `settings` are ``skip.rollout_tq``'s keys (a dict, an
    OmegaConf node, a RolloutTQConfig or None), `namespace` names the cache (experiment_name, project_name,
    K and whichever shape values the trainer has), `fingerprint` the values that shape the rollouts,
    `training_config` the rest (a nested mapping, recorded flattened), `w_invariant` whether the trainer's
    training values are the same on any number of ranks (run.shape)."""
    if fingerprint is not None and not isinstance(fingerprint, Fingerprint):
        fingerprint = Fingerprint.from_values(fingerprint)
    return RunSettings(
        rollout=settings_from(settings), namespace=namespace_key_from(namespace), fingerprint=fingerprint,
        training_config=None if training_config is None else flatten_config(training_config), config=config,
        w_invariant=bool(w_invariant),
    )


# The Hydra startup callback resolves a job's settings before its task function runs (`on_run_start`, to refuse
# a bad config before the run directory exists): it hands them over, and `on_job_start` and the task function
# take them instead of resolving the same config again. Matched by the config's resolved values and the
# environment the adapters read; one slot (Hydra runs a process's jobs one at a time).
_ENV = ("WORLD_SIZE", DUMP_DIR_ENV, REPLAY_FROM_ENV, REPLAY_CHECK_ENV)
_handed: List[Tuple[Any, RunSettings]] = []


def _identity(config: Any) -> Any:
    try:
        return plain(as_node(config)), tuple(os.environ.get(name) for name in _ENV)
    except Exception:  # noqa: BLE001 - a config that cannot be resolved here matches nothing
        return None


def hand_over(config: Any, settings: RunSettings) -> None:
    """`settings` were resolved from `config`: the next :func:`take` of the same config returns them."""
    _handed[:] = [(_identity(config), settings)]


def take(config: Any) -> Optional[RunSettings]:
    """The settings handed over for `config` (the same resolved values, the same environment), else None."""
    if not _handed:
        return None
    identity, settings = _handed.pop()
    return settings if identity is not None and identity == _identity(config) else None
