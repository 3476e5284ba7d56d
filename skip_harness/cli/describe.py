"""A payload described for `skip-harness show`: one row per field (path, type, dtype, shape, bytes,
first values), the first entries of each field, and how the file stores each tensor."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from rich.markup import escape
from rich.table import Table

from skip_harness.codec.payload_kinds import is_non_tensor_data, is_non_tensor_stack, is_tensordict
from skip_harness.cli._common import human_bytes

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


_MAX_ROWS = 400          # structure rows shown before "... more"
_VALUE_CHARS = 160


def _is_td(obj: Any) -> bool:
    return is_tensordict(obj)


def describe(obj: Any, path: str = "") -> Iterator[Tuple[str, str, str, str, int, str]]:
    """(key path, type, shape, dtype, bytes, value) rows, depth first; containers before their items."""
    name = path or "(payload)"
    if isinstance(obj, torch.Tensor) and obj.is_nested:
        yield name, f"NestedTensor({str(obj.layout).replace('torch.', '')})", _nested_shape(obj), \
            str(obj.dtype).replace("torch.", ""), _nested_bytes(obj), ""
        return
    if isinstance(obj, torch.Tensor):
        value = repr(obj.item()) if obj.dim() == 0 else ""
        yield name, "Tensor", _shape(obj.shape), str(obj.dtype).replace("torch.", ""), \
            obj.numel() * obj.element_size(), value
        return
    if np is not None and isinstance(obj, np.ndarray):
        yield name, "ndarray", _shape(obj.shape), str(obj.dtype), int(obj.nbytes), ""
        return
    if is_non_tensor_stack(obj):
        values = obj.tolist()
        yield name, "NonTensorStack", _shape(obj.batch_size), "", _scalar_bytes(values), _short(values)
        return
    if is_non_tensor_data(obj):
        yield name, type(obj).__name__, _shape(obj.batch_size), "", _scalar_bytes(obj.data), _short(obj.data)
        return
    kids: Optional[List[Tuple[str, Any]]] = None
    kind = type(obj).__name__
    shape = ""
    if _is_td(obj):
        kids, shape = [(str(k), obj.get(k)) for k in obj.keys()], _shape(obj.batch_size)
    elif isinstance(obj, dict):
        kids, shape = [(repr(k) if not isinstance(k, str) else k, v) for k, v in obj.items()], f"{len(obj)} keys"
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        kids = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        kids = list(obj._asdict().items())  # type: ignore[attr-defined]  # a namedtuple
    elif isinstance(obj, (list, tuple)):
        shape = f"len {len(obj)}"
        kinds = {type(v).__name__ for v in obj}
        if obj and all(not _container(v) for v in obj):
            kind = f"{kind}[{' | '.join(sorted(kinds))}]"
            yield name, kind, shape, "", _scalar_bytes(obj), _short(obj)
            return
        if all(isinstance(v, dict) for v in obj) and len({tuple(v) for v in obj}) == 1:
            kids = [("[*]", obj[0])]          # records of one shape (verl's tags): describe one of them
            kind = f"{kind}[dict]"
        else:
            kids = [(f"[{i}]", v) for i, v in enumerate(obj[:4])]
            if len(obj) > 4:
                kids.append((f"[4..{len(obj) - 1}]", _Elided(len(obj) - 4)))
    if kids is None:
        if isinstance(obj, _Elided):
            yield name, "...", f"{obj.n} more", "", 0, ""
            return
        yield name, kind, "", "", _scalar_bytes(obj), _short(obj)
        return
    rows: List[Tuple[str, str, str, str, int, str]] = []
    total = 0
    for k, v in kids:
        child = f"{path}{k}" if k.startswith("[") else (f"{path}.{k}" if path else k)
        sub = list(describe(v, child))
        total += sub[0][4] * (len(obj) if k == "[*]" else 1)   # a child's first row is its own total
        rows += sub
    yield name, kind, shape, "", total, ""
    yield from rows


class _Elided:
    def __init__(self, n: int):
        self.n = n


def _container(v: Any) -> bool:
    return isinstance(v, (dict, list, tuple, torch.Tensor)) or _is_td(v) or (
        dataclasses.is_dataclass(v) and not isinstance(v, type)) or (np is not None and isinstance(v, np.ndarray))


def _nested_shape(t: torch.Tensor) -> str:
    """A nested tensor's shape, its ragged dimension as min..max of the rows' lengths."""
    rows = t.unbind(0)
    dims = []
    for d in range(1, t.dim()):
        sizes = {int(r.shape[d - 1]) for r in rows}
        dims.append(str(min(sizes)) if len(sizes) == 1 else f"{min(sizes)}..{max(sizes)}")
    return "(" + ", ".join([str(int(t.size(0)))] + dims) + ("," if t.dim() == 1 else "") + ")"


def _nested_bytes(t: torch.Tensor) -> int:
    if t.layout == torch.jagged:
        parts = [t.values(), t.offsets()] + ([t.lengths()] if t.lengths() is not None else [])  # type: ignore[attr-defined]
    else:
        parts = list(t.unbind(0))
    return sum(p.numel() * p.element_size() for p in parts)


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _scalar_bytes(v: Any) -> int:
    if isinstance(v, (str, bytes)):
        return len(v.encode() if isinstance(v, str) else v)
    if isinstance(v, (list, tuple)):
        return sum(_scalar_bytes(x) for x in v)
    return 8 if isinstance(v, (int, float, bool)) else 0


def _short(v: Any, limit: int = _VALUE_CHARS) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def head_values(obj: Any, n: int, path: str = "") -> Iterator[Tuple[str, str]]:
    """(key path, first n entries) of every leaf along the mini-batch's first dimension."""
    if isinstance(obj, torch.Tensor) and obj.is_nested:
        rows = [r.detach().cpu() for r in obj.unbind(0)[:n]]
        yield path or "(payload)", _short([(r.float() if r.dtype == torch.bfloat16 else r).tolist() for r in rows], 2000)
        return
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        t = t.float() if t.dtype == torch.bfloat16 else t
        yield path or "(payload)", _short(t.item() if t.dim() == 0 else t[:n].tolist(), 2000)
        return
    if np is not None and isinstance(obj, np.ndarray):
        yield path or "(payload)", _short(obj.tolist() if obj.ndim == 0 else obj[:n].tolist(), 2000)
        return
    if is_non_tensor_stack(obj):
        yield path or "(payload)", _short(obj.tolist()[:n], 2000)
        return
    if is_non_tensor_data(obj):
        yield path or "(payload)", _short(obj.data, 2000)
        return
    if _is_td(obj):
        items = [(str(k), obj.get(k)) for k in obj.keys()]
    elif isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        items = list(obj._asdict().items())  # type: ignore[attr-defined]  # a namedtuple
    elif isinstance(obj, (list, tuple)):
        yield path or "(payload)", _short(list(obj[:n]), 2000)
        return
    else:
        yield path or "(payload)", _short(obj, 2000)
        return
    for k, v in items:
        yield from head_values(v, n, f"{path}.{k}" if path else k)


def _ratio(f: Any) -> Optional[float]:
    return round(f.stored_bytes / f.logical_bytes, 4) if f.logical_bytes else None


def _stored_table(stored: List[Any]) -> Table:
    """How each stored tensor is held on disk: its dtype and the narrower one it is stored in, the
    compression, and stored over full-width bytes."""
    logical, on_disk = sum(f.logical_bytes for f in stored), sum(f.stored_bytes for f in stored)
    t = Table(title=f"stored: {human_bytes(on_disk)} of {human_bytes(logical)} at full width"
                    + (f" ({on_disk / logical:.3f})" if logical else ""), title_justify="left")
    for col, justify in (("field", "left"), ("dtype", "left"), ("stored as", "left"), ("compression", "left"),
                         ("bytes", "right"), ("stored", "right"), ("ratio", "right")):
        t.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]  # rich wants a Literal
    for f in stored[:_MAX_ROWS]:
        ratio = _ratio(f)
        t.add_row(escape(f.name), f.dtype, f.stored_dtype, f.compression, human_bytes(f.logical_bytes),
                  human_bytes(f.stored_bytes), "" if ratio is None else f"{ratio:.3f}")
    if len(stored) > _MAX_ROWS:
        t.add_row(f"... {len(stored) - _MAX_ROWS} more", "", "", "", "", "", "")
    return t


def _meta_text(meta: Dict[str, Any]) -> str:
    shown = dict(meta)
    if isinstance(shown.get("rng"), dict):
        shown["rng"] = f"<recorded generator states: {', '.join(sorted(shown['rng']))}>"
    return json.dumps(shown, indent=1, default=str)
