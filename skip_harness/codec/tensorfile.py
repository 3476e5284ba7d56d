"""The cache's payload file format (FORMAT_VERSION 3): the encoded structure as a small JSON header
followed by the stored bytes of every tensor.

    MAGIC (8 bytes) | u32 format version | u32 0 | u64 header length | header (UTF-8 JSON) | pad |
    tensor bytes, each at a 64-byte aligned offset

The header holds ``format``, ``tensors`` (one ``[dtype, shape, offset, nbytes]`` per tensor, or
``[dtype, shape, offset, nbytes, how]`` where ``how`` says how it is stored: ``name`` (the field, for
messages and `show`), ``as`` (a narrower integer dtype holding every value: lossless narrowing) and
``zstd`` (``[[stored, raw], ...]``: the bytes as consecutive zstd frames, one per chunk, so a load
decompresses chunks in parallel and a damaged chunk names its field); ``nbytes`` is always the stored
length, so a checksum over the file covers what is stored and needs no decompression) and ``tree``
(the encoded structure: JSON scalars and lists as themselves, every other value a one-key object, e.g.
``{"T": 3}`` for tensor 3, ``{"d": [[key, value], ...]}`` for a dict). Reading parses JSON and maps the
file: there is no unpickling at all. Files of the previous version (``torch.save`` of the encoded
structure, and older caches' ``torch.save`` files) are still read, with ``torch.load(weights_only=True)``;
format 2 (no ``how``) is read as it was written.

This module moves encoded structures (`codec.encode`'s output) to and from files; errors are
`CodecError`s without the path, which `codec` adds once.
"""
from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import threading
import ctypes
import functools
import io
import json
import math
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import zstandard

from skip_harness.errors import CodecError
from skip_harness.codec.payload_kinds import np

FORMAT_VERSION = 3            # 1: torch.save of the encoded structure; 2: no `how` (both read, never written)
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
        return memoryview(u8.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
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
    tree: Any = None
    names: List[Optional[str]] = field(default_factory=list)


def plan(structure: Any, names: Optional[Dict[int, str]] = None) -> FileImage:
    """The file image of an encoded structure in the current format (no tensor bytes copied), every
    tensor at full width. `names`: id(tensor) -> the field it holds (recorded for messages and `show`)."""
    tensors: List[torch.Tensor] = []
    tree = _pack(structure, tensors)
    tensor_names = [None if names is None else names.get(id(t)) for t in tensors]
    entries = [(_dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size(), _how(n, None, None))
               for t, n in zip(tensors, tensor_names)]
    head, offsets, nbytes = _layout(tree, entries)
    return FileImage(head, tensors, offsets, nbytes, tree, tensor_names)


def _how(name: Optional[str], stored_dtype: Optional[str], chunks: Optional[list]) -> Optional[Dict[str, Any]]:
    how: Dict[str, Any] = {}
    if name is not None:
        how["name"] = name
    if stored_dtype is not None:
        how["as"] = stored_dtype
    if chunks is not None:
        how["zstd"] = chunks
    return how or None


def _layout(tree: Any, entries: Sequence[Tuple[str, List[int], int, Optional[Dict[str, Any]]]]
            ) -> Tuple[bytes, List[int], int]:
    """(head, absolute offset of each tensor's stored bytes, file size) for entries (dtype, shape,
    stored nbytes, how)."""
    table, rel_offsets, offset, end = [], [], 0, 0
    for dtype, shape, nbytes, how in entries:
        table.append([dtype, shape, offset, nbytes] + ([how] if how else []))
        rel_offsets.append(offset)
        end = offset + nbytes
        offset = _align(end)
    header = json.dumps({"format": FORMAT_VERSION, "tensors": table, "tree": tree},
                        ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header)) + header
    data_start = _align(len(head))
    head += bytes(data_start - len(head))
    return head, [data_start + o for o in rel_offsets], data_start + end


# --------------------------------------------------------------------------------------------
# stored forms: lossless narrowing and zstd


@dataclass(frozen=True)
class StoredForm:
    """How tensors are stored: `narrow` integer tensors into the narrowest dtype their min / max allow;
    `zstd_level` (None: no compression) compresses every tensor in chunks of `chunk_bytes`."""

    narrow: bool = True
    zstd_level: Optional[int] = None
    chunk_bytes: int = 1 << 22

    @property
    def transforms(self) -> bool:
        return self.narrow or self.zstd_level is not None


@dataclass
class StoredImage:
    """A file image whose tensors are stored in a `StoredForm`: `head`, then (offset, bytes-like or
    contiguous tensor) pieces; `nbytes` in all; `logical_nbytes`, the same file at full width."""

    head: bytes
    pieces: List[Tuple[int, Any]]
    nbytes: int
    logical_nbytes: int


# Narrower integer dtypes a tensor may be stored in, narrowest first (torch's other unsigned types
# lack operators; they are only ever sources).
_NARROW_TO = (torch.uint8, torch.int8, torch.int16, torch.int32)
_INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                         torch.uint16, torch.uint32, torch.uint64})


def narrowest_dtype(t: torch.Tensor) -> torch.dtype:
    """The narrowest dtype holding every value of the integer tensor `t` exactly (its own if none)."""
    if t.dtype not in _INT_DTYPES or t.numel() == 0:
        return t.dtype
    try:
        lo, hi = (int(v) for v in torch.aminmax(t))
    except (RuntimeError, NotImplementedError):   # unsigned dtypes without the kernel
        arr = t.numpy()
        lo, hi = int(arr.min()), int(arr.max())
    for cand in _NARROW_TO:
        if cand.itemsize >= t.dtype.itemsize:
            break
        info = torch.iinfo(cand)
        if info.min <= lo and hi <= info.max:
            return cand
    return t.dtype


def stored_image(image: FileImage, tensors: Sequence[torch.Tensor], form: StoredForm) -> StoredImage:
    """`image` with its tensors (contiguous CPU tensors holding `image.tensors`' values: the staged copy,
    or the tensors themselves) narrowed and compressed as `form` says. Runs on a writer thread."""
    cctx = zstandard.ZstdCompressor(level=form.zstd_level, write_checksum=True) if form.zstd_level is not None else None
    entries, data = [], []
    for t, name in zip(tensors, image.names or [None] * len(tensors)):
        dtype = t.dtype
        stored_dtype = narrowest_dtype(t) if form.narrow else dtype
        chunks = None
        if cctx is not None and t.numel():
            frames, chunks = _compress_chunks(cctx, t.reshape(-1), stored_dtype, form.chunk_bytes)
            raw: Any = frames
            if sum(len(f) for f in frames) >= sum(c[1] for c in chunks):   # noise does not compress: raw
                chunks = None
        if chunks is None:
            stored = t if stored_dtype == dtype else t.to(stored_dtype)
            raw = stored.reshape(-1).view(torch.uint8)          # contiguous: the staged copy's layout
        nbytes = sum(len(f) for f in raw) if chunks is not None else raw.numel()
        entries.append((_dtype_name(dtype), list(t.shape), nbytes,
                        _how(name, None if stored_dtype == dtype else _dtype_name(stored_dtype), chunks)))
        data.append(raw)
    head, offsets, nbytes = _layout(image.tree, entries)
    pieces: List[Tuple[int, Any]] = []
    for off, raw in zip(offsets, data):
        if isinstance(raw, list):
            for frame in raw:
                pieces.append((off, frame))
                off += len(frame)
        elif raw.numel():
            pieces.append((off, raw))
    return StoredImage(head, pieces, nbytes, image.nbytes)


def _compress_chunks(cctx: Any, flat: torch.Tensor, stored_dtype: torch.dtype, chunk_bytes: int
                     ) -> Tuple[List[bytes], List[List[int]]]:
    """zstd frames of `flat` stored as `stored_dtype`, `chunk_bytes` of stored bytes each; each chunk is
    narrowed into this thread's scratch first (no full-size temporary)."""
    per = max(1, chunk_bytes // stored_dtype.itemsize)
    frames, chunks = [], []
    for a in range(0, flat.numel(), per):
        part = flat[a:a + per]
        if stored_dtype != flat.dtype:
            need = part.numel() * stored_dtype.itemsize
            scratch = getattr(_scratch, "wbuf", None)
            if scratch is None or len(scratch) < need:
                scratch = _scratch.wbuf = bytearray(max(need, chunk_bytes))
            narrow = torch.frombuffer(scratch, dtype=stored_dtype, count=part.numel())
            # NumPy: on this thread alone (torch would fan out over the intra-op threads the trainer's
            # own computation uses)
            np.copyto(narrow.numpy(), part.numpy(), casting="unsafe")
            part = narrow
        view = _byte_view(part)
        frames.append(cctx.compress(view))
        chunks.append([len(frames[-1]), len(view)])
    return frames, chunks


def fill_stored(stored: StoredImage, buffer: Any) -> None:
    """Copy a stored image into `buffer` (a writable ctypes array of at least stored.nbytes bytes)."""
    base = ctypes.addressof(buffer)
    ctypes.memmove(base, stored.head, len(stored.head))
    pos = len(stored.head)
    for off, piece in stored.pieces:
        if off > pos:
            ctypes.memset(base + pos, 0, off - pos)
        if isinstance(piece, torch.Tensor):
            ctypes.memmove(base + off, piece.data_ptr(), piece.numel())
            pos = off + piece.numel()
        else:
            ctypes.memmove(base + off, piece, len(piece))
            pos = off + len(piece)
    if stored.nbytes > pos:
        ctypes.memset(base + pos, 0, stored.nbytes - pos)


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


def write(fileobj: BinaryIO, structure: Any, names: Optional[Dict[int, str]] = None,
          form: Optional[StoredForm] = None) -> int:
    """Write an encoded structure to an open binary file object (anything with write()) in the current
    format, the tensors' bytes straight from their memory (or as `form` stores them). Returns the bytes
    written."""
    image = plan(structure, names)
    if form is not None and form.transforms:
        stored = stored_image(image, [t.contiguous() for t in image.tensors], form)
        fileobj.write(stored.head)
        pos = len(stored.head)
        for off, piece in stored.pieces:
            if off > pos:
                fileobj.write(bytes(off - pos))
            mv = _byte_view(piece) if isinstance(piece, torch.Tensor) else piece
            fileobj.write(mv)
            pos = off + len(mv)
        if stored.nbytes > pos:
            fileobj.write(bytes(stored.nbytes - pos))
        return stored.nbytes
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


def _header_of(view: memoryview, size: int) -> Tuple[Dict[str, Any], int]:
    return _parse_header(lambda n, off: bytes(view[off:off + n]), size)


def _parse_header(pread: Callable[[int, int], bytes], size: int) -> Tuple[Dict[str, Any], int]:
    head = pread(_PREAMBLE.size, 0)
    if len(head) < _PREAMBLE.size:
        raise CodecError("truncated: no complete header")
    magic, version, _reserved, hlen = _PREAMBLE.unpack(head)
    if version > FORMAT_VERSION or version < 2:  # 2 and 3 share the layout; 3 adds `how`
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
        if entry[2] % _ALIGN or not _stored_size_valid(dtype, entry):
            raise CodecError(f"malformed tensor entry {str(entry)[:80]}")
        end = max(end, data_start + entry[2] + entry[3])
    if end > size:
        raise CodecError(f"truncated: {size} bytes, the header needs {end}")
    return doc, data_start


_HOW_KEYS = frozenset({"name", "as", "zstd"})
_MAX_CHUNK_RAW = 1 << 30          # a chunk holds at most this many bytes decompressed (writers use 4 MiB)


def _stored_size_valid(dtype: torch.dtype, entry: list) -> bool:
    """Whether a tensor entry's stored size agrees with its shape, dtype and `how`."""
    numel = math.prod(entry[1])
    how = entry[4] if len(entry) > 4 else None
    if how is None:
        return entry[3] == numel * dtype.itemsize
    if type(how) is not dict or not how or not set(how) <= _HOW_KEYS:
        return False
    if "name" in how and type(how["name"]) is not str:
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
    out_pos = 0
    for i, entry in enumerate(doc["tensors"]):
        name, shape, off, nbytes = entry[:4]
        how = entry[4] if len(entry) > 4 else {}
        dtype = _dtype_from_name(name)
        stored_dtype = _dtype_from_name(how["as"]) if "as" in how else dtype
        if "zstd" not in how and stored_dtype == dtype:
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
            tasks.append((field_name, j, len(chunks), pos, stored, flat[first:first + count], stored_dtype))
            pos, first = pos + stored, first + count
    if tasks:
        _decompress_all(memoryview(buf).cast("B"), tasks)
    return result


def logical_nbytes(doc: Dict[str, Any]) -> int:
    """Bytes the narrowed or compressed tensors of a parsed header take at full width (64-byte aligned
    each): the size of the `out` buffer `_tensors_from` fills."""
    total = 0
    for entry in doc["tensors"]:
        how = entry[4] if len(entry) > 4 else {}
        if "zstd" in how or "as" in how:
            total = _align(total + math.prod(entry[1]) * _dtype_from_name(entry[0]).itemsize)
    return total


_pool_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_scratch = threading.local()
_PARALLEL_FROM = 1 << 23          # decompress in parallel once a file holds this many raw bytes


_pool_pid = 0


def _decompress_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads chunks are decompressed on (started on first use; again in a forked child, whose
    copy of the parent's pool has no threads)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                          thread_name_prefix="skip_harness-zstd")
            _pool_pid = os.getpid()
        return _pool


def _decompress_all(view: memoryview, tasks: List[Tuple[Any, ...]]) -> None:
    """Decompress every chunk of `tasks` ((field, chunk index, chunks, file offset, stored bytes, the
    slice of the full-width tensor it fills, the dtype it was stored in)) into its slice; CodecError
    naming the field and chunk of the first damaged one."""
    total = sum(t[5].numel() * t[6].itemsize for t in tasks)      # raw bytes
    if len(tasks) > 1 and total >= _PARALLEL_FROM:
        errors = list(_decompress_pool().map(lambda t: _decompress_one(view, t), tasks))
    else:
        errors = [_decompress_one(view, t) for t in tasks]
    for err in errors:
        if err is not None:
            raise CodecError(err)


def _decompress_one(view: memoryview, task: Tuple[Any, ...]) -> Optional[str]:
    field_name, j, n, pos, stored, dst, stored_dtype = task
    raw = dst.numel() * stored_dtype.itemsize
    if stored_dtype == dst.dtype:                   # straight into the tensor's memory
        into = memoryview(dst.view(torch.uint8).numpy())
    else:                                           # into this thread's scratch, then widened
        scratch = getattr(_scratch, "buf", None)
        if scratch is None or len(scratch) < raw:
            scratch = _scratch.buf = bytearray(max(raw, 1 << 22))
        into = memoryview(scratch)[:raw]
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(view[pos:pos + stored], read_across_frames=False)
        got = 0
        while got < raw:
            k = reader.readinto(into[got:])
            if k == 0:
                break
            got += k
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        return f"{field_name}: zstd chunk {j + 1} of {n} cannot be decompressed ({exc})"
    if got != raw or extra:
        return f"{field_name}: zstd chunk {j + 1} of {n} does not hold the {raw} bytes its header says"
    if stored_dtype != dst.dtype:            # widened with NumPy: this thread only
        np.copyto(dst.numpy(), torch.frombuffer(scratch, dtype=stored_dtype, count=dst.numel()).numpy())
    return None


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
        out.append(StoredField(how.get("name", f"tensor {i}"), entry[0], how.get("as", entry[0]),
                               "zstd" if "zstd" in how else "none", math.prod(entry[1]) * dtype.itemsize, entry[3]))
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


NOT_A_PAYLOAD = "not a skip_harness or torch payload file"
_TORCH_MAGICS = (b"PK\x03\x04", b"\x80")   # torch.save's zip archive; its legacy format (a pickle)


def looks_like_torch_image(view: memoryview) -> bool:
    """Whether the bytes start as a torch.save file does (a zip archive, or the legacy pickle format)."""
    start = bytes(view[:4])
    return any(start.startswith(m) for m in _TORCH_MAGICS)


def torch_load(view: memoryview) -> Any:
    """torch.load(weights_only=True) of a file image in the previous format (read from memory: the
    codec never opens a file); CodecError (no path) on failure, NOT_A_PAYLOAD for bytes that are
    neither format (random bytes, a text file)."""
    if not looks_like_torch_image(view):
        raise CodecError(NOT_A_PAYLOAD)
    try:
        return torch.load(io.BytesIO(view), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CodecError(f"cannot be loaded safely: {sanitized(exc)}") from None
