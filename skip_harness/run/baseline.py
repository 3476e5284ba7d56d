"""A replay at another K: what its values that depend on K are compared with.

A recording made at K = 4 holds the values of four updates a step; a replay at K = 1 makes one, on the same
rows: its loss, KL and gradient norm are not the recording's, and no tolerance makes them so. What they can be
compared with is an earlier replay of the same recording at the same K and W whose training side was the
recording's (its config differs only in how the batch is split, `config.BATCH_SPLIT_KEYS`): it trained on the
same rows, in the same order, at the same shape -- the same computation. Replays keep their values in the
recording (`{recording}/.values/runs/{run_id}/`), so the first such replay is the reference of every later
one (the first that ran on this run's machine, when one did: compared exactly, not within rounding noise): a
change of the training side (a learning rate 1% off) is caught at its first step, naming the key.
The same holds at another W for a trainer whose training values depend on W (`run.shape`): the baseline is
then a replay at this W, whose config may differ from the recording's in the keys that change with W.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from skip_harness.config import BATCH_SPLIT_KEYS
from skip_harness.run.machine import as_machine
from skip_harness.run.machine import difference as machine_difference
from skip_harness.run.shape import shard_key
from skip_harness.store.api import ValuesStore, config_changes

log = logging.getLogger("skip_harness")


@dataclass
class Baseline:
    """An earlier replay of the recording at this run's K and W, with the recording's training side."""

    store: Any
    run: str
    training_config: Dict[str, Any]
    _values: Dict[int, Optional[Dict[str, float]]] = field(default_factory=dict)

    _machines: Dict[int, Optional[Dict[str, str]]] = field(default_factory=dict)

    def values(self, step: int) -> Optional[Dict[str, float]]:
        if step not in self._values:
            found = self.store.read_run_step(self.run, step)
            self._values[step] = None if found is None else dict(found.values)
            self._machines[step] = None if found is None else found.machine
        return self._values[step]

    def machine(self, step: int) -> Optional[Dict[str, str]]:
        """The machine that computed the baseline's values of `step` (run.machine); None when not said."""
        self.values(step)
        return self._machines.get(step)


# Keys a trainer writes from K itself: verl sets each optimizer's total_training_steps to
# trainer.total_training_steps x K (its scheduler steps once per update; verl/trainer/ppo/v1/trainer_base.py:777).
DERIVED_FROM_K = (".optim.total_training_steps",)


def _same_training_side(then: Dict[str, Any], cfg: Dict[str, Any], now: Optional[Dict[str, Any]]) -> bool:
    """Whether a replay's config `cfg` differs from the recording's (`then`) only in how the batch is split (K,
    the mode), in what a trainer derives from it, and in the keys that change with W (`config.SHARD_KEYS`),
    these holding this run's (`now`'s) values: a baseline is at this run's K and W."""
    split = {k.rsplit(".", 1)[-1] for k in BATCH_SPLIT_KEYS}
    if now is not None and any(shard_key(k) for k, _, _ in config_changes(cfg, now)):
        return False
    return all(key.rsplit(".", 1)[-1] in split or key.endswith(DERIVED_FROM_K) or shard_key(key)
               for key, _, _ in config_changes(then, cfg))


def find_baseline(namespace: Any, recorded: Optional[Dict[str, Any]], K: int, W: int, own_run: Optional[str],
                  started_before: Optional[float] = None, now: Optional[Dict[str, Any]] = None,
                  machine: Optional[Dict[str, str]] = None) -> Optional[Baseline]:
    """The oldest replay kept in the recording's `namespace` at K and W (its `run.json`'s: the process
    group's), made with the recording's training side (`recorded`, the config recorded with its values) at
    this run's W (`now`'s values of `config.SHARD_KEYS`: verl's worker count), started before this run;
    None when there is none. Of those, the oldest that ran on `machine` (this run's, `run.machine`) and
    did not diverge (its run.json's `diverged_at`) when one did: its values are compared exactly, another
    machine's only within rounding noise -- so the first replay on a machine that reproduced the reference
    within that noise is the machine's exact reference from then on."""
    if recorded is None:
        return None
    started_before = time.time() if started_before is None else started_before
    store = ValuesStore(namespace)
    try:
        runs = store.list_runs()
    except Exception:  # noqa: BLE001 - an unreadable runs directory: no reference
        return None
    oldest: Optional[Baseline] = None
    for run in runs:
        if run == own_run:
            continue
        doc = store.read_run(run) or {}
        cfg = doc.get("training_config")
        if doc.get("K") != K or doc.get("W") != W or not isinstance(cfg, dict):
            continue
        if not isinstance(doc.get("started"), (int, float)) or doc["started"] >= started_before:
            continue
        if _same_training_side(recorded, cfg, now):
            here = machine is not None and not machine_difference(as_machine(doc.get("machine")), machine) \
                and "diverged_at" not in doc
            if here or machine is None:
                log.debug("replay values at K=%d, W=%d compared with replay %s's", K, W, run)
                return Baseline(store, run, cfg)
            oldest = oldest or Baseline(store, run, cfg)
    if oldest is not None:
        log.debug("replay values at K=%d, W=%d compared with replay %s's (another machine's)", K, W, oldest.run)
    return oldest


__all__ = ["Baseline", "find_baseline"]
