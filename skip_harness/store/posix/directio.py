"""Payload files written from and read into pool buffers with O_DIRECT, past the page cache.

Filling page-cache pages is what a buffered write or a memory-mapped read of a large file mostly
costs -- page allocation and faults on the trainer's cores -- and a cache file is written once and
read in a later run, so the page cache buys nothing. With O_DIRECT the device moves the bytes
straight between the (page-aligned, reused) buffer and the disk; a written file's last partial
block goes through the page cache. Where a file system refuses O_DIRECT (EINVAL: tmpfs on older
kernels, some network file systems) the same calls go through the page cache instead, dropping
the written pages after fsync.

`write_buffer_at` keeps the write protocol of `fileops` (unique temporary name, fsync, `os.replace`,
directory fsync). This module does no logging.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
from typing import Callable, Iterator, Optional, Tuple

from skip_harness.store.bufferpool import ALIGN, BufferPool, Lease, round_up
from skip_harness.store.posix.fileops import CREATE_FLAGS, READ_FLAGS, drop_cached_pages, fsync_dir, replace_via_temp

_DIRECT = getattr(os, "O_DIRECT", 0)


_libc = ctypes.CDLL(None, use_errno=True)
_madvise = getattr(_libc, "madvise", None)
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
_MADV_DOFORK = getattr(mmap, "MADV_DOFORK", 11)


@contextlib.contextmanager
def kept_from_forks(lease: Lease) -> Iterator[None]:
    """The leased buffer left out of any fork while a transfer to or from it is in flight.

    A pool buffer is private memory: on older kernels (before about 5.17) a fork during direct I/O
    into it copies pages under the transfer, so the parent could read stale bytes (a good step would
    fail its checksum). MADV_DONTFORK for the transfer's window keeps the buffer out of a child
    forked meanwhile (a DataLoader worker never touches a buffer in flight), so a fork never waits
    for the disk; MADV_DOFORK puts it back after. Where madvise is missing or refuses, the transfer
    goes on as before."""
    advised = False
    if _madvise is not None and lease.array is not None:
        advised = _madvise(ctypes.addressof(lease.array), lease.capacity, _MADV_DONTFORK) == 0
    try:
        yield
    finally:
        if advised and lease.array is not None:
            _madvise(ctypes.addressof(lease.array), lease.capacity, _MADV_DOFORK)


def _open(path: str, flags: int, mode: int = 0o644, dir_fd=None) -> Tuple[int, bool]:
    """(fd, direct): opened with O_DIRECT where the file system takes it, else without."""
    if _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, mode, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode, dir_fd=dir_fd), False


def _buffered(fd: int) -> None:
    """Turn O_DIRECT off on an open file (a file system that took the open but not the I/O)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_DIRECT)


def _pwrite_all(fd: int, view: memoryview, nbytes: int, direct: bool) -> None:
    """Write view[:nbytes] at offset 0. With `direct` the whole ALIGN blocks go straight to the disk and
    the unaligned tail through the page cache: a direct write padded past the payload would need a
    truncate, and truncating into a block the page cache does not hold reads that block back from the
    disk first (one synchronous read a payload, on the writer's thread)."""
    end = nbytes - nbytes % ALIGN if direct else nbytes
    done = 0
    while done < nbytes:
        if direct and done >= end:
            _buffered(fd)            # the tail
            direct, end = False, nbytes
        try:
            n = os.pwrite(fd, view[done:end], done)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            _buffered(fd)
            direct, end = False, nbytes
            continue
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n
        if direct and done % ALIGN and done < end:
            _buffered(fd)            # a short direct write: finish through the page cache
            direct, end = False, nbytes


def write_buffer_at(dir_fd: int, name: str, lease: Lease, nbytes: int, drop_cache: bool = True,
                    sync_dir: bool = True) -> None:
    """Atomically and durably create `name` in dir_fd holding the first `nbytes` of the leased buffer;
    without `sync_dir` the directory's fsync is the caller's. On failure the temporary file is removed
    and the exception propagates."""
    def fill(tmp: str) -> None:
        fd, direct = _open(tmp, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            with kept_from_forks(lease):
                _pwrite_all(fd, lease.view(), nbytes, direct)
            os.fsync(fd)
            if drop_cache:
                drop_cached_pages(fd)             # a no-op for what went out direct
        finally:
            os.close(fd)

    replace_via_temp(dir_fd, name, fill)
    if sync_dir:
        fsync_dir(dir_fd)


def read_into(path: str, pool: BufferPool, dir_fd: Optional[int] = None,
              check: Optional[Callable[[os.stat_result], None]] = None) -> Tuple[Lease, int]:
    """The whole regular file at `path` (relative to `dir_fd` when given; never through a symlink in its
    last component) read into a leased pool buffer: (lease, bytes read). `check` sees the open file's
    stat before a buffer is taken (it raises to refuse the file: one open serves the check and the
    read). Raises OSError."""
    fd, direct = _open(path, READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if check is not None:
            check(st)
        size = st.st_size
        lease = pool.acquire(size)
        try:
            with kept_from_forks(lease):
                got = _pread_all(fd, lease.view(), size, direct)
        except BaseException:
            lease.release()
            raise
        return lease, min(got, size)
    finally:
        os.close(fd)


def _pread_all(fd: int, view: memoryview, size: int, direct: bool) -> int:
    """Read the file into view[:size] from offset 0 (whole ALIGN blocks while direct); the bytes got
    (fewer when the file is shorter than fstat said: the caller checks the size)."""
    end = round_up(size) if direct else size
    got = 0
    while got < size:
        try:
            n = os.preadv(fd, [view[got:end]], got)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            _buffered(fd)
            direct, end = False, size
            continue
        if n <= 0:
            break
        got += n
        if direct and got % ALIGN and got < size:
            _buffered(fd)
            direct, end = False, size
    return got
