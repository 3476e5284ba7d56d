"""`skip.rollout_tq.action=compare`: how far the rollouts a run generates drift from the recording's.

Every step is generated as if uncached and trained on; each mini-batch `sample` returns is compared, the
moment it is returned, with the recording's mini-batch at the same step and inner index (this run's own
namespace, or `replay_from`'s re-chunked and re-sharded to this run's K and W). Trajectories are paired
row by row, and only when they are the same trajectories: as many of them, and the same prompts where
the batch holds prompts; otherwise the step says why it cannot pair them and counts nothing. Per step:
how many trajectories are identical (the same response tokens), the first differing token position
(the earliest over the step's trajectories), and the largest log-prob difference on the shared prefix
(the positions before a trajectory's first differing token; where the batch holds log-probs). Rank 0
sums every rank's figures. Nothing is written to the recording: the figures are the run's values, kept
under its run id (`VALUE_KEYS`), and each trajectory's first differing token beside them (`Figures.batches`:
the viewer marks it per trajectory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness.run.trajectories import Rows, rows_of

IDENTICAL_SHARE = "compare/identical_share"
IDENTICAL = "compare/identical"
TRAJECTORIES = "compare/trajectories"
FIRST_DIFF = "compare/first_diff_token"
MAX_LOGPROB_DIFF = "compare/max_logprob_diff"
VALUE_KEYS = (IDENTICAL_SHARE, IDENTICAL, TRAJECTORIES, FIRST_DIFF, MAX_LOGPROB_DIFF)


Firsts = Tuple[Optional[int], ...]      # one mini-batch's trajectories: each one's first differing token (None: identical)


class Figures(Dict[str, float]):
    """A step's figures as the run's values (`compare/...`), and `batches`: every mini-batch's per-trajectory
    first differing tokens, rank by rank and in inner order within a rank (what `trajectory_firsts` names)."""

    def __init__(self, values: Optional[Dict[str, float]] = None, batches: Tuple[Firsts, ...] = ()):
        super().__init__(values or {})
        self.batches = batches


def trajectory_firsts(batches: Sequence[Firsts], K: int, W: int) -> Dict[str, Optional[int]]:
    """`Figures.batches` by trajectory ref `{inner}.{rank}.{index}` (a step's K x W mini-batches, rank-major);
    {} when they are not K x W mini-batches."""
    if len(batches) != K * W:
        return {}
    return {f"{m % K}.{m // K}.{j}": first for m, firsts in enumerate(batches) for j, first in enumerate(firsts)}


@dataclass(frozen=True)
class Drift:
    """One step's (or one mini-batch's) comparison with the recording."""

    identical: int = 0
    trajectories: int = 0
    first_diff: Optional[int] = None        # the earliest differing token position; None: none differs
    max_logprob_diff: Optional[float] = None  # None: no log-probs to compare
    unpaired: str = ""                       # why the trajectories could not be paired ('' when they were)
    batches: Tuple[Firsts, ...] = ()         # each mini-batch's trajectories' first differing tokens

    def plus(self, other: "Drift") -> "Drift":
        firsts = [x for x in (self.first_diff, other.first_diff) if x is not None]
        lps = [x for x in (self.max_logprob_diff, other.max_logprob_diff) if x is not None]
        return Drift(self.identical + other.identical, self.trajectories + other.trajectories,
                     min(firsts) if firsts else None, max(lps) if lps else None, self.unpaired or other.unpaired,
                     self.batches + other.batches)

    def describe(self) -> str:
        """`compared: 5 of 8 trajectories identical, first differing token 2, largest log-prob difference
        0.0231 on the shared prefix`."""
        if self.unpaired:
            return f"not compared: {self.unpaired}"
        line = f"compared: {self.identical} of {self.trajectories} trajectories identical"
        line += ", no differing token" if self.first_diff is None else f", first differing token {self.first_diff}"
        if self.max_logprob_diff is not None:
            line += f", largest log-prob difference {self.max_logprob_diff:.6g} on the shared prefix"
        return line

    def values(self) -> Figures:
        """The figures as the run's values (`compare/...`), each trajectory's first differing token beside
        them; none when the trajectories were not paired."""
        if self.unpaired or not self.trajectories:
            return Figures()
        out = {IDENTICAL_SHARE: self.identical / self.trajectories, IDENTICAL: self.identical,
               TRAJECTORIES: self.trajectories}
        if self.first_diff is not None:
            out[FIRST_DIFF] = self.first_diff
        if self.max_logprob_diff is not None:
            out[MAX_LOGPROB_DIFF] = self.max_logprob_diff
        return Figures(out, self.batches)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    """The first position where two token rows differ (a shorter row differs where it ends); None if equal."""
    m = min(a.numel(), b.numel())
    neq = (a[:m].to(torch.int64) != b[:m].to(torch.int64)).nonzero()
    if neq.numel():
        return int(neq[0])
    return None if a.numel() == b.numel() else m


def _unpaired(now: Rows, then: Rows) -> str:
    if now.responses is None or then.responses is None:
        side = "the generated" if now.responses is None else "the recorded"
        return f"no response token field found in {side} mini-batch (one of responses, completion_ids, ...)"
    if now.n != then.n:
        return f"{now.n} trajectories generated, {then.n} recorded"
    if now.prompts is not None and then.prompts is not None:
        other = sum(1 for a, b in zip(now.prompts, then.prompts) if a.shape != b.shape or not torch.equal(a, b))
        if other:
            return f"other prompts ({other} of {now.n} trajectories)"
    return ""


def compare_batches(generated: Any, recorded: Any) -> Drift:
    """One generated mini-batch against the recorded one at the same step and inner index."""
    now, then = rows_of(generated), rows_of(recorded)
    why = _unpaired(now, then)
    if why:
        return Drift(unpaired=why)
    assert now.responses is not None and then.responses is not None
    identical, firsts, lps, rows = 0, [], [], []
    both_lp = now.logprobs is not None and then.logprobs is not None
    for j, (a, b) in enumerate(zip(now.responses, then.responses)):
        first = first_difference(a, b)
        rows.append(first)
        if first is None:
            identical += 1
        else:
            firsts.append(first)
        shared = min(a.numel(), b.numel()) if first is None else first
        if both_lp and shared:
            la, lb = now.logprobs[j][:shared], then.logprobs[j][:shared]  # type: ignore[index]
            lps.append(float((la.double() - lb.double()).abs().max()))
        elif both_lp:
            lps.append(0.0)
    return Drift(identical, now.n, min(firsts) if firsts else None, (max(lps) if lps else 0.0) if both_lp else None,
                 batches=(tuple(rows),))


def combined(drifts: Sequence[Optional[Drift]]) -> Drift:
    """Every mini-batch's (and every rank's) figures as one step's."""
    out = Drift()
    for d in drifts:
        if d is not None:
            out = out.plus(d)
    return out


@dataclass
class DriftTotals:
    """The run's sum over its compared steps (the summary's `rollouts compared` line)."""

    steps: int = 0
    identical: int = 0
    trajectories: int = 0
    not_compared: int = 0
    reasons: Optional[List[str]] = None

    def add(self, drift: Drift) -> None:
        if drift.unpaired:
            self.not_compared += 1
            self.reasons = (self.reasons or []) + [drift.unpaired]
            return
        self.steps += 1
        self.identical += drift.identical
        self.trajectories += drift.trajectories

    def describe(self) -> str:
        """`rollouts compared: 30 of 32 trajectories identical (4 steps)`."""
        line = (f"rollouts compared: {self.identical} of {self.trajectories} trajectories identical "
                f"({self.steps} step{'' if self.steps == 1 else 's'})")
        if self.not_compared:
            line += f"; {self.not_compared} step{'' if self.not_compared == 1 else 's'} not compared"
            if self.reasons:
                line += f" ({self.reasons[0]})"
        return line


__all__ = ["Drift", "DriftTotals", "Figures", "VALUE_KEYS", "combined", "compare_batches", "first_difference",
           "trajectory_firsts"]
