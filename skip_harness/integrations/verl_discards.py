"""What verl's sampler discarded from a step, and why, handed to the harness (`SkipHarness.discard`).

verl 0.9.x's V1 ``ReplayBuffer`` (and ``ReplayBufferAsync``) drops finished prompt groups inside ``sample``
before it hands a batch to training: DAPO's ``algorithm.filter_groups`` (a group whose samples all scored
the same on the filter's metric: no GRPO signal), groups older than the off-policy bound, failed rollouts
(all in ``_evict_terminal_groups``), and in sync DAPO the surplus groups once enough were kept
(``_clear_groups`` called from ``sample``). The cached step holds only what was kept; this module wraps
those two methods in memory (verl's files untouched) and reports each dropped group's uid with its reason
and, for a DAPO-filtered group, its samples' shared metric value -- read from verl's own classification
before verl clears it. On a served step verl's sampler finds only the recorded (kept) groups, drops
nothing, and the harness keeps the recording's discards. Validation (partition ``val``) is never reported.

Wrapped: ``ReplayBuffer._evict_terminal_groups(global_steps, partition_id, eviction_reasons)`` with
``eviction_reasons`` = (stale uids, DAPO uids, failed uids, counts) and ``ReplayBuffer._clear_groups(
partition_id, uids)`` -- two rows of :data:`verl_patches.PATCHES`, whose :func:`verl_patches.check_shapes`
checks them before :func:`install` runs (a changed one refused by name; a missing one turns
:data:`verl_patches.DISCARDS` off with a WARNING, and the plug-in does not call :func:`install`); read
(best effort, a WARNING when not as expected): ``_dapo_classification_cache[partition]`` ({uid: shared value
or None}), ``partitions[partition]`` (trajectory keys ``{uid}_{i}``), ``filter_groups_metric``.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

log = logging.getLogger("skip_harness")

PARTITION = "train"
STALE = "off-policy: older than trainer.v1 max_off_policy_threshold allows (dropped)"
FAILED = "rollout failed"
SURPLUS = "filter_groups surplus: enough groups were kept for the batch; verl's sync sampler drops the rest"

_state = threading.local()
_installed: Dict[Tuple[type, str], Callable[..., Any]] = {}


def _tied(metric: Optional[str], value: Any) -> str:
    name = "reward" if metric in (None, "reward") else str(metric)
    shown = f"{value:.6g}" if isinstance(value, float) else str(value)
    return f"filter_groups: every sample's {name} was {shown} (no spread, no GRPO signal)"


def _sizes(buffer: Any, partition_id: str, uids: Set[str]) -> Dict[str, int]:
    """Trajectories per dropped group, from verl's metadata snapshot (keys `{uid}_{i}`)."""
    out: Dict[str, int] = {}
    for key in getattr(buffer, "partitions", {}).get(partition_id, {}):
        uid = str(key).split("_")[0]
        if uid in uids:
            out[uid] = out.get(uid, 0) + 1
    return out


def evicted(buffer: Any, partition_id: str, reasons: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """(reason, {uid: rewards or None}) for each kind of group `_evict_terminal_groups` is about to drop."""
    stale, dapo, failed = (set(map(str, reasons[i] or ())) for i in range(3))
    cache = getattr(buffer, "_dapo_classification_cache", {}).get(partition_id, {})
    sizes = _sizes(buffer, partition_id, dapo)
    by_reason: Dict[str, Dict[str, Any]] = {}
    metric = getattr(buffer, "filter_groups_metric", None)
    for uid in sorted(dapo):
        value = cache.get(uid)
        reason = _tied(metric, value) if value is not None else _tied(metric, "the same")
        rewards = [float(value)] * sizes.get(uid, 0) if value is not None and metric in (None, "reward") else None
        by_reason.setdefault(reason, {})[uid] = rewards or None
    for kind, uids in ((STALE, stale - dapo), (FAILED, failed - dapo - stale)):
        if uids:
            by_reason[kind] = {uid: None for uid in sorted(uids)}
    return list(by_reason.items())


def install(plugin: Callable[[], Any], buffer_cls: type, step_of: Callable[[], Any]) -> None:
    """Wrap the two methods (once). `plugin()` is the enabled skip_harness instance (its `harness`), or None;
    `step_of()` the step verl is in (verl's ``SkipManager.step``: the step its decorators cache)."""

    def report(groups: List[Tuple[str, Dict[str, Any]]]) -> None:
        skip = plugin()
        if skip is None or not groups:
            return
        try:
            step = int(step_of())
            for reason, uids in groups:
                skip.harness.discard(step, uids, reason)
        except Exception as exc:  # noqa: BLE001 - what was dropped is a record: it never stops the training
            log.warning("skip_harness: the groups verl's sampler dropped could not be recorded: %s: %s",
                        type(exc).__name__, exc)

    def wrap(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        if (buffer_cls, name) in _installed:
            return
        original = buffer_cls.__dict__[name]
        _installed[(buffer_cls, name)] = original
        setattr(buffer_cls, name, functools.wraps(original)(make(original)))

    def evict(original: Callable[..., Any]) -> Callable[..., Any]:
        def _evict_terminal_groups(self: Any, global_steps: Any, partition_id: str, eviction_reasons: Any) -> Any:
            try:
                groups = evicted(self, partition_id, eviction_reasons) if partition_id == PARTITION and plugin() else []
            except Exception as exc:  # noqa: BLE001 - verl's metadata not as checked: nothing recorded, verl runs on
                log.warning("skip_harness: cannot read which groups verl's sampler drops: %s: %s", type(exc).__name__, exc)
                groups = []
            _state.evicting = True
            try:
                result = original(self, global_steps, partition_id, eviction_reasons)
            finally:
                _state.evicting = False
            report(groups)
            return result
        return _evict_terminal_groups

    def clear(original: Callable[..., Any]) -> Callable[..., Any]:
        def _clear_groups(self: Any, partition_id: str, uids: Any) -> Any:
            surplus = partition_id == PARTITION and uids and not getattr(_state, "evicting", False) and plugin()
            result = original(self, partition_id, uids)
            if surplus:
                report([(SURPLUS, {str(u): None for u in sorted(map(str, uids))})])
            return result
        return _clear_groups

    wrap("_evict_terminal_groups", evict)
    wrap("_clear_groups", clear)


def uninstall() -> None:
    """Give verl its own methods back."""
    for (cls, name), original in list(_installed.items()):
        setattr(cls, name, original)
        del _installed[(cls, name)]


__all__ = ["evicted", "install", "uninstall"]
