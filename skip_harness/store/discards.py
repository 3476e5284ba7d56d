"""What a filter discarded from a step and why: the groups a trainer dropped after generating them.

A GRPO trainer with a filter (verl's DAPO `algorithm.filter_groups`: a group whose samples all got the
same reward gives no signal, and is evicted and generated again) trains on fewer groups than it
generated. The step a harness caches is what the trainer kept; what it dropped is recorded beside it:

    {namespace}/.values/discarded-{step}.json    {"discarded": [{"group", "reason", "rewards"}, ...]}

`group` is the trainer's id of the dropped group (verl: the prompt's uid), `reason` why it was dropped
(one line), `rewards` its samples' rewards where the trainer knew them (else null). Like the recorded
values (`store.values`) the file is outside the step's commit record and bound to it (the record's
creation time): a step without one is complete, a step removed and written again drops it
(`Namespace.remove_step`), and `StepReader.read_discarded` answers None for a file of another write.
Written whole through the namespace's backend by the run that recorded the step, create-only the first
time (a reader never replaces a recording's), on the writer thread after the step's commit. JSON only;
non-finite rewards are stored as the strings "NaN", "Infinity" and "-Infinity".

This module does no logging: it raises or returns, and the harness reports.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from skip_harness.store.layout import VALUES_DIR
from skip_harness.store.namespace import Namespace
# non-finite rewards as the recorded values write them ("NaN", "Infinity", "-Infinity")
from skip_harness.store.values import _decode, _encode

DISCARDS_FORMAT = 1


def discards_key(step: int) -> str:
    return f"{VALUES_DIR}/discarded-{int(step)}.json"


@dataclass(frozen=True)
class Discarded:
    """One dropped group: its id, why, and its samples' rewards (None when the trainer did not say)."""

    group: str
    reason: str
    rewards: Optional[Tuple[float, ...]] = None

    def to_json(self) -> Dict[str, Any]:
        rewards = None if self.rewards is None else [_encode(r) for r in self.rewards]
        return {"group": self.group, "reason": self.reason, "rewards": rewards}


@dataclass(frozen=True)
class StepDiscards:
    """A step's discarded groups as stored, the commit record they belong to, and when they were written."""

    step: int
    discarded: Tuple[Discarded, ...]
    commit_created: Optional[float]
    recorded: float


class DiscardStore:
    """The discard files of one namespace, through its backend (safe from any thread)."""

    def __init__(self, namespace: Namespace):
        self.namespace = namespace

    def write_step(self, step: int, discarded: Sequence[Discarded], *, commit_created: Optional[float],
                   create_only: bool = True) -> bool:
        """Store the step's discarded groups whole. `create_only` (the first write of a run): only where
        the step has none (False when it has: they are kept); else replacing them atomically (the same
        run's later reports of the step, merged)."""
        doc = {"format": DISCARDS_FORMAT, "step": int(step), "commit_created": commit_created,
               "recorded": time.time(), "discarded": [d.to_json() for d in discarded]}
        data = (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()
        key = discards_key(step)
        if create_only:
            self.namespace.locker.fence(key=key)
            return self.namespace.storage.put_if_absent(key, data) is not None
        self.namespace.write_small(key, data)
        return True

    def read_step(self, step: int) -> Optional[StepDiscards]:
        """The step's discards as stored (not checked against its commit record); None when there are
        none, or the file does not parse (a discard file is never a fault of the step)."""
        try:
            data = self.namespace.read_small(discards_key(step))
        except Exception:  # noqa: BLE001 - unreadable: the step simply shows none
            return None
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(doc, dict) or doc.get("format") != DISCARDS_FORMAT or doc.get("step") != int(step):
            return None
        raw = doc.get("discarded")
        if not isinstance(raw, list):
            return None
        out: List[Discarded] = []
        for item in raw:
            if not isinstance(item, dict) or not isinstance(item.get("group"), str) \
                    or not isinstance(item.get("reason"), str):
                continue
            rewards = item.get("rewards")
            kept = None
            if isinstance(rewards, list):
                decoded = [_decode(r) for r in rewards]
                kept = tuple(r for r in decoded if r is not None)
            out.append(Discarded(item["group"], item["reason"], kept))
        created = doc.get("commit_created")
        created = float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else None
        recorded = doc.get("recorded")
        recorded = float(recorded) if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) else 0.0
        return StepDiscards(int(step), tuple(out), created, recorded)


__all__ = ["DISCARDS_FORMAT", "DiscardStore", "Discarded", "StepDiscards", "discards_key"]
