"""Payload <-> file without pickled code.

A payload is whatever a trainer's `sample` returns: tensors, dicts (str/int keys), lists, tuples,
ints, floats, bools, complex numbers, strings, bytes, None, NumPy arrays and scalars, and TensorDicts.

`encode` turns a payload into a structure that `torch.save` writes and `torch.load(weights_only=True)`
reads back: only tensors, plain containers and scalars. Anything that is not one of those is
written as a *tagged dict* ``{TAG: kind, ...}``:

    "tensor"      a tensor that lived on another device: ``device`` (str) and ``data`` (CPU tensor)
    "tensordict"  a TensorDict: ``batch_size`` (list of ints), ``device`` (str or None), ``keys``, ``values``
    "ndarray"     a NumPy array: numeric ones as a CPU tensor in ``data``; others as ``items`` + ``shape``
    "npscalar"    a NumPy scalar: ``dtype`` and ``value``
    "dict"        a user dict that itself holds the key TAG (escaped): ``keys``, ``values``

`decode` is the inverse. Loading a file never imports or calls anything stored in it: `load_from`
uses `torch.load(weights_only=True)` and turns every failure into `CodecError`.
"""
from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from typing import Any, BinaryIO, Dict, List, Sequence, Union

import torch

from skip_harness.errors import CodecError

try:  # optional
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with torch wheels
    _np = None

try:  # optional
    from tensordict import TensorDictBase as _TensorDictBase
    from tensordict import TensorDict as _TensorDict
except Exception:  # ImportError, or a tensordict that does not match this torch
    _TensorDictBase = None
    _TensorDict = None

logger = logging.getLogger("skip_harness.codec")

TAG = "__skip_harness__"
FORMAT_VERSION = 1

# Attribute `snapshot` sets on its CPU copy of a tensor that lived on another device, so that
# `encode` still records where it came from.
_ORIGIN_ATTR = "_skip_harness_origin_device"

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _key_repr(key: Any) -> str:
    return f"[{key!r}]"


def origin_device(tensor: torch.Tensor) -> torch.device:
    """The device a tensor came from: its own, or for a `snapshot` copy, the original's."""
    dev = getattr(tensor, _ORIGIN_ATTR, None)
    return torch.device(dev) if dev is not None else tensor.device


def _is_tensordict(obj: Any) -> bool:
    return _TensorDictBase is not None and isinstance(obj, _TensorDictBase)


def _plain_cpu_tensor(t: torch.Tensor, where: str) -> torch.Tensor:
    """A detached, plain (no subclass, no Python attributes) CPU tensor holding only its own bytes."""
    if t.layout != torch.strided:
        raise CodecError(f"{where}: unsupported tensor layout {t.layout} (only dense tensors can be cached)")
    if t.is_quantized or t.is_nested:
        raise CodecError(f"{where}: unsupported tensor kind (quantized or nested)")
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    if t.device.type != "cpu":
        t = t.cpu()
    # A view into a larger storage would write the whole storage: keep just its elements.
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def encode(payload: Any) -> Any:
    """A structure of tensors, plain containers and scalars that `torch.save` can write and
    `torch.load(weights_only=True)` can read. Raises CodecError naming the type and the position."""
    return _encode(payload, "payload", set())


def _encode(obj: Any, where: str, active: set) -> Any:
    if isinstance(obj, torch.Tensor):
        dev = origin_device(obj)
        data = _plain_cpu_tensor(obj, where)
        if dev.type == "cpu":
            return data
        return {TAG: "tensor", "device": str(dev), "data": data}
    t = type(obj)
    if t in _SCALARS:
        return obj
    oid = id(obj)
    if oid in active:
        raise CodecError(f"{where}: the payload contains itself (a reference cycle)")
    active.add(oid)
    try:
        if t is dict or t is OrderedDict:
            out = {} if t is dict else OrderedDict()
            for k, v in obj.items():
                if type(k) not in (str, int, bool):
                    raise CodecError(
                        f"{where}: unsupported dict key type {type(k).__name__} ({k!r}); keys must be str or int"
                    )
                out[k] = _encode(v, where + _key_repr(k), active)
            if TAG in out:
                return {TAG: "dict", "ordered": t is OrderedDict, "keys": list(out.keys()),
                        "values": list(out.values())}
            return out
        if t is list:
            return [_encode(v, f"{where}[{i}]", active) for i, v in enumerate(obj)]
        if t is tuple:
            return tuple(_encode(v, f"{where}[{i}]", active) for i, v in enumerate(obj))
        if _is_tensordict(obj):
            keys = list(obj.keys())
            return {
                TAG: "tensordict",
                "batch_size": [int(s) for s in obj.batch_size],
                "device": None if obj.device is None else str(obj.device),
                "keys": keys,
                "values": [_encode(obj.get(k), where + _key_repr(k), active) for k in keys],
            }
        if _np is not None and isinstance(obj, _np.ndarray):
            return _encode_ndarray(obj, where, active)
        if _np is not None and isinstance(obj, _np.generic):
            if obj.dtype.kind in "biufc":
                return {TAG: "npscalar", "dtype": obj.dtype.str, "value": obj.item()}
            return _encode(obj.item(), where, active)
    finally:
        active.discard(oid)
    raise CodecError(f"{where}: unsupported type {t.__module__}.{t.__qualname__}")


def _encode_ndarray(arr: Any, where: str, active: set) -> Any:
    if arr.dtype.kind in "biufc" and not arr.dtype.hasobject:
        try:
            data = torch.from_numpy(_np.ascontiguousarray(arr)).clone()
        except TypeError:  # a dtype torch has no tensor for (e.g. float128)
            data = None
        if data is not None:
            return {TAG: "ndarray", "dtype": arr.dtype.str, "data": data}
    if arr.dtype.kind in "OUS":
        items = [_encode(v, f"{where}[{i}]", active) for i, v in enumerate(arr.ravel().tolist())]
        return {TAG: "ndarray", "dtype": arr.dtype.str if arr.dtype.kind != "O" else "O",
                "shape": list(arr.shape), "items": items}
    raise CodecError(f"{where}: unsupported NumPy dtype {arr.dtype}")


@functools.lru_cache(maxsize=None)
def _device_available(device: str) -> bool:
    try:
        dev = torch.device(device)
    except Exception:
        return False
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    if dev.type == "mps":
        return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    mod = getattr(torch, dev.type, None)
    is_available = getattr(mod, "is_available", None)
    if callable(is_available):
        try:
            if not is_available():
                return False
            count = getattr(mod, "device_count", None)
            return dev.index is None or not callable(count) or dev.index < count()
        except Exception:
            return False
    return dev.type == "meta"


def decode(obj: Any) -> Any:
    """Inverse of `encode`. Tensors go back to their recorded device when it exists here, else stay on CPU."""
    return _decode(obj, "payload")


def _decode(obj: Any, where: str) -> Any:
    t = type(obj)
    if isinstance(obj, torch.Tensor) or t in _SCALARS:
        return obj
    if t is dict or t is OrderedDict:
        kind = obj.get(TAG) if TAG in obj else None
        if kind is None:
            out = {} if t is dict else OrderedDict()
            for k, v in obj.items():
                out[k] = _decode(v, where + _key_repr(k))
            return out
        try:
            return _decode_tagged(kind, obj, where)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"{where}: malformed {kind!r} record: {exc}") from exc
    if t is list:
        return [_decode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if t is tuple:
        return tuple(_decode(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, torch.Size):
        return obj
    raise CodecError(f"{where}: unexpected stored type {t.__module__}.{t.__qualname__}")


def _decode_tagged(kind: str, obj: Dict[str, Any], where: str) -> Any:
    if kind == "tensor":
        data = obj["data"]
        if not isinstance(data, torch.Tensor):
            raise CodecError(f"{where}: malformed tensor record")
        device = obj["device"]
        if _device_available(device):
            return data.to(device)
        logger.debug("%s: device %s is not available here; left on CPU", where, device)
        return data
    if kind == "dict":
        keys, values = obj["keys"], obj["values"]
        out = OrderedDict() if obj.get("ordered") else {}
        for k, v in zip(keys, values, strict=True):
            out[k] = _decode(v, where + _key_repr(k))
        return out
    if kind == "tensordict":
        if _TensorDict is None:
            raise CodecError(f"{where}: stored TensorDict, but the tensordict package is not importable")
        keys, values = obj["keys"], obj["values"]
        data = {k: _decode(v, where + _key_repr(k)) for k, v in zip(keys, values, strict=True)}
        device = obj.get("device")
        if device is not None and not _device_available(device):
            device = None
        return _TensorDict(data, batch_size=list(obj["batch_size"]), device=device)
    if kind == "ndarray":
        if _np is None:
            raise CodecError(f"{where}: stored NumPy array, but numpy is not importable")
        dtype = _np.dtype(obj["dtype"]) if obj["dtype"] != "O" else _np.dtype(object)
        if "data" in obj:
            return obj["data"].numpy().astype(dtype, copy=False)
        items = [_decode(v, f"{where}[{i}]") for i, v in enumerate(obj["items"])]
        shape = tuple(obj["shape"])
        if dtype.kind == "O":
            arr = _np.empty(len(items), dtype=object)
            for i, v in enumerate(items):
                arr[i] = v
            return arr.reshape(shape)
        return _np.array(items, dtype=dtype).reshape(shape)
    if kind == "npscalar":
        if _np is None:
            raise CodecError(f"{where}: stored NumPy scalar, but numpy is not importable")
        return _np.dtype(obj["dtype"]).type(obj["value"])
    raise CodecError(f"{where}: unknown record kind {kind!r}")


# --------------------------------------------------------------------------------------------
# snapshot and merge


def snapshot(payload: Any) -> Any:
    """A deep copy whose every tensor is an independent CPU clone, so changes the trainer makes in
    place after `sample` returns never reach what is written. A tensor from another device keeps
    a note of that device (see `origin_device`), which `encode` records."""
    return _snapshot(payload, "payload")


def _snapshot(obj: Any, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        dev = origin_device(obj)
        if type(src) is not torch.Tensor:
            src = src.as_subclass(torch.Tensor)
        copy = src.to("cpu", copy=True) if src.device.type != "cpu" else src.clone()
        if dev.type != "cpu":
            setattr(copy, _ORIGIN_ATTR, str(dev))
        return copy
    t = type(obj)
    if t in _SCALARS:
        return obj
    if t is dict or t is OrderedDict:
        out = {} if t is dict else OrderedDict()
        for k, v in obj.items():
            out[k] = _snapshot(v, where + _key_repr(k))
        return out
    if t is list:
        return [_snapshot(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if t is tuple:
        return tuple(_snapshot(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if _is_tensordict(obj):
        # Keep the TensorDict (with its device, so encode records it) but own every tensor.
        return obj.clone()
    if _np is not None and isinstance(obj, _np.ndarray):
        if obj.dtype.kind != "O":
            return obj.copy()
        out = _np.empty(obj.size, dtype=object)
        for i, v in enumerate(obj.ravel().tolist()):
            out[i] = _snapshot(v, f"{where}[{i}]")
        return out.reshape(obj.shape)
    if _np is not None and isinstance(obj, _np.generic):
        return obj
    raise CodecError(f"{where}: unsupported type {t.__module__}.{t.__qualname__}")


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
    if isinstance(first, torch.Tensor):
        if not all(isinstance(x, torch.Tensor) for x in items):
            raise CodecError(f"{where}: cannot merge a tensor with {_type_names(items)}")
        try:
            if first.dim() == 0:
                return torch.stack(items)
            return torch.cat(items, dim=0)
        except Exception as exc:
            raise CodecError(f"{where}: cannot concatenate tensors: {exc}") from exc
    if _is_tensordict(first):
        try:
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
            out[k] = _merge([x[k] for x in items], where + _key_repr(k))
        return out
    if t is list:
        return [v for x in items for v in x]
    if t is tuple:
        n = len(first)
        if any(len(x) != n for x in items):
            raise CodecError(f"{where}: tuples of different lengths: {[len(x) for x in items]}")
        return tuple(_merge([x[i] for x in items], f"{where}[{i}]") for i in range(n))
    if _np is not None and t is _np.ndarray:
        if first.ndim == 0:
            return _np.stack(items)
        return _np.concatenate(items, axis=0)
    if t in _SCALARS or (_np is not None and isinstance(first, _np.generic)):
        if all(_same_scalar(x, first) for x in items[1:]):
            return first
        return list(items)
    raise CodecError(f"{where}: unsupported type {t.__module__}.{t.__qualname__}")


def _same_scalar(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (a != a and b != b)  # NaN equals NaN here
    except Exception:
        return False


def _type_names(items: Sequence[Any]) -> str:
    return ", ".join(sorted({type(x).__name__ for x in items}))


# --------------------------------------------------------------------------------------------
# files


def save_to(fileobj: BinaryIO, payload: Any) -> None:
    """Write `payload` to an open binary file object (anything with write() and flush())."""
    torch.save(encode(payload), fileobj)


def load_from(path: Union[str, os.PathLike], mmap: bool = True) -> Any:
    """Load a payload written by `save_to`. Never runs code stored in the file: anything that would
    need more than tensors, containers and scalars raises CodecError, as does any other load failure."""
    try:
        try:
            obj = torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")
        except RuntimeError as exc:
            # Files in torch's old (non-zip) format cannot be memory-mapped; load them normally.
            if not (mmap and "mmap" in str(exc)):
                raise
            obj = torch.load(path, weights_only=True, mmap=False, map_location="cpu")
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CodecError(f"{os.fspath(path)}: cannot be loaded safely: {type(exc).__name__}: {first_line}") from exc
    try:
        return decode(obj)
    except CodecError as exc:
        raise CodecError(f"{os.fspath(path)}: {exc}") from exc
