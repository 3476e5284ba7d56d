"""A payload <-> a structure of plain CPU tensors, containers and scalars, without pickled code.

`encode` turns a payload into that structure; anything else is written as a *tagged dict*
``{TAG: kind, ...}`` (the kinds are listed in :mod:`skip_harness.codec`). `decode` is the inverse. A
registered type is rebuilt from this process's name -> class registry (`payload_kinds`); nothing is
ever imported or called by a name found in a file.
"""
from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import torch

from skip_harness.errors import CodecError
from skip_harness.codec.fastwalk import NOT_PLAIN, NonTensorMaker, PlainJSON, is_plain, plain, stack_values
from skip_harness.codec.payload_kinds import (
    ORIGIN_ATTR, SCALARS, TAG, device_available, fields_of, is_meta_data, is_non_tensor_data, is_non_tensor_stack, is_tensordict,
    key_repr, np, origin_device, rebuild, registered_or_refuse, tensordict_class,
)

logger = logging.getLogger("skip_harness.codec")



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
    return t  # a view into a larger storage is fine: only its own elements are written


def encode(payload: Any) -> Any:
    """A structure of tensors, plain containers and scalars that `torch.save` can write and
    `torch.load(weights_only=True)` can read. Raises CodecError naming the type and the position."""
    return _encode(payload, "payload", _Walk())


class _Walk(set):
    """The ids of the containers being encoded (to refuse cycles), and the field each stored tensor
    holds (id(tensor) -> position, e.g. ``payload['batch']['responses'].values``)."""

    def __init__(self, raw_plain: bool = False) -> None:
        super().__init__()
        self.names: Dict[int, str] = {}
        self.raw_plain = raw_plain   # plain values as PlainJSON references (encode_named), not copies

    def tensor(self, t: torch.Tensor, where: str) -> torch.Tensor:
        self.names[id(t)] = where
        return t


def encode_named(payload: Any) -> Tuple[Any, Dict[int, str]]:
    """`encode`, with the field each of the structure's tensors holds (id(tensor) -> position), for a
    file image made at once: plain values (chat messages, tags, uids) are PlainJSON references to the
    payload's own objects, which the image dumps as JSON text before the caller returns."""
    walk = _Walk(raw_plain=True)
    return _encode(payload, "payload", walk), walk.names


def _nested_meta(t: torch.Tensor) -> Optional[Tuple[Any, bool, torch.device]]:
    """A nested tensor's (layout, requires_grad, device), None for any other tensor. Read past the
    tensor's `__torch_function__`: through it, each of the three costs a jagged tensor ~10 us, ~50 us a
    field on the trainer's thread (its own C attributes hold the same values)."""
    if type(t) is torch.Tensor:
        return (t.layout, t.requires_grad, t.device) if t.is_nested else None
    with torch._C.DisableTorchFunctionSubclass():
        return (t.layout, t.requires_grad, t.device) if t.is_nested else None


def _encode(obj: Any, where: str, active: _Walk) -> Any:
    if isinstance(obj, torch.Tensor):
        nested = _nested_meta(obj)
        if nested is not None:
            return _encode_nested(obj, where, active, nested)
        dev = origin_device(obj)
        data = active.tensor(_plain_cpu_tensor(obj, where), where)
        if dev.type == "cpu":
            return data
        return {TAG: "tensor", "device": str(dev), "data": data}
    t = type(obj)
    if t in SCALARS:
        return obj
    if t is list or t is dict:
        if active.raw_plain:
            if is_plain(obj):
                return PlainJSON(obj)
        else:
            copied = plain(obj)
            if copied is not NOT_PLAIN:
                return copied
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
                # a scalar is itself: no position string built for it (a GRPO batch's chat messages
                # and tags are thousands of them, encoded on the trainer's thread)
                out[k] = v if type(v) in SCALARS else _encode(v, where + key_repr(k), active)
            if TAG in out:
                return {TAG: "dict", "ordered": t is OrderedDict, "keys": list(out.keys()),
                        "values": list(out.values())}
            return out
        if t is list:
            return [v if type(v) in SCALARS else _encode(v, f"{where}[{i}]", active) for i, v in enumerate(obj)]
        if t is tuple:
            return tuple(v if type(v) in SCALARS else _encode(v, f"{where}[{i}]", active) for i, v in enumerate(obj))
        if is_non_tensor_data(obj) or is_non_tensor_stack(obj):
            return _encode_non_tensor(obj, where, active)
        if is_tensordict(obj):
            keys = list(obj.keys())
            return {
                TAG: "tensordict",
                "batch_size": [int(s) for s in obj.batch_size],
                "device": None if obj.device is None else str(obj.device),
                "keys": keys,
                "values": [_encode(obj.get(k), where + key_repr(k), active) for k in keys],
            }
        if np is not None and isinstance(obj, np.ndarray):
            return _encode_ndarray(obj, where, active)
        if np is not None and isinstance(obj, np.generic):
            if obj.dtype.kind in "biufc":
                return {TAG: "npscalar", "dtype": obj.dtype.str, "value": obj.item()}
            return _encode(obj.item(), where, active)
        name = registered_or_refuse(obj, where)
        if name is not None:
            names, values = fields_of(obj)
            return {TAG: "object", "type": name, "fields": names,
                    "values": [_encode(v, f"{where}.{n}", active) for n, v in zip(names, values)]}
    finally:
        active.discard(oid)
    raise CodecError(f"{where}: unsupported type {t.__module__}.{t.__qualname__}")


def _encode_nested(nt: torch.Tensor, where: str, walk: _Walk, meta: Tuple[Any, bool, torch.device]) -> Dict[str, Any]:
    """A nested tensor as its dense components (no pickle): jagged ones as values / offsets / lengths,
    strided ones as the list of their components; each component a plain CPU tensor. `meta`: its
    `_nested_meta`."""
    layout, requires_grad, own_device = meta
    origin = getattr(nt, ORIGIN_ATTR, None)
    dev = torch.device(origin) if origin is not None else own_device
    if requires_grad:
        nt = nt.detach()          # (detaching a nested tensor dispatches through Python: only when needed)
    if layout == torch.jagged:
        lengths = nt.lengths()  # type: ignore[attr-defined]  # jagged nested tensor API
        # values(): a view of the buffer the tensor keeps, made through torch's dispatch (0.1 ms a
        # field); without autograd the buffer itself holds the same elements
        values = getattr(nt, "_values", None)
        if not isinstance(values, torch.Tensor) or values.requires_grad:
            values = nt.values()  # type: ignore[attr-defined]
        return {TAG: "jagged", "device": str(dev),
                "values": walk.tensor(_plain_cpu_tensor(values, where + ".values()"), where + ".values()"),
                "offsets": walk.tensor(_plain_cpu_tensor(nt.offsets(), where + ".offsets()"), where + ".offsets()"),  # type: ignore[attr-defined]
                "lengths": None if lengths is None else walk.tensor(_plain_cpu_tensor(lengths, where + ".lengths()"),
                                                                    where + ".lengths()"),
                "ragged_idx": int(nt._ragged_idx),  # type: ignore[attr-defined]
                "min_seqlen": _cached_seqlen(nt, "_min_seqlen"), "max_seqlen": _cached_seqlen(nt, "_max_seqlen")}
    if layout == torch.strided:
        return {TAG: "nested", "device": str(dev),
                "items": [walk.tensor(_plain_cpu_tensor(c, f"{where}[{i}]"), f"{where}[{i}]")
                          for i, c in enumerate(nt.unbind())]}
    raise CodecError(f"{where}: unsupported nested tensor layout {layout}")


def _cached_seqlen(nt: torch.Tensor, attr: str) -> Any:
    """A jagged tensor's cached min / max sequence length as an int, None when not cached (reading the
    attribute never computes it: that would be a device sync)."""
    try:
        value = getattr(nt, attr + "_tensor", None)
    except Exception:  # pragma: no cover - a torch without the cache
        return None
    if value is None:
        return None
    try:
        from torch.nested._internal.nested_tensor import _load_val_from_tensor
        return int(_load_val_from_tensor(value))
    except Exception:  # pragma: no cover - a torch that keeps it otherwise: recomputed when needed
        return None


def _encode_non_tensor(obj: Any, where: str, active: _Walk) -> Any:
    """A NonTensorData / MetaData (one value for its whole batch) or a NonTensorStack (one value per
    batch element, kept as nested lists with one level per batch dimension)."""
    batch_size = [int(s) for s in obj.batch_size]
    device = None if obj.device is None else str(obj.device)
    if not is_non_tensor_stack(obj):
        return {TAG: "nontensor", "class": "MetaData" if is_meta_data(obj) else "NonTensorData",
                "batch_size": batch_size, "device": device, "value": _encode(obj.data, where, active)}
    if 0 in batch_size[:-1]:
        raise CodecError(f"{where}: a NonTensorStack of batch size {batch_size} (empty along a leading "
                         "dimension) cannot be rebuilt, so it is not cached")
    items = stack_values(obj)
    if items is None:
        items = obj.tolist()

    # One object in many rows (a GRPO group's chat prompt, repeated over its n samples) is encoded once
    # when it holds no tensor: id -> (the object, kept alive; its encoding)
    seen: Dict[int, Tuple[Any, Any]] = {}

    def nested(values: Any, depth: int, at: str) -> Any:
        if depth == len(batch_size):
            if type(values) in SCALARS:
                return values
            known = seen.get(id(values))
            if known is not None and known[0] is values:
                return known[1]
            tensors = len(active.names)
            encoded = _encode(values, at, active)
            if len(active.names) == tensors:
                seen[id(values)] = (values, encoded)
            return encoded
        if type(values) is not list or len(values) != batch_size[depth]:
            raise CodecError(f"{where}: a NonTensorStack of batch size {batch_size} whose values do not "
                             "have that shape cannot be cached")
        return [nested(v, depth + 1, f"{at}[{i}]") for i, v in enumerate(values)]

    # rows of plain JSON: one JSON text in the header (encode_named)
    plain_rows = (active.raw_plain and len(batch_size) == 1 and type(items) is list and len(items) == batch_size[0]
                  and is_plain(items, -1, set()))
    return {TAG: "nontensorstack", "batch_size": batch_size, "device": device,
            "items": PlainJSON(items) if plain_rows else nested(items, 0, where)}


def _encode_ndarray(arr: Any, where: str, active: _Walk) -> Any:
    if arr.dtype.kind in "biufc" and not arr.dtype.hasobject:
        try:
            data = torch.from_numpy(np.ascontiguousarray(arr)).clone()
        except TypeError:  # a dtype torch has no tensor for (e.g. float128)
            data = None
        if data is not None:
            return {TAG: "ndarray", "dtype": arr.dtype.str, "data": active.tensor(data, where)}
    if arr.dtype.kind in "OUS":
        items = [_encode(v, f"{where}[{i}]", active) for i, v in enumerate(arr.ravel().tolist())]
        return {TAG: "ndarray", "dtype": arr.dtype.str if arr.dtype.kind != "O" else "O",
                "shape": list(arr.shape), "items": items}
    raise CodecError(f"{where}: unsupported NumPy dtype {arr.dtype}")


def decode(obj: Any, *, check_only: bool = False) -> Any:
    """Inverse of `encode`. Tensors go back to their recorded device when it exists here, else stay on CPU.
    With `check_only`, the structure is validated without building registered types or TensorDicts
    (so a process that registered nothing can check a file) and None is returned."""
    out = _decode(obj, "payload", check_only)
    return None if check_only else out


def _decode(obj: Any, where: str, check_only: bool = False) -> Any:
    t = type(obj)
    if isinstance(obj, torch.Tensor) or t in SCALARS:
        return obj
    if t is dict or t is OrderedDict:
        kind = obj.get(TAG) if TAG in obj else None
        if kind is None:
            out = {} if t is dict else OrderedDict()
            for k, v in obj.items():
                out[k] = _decode(v, where + key_repr(k), check_only)
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
        return None if check_only else rebuild(name, names, decoded, where)
    if kind == "tensor":
        data = obj["data"]
        if not isinstance(data, torch.Tensor) or not isinstance(obj["device"], str):
            raise CodecError(f"{where}: malformed tensor record")
        device = obj["device"]
        if check_only:
            return None
        if device_available(device):
            return data.to(device)
        logger.debug("%s: device %s is not available here; left on CPU", where, device)
        return data
    if kind in ("jagged", "nested"):
        return _decode_nested(kind, obj, where, check_only)
    if kind == "dict":
        keys, values = obj["keys"], obj["values"]
        out = OrderedDict() if obj.get("ordered") else {}
        for k, v in zip(keys, values, strict=True):
            out[k] = _decode(v, where + key_repr(k), check_only)
        return out
    if kind == "tensordict":
        keys, values = obj["keys"], obj["values"]
        data = {k: _decode(v, where + key_repr(k), check_only) for k, v in zip(keys, values, strict=True)}
        if check_only:
            return None
        TensorDict = tensordict_class("TensorDict")
        if TensorDict is None:
            raise CodecError(f"{where}: stored TensorDict, but the tensordict package is not importable")
        device = obj.get("device")
        if device is not None and not device_available(device):
            device = None
        return TensorDict(data, batch_size=list(obj["batch_size"]), device=device)
    if kind in ("nontensor", "nontensorstack"):
        return _decode_non_tensor(kind, obj, where, check_only)
    if kind == "ndarray":
        if np is None:
            raise CodecError(f"{where}: stored NumPy array, but numpy is not importable")
        dtype = np.dtype(obj["dtype"]) if obj["dtype"] != "O" else np.dtype(object)
        if "data" in obj:
            if not isinstance(obj["data"], torch.Tensor):
                raise CodecError(f"{where}: malformed ndarray record")
            return None if check_only else obj["data"].numpy().astype(dtype, copy=False)
        items = [_decode(v, f"{where}[{i}]", check_only) for i, v in enumerate(obj["items"])]
        shape = tuple(obj["shape"])
        if check_only:
            return None
        if dtype.kind == "O":
            arr = np.empty(len(items), dtype=object)
            for i, v in enumerate(items):
                arr[i] = v
            return arr.reshape(shape)
        return np.array(items, dtype=dtype).reshape(shape)
    if kind == "npscalar":
        if np is None:
            raise CodecError(f"{where}: stored NumPy scalar, but numpy is not importable")
        value = np.dtype(obj["dtype"]).type(obj["value"])
        return None if check_only else value
    raise CodecError(f"{where}: unknown record kind {kind!r}")


def _decode_nested(kind: str, obj: Dict[str, Any], where: str, check_only: bool) -> Any:
    device = obj["device"]
    if not isinstance(device, str):
        raise CodecError(f"{where}: malformed {kind} record")
    if kind == "nested":
        items = obj["items"]
        if type(items) is not list or not items or not all(isinstance(c, torch.Tensor) for c in items):
            raise CodecError(f"{where}: malformed nested record")
        if check_only:
            return None
        target = device if device_available(device) else "cpu"
        with warnings.catch_warnings():   # torch's note that the strided layout is a prototype
            warnings.simplefilter("ignore", UserWarning)
            return torch.nested.as_nested_tensor([c.to(target) for c in items], layout=torch.strided)
    values, offsets, lengths, ragged_idx = obj["values"], obj["offsets"], obj["lengths"], obj["ragged_idx"]
    seqlens = (obj["min_seqlen"], obj["max_seqlen"])
    if (not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor)
            or not (lengths is None or isinstance(lengths, torch.Tensor)) or type(ragged_idx) is not int
            or not all(s is None or type(s) is int for s in seqlens)):
        raise CodecError(f"{where}: malformed jagged record")
    if check_only:   # the tensors are placeholders here: their shapes are checked when loaded
        return None
    if not _jagged_indices_valid(values, offsets, lengths, ragged_idx):
        raise CodecError(f"{where}: malformed jagged record (offsets, lengths or ragged dimension do not fit "
                         "its values)")
    if device_available(device) and device != "cpu":
        values, offsets = values.to(device), offsets.to(device)
        lengths = None if lengths is None else lengths.to(device)
    try:
        return torch.nested.nested_tensor_from_jagged(values, offsets, lengths, jagged_dim=ragged_idx,
                                                      min_seqlen=seqlens[0], max_seqlen=seqlens[1])
    except Exception as exc:
        raise CodecError(f"{where}: malformed jagged record: {exc}") from None


def _jagged_indices_valid(values: torch.Tensor, offsets: torch.Tensor, lengths: Any, ragged_idx: int) -> bool:
    """Whether every row a jagged record's offsets (and lengths) name lies within its values (a file is
    untrusted input: a row outside them must not become a view of other memory)."""
    if not 1 <= ragged_idx <= values.dim() or offsets.dim() != 1 or offsets.numel() < 1 \
            or offsets.dtype != torch.int64:
        return False
    size = values.shape[ragged_idx - 1]
    if lengths is None:
        return bool(offsets[0] >= 0) and bool(offsets[-1] <= size) and bool((offsets.diff() >= 0).all())
    if lengths.dim() != 1 or lengths.dtype != torch.int64 or lengths.numel() != offsets.numel() - 1:
        return False
    starts = offsets[:-1]
    return bool((starts >= 0).all()) and bool((lengths >= 0).all()) and bool((starts + lengths <= size).all())


def _decode_non_tensor(kind: str, obj: Dict[str, Any], where: str, check_only: bool) -> Any:
    batch_size, device = obj["batch_size"], obj.get("device")
    if type(batch_size) is not list or not all(type(s) is int and s >= 0 for s in batch_size) \
            or not (device is None or isinstance(device, str)):
        raise CodecError(f"{where}: malformed {kind} record")
    if device is not None and not device_available(device):
        device = None
    if kind == "nontensor":
        cls_name = obj["class"]
        if cls_name not in ("NonTensorData", "MetaData"):
            raise CodecError(f"{where}: malformed nontensor record (class {str(cls_name)[:40]!r})")
        value = _decode(obj["value"], where, check_only)
        if check_only:
            return None
        cls = tensordict_class(cls_name)
        if cls is None:
            raise CodecError(f"{where}: stored {cls_name}, but tensordict is not importable or has no non-tensor data")
        return cls(data=value, batch_size=batch_size, device=device)

    NonTensorData, NonTensorStack = tensordict_class("NonTensorData"), tensordict_class("NonTensorStack")

    make = NonTensorMaker(NonTensorData, device)

    def nested(items: Any, depth: int, at: str) -> Any:
        if depth == len(batch_size):
            value = _decode(items, at, check_only)
            return None if check_only else make(value)
        if type(items) is not list or len(items) != batch_size[depth]:
            raise CodecError(f"{where}: malformed nontensorstack record (its items do not have shape "
                             f"{batch_size})")
        children = [nested(v, depth + 1, f"{at}[{i}]") for i, v in enumerate(items)]
        return None if check_only else NonTensorStack(*children)

    if not check_only and (NonTensorStack is None or NonTensorData is None):
        raise CodecError(f"{where}: stored NonTensorStack, but tensordict is not importable or has no non-tensor "
                         "data")
    out = nested(obj["items"], 0, where)
    if not check_only and list(out.batch_size) != batch_size:  # a shape tensordict cannot stack
        raise CodecError(f"{where}: malformed nontensorstack record (batch size {batch_size})")
    return out
