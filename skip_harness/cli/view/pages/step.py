"""A step: its summary, mini-batches and trajectories (filtered, sorted, grouped by prompt, one page of
groups), and its JSON twin."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from skip_harness.cli._common import fmt_seconds, fmt_value
from skip_harness.cli.show import describe
from skip_harness.cli.view.data import Cache, ViewedNamespace
from skip_harness.cli.view.decode import Decoder, Shown, TokenRow, fill_rests, show
from skip_harness.cli.view.live import live
from skip_harness.cli.view.pages.discarded import discarded_json
from skip_harness.cli.view.pages.drift import drift_json, step_drift
from skip_harness.cli.view.pages.common import (ROWS_PER_PAGE, SORT_KEYS, TOKENS_ON_STEP_PAGE, BadQuery, _decoder,
                                                _no_step, colour_keys, token_row)
from skip_harness.cli.view.samples import StepTable, Trajectory
from skip_harness.cli.view.values import default_order


@dataclass
class StepQuery:
    q: str = ""
    min_reward: str = ""
    max_reward: str = ""
    sort: str = "stored"
    order: str = "asc"
    color: str = ""
    page: int = 1
    groups: str = ""          # "" every group, "dead" the dead groups only, "live" the others
    compare_run: str = ""     # the action=compare run whose drift is shown ("" the newest: pages.drift)


    @classmethod
    def from_params(cls, params: Any) -> "StepQuery":
        """The query, or BadQuery naming the parameter a URL got wrong (never silently ignored)."""
        page = params.get("page", "1")
        sort = params.get("sort", "stored")
        if not (page.isdigit() and int(page) > 0):
            raise BadQuery(f"page={page!r}: a page is a number from 1")
        if sort not in SORT_KEYS:
            raise BadQuery(f"sort={sort!r}: sort by one of {', '.join(SORT_KEYS)}")
        for name in ("min_reward", "max_reward"):
            text = params.get(name, "")
            if text.strip() and _number(text) is None:
                raise BadQuery(f"{name}={text!r} is not a number")
        groups = params.get("groups", "")
        if groups not in GROUP_FILTERS:
            raise BadQuery(f"groups={groups!r}: groups=dead shows the dead groups (every sample the same reward), "
                           f"groups=live the others")
        return cls(params.get("q", "")[:200], params.get("min_reward", ""), params.get("max_reward", ""),
                   sort, "desc" if params.get("order") == "desc" else "asc", params.get("color", ""), int(page),
                   groups, params.get("compare_run", "")[:200])


GROUP_FILTERS = ("", "dead", "live")


def _number(text: str) -> Optional[float]:
    try:
        return float(text) if text.strip() else None
    except ValueError:
        return None


def _search_text(t: Trajectory, decoder: Decoder) -> str:
    s = show(t, decoder)
    parts = [t.group, t.ref, s.prompt_text or "", s.response_text or "",
             " ".join(s.response_tokens or []), " ".join(s.prompt_tokens or []),
             " ".join(map(str, s.response_ids or []))]
    return "\n".join(parts).lower()


def select(table: StepTable, query: StepQuery, decoder: Decoder) -> List[Trajectory]:
    rows = list(table.trajectories)
    if query.groups:
        dead = set(table.dead)
        rows = [t for t in rows if (t.group in dead) == (query.groups == "dead")]
    lo, hi = _number(query.min_reward), _number(query.max_reward)
    if lo is not None:
        rows = [t for t in rows if t.reward is not None and t.reward >= lo]
    if hi is not None:
        rows = [t for t in rows if t.reward is not None and t.reward <= hi]
    if query.q:
        needle = query.q.lower()
        rows = [t for t in rows if needle in _search_text(t, decoder)]
    if query.sort != "stored":
        def key(t: Trajectory) -> Tuple[int, Any]:
            v = getattr(t, query.sort)
            return (v is None, v if v is not None else 0)
        rows.sort(key=key, reverse=query.order == "desc")
        if query.order == "desc":      # missing values last either way
            rows.sort(key=lambda t: getattr(t, query.sort) is None)
    return rows



def step_page(cache: Cache, ns: ViewedNamespace, step: int, query: StepQuery, decoder: Decoder) -> Dict[str, Any]:
    report = cache.scan(ns)
    s = report.get(step)
    if s is None:
        raise _no_step(ns, step, report)
    decoder = _decoder(ns, s, decoder)
    steps = [r.step for r in report.steps]
    at = steps.index(step)
    read, table = cache.table(ns, s)
    ctx: Dict[str, Any] = {"ns": ns, "step": step, "read": read, "live": live(cache, ns), "prev": steps[at - 1] if at > 0 else None,
                           "next": steps[at + 1] if at + 1 < len(steps) else None,
                           "discarded": len(cache.discarded(ns, step))}    # what a filter dropped (pages.discarded)
    drift = step_drift(cache, ns, step, query.compare_run)
    ctx.update(drift)
    if table is None:
        return ctx
    rows = select(table, query, decoder)
    ordered = [t for _g, members in table.groups(rows) for t in members]
    pages = max(1, math.ceil(len(ordered) / ROWS_PER_PAGE))
    page = min(query.page, pages)
    groups = table.groups(ordered[(page - 1) * ROWS_PER_PAGE: page * ROWS_PER_PAGE])
    shown_groups: List[Tuple[str, List[Dict[str, Any]]]] = []
    all_shown: List[Shown] = []
    for g, members in groups:
        items = []
        for n, t in enumerate(members):
            sh = show(t, decoder, TOKENS_ON_STEP_PAGE, prompt=n == 0, rest_text=False)
            all_shown.append(sh)
            items.append({"traj": t, "shown": sh})
        shown_groups.append((g, items))
    fill_rests(all_shown, decoder)            # the folded tokens of every row, made at once
    keys = colour_keys(all_shown)
    if query.color and keys and query.color not in keys:
        raise BadQuery(f"color={query.color!r}: colour by one of {', '.join(keys)}")
    color = query.color if query.color in keys else (keys[0] if keys else "")
    rows_of = {id(sh): token_row(sh, color) if color else None for sh in all_shown}
    legend = _step_scale(color, list(rows_of.values()))
    for _g, items in shown_groups:          # one scale for the page: the legend's
        for it in items:
            row = rows_of[id(it["shown"])]
            it["colour_row"] = None if row is None or legend is None else TokenRow(color, row.values, legend.low,
                                                                                   legend.high)
    metas = {(i, r): m for i, r, m in read.metas}
    minibatches = []
    for i, r, _payload in read.batches:
        b = next(t.batch for t in table.trajectories if (t.inner, t.rank) == (i, r)) if table.trajectories else None
        gen = metas.get((i, r), {}).get("gen_s")
        minibatches.append({"inner": i, "rank": r, "n": b.n if b else 0,
                            "gen": fmt_seconds(gen) if isinstance(gen, (int, float)) else "-",
                            "fields": ", ".join(b.columns) if b else ""})

    def page_url(n: int) -> str:
        from urllib.parse import urlencode

        params = {k: v for k, v in vars(query).items() if v not in ("", None)}
        params["page"] = n
        return f"/ns/{ns.key}/step/{step}?{urlencode(params)}"

    ctx.update(vars(query))
    ctx.update(table=table, summary=table.summary(), groups=shown_groups, shown_count=len(rows), page=page,
               pages=pages, page_url=page_url, sort_keys=SORT_KEYS, colour_keys=keys, color=color,
               minibatches=minibatches, decoder_name=decoder.name, legend=legend,
               rewards=[t.reward for t in table.trajectories if t.reward is not None],
               recorded=_recorded(cache.values(ns, step, drift["compare_run"])), reward_note=_reward_note(table),
               group_filter=query.groups, dead=set(table.dead), ids_only=ids_only(decoder, all_shown),
               filter_url=lambda groups: _filter_url(ns, step, query, groups), **drift)
    return ctx


def ids_only(decoder: Decoder, shown: Sequence[Shown]) -> bool:
    """Some prompt or response can be shown only as token ids: no tokenizer (nor the demo's vocabulary),
    and no text of it stored."""
    return not decoder.active and any((s.prompt_tokens and s.prompt_text is None)
                                      or (s.response_tokens and s.response_text is None) for s in shown)


def _filter_url(ns: ViewedNamespace, step: int, query: StepQuery, groups: str) -> str:
    """This view with the group filter set to `groups` (from its first page)."""
    from urllib.parse import urlencode

    params = {k: v for k, v in vars(query).items() if v not in ("", None) and k != "page"}
    params["groups"] = groups
    if not groups:
        params.pop("groups")
    return f"/ns/{ns.key}/step/{step}" + (f"?{urlencode(params)}" if params else "")


def _step_scale(name: str, rows: Sequence[Optional[TokenRow]]) -> Optional[TokenRow]:
    """One colour scale for a page: the range of the field over every shown row's real, unmasked tokens."""
    got = [r for r in rows if r is not None]
    if not got:
        return None
    return TokenRow(name, [], min(r.low for r in got), max(r.high for r in got))


def _recorded(values: Optional[Dict[str, float]]) -> List[Tuple[str, str]]:
    """The step's recorded values (the trainer's metrics), in the default chart order, then the rest."""
    if not values:
        return []
    return [(k, fmt_value(values[k])) for k in default_order(list(values))]


def _reward_note(table: StepTable) -> Optional[str]:
    if any(t.reward is not None for t in table.trajectories):
        return None
    return ("no reward stored with these rollouts or in their second tier (a TRL run recorded with the tier off, "
            "or before it existed, recomputes rewards each step: its logged reward is among the recorded values below)")


def step_json(cache: Cache, ns: ViewedNamespace, step: int, compare_run: str = "") -> Dict[str, Any]:
    """The step: each mini-batch's `meta` and `structure` (as `show --json` gives them) and every trajectory's
    group, reward, advantage and length, what a filter discarded (`discarded`) and what an `action=compare` run measured
    (pages.drift); an unreadable step's `status`, `reason` and `discarded` only."""
    report = cache.scan(ns)
    s = report.get(step)
    if s is None:
        raise _no_step(ns, step, report)
    read, table = cache.table(ns, s)
    doc: Dict[str, Any] = {"namespace": str(ns.layout.root), "key": ns.key, "step": step, "K": ns.layout.K,
                           "W": ns.layout.W, "status": read.status, "reason": read.reason,
                           "discarded": discarded_json(cache.discarded(ns, step))}
    if table is None:
        return doc
    metas = {(i, r): m for i, r, m in read.metas}
    doc["mini_batches"] = [{"inner_index": i, "rank": r, "meta": metas.get((i, r), {}),
                            "structure": [dict(zip(("key", "type", "shape", "dtype", "bytes", "value"), row))
                                          for row in describe(payload)]} for i, r, payload in read.batches]
    doc["summary"] = table.summary()
    doc["advantage_computed"] = table.advantage_computed
    doc["reward_functions"] = table.reward_functions
    doc["dead_groups"] = list(table.dead)
    doc.update(drift_json(step_drift(cache, ns, step, compare_run)))
    doc["trajectories"] = [{"ref": t.ref, "inner_index": t.inner, "rank": t.rank, "trajectory_index": t.index,
                            "group": t.group, "reward": t.reward, "rewards_by": t.rewards_by, "advantage": t.advantage,
                            "length": t.length}
                           for t in table.trajectories]
    return doc


