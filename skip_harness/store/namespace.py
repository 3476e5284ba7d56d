"""One namespace's steps on any storage: the commit protocol, written once above `store.storage`.

A `Namespace` is a `Storage` (the bytes), a `Locker` (who may write) and `RunMarkers`. Every backend
gets the same protocol from it:

- a step's payload and meta files are written first, each atomically and its stored size checked;
  `commit(step, record)` then puts the commit record, the step's last file, create-only (a second
  committer is told, never overwrites);
- rewriting a step removes its commit record first (`uncommit`), removing one removes the commit
  record first (`remove_step`): a step is never seen complete with a file missing;
- setting a step aside (quarantine) is one atomic rename where the storage has one, else a copy of
  its files and a removal, commit record first;
- fencing: every write first asks the locker (`Locker.fence`), strictly before a commit record is put
  or removed (an object store's lease is renewed by a conditional write first; flock: nothing to do);
- where the storage has no rename (an object store), a step file is put create-only, and an object
  already there (a step rewritten in place) is replaced only right after a strict fence: a stalled
  run's retried request never lands over another run's files;
- listings are grouped into steps (`StepListing`) from `Storage.list`; verified reads check size and
  xxh3-128 against the commit record in the pass that reads (`Storage.get_verified`, `map_verified`);
- `modified` / `last_read` come from `stat` (mtime, and atime where the storage records reads);
- hooks run when the namespace is given back (`on_release`): the index of a storage without append is
  rewritten there, once (`store.index.IndexWriter`, which a step store's writer owns).

Keys are relative to the namespace and '/'-separated: `'3/0/tq_batch.pt'` is a payload of step 3,
`'3/commit.json'` its commit record. Within a step, `rel` is relative to the step (`'0/tq_batch.pt'`).
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from skip_harness.errors import CorruptStepError
from skip_harness.store.layout import (
    COMMIT_NAME, QUARANTINE_DIR, TIER_DIR, TMP_PREFIX, TRASH_PREFIX, VALUES_DIR, parse_step_name,
)
from skip_harness.store.locking import Hold, Locker, RunMarkers, StorageRunMarkers
from skip_harness.store.storage import DIR, FILE, LINK, LINK_WHAT, TEMPORARY, Entry, Storage

NOT_A_DIRECTORY = "not a directory"
LEFTOVER = "leftover of an interrupted write or removal"


# --------------------------------------------------------------------------------------------
# what a listing returns


class StoredFile(NamedTuple):
    """One file (object) of a step: its path in the step, stored size and change stamp (a tuple: a scan
    makes one per file)."""

    rel: str
    size: int
    stamp: str


@dataclass(frozen=True)
class StepListing:
    """What one listing found of a step, for its status: its files, leftover temporaries of an
    interrupted write, and odd entries (a symlink, a device: never followed or read) with what they
    are."""

    step: int
    files: Mapping[str, StoredFile] = field(default_factory=dict)
    temporaries: Tuple[str, ...] = ()
    odd: Tuple[Tuple[str, str], ...] = ()      # (rel, what it is); a link's `what` is LINK_WHAT
    entry: str = ""                            # "" a step (directory / key prefix); LINK_WHAT or NOT_A_DIRECTORY
    total: int = 0                             # bytes of every entry listed: files, temporaries, odd ones

    @property
    def committed(self) -> bool:
        return COMMIT_NAME in self.files

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass(frozen=True)
class NamespaceListing:
    """Every step of a namespace in numeric order, and the top-level leftovers (name, what)."""

    steps: Tuple[StepListing, ...] = ()
    leftovers: Tuple[Tuple[str, str], ...] = ()


def _grouped(step: int, entries: Iterable[Entry], cut: int) -> StepListing:
    files: Dict[str, StoredFile] = {}
    temps: List[str] = []
    odd: List[Tuple[str, str]] = []
    total = 0
    for e in entries:
        rel = e.key[cut:]
        total += e.size
        if e.kind == FILE:
            files[rel] = StoredFile(rel, e.size, e.stamp)
        elif e.kind == TEMPORARY:
            temps.append(rel)
        else:
            odd.append((rel, e.what or e.kind))
    return StepListing(step, files, tuple(sorted(temps)), tuple(sorted(odd)), total=total)


class _NamespaceHold(Hold):
    """The locker's hold, with the namespace's release hooks run first (while the hold is still ours)."""

    def __init__(self, namespace: "Namespace", inner: Hold):
        self._namespace, self._inner = namespace, inner
        self.why = inner.why

    @property
    def lost(self) -> bool:
        return self._inner.lost

    def release(self) -> None:
        namespace, self._namespace = self._namespace, None
        if namespace is not None and not self._inner.lost and not self._inner.read_only:
            namespace.run_release_hooks()
        self._inner.release()

    def note_recording(self) -> None:
        self._inner.note_recording()


class Namespace:
    """One namespace on a storage. Safe to call from several threads at once (a writer and a prefetch
    reader); never from a forked child."""

    def __init__(self, storage: Storage, locker: Locker, markers: Optional[RunMarkers] = None):
        self.storage = storage
        self.locker = locker
        self.markers = markers if markers is not None else StorageRunMarkers(storage, locker)
        self.url = storage.url
        self.caps = storage.caps
        self._hooks: Dict[str, Callable[[], None]] = {}
        self._hooks_guard = threading.Lock()

    def __repr__(self) -> str:
        return f"Namespace({self.storage!r})"

    def where(self, key: str = "") -> str:
        """A key's full path or URL, for messages."""
        return self.storage.where(key)

    # ---- writing (a step's files, then its commit record)

    def _put_step_file(self, key: str, data: Any, nbytes: int) -> int:
        return self._put_step_files([(key, data, nbytes)])[0]

    def _put_step_files(self, files: Sequence[Tuple[str, Any, int]]) -> List[int]:
        """Store each (key, data, nbytes) of a step, in order, atomically and durably (together, where the
        storage renames: `Storage.put_all`); the stored sizes, each checked."""
        if self.caps.atomic_rename:         # temporary name + rename: replaces atomically, nothing to race
            for key, _data, _nbytes in files:
                self.locker.fence(key=key)
            got = self.storage.put_all(files)
        else:
            got = [self._put_in_place(key, data, nbytes) for key, data, nbytes in files]
        for (key, _data, nbytes), size in zip(files, got):
            if size != nbytes:
                raise CorruptStepError(self.where(key), f"stored {size} bytes, wrote {nbytes}")
        return got

    def _put_in_place(self, key: str, data: Any, nbytes: int) -> int:
        """A storage without rename: create-only first, else (a file of a step rewritten in place) proven
        ours before it is replaced; the size as the storage reports it (-1: not there)."""
        self.locker.fence(key=key)
        view = data.view(nbytes) if hasattr(data, "view") and callable(data.view) else memoryview(data).cast("B")[:nbytes]
        if self.storage.put_if_absent(key, view) is None:
            self.locker.fence(strict=True, key=key)
            self.storage.put(key, view)
        found = self.storage.stat(key)
        return -1 if found is None else found.size

    def write_payload(self, step: int, rel: str, buffer: Any, nbytes: int) -> int:
        """Store the first `nbytes` of `buffer` (a pool buffer's lease, or any buffer) as file `rel` of
        `step`, atomically and durably; returns the stored size as checked."""
        return self._put_step_file(f"{int(step)}/{rel}", buffer, nbytes)

    def write_step_files(self, step: int, files: Sequence[Tuple[str, Any, int]]) -> List[int]:
        """`write_payload` of each (rel, buffer, nbytes) of `step` -- a mini-batch's payload and its
        meta.json -- made durable together where the storage renames (one directory fsync on POSIX);
        returns the stored sizes as checked."""
        return self._put_step_files([(f"{int(step)}/{rel}", data, nbytes) for rel, data, nbytes in files])

    def write_small(self, key: str, data: bytes) -> None:
        """Store a small file at `key` (a step's meta file as a step file; the index, a values file, a
        marker replacing what is there), atomically."""
        if parse_step_name(key.partition("/")[0]) is not None:
            self._put_step_file(key, data, len(data))
            return
        self.locker.fence(key=key)
        self.storage.put(key, data)

    def append_small(self, key: str, data: bytes) -> int:
        """Where the storage appends (`caps.append`): add `data` at the end of the file at `key` (the
        index, a hint: not durably, see Storage.append) once the locker lets us write; returns the file's
        size before the append."""
        self.locker.fence(key=key)
        return self.storage.append(key, data)

    def commit(self, step: int, record: bytes) -> str:
        """Put the step's commit record, the last of its files, create-only: only once every file it
        lists is written and its size checked. CorruptStepError when one is there already. Returns the
        stored record's stamp."""
        key = f"{int(step)}/{COMMIT_NAME}"
        self.locker.fence(strict=True, key=key)
        stamp = self.storage.put_if_absent(key, record)
        if stamp is None:
            raise CorruptStepError(self.where(key), "a commit record is there already")
        return stamp

    def uncommit(self, step: int) -> None:
        """Remove only the step's commit record (its files are about to be rewritten); nothing when it
        has none."""
        key = f"{int(step)}/{COMMIT_NAME}"
        self.locker.fence(key=key)
        found = self.storage.stat(key)
        if found is None or found.kind == DIR:
            return
        self.locker.fence(strict=True, key=key)
        self.storage.delete(key)

    def remove_step(self, step: int) -> int:
        """Remove the step, the commit record first; returns the bytes freed (0 when it is absent). A
        step entry that is a link or a file is removed as such, never followed."""
        commit = f"{int(step)}/{COMMIT_NAME}"
        self.locker.fence(key=commit)
        freed = 0
        found = self.storage.stat(commit)
        if found is not None and found.kind != DIR:
            self.locker.fence(strict=True, key=commit)
            freed += self.storage.delete(commit)
        self.locker.fence(key=str(int(step)))
        freed += self.storage.delete_prefix(f"{int(step)}/")
        return freed + self._drop_values(step)

    def steps_with_records(self) -> set:
        """The steps the records beside the steps name -- their values, discards and second tier --
        whether or not the step itself is there (`remove_step` removes them after the step: one it
        interrupted leaves them behind): a step that is written again clears them first."""
        found = set()
        for e in self.storage.list_dir(VALUES_DIR):
            stem = e.name[:-len(".json")] if e.name.endswith(".json") else ""
            step = parse_step_name(stem[len("discarded-"):] if stem.startswith("discarded-") else stem)
            if step is not None:
                found.add(step)
        for e in self.storage.list_dir(TIER_DIR):
            step = parse_step_name(e.name)
            if step is not None:
                found.add(step)
        return found

    def _drop_values(self, step: int) -> int:
        """The values recorded for a step that is removed or set aside (`store.values`: outside the step,
        bound to its commit record) go with it: no orphan is left behind in `.values/`."""
        freed = 0
        for key in (f"{VALUES_DIR}/{int(step)}.json", f"{VALUES_DIR}/discarded-{int(step)}.json"):   # its discards too
            self.locker.fence(key=key)
            freed += self.storage.delete(key)
        tier = f"{TIER_DIR}/{int(step)}"       # its second tier (store.tier) too
        self.locker.fence(key=tier)
        return freed + self.storage.delete_prefix(tier + "/")

    def set_aside(self, step: int, reason: str = "") -> str:
        """Move the step out of the namespace's steps, under `.quarantine/`; returns where it went. One
        atomic rename where the storage has one (the commit record goes with it; named
        `{step}-{time}-{random}`), else a copy of every file under `{step}-{reason}-{time}` and a
        removal, commit record first."""
        self.locker.fence(key=str(int(step)))
        if self.caps.atomic_rename:
            when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            dest = f"{QUARANTINE_DIR}/{int(step)}-{when}-{secrets.token_hex(3)}"
            self.storage.move(str(int(step)), dest)
            self._drop_values(step)
            return self.where(dest)
        dest = f"{QUARANTINE_DIR}/{int(step)}-{reason}-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9:09d}"
        prefix = f"{int(step)}/"
        for e in list(self.storage.list(prefix)):
            self.locker.fence(key=dest)
            self.storage.copy(e.key, f"{dest}/{e.key[len(prefix):]}")
        self.remove_step(step)
        return self.where(dest)

    def remove(self, key: str) -> int:
        """Remove the entry at `key` whatever it is (a leftover of an interrupted write or removal: a
        file, a link, a directory, a prefix), never following a link; returns the bytes freed."""
        self.locker.fence(key=key)
        found = self.storage.stat(key)
        if found is not None and found.kind != DIR:
            return self.storage.delete(key)
        return self.storage.delete_prefix(key + "/")

    # ---- listing

    def list_step(self, step: int) -> Optional[StepListing]:
        """One step's listing; None when the namespace holds no such step."""
        name = str(int(step))
        if self.caps.directories:
            own = self.storage.stat(name)
            if own is None:
                return None
            if own.kind != DIR:
                return StepListing(int(step), entry=LINK_WHAT if own.kind == LINK else NOT_A_DIRECTORY,
                                   total=own.size)
            return _grouped(int(step), self.storage.list(name + "/"), len(name) + 1)
        entries = list(self.storage.list(name + "/"))
        return _grouped(int(step), entries, len(name) + 1) if entries else None

    def list_steps(self) -> NamespaceListing:
        """Every step in numeric order, and the top-level leftovers: a directory storage lists the top
        level and each step; an object store lists the whole namespace once (1000 keys a request)."""
        if self.caps.directories:
            found: List[Tuple[int, Entry]] = []
            leftovers: List[Tuple[str, str]] = []
            for e in self.storage.list_dir(""):
                step = parse_step_name(e.name)
                if step is not None:
                    found.append((step, e))
                elif e.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    leftovers.append((e.name, LEFTOVER))
            steps = []
            for step, e in sorted(found, key=lambda x: x[0]):
                if e.kind == DIR:
                    steps.append(_grouped(step, self.storage.list(e.key + "/"), len(e.key) + 1))
                else:
                    steps.append(StepListing(step, entry=LINK_WHAT if e.kind == LINK else NOT_A_DIRECTORY,
                                             total=e.size))
            return NamespaceListing(tuple(steps), tuple(sorted(leftovers)))
        by_step: Dict[int, List[Entry]] = {}
        for e in self.storage.list(""):
            head, sep, rest = e.key.partition("/")
            step = parse_step_name(head)
            if step is not None and sep and rest:
                by_step.setdefault(step, []).append(e)
        return NamespaceListing(tuple(_grouped(s, by_step[s], len(str(s)) + 1) for s in sorted(by_step)))

    def list_dir(self, prefix: str = "") -> List[Entry]:
        """The entries directly under `prefix` (`Storage.list_dir`)."""
        return self.storage.list_dir(prefix)

    def stat(self, key: str) -> Optional[Entry]:
        """The entry at `key` (`Storage.stat`)."""
        return self.storage.stat(key)

    def tree_bytes(self, prefix: str) -> int:
        """Bytes of every entry under `prefix` (or of the entry itself)."""
        return sum(e.size for e in self.storage.list(prefix))

    # ---- reading

    def read_small(self, key: str) -> Optional[bytes]:
        """A small file's bytes (a commit record, a meta.json, the index); None when there is none.
        A symlink is never followed (CorruptStepError)."""
        return self.storage.get(key)

    def read_unchecked(self, step: int, rel: str) -> Tuple[Any, int]:
        """(buffer, size) of file `rel` of `step`, with nothing to check it against (an older step: no
        commit record): mapped where the storage maps files, else read whole. CorruptStepError naming it
        when it is missing; a link is never followed."""
        key = f"{int(step)}/{rel}"
        if self.caps.mmap:
            return self.storage.map(key)
        data = self.storage.get(key)
        if data is None:
            raise CorruptStepError(self.where(key), "missing")
        return bytearray(data), len(data)       # writable: decoded tensors are views of it

    def read_small_tagged(self, key: str) -> Tuple[Optional[bytes], Optional[str]]:
        """(bytes, the stamp they came with) of a small file; (None, None) when there is none."""
        return self.storage.get_stamped(key)

    def read_verified(self, step: int, rel: str, size: int, checksum: str, pool: Any) -> Tuple[Any, int]:
        """File `rel` of `step` read into a buffer leased from `pool`, its size and xxh3-128 checked
        against the commit record's `size` and `checksum` in the same pass: (lease, size).
        CorruptStepError naming the file when it is missing, short, or differs."""
        return self.storage.get_verified(f"{int(step)}/{rel}", size, checksum, pool), size

    def map_verified(self, step: int, rel: str, size: int, checksum: str) -> Optional[Any]:
        """Where the storage maps files (`caps.mmap`): the file's bytes as a private mapping checked
        like `read_verified` (decoded tensors are views of it). None where it cannot: `read_verified`."""
        if not self.caps.mmap or size == 0:
            return None
        return self.storage.map_verified(f"{int(step)}/{rel}", size, checksum)

    def modified(self, key: str = "") -> Optional[float]:
        """When `key` (a step: its number; '' the namespace) last changed, where the storage records it."""
        if self.caps.directories:
            found = self.storage.stat(key)
            return None if found is None or found.mtime_ns is None else found.mtime_ns / 1e9
        times = [e.mtime_ns for e in self.storage.list(f"{key}/" if key else "") if e.mtime_ns is not None]
        return max(times) / 1e9 if times else None

    def last_read(self, step: int, rels: Iterable[str]) -> Optional[float]:
        """The newest time one of the step's files `rels` was read after it was written, where the
        storage records reads (a POSIX file's access time: with `relatime`, Linux's default, a read is
        recorded when it is the first since the file was written or a day after the last recorded one;
        on a `noatime` mount nothing is); None when it does not, or none was."""
        if not self.caps.access_times:
            return None
        times = []
        for rel in rels:
            e = self.storage.stat(f"{int(step)}/{rel}")
            if e is not None and e.atime_ns is not None and e.mtime_ns is not None and e.atime_ns > e.mtime_ns:
                times.append(e.atime_ns / 1e9)
        return max(times) if times else None

    # ---- holding it

    def lock(self, timeout: float = 0.0) -> Hold:
        """Hold the namespace for writing (`Locker.lock`); its release runs the release hooks first."""
        return _NamespaceHold(self, self.locker.lock(timeout))

    def holder(self) -> Optional[str]:
        return self.locker.holder()

    def holder_records(self) -> Optional[bool]:
        return self.locker.holder_records()

    def writable(self) -> Optional[str]:
        return self.locker.writable()

    def on_release(self, name: str, hook: Callable[[], None]) -> None:
        """Run `hook` once when this run gives the namespace back (while it is still ours)."""
        with self._hooks_guard:
            self._hooks[name] = hook

    def run_release_hooks(self) -> None:
        with self._hooks_guard:
            hooks, self._hooks = list(self._hooks.values()), {}
        for hook in hooks:
            hook()

    def put_run_marker(self, token: str) -> None:
        self.markers.put(token)

    def sees_run_marker(self, token: str, wait: float = 0.0) -> bool:
        return self.markers.sees(token, wait)

    def remove_run_marker(self, token: str) -> None:
        self.markers.remove(token)


__all__ = ["LEFTOVER", "LINK", "LINK_WHAT", "NOT_A_DIRECTORY", "Namespace", "NamespaceListing", "StepListing",
           "StoredFile"]
