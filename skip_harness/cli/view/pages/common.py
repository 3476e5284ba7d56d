"""What every page shares: the errors a page answers with, how a namespace's decoder and a missing step
are found, the colour fields of shown trajectories, and which steps the charts read."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from skip_harness.cli.view.data import Cache, ViewedNamespace, fingerprint_values as _fp_values
from skip_harness.cli.view.decode import Decoder, Shown, TokenRow
from skip_harness.cli.view.samples import MASK, _last
from skip_harness.store.api import NamespaceReport, StepReport

SORT_KEYS = ("stored", "reward", "advantage", "length", "group")
ROWS_PER_PAGE = 32           # trajectories on one page of a step (its groups in order; a group may go on)
TOKENS_ON_STEP_PAGE = 64     # response tokens of each (all of them on the trajectory's own page)
CHART_STEPS = 200            # steps read for the rollout charts; more are sampled evenly


class NotFound(Exception):
    """A namespace, step or trajectory the cache does not have; the message says which."""


class BadQuery(Exception):
    """A URL parameter that means nothing (a reward bound that is not a number...); the message says which."""



def compare_choices(cache: Cache) -> List[Dict[str, Any]]:
    return [{"key": n.key, "label": n.label, "root_index": n.root_index} for n in cache.namespaces()]


def _other(cache: Cache, key: str) -> str:
    keys = [n.key for n in cache.namespaces()]
    return next((k for k in keys if k != key), key)


def chart_steps(steps: Sequence[int], budget: int = CHART_STEPS) -> List[int]:
    if len(steps) <= budget:
        return list(steps)
    picked = {steps[round(i * (len(steps) - 1) / (budget - 1))] for i in range(budget)}
    return sorted(picked)


def token_row(shown: Shown, name: str) -> Optional[TokenRow]:
    return next((r for r in shown.token_rows if r.name == name), None)


def colour_keys(shown: Sequence[Shown]) -> List[str]:
    names: Dict[str, None] = {}
    for s in shown:
        names.update(dict.fromkeys(r.name for r in s.token_rows))
    plain = [n for n in names if _last(n) not in MASK]
    return plain + [n for n in names if n not in plain]


def _decoder(ns: ViewedNamespace, s: Optional[StepReport], decoder: Decoder) -> Decoder:
    return decoder.for_namespace(ns.group, _fp_values(s))


def _no_step(ns: ViewedNamespace, step: int, report: NamespaceReport) -> NotFound:
    steps = [r.step for r in report.steps]
    held = f"it holds steps {steps[0]} .. {steps[-1]}" if steps else "it holds no step"
    return NotFound(f"{ns.layout.root}: no step {step} ({held})")


