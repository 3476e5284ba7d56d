"""What an `action=compare` run measured (run.drift): how far the rollouts it generated again drifted from the
recording's, shown on the recording's pages -- per step the share of identical trajectories and the first
differing token, per trajectory whether it is identical and where it first differs. Every such run of the
namespace can be chosen (`?compare_run=RUN_ID`); the newest by default."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from skip_harness.cli.view.data import Cache, ViewedNamespace
from skip_harness.cli.view.pages.common import BadQuery


def chosen_run(cache: Cache, ns: ViewedNamespace, asked: str) -> Optional[str]:
    """The compare run a page shows: `asked` (BadQuery when the namespace kept no such compare run), else the
    newest; None when the namespace has none."""
    runs = [r["run"] for r in cache.compare_runs(ns)]
    if asked and asked not in runs:
        shown = ", ".join(runs[-5:]) or "none"
        raise BadQuery(f"compare_run={asked!r}: no action=compare run of that id kept its figures in {ns.label} "
                       f"(compare runs: {shown})")
    return asked or (runs[-1] if runs else None)


def step_drift(cache: Cache, ns: ViewedNamespace, step: int, asked: str = "") -> Dict[str, Any]:
    """The step's drift for the page and its JSON: `compare_runs` (every compare run, oldest first),
    `compare_run` (the one shown) and `drift` (its figures at this step and `first_difference` by trajectory
    ref; None when it has none for the step)."""
    runs: List[Dict[str, Any]] = cache.compare_runs(ns)
    run = chosen_run(cache, ns, asked)
    drift = cache.drift(ns, step, run) if run is not None else None
    if drift is not None and not drift["figures"] and drift["first_difference"] is None:
        drift = None
    return {"compare_runs": runs, "compare_run": run, "drift": drift}


def drift_json(ctx: Dict[str, Any]) -> Dict[str, Any]:
    """`step_drift`'s result as the step JSON's keys: `compare_runs` (ids), `compare_run`, `drift`
    ({"run", "identical_share", "identical", "trajectories", "first_diff_token", "max_logprob_diff",
    "first_difference": {ref: token index or null} or null, "note"} or null)."""
    drift = ctx["drift"]
    doc = None
    if drift is not None:
        figures = drift["figures"]
        counts = {k: None if figures.get(k) is None else int(figures[k])
                  for k in ("identical", "trajectories", "first_diff_token")}
        doc = {"run": drift["run"], "identical_share": figures.get("identical_share"), **counts,
               "max_logprob_diff": figures.get("max_logprob_diff"),
               "first_difference": drift["first_difference"], "note": drift["note"]}
    return {"compare_runs": [r["run"] for r in ctx["compare_runs"]], "compare_run": ctx["compare_run"], "drift": doc}
