"""What a filter discarded from a step (store.discards): each dropped group, why, and its samples' rewards --
read from the small record beside the step, never from its payload (the step holds what was kept)."""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional

from skip_harness.cli.view.data import Cache, ViewedNamespace
from skip_harness.cli.view.live import live
from skip_harness.cli.view.pages.common import _no_step
from skip_harness.cli.view.style import fmt
from skip_harness.store.api import Discarded


def discarded_json(found: Any) -> List[Dict[str, Any]]:
    """The step JSON's `discarded`: `[{"group", "reason", "rewards"}]` (rewards null when not reported)."""
    return [{"group": d.group, "reason": d.reason, "rewards": None if d.rewards is None else list(d.rewards)}
            for d in found]


def discarded_page(cache: Cache, ns: ViewedNamespace, step: int) -> Dict[str, Any]:
    report = cache.scan(ns)
    if report.get(step) is None:
        raise _no_step(ns, step, report)
    steps = [r.step for r in report.steps]
    at = steps.index(step)
    found = cache.discarded(ns, step)
    reasons = Counter(d.reason for d in found)
    return {"ns": ns, "step": step, "live": live(cache, ns), "rows": [_row(d) for d in found],
            "reasons": reasons.most_common(), "samples": sum(len(d.rewards or ()) for d in found),
            "prev": steps[at - 1] if at > 0 else None, "next": steps[at + 1] if at + 1 < len(steps) else None}


def _row(d: Discarded) -> Dict[str, Any]:
    rewards = d.rewards
    same: Optional[float] = rewards[0] if rewards and all(r == rewards[0] for r in rewards) else None
    return {"group": d.group, "reason": d.reason, "rewards": rewards, "n": None if rewards is None else len(rewards),
            "same": same, "rewards_text": None if rewards is None else ", ".join(map(fmt, rewards))}
