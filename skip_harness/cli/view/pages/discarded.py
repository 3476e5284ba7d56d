"""What a filter discarded from a step (store.discards): each dropped group, why, and its samples' rewards --
read from the small record beside the step, never from its payload (the step holds what was kept)."""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Sequence

from markupsafe import Markup, escape

from skip_harness.cli.view.data import Cache, ViewedNamespace
from skip_harness.cli.view.live import live
from skip_harness.cli.view.pages.common import _no_step
from skip_harness.cli.view.style import fmt
from skip_harness.store.api import Discarded

_TIED = (" <span class=\"dead-badge\" title=\"every sample of this group got the same reward: GRPO's advantages "
         "would all be zero\">tied</span>")


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
    return {"ns": ns, "step": step, "live": live(cache, ns), "rows": found, "rows_html": rows_html(found),
            "reasons": reasons.most_common(), "samples": sum(len(d.rewards or ()) for d in found),
            "prev": steps[at - 1] if at > 0 else None, "next": steps[at + 1] if at + 1 < len(steps) else None}


def rows_html(found: Sequence[Discarded]) -> Markup:
    """The table's rows, every value escaped (group names and reasons are the trainer's text), built in one
    pass: the template's loop over 40 groups of 8 rewards cost twice the page's reads (as tokens_html)."""
    parts: List[str] = []
    add = parts.append
    escaped: Dict[str, str] = {}      # one filter gives its groups one reason, a tie at one reward one text

    def once(text: str) -> str:
        out = escaped.get(text)
        if out is None:
            out = escaped[text] = escape(text)
        return out

    for d in found:
        group, rewards = escape(d.group), d.rewards
        add(f'<tr class="discarded-group" data-group="{group}"><td class="mono uid">{group}</td>'
            f'<td>{once(d.reason)}</td>\n<td class="num">')
        if rewards is None:
            add('-</td><td class="num"><span class="facts small">not reported</span></td></tr>')
            continue
        first = rewards[0] if rewards else None
        tied = all(r == first for r in rewards)
        # a tied group (what filter_groups drops) prints its reward n times: equal floats print alike, but
        # for 0.0 and -0.0 ("0", "-0")
        text = ", ".join([fmt(first)] * len(rewards) if tied and first else map(fmt, rewards))
        add(f'{len(rewards)}</td><td class="num">{once(text)}')
        if tied and len(rewards) > 1:
            add(_TIED)         # every sample the same reward: a group with no GRPO signal
        add("</td></tr>")
    return Markup("".join(parts))
