"""How a file image's tensors are stored: integers narrowed losslessly to the narrowest dtype their
values allow, and the bytes compressed as consecutive zstd frames of `chunk_bytes` each (written on the
writer thread); and decompressing those chunks again, in parallel for a large file (on a load)."""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import zstandard

from skip_harness.errors import CodecError
from skip_harness.codec import dedupe
from skip_harness.codec.fileimage import FileImage, _byte_view, _dtype_name, _how, _layout, laid_out, numpy_view
from skip_harness.codec.payload_kinds import np

@dataclass(frozen=True)
class StoredForm:
    """How tensors are stored: `narrow` integer tensors into the narrowest dtype their min / max allow;
    `zstd_level` (None: no compression) compresses every tensor in chunks of `chunk_bytes`."""

    narrow: bool = True
    zstd_level: Optional[int] = None
    chunk_bytes: int = 1 << 22
    dedupe: bool = False          # tensors that repeat or follow from others stored as a rule (`dedupe`)
    shuffle: bool = False         # floats' bytes grouped by significance before zstd (as Blosc does)

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
_NUMPY_INT = {torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32"}
_INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                         torch.uint16, torch.uint32, torch.uint64})


def narrowest_dtype(t: torch.Tensor) -> torch.dtype:
    """The narrowest dtype holding every value of the integer tensor `t` exactly (its own if none)."""
    if t.dtype not in _INT_DTYPES or t.numel() == 0:
        return t.dtype
    # NumPy: on this thread alone (torch's aminmax would fan out over the trainer's intra-op threads)
    arr = numpy_view(t)
    if arr is None:
        arr = t.detach().reshape(-1).numpy()
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
    or the tensors themselves) narrowed and compressed as `form` says. Runs on a writer thread; a staged
    image (`fileimage.plan(staged=True)`) has its header laid out here (`fileimage.laid_out`), last: its
    JSON holds the GIL for its whole length, better not when the trainer's thread has just handed over
    the step (its tree is the same for dedupe's look at the jagged fields: a `j` node names no tensor)."""
    cctx = zstandard.ZstdCompressor(level=form.zstd_level, write_checksum=True) if form.zstd_level is not None else None
    names = list(image.names or [None] * len(tensors))
    rules = dedupe.plan(image.tree, tensors, names) if form.dedupe else None
    if rules is not None and rules.how:
        tensors, names = [*tensors, *rules.extras], [*names, *rules.extra_names]
    entries, data = [], []
    for i, (t, name) in enumerate(zip(tensors, names)):
        dtype = t.dtype
        if rules is not None and i in rules.how:                 # stored as a rule: no bytes of its own
            how = _how(name, None, None) or {}
            entries.append((_dtype_name(dtype), list(t.shape), 0, {**how, **rules.how[i]}))
            data.append(torch.empty(0, dtype=torch.uint8))
            continue
        stored_dtype = narrowest_dtype(t) if form.narrow else dtype
        chunks = None
        shuffle = form.shuffle and dtype in _SHUFFLED and cctx is not None and _shuffle_pays(cctx, t)
        if cctx is not None and t.numel():
            frames, chunks = _compress_chunks(cctx, t.reshape(-1), stored_dtype, form.chunk_bytes, shuffle)
            raw: Any = frames
            if sum(len(f) for f in frames) >= sum(c[1] for c in chunks):   # noise does not compress: raw
                chunks = None
        if chunks is None:
            shuffle = False
        if chunks is None:
            stored = t if stored_dtype == dtype else t.to(stored_dtype)
            raw = stored.reshape(-1).view(torch.uint8)          # contiguous: the staged copy's layout
        nbytes = sum(len(f) for f in raw) if chunks is not None else raw.numel()
        how = _how(name, None if stored_dtype == dtype else _dtype_name(stored_dtype), chunks)
        entries.append((_dtype_name(dtype), list(t.shape), nbytes, {**how, "shuffle": True} if shuffle and how else how))
        data.append(raw)
    full = laid_out(image)
    head, offsets, nbytes = _layout(full.tree, entries, full.raws)
    pieces: List[Tuple[int, Any]] = []
    for off, raw in zip(offsets, data):
        if isinstance(raw, list):
            for frame in raw:
                pieces.append((off, frame))
                off += len(frame)
        elif raw.numel():
            pieces.append((off, raw))
    return StoredImage(head, pieces, nbytes, full.nbytes)


def _compress_chunks(cctx: Any, flat: torch.Tensor, stored_dtype: torch.dtype, chunk_bytes: int,
                     shuffle: bool = False) -> Tuple[List[bytes], List[List[int]]]:
    """zstd frames of `flat` stored as `stored_dtype`, `chunk_bytes` of stored bytes each; each chunk is
    narrowed into this thread's scratch first (no full-size temporary), or with `shuffle` its bytes
    grouped by their place in each element (every first byte, then every second, ...)."""
    per = max(1, chunk_bytes // stored_dtype.itemsize)
    frames, chunks = [], []
    # sliced in NumPy when it can be (no torch call a chunk: `fileimage.numpy_view`)
    arr = numpy_view(flat)
    for a in range(0, flat.numel(), per):
        part: Any = flat[a:a + per] if arr is None else arr[a:a + per]
        if stored_dtype != flat.dtype:
            count = len(part)
            need = count * stored_dtype.itemsize
            scratch = getattr(_scratch, "wbuf", None)
            if scratch is None or len(scratch) < need:
                scratch = _scratch.wbuf = bytearray(max(need, chunk_bytes))
            narrow = np.frombuffer(scratch, dtype=_NUMPY_INT[stored_dtype], count=count)
            # NumPy: on this thread alone (torch would fan out over the intra-op threads the trainer's
            # own computation uses)
            np.copyto(narrow, part if arr is not None else part.numpy(), casting="unsafe")
            part = narrow
        view = _byte_view(part)
        if shuffle:
            view = _shuffled(view, stored_dtype.itemsize)
        frames.append(cctx.compress(view))
        chunks.append([len(frames[-1]), len(view)])
    return frames, chunks


# floats: their sign and exponent bytes repeat where their low mantissa bytes are noise
_SHUFFLED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


_UINT = {2: "uint16", 4: "uint32", 8: "uint64"}
_SAMPLE_BYTES = 1 << 16
_SHUFFLE_GAIN = 0.95              # shuffled only when a sample of it compresses to this share or less


def _shuffle_pays(cctx: Any, t: torch.Tensor) -> bool:
    """Whether grouping `t`'s bytes compresses it enough better to pay for regrouping them on a load,
    judged on its first 64 KiB (a mostly-zero tensor compresses to nothing either way)."""
    arr = numpy_view(t)
    count = _SAMPLE_BYTES // t.element_size()
    view = _byte_view(t.reshape(-1)[:count] if arr is None else arr[:count])
    plain = len(cctx.compress(view))
    return len(cctx.compress(_shuffled(view, t.element_size()))) <= _SHUFFLE_GAIN * plain


def _shuffled(view: Any, size: int) -> memoryview:
    """The bytes of `view` (elements of `size` bytes) grouped by place -- every element's lowest byte, then
    every second byte, ... -- in this thread's scratch. Shifts and masks over whole words: a strided byte
    copy (`copyto` of a transpose) is three times slower."""
    words = np.frombuffer(view, dtype=_UINT[size])
    n = len(words)
    scratch, tmp = _scratch_pair("sbuf", n * size, words.dtype)
    planes = np.frombuffer(scratch, dtype=np.uint8, count=n * size).reshape(size, n)
    for k in range(size):
        np.right_shift(words, 8 * k, out=tmp)
        np.copyto(planes[k], tmp, casting="unsafe")            # the low byte of each
    return memoryview(scratch)[:n * size]


def _unshuffled(planes: Any, dst: torch.Tensor, size: int) -> None:
    """Inverse of `_shuffled`: `planes` (size x n bytes) put back together into `dst`'s n elements."""
    n = dst.numel()
    out = dst.view(getattr(torch, _UINT[size].replace("uint", "int"))).numpy().view(_UINT[size])
    _unused, tmp = _scratch_pair("ubuf", 0, out.dtype, n)
    src = np.frombuffer(planes, dtype=np.uint8, count=n * size).reshape(size, n)
    np.copyto(out, src[0])
    for k in range(1, size):
        np.copyto(tmp, src[k])
        np.left_shift(tmp, 8 * k, out=tmp)
        np.bitwise_or(out, tmp, out=out)


def _scratch_pair(name: str, nbytes: int, word: Any, words: int = 0) -> Tuple[bytearray, Any]:
    """This thread's scratch of at least `nbytes` bytes, and a word array of `words` (or nbytes / size) words."""
    scratch = getattr(_scratch, name, None)
    if scratch is None or len(scratch) < nbytes:
        scratch = bytearray(max(nbytes, 1 << 22))
        setattr(_scratch, name, scratch)
    count = words or nbytes // np.dtype(word).itemsize
    tmp = getattr(_scratch, name + "_w", None)
    if tmp is None or tmp.dtype != np.dtype(word) or len(tmp) < count:
        tmp = np.empty(max(count, (1 << 22) // np.dtype(word).itemsize), dtype=word)
        setattr(_scratch, name + "_w", tmp)
    return scratch, tmp[:count]


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
    field_name, j, n, pos, stored, dst, stored_dtype, shuffled = task
    raw = dst.numel() * stored_dtype.itemsize
    if stored_dtype == dst.dtype and not shuffled:  # straight into the tensor's memory
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
    if shuffled:                             # each element's bytes put back together
        _unshuffled(scratch, dst, stored_dtype.itemsize)
    elif stored_dtype != dst.dtype:          # widened with NumPy: this thread only
        np.copyto(dst.numpy(), torch.frombuffer(scratch, dtype=stored_dtype, count=dst.numel()).numpy())
    return None
