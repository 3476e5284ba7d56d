"""What a payload may hold, besides tensors and plain containers: the scalar types, the optional NumPy
and tensordict kinds (None here when the package is missing), and the dataclass and namedtuple types
registered by name with `register_type`.

A registered type is rebuilt from this process's name -> class registry; nothing is ever imported or
called by a name found in a file.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness.errors import CodecError

try:  # optional
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch wheels
    np = None

# tensordict is optional and costly to import (it pulls in torch._dynamo: about 1.5 s of CPU per process), so
# it is imported only when a file to decode names one of its kinds. Telling whether an object is one of its
# kinds needs no import: an object cannot be a TensorDict unless its module is loaded already.
_tensordict_lock = threading.Lock()
_tensordict_tried = False


def _loaded_tensordict() -> Any:
    """The tensordict module if this process has imported it (whole), else None. Never imports it."""
    mod = sys.modules.get("tensordict")
    return mod if mod is not None and hasattr(mod, "TensorDictBase") else None


def tensordict_class(name: str) -> Any:
    """One of tensordict's classes (`TensorDict`, `NonTensorData`, `MetaData`, `NonTensorStack`), importing the
    package on first need; None when it is missing, does not match this torch, or lacks that class."""
    global _tensordict_tried
    mod = _loaded_tensordict()
    if mod is None and not _tensordict_tried:
        with _tensordict_lock:
            if not _tensordict_tried:
                _tensordict_tried = True
                try:
                    mod = importlib.import_module("tensordict")
                except Exception:  # ImportError, or a tensordict that does not match this torch
                    mod = None
        mod = mod or _loaded_tensordict()
    return getattr(mod, name, None) if mod is not None else None


def _loaded_class(name: str) -> Any:
    mod = _loaded_tensordict()
    return getattr(mod, name, None) if mod is not None else None

# Attribute a CPU copy of a tensor that lived on another device may carry, so that `encode` still
# records where it came from (the tests use it to stand for a CUDA tensor on a CPU-only machine).
ORIGIN_ATTR = "_skip_harness_origin_device"

SCALARS = (bool, int, float, complex, str, bytes, type(None))
TAG = "__skip_harness__"          # the key of a tagged dict (structure.py), escaped in a user dict that holds it


class UnregisteredTypeError(CodecError):
    """A dataclass or namedtuple whose type is not registered (at write), or a file holding a registered
    type's record whose name this process has not registered (at read). Not a corrupt file."""


# --------------------------------------------------------------------------------------------
# registered types (dataclasses and namedtuples)

_registry_lock = threading.Lock()
_by_name: Dict[str, type] = {}
_by_class: Dict[type, str] = {}


# Kinds registered on first use, by their qualified name, without importing their package before a
# payload holds one or a file names one: verl V0's DataProto (its TensorDict `batch`, its
# `non_tensor_batch` of NumPy object arrays -- each element through the codec's own encoding --, its
# `meta_info` dict), available when verl is importable.
LAZY_KINDS: Dict[str, Tuple[str, str]] = {"verl.protocol.DataProto": ("verl.protocol", "DataProto")}


def _lazy_class(name: str, *, import_it: bool) -> Optional[type]:
    """The class of a lazily registered kind: from the already imported module, or (`import_it`)
    importing it; None when it is not a lazy kind or its package is not there."""
    spec = LAZY_KINDS.get(name)
    if spec is None:
        return None
    module = sys.modules.get(spec[0])
    if module is None and import_it:
        try:
            module = importlib.import_module(spec[0])
        except Exception:
            return None
    cls = getattr(module, spec[1], None) if module is not None else None
    return cls if isinstance(cls, type) else None


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


def registered_or_refuse(obj: Any, where: str) -> Optional[str]:
    """The registered name of a dataclass / namedtuple instance's type; None if obj is neither;
    UnregisteredTypeError naming the type and how to register it if it is one but not registered."""
    t = type(obj)
    if not (_is_namedtuple_class(t) or (dataclasses.is_dataclass(t) and not isinstance(obj, type))):
        return None
    name = _by_class.get(t)
    if name is None and _lazy_class(_qualified(t), import_it=False) is t:
        name = _qualified(t)
        register_type(t, name)
    if name is None:
        kind = "namedtuple" if _is_namedtuple_class(t) else "dataclass"
        raise UnregisteredTypeError(
            f"{where}: {_qualified(t)} is a {kind} whose type is not registered with the codec; call "
            f"skip_harness.codec.register_type({t.__qualname__}) before caching it (and before loading it)"
        )
    return name


def fields_of(obj: Any) -> Tuple[List[str], List[Any]]:
    if isinstance(obj, tuple):
        names = list(type(obj)._fields)  # type: ignore[attr-defined]  # a namedtuple
        return names, list(obj)
    names = [f.name for f in dataclasses.fields(obj)]
    return names, [getattr(obj, n) for n in names]


def rebuild(name: str, names: Sequence[str], values: Sequence[Any], where: str) -> Any:
    cls = _by_name.get(name)
    if cls is None and name in LAZY_KINDS:
        cls = _lazy_class(name, import_it=True)
        if cls is None:
            raise UnregisteredTypeError(f"{where}: holds a {name}, but {LAZY_KINDS[name][0]} is not importable "
                                        "here (install the [verl] extra to load it)")
        register_type(cls, name)
    if cls is None:
        short = name.rsplit(".", 1)[-1]
        raise UnregisteredTypeError(
            f"{where}: holds a {name} record, a type not registered in this process; call "
            f"skip_harness.codec.register_type({short}) before loading it"
        )
    return construct(cls, list(names), list(values), where)


def construct(cls: type, names: List[str], values: List[Any], where: str) -> Any:
    if _is_namedtuple_class(cls):
        if names != list(cls._fields):  # type: ignore[attr-defined]  # a namedtuple class
            raise CodecError(f"{where}: stored fields {names} differ from {_qualified(cls)}'s {list(cls._fields)}")  # type: ignore[attr-defined]
        return cls._make(values)  # type: ignore[attr-defined]
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


# --------------------------------------------------------------------------------------------
# kinds of value


def key_repr(key: Any) -> str:
    """How a dict key is shown in a position ("payload['x'][0]")."""
    return f"[{key!r}]"


def origin_device(tensor: torch.Tensor) -> torch.device:
    """The device a tensor came from: its own, or for a CPU copy carrying ORIGIN_ATTR, the original's."""
    dev = getattr(tensor, ORIGIN_ATTR, None)
    return torch.device(dev) if dev is not None else tensor.device


def is_tensordict(obj: Any) -> bool:
    base = _loaded_class("TensorDictBase")
    return base is not None and isinstance(obj, base)


def is_non_tensor_data(obj: Any) -> bool:
    kinds = tuple(c for c in (_loaded_class("NonTensorData"), _loaded_class("MetaData")) if c is not None)
    return bool(kinds) and isinstance(obj, kinds)


def is_meta_data(obj: Any) -> bool:
    cls = _loaded_class("MetaData")
    return cls is not None and isinstance(obj, cls)


def is_non_tensor_stack(obj: Any) -> bool:
    cls = _loaded_class("NonTensorStack")
    return cls is not None and isinstance(obj, cls)


@functools.lru_cache(maxsize=None)
def device_available(device: str) -> bool:
    """Whether tensors can be put on `device` in this process (a recorded device may be absent here)."""
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
