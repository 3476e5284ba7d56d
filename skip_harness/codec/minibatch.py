"""The merge of a step's mini-batches into one payload (`merged`)."""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, List, Sequence

import torch

from skip_harness.errors import CodecError
from skip_harness.codec.payload_kinds import (
    SCALARS, construct, fields_of, is_non_tensor_data, is_tensordict, key_repr, np, registered_or_refuse,
)


def merge(payloads: Sequence[Any]) -> Any:
    """Concatenate the mini-batches of a step in order into one payload.

    Tensors: `torch.cat` on dim 0 (0-dim tensors are stacked); dicts key by key; lists concatenated;
    tuples element by element; TensorDicts with `torch.cat`; NumPy arrays concatenated; equal
    scalars and strings kept once, unequal ones become a list of the values in order."""
    payloads = list(payloads)
    if not payloads:
        raise CodecError("merge: no mini-batches to merge")
    return _merge(payloads, "payload")


def _merge(items: List[Any], where: str) -> Any:
    first = items[0]
    if len(items) == 1:
        return first
    if isinstance(first, torch.Tensor) and first.is_nested:
        if not all(isinstance(x, torch.Tensor) and x.is_nested for x in items):
            raise CodecError(f"{where}: cannot merge a nested tensor with {_type_names(items)}")
        try:
            return cat_nested(items)
        except Exception as exc:
            raise CodecError(f"{where}: cannot concatenate nested tensors: {exc}") from exc
    if isinstance(first, torch.Tensor):
        if not all(isinstance(x, torch.Tensor) for x in items):
            raise CodecError(f"{where}: cannot merge a tensor with {_type_names(items)}")
        try:
            if first.dim() == 0:
                return torch.stack(items)
            return torch.cat(items, dim=0)
        except Exception as exc:
            raise CodecError(f"{where}: cannot concatenate tensors: {exc}") from exc
    if is_tensordict(first) or is_non_tensor_data(first):
        try:
            nested = _nested_keys(first)
            if nested:
                return _cat_tensordicts_with_nested(items, nested)
            return torch.cat(items, dim=0)
        except Exception as exc:
            raise CodecError(f"{where}: cannot concatenate TensorDicts: {exc}") from exc
    t = type(first)
    if not all(type(x) is t for x in items):
        raise CodecError(f"{where}: cannot merge values of different types: {_type_names(items)}")
    if t is dict or t is OrderedDict:
        keys = list(first.keys())
        for x in items[1:]:
            if list(x.keys()) != keys and set(x.keys()) != set(keys):
                raise CodecError(f"{where}: mini-batches have different keys: {sorted(map(str, keys))} "
                                 f"vs {sorted(map(str, x.keys()))}")
        out = {} if t is dict else OrderedDict()
        for k in keys:
            out[k] = _merge([x[k] for x in items], where + key_repr(k))
        return out
    if t is list:
        return [v for x in items for v in x]
    if t is tuple:
        n = len(first)
        if any(len(x) != n for x in items):
            raise CodecError(f"{where}: tuples of different lengths: {[len(x) for x in items]}")
        return tuple(_merge([x[i] for x in items], f"{where}[{i}]") for i in range(n))
    if np is not None and t is np.ndarray:
        if first.ndim == 0:
            return np.stack(items)
        return np.concatenate(items, axis=0)
    if t in SCALARS or (np is not None and isinstance(first, np.generic)):
        if all(_same_scalar(x, first) for x in items[1:]):
            return first
        return list(items)
    if registered_or_refuse(first, where) is not None:
        names = fields_of(first)[0]
        columns = [fields_of(x)[1] for x in items]
        merged = [_merge([c[j] for c in columns], f"{where}.{n}") for j, n in enumerate(names)]
        return construct(t, names, merged, where)
    raise CodecError(f"{where}: unsupported type {t.__module__}.{t.__qualname__}")


def nested_of_rows(rows: List[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A nested tensor of the layout of `like` (and, jagged, its ragged dimension) holding `rows`;
    rows whose other sizes differ fail in torch.cat."""
    if like.layout == torch.jagged:
        ragged = like._ragged_idx  # type: ignore[attr-defined]  # a jagged nested tensor
        values = torch.cat(rows, dim=ragged - 1)
        lengths = torch.tensor([r.shape[ragged - 1] for r in rows], dtype=torch.int64, device=values.device)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64, device=values.device)
        torch.cumsum(lengths, dim=0, out=offsets[1:])
        return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged)
    with warnings.catch_warnings():   # torch's note that the strided layout is a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.as_nested_tensor(rows, layout=like.layout)


def cat_nested(items: Sequence[torch.Tensor]) -> torch.Tensor:
    """Nested tensors concatenated along dim 0 (torch.cat does not support it): jagged ones as one
    jagged tensor of every row, with the first one's ragged dimension (a mini-batch of one row may have
    been built with another: torch picks the dimension whose sizes differ); strided ones from their
    components."""
    first = items[0]
    if first.layout == torch.jagged and any(x.layout != torch.jagged for x in items):
        raise CodecError("nested tensors of different layouts")
    return nested_of_rows([r for x in items for r in x.unbind(0)], first)


def _nested_keys(td: Any) -> List[Any]:
    """The keys (nested keys as tuples) of a TensorDict's nested-tensor leaves."""
    if not is_tensordict(td):
        return []
    return [k for k, v in td.items(include_nested=True, leaves_only=True)
            if isinstance(v, torch.Tensor) and v.is_nested]


def _cat_tensordicts_with_nested(items: List[Any], nested: List[Any]) -> Any:
    """torch.cat of TensorDicts holding nested tensors: the rest by torch.cat, the nested leaves by
    `cat_nested`."""
    for x in items[1:]:
        if set(_nested_keys(x)) != set(nested):
            raise CodecError(f"mini-batches have different nested-tensor keys: {sorted(map(str, nested))} "
                             f"vs {sorted(map(str, _nested_keys(x)))}")
    out = torch.cat([x.exclude(*nested) for x in items], dim=0)
    for k in nested:
        out.set(k, cat_nested([x.get(k) for x in items]))  # type: ignore[attr-defined]  # a TensorDict
    return out


def _same_scalar(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (a != a and b != b)  # NaN equals NaN here
    except Exception:
        return False


def _type_names(items: Sequence[Any]) -> str:
    return ", ".join(sorted({type(x).__name__ for x in items}))
