"""What each page and its JSON twin hold, built from the cache (no HTTP here): the overview, a
namespace, its charts, a step (filtered, sorted, grouped, one page of groups), a trajectory, compare."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from skip_harness.cli._common import fmt_ago, fmt_seconds, fmt_value, human_bytes
from skip_harness.cli.listing import grand_total
from skip_harness.cli.show import describe
from skip_harness.cli.view import charts
from skip_harness.cli.view.data import Cache, Kept, Namespace, StepRead, fingerprint_values as _fp_values, step_stamp
from skip_harness.cli.view.decode import Decoder, Shown, TokenRow, show
from skip_harness.cli.view.decode import fill_rests
from skip_harness.cli.view.pairs import DIFFERS, Pair, Pairing, pair
from skip_harness.cli.view.samples import MASK, StepTable, Trajectory, _last
from skip_harness.cli.view.values import by_prefix, default_order, pick
from skip_harness.store.api import NamespaceReport, STATUSES, StepReport

SORT_KEYS = ("stored", "reward", "advantage", "length", "group")
ROWS_PER_PAGE = 32           # trajectories on one page of a step (its groups in order; a group may go on)
TOKENS_ON_STEP_PAGE = 64     # response tokens of each (all of them on the trajectory's own page)
CHART_STEPS = 200            # steps read for the rollout charts; more are sampled evenly


class NotFound(Exception):
    """A namespace, step or trajectory the cache does not have; the message says which."""


class BadQuery(Exception):
    """A URL parameter that means nothing (a reward bound that is not a number...); the message says which."""


# --------------------------------------------------------------------------------------------
# overview and namespace


def overview(cache: Cache) -> Dict[str, Any]:
    rows, views = [], []
    for ns in cache.namespaces():
        view = cache.namespace_view(ns, read_metas=False)
        views.append(view)
        mode, seed = cache.mode_seed(view)
        rows.append({"key": ns.key, "label": ns.label, "root_index": ns.root_index, "K": ns.layout.K,
                     "W": ns.layout.W, "mode": fmt_value(mode), "seed": fmt_value(seed), "counts": view.counts(),
                     "size": human_bytes(view.bytes), "written": fmt_ago(view.written), "gen": fmt_seconds(view.gen_s)})
    return {"rows": rows, "statuses": STATUSES, "total": grand_total(views),
            "roots": [str(r) for r in cache.roots]}


def overview_json(cache: Cache) -> Dict[str, Any]:
    """`ls --json`'s document (`dump_dir`, `namespaces`, `total_bytes`), each namespace with its `key`."""
    docs = [cache.namespace_doc(ns) for ns in cache.namespaces()]
    return {"dump_dir": str(cache.roots[0]) if len(cache.roots) == 1 else None,
            "roots": [str(r) for r in cache.roots], "namespaces": docs,
            "total_bytes": sum(d["total_bytes"] for d in docs)}


@dataclass
class ChartQuery:
    """What the charts show: picked keys (`k`, repeatable), a search over the keys (`q`), other runs to
    overlay (`with`, namespace keys, repeatable)."""

    keys: List[str]
    q: str
    runs: List[str]

    @classmethod
    def from_params(cls, params: Any) -> "ChartQuery":
        return cls([k for k in params.getlist("k") if k][:200], params.get("q", "")[:200],
                   [r for r in params.getlist("with") if r][:8])

    def query_string(self) -> str:
        from urllib.parse import urlencode

        return urlencode([("k", k) for k in self.keys] + ([("q", self.q)] if self.q else [])
                         + [("with", r) for r in self.runs])


def namespace(cache: Cache, ns: Namespace, summaries: "Summaries", query: Optional[ChartQuery] = None) -> Dict[str, Any]:
    query = query or ChartQuery([], "", [])
    report = cache.scan(ns)
    view = cache.namespace_view(ns, report)
    doc = cache.namespace_doc(ns, view)
    mode, seed = cache.mode_seed(view)
    steps = [{"step": r.report.step, "status": r.report.status, "size": human_bytes(r.report.bytes),
              "written": fmt_ago(r.written), "gen": fmt_seconds(r.gen_s), "reason": r.report.reason,
              "fingerprint": None if r.report.fingerprint is None else r.report.fingerprint.digest} for r in view.rows]
    servable = [s.step for s in report.steps if s.servable]
    series = value_series(cache, ns, summaries, report)
    keys = default_order(list(series))
    shown = pick(keys, query.keys, query.q)
    missing = [k for k in query.keys if k not in series]
    runs = [r for r in query.runs if cache.namespace(r) is not None]
    bad = [r for r in query.runs if r not in runs]
    if missing or bad:
        raise BadQuery("; ".join(([f"no recorded value {', '.join(missing)} in {ns.label}"] if missing else [])
                                 + ([f"no namespace {', '.join(bad)} to overlay"] if bad else [])))
    return {"ns": ns, "doc": doc, "mode": fmt_value(mode), "seed": fmt_value(seed), "size": human_bytes(view.bytes),
            "steps": steps, "note": report.index_note, "ns_rows": compare_choices(cache), "pick_a": ns.key,
            "pick_b": _other(cache, ns.key), "pick_step": servable[-1] if servable else 1,
            "chart_rows": 1 + math.ceil(len(shown) / 2), "chart_extra": 14 * len(runs),
            "value_groups": by_prefix(keys), "charted": set(shown), "query": query, "runs": runs,
            "charts_src": f"/ns/{ns.key}/charts" + (f"?{query.query_string()}" if query.query_string() else ""),
            "key_count": len(keys)}


def value_series(cache: Cache, ns: Namespace, summaries: "Summaries", report: NamespaceReport
                 ) -> Dict[str, List[charts.Point]]:
    """Every recorded numeric value over the charted steps: {key: points}."""
    servable = [s for s in report.steps if s.servable]
    picked = set(chart_steps([s.step for s in servable]))
    values: Dict[str, List[charts.Point]] = {}
    for s in servable:
        if s.step not in picked:
            continue
        for k, v in (summaries.values(cache, ns, s) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                values.setdefault(k, []).append(charts.Point(s.step, float(v)))
    return values


def compare_choices(cache: Cache) -> List[Dict[str, Any]]:
    return [{"key": n.key, "label": n.label, "root_index": n.root_index} for n in cache.namespaces()]


def _other(cache: Cache, key: str) -> str:
    keys = [n.key for n in cache.namespaces()]
    return next((k for k in keys if k != key), key)


class Summaries:
    """Each step's summary (reward and length statistics) and recorded values, kept while its commit
    record's time and size stay the same, so charts read a step once."""

    def __init__(self) -> None:
        self._kept: Kept[Tuple[str, int], Optional[Dict[str, Any]]] = Kept()
        self._values: Kept[Tuple[str, int], Optional[Dict[str, float]]] = Kept()

    def get(self, cache: Cache, ns: Namespace, s: StepReport) -> Optional[Dict[str, Any]]:
        def compute() -> Optional[Dict[str, Any]]:
            table = cache.table(ns, s)[1]
            return None if table is None else table.summary()
        return self._kept.get((ns.key, s.step), step_stamp(s), compute)

    def values(self, cache: Cache, ns: Namespace, s: StepReport) -> Optional[Dict[str, float]]:
        """The step's recorded values, kept while its commit record stays the same."""
        return self._values.get((ns.key, s.step), step_stamp(s), lambda: cache.values(ns, s.step))


def chart_steps(steps: Sequence[int], budget: int = CHART_STEPS) -> List[int]:
    if len(steps) <= budget:
        return list(steps)
    picked = {steps[round(i * (len(steps) - 1) / (budget - 1))] for i in range(budget)}
    return sorted(picked)


def _rollout_series(cache: Cache, ns: Namespace, summaries: Summaries, report: NamespaceReport
                    ) -> Tuple[List[charts.Point], List[charts.Point]]:
    servable = [s for s in report.steps if s.servable]
    picked = set(chart_steps([s.step for s in servable]))
    reward, length = [], []
    for s in servable:
        if s.step not in picked:
            continue
        sm = summaries.get(cache, ns, s)
        if sm is None:
            continue
        if sm["reward_mean"] is not None:
            std = sm["reward_std"] or 0.0
            reward.append(charts.Point(s.step, sm["reward_mean"], sm["reward_mean"] - std, sm["reward_mean"] + std))
        if sm["length_mean"] is not None:
            length.append(charts.Point(s.step, sm["length_mean"], sm["length_min"], sm["length_max"]))
    return reward, length


def namespace_charts(cache: Cache, ns: Namespace, summaries: Summaries, query: Optional[ChartQuery] = None
                     ) -> Dict[str, Any]:
    """The rollouts' reward and length over steps, then the recorded values picked (by default: loss,
    reward, KL, grad norm, lengths... timings last), each overlaid with the runs `with` names; every step's
    status marked along the step axis."""
    query = query or ChartQuery([], "", [])
    report = cache.scan(ns)
    servable = [s for s in report.steps if s.servable]
    picked = set(chart_steps([s.step for s in servable]))
    reward, length = _rollout_series(cache, ns, summaries, report)
    others = []
    for key in query.runs:
        other = cache.namespace(key)
        if other is None:
            raise BadQuery(f"with={key!r}: no such namespace to overlay")
        rep = cache.scan(other)
        others.append((other.label, _rollout_series(cache, other, summaries, rep),
                       value_series(cache, other, summaries, rep)))
    marks = [(s.step, s.status) for s in report.steps]

    def href(step: int) -> str:
        return f"/ns/{ns.key}/step/{step}"

    svgs = [charts.line_chart("reward: mean ± std per step", reward, href, css_id="chart-reward", marks=marks,
                              overlays=[(label, rl[0]) for label, rl, _v in others]),
            charts.line_chart("response length: mean (min .. max)", length, href, css_id="chart-length", marks=marks,
                              overlays=[(label, rl[1]) for label, rl, _v in others])]
    values = value_series(cache, ns, summaries, report)
    keys = default_order(list(values))
    shown = pick(keys, query.keys, query.q)
    for n, k in enumerate(shown):
        svgs.append(charts.line_chart(f"recorded: {k}", values[k], href, css_id=f"chart-value-{n}", marks=marks,
                                      overlays=[(label, v.get(k, [])) for label, _rl, v in others]))
    note = None
    if len(picked) < len(servable):
        note = f"charts from {len(picked)} of {len(servable)} steps, evenly spaced"
    return {"charts": svgs, "note": note, "values": keys, "shown": shown}


# --------------------------------------------------------------------------------------------
# a step


@dataclass
class StepQuery:
    q: str = ""
    min_reward: str = ""
    max_reward: str = ""
    sort: str = "stored"
    order: str = "asc"
    color: str = ""
    page: int = 1

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
        return cls(params.get("q", "")[:200], params.get("min_reward", ""), params.get("max_reward", ""),
                   sort, "desc" if params.get("order") == "desc" else "asc", params.get("color", ""), int(page))


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


def token_row(shown: Shown, name: str) -> Optional[TokenRow]:
    return next((r for r in shown.token_rows if r.name == name), None)


def colour_keys(shown: Sequence[Shown]) -> List[str]:
    names: Dict[str, None] = {}
    for s in shown:
        names.update(dict.fromkeys(r.name for r in s.token_rows))
    plain = [n for n in names if _last(n) not in MASK]
    return plain + [n for n in names if n not in plain]


def _decoder(ns: Namespace, s: Optional[StepReport], decoder: Decoder) -> Decoder:
    return decoder.for_namespace(ns.group, _fp_values(s))


def _no_step(ns: Namespace, step: int, report: NamespaceReport) -> NotFound:
    steps = [r.step for r in report.steps]
    held = f"it holds steps {steps[0]} .. {steps[-1]}" if steps else "it holds no step"
    return NotFound(f"{ns.layout.root}: no step {step} ({held})")


def step_page(cache: Cache, ns: Namespace, step: int, query: StepQuery, decoder: Decoder) -> Dict[str, Any]:
    report = cache.scan(ns)
    s = report.get(step)
    if s is None:
        raise _no_step(ns, step, report)
    decoder = _decoder(ns, s, decoder)
    steps = [r.step for r in report.steps]
    at = steps.index(step)
    read, table = cache.table(ns, s)
    ctx: Dict[str, Any] = {"ns": ns, "step": step, "read": read, "prev": steps[at - 1] if at > 0 else None,
                           "next": steps[at + 1] if at + 1 < len(steps) else None}
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
               recorded=_recorded(cache.values(ns, step)), reward_note=_reward_note(table))
    return ctx


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


def step_json(cache: Cache, ns: Namespace, step: int) -> Dict[str, Any]:
    """The step: each mini-batch's `meta` and `structure` (as `show --json` gives them) and every trajectory's
    group, reward, advantage and length; an unreadable step's `status` and `reason` only."""
    report = cache.scan(ns)
    s = report.get(step)
    if s is None:
        raise _no_step(ns, step, report)
    read, table = cache.table(ns, s)
    doc: Dict[str, Any] = {"namespace": str(ns.layout.root), "key": ns.key, "step": step, "K": ns.layout.K,
                           "W": ns.layout.W, "status": read.status, "reason": read.reason}
    if table is None:
        return doc
    metas = {(i, r): m for i, r, m in read.metas}
    doc["mini_batches"] = [{"inner_index": i, "rank": r, "meta": metas.get((i, r), {}),
                            "structure": [dict(zip(("key", "type", "shape", "dtype", "bytes", "value"), row))
                                          for row in describe(payload)]} for i, r, payload in read.batches]
    doc["summary"] = table.summary()
    doc["advantage_computed"] = table.advantage_computed
    doc["reward_functions"] = table.reward_functions
    doc["trajectories"] = [{"ref": t.ref, "inner_index": t.inner, "rank": t.rank, "trajectory_index": t.index,
                            "group": t.group, "reward": t.reward, "rewards_by": t.rewards_by, "advantage": t.advantage,
                            "length": t.length}
                           for t in table.trajectories]
    return doc


def trajectory(cache: Cache, ns: Namespace, step: int, ref: str, decoder: Decoder, color: str = "") -> Dict[str, Any]:
    report = cache.scan(ns)
    s = report.get(step)
    if s is None:
        raise _no_step(ns, step, report)
    read, table = cache.table(ns, s)
    if table is None:
        raise NotFound(f"step {step} of {ns.layout.root} is {read.status}: {read.reason}")
    decoder = _decoder(ns, s, decoder)
    at = next((k for k, t in enumerate(table.trajectories) if t.ref == ref), None)
    if at is None:
        raise NotFound(f"step {step} of {ns.layout.root} has no trajectory {ref} (inner.rank.index)")
    t = table.trajectories[at]
    shown = show(t, decoder)
    keys = colour_keys([shown])
    if color and keys and color not in keys:
        raise BadQuery(f"color={color!r}: colour by one of {', '.join(keys)}")
    asked = color if color in keys else ""
    color = asked or (keys[0] if keys else "")
    return {"ns": ns, "step": step, "traj": t, "asked_color": asked, "shown": shown, "advantage_computed": table.advantage_computed,
            "colour_row": token_row(shown, color) if color else None, "colour_keys": keys, "color": color,
            "prev_ref": table.trajectories[at - 1].ref if at > 0 else None,
            "next_ref": table.trajectories[at + 1].ref if at + 1 < len(table.trajectories) else None,
            "count": len(table.trajectories), "position": at + 1, "decoder_name": decoder.name}


# --------------------------------------------------------------------------------------------
# compare


COMPARE_ROWS = 50          # pairs on one page of compare


def _brief(t: Optional[Trajectory], decoder: Decoder) -> str:
    if t is None:
        return "-"
    sh = show(t, decoder, TOKENS_ON_STEP_PAGE, fold=False, prompt=False, rows=False)
    text = " ".join(sh.response_tokens or []) if sh.response_text is None else sh.response_text
    return text + (f" … {sh.truncated} more tokens ({sh.response_real} in all)" if sh.truncated else "")


class Pairings:
    """The last compared pair of steps (both tables and their pairing), kept while both steps' commit
    records stay the same: paging through a compare reads and pairs the two steps once."""

    def __init__(self) -> None:
        self._kept: Kept[Tuple[str, str, int], Dict[str, Any]] = Kept(size=1)

    def get(self, cache: Cache, a: Namespace, b: Namespace, step: int,
            scans: Optional[Sequence[NamespaceReport]] = None) -> Dict[str, Any]:
        """`scans`: both namespaces' scans when the caller has just made them."""
        reports = [sc.get(step) for sc in (scans or [cache.scan(ns) for ns in (a, b)])]

        def compute() -> Dict[str, Any]:
            sides, tables = [], []
            for ns, s in zip((a, b), reports):
                read, table = cache.table(ns, s) if s is not None else \
                    (StepRead(ns, step, "missing", f"no step {step}", [], []), None)
                tables.append(table)
                sides.append({"ns": ns, "read": StepRead(ns, step, read.status, read.reason, [], read.metas),
                              "summary": table.summary() if table else None, "report": s})
            pairing = pair(tables[0], tables[1]) if tables[0] is not None and tables[1] is not None else None
            return {"sides": sides, "pairing": pairing}

        return self._kept.get((a.key, b.key, step), tuple(None if s is None else step_stamp(s) for s in reports),
                              compute)


def shape_notes(a: Namespace, b: Namespace, pairing: Optional[Pairing]) -> List[str]:
    """What differs in the two runs' shapes, said on top, and how the page handles it."""
    notes = []
    for name, x, y in (("K", a.layout.K, b.layout.K), ("W", a.layout.W, b.layout.W)):
        if x != y:
            how = (f"trajectories are paired by {pairing.by} and sample index across mini-batches and ranks"
                   if pairing is not None and pairing.by != "position" else
                   "these rollouts store no prompt ids or uid: trajectories cannot be paired across mini-batches")
            notes.append(f"{name} differs: A has {name} = {x}, B has {name} = {y}; {how}")
    return notes


def compare(cache: Cache, a: Namespace, b: Namespace, step: int, decoder: Decoder, pairings: Pairings,
            page: int = 1, only: str = "") -> Dict[str, Any]:
    """Two namespaces at one step: each side's summary, and their trajectories paired by identity (one page
    of pairs; `only=differ` shows the pairs that differ and the one-sided ones)."""
    scans = (cache.scan(a), cache.scan(b))           # scanned once: the pairing's stamps and the diff's
    got = pairings.get(cache, a, b, step, scans)
    pairing: Optional[Pairing] = got["pairing"]
    rows: List[Dict[str, Any]] = []
    listed: List[Pair] = []
    if pairing is not None:
        listed = [p for p in pairing.pairs if not p.same] if only == "differ" else pairing.pairs
    pages_n = max(1, math.ceil(len(listed) / COMPARE_ROWS))
    if page > pages_n:
        raise BadQuery(f"page={page}: this compare has {pages_n} page{'s' if pages_n != 1 else ''}")
    dec_a = _decoder(a, got["sides"][0]["report"], decoder)
    dec_b = _decoder(b, got["sides"][1]["report"], decoder)
    for p in listed[(page - 1) * COMPARE_ROWS: page * COMPARE_ROWS]:
        rows.append({"identity": p.identity, "ref_a": p.a.ref if p.a else None, "ref_b": p.b.ref if p.b else None,
                     "reward_a": p.a.reward if p.a else None, "reward_b": p.b.reward if p.b else None,
                     "text_a": _brief(p.a, dec_a), "text_b": _brief(p.b, dec_b), "same": p.same,
                     "state": "same" if p.same else "only in A" if p.b is None else "only in B" if p.a is None
                     else "differs"})

    def page_url(n: int) -> str:
        from urllib.parse import urlencode

        params: Dict[str, Any] = {"a": a.key, "b": b.key, "step": step, "page": n}
        if only:
            params["only"] = only
        return f"/compare?{urlencode(params)}"

    return {"sides": got["sides"], "pairing": pairing, "rows": rows, "step": step, "page": page, "pages": pages_n,
            "page_url": page_url, "only": only, "differs": DIFFERS, "notes": shape_notes(a, b, pairing),
            "ns_rows": compare_choices(cache), "pick_a": a.key, "pick_b": b.key, "pick_step": step, "scans": scans}


def diff_at(diff: Optional[Dict[str, Any]], step: int) -> Dict[str, Any]:
    """From `skip-harness diff --json`'s document for two namespaces (rollouts by commit records only): the
    training-side config keys that differ, the first step whose recorded values diverge, the keys recorded
    on one side only, the steps on one side only. Trajectories are counted by the page's pairing alone (one
    definition of "differs")."""
    if diff is None:
        return {"diff_pair": None}
    one = (diff.get("namespaces") or [{}])[0]
    values = one.get("values") or {}
    return {"diff_pair": {"config": diff.get("config") or [], "first_divergence": values.get("first_divergence"),
                          "steps_compared": values.get("steps_compared"),
                          "keys_only_in_a": values.get("keys_only_in_a") or [],
                          "keys_only_in_b": values.get("keys_only_in_b") or [],
                          "steps_only_in_a": one.get("steps_only_in_a"), "steps_only_in_b": one.get("steps_only_in_b"),
                          "same_records": one.get("rollouts_same_records")}}
