"""Reading a payload file image back from memory: the header parsed and bounds checked, every tensor a
view of the buffer (or, stored narrowed or compressed, of new memory it is widened into); no unpickling.
An image in the previous format goes to :mod:`torchsave`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from skip_harness.errors import CodecError
from skip_harness.codec import dedupe
from skip_harness.codec.compression import _INT_DTYPES, _NARROW_TO, _decompress_all
from skip_harness.codec.fileimage import (
    _ALIGN, _MAX_HEADER_BYTES, _PREAMBLE, FORMAT_VERSION, MAGIC, _align, _dtype_from_name, _unpack,
)
from skip_harness.codec.torchsave import torch_load

def _header_of(view: memoryview, size: int) -> Tuple[Dict[str, Any], int]:
    return _parse_header(lambda n, off: bytes(view[off:off + n]), size)


def _parse_header(pread: Callable[[int, int], bytes], size: int) -> Tuple[Dict[str, Any], int]:
    head = pread(_PREAMBLE.size, 0)
    if len(head) < _PREAMBLE.size:
        raise CodecError("truncated: no complete header")
    magic, version, _reserved, hlen = _PREAMBLE.unpack(head)
    if version > FORMAT_VERSION or version < 2:  # 2 to 5 share the layout; 3 adds `how`, 4 its rules, 5 `j`
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
        if (type(entry) is not list or len(entry) not in ((4, 5) if version >= 3 else (4,))
                or type(entry[0]) is not str or type(entry[1]) is not list
                or not all(type(s) is int and s >= 0 for s in entry[1])
                or type(entry[2]) is not int or type(entry[3]) is not int or entry[2] < 0):
            raise CodecError(f"malformed tensor entry {str(entry)[:80]}")
        dtype = _dtype_from_name(entry[0])
        if entry[2] % _ALIGN or not _stored_size_valid(dtype, entry, _HOW_KEYS_4 if version >= 4 else _HOW_KEYS):
            raise CodecError(f"malformed tensor entry {str(entry)[:80]}")
        end = max(end, data_start + entry[2] + entry[3])
    if end > size:
        raise CodecError(f"truncated: {size} bytes, the header needs {end}")
    if version >= 4:
        dedupe.check_header(doc["tensors"])
    return doc, data_start


_HOW_KEYS = frozenset({"name", "as", "zstd"})
_HOW_KEYS_4 = _HOW_KEYS | frozenset(dedupe.RULES) | {"shuffle"}
_MAX_CHUNK_RAW = 1 << 30          # a chunk holds at most this many bytes decompressed (writers use 4 MiB)


def _stored_size_valid(dtype: torch.dtype, entry: list, keys: frozenset = _HOW_KEYS) -> bool:
    """Whether a tensor entry's stored size agrees with its shape, dtype and `how` (a rule's entry stores
    nothing: `dedupe.check_header` checks the rest)."""
    numel = math.prod(entry[1])
    how = entry[4] if len(entry) > 4 else None
    if how is None:
        return entry[3] == numel * dtype.itemsize
    if type(how) is not dict or not how or not set(how) <= keys:
        return False
    if "name" in how and type(how["name"]) is not str:
        return False
    if dedupe.rule_of(how) is not None:
        return entry[3] == 0
    if "shuffle" in how and (how["shuffle"] is not True or "zstd" not in how or "as" in how
                             or dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64)):
        return False
    stored_dtype = dtype
    if "as" in how:
        if type(how["as"]) is not str:
            return False
        stored_dtype = _dtype_from_name(how["as"])
        if stored_dtype not in _NARROW_TO or dtype not in _INT_DTYPES or stored_dtype.itemsize >= dtype.itemsize:
            return False
    raw = numel * stored_dtype.itemsize
    chunks = how.get("zstd")
    if chunks is None:
        return entry[3] == raw
    if type(chunks) is not list or not chunks or not all(
            type(c) is list and len(c) == 2 and all(type(x) is int and x > 0 for x in c) and c[1] <= _MAX_CHUNK_RAW
            for c in chunks):
        return False
    return (sum(c[0] for c in chunks) == entry[3] and sum(c[1] for c in chunks) == raw
            and all(c[1] % stored_dtype.itemsize == 0 for c in chunks))



def _tensors_from(buf: Any, doc: Dict[str, Any], data_start: int, out: Any = None) -> List[torch.Tensor]:
    """The tensors of a parsed header: stored raw ones as views of `buf`; narrowed or compressed ones
    rebuilt at full width -- in `out` (a writable buffer of at least `logical_nbytes(doc)` bytes, e.g. a
    pool buffer whose pages are already there) when given, else in new memory --, chunks in parallel."""
    result: List[torch.Tensor] = []
    tasks: List[Tuple[Any, ...]] = []
    deferred: List[Tuple[int, Dict[str, Any], torch.Tensor]] = []
    out_pos = 0
    for i, entry in enumerate(doc["tensors"]):
        name, shape, off, nbytes = entry[:4]
        how = entry[4] if len(entry) > 4 else {}
        dtype = _dtype_from_name(name)
        stored_dtype = _dtype_from_name(how["as"]) if "as" in how else dtype
        rule = dedupe.rule_of(how)
        if "zstd" not in how and stored_dtype == dtype and rule is None:
            if nbytes == 0:
                result.append(torch.empty(shape, dtype=dtype))
            else:
                u8 = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=data_start + off)
                result.append(u8.view(dtype).reshape(shape))
            continue
        numel = math.prod(shape)
        if out is not None and numel:
            target = torch.frombuffer(out, dtype=dtype, count=numel, offset=out_pos).reshape(shape)
            out_pos = _align(out_pos + numel * dtype.itemsize)
        else:
            target = torch.empty(shape, dtype=dtype)
        result.append(target)
        if rule is not None:
            deferred.append((i, how, target))
            continue
        if numel == 0:
            continue
        flat, field_name = target.view(-1), how.get("name") or f"tensor {i}"
        if "zstd" not in how:                       # narrowed, stored raw
            u8 = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=data_start + off)
            flat.copy_(u8.view(stored_dtype))
            continue
        pos, first = data_start + off, 0
        chunks = how["zstd"]
        for j, (stored, raw) in enumerate(chunks):
            count = raw // stored_dtype.itemsize
            tasks.append((field_name, j, len(chunks), pos, stored, flat[first:first + count], stored_dtype,
                          bool(how.get("shuffle"))))
            pos, first = pos + stored, first + count
    if tasks:
        _decompress_all(memoryview(buf).cast("B"), tasks)
    if deferred:
        dedupe.rebuild(deferred, result, [(e[4].get("name") if len(e) > 4 else None) or f"tensor {j}"
                                          for j, e in enumerate(doc["tensors"])])
    return result


def logical_nbytes(doc: Dict[str, Any]) -> int:
    """Bytes the narrowed or compressed tensors of a parsed header take at full width (64-byte aligned
    each): the size of the `out` buffer `_tensors_from` fills."""
    total = 0
    for entry in doc["tensors"]:
        how = entry[4] if len(entry) > 4 else {}
        if "zstd" in how or "as" in how or dedupe.rule_of(how) is not None:
            total = _align(total + math.prod(entry[1]) * _dtype_from_name(entry[0]).itemsize)
    return total


def is_current_image(view: memoryview) -> bool:
    return bytes(view[:len(MAGIC)]) == MAGIC


def read_buffer(buffer: Any, size: int, alloc: Optional[Callable[[int], Any]] = None) -> Any:
    """The encoded structure of a current-format file image held in the first `size` bytes of
    `buffer` (anything torch.frombuffer takes); its tensors are views of that memory -- those stored
    narrowed or compressed are rebuilt in `alloc(nbytes)` (a writable buffer, e.g. from a pool) when
    given, else in new memory."""
    view = memoryview(buffer).cast("B")[:size]
    doc, data_start = _header_of(view, size)
    need = logical_nbytes(doc)
    out = alloc(need) if alloc is not None and need else None
    return _unpack(doc["tree"], _tensors_from(buffer, doc, data_start, out))


@dataclass(frozen=True)
class StoredField:
    """How one tensor of a file is stored (from its header alone): the field it holds, its dtype, the
    dtype it is stored in, `zstd` or `none`, and its bytes at full width and as stored."""

    name: str
    dtype: str
    stored_dtype: str
    compression: str
    logical_bytes: int
    stored_bytes: int


def stored_fields(buffer: Any, size: int) -> List[StoredField]:
    """How each tensor of the file image in the first `size` bytes of `buffer` is stored (its header
    only; [] for a file in the previous format)."""
    view = memoryview(buffer).cast("B")[:size]
    if not is_current_image(view):
        return []
    doc, _data_start = _header_of(view, size)
    out = []
    for i, entry in enumerate(doc["tensors"]):
        how = entry[4] if len(entry) > 4 else {}
        dtype = _dtype_from_name(entry[0])
        rule = dedupe.rule_of(how)
        out.append(StoredField(how.get("name", f"tensor {i}"), entry[0], how.get("as", entry[0]),
                               rule if rule is not None else "zstd" if "zstd" in how else "none",
                               math.prod(entry[1]) * dtype.itemsize, entry[3]))
    return out


def read_skeleton(buffer: Any, size: int) -> Any:
    """The encoded structure of the file image in the first `size` bytes of `buffer`, its header and
    records validated and bounds checked, with empty tensors in place of the stored ones (no tensor
    data is touched in a current-format image; one in the previous format is loaded by torch)."""
    view = memoryview(buffer).cast("B")[:size]
    if not is_current_image(view):
        return torch_load(view)
    doc, _data_start = _header_of(view, size)
    return _unpack(doc["tree"], [torch.empty(0)] * len(doc["tensors"]))
