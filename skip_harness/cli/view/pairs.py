"""Two runs' trajectories at one step, paired by identity -- the prompt (its real token ids, else the
stored uid) and the sample's index among that prompt's samples -- never by position, so a run with
K = 1 pairs with one of K = 2 (or another W) sample by sample.

One definition of "differs", the one the compare page states: a pair differs when its real response
tokens (padding dropped) or its reward differ; a trajectory whose identity one side lacks is counted
apart (`only_a`, `only_b`), never as a difference. A pair whose tokens differ has its first differing
token (`Pair.first`: the first position whose real tokens differ, or where the shorter response ends).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from skip_harness.cli.view.decode import _length, first_true, mask_ends, prompt_start, response_span
from skip_harness.cli.view.samples import ATTENTION_MASK, GROUP, KEYS, PROMPT_IDS, RESPONSE_IDS, Batch, StepTable, Trajectory
from skip_harness.run.drift import first_difference

DIFFERS = ("a pair differs when its real response tokens (padding dropped) or its reward differ; trajectories "
           "are paired by prompt and sample index, never by position")


@dataclass
class Pair:
    identity: str                  # "{prompt}#{k}": the prompt's short digest (or uid), the k-th sample of it
    a: Optional[Trajectory]
    b: Optional[Trajectory]
    same: bool
    first: Optional[int] = None    # the first differing real response token; None: the tokens are the same


@dataclass
class Pairing:
    pairs: List[Pair]
    same: int
    differ: int
    only_a: int
    only_b: int
    by: str                         # what identifies a prompt: "prompt tokens" | "uid" | "position"


_WEIGHTS = 1 << 16
_drawn: Optional[torch.Tensor] = None


def _weights(width: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Two fixed pseudo-random int64 weights per position, counted from the row's end (a left-padded prompt's
    tokens keep their weights whatever its padded width)."""
    if width > _WEIGHTS:
        return None
    global _drawn
    if _drawn is None:
        _drawn = torch.randint(1, 1 << 62, (2, _WEIGHTS), generator=torch.Generator().manual_seed(31), dtype=torch.int64)
    return _drawn[0, :width].flip(0), _drawn[1, :width].flip(0)


def _prompt_digests(b: Batch) -> Optional[List[str]]:
    """Every prompt of a padded [n, P] mini-batch as a digest of its real tokens (padding masked out by the
    attention mask, whose values are 0 and 1), computed with tensor operations: a wrapping 64-bit weighted
    sum of (id + 1) over the attended positions, shown as its first 12 hex digits."""
    if "prompt_digests" in b.derived:
        return b.derived["prompt_digests"]
    out = None
    name = b.find(PROMPT_IDS)
    ids = b.columns.get(name) if name is not None else None
    if isinstance(ids, torch.Tensor) and not ids.is_nested and ids.dim() == 2 and not ids.is_floating_point():
        width = int(ids.shape[1])
        w = _weights(width)
        if w is not None:
            att = b.find(ATTENTION_MASK)
            a = b.columns.get(att) if att is not None else None
            resp = b.columns.get(b.find(RESPONSE_IDS)) if b.find(RESPONSE_IDS) else None
            r_width = int(resp.shape[1]) if isinstance(resp, torch.Tensor) and not resp.is_nested and resp.dim() == 2 else 0
            x = ids.to(torch.int64)
            if isinstance(a, torch.Tensor) and not a.is_nested and a.dim() == 2 and a.shape[1] in (width, width + r_width):
                m = a[:, :width]
                m = m if m.dtype == torch.int64 else (m != 0).to(torch.int64)
                x = torch.addcmul(m, x, m)       # (id + 1) where attended, 0 where not: one temporary
            else:
                x = x.add(1)
            h = torch.mv(x, w[0]).tolist()       # one wrapping 64-bit sum: prompts of one step told apart
            out = [f"{(u & 0xFFFFFFFFFFFFFFFF) >> 16:012x}" for u in h]     # its first 12 hex digits
    b.derived["prompt_digests"] = out
    return out


def _prompt_key(t: Trajectory) -> Tuple[str, str]:
    """(the prompt's identity, how it was found): a digest of its real token ids, else the stored group
    (uid), else its position's group."""
    b, j = t.batch, t.index
    digests = _prompt_digests(b)
    if digests is not None:
        return digests[j], "prompt tokens"
    name = b.find(PROMPT_IDS)
    if name is not None:
        row = b.row(name, j)
        if isinstance(row, torch.Tensor) and row.dim() == 1 and not row.is_floating_point():
            n_resp = _length(b.row(b.find(RESPONSE_IDS), j)) if b.find(RESPONSE_IDS) else None
            start = prompt_start(b, j, int(row.shape[0]), n_resp)
            data = row[start:].contiguous().to(torch.int64).numpy().tobytes()
            return hashlib.blake2b(data, digest_size=6).hexdigest(), "prompt tokens"   # a jagged row
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
        key, how = _prompt_key(t)        # a mini-batch's digests made once for all its rows (kept in its `derived`)
        ways.add(how)
        k = seen.get(key, 0)
        seen[key] = k + 1
        out.append((f"{key}#{k}", t))
    by = "position" if "position" in ways else "uid" if "uid" in ways else "prompt tokens"
    return out, by


def real_response(t: Trajectory) -> Optional[torch.Tensor]:
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


def _padded(b: Batch) -> Optional[torch.Tensor]:
    name = b.find(RESPONSE_IDS)
    v = b.columns.get(name) if name is not None else None
    if isinstance(v, torch.Tensor) and not v.is_nested and v.dim() == 2 and b.derived.get("ends") is not None:
        return v
    return None


def _first_tokens(matched: List[Tuple[Trajectory, Trajectory]]) -> List[Optional[int]]:
    """Each pair's first differing real response token (None: the same tokens): padded mini-batches compared
    a mini-batch pair at a time with tensor operations (every token, exactly), jagged ones row by row."""
    out: List[Optional[int]] = [None] * len(matched)
    groups: Dict[Tuple[int, int], List[int]] = {}
    for n, (ta, tb) in enumerate(matched):
        groups.setdefault((id(ta.batch), id(tb.batch)), []).append(n)
    for members in groups.values():
        ba, bb = matched[members[0]][0].batch, matched[members[0]][1].batch
        ra, rb = _padded(ba), _padded(bb)
        if ra is None or rb is None:
            for n in members:
                out[n] = _first_in_rows(*matched[n])
            continue
        ja = [matched[n][0].index for n in members]
        jb = [matched[n][1].index for n in members]
        ia, ib = torch.tensor(ja), torch.tensor(jb)
        ea = torch.tensor(ba.derived["ends"])[ia]
        eb = torch.tensor(bb.derived["ends"])[ib]
        # only the positions before the longest real end matter: every position before the shorter of a
        # pair's two ends is within `width` (an end is at most its batch's width)
        width = min(int(ra.shape[1]), int(rb.shape[1]), int(ea.max()) if len(ja) else 0)
        in_order = ja == list(range(ba.n)) and jb == list(range(bb.n))      # no gather: compare the batches
        xa = ra[:, :width] if in_order else ra[ia, :width]
        xb = rb[:, :width] if in_order else rb[ib, :width]
        first = torch.from_numpy(first_true((xa != xb).numpy(), width))     # the first differing position (width: none)
        shorter = torch.minimum(ea, eb)
        at = torch.where(first < shorter, first, torch.where(ea != eb, shorter, torch.full_like(first, -1)))
        for n, d in zip(members, at.tolist()):
            out[n] = None if d < 0 else int(d)
    return out


def _first_in_rows(a: Trajectory, b: Trajectory) -> Optional[int]:
    ra, rb = real_response(a), real_response(b)
    if ra is None or rb is None:
        return None if (ra is None) == (rb is None) else 0
    return first_difference(ra, rb)


def _same_row(a: Trajectory, b: Trajectory) -> bool:
    return _first_in_rows(a, b) is None


def _same_reward(a: Trajectory, b: Trajectory) -> bool:
    return a.reward == b.reward or (a.reward is not None and b.reward is not None
                                    and a.reward != a.reward and b.reward != b.reward)


def pair(table_a: StepTable, table_b: StepTable) -> Pairing:
    """Both steps' trajectories paired by identity, A's order first, then B's trajectories A lacks."""
    for t in table_a.trajectories + table_b.trajectories:      # every row's end: once per mini-batch
        if "ends" not in t.batch.derived:
            mask_ends(t.batch)
    ids_a, by_a = identities(table_a)
    ids_b, by_b = identities(table_b)
    in_b = dict(ids_b)
    pairs: List[Pair] = []
    same = differ = only_a = 0
    matched: List[Tuple[Trajectory, Trajectory]] = []
    slots: List[int] = []
    for ident, ta in ids_a:
        tb = in_b.pop(ident, None)
        if tb is None:
            only_a += 1
            pairs.append(Pair(ident, ta, None, False))
            continue
        slots.append(len(pairs))
        matched.append((ta, tb))
        pairs.append(Pair(ident, ta, tb, False))
    for slot, (ta, tb), first in zip(slots, matched, _first_tokens(matched)):
        equal = first is None and _same_reward(ta, tb)
        pairs[slot].same = equal
        pairs[slot].first = first
        same += equal
        differ += not equal
    for ident, tb in ids_b:
        if ident in in_b:
            pairs.append(Pair(ident, None, tb, False))
    order = ("prompt tokens", "uid", "position")
    by = max(by_a, by_b, key=order.index)
    return Pairing(pairs, same, differ, only_a, len(in_b), by)
