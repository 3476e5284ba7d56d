"""The storage interface: the few key/byte operations a namespace's files need, and what a backend can do.

Everything above this seam -- the commit protocol (payloads and metas first, the commit record last,
removed first), step listings and statuses, verified reads, the index, the values -- is written once,
in `store.namespace`, for every backend. A backend is one `Storage` subclass plus a `locking.Locker`, with
whatever helpers they need beside them: `store.posix` (a directory on a local or shared file system:
`storage.py`, and `lock.py` with its flock, `fileops.py`, `directio.py`, `holder.py`), `store.objstore`
(an S3-compatible bucket: `storage.py`, the lease's `locker.py` and `lease.py`, `client.py`, `errors.py`),
`store.memory` (one module: a dict, for tests and as the reference implementation).
Learned from zarr 3's `abc/store.py` (a handful of key operations and capability flags) and
torch.distributed.checkpoint's `StorageWriter` / `StorageReader` (the metadata-last protocol lives
above them, in `finish`).

Keys
    '/'-separated paths relative to the storage's root (one namespace): `'3/0/tq_batch.pt'`,
    `'3/commit.json'`, `'.index.jsonl'`. Never empty components, never `..`; the caller builds them.
    A "prefix" is a key ending in '/' (`'3/'`) or '' (everything).

Kinds of entry (`Entry.kind`)
    FILE       a stored object / regular file: the only kind `get` and friends read;
    DIR        a real directory (only storages with `caps.directories`; object stores have none);
    TEMPORARY  a file being written under a temporary name (`.tmp-` on POSIX): the trace of an
               interrupted write, never read;
    LINK       a symbolic link: listed and removed as a link, never followed or entered;
    OTHER      anything else (a device, a socket); `Entry.what` says what it is.

Errors
    A file that is missing, short, of another checksum or not a regular file where one is read:
    `CorruptStepError(path, reason)` naming its full path or URL (`where(key)`). A storage that cannot be
    reached or refuses: an `OSError` (POSIX) or a `SkipHarnessError` subclass (the object store's
    `ObjectStoreError`s); callers catch `SkipHarnessError` and `OSError`.

Threads
    A storage is called from several threads at once (the writer thread writes a step while the
    prefetch thread reads another); never from a forked child.

Writing a new backend: subclass `Storage`, set `caps` and `url`, implement the abstract methods (their
docstrings are the contract), give it a `store.registry.Backend` registered by URL scheme, and subclass
the protocol's tests that ship in the package (`skip_harness.testing.store_tests.StoreTests`), as our
backends do in tests/test_backend.py (docs/store.md#adding-a-backend).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from skip_harness.store.checksum import checksum_int

FILE = "file"
DIR = "dir"
TEMPORARY = "temporary"
LINK = "link"
OTHER = "other"

LINK_WHAT = "a symlink (never followed)"       # how a link is described in listings and messages


@dataclass(frozen=True)
class Capabilities:
    """What a storage can do beyond the common operations.

    - `mmap`: `map_verified` maps a file (decoded tensors view the page cache; no copy);
    - `access_times`: `Entry.atime_ns` records when a file was last read (POSIX atime);
    - `append`: `append` adds to a file in place, durably (else the caller rewrites it whole);
    - `atomic_rename`: `move` renames a whole prefix in one atomic step, and `put` replaces a file
      atomically by rename (else a prefix is copied key by key, and writes that must not overwrite
      another writer's are create-only: `put_if_absent`);
    - `directories`: keys live in real directories: a listing walks them, `stat` of a directory is an
      entry of kind DIR, and a directory's own entry can be a link or a file (object stores: keys
      under a prefix, no entry for the prefix itself; one request lists a whole namespace)."""

    mmap: bool = False
    access_times: bool = False
    append: bool = False
    atomic_rename: bool = False
    directories: bool = False


class Entry(NamedTuple):
    """One entry of a listing or a `stat`: its key, kind, stored size, an opaque change stamp (equal
    stamps: the same bytes -- inode + mtime + size on POSIX, the ETag on an object store), and the
    times the storage records (nanoseconds since the epoch; None where it does not). A tuple: a scan
    makes tens of thousands."""

    key: str
    kind: str = FILE
    size: int = 0
    stamp: str = ""
    mtime_ns: Optional[int] = None
    atime_ns: Optional[int] = None
    what: str = ""          # for LINK and OTHER: what the entry is, for a message

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]


class Storage(abc.ABC):
    """The bytes of one namespace, by key. See the module's docstring for keys, kinds and errors."""

    #: what this storage can do beyond the common operations
    caps: Capabilities = Capabilities()
    #: where the storage is, for messages: a directory path or a URL
    url: str = ""

    def where(self, key: str = "") -> str:
        """A key's full path or URL, for messages (`url` for '')."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    # ---- reading

    @abc.abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The whole file at `key` (a small one: a meta file, a commit record, the index); None when
        there is none. A link, or a directory on the way that is a link, is never followed
        (CorruptStepError naming it); so is anything that is not a regular file."""

    def get_stamped(self, key: str) -> Tuple[Optional[bytes], Optional[str]]:
        """`get` and the change stamp of the bytes it returned (the one a listing gives the same file),
        (None, None) when there is none; the stamp is None where the storage cannot tell it from the
        read itself. Used where an index entry must describe exactly the bytes read."""
        return self.get(key), None

    @abc.abstractmethod
    def get_verified(self, key: str, size: int, checksum: str, pool: Any) -> Any:
        """The file at `key` read into a buffer leased from `pool` (`bufferpool.BufferPool.acquire`),
        its size and xxh3-128 (`checksum_bytes`) checked against `size` and `checksum` in the pass that
        reads it; returns the lease (its first `size` bytes are the file). CorruptStepError naming the
        file when it is missing, of another size or checksum, or not a regular file; the lease is
        released then. POSIX reads with O_DIRECT; an object store streams and hashes chunk by chunk."""

    def map_verified(self, key: str, size: int, checksum: str) -> Any:
        """Only where `caps.mmap`: the file as a private (copy-on-write) mapping of `size` bytes,
        checked like `get_verified`. Elsewhere NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot map files (caps.mmap is False)")

    def map(self, key: str) -> Tuple[Any, int]:
        """Only where `caps.mmap`: (a private (copy-on-write) mapping, size) of the whole file at `key`,
        unchecked -- an older step's file, with no commit record to check it against (read lazily: a
        check of its header reads only that). CorruptStepError like `get_verified` when it is missing or
        not a regular file. Elsewhere NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot map files (caps.mmap is False)")

    @abc.abstractmethod
    def stat(self, key: str) -> Optional[Entry]:
        """The entry at `key`, itself never followed (None when there is none): a file, a link, a
        directory (only with `caps.directories`), ... Cheap (the index stats thousands): POSIX stats by
        path, so a caller that must not pass a link on the way stats the directories first."""

    def stamps(self, keys: Sequence[str], kinds: Sequence[str]) -> Optional[Tuple[int, int]]:
        """One change stamp covering the entries at `keys` (an int: equal stamps, none of them changed) and
        the newest mtime among them (ns, 0 where unknown); None when one is missing or not of its kind in
        `kinds`. What the index checks a committed step by (thousands at startup): a storage may do it
        faster than `stat` one by one (POSIX: fd-relative, no Entry made)."""
        parts = []
        newest = 0
        for key, kind in zip(keys, kinds):
            e = self.stat(key)
            if e is None or e.kind != kind:
                return None
            parts.append(e.stamp)
            newest = max(newest, e.mtime_ns or 0)
        return checksum_int("|".join(parts).encode()), newest

    def stamps_many(self, names: Sequence[str], suffixes: Sequence[str],
                    kinds: Sequence[str]) -> List[Optional[Tuple[int, int]]]:
        """`stamps` of many groups of one shape: for each of `names`, the keys `name + suffix` for each of
        `suffixes` (a suffix "" is the name itself), of `kinds`. The index checks every committed step
        with one call at startup (10,000 steps x K = 4: 60,000 entries), so a storage may share work
        across the groups (POSIX opens the namespace once)."""
        return [self.stamps([name + suffix for suffix in suffixes], kinds) for name in names]

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[Entry]:
        """Every entry under `prefix`, at any depth, in no particular order; links and temporaries are
        entries of their own and never entered. Directories are not entries (they are walked). With
        `caps.directories`, a `prefix` whose directory is itself a link or not a directory yields that
        one entry (its key `prefix` without the '/'); a missing prefix yields nothing."""

    @abc.abstractmethod
    def list_dir(self, prefix: str = "") -> List[Entry]:
        """The entries directly under `prefix` (one level): files, links, ... and the sub-prefixes, as
        entries of kind DIR (their key without a trailing '/', size 0). Nothing when there is none."""

    # ---- writing: every write is atomic (a reader sees the old bytes, the new ones, or none) and durable
    # once it returns

    @abc.abstractmethod
    def put(self, key: str, data: Any, nbytes: Optional[int] = None) -> int:
        """Store the first `nbytes` (default: all) of `data` at `key`, replacing what is there, creating
        the directories on the way (a link or a file in a directory's place is removed, never
        followed); returns the stored size as the storage reports it. `data` is any buffer, or a
        `bufferpool.Lease` (POSIX writes it with O_DIRECT)."""

    def put_all(self, files: Sequence[Tuple[str, Any, Optional[int]]]) -> List[int]:
        """`put` of each (key, data, nbytes), in order; the stored sizes. Every file is durable once it
        returns, not before: a backend may make them durable together (POSIX fsyncs each directory
        once, after its last file). Each file is still replaced atomically."""
        return [self.put(key, data, nbytes) for key, data, nbytes in files]

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: Any) -> Optional[str]:
        """Store `data` at `key` only when nothing is there: the stored file's stamp, or None when
        something was there already (nothing written). Create-only on an object store
        (`If-None-Match: *`); on POSIX a check and a rename, under the namespace's lock."""

    def append(self, key: str, data: bytes) -> int:
        """Only where `caps.append`: add `data` at the end of the file at `key` (created when missing);
        returns the file's size before the append. Elsewhere NotImplementedError. Not made durable: its
        one user, the namespace index, is a hint whose torn or lost tail the next scan reads in full and
        rewrites -- and an fsync a commit on the writer thread slows a training step on every core."""
        raise NotImplementedError(f"{type(self).__name__} cannot append (caps.append is False)")

    @abc.abstractmethod
    def delete(self, key: str) -> int:
        """Remove the file (or link, or other entry; never a directory) at `key`, durably; returns the
        bytes it held, 0 when there was none."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove everything under `prefix` (a link where its directory belongs is removed as a link,
        never entered), and the directory itself; returns the bytes freed. A removal interrupted half
        way leaves a leftover the next scan reports (POSIX: a `.trash-` directory)."""

    def move(self, src_prefix: str, dst_prefix: str) -> None:
        """Only where `caps.atomic_rename`: rename the entry `src_prefix` names (a directory, file or
        link: never followed) to `dst_prefix`, atomically and durably; the directories above `dst_prefix`
        are created. Elsewhere NotImplementedError: `copy` key by key."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename (caps.atomic_rename is False)")

    @abc.abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Copy the file at `src` to `dst` (server side where the storage can)."""


__all__ = ["DIR", "FILE", "LINK", "LINK_WHAT", "OTHER", "TEMPORARY", "Capabilities", "Entry", "Storage"]
