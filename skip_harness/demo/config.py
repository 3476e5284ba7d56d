"""The demo's config: `scripts/train.py`'s whole schema (verl's key names), its fingerprint keys, and
its registration in Hydra's ConfigStore as `demo_schema`. The rollout cache's own schema
(`skip.rollout_tq`), the K rule and the batch split stay in :mod:`skip_harness.config`; the demo's run settings
(K, the namespace, the split: checked once) are built by `demo.run.validate`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from skip_harness.config import SkipConfig, _to_object, register_configs
from skip_harness.errors import ConfigError


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
    test_freq: int = 5
    progress: bool = True  # a progress bar on stderr, drawn only when stderr is a terminal
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
    # verl's KL loss against the reference policy (a frozen copy of the initial one); its log-probs are
    # the second tier's `reference` phase. Off: the loss and every value are as before.
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001


@dataclass
class RewardModelConfig:
    """The demo's reward phase, for the second tier and its bench: off unless one is set."""

    # seconds each reward call spends waiting (a remote judge, a sandbox): the phase's cost
    cost_s: float = 0.0
    # noise added to each reward from the OS's randomness (a judge that is not deterministic)
    noise: float = 0.0


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
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    skip: SkipConfig = field(default_factory=SkipConfig)

    def __post_init__(self) -> None:
        # the fields' own checks; the mode, K and the batch split are the run settings' (demo.run.validate)
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
        for name, amount in (("reward_model.cost_s", self.reward_model.cost_s), ("reward_model.noise", self.reward_model.noise),
                             ("actor_rollout_ref.actor.kl_loss_coef", self.actor_rollout_ref.actor.kl_loss_coef)):
            if not amount >= 0:
                raise ConfigError(name, f"must be >= 0, got {amount}")
        threads = self.trainer.torch_threads
        if threads is not None and threads < 1:
            raise ConfigError("trainer.torch_threads", f"must be >= 1 or null (cores / processes per machine), got {threads}")
        if self.trainer.test_freq < 0:
            raise ConfigError("trainer.test_freq", f"must be >= 0 (0 = no validation), got {self.trainer.test_freq}")


# The config keys that shape the demo's rollouts apart from the learned weights, in every mode.
DEMO_FINGERPRINT_KEYS = (
    "trainer.v1.trainer_mode",
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
# ...and in separate_async, where it is K (sync and colocate_async never read it).
SEPARATE_ASYNC_FINGERPRINT_KEYS = ("trainer.v1.separate_async.parameter_sync_step",)


def demo_fingerprint_keys(mode: str) -> tuple:
    """The demo's fingerprint keys in trainer mode `mode`: what shapes its rollouts in that mode."""
    return DEMO_FINGERPRINT_KEYS + (SEPARATE_ASYNC_FINGERPRINT_KEYS if mode == "separate_async" else ())


def to_demo_config(cfg: Any) -> DemoConfig:
    """Validate a composed DictConfig (or a dict) into a DemoConfig; raises ConfigError naming the key."""
    return _to_object(DemoConfig, cfg, prefix="")


def register_demo_configs() -> None:
    """Register the demo's schema (`demo_schema`) and the rollout cache's in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    register_configs()
    ConfigStore.instance().store(name="demo_schema", node=DemoConfig)
