"""The overview (every namespace, as `ls`), a namespace (steps table, chart picker) and its charts over
steps (reward, length, the recorded values; other runs overlaid)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import quote

from skip_harness.cli._common import fmt_ago, fmt_seconds, fmt_value, human_bytes
from skip_harness.cli.listing import grand_total
from skip_harness.cli.view import charts
from skip_harness.cli.view.data import Cache, Kept, ViewedNamespace, step_stamp
from skip_harness.cli.view.live import live
from skip_harness.cli.view.pages.common import BadQuery, _other, chart_steps, compare_choices
from skip_harness.cli.view.pages.drift import chosen_run
from skip_harness.cli.view.values import by_prefix, default_order, pick
from skip_harness.store.api import NamespaceReport, STATUSES, StepReport

ROLLOUT_CHARTS = 3       # reward, length, dead groups: drawn before the recorded values
DEAD_BUDGET_S = 0.5      # what the namespace page spends reading steps to count their dead groups


def overview(cache: Cache) -> Dict[str, Any]:
    rows, views = [], []
    for ns in cache.namespaces():
        view = cache.namespace_view(ns, read_metas=False)
        views.append(view)
        mode, seed = cache.mode_seed(view)
        rows.append({"key": ns.key, "label": ns.label, "root_index": ns.root_index, "K": ns.layout.K, "live": live(cache, ns),
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
    overlay (`with`, namespace keys, repeatable), the `action=compare` run whose figures are charted
    (`compare_run`; the newest by default: pages.drift)."""

    keys: List[str]
    q: str
    runs: List[str]
    compare_run: str = ""

    @classmethod
    def from_params(cls, params: Any) -> "ChartQuery":
        return cls([k for k in params.getlist("k") if k][:200], params.get("q", "")[:200],
                   [r for r in params.getlist("with") if r][:8], params.get("compare_run", "")[:200])

    def query_string(self) -> str:
        from urllib.parse import urlencode

        return urlencode([("k", k) for k in self.keys] + ([("q", self.q)] if self.q else [])
                         + [("with", r) for r in self.runs]
                         + ([("compare_run", self.compare_run)] if self.compare_run else []))


def namespace(cache: Cache, ns: ViewedNamespace, summaries: "Summaries", query: Optional[ChartQuery] = None) -> Dict[str, Any]:
    query = query or ChartQuery([], "", [])
    report = cache.scan(ns)
    view = cache.namespace_view(ns, report)
    doc = cache.namespace_doc(ns, view)
    mode, seed = cache.mode_seed(view)
    dead = dead_counts(cache, ns, summaries, report)
    steps = [{"step": r.report.step, "status": r.report.status, "size": human_bytes(r.report.bytes),
              "written": fmt_ago(r.written), "gen": fmt_seconds(r.gen_s), "reason": r.report.reason,
              "fingerprint": None if r.report.fingerprint is None else r.report.fingerprint.digest,
              "dead": dead.get(r.report.step)} for r in view.rows]
    servable = [s.step for s in report.steps if s.servable]
    compare_run = chosen_run(cache, ns, query.compare_run)
    series = value_series(cache, ns, summaries, report, compare_run)
    keys = default_order(list(series))
    shown = pick(keys, query.keys, query.q)
    missing = [k for k in query.keys if k not in series]
    runs = [r for r in query.runs if cache.namespace(r) is not None]
    bad = [r for r in query.runs if r not in runs]
    if missing or bad:
        raise BadQuery("; ".join(([f"no recorded value {', '.join(missing)} in {ns.label}"] if missing else [])
                                 + ([f"no namespace {', '.join(bad)} to overlay"] if bad else [])))
    return {"ns": ns, "doc": doc, "live": live(cache, ns), "mode": fmt_value(mode), "seed": fmt_value(seed), "size": human_bytes(view.bytes),
            "steps": steps, "note": report.index_note, "ns_rows": compare_choices(cache), "pick_a": ns.key,
            "pick_b": _other(cache, ns.key), "pick_step": servable[-1] if servable else 1,
            "chart_rows": math.ceil((ROLLOUT_CHARTS + len(shown)) / 2), "dead_budget_s": DEAD_BUDGET_S, "chart_extra": 14 * len(runs),
            "value_groups": by_prefix(keys), "charted": set(shown), "query": query, "runs": runs,
            "charts_src": f"/ns/{ns.key}/charts" + (f"?{query.query_string()}" if query.query_string() else ""),
            "key_count": len(keys), "compare_runs": cache.compare_runs(ns), "compare_run": compare_run}


def dead_counts(cache: Cache, ns: ViewedNamespace, summaries: "Summaries", report: NamespaceReport
                ) -> Dict[int, Tuple[int, Optional[float]]]:
    """{step: (dead groups, their share)} for the charted steps whose summary is kept, or can be made within
    DEAD_BUDGET_S (a step's dead groups need its verified read: the charts read the same steps and keep their
    summaries, so the rest show once the charts are drawn)."""
    servable = [s for s in report.steps if s.servable]
    picked = set(chart_steps([s.step for s in servable]))
    deadline = time.monotonic() + DEAD_BUDGET_S
    out: Dict[int, Tuple[int, Optional[float]]] = {}
    for s in servable:
        if s.step not in picked:
            continue
        sm = summaries.get(cache, ns, s) if time.monotonic() < deadline else summaries.peek(ns, s)
        if sm is not None and sm.get("dead_group_share") is not None:
            out[s.step] = (sm["dead_group_count"], sm["dead_group_share"])
    return out


def value_series(cache: Cache, ns: ViewedNamespace, summaries: "Summaries", report: NamespaceReport,
                 compare_run: Optional[str] = None) -> Dict[str, List[charts.Point]]:
    """Every recorded numeric value over the charted steps, and `compare_run`'s figures (the newest
    `action=compare` run's when None): {key: points}."""
    servable = [s for s in report.steps if s.servable]
    picked = set(chart_steps([s.step for s in servable]))
    values: Dict[str, List[charts.Point]] = {}
    for s in servable:
        if s.step not in picked:
            continue
        for k, v in (summaries.values(cache, ns, s, compare_run) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                values.setdefault(k, []).append(charts.Point(s.step, float(v)))
    return values



class Summaries:
    """Each step's summary (reward and length statistics) and recorded values, kept while its commit
    record's time and size stay the same, so charts read a step once."""

    def __init__(self) -> None:
        self._kept: Kept[Tuple[str, int], Optional[Dict[str, Any]]] = Kept()
        self._values: Kept[Tuple[str, int, Optional[str]], Optional[Dict[str, float]]] = Kept()

    def get(self, cache: Cache, ns: ViewedNamespace, s: StepReport) -> Optional[Dict[str, Any]]:
        def compute() -> Optional[Dict[str, Any]]:
            table = cache.table(ns, s)[1]
            return None if table is None else table.summary()
        return self._kept.get((ns.key, s.step), step_stamp(s), compute)

    def peek(self, ns: ViewedNamespace, s: StepReport) -> Optional[Dict[str, Any]]:
        """The step's summary if it is kept (and still the step's), never reading it."""
        return self._kept.peek((ns.key, s.step), step_stamp(s))

    def values(self, cache: Cache, ns: ViewedNamespace, s: StepReport, compare_run: Optional[str] = None
               ) -> Optional[Dict[str, float]]:
        """The step's recorded values (with `compare_run`'s figures), kept while its commit record stays the
        same."""
        return self._values.get((ns.key, s.step, compare_run), step_stamp(s),
                                lambda: cache.values(ns, s.step, compare_run))



def _rollout_series(cache: Cache, ns: ViewedNamespace, summaries: Summaries, report: NamespaceReport
                    ) -> Tuple[List[charts.Point], List[charts.Point], List[charts.Point]]:
    """Reward, length and the share of dead groups over the charted steps."""
    servable = [s for s in report.steps if s.servable]
    picked = set(chart_steps([s.step for s in servable]))
    reward: List[charts.Point] = []
    length: List[charts.Point] = []
    dead: List[charts.Point] = []
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
        if sm.get("dead_group_share") is not None:
            dead.append(charts.Point(s.step, sm["dead_group_share"]))
    return reward, length, dead


def namespace_charts(cache: Cache, ns: ViewedNamespace, summaries: Summaries, query: Optional[ChartQuery] = None
                     ) -> Dict[str, Any]:
    """The rollouts' reward and length over steps, then the recorded values picked (by default: loss,
    reward, KL, grad norm, lengths... timings last), each overlaid with the runs `with` names; every step's
    status marked along the step axis."""
    query = query or ChartQuery([], "", [])
    report = cache.scan(ns)
    servable = [s for s in report.steps if s.servable]
    picked = set(chart_steps([s.step for s in servable]))
    reward, length, dead = _rollout_series(cache, ns, summaries, report)
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
        return f"/ns/{ns.key}/step/{step}" + (f"?compare_run={quote(query.compare_run)}" if query.compare_run else "")

    svgs = [charts.line_chart("reward: mean ± std per step", reward, href, css_id="chart-reward", marks=marks,
                              overlays=[(label, rl[0]) for label, rl, _v in others]),
            charts.line_chart("response length: mean (min .. max)", length, href, css_id="chart-length", marks=marks,
                              overlays=[(label, rl[1]) for label, rl, _v in others]),
            charts.line_chart("dead groups: share of the step's groups (every sample the same reward)", dead, href,
                              css_id="chart-dead", marks=marks, overlays=[(label, rl[2]) for label, rl, _v in others])]
    values = value_series(cache, ns, summaries, report, chosen_run(cache, ns, query.compare_run))
    keys = default_order(list(values))
    shown = pick(keys, query.keys, query.q)
    for n, k in enumerate(shown):
        svgs.append(charts.line_chart(f"recorded: {k}", values[k], href, css_id=f"chart-value-{n}", marks=marks,
                                      overlays=[(label, v.get(k, [])) for label, _rl, v in others]))
    note = None
    if len(picked) < len(servable):
        note = f"charts from {len(picked)} of {len(servable)} steps, evenly spaced"
    return {"charts": svgs, "note": note, "values": keys, "shown": shown}

