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

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from skip_harness.config import ROLLOUT_TQ_KEY, RolloutTQConfig, check_batch_split, settings_from
from skip_harness.errors import ConfigError

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

_MISSING = object()


class _EveryStep:
    """``skip.rollout_tq.steps`` as verl's decorator reads it (``step in steps``) with ``all_steps``."""

    def __contains__(self, step: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "every step (skip_harness.all_steps)"


EVERY_STEP = _EveryStep()


@dataclass(frozen=True)
class VerlPlan:
    """Everything the plug-in needs, validated before any work."""

    settings: RolloutTQConfig
    namespace: Dict[str, Any]
    fingerprint: Dict[str, Any]
    K: int
    n: int
    train_batch_size: int
    trainer_mode: str
    all_steps: bool
    total_training_steps: Optional[int]

    @property
    def prompts_per_sample(self) -> int:
        return self.train_batch_size // self.K


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _select(cfg: Any, key: str, default: Any = _MISSING) -> Any:
    value = OmegaConf.select(cfg, key, default=default)
    return _plain(value)


def _int(cfg: Any, key: str, *, minimum: int, default: Any = _MISSING) -> int:
    value = _select(cfg, key, default=default)
    if value is _MISSING or value is None:
        raise ConfigError(key, "missing; the verl rollout cache needs it")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, f"must be an int >= {minimum}, got {value!r}")
    return value


def k_of(cfg: Any) -> Tuple[str, int]:
    """(trainer mode, K) as verl's V1 trainer computes them: K =
    ``trainer.v1.{trainer_mode}.parameter_sync_step``, 1 when the mode has none (sync, colocate_async)."""
    mode = _select(cfg, "trainer.v1.trainer_mode", default="sync")
    if not isinstance(mode, str) or not mode:
        raise ConfigError("trainer.v1.trainer_mode", f"must be a trainer mode name, got {mode!r}")
    key = f"trainer.v1.{mode}.parameter_sync_step"
    K = _int(cfg, key, minimum=1, default=1)
    return mode, K


def _node(cfg: Any) -> Dict[str, Any]:
    node = OmegaConf.select(cfg, NODE, default=None)
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise ConfigError(NODE, f"must be a mapping of skip_harness settings, got {_plain(node)!r}")
    return dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]  # a DictConfig: a dict


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
    values: Dict[str, Any] = {key: _select(cfg, key, default=None) for key in FINGERPRINT_KEYS}
    for key in extra_keys:
        value = _select(cfg, key)
        if value is _MISSING:
            raise ConfigError(f"{NODE}.fingerprint_keys", f"{key!r} is not in the config (mistyped?)")
        values[key] = value
    values["parameter_sync_step"] = K
    return values


def plan_of(local_config: Any, cfg: Any) -> VerlPlan:
    """Validate everything the plug-in takes from verl's config (`cfg`, the whole config SkipManager.init got)."""
    settings, all_steps, extra = settings_of(local_config, cfg)
    mode, K = k_of(cfg)
    train_batch_size = _int(cfg, "data.train_batch_size", minimum=1)
    gen = _select(cfg, "data.gen_batch_size", default=None)
    gbs = train_batch_size if gen is None else _int(cfg, "data.gen_batch_size", minimum=1)
    if train_batch_size % K:
        # verl asserts this in PPOTrainer.step; say it before any work, naming both keys
        raise ConfigError("data.train_batch_size", f"{train_batch_size} is not a multiple of K = "
                          f"trainer.v1.{mode}.parameter_sync_step = {K} (each of the K sample calls of a step "
                          "takes train_batch_size / K prompts)")
    check_batch_split(train_batch_size, K, 1)
    n = _int(cfg, "actor_rollout_ref.rollout.n", minimum=1)
    # verl's RolloutSkip names the namespace with trainer.get(..., default) -- keep its defaults
    namespace = {
        "experiment_name": str(_select(cfg, "trainer.experiment_name", default=None) or "default_experiment_name"),
        "project_name": str(_select(cfg, "trainer.project_name", default=None) or "default_project_name"),
        "train_batch_size": gbs,
        "n": n,
        "max_prompt_length": _int(cfg, "data.max_prompt_length", minimum=0, default=0),
        "max_response_length": _int(cfg, "data.max_response_length", minimum=0, default=0),
        "K": K,
    }
    total = _select(cfg, "trainer.total_training_steps", default=None)
    if not isinstance(total, int) or isinstance(total, bool):
        # verl's trainer computes it (steps per epoch x epochs) and writes it, times K, into the
        # optimizer's config before fit() builds the skip classes
        optim = _select(cfg, "actor_rollout_ref.actor.optim.total_training_steps", default=None)
        total = optim // K if isinstance(optim, int) and not isinstance(optim, bool) and optim > 0 else None
    return VerlPlan(
        settings=settings,
        namespace=namespace,
        fingerprint=fingerprint_of(cfg, K, extra),
        K=K,
        n=n,
        train_batch_size=train_batch_size,
        trainer_mode=mode,
        all_steps=all_steps,
        total_training_steps=total if isinstance(total, int) and not isinstance(total, bool) else None,
    )


def role_enabled(cfg: Any, role: str) -> bool:
    return bool(_select(cfg, f"skip.{role}.enable", default=False))


def describe(plan: VerlPlan, steps: Any) -> str:
    s = plan.settings
    return (f"K = {plan.K} (trainer.v1.{plan.trainer_mode}), action {s.action.value}, steps {steps!r}, "
            f"cleanup {s.cleanup.value}, on_mismatch {s.on_mismatch.value}")
