"""Cutting and joining payloads along the batch dimension: a step recorded as K x W mini-batches served
as K' x W' others (`skip.rollout_tq.replay_from`).

A payload's *rows* are the size of its batch dimension: the leading size of its first batched leaf
(depth first: a tensor of one dimension or more, a TensorDict's first batch dimension, a NumPy array).
A leaf is *batched* when its leading size is the payload's rows -- tensors (jagged and strided nested
ones included), TensorDicts (non-tensor fields and nested-tensor leaves included), NumPy arrays, and
lists of that length -- and is cut and joined along it. Every other leaf (a 0-dim tensor, a scalar, a
string, a tensor of another leading size: what a trainer stores once per call) is *per call*: a joined
or cut payload keeps the first piece's. Dicts, tuples and registered dataclasses are walked field by
field. One more form is cut by rows: a *flat* field of a dict (:data:`FLAT_FIELDS`: TRL's unit,
`completion_ids` and `logprobs` flat, cut by their `lengths` field; `prompt_ids` by `prompt_lengths` --
as the viewer and the replay's trajectories read it), when its lengths field is beside it and they add
up: row i is its elements [sum(lengths[:i]), sum(lengths[:i+1])). Pure: no I/O, no logging.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Optional, Sequence

import torch

from skip_harness.codec.minibatch import _merge, nested_of_rows
from skip_harness.codec.payload_kinds import (
    construct, fields_of, is_non_tensor_data, is_tensordict, key_repr, np, registered_name,
)
from skip_harness.errors import CodecError


#: A flat field (every row's elements one after another) and the field holding each row's length.
FLAT_FIELDS = {"completion_ids": "lengths", "logprobs": "lengths", "logprob_is_none": "lengths",
               "prompt_ids": "prompt_lengths"}


def _flat_lengths(d: dict) -> dict:
    """{flat field: its lengths (a list of ints)} for the flat fields of dict `d` whose lengths field is
    beside them and adds up to their leading size (or is None)."""
    out: dict = {}
    for name, by in FLAT_FIELDS.items():
        if name not in d or not isinstance(d.get(by), torch.Tensor) or d[by].dim() != 1 or d[by].is_floating_point():
            continue
        v = d[name]
        lengths = [int(x) for x in d[by].tolist()]
        if v is None or (isinstance(v, torch.Tensor) and not v.is_nested and v.dim() >= 1
                         and int(v.size(0)) == sum(lengths)):
            out[name] = lengths
    return out


def rows(payload: Any) -> Optional[int]:
    """The size of the payload's batch dimension (its first batched leaf's leading size), None if it has none."""
    if isinstance(payload, torch.Tensor):
        return int(payload.size(0)) if payload.dim() >= 1 else None
    if is_tensordict(payload) or is_non_tensor_data(payload):
        size = tuple(payload.batch_size)
        return int(size[0]) if size else None
    if np is not None and isinstance(payload, np.ndarray):
        return int(payload.shape[0]) if payload.ndim >= 1 else None
    if isinstance(payload, dict):
        flat = _flat_lengths(payload)
        children: Sequence[Any] = [v for k, v in payload.items() if k not in flat]
    elif isinstance(payload, tuple):
        children = payload
    elif isinstance(payload, list):
        return len(payload)
    elif registered_name(type(payload)) is not None:
        children = fields_of(payload)[1]
    else:
        return None
    for child in children:
        n = rows(child)
        if n is not None:
            return n
    return None


def _batched(x: Any, n: int) -> bool:
    """Whether leaf `x` runs along a batch dimension of `n` rows."""
    if isinstance(x, torch.Tensor):
        return x.dim() >= 1 and int(x.size(0)) == n
    if is_tensordict(x) or is_non_tensor_data(x):
        size = tuple(x.batch_size)
        return bool(size) and int(size[0]) == n
    if np is not None and isinstance(x, np.ndarray):
        return x.ndim >= 1 and int(x.shape[0]) == n
    if isinstance(x, list):
        return len(x) == n
    return False


def cut(payload: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of `payload` (per-call leaves kept as they are)."""
    n = rows(payload)
    if n is None:
        raise CodecError("cut: the payload has no batch dimension (no tensor, TensorDict or array of one "
                         "dimension or more)")
    if not 0 <= start <= stop <= n:
        raise CodecError(f"cut: rows [{start}, {stop}) out of a payload of {n} rows")
    return _cut(payload, n, start, stop, "payload")


def _cut(x: Any, n: int, a: int, b: int, where: str) -> Any:
    if isinstance(x, torch.Tensor):
        if not _batched(x, n):
            return x
        if x.is_nested:
            return _nested_rows(list(x.unbind(0))[a:b], x)
        return x[a:b]
    if is_tensordict(x) or is_non_tensor_data(x):
        if not _batched(x, n):
            return x
        nested = [k for k, v in x.items(include_nested=True, leaves_only=True)
                  if isinstance(v, torch.Tensor) and v.is_nested] if is_tensordict(x) else []
        if not nested:
            return x[a:b]
        out = x.exclude(*nested)[a:b]
        for k in nested:
            v = x.get(k)
            out.set(k, _nested_rows(list(v.unbind(0))[a:b], v))
        return out
    if np is not None and isinstance(x, np.ndarray):
        return x[a:b] if _batched(x, n) else x
    t = type(x)
    if t is dict or t is OrderedDict:
        out_d = {} if t is dict else OrderedDict()
        flat = _flat_lengths(x)
        for k, v in x.items():
            if k in flat:
                lengths = flat[k]
                out_d[k] = None if v is None else v[sum(lengths[:a]):sum(lengths[:b])]
                continue
            out_d[k] = _cut(v, n, a, b, where + key_repr(k))
        return out_d
    if t is list:
        return x[a:b] if len(x) == n else x
    if t is tuple:
        return tuple(_cut(v, n, a, b, f"{where}[{i}]") for i, v in enumerate(x))
    if registered_name(t) is not None:
        names, values = fields_of(x)
        return construct(t, names, [_cut(v, n, a, b, f"{where}.{m}") for m, v in zip(names, values)], where)
    return x


def _nested_rows(parts: List[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A nested tensor of the layout of `like` holding `parts` (its rows)."""
    if like.layout == torch.jagged and not parts:
        raise CodecError("cut: an empty slice of a jagged nested tensor")
    return nested_of_rows(parts, like)


def join(pieces: Sequence[Any]) -> Any:
    """The pieces concatenated in order along their batch dimension (per-call leaves: the first piece's)."""
    pieces = list(pieces)
    if not pieces:
        raise CodecError("join: no pieces")
    ns = [rows(p) for p in pieces]
    if any(n is None for n in ns):
        raise CodecError("join: a piece has no batch dimension")
    return _join(pieces, [int(n) for n in ns if n is not None], "payload")


def _join(items: List[Any], ns: List[int], where: str) -> Any:
    first = items[0]
    if len(items) == 1:
        return first
    leaf = isinstance(first, torch.Tensor) or is_tensordict(first) or is_non_tensor_data(first) or (
        np is not None and isinstance(first, np.ndarray))
    if leaf:
        if not _batched(first, ns[0]):
            return first
        if not all(_batched(x, n) for x, n in zip(items, ns)):
            raise CodecError(f"{where}: a leaf runs along the batch dimension in one piece and not in another")
        return _merge(items, where)
    t = type(first)
    if not all(type(x) is t for x in items):
        raise CodecError(f"{where}: cannot join values of different types")
    if t is dict or t is OrderedDict:
        keys = list(first.keys())
        if any(set(x.keys()) != set(keys) for x in items):
            raise CodecError(f"{where}: pieces have different keys")
        out = {} if t is dict else OrderedDict()
        flats = [_flat_lengths(x) for x in items]
        for k in keys:
            if all(k in f for f in flats):
                out[k] = _join_flat([x[k] for x in items], [f[k] for f in flats], where + key_repr(k))
                continue
            if any(k in f for f in flats):
                raise CodecError(f"{where}{key_repr(k)}: a flat field in one piece and not in another")
            out[k] = _join([x[k] for x in items], ns, where + key_repr(k))
        return out
    if t is list:
        if len(first) != ns[0]:
            return first
        return [v for x in items for v in x]
    if t is tuple:
        if any(len(x) != len(first) for x in items):
            raise CodecError(f"{where}: tuples of different lengths")
        return tuple(_join([x[i] for x in items], ns, f"{where}[{i}]") for i in range(len(first)))
    if registered_name(t) is not None:
        names = fields_of(first)[0]
        columns = [fields_of(x)[1] for x in items]
        return construct(t, names, [_join([c[j] for c in columns], ns, f"{where}.{m}")
                                    for j, m in enumerate(names)], where)
    return first


def _join_flat(values: List[Any], lengths: List[List[int]], where: str) -> Any:
    """Flat fields joined: concatenated. A piece without one (None) beside pieces with one is all False
    when the field is a bool mask (TRL's `logprob_is_none`: the piece had no None), else an error."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if len(present) != len(values):
        if present[0].dtype != torch.bool:
            raise CodecError(f"{where}: a flat field is None in one piece and not in another")
        values = [torch.zeros(sum(n), dtype=torch.bool) if v is None else v for v, n in zip(values, lengths)]
    return torch.cat(values, 0)


def regroup(pieces: Sequence[Any], parts: int) -> List[Any]:
    """`pieces` (a step's mini-batches in recorded order) concatenated and split into `parts` equal
    parts, in order. CodecError when the rows do not split evenly."""
    sizes = [rows(p) for p in pieces]
    if any(s is None for s in sizes):
        raise CodecError("regroup: a piece has no batch dimension")
    total = sum(int(s) for s in sizes if s is not None)
    if parts < 1 or total % parts:
        raise CodecError(f"regroup: {total} rows do not split into {parts} equal parts")
    each = total // parts
    return [take(pieces, [int(s) for s in sizes if s is not None], j * each, (j + 1) * each) for j in range(parts)]


def take(pieces: Sequence[Any], sizes: Sequence[int], start: int, stop: int) -> Any:
    """Rows [start, stop) of the concatenation of `pieces` (of `sizes` rows each), joining only the
    pieces it overlaps."""
    out, offset = [], 0
    for piece, size in zip(pieces, sizes):
        a, b = max(start, offset), min(stop, offset + size)
        if a < b:
            out.append(piece if (a, b) == (offset, offset + size) else cut(piece, a - offset, b - offset))
        offset += size
    if not out:
        raise CodecError(f"take: rows [{start}, {stop}) are beyond the {offset} rows of the pieces")
    return join(out)
