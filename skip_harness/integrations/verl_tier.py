"""verl's second tier: the V1 trainer's reference log-probs and colocated rewards served on a replay.

:mod:`verl_hooks` wraps two more of ``PPOTrainer``'s methods (in memory; verl's files untouched; their
shape checked when the plug-in loads) and hands each training call here, which routes it through
:meth:`SkipHarness.phase` (docs/api.md#the-second-tier-rewards-and-reference-log-probs):

- ``_compute_ref_log_prob(batch, metrics)``, the reference policy's forward pass: verl writes the
  ``ref_log_prob`` field (a jagged tensor per trajectory) of the mini-batch's keys into TransferQueue and
  sets ``calculate_entropy`` / ``compute_loss`` / ``temperature`` (``no_lora_adapter``) in the batch's
  ``extra_info``. That field, read back as verl wrote it, and those ``extra_info`` entries are the
  ``reference`` phase's values. Its validity key: the reference model's path, a digest of its
  ``config.json`` and of verl's ``actor_rollout_ref.model`` node, the reference settings
  (``actor_rollout_ref.ref``, the rollout temperature its forward reads, ``use_kl_loss``,
  ``kl_loss_coef``, ``kl_loss_type``, ``use_kl_in_reward``, ``kl_penalty``, ``kl_ctrl``).
- ``_compute_reward_colocate(batch, metrics)``, a colocated reward model (verl calls it when the reward
  loop has no workers of its own): verl writes ``rm_scores`` and the reward's extra infos
  (``meta_info["reward_extra_keys"]`` of what ``reward_loop_manager.compute_rm_score`` returned) into
  TransferQueue; those fields, read back, are the ``reward`` phase's values. Its key: each sub-node of
  verl's ``reward`` config (the reward manager, the reward model and its path, the custom reward
  function's path and name, the sandbox ...; ``num_workers`` aside), a digest of the custom reward
  function's source file, and the tokenizer the reward decodes with.

On a step served from the cache whose key matches, the stored fields are put back into TransferQueue for
this call's keys (in the mini-batch's order: the same groups in the same order, as the replay serves them)
and verl's method does not run; otherwise it runs and its fields are stored (after the step's commit).
Validation (partition ``val``) always runs verl's own method. ``skip_harness.tier=false`` turns it off.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Dict, List, Tuple

from skip_harness.nodes import select
from skip_harness.run.tier import REFERENCE, REWARD, digest_text, phase_label

log = logging.getLogger("skip_harness")

PARTITION = "train"
#: the config keys of the reference settings (besides the model and ``actor_rollout_ref.ref``)
REFERENCE_SETTINGS = (
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty",
    "algorithm.kl_ctrl",
)
#: keys of verl's ``reward`` node that change no reward value
REWARD_NOT_KEYED = ("num_workers",)
_SCALARS = (bool, int, float, str, type(None))


def _digest(value: Any) -> str:
    return digest_text(json.dumps(value, sort_keys=True, default=str))


def _file_digest(path: Any) -> str:
    """A digest of a local file's text, '' when there is none (a Hub name, no path)."""
    if not path:
        return ""
    path = os.path.expanduser(str(path))
    try:
        with open(path, "rb") as f:
            return digest_text(f.read().decode("utf-8", "replace"))
    except OSError:
        return ""


def _model_config_digest(path: Any) -> str:
    if not path:
        return ""
    path = os.path.expanduser(str(path))
    return _file_digest(os.path.join(path, "config.json")) if os.path.isdir(path) else ""


def reference_key(cfg: Any) -> Dict[str, str]:
    """The reference side's validity key, from verl's whole config."""
    model = select(cfg, "actor_rollout_ref.model") or {}
    path = model.get("path") if isinstance(model, dict) else None
    key = {
        "reference model path": str(path),
        "reference model config.json": _model_config_digest(model.get("hf_config_path") or path
                                                            if isinstance(model, dict) else path),
        "actor_rollout_ref.model": _digest(model),
        "actor_rollout_ref.ref": _digest(select(cfg, "actor_rollout_ref.ref")),
    }
    for name in REFERENCE_SETTINGS:
        key[name] = json.dumps(select(cfg, name), sort_keys=True, default=str)
    return key


def reward_key(cfg: Any) -> Dict[str, str]:
    """The reward side's validity key, from verl's whole config."""
    node = select(cfg, "reward") or {}
    key: Dict[str, str] = {}
    if isinstance(node, dict):
        for name in sorted(node):
            if name not in REWARD_NOT_KEYED:
                key[f"reward.{name}"] = _digest(node[name])
    function = node.get("custom_reward_function") if isinstance(node, dict) else None
    if isinstance(function, dict) and function.get("path"):
        key[f"reward function {function.get('name') or 'compute_score'}"] = _file_digest(function["path"])
    model = select(cfg, "reward.reward_model.model_path")
    if model:
        key["reward model config.json"] = _model_config_digest(model)
    key["tokenizer"] = str(select(cfg, "actor_rollout_ref.model.tokenizer_path")
                           or select(cfg, "actor_rollout_ref.model.path"))
    return key


class Keys:
    """One plug-in instance's validity keys (computed once: reading files each call would cost)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._keys: Dict[str, Dict[str, str]] = {}

    def of(self, phase: str) -> Dict[str, str]:
        if phase not in self._keys:
            self._keys[phase] = reference_key(self.cfg) if phase == REFERENCE else reward_key(self.cfg)
        return self._keys[phase]


def _scalar_items(info: Any) -> Dict[str, Any]:
    return {str(k): v for k, v in dict(info or {}).items() if isinstance(v, _SCALARS)}


def _read(batch: Any, fields: List[str]) -> Any:
    import transfer_queue as tq

    return tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id, select_fields=list(fields))


def _put(batch: Any, data: Any) -> None:
    import transfer_queue as tq

    tq.kv_batch_put(keys=list(batch.keys), partition_id=batch.partition_id, fields=data)


def _said(step: int, phase: str, what: str) -> None:
    """One line per call of a tiered phase: `step 2: reference log-probs served from the cache (no reference
    forward)`, or `... verl's _compute_ref_log_prob ran (the reference forward)`."""
    log.info("step %d: %s %s", step, phase_label(phase), what)


def _fits(phase: str, values: Any, batch: Any, step: int) -> bool:
    """Whether stored values hold one row per key of this mini-batch; else a WARNING, and the phase runs."""
    stored = values.get("fields") if isinstance(values, dict) else None
    size = getattr(stored, "batch_size", None)
    rows = int(size[0]) if size else -1
    if rows == len(batch.keys):
        return True
    log.warning("step %s: the stored %s hold %d rows, this mini-batch %d: verl's own method runs",
                step, phase_label(phase), rows, len(batch.keys))
    return False


def reference(harness: Any, keys: Keys, trainer: Any, batch: Any, metrics: Any,
              original: Callable[..., Any]) -> Any:
    """verl's ``_compute_ref_log_prob``, served or run (module docstring)."""
    ran: List[Any] = []

    def compute() -> Dict[str, Any]:
        before = _scalar_items(batch.extra_info)
        ran.append(original(trainer, batch, metrics))
        after = _scalar_items(batch.extra_info)
        changed = {k: v for k, v in after.items() if k not in before or before[k] != v}
        return {"fields": _read(batch, ["ref_log_prob"]), "extra_info": changed}

    return _served_or_run(harness, keys, REFERENCE, trainer, batch, compute, ran,
                          lambda: original(trainer, batch, metrics),
                          "verl's _compute_ref_log_prob ran (the reference forward)",
                          "served from the cache (no reference forward)")


def reward(harness: Any, keys: Keys, trainer: Any, batch: Any, metrics: Any,
           original: Callable[..., Any]) -> Any:
    """verl's ``_compute_reward_colocate``, served or run (module docstring)."""
    ran: List[Any] = []

    def compute() -> Dict[str, Any]:
        extra, result = _with_reward_keys(trainer, lambda: original(trainer, batch, metrics=metrics))
        ran.append(result)
        return {"fields": _read(batch, ["rm_scores", *extra])}

    return _served_or_run(harness, keys, REWARD, trainer, batch, compute, ran,
                          lambda: original(trainer, batch, metrics=metrics),
                          "verl's _compute_reward_colocate ran (the reward model)",
                          "served from the cache (no reward model call)")


def _served_or_run(harness: Any, keys: Keys, phase: str, trainer: Any, batch: Any,
                   compute: Callable[[], Dict[str, Any]], ran: List[Any], run_again: Callable[[], Any],
                   ran_line: str, served_line: str) -> Any:
    """One phase of a step through `SkipHarness.phase`: verl's own result when `compute` ran it; else the
    stored values put back into the batch (its `extra_info` entries too, where stored), or verl's method
    run after all when they do not fit the batch."""
    step = int(trainer.global_steps)
    values = harness.phase(phase, step, compute, key=keys.of(phase))
    if ran:
        _said(step, phase, ran_line)
        return ran[0]
    if not _fits(phase, values, batch, step):
        return run_again()
    if "extra_info" in values:
        batch.extra_info.update(values.get("extra_info") or {})
    _put(batch, values["fields"])
    _said(step, phase, served_line)
    return batch


def _with_reward_keys(trainer: Any, call: Callable[[], Any]) -> Tuple[List[str], Any]:
    """Run `call` (verl's method), hearing the reward extra keys of what ``compute_rm_score`` returned
    (verl writes them into TransferQueue and returns only the batch): the instance's method is wrapped
    for the call, then restored."""
    manager = trainer.reward_loop_manager
    heard: List[str] = []
    own = "compute_rm_score" in vars(manager)
    method = manager.compute_rm_score

    def compute_rm_score(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        heard.extend(str(k) for k in (getattr(out, "meta_info", None) or {}).get("reward_extra_keys", []))
        return out

    manager.compute_rm_score = compute_rm_score
    try:
        result = call()
    finally:
        if own:
            manager.compute_rm_score = method
        else:
            del manager.compute_rm_score
    return heard, result


__all__ = ["Keys", "reference", "reference_key", "reward", "reward_key"]
