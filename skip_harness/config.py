"""Config schemas (dataclasses registered in Hydra's ConfigStore) and the checks across fields.

Type errors (a string where an int belongs, an unknown `action`, steps that are not ints) are caught by
OmegaConf while composing and name the key. Checks that involve several keys run when the config is
turned into these dataclasses (`__post_init__`) and raise :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError
from .layout import NamespaceKey

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
DUMP_DIR_ENV = "SKIP_HARNESS_DUMP_DIR"


class Action(str, Enum):
    cache = "cache"
    repeat = "repeat"


class Cleanup(str, Enum):
    delete = "delete"
    quarantine = "quarantine"
    off = "off"


class OnMismatch(str, Enum):
    error = "error"
    regenerate = "regenerate"


@dataclass
class RolloutTQConfig:
    """`skip.rollout_tq`: the rollout cache."""

    enable: bool = False
    dump_dir: Optional[str] = None
    steps: Optional[List[int]] = None
    action: Action = Action.cache
    cleanup: Cleanup = Cleanup.delete
    lock_timeout: float = 0.0
    on_mismatch: OnMismatch = OnMismatch.error
    # Record torch/numpy/python global RNG states after each generation and restore them on a hit,
    # for trainers whose generation draws from the global generators (the demo does not need it).
    restore_rng: bool = False
    # Write cache files on a background thread (True) or inside `sample` (False, as verl does).
    async_write: bool = True

    def __post_init__(self) -> None:
        key = "skip.rollout_tq"
        if self.steps is not None:
            for i, s in enumerate(self.steps):
                if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                    raise ConfigError(f"{key}.steps[{i}]", f"steps must be ints >= 1 or null, got {s!r}")
        if self.lock_timeout < 0:
            raise ConfigError(f"{key}.lock_timeout", f"must be >= 0 seconds, got {self.lock_timeout}")
        for name, enum in (("action", Action), ("cleanup", Cleanup), ("on_mismatch", OnMismatch)):
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    setattr(self, name, enum(value))
                except ValueError:
                    choices = ", ".join(e.value for e in enum)
                    raise ConfigError(f"{key}.{name}", f"unknown value {value!r}; expected one of {choices}") from None

    def resolved_dump_dir(self) -> Path:
        """The cache root: the explicit key, else $SKIP_HARNESS_DUMP_DIR, else the user's cache dir."""
        if self.dump_dir:
            return Path(self.dump_dir).expanduser()
        env = os.environ.get(DUMP_DIR_ENV)
        if env:
            return Path(env).expanduser()
        from platformdirs import user_cache_dir

        return Path(user_cache_dir("skip_harness")) / "rollouts"

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps


@dataclass
class SkipConfig:
    rollout_tq: RolloutTQConfig = field(default_factory=RolloutTQConfig)


@dataclass
class SeparateAsyncConfig:
    parameter_sync_step: int = 4


@dataclass
class TrainerV1Config:
    trainer_mode: str = "sync"
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)


@dataclass
class TrainerConfig:
    project_name: str = "skip_harness_demo"
    experiment_name: str = "${trainer.v1.trainer_mode}_seed${seed}"
    total_training_steps: int = 20
    test_freq: int = 0
    progress: bool = True
    # torch intra-op threads; null: the machine's cores / processes per machine. Fixed so a run gives
    # the same bits under any launcher (Hydra's joblib workers would otherwise run with one thread).
    torch_threads: Optional[int] = None
    v1: TrainerV1Config = field(default_factory=TrainerV1Config)


@dataclass
class DataConfig:
    train_batch_size: int = 512
    max_prompt_length: int = 8
    max_response_length: int = 10
    val_batch_size: int = 32


@dataclass
class ModelConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4


@dataclass
class RolloutConfig:
    n: int = 8
    temperature: float = 1.0


@dataclass
class OptimConfig:
    lr: float = 3e-3


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    clip_ratio: float = 0.2


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)


@dataclass
class DemoConfig:
    """The whole config of `scripts/train.py` (verl's key names)."""

    seed: int = 0
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    skip: SkipConfig = field(default_factory=SkipConfig)

    def __post_init__(self) -> None:
        k_for(self.trainer.v1.trainer_mode, self.trainer.v1.separate_async.parameter_sync_step)
        positive = {
            "data.train_batch_size": self.data.train_batch_size,
            "data.max_prompt_length": self.data.max_prompt_length,
            "data.max_response_length": self.data.max_response_length,
            "actor_rollout_ref.rollout.n": self.actor_rollout_ref.rollout.n,
            "trainer.total_training_steps": self.trainer.total_training_steps,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(key, f"must be >= 1, got {value}")
        threads = self.trainer.torch_threads
        if threads is not None and threads < 1:
            raise ConfigError("trainer.torch_threads", f"must be >= 1 or null (cores / processes per machine), got {threads}")
        if self.trainer.test_freq < 0:
            raise ConfigError("trainer.test_freq", f"must be >= 0 (0 = no validation), got {self.trainer.test_freq}")
        check_batch_split(self.data.train_batch_size, self.K, 1)

    @property
    def K(self) -> int:
        """Sample calls per step: parameter_sync_step in separate_async, else 1."""
        return k_for(self.trainer.v1.trainer_mode, self.trainer.v1.separate_async.parameter_sync_step)

    def check_world_size(self, world_size: int) -> None:
        check_batch_split(self.data.train_batch_size, self.K, world_size)

    def namespace_key(self, world_size: int) -> NamespaceKey:
        return namespace_key_from_config(self, world_size)


# The config keys that shape the demo's rollouts apart from the learned weights.
DEMO_FINGERPRINT_KEYS = (
    "trainer.v1.trainer_mode",
    "trainer.v1.separate_async.parameter_sync_step",
    "seed",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.model.d_model",
    "actor_rollout_ref.model.n_layers",
    "actor_rollout_ref.model.n_heads",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore. Called explicitly by scripts, never on import."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="demo_schema", node=DemoConfig)
    cs.store(group="skip", name="rollout_tq_schema", node=RolloutTQConfig, package="skip.rollout_tq")


def to_demo_config(cfg: Any) -> DemoConfig:
    """Validate a composed DictConfig (or a dict) into a DemoConfig; raises ConfigError naming the key."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.merge(OmegaConf.structured(DemoConfig), cfg)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, DemoConfig):  # composed without the schema: merge it in
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DemoConfig), cfg))
    return obj


def check_batch_split(train_batch_size: int, K: int, world_size: int) -> None:
    """`data.train_batch_size` is global: each sample on each rank takes train_batch_size / (K x W) prompts."""
    if train_batch_size % (K * world_size) == 0:
        return
    if world_size == 1:
        raise ConfigError(
            "data.train_batch_size",
            f"{train_batch_size} is not a multiple of K = trainer.v1.separate_async.parameter_sync_step = {K} "
            f"(each of the K sample calls of a step takes train_batch_size / K prompts)",
        )
    raise ConfigError(
        "data.train_batch_size",
        f"{train_batch_size} is not a multiple of K x W = {K} x {world_size} "
        f"(each sample on each rank takes train_batch_size / (K x W) prompts)",
    )


def _select(cfg: Any, key: str) -> Any:
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        raise ConfigError(key, "missing; the rollout cache names its namespace with it")
    return value


def k_for(mode: str, parameter_sync_step: Optional[int]) -> int:
    """K from the trainer mode: parameter_sync_step in separate_async, else 1. Checks both keys."""
    if mode not in TRAINER_MODES:
        raise ConfigError("trainer.v1.trainer_mode", f"unknown mode {mode!r}; expected one of {', '.join(TRAINER_MODES)}")
    if parameter_sync_step is not None and parameter_sync_step < 1:
        raise ConfigError("trainer.v1.separate_async.parameter_sync_step", f"must be >= 1, got {parameter_sync_step}")
    return parameter_sync_step if mode == "separate_async" else 1


def k_from_config(cfg: Any) -> int:
    """K for any verl-keyed config (parameter_sync_step is only required in separate_async)."""
    mode = str(_select(cfg, "trainer.v1.trainer_mode"))
    if mode != "separate_async":
        return k_for(mode, None)
    return k_for(mode, int(_select(cfg, "trainer.v1.separate_async.parameter_sync_step")))


def namespace_key_from_config(cfg: Any, world_size: int) -> NamespaceKey:
    """The namespace of any config that uses verl's key names (a DictConfig or the dataclasses)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    check_batch_split(int(_select(cfg, "data.train_batch_size")), k_from_config(cfg), world_size)
    return NamespaceKey(
        experiment_name=str(_select(cfg, "trainer.experiment_name")),
        project_name=str(_select(cfg, "trainer.project_name")),
        train_batch_size=int(_select(cfg, "data.train_batch_size")),
        n=int(_select(cfg, "actor_rollout_ref.rollout.n")),
        max_prompt_length=int(_select(cfg, "data.max_prompt_length")),
        max_response_length=int(_select(cfg, "data.max_response_length")),
        K=k_from_config(cfg),
        W=world_size,
    )


def rollout_tq_from(cfg: Any) -> RolloutTQConfig:
    """The `skip.rollout_tq` node of any trainer's config as a validated RolloutTQConfig."""
    node = OmegaConf.select(cfg, "skip.rollout_tq", default=None) if cfg is not None else None
    merged = OmegaConf.merge(OmegaConf.structured(RolloutTQConfig), node or {})
    return OmegaConf.to_object(merged)
