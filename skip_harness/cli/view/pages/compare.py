"""Compare: two namespaces at one step, their trajectories paired by identity, and `skip-harness diff`'s
document for the two."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from skip_harness.cli.view.data import Cache, Kept, ViewedNamespace, StepRead, step_stamp
from skip_harness.cli.view.decode import Decoder, show
from skip_harness.cli.view.pages.common import TOKENS_ON_STEP_PAGE, BadQuery, _decoder, compare_choices
from skip_harness.cli.view.pairs import DIFFERS, Pair, Pairing, pair, real_response
from skip_harness.cli.view.samples import Trajectory
from skip_harness.store.api import NamespaceReport


COMPARE_ROWS = 50          # pairs on one page of compare
BEFORE_MARK = 8            # tokens shown before a first difference that lies past the fold


def _brief(t: Optional[Trajectory], decoder: Decoder) -> str:
    if t is None:
        return "-"
    sh = show(t, decoder, TOKENS_ON_STEP_PAGE, fold=False, prompt=False, rows=False)
    text = " ".join(sh.response_tokens or []) if sh.response_text is None else sh.response_text
    return text + (f" … {sh.truncated} more tokens ({sh.response_real} in all)" if sh.truncated else "")


def _marked(t: Optional[Trajectory], decoder: Decoder, first: int) -> Optional[Dict[str, Any]]:
    """One side of a pair whose tokens differ, its first differing token marked: the response's first
    tokens when the difference is among them, else the tokens from BEFORE_MARK before it (those before
    folded: the difference is in view whatever its position). None when the side has no token ids."""
    ids = real_response(t) if t is not None else None
    if ids is None:
        return None
    real = int(ids.numel())
    start = 0 if first < TOKENS_ON_STEP_PAGE else first - BEFORE_MARK
    shown = ids[start:start + TOKENS_ON_STEP_PAGE].tolist()
    tokens = decoder.tokens(shown)
    at = first - start
    return {"skipped": start, "before": " ".join(tokens[:at]), "mark": tokens[at] if at < len(tokens) else None,
            "after": " ".join(tokens[at + 1:]), "more": real - start - len(shown), "real": real}


class Pairings:
    """The last compared pair of steps (both tables and their pairing), kept while both steps' commit
    records stay the same: paging through a compare reads and pairs the two steps once."""

    def __init__(self) -> None:
        self._kept: Kept[Tuple[str, str, int], Dict[str, Any]] = Kept(size=1)

    def get(self, cache: Cache, a: ViewedNamespace, b: ViewedNamespace, step: int,
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


def shape_notes(a: ViewedNamespace, b: ViewedNamespace, pairing: Optional[Pairing]) -> List[str]:
    """What differs in the two runs' shapes, said on top, and how the page handles it."""
    notes = []
    for name, x, y in (("K", a.layout.K, b.layout.K), ("W", a.layout.W, b.layout.W)):
        if x != y:
            how = (f"trajectories are paired by {pairing.by} and sample index across mini-batches and ranks"
                   if pairing is not None and pairing.by != "position" else
                   "these rollouts store no prompt ids or uid: trajectories cannot be paired across mini-batches")
            notes.append(f"{name} differs: A has {name} = {x}, B has {name} = {y}; {how}")
    return notes


def compare(cache: Cache, a: ViewedNamespace, b: ViewedNamespace, step: int, decoder: Decoder, pairings: Pairings,
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
                     "first_difference": p.first,
                     "mark_a": None if p.first is None else _marked(p.a, dec_a, p.first),
                     "mark_b": None if p.first is None else _marked(p.b, dec_b, p.first),
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
