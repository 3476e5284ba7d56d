"""The local POSIX backend behind `store.backend`: a namespace is a directory.

Every measured trick of the POSIX cache stays here and in its helpers (`fileops`, `directio`):
payloads written with O_DIRECT from reused, page-aligned pool buffers (the page cache where a file
system refuses it, its pages dropped once durable); a unique temporary name + fsync + rename +
directory fsync for every file; fd-relative walking that never follows a link (a step or inner
directory that is a symlink is never entered); inode + mtime + size as the change stamp the index
keeps; the namespace lock a `filelock` file whose holder record names pid and host.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import time
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional, Tuple

from skip_harness.errors import CorruptStepError
from skip_harness.store import lock as _lock
from skip_harness.store.backend import (
    COMMIT_NAME, LINK, NOT_A_DIRECTORY, DumpDir, Hold, NamespaceBackend, NamespaceListing, StepListing, StoredFile,
)
from skip_harness.store.bufferpool import BufferPool, Lease
from skip_harness.store.layout import TMP_PREFIX, TRASH_PREFIX, Layout, parse_namespace_leaf, parse_step_name
from skip_harness.store.posix.directio import read_into, write_buffer_at
from skip_harness.store.posix.fileops import (
    READ_FLAGS, NotARealDirectory, checksum_bytes, describe_mode, fsync_dir, open_dir_at, remove_entry_at,
    write_file_at,
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


def stamp_of(st: os.stat_result) -> str:
    """The change stamp of a file: equal stamps, same file and bytes (a rewrite is a new inode)."""
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


class _FileHold(Hold):
    def __init__(self, lock: Optional[_lock.NamespaceLock], read_only: bool = False, why: str = ""):
        self._lock = lock
        self.read_only = read_only
        self.why = why

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(all_levels=True)


class PosixNamespace(NamespaceBackend):
    """A namespace directory on a local (or shared POSIX) file system."""

    def __init__(self, layout: Layout, *, drop_written_pages: bool = True):
        self.layout = layout
        self.root = Path(layout.root)
        self.url = str(self.root)
        self.drop_written_pages = drop_written_pages

    # ---- fd-relative walking (never through a link)

    def _open_root(self, create: bool) -> Optional[int]:
        if create:
            os.makedirs(self.root, exist_ok=True)
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None

    def _open_parent(self, key: str, create: bool) -> Tuple[int, str]:
        """(fd of the directory holding `key`, its last component), every directory on the way a real
        directory (created when `create`; a link or file in a directory's place removed when creating,
        else CorruptStepError)."""
        parts = PurePosixPath(key).parts
        fd = self._open_root(create)
        if fd is None:
            raise FileNotFoundError(str(self.root))
        path = self.root
        try:
            for part in parts[:-1]:
                path = path / part
                try:
                    sub, created = open_dir_at(part, fd, create=create)
                except NotARealDirectory as exc:
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

    # ---- writing

    def write_payload(self, step: int, rel: str, buffer: Any, nbytes: int) -> int:
        dir_fd, name = self._open_parent(f"{int(step)}/{rel}", create=True)
        try:
            write_buffer_at(dir_fd, name, buffer, nbytes, self.drop_written_pages)
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
        finally:
            os.close(dir_fd)

    def write_small(self, key: str, data: bytes) -> None:
        dir_fd, name = self._open_parent(key, create=True)
        try:
            write_file_at(dir_fd, name, lambda f: f.write(data))
        finally:
            os.close(dir_fd)

    def commit(self, step: int, record: bytes) -> None:
        dir_fd, name = self._open_parent(f"{int(step)}/{COMMIT_NAME}", create=False)
        try:
            if _lstat_at(name, dir_fd) is not None:
                raise CorruptStepError(self.root / str(step) / name, "a commit record is there already")
            write_file_at(dir_fd, name, lambda f: f.write(record))
        finally:
            os.close(dir_fd)

    def uncommit(self, step: int) -> None:
        root_fd = self._open_root(create=False)
        if root_fd is None:
            return
        try:
            try:
                step_fd, _ = open_dir_at(str(int(step)), root_fd, create=False)
            except (FileNotFoundError, NotARealDirectory):
                return                    # no step, or a link / file in its place: the writes replace it
        finally:
            os.close(root_fd)
        try:
            if _lstat_at(COMMIT_NAME, step_fd) is not None:
                os.unlink(COMMIT_NAME, dir_fd=step_fd)
                fsync_dir(step_fd)
        finally:
            os.close(step_fd)

    def remove_step(self, step: int) -> int:
        root_fd = self._open_root(create=False)
        if root_fd is None:
            return 0
        try:
            return remove_entry_at(root_fd, str(int(step)), self.root)
        finally:
            os.close(root_fd)

    def set_aside(self, step: int, reason: str = "") -> str:
        """Move the step entry (directory, file or link: never followed) under {namespace}/.quarantine/
        with one rename (the commit record goes with it, atomically); `reason` is for the object store's
        name, the POSIX name is `{step}-{time}-{random}`."""
        qdir = self.layout.quarantine_dir
        try:
            os.mkdir(qdir)
        except FileExistsError:
            pass
        st = os.lstat(qdir)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{qdir} is not a real directory; refusing to move anything into it")
        when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        src = self.layout.step_dir(int(step))
        dst = qdir / f"{src.name}-{when}-{secrets.token_hex(3)}"
        os.rename(src, dst)
        for d in (self.root, qdir):
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return str(dst)

    # ---- reading

    def list_step(self, step: int) -> Optional[StepListing]:
        path = self.root / str(int(step))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return StepListing(int(step), entry=LINK if stat.S_ISLNK(st.st_mode) else NOT_A_DIRECTORY,
                               total=st.st_size)
        return _list_step(int(step), str(path))

    def list_steps(self) -> NamespaceListing:
        steps: List[StepListing] = []
        leftovers: List[Tuple[str, str]] = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return NamespaceListing()
        found: List[Tuple[int, Any]] = []
        for e in entries:
            step = parse_step_name(e.name)
            if step is None:
                if e.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    leftovers.append((e.name, "leftover of an interrupted write or removal"))
                continue
            found.append((step, e))
        for step, e in sorted(found, key=lambda x: x[0]):
            if e.is_dir(follow_symlinks=False):
                steps.append(_list_step(step, e.path))
            else:
                st = e.stat(follow_symlinks=False)
                steps.append(StepListing(step, entry=LINK if stat.S_ISLNK(st.st_mode) else NOT_A_DIRECTORY,
                                         total=st.st_size))
        return NamespaceListing(tuple(steps), tuple(sorted(leftovers)))

    def read_small(self, key: str) -> Optional[bytes]:
        try:
            dir_fd, name = self._open_parent(key, create=False)
        except FileNotFoundError:
            return None
        try:
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a symlink, never followed
                    raise CorruptStepError(self.root / key, "is a symlink (never followed)") from None
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise CorruptStepError(self.root / key, "is not a regular file")
                with open(fd, "rb", closefd=False) as f:
                    return f.read()
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)

    def _open_file(self, step: int, rel: str, size: int) -> Tuple[int, Path]:
        """(fd, path) of file `rel` of `step`, reached fd by fd without following a link, a regular
        file of `size` bytes (checked before anything is read: never a buffer for a wrong size)."""
        path = self.root / str(int(step)) / rel
        try:
            dir_fd, name = self._open_parent(f"{int(step)}/{rel}", create=False)
        except FileNotFoundError:
            raise CorruptStepError(path, "missing") from None
        try:
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                raise CorruptStepError(path, "missing") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise CorruptStepError(path, "is a symlink (never followed); expected a regular file") from None
                raise CorruptStepError(path, f"cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)
        st = os.fstat(fd)
        reason = None
        if not stat.S_ISREG(st.st_mode):
            reason = f"{describe_mode(st.st_mode)}; expected a regular file"
        elif st.st_size != size:
            reason = f"{st.st_size} bytes, the commit record says {size}"
        if reason is not None:
            os.close(fd)
            raise CorruptStepError(path, reason)
        return fd, path

    def read_verified(self, step: int, rel: str, size: int, checksum: str, pool: BufferPool) -> Tuple[Lease, int]:
        fd, path = self._open_file(step, rel, size)
        os.close(fd)
        dir_fd, name = self._open_parent(f"{int(step)}/{rel}", create=False)
        try:
            lease, got = read_into(name, pool, dir_fd=dir_fd)    # O_DIRECT: a hit's file is not in the page cache
        except OSError as exc:
            raise CorruptStepError(path, f"cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)
        try:
            if got != size:
                raise CorruptStepError(path, f"{got} bytes, the commit record says {size}")
            digest = checksum_bytes(lease.view(got))
            if digest != checksum:
                raise CorruptStepError(path, f"checksum {digest} does not match the commit record's {checksum}")
        except BaseException:
            lease.release()
            raise
        return lease, got

    def map_verified(self, step: int, rel: str, size: int, checksum: str) -> Optional[Any]:
        if size == 0:
            return None
        fd, path = self._open_file(step, rel, size)
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

    # ---- the namespace

    def lock(self, timeout: float = 0.0) -> Hold:
        """The namespace's lock file (flock), the directory created if needed. A read-only mount or a
        directory this process may not write gives a read-only Hold; a `.lock` that is a link raises
        UnsafeLockFileError, a path that is not a directory an OSError."""
        lock = _lock.NamespaceLock(self.layout, timeout)
        try:
            lock.acquire()
        except _lock.ReadOnlyCache as exc:
            return _FileHold(None, read_only=True, why=exc.reason)
        except OSError as exc:
            if exc.errno in _lock.READ_ONLY_ERRNOS:
                return _FileHold(None, read_only=True, why=exc.strerror or str(exc))
            raise
        return _FileHold(lock)

    def holder(self) -> Optional[str]:
        return _lock.probe(self.layout) if os.path.isdir(self.root) else None

    def writable(self) -> Optional[str]:
        probe = self.root
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"{probe}: this process may not write here"
        return None

    def modified(self, key: str = "") -> Optional[float]:
        try:
            return os.lstat(self.root / key if key else self.root).st_mtime
        except OSError:
            return None

    def last_read(self, step: int, rels) -> Optional[float]:
        """The file system decides how exact an access time is: with `relatime` (Linux's default) a read
        is recorded when it is the first since the file was written or a day after the last recorded
        one; on a `noatime` mount nothing is."""
        times = []
        for rel in rels:
            try:
                st = os.lstat(self.root / str(int(step)) / rel)
            except OSError:
                continue
            if st.st_atime > st.st_mtime:
                times.append(st.st_atime)
        return max(times) if times else None

    def put_run_marker(self, token: str) -> None:
        _lock.write_run_marker(self.layout, token)

    def sees_run_marker(self, token: str, wait: float = 0.0) -> bool:
        return _lock.sees_run_marker(self.layout, token, wait)

    def remove_run_marker(self, token: str) -> None:
        _lock.remove_run_marker(self.layout, token)


def _lstat_at(name: str, dir_fd: int) -> Optional[os.stat_result]:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _list_step(step: int, step_path: str) -> StepListing:
    """One pass over a step directory (never into a link): files with sizes and stamps, temporaries,
    and odd entries."""
    files: Dict[str, StoredFile] = {}
    temps: List[str] = []
    odd: List[Tuple[str, str]] = []
    total = 0
    stack = [("", step_path)]
    while stack:
        prefix, d = stack.pop()
        with os.scandir(d) as it:
            for e in it:
                rel = prefix + e.name
                if e.is_dir(follow_symlinks=False):
                    stack.append((rel + "/", e.path))
                    continue
                st = e.stat(follow_symlinks=False)
                total += st.st_size
                if stat.S_ISLNK(st.st_mode):
                    odd.append((rel, LINK))
                elif e.name.startswith(TMP_PREFIX):
                    temps.append(rel)
                elif stat.S_ISREG(st.st_mode):
                    files[rel] = StoredFile(rel, st.st_size, stamp_of(st))
                else:
                    odd.append((rel, describe_mode(st.st_mode)))
    return StepListing(step, files, tuple(sorted(temps)), tuple(sorted(odd)), total=total)


class PosixDumpDir(DumpDir):
    """A local dump_dir: `{dump_dir}/{experiment}_{project}/{leaf}` directories."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = str(self.root)

    def namespace(self, rel: str) -> PosixNamespace:
        leaf = PurePosixPath(rel).name
        kw = parse_namespace_leaf(leaf)
        if kw is None:
            raise ValueError(f"{self.root / rel}: {leaf!r} is not a namespace name")
        return PosixNamespace(Layout(self.root / rel, K=kw[0], W=kw[1]))

    def list_namespaces(self) -> List[str]:
        out: List[str] = []
        try:
            groups = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for g in groups:
            if not g.is_dir(follow_symlinks=False) or g.name.startswith("."):
                continue
            try:
                leaves = list(os.scandir(g.path))
            except OSError:
                continue
            for leaf in leaves:
                if parse_namespace_leaf(leaf.name) is not None and leaf.is_dir(follow_symlinks=False):
                    out.append(f"{g.name}/{leaf.name}")
        return sorted(out)


__all__ = ["PosixDumpDir", "PosixNamespace", "stamp_of"]
