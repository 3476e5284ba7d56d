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
from typing import Tuple

from skip_harness.bufferpool import ALIGN, BufferPool, Lease, round_up
from skip_harness.fileops import CREATE_FLAGS, READ_FLAGS, drop_cached_pages, tmp_name, fsync_dir

_DIRECT = getattr(os, "O_DIRECT", 0)


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


def _pwrite_all(fd: int, view: memoryview, nbytes: int, direct: bool) -> bool:
    """Write view[:nbytes] at offset 0; with `direct`, whole ALIGN blocks (the caller truncates).
    Returns whether the bytes went out direct."""
    end = round_up(nbytes) if direct else nbytes
    done = 0
    while done < end:
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
    return direct


def write_buffer_at(dir_fd: int, name: str, lease: Lease, nbytes: int, drop_cache: bool = True) -> None:
    """Atomically and durably create `name` in dir_fd holding the first `nbytes` of the leased buffer
    (which has at least round_up(nbytes) bytes). On failure the temporary file is removed and the
    exception propagates."""
    tmp = tmp_name(name)
    fd, direct = _open(tmp, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
    try:
        try:
            direct = _pwrite_all(fd, lease.view(), nbytes, direct)
            if direct and nbytes % ALIGN:
                os.ftruncate(fd, nbytes)
            os.fsync(fd)
            if not direct and drop_cache:
                drop_cached_pages(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
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
