"""Payload <-> file without pickled code.

A payload is whatever a trainer's `sample` returns: tensors, dicts (str/int keys), lists, tuples,
ints, floats, bools, complex numbers, strings, bytes, None, NumPy arrays and scalars, TensorDicts,
and dataclasses / namedtuples whose type was registered with :func:`register_type`.

`encode` turns a payload into a structure of plain CPU tensors, plain containers and scalars. Anything
else is written as a *tagged dict* ``{TAG: kind, ...}``:

    "tensor"      a tensor that lived on another device: ``device`` (str) and ``data`` (CPU tensor)
    "tensordict"  a TensorDict: ``batch_size`` (list of ints), ``device`` (str or None), ``keys``, ``values``
    "nontensor"   a tensordict NonTensorData or MetaData: ``class``, ``batch_size``, ``device``, ``value``
    "nontensorstack"  a tensordict NonTensorStack: ``batch_size``, ``device``, ``items`` (its values as
                  nested lists, one level per batch dimension)
    "ndarray"     a NumPy array: numeric ones as a CPU tensor in ``data``; others as ``items`` + ``shape``
    "npscalar"    a NumPy scalar: ``dtype`` and ``value``
    "dict"        a user dict that itself holds the key TAG (escaped): ``keys``, ``values``
    "object"      a registered dataclass or namedtuple: ``type`` (its registered name), ``fields``, ``values``

`decode` is the inverse. A registered type is rebuilt from this process's name -> class registry; nothing
is ever imported or called by a name found in a file.

The file (FORMAT_VERSION 2) is a small JSON header followed by the raw bytes of every tensor:

    MAGIC (8 bytes) | u32 format version | u32 0 | u64 header length | header (UTF-8 JSON) | pad |
    tensor bytes, each at a 64-byte aligned offset

The header holds ``format``, ``tensors`` (one ``[dtype, shape, offset, nbytes]`` per tensor) and ``tree``
(the encoded structure: JSON scalars and lists as themselves, every other value a one-key object, e.g.
``{"T": 3}`` for tensor 3, ``{"d": [[key, value], ...]}`` for a dict). Loading parses JSON and maps the
file: there is no unpickling at all. Files of the previous version (``torch.save`` of the encoded
structure, and older caches' ``torch.save`` files) are still read, with ``torch.load(weights_only=True)``.
Every failure to load is a `CodecError` that names the file once.
"""
from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import json
import logging
import math
import mmap as _mmap
import os
import re
import struct
import threading
from collections import OrderedDict
from typing import Any, BinaryIO, Dict, List, Optional, Sequence, Tuple, Union

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

try:  # optional, and newer than TensorDict itself
    from tensordict import MetaData as _MetaData
    from tensordict import NonTensorData as _NonTensorData
    from tensordict import NonTensorStack as _NonTensorStack
except Exception:
    _MetaData = _NonTensorData = _NonTensorStack = None

logger = logging.getLogger("skip_harness.codec")

TAG = "__skip_harness__"
FORMAT_VERSION = 2            # 1: torch.save of the encoded structure (read, never written any more)
MAGIC = b"\x89SKH\r\n\x1a\n"
_PREAMBLE = struct.Struct("<8sIIQ")   # magic, format version, reserved, header length
_ALIGN = 64
_MAX_HEADER_BYTES = 1 << 30


class UnregisteredTypeError(CodecError):
    """A dataclass or namedtuple whose type is not registered (at write), or a file holding a registered
    type's record whose name this process has not registered (at read). Not a corrupt file."""


# --------------------------------------------------------------------------------------------
# registered types (dataclasses and namedtuples)

_registry_lock = threading.Lock()
_by_name: Dict[str, type] = {}
_by_class: Dict[type, str] = {}


def _is_namedtuple_class(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_type(cls: Optional[type] = None, name: Optional[str] = None):
    """Let instances of a dataclass or namedtuple class be cached; they come back as that class.

    `name` (default ``module.QualName``) is what the file records; loading rebuilds the instance from
    the class registered under that name in the loading process (nothing is imported from the file),
    so register the type in every process that reads or writes it. Returns the class, so it also works
    as a decorator (``@register_type`` or ``@register_type(name="...")``)."""
    if cls is None:
        return lambda c: register_type(c, name)
    if not isinstance(cls, type) or not (dataclasses.is_dataclass(cls) or _is_namedtuple_class(cls)):
        raise CodecError(f"register_type: {cls!r} is not a dataclass or namedtuple class")
    key = _qualified(cls) if name is None else name
    if not isinstance(key, str) or not key:
        raise CodecError(f"register_type: the name must be a non-empty string, got {key!r}")
    with _registry_lock:
        other = _by_name.get(key)
        if other is not None and other is not cls and _qualified(other) != _qualified(cls):
            raise CodecError(f"register_type: the name {key!r} is already registered for {_qualified(other)}")
        old = _by_class.get(cls)
        if old is not None and old != key:
            del _by_name[old]
        if other is not None and other is not cls:  # the same class defined again (a re-run notebook cell)
            _by_class.pop(other, None)
        _by_name[key] = cls
        _by_class[cls] = key
    return cls


def unregister_type(cls: type) -> None:
    """Forget a registered class (tests, notebooks)."""
    with _registry_lock:
        key = _by_class.pop(cls, None)
        if key is not None:
            _by_name.pop(key, None)


def registered_name(cls: type) -> Optional[str]:
    return _by_class.get(cls)


def _registered_or_refuse(obj: Any, where: str) -> Optional[str]:
    """The registered name of a dataclass / namedtuple instance's type; None if obj is neither;
    UnregisteredTypeError naming the type and how to register it if it is one but not registered."""
    t = type(obj)
    if not (_is_namedtuple_class(t) or (dataclasses.is_dataclass(t) and not isinstance(obj, type))):
        return None
    name = _by_class.get(t)
    if name is None:
        kind = "namedtuple" if _is_namedtuple_class(t) else "dataclass"
        raise UnregisteredTypeError(
            f"{where}: {_qualified(t)} is a {kind} whose type is not registered with the codec; call "
            f"skip_harness.codec.register_type({t.__qualname__}) before caching it (and before loading it)"
        )
    return name


def _fields_of(obj: Any) -> Tuple[List[str], List[Any]]:
    if isinstance(obj, tuple):
        names = list(type(obj)._fields)
        return names, list(obj)
    names = [f.name for f in dataclasses.fields(obj)]
    return names, [getattr(obj, n) for n in names]


def _rebuild(name: str, names: Sequence[str], values: Sequence[Any], where: str) -> Any:
    cls = _by_name.get(name)
    if cls is None:
        short = name.rsplit(".", 1)[-1]
        raise UnregisteredTypeError(
            f"{where}: holds a {name} record, a type not registered in this process; call "
            f"skip_harness.codec.register_type({short}) before loading it"
        )
    return _construct(cls, list(names), list(values), where)


def _construct(cls: type, names: List[str], values: List[Any], where: str) -> Any:
    if _is_namedtuple_class(cls):
        if names != list(cls._fields):
            raise CodecError(f"{where}: stored fields {names} differ from {_qualified(cls)}'s {list(cls._fields)}")
        return cls._make(values)
    fields = dataclasses.fields(cls)
    if names != [f.name for f in fields]:
        raise CodecError(f"{where}: stored fields {names} differ from {_qualified(cls)}'s "
                         f"{[f.name for f in fields]}")
    kwargs = {f.name: v for f, v in zip(fields, values) if f.init}
    obj = cls(**kwargs)
    for f, v in zip(fields, values):
        if not f.init:
            object.__setattr__(obj, f.name, v)
    return obj

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


def _is_non_tensor_data(obj: Any) -> bool:
    return _NonTensorData is not None and isinstance(obj, (_NonTensorData, _MetaData))


def _is_non_tensor_stack(obj: Any) -> bool:
    return _NonTensorStack is not None and isinstance(obj, _NonTensorStack)


def _plain_cpu_tensor(t: torch.Tensor, where: str) -> torch.Tensor:
    """A detached, plain (no subclass, no Python attributes) CPU tensor holding only its own bytes."""
    if t.layout != torch.strided:
        raise CodecError(f"{where}: unsupported tensor layout {t.layout} (only dense tensors can be cached)")
    if t.is_quantized or t.is_nested:
        raise CodecError(f"{where}: unsupported tensor kind (quantized or nested)")
    t = t.detach().resolve_conj().resolve_neg()  # lazy conjugate / negative views: their values, in memory
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
        if _is_non_tensor_data(obj) or _is_non_tensor_stack(obj):
            return _encode_non_tensor(obj, where, active)
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
        name = _registered_or_refuse(obj, where)
        if name is not None:
            names, values = _fields_of(obj)
            return {TAG: "object", "type": name, "fields": names,
                    "values": [_encode(v, f"{where}.{n}", active) for n, v in zip(names, values)]}
    finally:
        active.discard(oid)
    raise CodecError(f"{where}: unsupported type {t.__module__}.{t.__qualname__}")


def _encode_non_tensor(obj: Any, where: str, active: set) -> Any:
    """A NonTensorData / MetaData (one value for its whole batch) or a NonTensorStack (one value per
    batch element, kept as nested lists with one level per batch dimension)."""
    batch_size = [int(s) for s in obj.batch_size]
    device = None if obj.device is None else str(obj.device)
    if not _is_non_tensor_stack(obj):
        return {TAG: "nontensor", "class": "MetaData" if isinstance(obj, _MetaData) else "NonTensorData",
                "batch_size": batch_size, "device": device, "value": _encode(obj.data, where, active)}
    if 0 in batch_size[:-1]:
        raise CodecError(f"{where}: a NonTensorStack of batch size {batch_size} (empty along a leading "
                         "dimension) cannot be rebuilt, so it is not cached")
    items = obj.tolist()

    def nested(values: Any, depth: int, at: str) -> Any:
        if depth == len(batch_size):
            return _encode(values, at, active)
        if type(values) is not list or len(values) != batch_size[depth]:
            raise CodecError(f"{where}: a NonTensorStack of batch size {batch_size} whose values do not "
                             "have that shape cannot be cached")
        return [nested(v, depth + 1, f"{at}[{i}]") for i, v in enumerate(values)]

    return {TAG: "nontensorstack", "batch_size": batch_size, "device": device,
            "items": nested(items, 0, where)}


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


def decode(obj: Any, *, check_only: bool = False) -> Any:
    """Inverse of `encode`. Tensors go back to their recorded device when it exists here, else stay on CPU.
    With `check_only`, the structure is validated without building registered types or TensorDicts
    (so a process that registered nothing can check a file) and None is returned."""
    out = _decode(obj, "payload", check_only)
    return None if check_only else out


def _decode(obj: Any, where: str, check_only: bool = False) -> Any:
    t = type(obj)
    if isinstance(obj, torch.Tensor) or t in _SCALARS:
        return obj
    if t is dict or t is OrderedDict:
        kind = obj.get(TAG) if TAG in obj else None
        if kind is None:
            out = {} if t is dict else OrderedDict()
            for k, v in obj.items():
                out[k] = _decode(v, where + _key_repr(k), check_only)
            return out
        try:
            return _decode_tagged(kind, obj, where, check_only)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"{where}: malformed {kind!r} record: {exc}") from exc
    if t is list:
        return [_decode(v, f"{where}[{i}]", check_only) for i, v in enumerate(obj)]
    if t is tuple:
        return tuple(_decode(v, f"{where}[{i}]", check_only) for i, v in enumerate(obj))
    if isinstance(obj, torch.Size):
        return obj
    raise CodecError(f"{where}: unexpected stored type {t.__module__}.{t.__qualname__}")


def _decode_tagged(kind: str, obj: Dict[str, Any], where: str, check_only: bool = False) -> Any:
    if kind == "object":
        name, names, values = obj["type"], obj["fields"], obj["values"]
        if (not isinstance(name, str) or type(names) is not list or type(values) is not list
                or len(names) != len(values) or not all(isinstance(n, str) for n in names)):
            raise CodecError(f"{where}: malformed object record")
        decoded = [_decode(v, f"{where}.{n}", check_only) for n, v in zip(names, values)]
        return None if check_only else _rebuild(name, names, decoded, where)
    if kind == "tensor":
        data = obj["data"]
        if not isinstance(data, torch.Tensor) or not isinstance(obj["device"], str):
            raise CodecError(f"{where}: malformed tensor record")
        device = obj["device"]
        if check_only:
            return None
        if _device_available(device):
            return data.to(device)
        logger.debug("%s: device %s is not available here; left on CPU", where, device)
        return data
    if kind == "dict":
        keys, values = obj["keys"], obj["values"]
        out = OrderedDict() if obj.get("ordered") else {}
        for k, v in zip(keys, values, strict=True):
            out[k] = _decode(v, where + _key_repr(k), check_only)
        return out
    if kind == "tensordict":
        keys, values = obj["keys"], obj["values"]
        data = {k: _decode(v, where + _key_repr(k), check_only) for k, v in zip(keys, values, strict=True)}
        if check_only:
            return None
        if _TensorDict is None:
            raise CodecError(f"{where}: stored TensorDict, but the tensordict package is not importable")
        device = obj.get("device")
        if device is not None and not _device_available(device):
            device = None
        return _TensorDict(data, batch_size=list(obj["batch_size"]), device=device)
    if kind in ("nontensor", "nontensorstack"):
        return _decode_non_tensor(kind, obj, where, check_only)
    if kind == "ndarray":
        if _np is None:
            raise CodecError(f"{where}: stored NumPy array, but numpy is not importable")
        dtype = _np.dtype(obj["dtype"]) if obj["dtype"] != "O" else _np.dtype(object)
        if "data" in obj:
            if not isinstance(obj["data"], torch.Tensor):
                raise CodecError(f"{where}: malformed ndarray record")
            return None if check_only else obj["data"].numpy().astype(dtype, copy=False)
        items = [_decode(v, f"{where}[{i}]", check_only) for i, v in enumerate(obj["items"])]
        shape = tuple(obj["shape"])
        if check_only:
            return None
        if dtype.kind == "O":
            arr = _np.empty(len(items), dtype=object)
            for i, v in enumerate(items):
                arr[i] = v
            return arr.reshape(shape)
        return _np.array(items, dtype=dtype).reshape(shape)
    if kind == "npscalar":
        if _np is None:
            raise CodecError(f"{where}: stored NumPy scalar, but numpy is not importable")
        value = _np.dtype(obj["dtype"]).type(obj["value"])
        return None if check_only else value
    raise CodecError(f"{where}: unknown record kind {kind!r}")


def _decode_non_tensor(kind: str, obj: Dict[str, Any], where: str, check_only: bool) -> Any:
    batch_size, device = obj["batch_size"], obj.get("device")
    if type(batch_size) is not list or not all(type(s) is int and s >= 0 for s in batch_size) \
            or not (device is None or isinstance(device, str)):
        raise CodecError(f"{where}: malformed {kind} record")
    if device is not None and not _device_available(device):
        device = None
    if kind == "nontensor":
        cls_name = obj["class"]
        if cls_name not in ("NonTensorData", "MetaData"):
            raise CodecError(f"{where}: malformed nontensor record (class {str(cls_name)[:40]!r})")
        value = _decode(obj["value"], where, check_only)
        if check_only:
            return None
        if _NonTensorData is None:
            raise CodecError(f"{where}: stored {cls_name}, but this tensordict has no non-tensor data")
        cls = _NonTensorData if cls_name == "NonTensorData" else _MetaData
        return cls(data=value, batch_size=batch_size, device=device)

    def nested(items: Any, depth: int, at: str) -> Any:
        if depth == len(batch_size):
            value = _decode(items, at, check_only)
            return None if check_only else _NonTensorData(data=value, batch_size=[], device=device)
        if type(items) is not list or len(items) != batch_size[depth]:
            raise CodecError(f"{where}: malformed nontensorstack record (its items do not have shape "
                             f"{batch_size})")
        children = [nested(v, depth + 1, f"{at}[{i}]") for i, v in enumerate(items)]
        return None if check_only else _NonTensorStack(*children)

    if not check_only and _NonTensorStack is None:
        raise CodecError(f"{where}: stored NonTensorStack, but this tensordict has no non-tensor data")
    out = nested(obj["items"], 0, where)
    if not check_only and list(out.batch_size) != batch_size:  # a shape tensordict cannot stack
        raise CodecError(f"{where}: malformed nontensorstack record (batch size {batch_size})")
    return out


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
        clone = src.to("cpu", copy=True) if src.device.type != "cpu" else src.clone()
        if dev.type != "cpu":
            setattr(clone, _ORIGIN_ATTR, str(dev))
        return clone
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
    if _is_tensordict(obj) or _is_non_tensor_data(obj):
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
    if _registered_or_refuse(obj, where) is not None:
        names, values = _fields_of(obj)
        copies = [_snapshot(v, f"{where}.{n}") for n, v in zip(names, values)]
        if isinstance(obj, tuple):
            return t._make(copies)
        out = copy.copy(obj)  # keeps what __init__ would not rebuild; every field replaced below
        for n, v in zip(names, copies):
            object.__setattr__(out, n, v)
        return out
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
    if _is_tensordict(first) or _is_non_tensor_data(first):
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
    if _registered_or_refuse(first, where) is not None:
        names = _fields_of(first)[0]
        columns = [_fields_of(x)[1] for x in items]
        merged = [_merge([c[j] for c in columns], f"{where}.{n}") for j, n in enumerate(names)]
        return _construct(t, names, merged, where)
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rpartition(".")[2]


@functools.lru_cache(maxsize=None)
def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype) or name.startswith("q"):  # quantized dtypes are never written
        raise CodecError(f"unknown tensor dtype {name!r}")
    return dtype


def _pack(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """The encoded structure as a JSON tree; every tensor is appended to `tensors` and named by index."""
    t = type(obj)
    if obj is None or t is bool or t is str or t is int:
        return obj
    if t is float:
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if t is list:
        return [_pack(v, tensors) for v in obj]
    if t is dict or t is OrderedDict:
        return {"d" if t is dict else "o": [[k, _pack(v, tensors)] for k, v in obj.items()]}
    if t is torch.Tensor:
        tensors.append(obj)
        return {"T": len(tensors) - 1}
    if t is tuple:
        return {"t": [_pack(v, tensors) for v in obj]}
    if t is bytes:
        return {"b": base64.b64encode(obj).decode("ascii")}
    if t is complex:
        return {"c": [_pack(obj.real, tensors), _pack(obj.imag, tensors)]}
    raise CodecError(f"internal: encode produced a {t.__qualname__}")  # pragma: no cover


_KEY_TYPES = (str, int, bool)
_NONFINITE = ("nan", "inf", "-inf")


def _unpack(node: Any, tensors: List[torch.Tensor]) -> Any:
    """Inverse of `_pack`, validating every node (a file is untrusted input)."""
    t = type(node)
    if node is None or t is bool or t is str or t is int or t is float:
        return node
    if t is list:
        return [_unpack(v, tensors) for v in node]
    if t is dict and len(node) == 1:
        ((kind, v),) = node.items()
        if kind == "T" and type(v) is int and 0 <= v < len(tensors):
            return tensors[v]
        if kind in ("d", "o") and type(v) is list:
            out = {} if kind == "d" else OrderedDict()
            for pair in v:
                if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in _KEY_TYPES:
                    break
                out[pair[0]] = _unpack(pair[1], tensors)
            else:
                return out
        elif kind == "t" and type(v) is list:
            return tuple(_unpack(x, tensors) for x in v)
        elif kind == "b" and type(v) is str:
            try:
                return base64.b64decode(v, validate=True)
            except ValueError:
                pass
        elif kind == "c" and type(v) is list and len(v) == 2:
            re_, im = (_unpack(x, tensors) for x in v)
            if type(re_) is float and type(im) is float:
                return complex(re_, im)
        elif kind == "f" and v in _NONFINITE:
            return float(v)
    raise CodecError(f"malformed header: unexpected node {str(node)[:80]}")


def _byte_view(t: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, without copying them."""
    u8 = t.reshape(-1).view(torch.uint8)
    if _np is not None:
        return memoryview(u8.numpy())
    import ctypes  # pragma: no cover - numpy ships with torch wheels

    return ctypes.string_at(u8.data_ptr(), u8.numel())  # pragma: no cover


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def save_to(fileobj: BinaryIO, payload: Any) -> int:
    """Write `payload` to an open binary file object (anything with write()) in the current format.
    The tensors' bytes are written straight from their memory (no pickling, no copy, no container).
    Returns the bytes written."""
    tensors: List[torch.Tensor] = []
    tree = _pack(encode(payload), tensors)
    table, views, offset = [], [], 0
    for t in tensors:
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        table.append([_dtype_name(t.dtype), list(t.shape), offset, nbytes])
        views.append((offset, _byte_view(t) if nbytes else b""))
        offset = _align(offset + nbytes)
    header = json.dumps({"format": FORMAT_VERSION, "tensors": table, "tree": tree},
                        ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header)) + header
    data_start = _align(len(head))
    fileobj.write(head + bytes(data_start - len(head)))
    pos = 0
    for off, view in views:
        if off > pos:
            fileobj.write(bytes(off - pos))
        if len(view):
            fileobj.write(view)
        pos = off + len(view)
    return data_start + pos


def _sanitized(exc: BaseException) -> str:
    """A short reason for a failed torch.load, without torch's advice to retry unsafely."""
    text = str(exc)
    if "Weights only load failed" in text or "weights_only" in text:
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f" ({found.group(1)})" if found else ""
        return f"it needs pickled code to load{what}, which skip_harness never runs"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _read_header(fd: int, size: int) -> Tuple[Dict[str, Any], int]:
    head = os.pread(fd, _PREAMBLE.size, 0)
    if len(head) < _PREAMBLE.size:
        raise CodecError("truncated: no complete header")
    magic, version, _reserved, hlen = _PREAMBLE.unpack(head)
    if version > FORMAT_VERSION or version < 2:
        raise CodecError(f"format version {version}; this skip_harness reads versions up to {FORMAT_VERSION}"
                         + (" (written by a newer skip_harness)" if version > FORMAT_VERSION else ""))
    if hlen > min(size, _MAX_HEADER_BYTES):
        raise CodecError(f"truncated: the header says {hlen} bytes, the file has {size}")
    raw = os.pread(fd, hlen, _PREAMBLE.size)
    if len(raw) != hlen:
        raise CodecError("truncated header")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"malformed header: {str(exc)[:200]}") from None
    if type(doc) is not dict or doc.get("format") != version or type(doc.get("tensors")) is not list \
            or "tree" not in doc:
        raise CodecError("malformed header")
    data_start = _align(_PREAMBLE.size + hlen)
    end = data_start
    for entry in doc["tensors"]:
        if (type(entry) is not list or len(entry) != 4 or type(entry[0]) is not str or type(entry[1]) is not list
                or not all(type(s) is int and s >= 0 for s in entry[1])
                or type(entry[2]) is not int or type(entry[3]) is not int or entry[2] < 0):
            raise CodecError(f"malformed tensor entry {str(entry)[:80]}")
        dtype = _dtype_from_name(entry[0])
        if entry[3] != math.prod(entry[1]) * dtype.itemsize or entry[2] % _ALIGN:
            raise CodecError(f"malformed tensor entry {str(entry)[:80]}")
        end = max(end, data_start + entry[2] + entry[3])
    if end > size:
        raise CodecError(f"truncated: {size} bytes, the header needs {end}")
    return doc, data_start


def _is_current_format(fd: int) -> bool:
    return os.pread(fd, len(MAGIC), 0) == MAGIC


def _tensors_from(buf: Any, doc: Dict[str, Any], data_start: int) -> List[torch.Tensor]:
    out = []
    for name, shape, off, nbytes in doc["tensors"]:
        dtype = _dtype_from_name(name)
        if nbytes == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        u8 = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=data_start + off)
        out.append(u8.view(dtype).reshape(shape))
    return out


def _open_nofollow(spath: str) -> int:
    try:
        return os.open(spath, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CodecError(f"{spath}: cannot be opened: {exc.strerror or exc}") from None


def load_from(path: Union[str, os.PathLike], mmap: bool = True) -> Any:
    """Load a payload written by `save_to` (or by the previous version's torch.save). Never runs code
    stored in the file: anything that is not tensors, containers and scalars raises CodecError, as
    does any other load failure; the message names the file once. With `mmap` the tensors are
    private (copy-on-write) views of the mapped file, read lazily."""
    spath = os.fspath(path)
    fd = _open_nofollow(spath)
    try:
        if not _is_current_format(fd):
            return _load_torch(spath, mmap)
        size = os.fstat(fd).st_size
        doc, data_start = _read_header(fd, size)
        if mmap:
            buf: Any = _mmap.mmap(fd, size, access=_mmap.ACCESS_COPY)
        else:
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                n = os.preadv(fd, [view[got:]], got)
                if n <= 0:
                    raise CodecError("truncated while reading")
                got += n
        structure = _unpack(doc["tree"], _tensors_from(buf, doc, data_start))
        return decode(structure)
    except UnregisteredTypeError as exc:
        raise UnregisteredTypeError(f"{spath}: {exc}") from None
    except CodecError as exc:
        raise CodecError(f"{spath}: {exc}") from None
    except (OSError, ValueError, RecursionError, RuntimeError) as exc:
        raise CodecError(f"{spath}: cannot be loaded: {_sanitized(exc)}") from None
    finally:
        os.close(fd)


def check_file(path: Union[str, os.PathLike]) -> None:
    """Raise CodecError (naming the file once) unless the file would load safely: its header and every
    record are well formed and everything lies within the file. Reads no tensor data, builds no
    registered type (a process that registered nothing can check any file) and runs nothing from it."""
    spath = os.fspath(path)
    fd = _open_nofollow(spath)
    try:
        if not _is_current_format(fd):
            obj = _torch_load(spath, mmap=True)
        else:
            doc, data_start = _read_header(fd, os.fstat(fd).st_size)
            placeholders = [torch.empty(0)] * len(doc["tensors"])
            obj = _unpack(doc["tree"], placeholders)
        decode(obj, check_only=True)
    except CodecError as exc:
        raise CodecError(f"{spath}: {exc}") from None
    except (OSError, ValueError, RecursionError, RuntimeError) as exc:
        raise CodecError(f"{spath}: cannot be loaded: {_sanitized(exc)}") from None
    finally:
        os.close(fd)


def _torch_load(spath: str, mmap: bool) -> Any:
    """torch.load(weights_only=True) of a file in the previous format; CodecError (no path) on failure."""
    try:
        try:
            return torch.load(spath, weights_only=True, mmap=mmap, map_location="cpu")
        except RuntimeError as exc:
            # Files in torch's old (non-zip) format cannot be memory-mapped; load them normally.
            if not (mmap and "mmap" in str(exc)):
                raise
            return torch.load(spath, weights_only=True, mmap=False, map_location="cpu")
    except Exception as exc:
        raise CodecError(f"cannot be loaded safely: {_sanitized(exc)}") from None


def _load_torch(spath: str, mmap: bool) -> Any:
    return decode(_torch_load(spath, mmap))
