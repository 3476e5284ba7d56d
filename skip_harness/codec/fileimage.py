"""The payload file format's image (FORMAT_VERSION 5): an encoded structure laid out as a small JSON
header followed by every tensor's bytes, and the one copy of those bytes into a buffer.

    MAGIC (8 bytes) | u32 format version | u32 0 | u64 header length | header (UTF-8 JSON) | pad |
    tensor bytes, each at a 64-byte aligned offset

The header's fields are described in :mod:`skip_harness.codec.tensorfile`; how tensors are narrowed and
compressed is :mod:`compression`'s, reading an image back :mod:`fileread`'s.
"""
from __future__ import annotations

import base64
import ctypes
import dataclasses
import functools
import json
import marshal
import math
import re
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness.errors import CodecError
from skip_harness.codec.fastwalk import PlainJSON
from skip_harness.codec.payload_kinds import TAG, np

FORMAT_VERSION = 5            # 1: torch.save of the encoded structure; 2: no `how`; 3: no rules (`dedupe`);
                              # 4: no `j` nodes (all read, never written)
MAGIC = b"\x89SKH\r\n\x1a\n"
_PREAMBLE = struct.Struct("<8sIIQ")   # magic, format version, reserved, header length
_ALIGN = 64
_MAX_HEADER_BYTES = 1 << 30


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rpartition(".")[2]


@functools.lru_cache(maxsize=None)
def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype) or name.startswith("q"):  # quantized dtypes are never written
        raise CodecError(f"unknown tensor dtype {name!r}")
    return dtype


_LEAVES = (str, int, bool, type(None))   # JSON as they are (a float is checked for being finite)


def _json_text(value: Any) -> str:
    """The header's JSON text of `value`: ASCII, compact, no NaN (ValueError)."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def _pack(obj: Any, tensors: List[torch.Tensor], raws: List[Any], snapshot: bool = False) -> Any:
    """The encoded structure as a JSON tree; every tensor is appended to `tensors` and named by index,
    every PlainJSON value dumped as JSON text into `raws` and named by index ({"j": i}, spliced into the
    header by `_layout`: a `j` node holds plain JSON as it is). With `snapshot`, a PlainJSON value goes
    into `raws` as its `marshal` bytes instead, for `laid_out` to dump later on another thread: an exact
    copy (a PlainJSON value holds the builtin types alone) made in a tenth of the JSON's time."""
    t = type(obj)
    if obj is None or t is bool or t is str or t is int:
        return obj
    if t is float:
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if t is PlainJSON:
        if snapshot:
            raws.append(marshal.dumps(obj.value))
            return {"j": len(raws) - 1}
        try:
            raws.append(_json_text(obj.value))
        except ValueError:   # a float that is not finite: node by node, as {"f": ...} (an int too long for
            # JSON text fails again there, and `_layout` names it)
            return _pack(obj.value, tensors, raws)
        return {"j": len(raws) - 1}
    if t is list:
        return [v if type(v) in _LEAVES else _pack(v, tensors, raws, snapshot) for v in obj]
    if t is dict or t is OrderedDict:
        return {"d" if t is dict else "o": [[k, v if type(v) in _LEAVES else _pack(v, tensors, raws, snapshot)]
                                            for k, v in obj.items()]}
    if t is torch.Tensor:
        tensors.append(obj)
        return {"T": len(tensors) - 1}
    if t is tuple:
        return {"t": [_pack(v, tensors, raws, snapshot) for v in obj]}
    if t is bytes:
        return {"b": base64.b64encode(obj).decode("ascii")}
    if t is complex:
        return {"c": [_pack(obj.real, tensors, raws), _pack(obj.imag, tensors, raws)]}
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
        if kind == "j":    # plain JSON as it is (version 5)
            return v
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


def _byte_view(t: Any) -> Any:
    """The bytes of a contiguous CPU tensor (or NumPy array), without copying them. Through NumPy where the
    dtype has a NumPy twin: a torch call lets go of the GIL and takes it back, and a writer thread waits
    each time the trainer's thread holds it then (issue 42)."""
    arr = t if np is not None and isinstance(t, np.ndarray) else numpy_view(t)
    if arr is not None:
        return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # ndarray is a buffer
    u8 = t.reshape(-1).view(torch.uint8)
    if np is not None:
        return memoryview(u8.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
    return ctypes.string_at(u8.data_ptr(), u8.numel())  # pragma: no cover


def numpy_view(t: torch.Tensor) -> Any:
    """A contiguous CPU tensor's elements as a flat NumPy array sharing its memory, made without a torch
    call (see `_byte_view`); None where there is none (no NumPy, a dtype NumPy lacks such as bfloat16, a
    tensor that needs grad or is not contiguous)."""
    if np is None or t.requires_grad:
        return None
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):
        return None
    return arr.reshape(-1) if arr.flags.c_contiguous else None


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class FileImage:
    """An encoded structure laid out as a file: `head` (preamble, header, zero padding up to the data),
    then each tensor's bytes at its offset in `offsets` (from the start of the file), zeros between;
    `nbytes` in all."""

    head: bytes
    tensors: List[torch.Tensor]
    offsets: List[int]
    nbytes: int
    tree: Any = None
    names: List[Optional[str]] = field(default_factory=list)
    raws: List[Any] = field(default_factory=list)   # the tree's `j` nodes' JSON texts (staged: marshal bytes)
    staged: bool = False   # laid out for a staging copy only (`plan(staged=True)`): `laid_out` makes the file of it


def plan(structure: Any, names: Optional[Dict[int, str]] = None, *, staged: bool = False) -> FileImage:
    """The file image of an encoded structure in the current format (no tensor bytes copied), every
    tensor at full width. `names`: id(tensor) -> the field it holds (recorded for messages and `show`).

    `staged`: the image of a staging copy that a writer thread turns into the stored file (a compressed
    form, `compression.stored_image`), for the trainer's thread to make cheaply: no header (`head` is
    empty, the tensors laid out from offset 0), plain values as `marshal` snapshots. `laid_out` makes the
    header from it later, on the writer's thread -- the same file as without `staged`."""
    tensors: List[torch.Tensor] = []
    raws: List[Any] = []
    tree = _pack(structure, tensors, raws, staged)
    tensor_names = [None if names is None else names.get(id(t)) for t in tensors]
    if staged:
        offsets, end = _packed([t.numel() * t.element_size() for t in tensors])
        return FileImage(b"", tensors, offsets, end, tree, tensor_names, raws, staged=True)
    head, offsets, nbytes = _layout(tree, _full_width(tensors, tensor_names), raws)
    return FileImage(head, tensors, offsets, nbytes, tree, tensor_names, raws)


def laid_out(image: FileImage) -> FileImage:
    """A staged image (`plan(staged=True)`) as the full-width file image `plan` would have made of the same
    structure: its plain values dumped as JSON from their snapshots (one holding a float that is not finite
    packed node by node instead, as `_pack` does), its header and offsets laid out. Its tensors are those
    of `image` (a staged copy's bytes are read at `image.offsets`, not these). Any other image as it is."""
    if not image.staged:
        return image
    raws: List[Any] = []
    unfolded: Dict[int, Any] = {}        # raw index -> its value, packed node by node
    for i, snap in enumerate(image.raws):
        value = marshal.loads(snap)
        try:
            raws.append(_json_text(value))
        except ValueError:
            unfolded[i] = _pack(value, [], [])
            raws.append(None)
    tree = _unfold(image.tree, unfolded) if unfolded else image.tree
    head, offsets, nbytes = _layout(tree, _full_width(image.tensors, image.names), raws)
    return FileImage(head, image.tensors, offsets, nbytes, tree, image.names, raws)


def _full_width(tensors: Sequence[torch.Tensor],
                names: Sequence[Optional[str]]) -> List[Tuple[str, List[int], int, Optional[Dict[str, Any]]]]:
    """`_layout`'s entries of tensors stored as they are, at full width."""
    return [(_dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size(), _how(n, None, None))
            for t, n in zip(tensors, names)]


def _unfold(node: Any, packed: Dict[int, Any]) -> Any:
    """The packed tree `node` with each `{"j": i}` node whose i is in `packed` replaced by packed[i]."""
    t = type(node)
    if t is list:
        return [_unfold(v, packed) for v in node]
    if t is dict:
        if len(node) == 1 and type(node.get("j")) is int and node["j"] in packed:
            return packed[node["j"]]
        return {k: _unfold(v, packed) for k, v in node.items()}
    return node


def _long_int_at(node: Any, at: str) -> Optional[str]:
    """Where in the packed tree `node` (at position `at`) an int too long for decimal text is, or None --
    looked for only once the header's JSON has failed, so no step pays for it."""
    t = type(node)
    if t is int:
        try:
            str(node)
        except ValueError:
            return at
        return None
    items: Any = ()
    if t is list:
        items = enumerate(node)
    elif t is dict:
        if len(node) == 1 and ("d" in node or "o" in node):
            pairs = next(iter(node.values()))
            if "d" in node and pairs and pairs[0][0] == TAG:     # a tagged node: the user's path, not the encoding's
                tagged = dict(pairs)
                if type(tagged.get("keys")) is list and any(_long_int_at(k, at) for k in tagged["keys"]):
                    return f"{at} (a key)"
                for step, child in _user_children(tagged):
                    found = _long_int_at(child, at + step)
                    if found is not None:
                        return found
                return None
            for k, _v in pairs:
                if _long_int_at(k, at) is not None:
                    return f"{at} (a key)"
            items = iter(pairs)
        elif len(node) == 1 and "t" in node:
            items = enumerate(node["t"])
        else:
            items = node.items()
    for k, v in items:
        found = _long_int_at(v, f"{at}[{k!r}]")
        if found is not None:
            return found
    return None


def _user_children(node: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """A tagged node's children (structure.py's encodings) as (the path step a user would write, child):
    a TensorDict's or a tagged dict's `['key']`, a registered object's `.field`, a NonTensorStack's or an
    object array's `[i]`; a NonTensorData's value and a NumPy scalar's are at the node's own path."""
    kind = node[TAG]
    if kind in ("tensordict", "dict") and type(node.get("keys")) is list and type(node.get("values")) is list:
        return [(f"[{k!r}]", v) for k, v in zip(node["keys"], node["values"])]
    if kind == "object" and type(node.get("fields")) is list and type(node.get("values")) is list:
        return [(f".{f}", v) for f, v in zip(node["fields"], node["values"])]
    if kind in ("nontensor", "npscalar"):
        return [("", node.get("value"))]
    if kind in ("nontensorstack", "ndarray") and type(node.get("items")) is list:
        return [(f"[{i}]", v) for i, v in enumerate(node["items"])]
    return [(f"[{k!r}]", v) for k, v in node.items() if k != TAG]


def _how(name: Optional[str], stored_dtype: Optional[str], chunks: Optional[list]) -> Optional[Dict[str, Any]]:
    how: Dict[str, Any] = {}
    if name is not None:
        how["name"] = name
    if stored_dtype is not None:
        how["as"] = stored_dtype
    if chunks is not None:
        how["zstd"] = chunks
    return how or None


_J_NODE = re.compile(r'\{"j":(\d+)\}')


def _packed(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """(each piece's offset, the end of the last) for pieces of `sizes` bytes laid out in order from 0,
    each at a 64-byte aligned offset."""
    offsets, offset, end = [], 0, 0
    for nbytes in sizes:
        offsets.append(offset)
        end = offset + nbytes
        offset = _align(end)
    return offsets, end


def _layout(tree: Any, entries: Sequence[Tuple[str, List[int], int, Optional[Dict[str, Any]]]],
            raws: Sequence[Optional[str]] = ()) -> Tuple[bytes, List[int], int]:
    """(head, absolute offset of each tensor's stored bytes, file size) for entries (dtype, shape,
    stored nbytes, how); each `{"j":i}` node of the tree's JSON text replaced by {"j": raws[i]}, in one
    pass (no other dict of a packed tree has the one key "j", and a JSON string cannot hold an unescaped
    quote, so the pattern matches nothing else, and a spliced text is never matched again)."""
    rel_offsets, end = _packed([nbytes for _d, _s, nbytes, _h in entries])
    table = [[dtype, shape, offset, nbytes] + ([how] if how else [])
             for (dtype, shape, nbytes, how), offset in zip(entries, rel_offsets)]
    try:
        text = _json_text({"format": FORMAT_VERSION, "tensors": table, "tree": tree})
    except ValueError:
        where = _long_int_at(tree, "payload")
        if where is None:
            raise
        raise CodecError(f"{where}: an int of more than {sys.get_int_max_str_digits()} digits, which Python will "
                         "not write as decimal text (sys.get_int_max_str_digits); store it as a str or bytes") from None
    if raws:
        text = _J_NODE.sub(lambda m: '{"j":' + raws[int(m.group(1))] + "}", text)
    header = text.encode("ascii")
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header)) + header
    data_start = _align(len(head))
    head += bytes(data_start - len(head))
    return head, [data_start + o for o in rel_offsets], data_start + end


# --------------------------------------------------------------------------------------------
# stored forms: lossless narrowing and zstd


def shapes_only(image: FileImage) -> FileImage:
    """`image` holding no payload tensor (meta tensors of their shapes and dtypes in their place), so a
    staged write does not keep the trainer's tensors alive."""
    return dataclasses.replace(image, tensors=[torch.empty(t.shape, dtype=t.dtype, device="meta")
                                               for t in image.tensors])


def staged_tensors(image: FileImage, buffer: Any) -> List[torch.Tensor]:
    """The tensors of `image` as views of the full-width copy `pack_into` made in `buffer`."""
    out = []
    for t, off in zip(image.tensors, image.offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            out.append(torch.empty(t.shape, dtype=t.dtype))
            continue
        u8 = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=off)
        out.append(u8.view(t.dtype).view(t.shape))
    return out


def pack_into(image: FileImage, buffer: Any, copy: Callable[[int, int, int], None]) -> None:
    """Copy the file image into `buffer` (a writable ctypes array of at least image.nbytes bytes):
    the one copy of the tensors a write needs. `copy(dst_address, src_address, nbytes)` moves the
    bytes of contiguous tensors; other tensors are copied by torch."""
    for dst, src, nbytes in pack_parts(image, buffer)[0]:
        copy(dst, src, nbytes)


def pack_parts(image: FileImage, buffer: Any) -> Tuple[List[Tuple[int, int, int]], List[Any]]:
    """`pack_into`'s work, for a caller that copies and hashes at once: fills `buffer` now with all but
    the contiguous tensors' bytes (the header, the padding, and every other tensor, copied by torch), and
    returns the copies left -- (dst address, src address, nbytes), one per contiguous tensor -- and the
    file's image.nbytes bytes in order as buffers that hold them already: `buffer`'s where it is filled,
    a contiguous tensor's own memory where it is not (the same bytes once copied)."""
    base = ctypes.addressof(buffer)
    whole = memoryview(buffer).cast("B")
    ctypes.memmove(base, image.head, len(image.head))
    pos = len(image.head)
    copies: List[Tuple[int, int, int]] = []
    pieces: List[Any] = [whole[:pos]]
    for t, off in zip(image.tensors, image.offsets):
        if off > pos:
            ctypes.memset(base + pos, 0, off - pos)
            pieces.append(whole[pos:off])
        nbytes = t.numel() * t.element_size()
        if nbytes and t.is_contiguous():
            copies.append((base + off, t.data_ptr(), nbytes))
            pieces.append(_byte_view(t))
        elif nbytes:
            u8 = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=off)
            u8.view(t.dtype).view(t.shape).copy_(t)
            pieces.append(whole[off:off + nbytes])
        pos = off + nbytes
    return copies, pieces
