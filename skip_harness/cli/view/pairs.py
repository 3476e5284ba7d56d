"""Two runs' trajectories at one step, paired by identity -- the prompt (its real token ids, else the
stored uid) and the sample's index among that prompt's samples -- never by position, so a run with
K = 1 pairs with one of K = 2 (or another W) sample by sample.

One definition of "differs", the one the compare page states: a pair differs when its real response
tokens (padding dropped) or its reward differ; a trajectory whose identity one side lacks is counted
apart (`only_a`, `only_b`), never as a difference.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from skip_harness.cli.view.decode import _length, prompt_start, response_span
from skip_harness.cli.view.samples import GROUP, KEYS, PROMPT_IDS, RESPONSE_IDS, StepTable, Trajectory

DIFFERS = ("a pair differs when its real response tokens (padding dropped) or its reward differ; trajectories "
           "are paired by prompt and sample index, never by position")


@dataclass
class Pair:
    identity: str                  # "{prompt}#{k}": the prompt's short digest (or uid), the k-th sample of it
    a: Optional[Trajectory]
    b: Optional[Trajectory]
    same: bool


@dataclass
class Pairing:
    pairs: List[Pair]
    same: int
    differ: int
    only_a: int
    only_b: int
    by: str                         # what identifies a prompt: "prompt tokens" | "uid" | "position"


def _prompt_key(t: Trajectory) -> Tuple[str, str]:
    """(the prompt's identity, how it was found): a digest of its real token ids, else the stored group
    (uid), else its position's group."""
    b, j = t.batch, t.index
    name = b.find(PROMPT_IDS)
    if name is not None:
        row = b.row(name, j)
        if isinstance(row, torch.Tensor) and row.dim() == 1 and not row.is_floating_point():
            n_resp = _length(b.row(b.find(RESPONSE_IDS), j)) if b.find(RESPONSE_IDS) else None
            start = prompt_start(b, j, int(row.shape[0]), n_resp)
            data = row[start:].contiguous().to(torch.int64).numpy().tobytes()
            return hashlib.blake2b(data, digest_size=6).hexdigest(), "prompt tokens"
        if isinstance(row, list):
            return hashlib.blake2b(repr(row).encode(), digest_size=6).hexdigest(), "prompt tokens"
    if b.find(GROUP) is not None or b.find(KEYS) is not None:
        return t.group, "uid"
    return t.group, "position"


def identities(table: StepTable) -> Tuple[List[Tuple[str, Trajectory]], str]:
    """Every trajectory of the step with its identity "{prompt}#{k}" (k: its index among its prompt's
    samples, in stored order), and how prompts were identified (the weakest way any trajectory needed)."""
    seen: Dict[str, int] = {}
    out = []
    ways = set()
    for t in table.trajectories:
        key, how = _prompt_key(t)
        ways.add(how)
        k = seen.get(key, 0)
        seen[key] = k + 1
        out.append((f"{key}#{k}", t))
    by = "position" if "position" in ways else "uid" if "uid" in ways else "prompt tokens"
    return out, by


def _real_response(t: Trajectory) -> Optional[torch.Tensor]:
    b, j = t.batch, t.index
    name = b.find(RESPONSE_IDS)
    if name is None:
        return None
    row = b.row(name, j)
    if isinstance(row, list):
        row = torch.tensor(row, dtype=torch.int64)
    if not isinstance(row, torch.Tensor) or row.dim() != 1:
        return None
    real, _mask = response_span(b, j, int(row.shape[0]), t.length)
    return row[:real]


def same_trajectory(a: Trajectory, b: Trajectory) -> bool:
    """The one definition (DIFFERS): equal real response tokens and equal rewards."""
    ra, rb = _real_response(a), _real_response(b)
    if (ra is None) != (rb is None):
        return False
    if ra is not None and rb is not None and (ra.shape != rb.shape or not torch.equal(ra, rb)):
        return False
    return a.reward == b.reward or (a.reward is not None and b.reward is not None
                                    and a.reward != a.reward and b.reward != b.reward)


def pair(table_a: StepTable, table_b: StepTable) -> Pairing:
    """Both steps' trajectories paired by identity, A's order first, then B's trajectories A lacks."""
    ids_a, by_a = identities(table_a)
    ids_b, by_b = identities(table_b)
    in_b = dict(ids_b)
    pairs: List[Pair] = []
    same = differ = only_a = 0
    for ident, ta in ids_a:
        tb = in_b.pop(ident, None)
        if tb is None:
            only_a += 1
            pairs.append(Pair(ident, ta, None, False))
            continue
        equal = same_trajectory(ta, tb)
        same += equal
        differ += not equal
        pairs.append(Pair(ident, ta, tb, equal))
    for ident, tb in ids_b:
        if ident in in_b:
            pairs.append(Pair(ident, None, tb, False))
    order = ("prompt tokens", "uid", "position")
    by = max(by_a, by_b, key=order.index)
    return Pairing(pairs, same, differ, only_a, len(in_b), by)
