"""The cache's payload file format (FORMAT_VERSION 2): the encoded structure as a small JSON header
followed by the raw bytes of every tensor.

    MAGIC (8 bytes) | u32 format version | u32 0 | u64 header length | header (UTF-8 JSON) | pad |
    tensor bytes, each at a 64-byte aligned offset

The header holds ``format``, ``tensors`` (one ``[dtype, shape, offset, nbytes]`` per tensor) and ``tree``
(the encoded structure: JSON scalars and lists as themselves, every other value a one-key object, e.g.
``{"T": 3}`` for tensor 3, ``{"d": [[key, value], ...]}`` for a dict). Reading parses JSON and maps the
file: there is no unpickling at all. Files of the previous version (``torch.save`` of the encoded
structure, and older caches' ``torch.save`` files) are still read, with ``torch.load(weights_only=True)``.

This module moves encoded structures (`codec.encode`'s output) to and from files; errors are
`CodecError`s without the path, which `codec` adds once.
"""
from __future__ import annotations

import base64
import ctypes
import functools
import json
import math
import mmap as _mmap
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, List, Tuple

import torch

from skip_harness.errors import CodecError
from skip_harness.payload_kinds import np

FORMAT_VERSION = 2            # 1: torch.save of the encoded structure (read, never written any more)
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
    if np is not None:
        return memoryview(u8.numpy())
    return ctypes.string_at(u8.data_ptr(), u8.numel())  # pragma: no cover


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


def plan(structure: Any) -> FileImage:
    """The file image of an encoded structure in the current format (no tensor bytes copied)."""
    tensors: List[torch.Tensor] = []
    tree = _pack(structure, tensors)
    table, rel_offsets, offset, end = [], [], 0, 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        table.append([_dtype_name(t.dtype), list(t.shape), offset, nbytes])
        rel_offsets.append(offset)
        end = offset + nbytes
        offset = _align(end)
    header = json.dumps({"format": FORMAT_VERSION, "tensors": table, "tree": tree},
                        ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header)) + header
    data_start = _align(len(head))
    head += bytes(data_start - len(head))
    return FileImage(head, tensors, [data_start + o for o in rel_offsets], data_start + end)


def write(fileobj: BinaryIO, structure: Any) -> int:
    """Write an encoded structure to an open binary file object (anything with write()) in the current
    format, the tensors' bytes straight from their memory. Returns the bytes written."""
    image = plan(structure)
    fileobj.write(image.head)
    pos = len(image.head)
    for t, off in zip(image.tensors, image.offsets):
        if off > pos:
            fileobj.write(bytes(off - pos))
        view = _byte_view(t.contiguous())
        if len(view):
            fileobj.write(view)
        pos = off + len(view)
    return pos


def pack_into(image: FileImage, buffer: Any, copy: Callable[[int, int, int], None]) -> None:
    """Copy the file image into `buffer` (a writable ctypes array of at least image.nbytes bytes):
    the one copy of the tensors a write needs. `copy(dst_address, src_address, nbytes)` moves the
    bytes of contiguous tensors; other tensors are copied by torch."""
    base = ctypes.addressof(buffer)
    ctypes.memmove(base, image.head, len(image.head))
    pos = len(image.head)
    for t, off in zip(image.tensors, image.offsets):
        if off > pos:
            ctypes.memset(base + pos, 0, off - pos)
        nbytes = t.numel() * t.element_size()
        if nbytes and t.is_contiguous():
            copy(base + off, t.data_ptr(), nbytes)
        elif nbytes:
            u8 = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=off)
            u8.view(t.dtype).view(t.shape).copy_(t)
        pos = off + nbytes


def sanitized(exc: BaseException) -> str:
    """A short reason for a failed torch.load, without torch's advice to retry unsafely."""
    text = str(exc)
    if "Weights only load failed" in text or "weights_only" in text:
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f" ({found.group(1)})" if found else ""
        return f"it needs pickled code to load{what}, which skip_harness never runs"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _read_header(fd: int, size: int) -> Tuple[Dict[str, Any], int]:
    return _parse_header(lambda n, off: os.pread(fd, n, off), size)


def _parse_header(pread: Callable[[int, int], bytes], size: int) -> Tuple[Dict[str, Any], int]:
    head = pread(_PREAMBLE.size, 0)
    if len(head) < _PREAMBLE.size:
        raise CodecError("truncated: no complete header")
    magic, version, _reserved, hlen = _PREAMBLE.unpack(head)
    if version > FORMAT_VERSION or version < 2:
        raise CodecError(f"format version {version}; this skip_harness reads versions up to {FORMAT_VERSION}"
                         + (" (written by a newer skip_harness)" if version > FORMAT_VERSION else ""))
    if hlen > min(size, _MAX_HEADER_BYTES):
        raise CodecError(f"truncated: the header says {hlen} bytes, the file has {size}")
    raw = pread(hlen, _PREAMBLE.size)
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


def is_current_format(fd: int) -> bool:
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


def open_nofollow(spath: str) -> int:
    try:
        return os.open(spath, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CodecError(f"{spath}: cannot be opened: {exc.strerror or exc}") from None


def read(fd: int, spath: str, mmap: bool) -> Any:
    """The encoded structure stored in the open file `fd` (at `spath`), in either format. With `mmap`
    the tensors are private (copy-on-write) views of the mapped file, read lazily."""
    if not is_current_format(fd):
        return torch_load(spath, mmap)
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
    return _unpack(doc["tree"], _tensors_from(buf, doc, data_start))


def is_current_image(view: memoryview) -> bool:
    return bytes(view[:len(MAGIC)]) == MAGIC


def read_buffer(buffer: Any, size: int) -> Any:
    """The encoded structure of a current-format file image held in the first `size` bytes of
    `buffer` (anything torch.frombuffer takes); its tensors are views of that memory."""
    view = memoryview(buffer).cast("B")[:size]
    doc, data_start = _parse_header(lambda n, off: bytes(view[off:off + n]), size)
    return _unpack(doc["tree"], _tensors_from(buffer, doc, data_start))


def read_skeleton(fd: int, spath: str) -> Any:
    """The encoded structure of the open file `fd`, its header and records validated and bounds checked,
    with empty tensors in place of the stored ones (no tensor data is read from a current-format file)."""
    if not is_current_format(fd):
        return torch_load(spath, mmap=True)
    doc, _data_start = _read_header(fd, os.fstat(fd).st_size)
    return _unpack(doc["tree"], [torch.empty(0)] * len(doc["tensors"]))


NOT_A_PAYLOAD = "not a skip_harness or torch payload file"
_TORCH_MAGICS = (b"PK\x03\x04", b"\x80")   # torch.save's zip archive; its legacy format (a pickle)


def looks_like_torch_file(spath: str) -> bool:
    """Whether the file starts as a torch.save file does (a zip archive, or the legacy pickle format)."""
    try:
        with open(spath, "rb") as f:
            start = f.read(4)
    except OSError:
        return True   # let torch.load report it
    return any(start.startswith(m) for m in _TORCH_MAGICS)


def torch_load(spath: str, mmap: bool) -> Any:
    """torch.load(weights_only=True) of a file in the previous format; CodecError (no path) on failure,
    NOT_A_PAYLOAD for a file that is neither format (random bytes, a text file)."""
    if not looks_like_torch_file(spath):
        raise CodecError(NOT_A_PAYLOAD)
    try:
        try:
            return torch.load(spath, weights_only=True, mmap=mmap, map_location="cpu")
        except RuntimeError as exc:
            # Files in torch's old (non-zip) format cannot be memory-mapped; load them normally.
            if not (mmap and "mmap" in str(exc)):
                raise
            return torch.load(spath, weights_only=True, mmap=False, map_location="cpu")
    except Exception as exc:
        raise CodecError(f"cannot be loaded safely: {sanitized(exc)}") from None
