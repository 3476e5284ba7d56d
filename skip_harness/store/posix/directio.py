"""Payload files written from and read into pool buffers with O_DIRECT, past the page cache.

Filling page-cache pages is what a buffered write or a memory-mapped read of a large file mostly
costs -- page allocation and faults on the trainer's cores -- and a cache file is written once and
read in a later run, so the page cache buys nothing. With O_DIRECT the device moves the bytes
straight between the (page-aligned, reused) buffer and the disk. Where a file system refuses
O_DIRECT (EINVAL: tmpfs on older kernels, some network file systems) the same calls go through the
page cache instead, dropping the written pages after fsync.

`write_buffer_at` keeps the write protocol of `fileops` (unique temporary name, fsync, `os.replace`,
directory fsync). This module does no logging.
"""
from __future__ import annotations

import errno
import fcntl
import os
import threading
from typing import Tuple

from skip_harness.store.bufferpool import ALIGN, BufferPool, Lease, round_up
from skip_harness.store.posix.fileops import CREATE_FLAGS, READ_FLAGS, drop_cached_pages, fsync_dir, replace_via_temp

_DIRECT = getattr(os, "O_DIRECT", 0)


class _ForkGuard:
    """Holds `os.fork` until no direct read or write is in flight. A pool buffer is private memory;
    on older kernels (before about 5.17) a fork during direct I/O into it copies pages under the
    transfer, so the parent can read stale bytes (a good step would fail its checksum). I/O calls
    enter and leave freely in parallel; a fork waits for them to drain (at most one transfer)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0

    def __enter__(self) -> None:
        with self._cond:
            self._active += 1

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()                  # no new transfer starts; held through the fork
        while self._active:
            self._cond.wait()

    def after_fork_parent(self) -> None:
        self._cond.release()

    def after_fork_child(self) -> None:
        self.__init__()                       # the child has no transfer in flight


_FORK_GUARD = _ForkGuard()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_FORK_GUARD.before_fork, after_in_parent=_FORK_GUARD.after_fork_parent,
                        after_in_child=_FORK_GUARD.after_fork_child)


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


def _pwrite_all(fd: int, view: memoryview, nbytes: int, direct: bool) -> int:
    """Write view[:nbytes] at offset 0; with `direct`, whole ALIGN blocks. Returns the extent written
    (from nbytes up to round_up(nbytes): the caller truncates)."""
    end = round_up(nbytes) if direct else nbytes
    done = 0
    while done < end:
        try:
            with _FORK_GUARD:
                n = os.pwrite(fd, view[done:end], done)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            _buffered(fd)
            direct, end = False, max(done, nbytes)
            continue
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n
        if direct and done % ALIGN and done < end:
            _buffered(fd)            # a short direct write: finish through the page cache
            direct, end = False, max(done, nbytes)
    return done


def write_buffer_at(dir_fd: int, name: str, lease: Lease, nbytes: int, drop_cache: bool = True) -> None:
    """Atomically and durably create `name` in dir_fd holding the first `nbytes` of the leased buffer
    (which has at least round_up(nbytes) bytes). On failure the temporary file is removed and the
    exception propagates."""
    def fill(tmp: str) -> None:
        fd, direct = _open(tmp, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            if _pwrite_all(fd, lease.view(), nbytes, direct) > nbytes:
                os.ftruncate(fd, nbytes)          # the padding of the last direct block
            os.fsync(fd)
            if drop_cache:
                drop_cached_pages(fd)             # a no-op for what went out direct
        finally:
            os.close(fd)

    replace_via_temp(dir_fd, name, fill)
    fsync_dir(dir_fd)


def read_into(path: str, pool: BufferPool) -> Tuple[Lease, int]:
    """The whole regular file at `path` (never through a symlink in its last component) read into a
    leased pool buffer: (lease, bytes read). Raises OSError."""
    fd, direct = _open(path, READ_FLAGS)
    try:
        size = os.fstat(fd).st_size
        lease = pool.acquire(size)
        view = lease.view()
        end = round_up(size) if direct else size
        got = 0
        while got < size:
            try:
                with _FORK_GUARD:
                    n = os.preadv(fd, [view[got:end]], got)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                _buffered(fd)
                direct, end = False, size
                continue
            if n <= 0:
                break                     # shorter than fstat said: the caller checks the size
            got += n
            if direct and got % ALIGN and got < size:
                _buffered(fd)
                direct, end = False, size
        return lease, min(got, size)
    finally:
        os.close(fd)
