"""How a step's files are written and read safely.

Write protocol for one file (payload, meta.json, commit.json alike): write to a unique temporary name
('.tmp-' prefix) in the target directory, flush and fsync it, `os.replace` it into place, fsync the
directory. A step's commit record is written last, after every rank's payload and meta files are
durable; rewriting or removing a step unlinks the commit record first.

Every operation goes through directory file descriptors opened with O_NOFOLLOW, so a step or inner
directory that is a symlink is never entered: writing removes the link first, reading raises
CorruptStepError. Only this module, `scan`, `index` and `lock` touch cache files.

Status of a step (K and W come from the Layout), from directory listings and lstat plus the small
commit record (`classify_step`); checksums are read by `StepStore.verify_*` only:
- complete:   commit.json parses, its K/W match, it lists every needed file, and every file it lists is
              a regular file with the listed size;
- corrupt:    commit.json exists but does not parse / validate, or a listed file is missing or has
              another size;
- unverified: no commit.json, but each needed payload and meta file is there (for K = 1 the
              `{step}/0/` form counts too), no temporary files, and the files were not written by
              skip_harness itself (an older cache; our own uncommitted writes are interrupted ones);
- incomplete: anything else.

This module does no logging: it raises or returns, and the harness reports. `StepStore` holds no
mutable state, so a prefetch thread may read and verify steps while the writer writes others.
"""
from __future__ import annotations

import errno
import functools
import json
import mmap
import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import xxhash

from skip_harness import codec, index
from skip_harness.errors import CorruptStepError, HarnessUsageError
from skip_harness.fingerprint import Fingerprint
from skip_harness.layout import COMMIT_NAME, TMP_PREFIX, TRASH_PREFIX, Layout

STATUSES = ("complete", "unverified", "incomplete", "corrupt")
COMMIT_FORMAT = 1
WRITER_NAME = "skip_harness"      # meta.json "writer": tells our uncommitted writes from older caches
CHUNK_BYTES = 8 << 20             # read size when verifying checksums of small files
MAP_FROM = 1 << 20                # files from this size are hashed through a read-only mapping
WRITE_BUFFER_BYTES = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# --------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class FileEntry:
    """One file of a step: path relative to the step directory ('/'-separated), size, xxh3_128 hex."""

    rel: str
    bytes: int
    checksum: str

    def to_json(self) -> Dict[str, Any]:
        return {"rel": self.rel, "bytes": self.bytes, "checksum": self.checksum}


@dataclass(frozen=True)
class CommitRecord:
    step: int
    K: int
    W: int
    fingerprint: Optional[Fingerprint]
    files: Tuple[FileEntry, ...]
    created: float
    gen_s: Optional[float] = None      # seconds spent generating the step, when the writer knew it

    def to_json(self) -> Dict[str, Any]:
        doc = {
            "format": COMMIT_FORMAT,
            "step": self.step,
            "K": self.K,
            "W": self.W,
            "fingerprint": None if self.fingerprint is None else self.fingerprint.to_json(),
            "files": [f.to_json() for f in self.files],
            "created": self.created,
        }
        if self.gen_s is not None:
            doc["gen_s"] = self.gen_s
        return doc


def is_safe_rel(rel: str) -> bool:
    """A path inside a step directory: relative, at most two plain components, nothing hidden."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return len(parts) <= 2 and all(p and not p.startswith(".") for p in parts)


@functools.lru_cache(maxsize=64)
def _expected_rels(K: int, W: int) -> Tuple[Tuple[int, int, str, str], ...]:
    return tuple(Layout(Path("."), K=K, W=W).expected_rels())


def expected_rels(layout: Layout) -> Tuple[Tuple[int, int, str, str], ...]:
    """layout.expected_rels() for every rank, computed once per (K, W)."""
    return _expected_rels(layout.K, layout.W)


@functools.lru_cache(maxsize=64)
def _required_rels(K: int, W: int) -> Tuple[str, ...]:
    return tuple(rel for _i, _r, prel, mrel in _expected_rels(K, W) for rel in (prel, mrel))


def required_rels(layout: Layout) -> Tuple[str, ...]:
    """Every file a committed step must list: payload and meta of each inner index and rank."""
    return _required_rels(layout.K, layout.W)


def parse_commit(data: bytes, layout: Layout, step: int, path: Path) -> CommitRecord:
    """Parse and validate the bytes of a commit record; CorruptStepError(path, reason) if they are bad."""

    def bad(reason: str) -> CorruptStepError:
        return CorruptStepError(path, f"commit record {reason}")

    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"does not parse: {exc}") from None
    if not isinstance(doc, dict):
        raise bad("is not a JSON object")
    fmt = doc.get("format")
    if fmt != COMMIT_FORMAT:
        raise bad(f"has unsupported format {fmt!r} (this version reads {COMMIT_FORMAT})")
    for key in ("step", "K", "W"):
        if type(doc.get(key)) is not int:
            raise bad(f"has no valid {key!r}")
    if doc["step"] != step:
        raise bad(f"is for step {doc['step']}, found in step {step}'s directory")
    if doc["K"] != layout.K or doc["W"] != layout.W:
        raise bad(f"has K={doc['K']} W={doc['W']}, this namespace has K={layout.K} W={layout.W}")
    files_doc = doc.get("files")
    if not isinstance(files_doc, list):
        raise bad("has no file list")
    files: List[FileEntry] = []
    seen = set()
    required = required_rels(layout)
    required_set = frozenset(required)
    for f in files_doc:
        if not isinstance(f, dict):
            raise bad("has a malformed file entry")
        rel, size, checksum = f.get("rel"), f.get("bytes"), f.get("checksum")
        if rel not in required_set and not is_safe_rel(rel):
            raise bad(f"lists an unsafe path {rel!r}")
        if type(size) is not int or size < 0 or not isinstance(checksum, str) or not checksum:
            raise bad(f"has a malformed entry for {rel}")
        if rel in seen:
            raise bad(f"lists {rel} twice")
        seen.add(rel)
        files.append(FileEntry(rel, size, checksum))
    for rel in required:
        if rel not in seen:
            raise bad(f"does not list {rel}")
    fp_doc = doc.get("fingerprint")
    if fp_doc is None:
        fingerprint = None
    elif isinstance(fp_doc, dict) and isinstance(fp_doc.get("values", {}), dict):
        fingerprint = Fingerprint.from_json(fp_doc)
    else:
        raise bad("has a malformed fingerprint")
    created = doc.get("created", 0.0)
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise bad("has a malformed creation time")
    gen_s = doc.get("gen_s")
    if gen_s is not None and (not isinstance(gen_s, (int, float)) or isinstance(gen_s, bool)):
        raise bad("has a malformed gen_s")
    return CommitRecord(step, doc["K"], doc["W"], fingerprint, tuple(files), float(created),
                        None if gen_s is None else float(gen_s))


# --------------------------------------------------------------------------------------------
# checksums


def checksum_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


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
    fd = os.open(path, _READ_FLAGS)
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


class _NotARealDirectory(Exception):
    def __init__(self, name: str, what: str):
        self.name = name
        self.what = what
        super().__init__(f"{name} {what}")


def _describe_mode(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "is a symlink (never followed)"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISREG(mode):
        return "is a regular file, not a directory"
    return "is not a regular file or directory"


def _lstat_at(name: str, dir_fd: int) -> Optional[os.stat_result]:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open_dir_at(name: str, dir_fd: Optional[int], create: bool) -> Tuple[int, bool]:
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
            raise _NotARealDirectory(name, _describe_mode(st.st_mode)) from None
        raise


def _fsync_dir(fd: int) -> None:
    os.fsync(fd)


def _tmp_name(final_name: str) -> str:
    return f"{TMP_PREFIX}{final_name}.{os.getpid()}.{secrets.token_hex(4)}"


def write_file_at(dir_fd: int, name: str, write: Callable[[Any], None]) -> Tuple[int, str]:
    """Atomically and durably create `name` in the directory dir_fd: temp file, `write(fileobj)`,
    flush + fsync, rename into place, fsync the directory. Returns (bytes, xxh3_128 hex).
    On any failure before the rename the temp file is removed and the exception propagates."""
    return _StagedFile(dir_fd, name, write).finish()


def _drop_cached_pages(fd: int) -> None:
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


class _StagedFile:
    """A file written under a temporary name in dir_fd (into the page cache: the bytes are copied out of
    the caller's objects), and made durable and renamed into place by `finish()` -- possibly on another
    thread. `discard()` removes the temporary file. Any failure removes it too and propagates."""

    def __init__(self, dir_fd: int, name: str, write: Callable[[Any], None], drop_cache: bool = False):
        self.dir_fd, self.name, self.tmp = dir_fd, name, _tmp_name(name)
        self.drop_cache = drop_cache
        fd = os.open(self.tmp, _CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        self._file = None
        try:
            self._file = open(fd, "wb", buffering=WRITE_BUFFER_BYTES, closefd=True)
            hw = HashingWriter(self._file)
            write(hw)
            self._file.flush()
        except BaseException:
            if self._file is None:
                os.close(fd)
            self.discard()
            raise
        self.bytes, self.checksum = hw.bytes, hw.hexdigest()

    def finish(self) -> Tuple[int, str]:
        try:
            os.fsync(self._file.fileno())
            if self.drop_cache:
                _drop_cached_pages(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            self.discard()
            raise
        _fsync_dir(self.dir_fd)
        return self.bytes, self.checksum

    def discard(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        try:
            os.unlink(self.tmp, dir_fd=self.dir_fd)
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
    st = _lstat_at(name, root_fd)
    if st is None:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=root_fd)
        _fsync_dir(root_fd)
        return st.st_size
    freed = tree_bytes(str(root_path / name))
    if not name.startswith(TRASH_PREFIX):
        try:
            step_fd, _ = _open_dir_at(name, root_fd, create=False)
        except _NotARealDirectory:  # replaced under us: remove whatever it is now as an entry
            return remove_entry_at(root_fd, name, root_path)
        try:
            try:
                os.unlink(COMMIT_NAME, dir_fd=step_fd)
                _fsync_dir(step_fd)
            except (FileNotFoundError, IsADirectoryError):
                pass
        finally:
            os.close(step_fd)
        trash = f"{TRASH_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(3)}"
        os.rename(name, trash, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        _fsync_dir(root_fd)
        name = trash
    try:
        shutil.rmtree(name, dir_fd=root_fd)
    except OSError:
        pass  # the '.trash-' entry left is reported by the next scan as a leftover, and removed by cleanup
    return freed


# --------------------------------------------------------------------------------------------
# status of a step


def _check_step(step: Any) -> None:
    """Steps are ints >= 0 (the harness turns a trainer's integral step into an int first)."""
    if type(step) is not int or step < 0:
        raise HarnessUsageError(f"step must be an int >= 0, got {step!r}")


@dataclass(frozen=True)
class StepReport:
    step: int
    path: Path
    status: str          # one of STATUSES
    bytes: int
    reason: str
    fingerprint: Optional[Fingerprint]
    has_commit: bool
    exists: bool = True
    created: Optional[float] = None      # the commit record's time
    gen_s: Optional[float] = None        # generation seconds, when the commit record has them

    @property
    def servable(self) -> bool:
        return self.status in ("complete", "unverified")


class _Listing:
    __slots__ = ("files", "links", "temps", "others", "total")

    def __init__(self) -> None:
        self.files: Dict[str, int] = {}   # rel -> size of regular files (temps excluded)
        self.links: List[str] = []
        self.temps: List[str] = []
        self.others: List[str] = []
        self.total = 0


def _list_step(step_path: str) -> _Listing:
    out = _Listing()
    stack = [("", step_path)]
    while stack:
        prefix, d = stack.pop()
        with os.scandir(d) as it:
            for e in it:
                rel = prefix + e.name
                if e.is_dir(follow_symlinks=False):   # from d_type: no system call
                    stack.append((rel + "/", e.path))
                    continue
                st = e.stat(follow_symlinks=False)
                mode = st.st_mode
                out.total += st.st_size
                if stat.S_ISLNK(mode):
                    out.links.append(rel)
                elif e.name.startswith(TMP_PREFIX):
                    out.temps.append(rel)
                elif stat.S_ISREG(mode):
                    out.files[rel] = st.st_size
                else:
                    out.others.append(rel)
    return out


def _first(items: List[str]) -> str:
    items = sorted(items)
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return items[0] + more


def classify_step(layout: Layout, step: int, path: Optional[Path] = None) -> StepReport:
    """The status of one step, from directory listings and lstat (plus its small commit record)."""
    path = layout.step_dir(step) if path is None else path
    spath = str(path)

    def report(status: str, nbytes: int, reason: str, fp: Optional[Fingerprint] = None,
               has_commit: bool = False, exists: bool = True, record: Optional[CommitRecord] = None) -> StepReport:
        created = gen_s = None
        if record is not None:
            created, gen_s = record.created, record.gen_s
        return StepReport(step, path, status, nbytes, reason, fp, has_commit, exists, created, gen_s)

    try:
        st = os.lstat(spath)
    except FileNotFoundError:
        return report("incomplete", 0, "step directory does not exist", exists=False)
    if stat.S_ISLNK(st.st_mode):
        return report("incomplete", st.st_size, "step directory is a symlink (never followed)")
    if not stat.S_ISDIR(st.st_mode):
        return report("incomplete", st.st_size, "step entry is not a directory")
    try:
        listing = _list_step(spath)
    except OSError as exc:
        return report("incomplete", 0, f"cannot list the step directory: {exc}")
    nbytes = listing.total
    has_commit = COMMIT_NAME in listing.files or COMMIT_NAME in listing.links or COMMIT_NAME in listing.others
    if listing.links:
        return report("incomplete", nbytes, f"{_first(listing.links)} is a symlink (never followed)",
                      has_commit=has_commit)
    if has_commit:
        if COMMIT_NAME not in listing.files:
            return report("corrupt", nbytes, "commit record is not a regular file", has_commit=True)
        commit_path = os.path.join(spath, COMMIT_NAME)
        try:
            with open(commit_path, "rb") as f:
                record = parse_commit(f.read(), layout, step, commit_path)
        except CorruptStepError as exc:
            return report("corrupt", nbytes, exc.reason, has_commit=True)
        except OSError as exc:
            return report("corrupt", nbytes, f"commit record cannot be read: {exc}", has_commit=True)
        for entry in record.files:
            size = listing.files.get(entry.rel)
            if size is None:
                return report("corrupt", nbytes, f"{entry.rel} (listed in the commit record) is missing",
                              record.fingerprint, True, record=record)
            if size != entry.bytes:
                return report("corrupt", nbytes,
                              f"{entry.rel} has {size} bytes, the commit record says {entry.bytes}",
                              record.fingerprint, True, record=record)
        return report("complete", nbytes, "", record.fingerprint, True, record=record)

    if listing.temps:
        return report("incomplete", nbytes, f"temporary file {_first(listing.temps)} (an interrupted write)")
    files = listing.files
    missing: List[str] = []
    empty: List[str] = []
    metas: List[str] = []
    for _i, r, prel, mrel in expected_rels(layout):
        if prel not in files and layout.K == 1:
            legacy_p, legacy_m = layout.legacy_k1_rel(r)
            if legacy_p in files:
                prel, mrel = legacy_p, legacy_m
        for rel in (prel, mrel):
            if rel not in files:
                missing.append(rel)
        if files.get(prel) == 0:
            empty.append(prel)
        metas.append(mrel)
    if missing:
        return report("incomplete", nbytes, f"missing {_first(missing)}")
    if empty:
        return report("incomplete", nbytes, f"{_first(empty)} is empty")
    if _written_by_us(os.path.join(spath, metas[0])):
        return report("incomplete", nbytes,
                      "no commit record: written by skip_harness, interrupted before the step was committed")
    return report("unverified", nbytes, "no commit record (an older cache); served without checksums")


def _written_by_us(meta_path: str) -> bool:
    try:
        fd = os.open(meta_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        with open(fd, "rb", closefd=False) as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    finally:
        os.close(fd)
    return isinstance(doc, dict) and doc.get("writer") == WRITER_NAME


# --------------------------------------------------------------------------------------------
# the store


class StagedInner:
    """A payload written to its temporary file by `StepStore.stage_inner`; `complete()` makes it durable
    and writes its meta.json (returning the two FileEntry), `discard()` abandons it. Exactly one of them,
    once, from any thread."""

    def __init__(self, dir_fd: int, staged: _StagedFile, payload_rel: str, meta_rel: str, meta: Dict[str, Any]):
        self._dir_fd: Optional[int] = dir_fd
        self._staged = staged
        self.payload_rel, self.meta_rel = payload_rel, meta_rel
        self._meta = meta
        self.bytes = staged.bytes

    def complete(self) -> Tuple[FileEntry, FileEntry]:
        dir_fd = self._take()
        try:
            size, checksum = self._staged.finish()
            meta_doc = dict(self._meta, bytes=size, checksum=checksum, created=time.time())
            meta_bytes = (json.dumps(meta_doc, indent=1) + "\n").encode()
            meta_size, meta_checksum = write_file_at(dir_fd, PurePosixPath(self.meta_rel).name,
                                                     lambda f: f.write(meta_bytes))
        finally:
            os.close(dir_fd)
        return FileEntry(self.payload_rel, size, checksum), FileEntry(self.meta_rel, meta_size, meta_checksum)

    def discard(self) -> None:
        dir_fd = self._take()
        try:
            self._staged.discard()
        finally:
            os.close(dir_fd)

    def _take(self) -> int:
        dir_fd, self._dir_fd = self._dir_fd, None
        if dir_fd is None:
            raise HarnessUsageError(f"{self.payload_rel}: this staged write was already completed or discarded")
        return dir_fd


class StepStore:
    """Atomic, durable writes and verified reads of the steps of one namespace."""

    def __init__(self, layout: Layout, *, drop_written_pages: bool = True):
        """`drop_written_pages`: once a payload file is durable, let the kernel drop it from the page
        cache (the next write reuses those pages; a re-read in the same run then comes from the disk)."""
        self.layout = layout
        self.drop_written_pages = drop_written_pages

    # ---- helpers

    def _check_position(self, step: int, inner_index: int, rank: int) -> None:
        _check_step(step)
        if not 0 <= inner_index < self.layout.K:
            raise HarnessUsageError(f"inner index {inner_index} is outside 0..{self.layout.K - 1} (K={self.layout.K})")
        if not 0 <= rank < self.layout.W:
            raise HarnessUsageError(f"rank {rank} is outside 0..{self.layout.W - 1} (W={self.layout.W})")

    def _step_name(self, step: int) -> str:
        return self.layout.step_dir(step).name

    def _open_root(self, create: bool) -> Optional[int]:
        root = self.layout.root
        if create:
            os.makedirs(root, exist_ok=True)
        try:
            return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None

    def _open_step(self, root_fd: int, step: int, create: bool) -> Tuple[int, bool]:
        try:
            return _open_dir_at(self._step_name(step), root_fd, create=create)
        except _NotARealDirectory as exc:
            raise CorruptStepError(self.layout.step_dir(step), f"step directory {exc.what}") from None
        except FileNotFoundError:
            raise CorruptStepError(self.layout.step_dir(step), "step directory does not exist") from None

    def _real_file(self, step: int, rel: str) -> Path:
        """The path of step/rel after checking that no component is a symlink and it is a regular file."""
        step_dir = self.layout.step_dir(step)
        path = step_dir
        parts = PurePosixPath(rel).parts
        try:
            st = os.lstat(step_dir)
            if not stat.S_ISDIR(st.st_mode):
                raise CorruptStepError(step_dir, f"step directory {_describe_mode(st.st_mode)}")
            for i, part in enumerate(parts):
                path = path / part
                st = os.lstat(path)
                last = i == len(parts) - 1
                if not last and not stat.S_ISDIR(st.st_mode):
                    raise CorruptStepError(path, f"inner directory {_describe_mode(st.st_mode)}")
                if last and not stat.S_ISREG(st.st_mode):
                    raise CorruptStepError(path, f"{_describe_mode(st.st_mode)}; expected a regular file")
        except FileNotFoundError:
            raise CorruptStepError(path, "missing") from None
        return path

    def _existing_rel(self, step: int, rel: str, legacy_rel: str) -> str:
        """`rel`, or for K = 1 the older `0/` form `legacy_rel` when that is what exists."""
        if self.layout.K == 1 and not os.path.lexists(self.layout.step_dir(step) / rel):
            if os.path.lexists(self.layout.step_dir(step) / legacy_rel):
                return legacy_rel
        return rel

    def _payload_rel(self, step: int, inner_index: int, rank: int) -> str:
        return self._existing_rel(step, self.layout.payload_rel(inner_index, rank), self.layout.legacy_k1_rel(rank)[0])

    def _meta_rel(self, step: int, inner_index: int, rank: int) -> str:
        return self._existing_rel(step, self.layout.meta_rel(inner_index, rank), self.layout.legacy_k1_rel(rank)[1])

    # ---- writing

    def write_inner(self, step: int, inner_index: int, rank: int, payload: Any,
                    meta: Mapping[str, Any]) -> Tuple[FileEntry, FileEntry]:
        """Write the payload of (step, inner_index, rank), then its meta.json, each atomically and
        durably. Removes the step's commit record first if there is one (the step is being rewritten).
        A step entry that is a symlink or a file is removed first (never followed); so is an inner
        directory entry that is one. Returns (payload entry, meta entry)."""
        return self.stage_inner(step, inner_index, rank, payload, meta).complete()

    def stage_inner(self, step: int, inner_index: int, rank: int, payload: Any,
                    meta: Mapping[str, Any]) -> "StagedInner":
        """The first half of `write_inner`, for the caller's thread: prepares the step's directories
        (removing its commit record) and writes the payload's bytes to a temporary file -- the one copy
        of the payload a write needs, after which the caller may change the payload in place. The
        returned StagedInner's `complete()` (fsync, rename, meta.json; for a writer thread) or
        `discard()` must follow. Raises what encoding or writing raises, leaving no temporary file."""
        self._check_position(step, inner_index, rank)
        layout = self.layout
        step_name = self._step_name(step)
        root_fd = self._open_root(create=True)
        try:
            try:
                step_fd, created = _open_dir_at(step_name, root_fd, create=True)
            except _NotARealDirectory:
                remove_entry_at(root_fd, step_name, layout.root)
                step_fd, created = _open_dir_at(step_name, root_fd, create=True)
            if created:
                _fsync_dir(root_fd)
        finally:
            os.close(root_fd)
        inner_fd = step_fd
        try:
            if _lstat_at(COMMIT_NAME, step_fd) is not None:
                os.unlink(COMMIT_NAME, dir_fd=step_fd)
                _fsync_dir(step_fd)
            inner_rel = layout.inner_rel(inner_index)
            if str(inner_rel) != ".":
                inner_name = inner_rel.name
                try:
                    inner_fd, created = _open_dir_at(inner_name, step_fd, create=True)
                except _NotARealDirectory:
                    os.unlink(inner_name, dir_fd=step_fd)
                    inner_fd, created = _open_dir_at(inner_name, step_fd, create=True)
                if created:
                    _fsync_dir(step_fd)
            payload_rel = layout.payload_rel(inner_index, rank)
            staged = _StagedFile(inner_fd, PurePosixPath(payload_rel).name, lambda f: codec.save_to(f, payload),
                                 drop_cache=self.drop_written_pages)
        except BaseException:
            if inner_fd != step_fd:
                os.close(inner_fd)
            os.close(step_fd)
            raise
        if inner_fd != step_fd:
            os.close(step_fd)
        meta_doc = dict(meta)
        meta_doc.update(writer=WRITER_NAME, step=step, inner_index=inner_index, rank=rank, K=layout.K,
                        W=layout.W, payload=payload_rel, format=codec.FORMAT_VERSION)
        return StagedInner(inner_fd, staged, payload_rel, layout.meta_rel(inner_index, rank), meta_doc)

    def commit(self, step: int, entries: Sequence[FileEntry], fingerprint: Optional[Fingerprint],
               *, gen_s: Optional[float] = None) -> CommitRecord:
        """Write the step's commit record (atomically, durably) once every rank's files are written.
        `entries` are the FileEntry pairs `write_inner` returned, from every rank; `gen_s` (optional)
        the step's generation seconds, kept for tables. Refuses (raises) when an entry is missing or a
        listed file is not there with its size. Then appends the step to the namespace index (a hint:
        failing to append changes nothing but the next startup's speed)."""
        _check_step(step)
        layout = self.layout
        by_rel: Dict[str, FileEntry] = {}
        for e in entries:
            if not is_safe_rel(e.rel):
                raise HarnessUsageError(f"commit of step {step}: unsafe file path {e.rel!r}")
            if e.rel in by_rel and by_rel[e.rel] != e:
                raise HarnessUsageError(f"commit of step {step}: two different entries for {e.rel}")
            by_rel[e.rel] = e
        missing = [rel for rel in required_rels(layout) if rel not in by_rel]
        if missing:
            raise HarnessUsageError(
                f"commit of step {step}: no entry for {', '.join(missing[:4])}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            )
        for e in by_rel.values():
            path = self._real_file(step, e.rel)
            size = os.lstat(path).st_size
            if size != e.bytes:
                raise CorruptStepError(path, f"has {size} bytes, the entry to commit says {e.bytes}")
        record = CommitRecord(step, layout.K, layout.W, fingerprint,
                              tuple(sorted(by_rel.values(), key=lambda e: e.rel)), time.time(),
                              None if gen_s is None else float(gen_s))
        data = (json.dumps(record.to_json(), indent=1, allow_nan=False) + "\n").encode()
        root_fd = self._open_root(create=False)
        if root_fd is None:
            raise CorruptStepError(layout.root, "namespace directory does not exist")
        try:
            step_fd, _ = self._open_step(root_fd, step, create=False)
        finally:
            os.close(root_fd)
        try:
            write_file_at(step_fd, COMMIT_NAME, lambda f: f.write(data))
        finally:
            os.close(step_fd)
        fp_json = None if fingerprint is None else fingerprint.to_json()
        nbytes = sum(e.bytes for e in record.files) + len(data)
        index.append(layout, index.make_entry(layout, step, nbytes, fp_json, record.created, record.gen_s))
        return record

    def clear_step(self, step: int) -> int:
        """Remove a step so it can be rewritten: commit record first, then everything else; a step
        entry that is a symlink is unlinked, never entered. Returns the bytes freed (0 if absent)."""
        root_fd = self._open_root(create=False)
        if root_fd is None:
            return 0
        try:
            return remove_entry_at(root_fd, self._step_name(step), self.layout.root)
        finally:
            os.close(root_fd)

    # ---- reading

    def read_commit(self, step: int) -> Optional[CommitRecord]:
        """The step's commit record, None if it has none; CorruptStepError if it does not validate."""
        path = self.layout.commit_path(step)
        step_dir = self.layout.step_dir(step)
        try:
            st = os.lstat(step_dir)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptStepError(step_dir, f"step directory {_describe_mode(st.st_mode)}")
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptStepError(path, "commit record is a symlink (never followed)") from None
            raise
        try:
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
        finally:
            os.close(fd)
        return parse_commit(data, self.layout, step, path)

    def status(self, step: int) -> StepReport:
        """The step's StepReport (directory listings and lstat only; see `classify_step`)."""
        return classify_step(self.layout, step)

    def verify(self, step: int, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
        """None if the step can be served, else a reason naming the file. For a complete step the size
        and checksum of every listed file are checked (only the payload and meta files of `ranks`, if
        given; unknown extra files always). An unverified (older) step passes when its files exist."""
        return self.verify_status(step, ranks)[1]

    def verify_status(self, step: int, ranks: Optional[Iterable[int]] = None) -> Tuple[str, Optional[str]]:
        """`verify`, also telling the step's status as classified on the way ('complete', 'unverified',
        'incomplete' or 'corrupt'), so a caller that needs both classifies the step once."""
        report = self.status(step)
        if report.status in ("incomplete", "corrupt"):
            return report.status, f"{report.status}: {report.reason}"
        if report.status == "unverified":
            return report.status, None
        reason = self.verify_checksums(step, ranks)
        return ("corrupt" if reason else "complete"), reason

    def verify_step(self, step: int, ranks: Optional[Iterable[int]] = None, *, load: bool = True) -> Optional[str]:
        """None if the step would be served, else the reason (naming the file) it would be refused.

        A complete step: the size and checksum of every file its commit record lists (of `ranks`, if
        given). With `load`, also every payload of `ranks` (all ranks by default) is checked to load
        safely -- header, records and bounds, nothing executed, no registered type needed in this
        process (`codec.check_file`); a payload that would need pickled code fails. An unverified
        (older) step has no checksums: only the load check applies. Incomplete and corrupt steps
        fail with their status and reason."""
        ranks = None if ranks is None else sorted(set(ranks))
        status, reason = self.verify_status(step, ranks)
        if reason is not None or not load:
            return reason
        for _i, r, prel, _mrel in expected_rels(self.layout):
            if ranks is not None and r not in ranks:
                continue
            try:
                path = self._real_file(step, self._existing_rel(step, prel, self.layout.legacy_k1_rel(r)[0]))
                codec.check_file(path)
            except CorruptStepError as exc:
                return str(exc)
            except codec.CodecError as exc:
                return str(exc)
        return None

    def verify_checksums(self, step: int, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
        """For a step already classified complete: size and checksum of every file its commit record
        lists (of `ranks`, if given). None if they all match, else a reason naming the file."""
        try:
            record = self.read_commit(step)
        except CorruptStepError as exc:
            return str(exc)
        if record is None:
            return f"{self.layout.commit_path(step)}: commit record disappeared"
        wanted = None if ranks is None else set(ranks)
        rank_of: Dict[str, int] = {}
        for _i, r, prel, mrel in expected_rels(self.layout):
            rank_of[prel] = r
            rank_of[mrel] = r
        for entry in record.files:
            r = rank_of.get(entry.rel)
            if wanted is not None and r is not None and r not in wanted:
                continue
            try:
                path = self._real_file(step, entry.rel)
                size, digest = checksum_file(path)
            except CorruptStepError as exc:
                return str(exc)
            except OSError as exc:
                return f"{self.layout.step_dir(step) / entry.rel}: cannot be read: {exc.strerror or exc}"
            if size != entry.bytes:
                return f"{path}: {size} bytes, the commit record says {entry.bytes}"
            if digest != entry.checksum:
                return f"{path}: checksum {digest} does not match the commit record's {entry.checksum}"
        return None

    def read_inner(self, step: int, inner_index: int, rank: int) -> Any:
        """Load the payload of (step, inner_index, rank). Reads K = 1 steps stored as {step}/tq_batch.pt
        and as {step}/0/tq_batch.pt. CorruptStepError(path, reason) if it cannot be loaded safely."""
        self._check_position(step, inner_index, rank)
        path = self._real_file(step, self._payload_rel(step, inner_index, rank))
        try:
            return codec.load_from(path)
        except codec.UnregisteredTypeError:
            raise  # not a damaged file: this process has not registered a type the payload holds
        except codec.CodecError as exc:
            raise CorruptStepError(path, _without_path(str(exc), path)) from None

    def read_step(self, step: int, rank: int) -> List[Any]:
        """The K mini-batches of this rank in inner order."""
        return [self.read_inner(step, i, rank) for i in range(self.layout.K)]

    def read_meta(self, step: int, inner_index: int, rank: int) -> Dict[str, Any]:
        self._check_position(step, inner_index, rank)
        path = self._real_file(step, self._meta_rel(step, inner_index, rank))
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CorruptStepError(path, f"meta file cannot be read: {reason}") from None
        if not isinstance(doc, dict):
            raise CorruptStepError(path, "meta file is not a JSON object")
        return doc


def _without_path(message: str, path: Path) -> str:
    """`message` without a leading "{path}: " (a CorruptStepError names the path itself)."""
    prefix = f"{path}: "
    return message[len(prefix):] if message.startswith(prefix) else message
