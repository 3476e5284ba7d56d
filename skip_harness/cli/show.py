"""`skip-harness show PATH [STEP [INNER]]`: what one cached mini-batch holds, loaded safely.

PATH is a namespace (or a directory holding exactly one), a step directory, or a payload file. The
payload is loaded with the codec (`torch.load(weights_only=True)`, then the codec's own records):
nothing stored in the file is ever run.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from rich.markup import escape
from rich.table import Table

from skip_harness.codec.payload_kinds import is_non_tensor_data, is_non_tensor_stack
from skip_harness.store import payload_file
from skip_harness.store.paths import payload_rel_at
from skip_harness.store import scan as _scan
from skip_harness.errors import CodecError, CorruptStepError
from skip_harness.store.layout import Layout, UrlPath, parse_namespace_leaf, parse_step_name
from skip_harness.store.stepstore import StepStore

from skip_harness.cli._common import EXIT_CORRUPT, EXIT_OK, CliError, fmt_time, human_bytes, namespaces_under, stdout_console
from skip_harness.cli._verify import VERL_HINT, _plain_reason

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

try:
    from tensordict import TensorDictBase
except Exception:  # pragma: no cover
    TensorDictBase = None

_MAX_ROWS = 400          # structure rows shown before "... more"
_VALUE_CHARS = 160


@dataclasses.dataclass
class Target:
    payload: Path
    layout: Optional[Layout] = None
    step: Optional[int] = None
    inner: int = 0
    rank: int = 0


# --------------------------------------------------------------------------------------------
# resolving PATH [STEP [INNER]]


def _enclosing_namespace(path: Path) -> Optional[Tuple[Layout, int, int, int]]:
    """(layout, step, inner, rank) when `path` is a payload file inside a namespace."""
    parts = path.parts
    for depth in (2, 3):                 # ns/step/file or ns/step/inner/file
        if len(parts) <= depth:
            continue
        ns = Path(*parts[: len(parts) - depth])
        kw = parse_namespace_leaf(ns.name)
        step = parse_step_name(parts[len(parts) - depth])
        if kw is None or step is None:
            continue
        layout = Layout(ns, K=kw[0], W=kw[1])
        where = layout.position_of("/".join(parts[len(parts) - depth + 1:]))
        if where is not None:
            return layout, step, where[0], where[1]
    return None


def resolve(path: Path, step: Optional[int], inner: Optional[int], rank: int) -> Target:
    if isinstance(path, UrlPath):       # an object store: a namespace or a step URL
        return _resolve_in_namespace(path, step, inner, rank)
    if path.is_file():
        if step is not None:
            raise CliError(f"{path} is a payload file: STEP and INNER go with a namespace, not a file")
        found = _enclosing_namespace(path)
        if found is None:
            return Target(path)
        layout, s, i, r = found
        return Target(path, layout, s, i, r)
    if not path.is_dir():
        raise CliError(f"{path} does not exist" if not path.exists() else f"{path} is not a file or directory")
    if step is None and parse_step_name(path.name) is not None and parse_namespace_leaf(path.parent.name):
        step, path = parse_step_name(path.name), path.parent       # a step directory
    return _resolve_in_namespace(path, step, inner, rank)


def _resolve_in_namespace(path: Path, step: Optional[int], inner: Optional[int], rank: int) -> Target:
    if isinstance(path, UrlPath) and step is None and parse_step_name(path.name) is not None \
            and parse_namespace_leaf(path.parent.name):
        step, path = parse_step_name(path.name), path.parent       # a step URL
    layouts = namespaces_under(path)
    if not layouts:
        raise CliError(f"{path}: no skip_harness namespace here (give a namespace, a step directory or a payload file)")
    if len(layouts) > 1:
        names = ", ".join(str(lay.root) for lay in layouts[:3]) + (" ..." if len(layouts) > 3 else "")
        raise CliError(f"{path} holds {len(layouts)} namespaces ({names}); name one of them")
    layout = layouts[0]
    report = _scan.scan_namespace(layout)
    if step is None:
        servable = [s.step for s in report.steps if s.servable]
        if not servable:
            raise CliError(f"{layout.root}: no complete step to show", EXIT_CORRUPT)
        step = servable[-1]
    elif report.get(step) is None:
        have = [s.step for s in report.steps]
        raise CliError(f"{layout.root}: no step {step} (steps: {_ranges(have) or 'none'})")
    inner = 0 if inner is None else inner
    if not 0 <= inner < layout.K:
        raise CliError(f"INNER {inner} is outside 0..{layout.K - 1} (K={layout.K} in {layout.root})")
    if not 0 <= rank < layout.W:
        raise CliError(f"--rank {rank} is outside 0..{layout.W - 1} (W={layout.W} in {layout.root})")
    return Target(layout.step_dir(step) / payload_rel_at(layout, step, inner, rank), layout, step, inner, rank)


def _ranges(steps: List[int]) -> str:
    out: List[str] = []
    run: List[int] = []
    for s in sorted(steps):
        if run and s == run[-1] + 1:
            run.append(s)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


# --------------------------------------------------------------------------------------------
# describing a payload


def _is_td(obj: Any) -> bool:
    return TensorDictBase is not None and isinstance(obj, TensorDictBase)


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


# --------------------------------------------------------------------------------------------
# the command


def _header(target: Target, meta: Dict[str, Any], status: Optional[_scan.StepReport],
            record) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    t.add_row("file", escape(str(target.payload)))
    if isinstance(target.payload, UrlPath):      # an object: its size as the commit record lists it
        rel = str(target.payload.relative_to(target.layout.step_dir(target.step))) if target.layout else ""
        sizes = {e.rel: e.bytes for e in record.files} if record is not None else {}
        if rel in sizes:
            t.add_row("size", human_bytes(sizes[rel]))
    else:
        try:
            t.add_row("size", human_bytes(target.payload.stat().st_size))
        except OSError:
            pass
    if target.layout is not None:
        t.add_row("namespace", f"{target.layout.root}  (K={target.layout.K} W={target.layout.W})")
        t.add_row("step", f"{target.step}   inner index {target.inner}   rank {target.rank}")
    if status is not None:
        t.add_row("status", escape(status.status + (f" ({status.reason})" if status.reason else "")))
    gen_s = meta.get("gen_s")
    if isinstance(gen_s, (int, float)):
        t.add_row("generation", f"{gen_s:.3f}s (this mini-batch)")
    created = meta.get("created") or (record.created if record is not None else None)
    if isinstance(created, (int, float)):
        t.add_row("written", fmt_time(created, time.time()))
    fp = record.fingerprint if record is not None else None
    if fp is not None:
        values = ", ".join(f"{k}={v!r}" for k, v in fp.values.items())
        t.add_row("fingerprint", escape(f"{fp.digest}  {values}"))
    elif target.layout is not None:
        t.add_row("fingerprint", "none recorded")
    return t


def cmd_show(path: Path, step: Optional[int], inner: Optional[int], rank: int, head: int, as_json: bool) -> int:
    target = resolve(path, step, inner, rank)
    meta: Dict[str, Any] = {}
    status = record = None
    if target.layout is not None:
        reader = StepStore(target.layout).reader
        status = _scan.classify_step(target.layout, target.step)
        try:
            meta = reader.read_meta(target.step, target.inner, target.rank)
        except CorruptStepError:
            meta = {}
        try:
            record = reader.read_commit(target.step)
        except CorruptStepError:
            record = None
    else:
        meta = payload_file.sibling_meta(target.payload)
    try:
        if target.layout is not None:         # a cache file: the verified read a hit uses
            payload = StepStore(target.layout).reader.read_inner(target.step, target.inner, target.rank)
        else:                                 # a file named on its own, outside any namespace
            payload = payload_file.load(target.payload)
    except (CodecError, CorruptStepError, OSError) as exc:
        reason = _plain_reason(str(exc))
        if "global_steps" in meta and "writer" not in meta:
            reason += f" ({VERL_HINT})"
        raise CliError(f"{reason}", EXIT_CORRUPT) from None
    rows = list(describe(payload))
    stored = [] if isinstance(target.payload, UrlPath) else payload_file.stored_fields(target.payload)
    if as_json:
        doc = {"file": str(target.payload), "namespace": None if target.layout is None else str(target.layout.root),
               "step": target.step, "inner_index": target.inner, "rank": target.rank,
               "status": None if status is None else status.status,
               "fingerprint": None if record is None or record.fingerprint is None else record.fingerprint.to_json(),
               "meta": meta, "structure": [dict(zip(("key", "type", "shape", "dtype", "bytes", "value"), r))
                                           for r in rows],
               "stored": [dict(vars(f), ratio=_ratio(f)) for f in stored]}
        if head:
            doc["head"] = dict(head_values(payload, head))
        sys_out = json.dumps(doc, indent=1, default=str)
        stdout_console().out(sys_out, highlight=False)
        return EXIT_OK
    console = stdout_console()
    console.print(_header(target, meta, status, record))
    t = Table(title="structure", title_justify="left")
    for col, justify in (("key", "left"), ("type", "left"), ("shape", "left"), ("dtype", "left"),
                         ("bytes", "right"), ("value", "left")):
        t.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]  # rich wants a Literal
    for r in rows[:_MAX_ROWS]:
        t.add_row(escape(r[0]), escape(r[1]), r[2], r[3], human_bytes(r[4]) if r[4] else "", escape(r[5]))
    if len(rows) > _MAX_ROWS:
        t.add_row(f"... {len(rows) - _MAX_ROWS} more", "", "", "", "", "")
    console.print(t)
    if stored:
        console.print(_stored_table(stored))
    if meta:
        console.print("meta", style="bold")
        console.out(_meta_text(meta), highlight=False)
    if head:
        h = Table(title=f"first {head} entries", title_justify="left")
        h.add_column("key")
        h.add_column("values", overflow="fold")
        for k, v in head_values(payload, head):
            h.add_row(escape(k), escape(v))
        console.print(h)
    return EXIT_OK
