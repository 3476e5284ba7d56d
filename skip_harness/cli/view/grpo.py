"""What GRPO makes of a step's rewards: its dead groups, its advantages when the rollouts store none,
and which advantages are zero within rounding.

A **dead group** is a group (the samples of one prompt) of at least two samples with a reward, every
reward finite, whose rewards are all the same: GRPO's advantages are then all zero and the prompt gives
the update no signal. "The same" is within rounding (below); a group of one sample, or one whose rewards
were not stored, is never called dead (nothing can be said of it).

**Within rounding.** A reward is stored in some floating dtype (float32's machine epsilon is
2^-23 ~ 1.2e-7, bfloat16's 2^-7, float16's 2^-10, float64's and a Python number's 2^-52; an integer
reward counts as float64): two rewards equal in exact arithmetic but computed along different paths and
each rounded to that dtype differ by a few units in its last place, and the mean of n of them carries at
most about n such units. So, for a group of n samples with rewards r and eps the epsilon of their dtype:

- its rewards are the same when max(r) - min(r) <= n * eps * max|r|;
- a computed advantage (r_i - mean) / (std + 1e-6) is exactly 0 when |r_i - mean| <= n * eps * max|r|
  (what made it nonzero is the rewards' rounding, which the division by a tiny std would blow up);
- a stored advantage a (the trainer's, in its own dtype with epsilon eps_a) is shown as 0, uncoloured,
  when |a| <= n * eps_a * M, M the largest |advantage| of the step: it is below the rounding of the
  step's own advantages. The JSON keeps the stored value as it is.

The tolerance is relative to the values' scale and their dtype's precision, never an absolute cut-off:
a reward of 1e-9 beside rewards of 1e-9 is a real difference in float64.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

EPS64 = float(torch.finfo(torch.float64).eps)
GRPO_EPS = 1e-6          # what the computed advantages add to the group's std


def eps_of(value: Any) -> float:
    """The machine epsilon of the floating dtype a field is stored in (a tensor, a jagged tensor, a list of
    tensors); float64's for Python numbers and integers."""
    t = value[0] if isinstance(value, list) and value and isinstance(value[0], torch.Tensor) else value
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return float(torch.finfo(t.dtype).eps)
    return EPS64


def _finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)


def by_group(rows: Sequence[Any]) -> Dict[str, List[Any]]:
    """Trajectories by group, in order of first appearance."""
    out: Dict[str, List[Any]] = {}
    for t in rows:
        out.setdefault(t.group, []).append(t)
    return out


def _tolerance(members: Sequence[Any]) -> float:
    rewards = [t.reward for t in members]
    return len(members) * max(t.reward_eps for t in members) * max(abs(r) for r in rewards)


def is_dead(members: Sequence[Any]) -> bool:
    """Every sample of the group got the same reward (within rounding): at least two, all finite."""
    if len(members) < 2 or not all(_finite(t.reward) for t in members):
        return False
    rewards = [t.reward for t in members]
    return max(rewards) - min(rewards) <= _tolerance(members)


def dead_groups(rows: Sequence[Any]) -> List[str]:
    """The step's dead groups' ids, in order of first appearance."""
    return [g for g, members in by_group(rows).items() if is_dead(members)]


def _std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def grpo_advantages(rows: Sequence[Any]) -> None:
    """GRPO's advantages for rollouts that store none: each reward minus its group's mean over the group's
    std (+1e-6); exactly 0 where the difference is within the rewards' rounding."""
    groups = by_group([t for t in rows if t.reward is not None])
    for members in groups.values():
        rewards = [t.reward for t in members]
        mean, std = sum(rewards) / len(rewards), _std(rewards)
        tol = _tolerance(members) if all(_finite(r) for r in rewards) else 0.0
        for t in members:
            d = t.reward - mean
            t.advantage = 0.0 if abs(d) <= tol else d / (std + GRPO_EPS)


def mark_rounded_advantages(rows: Sequence[Any], eps_a: float) -> None:
    """Stored advantages within rounding of zero (|a| <= n * eps_a * the step's largest |a|, n the group's
    size): `advantage_zero` set, the value kept."""
    finite = [abs(t.advantage) for t in rows if _finite(t.advantage)]
    if not finite:
        return
    scale = max(finite)
    for members in by_group(rows).values():
        tol = len(members) * eps_a * scale
        for t in members:
            if _finite(t.advantage) and t.advantage != 0.0 and abs(t.advantage) <= tol:
                t.advantage_zero = True
