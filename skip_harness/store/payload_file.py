"""A payload file by its path, outside a step's verified read: an older cache's `torch.save` files,
a step without a commit record, and `show` / `check` on a loose file.

The store opens the file (never following a link, never blocking on a FIFO) and maps it; the codec
decodes the mapped bytes and knows nothing of where they came from. A committed step is read
through its namespace's backend instead (`reader.StepReader`), verified against its commit record.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
from typing import Any, Dict, List, Optional, Tuple, Union

from skip_harness import codec
from skip_harness.errors import CodecError
from skip_harness.store.layout import META_NAME, PAYLOAD_NAME

PathLike = Union[str, os.PathLike]
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_MAX_META_BYTES = 16 << 20


def _image(spath: str, mapped: bool) -> Tuple[Any, int]:
    """(buffer, size) of the regular file at `spath`: a private (copy-on-write) mapping, read lazily,
    or with `mapped` False its bytes read now. CodecError naming the file when it cannot be opened
    or is not a regular file (a symlink is never followed)."""
    try:
        fd = os.open(spath, _OPEN_FLAGS)
    except OSError as exc:
        raise CodecError(f"{spath}: cannot be opened: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CodecError(f"{spath}: not a regular file")
        size = st.st_size
        if size == 0:
            return bytearray(0), 0
        if mapped:
            return mmap.mmap(fd, size, access=mmap.ACCESS_COPY), size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.preadv(fd, [view[got:]], got)
            if n <= 0:
                raise CodecError(f"{spath}: truncated while reading")
            got += n
        return buf, size
    except OSError as exc:
        raise CodecError(f"{spath}: cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def load(path: PathLike, mmap: bool = True) -> Any:
    """The payload in the file at `path` (this format or the previous version's torch.save): never runs
    code from it; CodecError naming the file on any failure. With `mmap` the tensors are private
    (copy-on-write) views of the mapped file, read lazily."""
    spath = os.fspath(path)
    buf, size = _image(spath, mmap)
    return codec.load_buffer(buf, size, spath)


def check(path: PathLike) -> None:
    """CodecError naming the file unless it would load safely (header, records and bounds; no tensor
    data read, no registered type built, nothing run)."""
    spath = os.fspath(path)
    buf, size = _image(spath, True)
    codec.check_buffer(buf, size, spath)


def stored_fields(path: PathLike) -> List[codec.StoredField]:
    """How each tensor of the file is stored, from its header alone ([] for a torch.save file)."""
    spath = os.fspath(path)
    buf, size = _image(spath, True)
    return codec.stored_fields(buf, size, spath)


def size(path: PathLike) -> Optional[int]:
    """The size of the file at `path` (never through a link: the link's own), None when it cannot be stat'ed."""
    try:
        return os.lstat(os.fspath(path)).st_size
    except OSError:
        return None


def sibling_meta(path: PathLike) -> Dict[str, Any]:
    """The meta.json beside a loose payload file (`tq_batch.pt` -> `meta.json`, `tq_batch_rank1.pt`
    -> `meta_rank1.json`) as a dict; {} when there is none or it is not a JSON object (it only adds
    to what `show` prints). A symlink is never followed."""
    spath = os.fspath(path)
    head, name = os.path.split(spath)
    meta_name = META_NAME if name == PAYLOAD_NAME else name.replace("tq_batch", "meta").replace(".pt", ".json")
    if meta_name == name:
        return {}
    try:
        fd = os.open(os.path.join(head, meta_name), _OPEN_FLAGS)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            doc = json.loads(f.read(_MAX_META_BYTES))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return doc if isinstance(doc, dict) else {}
