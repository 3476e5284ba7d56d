"""The POSIX storage: a namespace is a directory on a local (or shared POSIX) file system.

Every measured trick of the POSIX cache stays here and in its helpers (`fileops`, `directio`):
payloads written with O_DIRECT from reused, page-aligned pool buffers and read with O_DIRECT into
them (the page cache where a file system refuses it, its pages dropped once durable); a unique
temporary name + fsync + rename + directory fsync for every file; fd-relative walking that never
follows a link (a directory on a key's way that is a symlink is never entered); inode + mtime + size
as the change stamp the index keeps. The contract is `store.storage`'s.
"""
from __future__ import annotations

import errno
import functools
import mmap
import os
import stat
import struct
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from skip_harness.errors import CorruptStepError
from skip_harness.store.bufferpool import BufferPool, Lease
from skip_harness.store.checksum import check_read, checksum_bytes, checksum_int
from skip_harness.store.layout import TMP_PREFIX
from skip_harness.store.posix.directio import read_into, write_buffer_at
from skip_harness.store.posix.fileops import (
    READ_FLAGS, NotARealDirectory, describe_mode, fsync_dir, open_dir_at, remove_entry_at,
    write_file_at,
)
from skip_harness.store.storage import DIR, FILE, LINK, LINK_WHAT, OTHER, TEMPORARY, Capabilities, Entry, Storage

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def stamp_of(st: os.stat_result) -> str:
    """The change stamp of a file: equal stamps, same file and bytes (a rewrite is a new inode)."""
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


_KINDS = {stat.S_IFDIR: DIR, stat.S_IFLNK: LINK, stat.S_IFREG: FILE}


@functools.lru_cache(maxsize=16)
def _pack(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


def _stamps_at(root_fd: int, names: Sequence[str],
               parts: Tuple[Tuple[str, bool, str], ...]) -> List[Optional[Tuple[int, int]]]:
    """`PosixStorage.stamps_many`'s loop (kept tight: it runs 60,000 times at a large startup)."""
    out: List[Optional[Tuple[int, int]]] = []
    pack = _pack(sum(3 if is_file else 2 for _, is_file, _ in parts)).pack
    kinds, ifmt, stat_at = _KINDS.get, stat.S_IFMT, os.stat
    for name in names:
        values: List[int] = []
        newest = 0
        try:
            for suffix, is_file, kind in parts:
                st = stat_at(name + suffix, dir_fd=root_fd, follow_symlinks=False)
                if kinds(ifmt(st.st_mode)) is not kind:
                    break
                mtime = st.st_mtime_ns
                values += (st.st_ino, st.st_size, mtime) if is_file else (st.st_ino, mtime)
                if mtime > newest:
                    newest = mtime
            else:
                out.append((checksum_int(pack(*values)), newest))
                continue
        except (OSError, ValueError, struct.error):
            pass
        out.append(None)
    return out


def _entry(key: str, name: str, st: os.stat_result) -> Entry:
    mode = st.st_mode
    kind = _KINDS.get(stat.S_IFMT(mode), OTHER)
    what = ""
    if kind is not DIR and kind is not LINK and name.startswith(TMP_PREFIX):
        kind = TEMPORARY
    elif kind is LINK:
        what = LINK_WHAT
    elif kind is OTHER:
        what = describe_mode(mode)
    size = st.st_size
    return Entry(key, kind, size, f"{st.st_ino}:{st.st_mtime_ns}:{size}", st.st_mtime_ns, st.st_atime_ns, what)


class PosixStorage(Storage):
    """A namespace directory `root`. `drop_written_pages`: where a payload is written through the page
    cache (a file system without O_DIRECT), let the kernel drop its pages once it is durable."""

    caps = Capabilities(mmap=True, access_times=True, append=True, atomic_rename=True, directories=True)

    def __init__(self, root: os.PathLike | str, *, drop_written_pages: bool = True):
        self.root = Path(root)
        self.url = str(self.root)
        self._prefix = self.url.rstrip("/") + "/"
        self.drop_written_pages = drop_written_pages

    def __repr__(self) -> str:
        return f"PosixStorage({self.url!r})"

    def path(self, key: str) -> Path:
        return self.root / key if key else self.root

    # ---- fd-relative walking (never through a link)

    def _open_root(self, create: bool) -> Optional[int]:
        try:
            return os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                return None
        os.makedirs(self.root, exist_ok=True)   # only when missing: three calls more on every write otherwise
        return os.open(self.root, _DIR_FLAGS)

    def _open_parent(self, key: str, create: bool, replace: bool = True) -> Tuple[int, str]:
        """(fd of the directory holding `key`, its last component), every directory on the way a real
        directory (created when `create`; a link or file in a directory's place removed when creating
        and `replace`, else CorruptStepError -- OSError when creating without `replace`).
        FileNotFoundError when the root or a directory on the way is missing."""
        parts = [part for part in key.split("/") if part and part != "."]   # PurePosixPath(key).parts, cheaper
        fd = self._open_root(create)
        if fd is None:
            raise FileNotFoundError(str(self.root))
        try:
            for depth, part in enumerate(parts[:-1]):
                try:
                    sub, created = open_dir_at(part, fd, create=create)
                except NotARealDirectory as exc:
                    path = self.root.joinpath(*parts[:depth + 1])     # for the message: made only here
                    if create and not replace:
                        raise OSError(f"{path} is not a real directory; refusing to move anything into it") from None
                    if not create:
                        raise CorruptStepError(path, f"directory {exc.what}") from None
                    remove_entry_at(fd, part, path.parent)
                    sub, created = open_dir_at(part, fd, create=True)
                if created:
                    fsync_dir(fd)
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def _open_file(self, key: str, size: Optional[int]) -> int:
        """An fd of the regular file at `key`, reached fd by fd without following a link, of `size`
        bytes when given (checked before anything is read: never a buffer for a wrong size)."""
        path = self.path(key)
        dir_fd, name = self._parent_for_read(key, path)
        try:
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                raise _unreadable(path, exc) from None
        finally:
            os.close(dir_fd)
        try:
            _check_file(path, os.fstat(fd), size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _parent_for_read(self, key: str, path: Path) -> Tuple[int, str]:
        try:
            return self._open_parent(key, create=False)
        except FileNotFoundError:
            raise CorruptStepError(path, "missing") from None

    # ---- reading

    def get(self, key: str) -> Optional[bytes]:
        return self.get_stamped(key)[0]

    def get_stamped(self, key: str) -> Tuple[Optional[bytes], Optional[str]]:
        try:
            dir_fd, name = self._open_parent(key, create=False)
        except FileNotFoundError:
            return None, None
        try:
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                return None, None
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a symlink, never followed
                    raise CorruptStepError(self.path(key), "is a symlink (never followed)") from None
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptStepError(self.path(key), "is not a regular file")
                with open(fd, "rb", closefd=False) as f:
                    data = f.read()
                return data, stamp_of(os.fstat(fd))
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)

    def get_verified(self, key: str, size: int, checksum: str, pool: BufferPool) -> Lease:
        path = self.path(key)
        dir_fd, name = self._parent_for_read(key, path)
        try:   # one open (O_DIRECT: a hit's file is not in the page cache) checks the file, then reads it
            lease, got = read_into(name, pool, dir_fd=dir_fd, check=lambda st: _check_file(path, st, size))
        except OSError as exc:
            raise _unreadable(path, exc) from None
        finally:
            os.close(dir_fd)
        return check_read(path, lease, got, size, checksum)

    def map_verified(self, key: str, size: int, checksum: str) -> Any:
        fd = self._open_file(key, size)
        path = self.path(key)
        try:
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise CorruptStepError(path, f"cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        digest = checksum_bytes(mapped)
        if digest != checksum:
            mapped.close()
            raise CorruptStepError(path, f"checksum {digest} does not match the commit record's {checksum}")
        return mapped

    def map(self, key: str) -> Tuple[Any, int]:
        fd = self._open_file(key, None)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return bytearray(0), 0
            return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE), size
        except OSError as exc:
            raise CorruptStepError(self.path(key), f"cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def stat(self, key: str) -> Optional[Entry]:
        try:
            st = os.stat(self._prefix + key if key else self.url, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return _entry(key, key.rpartition("/")[2], st)

    def stamps(self, keys: Sequence[str], kinds: Sequence[str]) -> Optional[Tuple[int, int]]:
        """inode + mtime (+ size for a file) of each entry, stat'ed relative to the namespace directory
        (never through a link at the last component), packed and hashed: no Entry made. The same values
        in the same order as the index has always hashed, so an index written before stays valid."""
        return self.stamps_many([""], keys, kinds)[0]

    def stamps_many(self, names: Sequence[str], suffixes: Sequence[str],
                    kinds: Sequence[str]) -> List[Optional[Tuple[int, int]]]:
        """`stamps` of each group, the namespace directory opened once for all of them: a startup scan
        checks 60,000 entries (10,000 steps x K = 4), and an open and a close a step were a third of it."""
        try:
            root_fd = os.open(self.root, _DIR_FLAGS)
        except OSError:
            return [None] * len(names)
        try:
            return _stamps_at(root_fd, names, tuple(zip(suffixes, [kind is FILE for kind in kinds], kinds)))
        finally:
            os.close(root_fd)

    def list(self, prefix: str = "") -> Iterator[Entry]:
        top = prefix.rstrip("/")
        if top:
            own = self.stat(top)
            if own is None:
                return
            if own.kind != DIR:
                yield own
                return
        stack = [(prefix if not top else top + "/", self._prefix + top if top else self.url)]
        while stack:
            rel_prefix, d = stack.pop()
            try:
                it = os.scandir(d)
            except FileNotFoundError:
                continue
            with it:
                for e in it:
                    name = e.name
                    if e.is_dir(follow_symlinks=False):
                        stack.append((rel_prefix + name + "/", e.path))
                        continue
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and not name.startswith(TMP_PREFIX):   # the common case, inline
                        size = st.st_size
                        yield Entry(rel_prefix + name, FILE, size, f"{st.st_ino}:{st.st_mtime_ns}:{size}",
                                    st.st_mtime_ns, st.st_atime_ns, "")
                    else:
                        yield _entry(rel_prefix + name, name, st)

    def list_dir(self, prefix: str = "") -> List[Entry]:
        top = prefix.rstrip("/")
        try:
            it = os.scandir(self._prefix + top if top else self.url)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        base = top + "/" if top else ""
        with it:
            for e in it:
                if e.is_dir(follow_symlinks=False):      # the directory's type from the listing: no stat
                    out.append(Entry(base + e.name, DIR))
                else:
                    out.append(_entry(base + e.name, e.name, e.stat(follow_symlinks=False)))
        return out

    # ---- writing

    def put(self, key: str, data: Any, nbytes: Optional[int] = None) -> int:
        return self.put_all([(key, data, nbytes)])[0]

    def put_all(self, files: Sequence[Tuple[str, Any, Optional[int]]]) -> List[int]:
        """Each file, in the order given, renamed into place after its own fsync; each directory fsynced
        once, after the last of them (a mini-batch's payload and meta.json: one directory fsync, not two)."""
        dirs: Dict[str, int] = {}           # parent key -> its open fd, in the order first used
        try:
            placed = []
            for key, data, nbytes in files:
                parent = key.rpartition("/")[0]
                if parent not in dirs:
                    dirs[parent] = self._open_parent(key, create=True)[0]
                name = PurePosixPath(key).name
                self._put_at(dirs[parent], name, data, nbytes)
                placed.append((dirs[parent], name))
            for dir_fd in dirs.values():
                fsync_dir(dir_fd)
            return [os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size for dir_fd, name in placed]
        finally:
            for dir_fd in dirs.values():
                os.close(dir_fd)

    def _put_at(self, dir_fd: int, name: str, data: Any, nbytes: Optional[int]) -> None:
        if isinstance(data, Lease):         # a pool buffer: O_DIRECT, past the page cache
            write_buffer_at(dir_fd, name, data, memoryview(data.array).nbytes if nbytes is None else nbytes,
                            self.drop_written_pages, sync_dir=False)
        else:
            view = memoryview(data).cast("B")
            if nbytes is not None:
                view = view[:nbytes]
            write_file_at(dir_fd, name, lambda f: f.write(view), sync_dir=False)

    def put_if_absent(self, key: str, data: Any) -> Optional[str]:
        dir_fd, name = self._open_parent(key, create=True)
        try:
            try:
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                return None
            except FileNotFoundError:
                pass
            write_file_at(dir_fd, name, lambda f: f.write(data))
            return stamp_of(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        finally:
            os.close(dir_fd)

    def append(self, key: str, data: bytes) -> int:
        dir_fd, name = self._open_parent(key, create=True)
        try:
            fd = os.open(name, _APPEND_FLAGS, 0o644, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            before = os.fstat(fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            return before        # not fsync'ed: see Storage.append
        finally:
            os.close(fd)

    def delete(self, key: str) -> int:
        try:
            dir_fd, name = self._open_parent(key, create=False)
        except (FileNotFoundError, CorruptStepError):
            return 0
        try:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory", str(self.path(key)))
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                return 0
            fsync_dir(dir_fd)
            return st.st_size
        finally:
            os.close(dir_fd)

    def delete_prefix(self, prefix: str) -> int:
        """A directory is renamed to a '.trash-' name first (one atomic step: the prefix is gone), then
        removed without following a link inside; a link or file in its place is unlinked."""
        top = prefix.rstrip("/")
        if not top:
            raise ValueError("delete_prefix: refusing to remove the whole namespace")
        try:
            dir_fd, name = self._open_parent(top, create=False)
        except (FileNotFoundError, CorruptStepError):
            return 0
        try:
            return remove_entry_at(dir_fd, name, self.path(top).parent)
        finally:
            os.close(dir_fd)

    def move(self, src_prefix: str, dst_prefix: str) -> None:
        src, dst = src_prefix.rstrip("/"), dst_prefix.rstrip("/")
        src_fd, src_name = self._open_parent(src, create=False)
        try:
            dst_fd, dst_name = self._open_parent(dst, create=True, replace=False)
            try:
                os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                fsync_dir(src_fd)
                fsync_dir(dst_fd)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)

    def copy(self, src: str, dst: str) -> None:
        fd = self._open_file(src, None)
        try:
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
        finally:
            os.close(fd)
        self.put(dst, data)



def _check_file(path: Path, st: os.stat_result, size: Optional[int]) -> None:
    """CorruptStepError unless `st` is a regular file of `size` bytes (any size when None)."""
    if not stat.S_ISREG(st.st_mode):
        raise CorruptStepError(path, f"{describe_mode(st.st_mode)}; expected a regular file")
    if size is not None and st.st_size != size:
        raise CorruptStepError(path, f"{st.st_size} bytes, the commit record says {size}")


def _unreadable(path: Path, exc: OSError) -> CorruptStepError:
    """A file a verified read could not open or read, as the CorruptStepError naming it."""
    if isinstance(exc, FileNotFoundError):
        return CorruptStepError(path, "missing")
    if exc.errno == errno.ELOOP:
        return CorruptStepError(path, "is a symlink (never followed); expected a regular file")
    return CorruptStepError(path, f"cannot be read: {exc.strerror or exc}")


__all__ = ["PosixStorage", "stamp_of"]
