"""What each page and its JSON twin hold, built from the cache (no HTTP here), a module per page:
`namespace` (the overview, a namespace, its charts), `step` (a step: filtered, sorted, grouped, one page
of groups), `trajectory`, `discarded` (what a filter dropped from a step), `compare`; `common` what they share."""
from skip_harness.cli.view.pages.common import BadQuery, NotFound
from skip_harness.cli.view.pages.discarded import discarded_json, discarded_page
from skip_harness.cli.view.pages.compare import DIFFERS, Pairings, compare, diff_at
from skip_harness.cli.view.pages.namespace import ChartQuery, Summaries, namespace, namespace_charts, overview, overview_json
from skip_harness.cli.view.pages.step import StepQuery, step_json, step_page
from skip_harness.cli.view.pages.trajectory import trajectory

__all__ = ["BadQuery", "ChartQuery", "DIFFERS", "NotFound", "Pairings", "StepQuery", "Summaries", "compare", "diff_at",
           "discarded_json", "discarded_page", "namespace", "namespace_charts", "overview", "overview_json", "step_json", "step_page", "trajectory"]
