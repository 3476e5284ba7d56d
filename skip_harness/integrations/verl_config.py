"""What the verl plug-in reads from verl's own config: settings, namespace, K and fingerprint. Pure: no I/O.

verl's config is composed from its ``ppo_trainer.yaml``; verl accepts only ``skip.<role>.{enable,
dump_dir, steps, action}``, so skip_harness's other settings come from a top-level ``skip_harness`` node
that verl never reads (add it with ``+skip_harness.cleanup=quarantine`` on the command line)::

    skip_harness:
      cleanup: quarantine          # any skip.rollout_tq setting of skip_harness but verl's four keys
      on_mismatch: regenerate
      lock_timeout: 30
      all_steps: true              # cache every step (verl's skip.rollout_tq.steps lists steps one by one)
      fingerprint_keys: [reward.custom_reward_function.path]   # more keys that shape the rollouts
      replay_check: error          # stop at a replay's first divergence (off | warn | error; docs/replay_check.md)

A bad value stops the run before any work with one message naming the key (``skip_harness.cleanup``,
``skip.rollout_tq.action``, ``trainer.v1.separate_async.parameter_sync_step`` ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from skip_harness.config import ROLLOUT_TQ_KEY, RolloutTQConfig, as_node, plain, settings_from
from skip_harness.errors import ConfigError
from skip_harness.nodes import MISSING, select
from skip_harness.run.settings import RunSettings, from_verl_keys

#: The node that holds skip_harness's own settings (verl rejects other keys under ``skip.rollout_tq``).
NODE = "skip_harness"
#: verl's own keys of ``skip.<role>``: they keep verl's meaning and are never taken from NODE.
VERL_KEYS = ("enable", "dump_dir", "steps", "action")

#: verl config keys that shape the rollouts apart from the policy's learned weights. Absent keys
#: (another verl version) are recorded as None; user-named ones (``skip_harness.fingerprint_keys``) must exist.
FINGERPRINT_KEYS = (
    "trainer.v1.trainer_mode",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.custom_chat_template",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.do_sample",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.seed",
    "actor_rollout_ref.rollout.multi_turn",
    "actor_rollout_ref.rollout.agent.default_agent_loop",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    "data.train_files",
    "data.prompt_key",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.train_batch_size",
    "data.gen_batch_size",
    "data.shuffle",
    "data.seed",
    "data.truncation",
    "data.filter_overlong_prompts",
    "data.return_raw_chat",
    "data.apply_chat_template_kwargs",
    "reward.reward_manager",
    "reward.custom_reward_function",
)


class _EveryStep:
    """``skip.rollout_tq.steps`` as verl's decorator reads it (``step in steps``) with ``all_steps``."""

    def __contains__(self, step: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "every step (skip_harness.all_steps)"


EVERY_STEP = _EveryStep()


@dataclass(frozen=True)
class VerlPlan:
    """Everything the plug-in needs, validated before any work: the run's settings (`run`, built by the
    verl-keyed adapter that `SkipHarness.from_config` and the Hydra callback use too) and verl's own extras."""

    run: RunSettings
    n: int
    all_steps: bool
    total_training_steps: Optional[int]

    @property
    def settings(self) -> RolloutTQConfig:
        return self.run.rollout

    @property
    def K(self) -> int:
        return self.run.K

    @property
    def trainer_mode(self) -> str:
        return str(self.run.mode)

    @property
    def train_batch_size(self) -> int:
        return int(self.run.train_batch_size or 0)

    @property
    def namespace(self) -> Dict[str, Any]:
        """The namespace key's values (W left out: the harness sets it)."""
        return {k: v for k, v in dataclasses.asdict(self.run.namespace).items() if k != "W"}

    @property
    def fingerprint(self) -> Dict[str, Any]:
        return dict(self.run.fingerprint.values) if self.run.fingerprint is not None else {}

    @property
    def prompts_per_sample(self) -> int:
        return self.train_batch_size // self.K


def _node(cfg: Any) -> Dict[str, Any]:
    node = OmegaConf.select(cfg, NODE, default=None)   # the node itself: a DictConfig, or it is refused
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise ConfigError(NODE, f"must be a mapping of skip_harness settings, got {plain(node)!r}")
    return dict(plain(node))


def settings_of(local_config: Any, cfg: Any) -> Tuple[RolloutTQConfig, bool, List[str]]:
    """skip_harness settings: verl's four keys from ``skip.rollout_tq`` (`local_config`, verl's dataclass),
    everything else from the ``skip_harness`` node. Returns (settings, all_steps, extra fingerprint keys)."""
    node = _node(cfg)
    for key in VERL_KEYS:
        if key in node:
            raise ConfigError(f"{NODE}.{key}", f"is verl's key: set {ROLLOUT_TQ_KEY}.{key} instead")
    all_steps = node.pop("all_steps", False)
    if not isinstance(all_steps, bool):
        raise ConfigError(f"{NODE}.all_steps", f"must be true or false, got {all_steps!r}")
    extra = node.pop("fingerprint_keys", None) or []
    if not isinstance(extra, list) or not all(isinstance(k, str) and k for k in extra):
        raise ConfigError(f"{NODE}.fingerprint_keys", f"must be a list of dotted config keys, got {extra!r}")
    steps = list(getattr(local_config, "steps", []) or [])
    verl = {
        "enable": bool(getattr(local_config, "enable", False)),
        "dump_dir": str(getattr(local_config, "dump_dir", "") or "") or None,
        "steps": None if all_steps else steps,
        "action": str(getattr(local_config, "action", "cache")),
    }
    try:
        settings = settings_from({**node, **verl})
    except ConfigError as exc:
        field = exc.key[len(ROLLOUT_TQ_KEY) + 1:] if exc.key.startswith(ROLLOUT_TQ_KEY + ".") else ""
        head = field.split(".")[0].split("[")[0]
        if head and head in node:
            message = str(exc)[len(exc.key) + 2:]
            raise ConfigError(f"{NODE}.{field}", message) from None
        raise
    if settings.replay_weights:
        raise ConfigError(f"{NODE}.replay_weights", "not supported in verl: the weights live in its training "
                          "workers, out of the plug-in's reach (docs/verl.md, \"The weights are not in the replay check\")")
    return settings, all_steps, list(extra)


def fingerprint_of(cfg: Any, K: int, extra_keys: List[str]) -> Dict[str, Any]:
    """The values of verl's sampling keys (FINGERPRINT_KEYS, None when absent) and of the user's
    `extra_keys` (a key that is not in the config is a ConfigError naming it), plus K."""
    values: Dict[str, Any] = {key: select(cfg, key) for key in FINGERPRINT_KEYS}
    for key in extra_keys:
        value = select(cfg, key, default=MISSING)
        if value is MISSING:
            raise ConfigError(f"{NODE}.fingerprint_keys", f"{key!r} is not in the config (mistyped?)")
        values[key] = value
    values["parameter_sync_step"] = K
    return values


def plan_of(local_config: Any, cfg: Any) -> VerlPlan:
    """Validate everything the plug-in takes from verl's config (`cfg`, the whole config SkipManager.init got):
    K, the namespace and the batch split by the verl-keyed adapter (`run.settings.from_verl_keys`: one K rule,
    one namespace key, one check), with the settings from its split nodes and verl's fingerprint."""
    cfg = as_node(cfg)
    settings, all_steps, extra = settings_of(local_config, cfg)
    # verl's driver splits a step over its own workers: the plug-in sees each step whole (W = 1)
    # its W for the replay check: verl's workers, read from the recorded training config (run.shape)
    run = from_verl_keys(cfg, rollout=settings, training=False, world_size=1,
                         fingerprint_of=lambda K: fingerprint_of(cfg, K, extra), workers_from_config=True)
    total = select(cfg, "trainer.total_training_steps")
    if not isinstance(total, int) or isinstance(total, bool):
        # verl's trainer computes it (steps per epoch x epochs) and writes it, times K, into the
        # optimizer's config before fit() builds the skip classes
        optim = select(cfg, "actor_rollout_ref.actor.optim.total_training_steps")
        total = optim // run.K if isinstance(optim, int) and not isinstance(optim, bool) and optim > 0 else None
    return VerlPlan(
        run=run,
        n=int(run.namespace.n or 0),
        all_steps=all_steps,
        total_training_steps=total if isinstance(total, int) and not isinstance(total, bool) else None,
    )


def role_enabled(cfg: Any, role: str) -> bool:
    return bool(select(cfg, f"skip.{role}.enable", default=False))


def describe(plan: VerlPlan, steps: Any) -> str:
    s = plan.settings
    return (f"K = {plan.K} (trainer.v1.{plan.trainer_mode}), action {s.action.value}, steps {steps!r}, "
            f"cleanup {s.cleanup.value}, on_mismatch {s.on_mismatch.value}")
