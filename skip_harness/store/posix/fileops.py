"""How one file is written, hashed and removed safely, through directory file descriptors.

Write protocol (payload, meta.json, commit.json alike): write to a unique temporary name ('.tmp-'
prefix) in the target directory, flush and fsync it, `os.replace` it into place, fsync the directory.
Directories are opened with O_NOFOLLOW, so a symlink is never entered. Checksums are xxh3_128, taken
as the bytes are written (`HashingWriter`) or read back (`checksum_fd`).

This module does no logging and knows nothing of steps beyond the commit record's name.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import xxhash

from skip_harness.store.layout import COMMIT_NAME, TMP_PREFIX, TRASH_PREFIX

CHUNK_BYTES = 8 << 20             # read size when verifying checksums of small files
MAP_FROM = 1 << 20                # files from this size are hashed through a read-only mapping
WRITE_BUFFER_BYTES = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# --------------------------------------------------------------------------------------------
# checksums


def checksum_fd(fd: int, chunk_bytes: int = CHUNK_BYTES) -> Tuple[int, str]:
    """(size, xxh3_128 hex) of an open regular file. Files from MAP_FROM bytes are hashed through a
    read-only mapping (no copy into a buffer: several times faster than reading, and the hash releases
    the GIL); smaller ones are read in chunks through one reused buffer."""
    size = os.fstat(fd).st_size
    if size >= MAP_FROM:
        try:
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
                if hasattr(mapped, "madvise"):
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                return size, xxhash.xxh3_128_hexdigest(mapped)
        except (OSError, ValueError):
            pass  # not mappable (a special file system): read it
    h = xxhash.xxh3_128()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    total = 0
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            total += n
    return total, h.hexdigest()


def checksum_file(path: os.PathLike | str, chunk_bytes: int = CHUNK_BYTES) -> Tuple[int, str]:
    """(size, xxh3_128 hex) of a file; refuses to follow a symlink in the last component."""
    fd = os.open(path, READ_FLAGS)
    try:
        return checksum_fd(fd, chunk_bytes)
    finally:
        os.close(fd)


class HashingWriter:
    """File-object wrapper that hashes every byte written through it (so writing never re-reads).

    Each buffer is hashed whole: xxhash releases the GIL for inputs over 100 kB, so hashing a tensor's
    bytes runs beside the trainer's Python thread. (Hashing in small chunks would not: every chunk
    would queue for the GIL behind a busy trainer thread.)"""

    def __init__(self, f):
        self._f = f
        self._h = xxhash.xxh3_128()
        self.bytes = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self._f.write(view)
        self._h.update(view)
        self.bytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# --------------------------------------------------------------------------------------------
# low-level, directory-fd based file operations


class NotARealDirectory(Exception):
    def __init__(self, name: str, what: str):
        self.name = name
        self.what = what
        super().__init__(f"{name} {what}")


def describe_mode(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "is a symlink (never followed)"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISREG(mode):
        return "is a regular file, not a directory"
    return "is not a regular file or directory"


def lstat_at(name: str, dir_fd: int) -> Optional[os.stat_result]:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_dir_at(name: str, dir_fd: Optional[int], create: bool) -> Tuple[int, bool]:
    """Open the real directory `name` (relative to dir_fd); never through a symlink. (fd, created)."""
    created = False
    if create:
        try:
            os.mkdir(name, 0o777, dir_fd=dir_fd)
            created = True
        except FileExistsError:
            pass
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd), created
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            raise NotARealDirectory(name, describe_mode(st.st_mode)) from None
        raise


def fsync_dir(fd: int) -> None:
    os.fsync(fd)


def tmp_name(final_name: str) -> str:
    return f"{TMP_PREFIX}{final_name}.{os.getpid()}.{secrets.token_hex(4)}"


def replace_via_temp(dir_fd: int, name: str, fill: Callable[[str], None]) -> None:
    """Create `name` in dir_fd atomically: `fill(tmp)` creates the temporary file `tmp` there (with
    CREATE_FLAGS), writes it, makes it durable and closes it; then it is renamed into place. On any
    failure the temporary file is removed and the exception propagates. The directory fsync is the
    caller's (whether a failing one matters is the caller's to say)."""
    tmp = tmp_name(name)
    try:
        fill(tmp)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def write_file_at(dir_fd: int, name: str, write: Callable[[Any], None], sync_dir: bool = True) -> Tuple[int, str]:
    """Atomically and durably create `name` in the directory dir_fd: temp file, `write(fileobj)`,
    flush + fsync, rename into place, fsync the directory (without `sync_dir`, the caller's, once for
    several files). Returns (bytes, xxh3_128 hex). On any failure before the rename the temp file is
    removed and the exception propagates."""
    written: List[Tuple[int, str]] = []

    def fill(tmp: str) -> None:
        fd = os.open(tmp, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            f = open(fd, "wb", buffering=WRITE_BUFFER_BYTES, closefd=True)
        except BaseException:
            os.close(fd)
            raise
        with f:
            hw = HashingWriter(f)
            write(hw)
            f.flush()
            os.fsync(f.fileno())
        written.append((hw.bytes, hw.hexdigest()))

    replace_via_temp(dir_fd, name, fill)
    if sync_dir:
        fsync_dir(dir_fd)
    return written[0]


def drop_cached_pages(fd: int) -> None:
    """Let the kernel drop a durable file's pages from the page cache. A cache file is read in a later run,
    not in this one; and writing into pages the kernel must first find and back costs several times the
    copy itself (measured: 285 ms of kernel time per 112 MiB into fresh pages, 29 ms into reused ones),
    time taken from the trainer's cores. Advisory: failures are ignored."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def tree_bytes(path: str) -> int:
    """Sum of the sizes (lstat) of every non-directory entry under `path`, never following links."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    stack = [path]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
    return total


def remove_entry_at(root_fd: int, name: str, root_path: Path) -> int:
    """Remove the entry `name` of a namespace directory: a link or file is unlinked (never followed);
    a directory loses its commit record first (durably), is renamed to a '.trash-' name, then removed
    without following any link inside. Returns the bytes it held."""
    st = lstat_at(name, root_fd)
    if st is None:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=root_fd)
        fsync_dir(root_fd)
        return st.st_size
    freed = tree_bytes(str(root_path / name))
    if not name.startswith(TRASH_PREFIX):
        try:
            step_fd, _ = open_dir_at(name, root_fd, create=False)
        except NotARealDirectory:  # replaced under us: remove whatever it is now as an entry
            return remove_entry_at(root_fd, name, root_path)
        try:
            try:
                os.unlink(COMMIT_NAME, dir_fd=step_fd)
                fsync_dir(step_fd)
            except (FileNotFoundError, IsADirectoryError):
                pass
        finally:
            os.close(step_fd)
        trash = f"{TRASH_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(3)}"
        os.rename(name, trash, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        fsync_dir(root_fd)
        name = trash
    try:
        shutil.rmtree(name, dir_fd=root_fd)
    except OSError:
        pass  # the '.trash-' entry left is reported by the next scan as a leftover, and removed by cleanup
    return freed
