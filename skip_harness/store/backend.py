"""The storage seam: what the rest of skip_harness asks of wherever a namespace's files live.

Two backends sit behind it: the local POSIX one (`store.posix`: fd-relative walking that never follows
a link, O_DIRECT from reused buffers, temporary name + fsync + rename, inode stamps) and the object
store (`store.objstore`: a PUT at the final key checked by size, the commit record create-only, a
lease object for the lock). Learned from torch.distributed.checkpoint (`StorageWriter` /
`StorageReader`, whose `finish()` on the coordinating rank writes the metadata last), zarr 3's store
ABC and joblib's store backends: the caching policy never builds a path, a backend offers a few
primitive operations on keys.

Keys are relative to the namespace and '/'-separated: `'3/0/tq_batch.pt'` is a payload of step 3,
`'3/commit.json'` its commit record, `'.index.jsonl'` the namespace index. Within a step, `rel` is relative to
the step (`'0/tq_batch.pt'`). Nothing here is a `Path`: a dump_dir may be `s3://bucket/prefix`.

The commit protocol, on every backend:
- every payload and meta file of a step is written (and its stored size checked) before
  `commit(step, record)` writes the commit record, the step's last file;
- rewriting or removing a step removes its commit record first (`remove_step`), so a step is never
  seen "complete" with a file missing; an object store's commit is create-only, so a rewrite is
  `remove_step` + writes + `commit`, never an overwrite in place;
- a step with files and no commit record is incomplete: the startup scan cleans it.

Checksums are ours (xxh3-128 over the stored bytes, `checksum_bytes`); a backend verifies a read
against the size and checksum its caller took from the commit record.

Errors: a bad cache file is a `CorruptStepError` naming it; a backend that cannot be reached raises a
`SkipHarnessError` subclass (e.g. the object store's `ObjectStoreUnavailable`): a failed write warns
and leaves the step uncommitted, a failed read is a miss. Callers catch `SkipHarnessError` and
`OSError`.
"""
from __future__ import annotations

import abc
import importlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional, Tuple, Union

from skip_harness.errors import ConfigError, SkipHarnessError

DUMP_DIR_KEY = "skip.rollout_tq.dump_dir"
COMMIT_NAME = "commit.json"
INDEX_KEY = ".index.jsonl"          # the namespace index, one JSON line per commit (store.index)

LINK = "a symlink (never followed)"
NOT_A_DIRECTORY = "not a directory"

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_ANY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$", re.S)
URL_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "memory")   # the object stores' URLs


# --------------------------------------------------------------------------------------------
# what a listing returns


@dataclass(frozen=True)
class StoredFile:
    """One file (object) of a step: its path in the step, stored size and an opaque change stamp
    (inode + mtime + size on POSIX, the ETag on an object store): equal stamps, same bytes."""

    rel: str
    size: int
    stamp: str


@dataclass(frozen=True)
class StepListing:
    """What one listing found of a step, for its status: its files, leftover temporaries of an
    interrupted write, and odd entries (a symlink, a device, a directory where a file belongs: never
    followed or read) with what they are."""

    step: int
    files: Mapping[str, StoredFile] = field(default_factory=dict)
    temporaries: Tuple[str, ...] = ()
    odd: Tuple[Tuple[str, str], ...] = ()      # (rel, what it is); a link's `what` is LINK
    entry: str = ""                            # "" a step (directory / key prefix); LINK or NOT_A_DIRECTORY
    total: int = 0                             # bytes of every entry listed: files, temporaries, odd ones

    @property
    def committed(self) -> bool:
        return COMMIT_NAME in self.files

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass(frozen=True)
class NamespaceListing:
    """Every step of a namespace in numeric order, and the top-level entries that are not steps
    (a stray file, a step name that is not a plain number, a symlink) with what they are."""

    steps: Tuple[StepListing, ...] = ()
    leftovers: Tuple[Tuple[str, str], ...] = ()


class Hold(abc.ABC):
    """The namespace lock as held by this run (a lock file on POSIX, a lease object on an object store).
    `lost` is set when another run took it over (a lease expired): stop writing."""

    read_only: bool = False
    why: str = ""            # with read_only: why this process may not write there, for the message

    @property
    def lost(self) -> bool:
        return False

    @abc.abstractmethod
    def release(self) -> None:
        """Give the namespace back (idempotent)."""


# --------------------------------------------------------------------------------------------
# the interface


class NamespaceBackend(abc.ABC):
    """One namespace's storage. Safe to call from several threads at once (a writer and a prefetch
    reader); never from a forked child (an object-store client hangs there)."""

    #: where the namespace is, for messages: a directory path or a URL
    url: str

    def where(self, key: str = "") -> str:
        """A key's full path or URL, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    # ---- writing (a step's files, then its commit record)

    @abc.abstractmethod
    def write_payload(self, step: int, rel: str, buffer: Any, nbytes: int) -> int:
        """Store the first `nbytes` of `buffer` (a pool buffer's lease on POSIX, any buffer on an object
        store) as file `rel` of `step`, atomically and durably; returns the stored size as checked."""

    @abc.abstractmethod
    def write_small(self, key: str, data: bytes) -> None:
        """Store a small file (a meta.json, the index, a marker) at `key`, replacing one there atomically."""

    @abc.abstractmethod
    def commit(self, step: int, record: bytes) -> None:
        """Write the step's commit record, the last of its files: only once every file it lists is
        written and its size checked. Raises when a commit record is there already."""

    @abc.abstractmethod
    def uncommit(self, step: int) -> None:
        """Remove only the step's commit record (its files are about to be rewritten, rank by rank);
        nothing when it has none."""

    @abc.abstractmethod
    def remove_step(self, step: int) -> int:
        """Remove the step, the commit record first; returns the bytes freed (0 when it is absent)."""

    @abc.abstractmethod
    def set_aside(self, step: int, reason: str) -> str:
        """Move the step out of the namespace's steps (quarantine), commit record first; returns where."""

    # ---- reading

    @abc.abstractmethod
    def list_steps(self) -> NamespaceListing:
        """Every step, from one pass over the namespace (no file is read)."""

    @abc.abstractmethod
    def list_step(self, step: int) -> Optional[StepListing]:
        """One step's listing; None when the namespace holds no such step."""

    @abc.abstractmethod
    def read_small(self, key: str) -> Optional[bytes]:
        """A small file's bytes (a commit record, a meta.json, the index); None when there is none.
        A symlink is never followed (CorruptStepError)."""

    @abc.abstractmethod
    def read_verified(self, step: int, rel: str, size: int, checksum: str, pool: Any) -> Tuple[Any, int]:
        """File `rel` of `step` read into a buffer leased from `pool` (BufferPool), its size and
        xxh3-128 checked against the commit record's `size` and `checksum` in the same pass:
        (lease, size). CorruptStepError naming the file when it is missing, short, or differs."""

    def map_verified(self, step: int, rel: str, size: int, checksum: str) -> Optional[Any]:
        """Where the storage can map a file: its bytes as a private (copy-on-write) mapping, checked
        against `size` and `checksum` like `read_verified` -- decoded tensors are views of it, and a
        file in the page cache is not copied. None where it cannot (an object store): use
        `read_verified`."""
        return None

    # ---- the namespace

    @abc.abstractmethod
    def lock(self, timeout: float = 0.0) -> Hold:
        """Hold the namespace for writing (LockHeldError naming the holder after `timeout` seconds).
        A namespace this process may only read gives a Hold with `read_only` (and `why`): serve,
        write nothing. Any other failure to reach it raises a SkipHarnessError or an OSError."""

    def holder(self) -> Optional[str]:
        """Who holds the namespace now, described for a message, or None -- without creating,
        writing or taking anything (a dry run asks this)."""
        return None

    @abc.abstractmethod
    def writable(self) -> Optional[str]:
        """None when this process may write here, else why not (for the message)."""

    @abc.abstractmethod
    def put_run_marker(self, token: str) -> None:
        """Leave a marker of this run, for the check that every node sees the same cache."""

    @abc.abstractmethod
    def sees_run_marker(self, token: str, wait: float = 0.0) -> bool:
        """Whether the marker `token` (put by rank 0, maybe on another node) is visible here."""

    @abc.abstractmethod
    def remove_run_marker(self, token: str) -> None:
        """Remove the marker (idempotent)."""

    def modified(self, key: str = "") -> Optional[float]:
        """When `key` (a step: its number; '' the namespace) last changed, where the storage records it."""
        return None

    def last_read(self, step: int, rels: Iterable[str]) -> Optional[float]:
        """The newest time one of the step's files `rels` was read after it was written, where the
        storage records reads (a POSIX file's access time); None when it does not, or none was."""
        return None

    def read_index(self) -> Optional[bytes]:
        """The namespace index (a hint the scan reconciles), None when there is none."""
        return self.read_small(INDEX_KEY)

    def write_index(self, data: bytes) -> None:
        """Replace the whole index."""
        self.write_small(INDEX_KEY, data)


class DumpDir(abc.ABC):
    """A dump_dir: the namespaces under it (`{experiment}_{project}/{shape leaf}`)."""

    url: str

    @abc.abstractmethod
    def namespace(self, rel: str) -> NamespaceBackend:
        """The namespace at `rel` (`'{experiment}_{project}/GBS...'`) under this dump_dir."""

    @abc.abstractmethod
    def list_namespaces(self) -> List[str]:
        """The `rel` of every namespace under this dump_dir (two levels), sorted."""


# --------------------------------------------------------------------------------------------
# opening one


def is_url(dump_dir: Union[str, os.PathLike, None]) -> bool:
    """Whether `dump_dir` names an object store (`s3://`, `gs://`, `az://`, `memory://`, ...); a
    `file://` URL and a plain path are local."""
    if dump_dir is None or isinstance(dump_dir, os.PathLike):
        return False
    m = _SCHEME.match(str(dump_dir))
    return bool(m) and m.group(1).lower() != "file"


def dump_dir_problem(dump_dir: Union[str, os.PathLike, None]) -> Optional[str]:
    """Why a dump_dir cannot be used, from its text alone; None when it may be. An object store's
    scheme without its `//` (`s3:/x`, `s3:x`, `gs:/x`) is refused rather than taken for a local folder
    of that name, and so is a URL without a bucket (`s3://`, `s3:///x`)."""
    if dump_dir is None or isinstance(dump_dir, os.PathLike):
        return None
    text = str(dump_dir)
    m = _SCHEME_ANY.match(text)
    if m is None or m.group(1).lower() not in URL_SCHEMES:
        return None
    scheme, slashes, rest = m.groups()
    if len(slashes) < 2:
        return (f"{text!r} looks like an object-store URL but is not one ({scheme}: needs two slashes): "
                f"write {scheme}://BUCKET/PREFIX, or ./{text} for a local folder of that name")
    if scheme.lower() != "memory" and (len(slashes) > 2 or not rest.partition("/")[0]):
        return f"{text!r} names no bucket: an object-store URL is {scheme}://BUCKET/PREFIX"
    return None


def local_path(dump_dir: Union[str, os.PathLike]) -> Path:
    """A local dump_dir as a Path (`~` expanded, a `file://` prefix dropped)."""
    s = os.fspath(dump_dir)
    if s.lower().startswith("file://"):
        s = s[len("file://"):]
    return Path(s).expanduser()


def open_dump_dir(dump_dir: Union[str, os.PathLike]) -> DumpDir:
    """The backend for a dump_dir: a local path -> the POSIX backend; a URL with a scheme -> the
    object-store backend (`skip_harness.store.objstore`, which needs the [s3] extra). ConfigError
    naming `skip.rollout_tq.dump_dir` when the URL cannot be served here."""
    why = dump_dir_problem(dump_dir)
    if why is not None:
        raise ConfigError(DUMP_DIR_KEY, why)
    if not is_url(dump_dir):
        from skip_harness.store.posix.backend import PosixDumpDir

        return PosixDumpDir(local_path(dump_dir))
    url = str(dump_dir)
    try:
        objstore = importlib.import_module("skip_harness.store.objstore")
        opener = getattr(objstore, "open_dump_dir")
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            DUMP_DIR_KEY,
            f"{url}: object storage needs the [s3] extra (pip install 'skip_harness[s3]'): {exc}",
        ) from None
    try:
        return opener(url)
    except ConfigError:
        raise
    except SkipHarnessError as exc:
        raise ConfigError(DUMP_DIR_KEY, str(exc) if str(exc).startswith(url) else f"{url}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(DUMP_DIR_KEY, f"{url}: not an object-store URL this build can open: {exc}") from None


_NAMESPACES: dict = {}      # namespace URL -> its ObjectNamespace (one client and one lease per process)
_NAMESPACES_GUARD = __import__("threading").Lock()


def namespace_of(layout: Any, *, drop_written_pages: bool = True) -> NamespaceBackend:
    """The backend of a Layout's namespace: the POSIX one for a directory, the object store's for a
    URL layout (`layout.is_url`) -- one instance per namespace URL in this process, so the lease the
    startup takes is the one the run's writes check."""
    if not getattr(layout, "is_url", False):
        from skip_harness.store.posix.backend import PosixNamespace

        return PosixNamespace(layout, drop_written_pages=drop_written_pages)
    url = str(layout.root)
    with _NAMESPACES_GUARD:
        ns = _NAMESPACES.get(url)
        if ns is None:
            root = layout.root
            ns = open_dump_dir(str(root.parent.parent)).namespace(f"{root.parent.name}/{root.name}")
            _NAMESPACES[url] = ns
        return ns


__all__ = [
    "namespace_of", "COMMIT_NAME", "DUMP_DIR_KEY", "INDEX_KEY", "DumpDir", "Hold", "NamespaceBackend", "NamespaceListing",
    "StepListing", "StoredFile", "URL_SCHEMES", "dump_dir_problem", "is_url", "local_path", "open_dump_dir",
]
