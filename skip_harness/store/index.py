"""The namespace index: a hint that makes the startup scan cost milliseconds, never the truth.

`{namespace}/.index.jsonl` holds a header line and one JSON line per committed step, appended (and
fsync'ed) by `StepWriter.commit` after the step's commit record is durable. A line records what the
full scan would report for the step (bytes, fingerprint, creation time, generation seconds) and a
*stamp*: inode and mtime of the step directory and of each inner directory, and inode, size and mtime
of the commit record. Any change to a step's directory entries (a commit record removed or rewritten,
an inner directory or a file added, removed or renamed, the step replaced) changes its stamp.

`scan.scan_namespace` lists the namespace once, takes a step's report from its line only while the
stamp still matches the disk (one lstat per directory and one of the commit record), and classifies
every other step in full. A missing, corrupt or stale index is rewritten from that result. Like git's
index, an entry stamped within `RACY_NS` of its own writing is not trusted (a change made in the same
clock tick as the commit would leave the mtime unchanged); it is checked in full and then rewritten.

What the index cannot see -- a file rewritten in place, or truncated, without touching its directory --
the scan's size check would have seen; the harness verifies sizes and checksums of a step before it
serves it, and `skip-harness verify` reads every checksum, so the index can cost a wasted startup
decision but never a wrong batch.

On an object store (`layout.is_url`) the same entries live in one object, `{namespace}/.index.jsonl`,
under a header that says its stamps are ETags (an index of the other kind is ignored). A step's stamp
there is a hash over its listed objects' (rel, size, ETag) -- taken from the one LIST the scan does
anyway -- and an entry is made only when the commit record read had the ETag the listing gave, so an
entry describes exactly the objects its stamp covers. There is no append: commits do not touch it
(`append`, `make_entry` and `drop` do nothing for a URL): the startup scan rewrites the whole object
once (`write_url`) when it found it missing, damaged or stale, and a run adds the steps it committed
once, when it gives its lease back (`ObjectNamespace.flush_index`). A killed run's steps are read in
full once, at the next startup, and are indexed from then on.

This module does no logging and never imports the scan (`scan` imports it). It reads and writes through
the namespace's backend (`store.backend`, `store.posix.backend`); the storage redesign moves that behind
the storage interface.
"""
from __future__ import annotations

import functools
import json
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import xxhash

from skip_harness.store.backend import INDEX_KEY
from skip_harness.store.layout import COMMIT_NAME, Layout
from skip_harness.store.posix.backend import PosixNamespace

INDEX_NAME = INDEX_KEY
INDEX_FORMAT = 1
RACY_NS = 250_000_000          # mtimes this close to the entry's own writing are rechecked (> any local fs tick)

URL_STAMP = "etag"   # an object-store index's stamps: xxh3_64 over each object's (rel, size, ETag)

Stamp = int   # xxh3_64 of (step dir ino, mtime_ns, commit ino, size, mtime_ns, each inner dir's ino, mtime_ns)


@dataclass(frozen=True)
class IndexEntry:
    """What the index knows of one committed step (everything the scan reports for a complete step)."""

    step: int
    bytes: int
    fingerprint: Optional[Dict[str, Any]]   # the commit record's fingerprint JSON
    created: float
    gen_s: Optional[float]
    stamp: Stamp
    written_ns: int                          # when the entry was made (the racy-stamp check)
    newest_mtime_ns: int                     # the newest mtime the stamp covers

    @property
    def racy(self) -> bool:
        return self.newest_mtime_ns >= self.written_ns - RACY_NS

    def fingerprint_key(self) -> Optional[str]:
        fp = self.fingerprint
        return None if fp is None else str(fp.get("digest") or json.dumps(fp, sort_keys=True))


class IndexUnusable(Exception):
    """The index file is missing or cannot be trusted at all; the message says which and why."""


def index_path(layout: Layout) -> str:
    return os.path.join(os.fspath(layout.root), INDEX_NAME)


def _header(layout: Layout) -> str:
    doc: Dict[str, Any] = {"skip_harness_index": INDEX_FORMAT, "K": layout.K, "W": layout.W}
    if layout.is_url:
        doc["stamp"] = URL_STAMP      # a POSIX index (inode stamps) copied into a bucket is not this one
    return json.dumps(doc, separators=(",", ":")) + "\n"


# Lines after the header: a fingerprint line {"fp": key, "v": fingerprint JSON} before the first entry
# that uses it, and one entry line per commit, a flat JSON array:
#     [step, bytes, created, gen_s | null, fingerprint key | null, stamp, written_ns, newest mtime_ns]


def _entry_line(e: IndexEntry) -> str:
    return json.dumps([e.step, e.bytes, e.created, e.gen_s, e.fingerprint_key(), e.stamp, e.written_ns,
                       e.newest_mtime_ns], separators=(",", ":"), allow_nan=False) + "\n"


def _fp_line(key: str, fp: Dict[str, Any]) -> str:
    return json.dumps({"fp": key, "v": fp}, separators=(",", ":"), allow_nan=False) + "\n"


# --------------------------------------------------------------------------------------------
# stamps


def read_stamp(root_fd: int, name: str, K: int) -> Optional[Tuple[Stamp, int]]:
    """(stamp, newest mtime) of step directory `name` in the namespace directory root_fd, None if any part
    of it is missing or not what a committed step has (a link, a file where a directory belongs)."""
    stat_at = os.stat
    try:
        st = stat_at(name, dir_fd=root_fd, follow_symlinks=False)
        commit = stat_at(name + _COMMIT_SUFFIX, dir_fd=root_fd, follow_symlinks=False)
        if (st.st_mode & 0o170000) != 0o040000 or (commit.st_mode & 0o170000) != 0o100000:
            return None
        values = [st.st_ino, st.st_mtime_ns, commit.st_ino, commit.st_size, commit.st_mtime_ns]
        newest = max(st.st_mtime_ns, commit.st_mtime_ns)
        if K > 1:
            for suffix in _inner_suffixes(K):
                ist = stat_at(name + suffix, dir_fd=root_fd, follow_symlinks=False)
                if (ist.st_mode & 0o170000) != 0o040000:
                    return None
                values += (ist.st_ino, ist.st_mtime_ns)
                if ist.st_mtime_ns > newest:
                    newest = ist.st_mtime_ns
        return xxhash.xxh3_64_intdigest(_pack_stamp(len(values)).pack(*values)), newest
    except (OSError, ValueError, struct.error):
        return None


_COMMIT_SUFFIX = "/" + COMMIT_NAME


@functools.lru_cache(maxsize=16)
def _inner_suffixes(K: int) -> Tuple[str, ...]:
    return tuple(f"/{i}" for i in range(K))


@functools.lru_cache(maxsize=16)
def _pack_stamp(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


def make_entry(layout: Layout, step: int, nbytes: int, fingerprint: Optional[Dict[str, Any]],
               created: float, gen_s: Optional[float]) -> Optional[IndexEntry]:
    """An entry for a step as it is on disk now (None if its stamp cannot be read; an object store
    keeps no index)."""
    if layout.is_url:
        return None
    try:
        root_fd = os.open(layout.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        stamp = read_stamp(root_fd, str(step), layout.K)
    finally:
        os.close(root_fd)
    if stamp is None:
        return None
    return IndexEntry(step, nbytes, fingerprint, created, gen_s, stamp[0], time.time_ns(), stamp[1])


# --------------------------------------------------------------------------------------------
# reading and writing


def read(layout: Layout, backend: Any = None) -> Dict[int, IndexEntry]:
    """{step: its latest entry}, read through the namespace's backend (`read_index`; the POSIX one
    unless `backend` is given -- an object store's index is one object). IndexUnusable if it is
    missing, cannot be read, is for another K/W or stamp kind, or any line of it does not parse (a torn
    append included: the index is then rebuilt)."""
    backend = backend if backend is not None else PosixNamespace(layout)
    try:
        data = backend.read_index()
    except Exception as exc:  # OSError, a symlink (CorruptStepError), ObjectStoreError: only a hint
        raise IndexUnusable(f"cannot be read: {exc}") from None
    if data is None:
        raise IndexUnusable("missing")
    return parse(layout, bytes(data))


def parse(layout: Layout, data: bytes) -> Dict[int, IndexEntry]:
    """{step: its latest entry} from the index's bytes; IndexUnusable when they cannot be trusted."""
    header = _header(layout).encode()
    if not data.startswith(header):
        raise IndexUnusable("corrupt: unexpected header (another format, K or W)")
    if not data.endswith(b"\n"):
        raise IndexUnusable("corrupt: the last line is cut short (an interrupted append)")
    body = data[len(header):].rstrip(b"\n")
    try:
        lines = json.loads(b"[" + body.replace(b"\n", b",") + b"]") if body else []
    except (ValueError, RecursionError) as exc:
        raise IndexUnusable(f"corrupt: does not parse ({exc})") from None
    fps: Dict[str, Dict[str, Any]] = {}
    out: Dict[int, IndexEntry] = {}
    for n, line in enumerate(lines, start=2):
        if type(line) is dict and type(line.get("fp")) is str and type(line.get("v")) is dict:
            fps[line["fp"]] = line["v"]
            continue
        # A stamp that is malformed can only fail to match the disk; the fields reported are checked.
        if (type(line) is not list or len(line) != 8 or type(line[0]) is not int or line[0] < 0
                or type(line[1]) is not int or type(line[2]) not in (int, float)
                or type(line[3]) not in (int, float, type(None))
                or not (line[4] is None or (type(line[4]) is str and line[4] in fps))
                or type(line[5]) is not int or type(line[6]) is not int or type(line[7]) is not int):
            raise IndexUnusable(f"corrupt: line {n} is not an index entry")
        step, nbytes, created, gen_s, fpkey, stamp, written, newest = line
        out[step] = IndexEntry(step, nbytes, None if fpkey is None else fps[fpkey], float(created),
                               None if gen_s is None else float(gen_s), stamp, written, newest)
    return out


_appended: Dict[str, Tuple[int, int, Optional[str]]] = {}   # path -> (inode, size, fingerprint key) after our append
_append_lock = threading.Lock()


def append(layout: Layout, entry: Optional[IndexEntry]) -> bool:
    """Append one entry durably (creating the index with its header if there is none, and writing the
    entry's fingerprint line unless this process's previous append to the same file did). Returns False
    if it could not be written: the index is a hint, and the next scan finds the step anyway."""
    if entry is None or layout.is_url:
        return False
    path = index_path(layout)
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    key = entry.fingerprint_key()
    with _append_lock:
        try:
            try:
                fd = os.open(path, flags)
                prefix = ""
            except FileNotFoundError:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                prefix = _header(layout)
            try:
                st = os.fstat(fd)
                if key is not None and _appended.get(path) != (st.st_ino, st.st_size, key):
                    prefix += _fp_line(key, entry.fingerprint)
                data = (prefix + _entry_line(entry)).encode()
                os.write(fd, data)
                os.fsync(fd)
                _appended[path] = (st.st_ino, st.st_size + len(data), key)
            finally:
                os.close(fd)
        except OSError:
            _appended.pop(path, None)
            return False
    return True


def rewrite(layout: Layout, entries: Iterable[IndexEntry]) -> Optional[str]:
    """Replace the index atomically with `entries`. None on success, else why it could not be written."""
    data = render(layout, entries)
    try:
        PosixNamespace(layout).write_index(data)   # temp + fsync + rename + dir fsync
    except OSError as exc:
        return exc.strerror or str(exc)
    with _append_lock:
        _appended.pop(index_path(layout), None)
    return None


def drop(layout: Layout, steps: Iterable[int]) -> None:
    """Forget `steps` (removed by cleanup), so the next scan does not find the index stale. Best effort."""
    gone = set(steps)
    if not gone or layout.is_url:
        return
    try:
        entries = read(layout)
    except IndexUnusable:
        return
    if gone & set(entries):
        rewrite(layout, [e for s, e in entries.items() if s not in gone])


def remove(layout: Layout) -> None:
    """Delete the index (tests, and callers that want the next scan to be a full one)."""
    try:
        os.unlink(index_path(layout))
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------------------------
# an object store's index


def listing_stamp(listing: Any) -> Stamp:
    """The stamp of a step on an object store, from its listing (a `StepListing`): xxh3_64 over every
    object's (rel, size, ETag), sorted by rel. Any object added, removed, rewritten or resized changes
    it; an ETag is the object's content hash (or a per-write value), never an mtime, so no entry is
    racy."""
    h = xxhash.xxh3_64()
    for rel in sorted(listing.files):
        f = listing.files[rel]
        h.update(json.dumps([rel, int(f.size), str(f.stamp)], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.intdigest()


def url_entry(step: int, nbytes: int, fingerprint: Optional[Dict[str, Any]], created: float,
              gen_s: Optional[float], stamp: Stamp) -> IndexEntry:
    """An object-store entry (`newest_mtime_ns` 0: never racy)."""
    return IndexEntry(step, nbytes, fingerprint, created, gen_s, stamp, time.time_ns(), 0)


def write_url(layout: Layout, backend: Any, entries: Iterable[IndexEntry]) -> Optional[str]:
    """Replace the index object with `entries` (one PUT through `backend.write_index`). None on
    success, else why it could not be written (read-only credential, outage)."""
    try:
        backend.write_index(render(layout, entries))
    except Exception as exc:  # a hint that could not be written: the next scan reads the steps
        return str(exc)
    return None


def render(layout: Layout, entries: Iterable[IndexEntry]) -> bytes:
    """The whole index (header, fingerprint lines, one line per entry in step order) as bytes."""
    parts = [_header(layout)]
    seen = set()
    for e in sorted(entries, key=lambda e: e.step):
        key = e.fingerprint_key()
        if key is not None and key not in seen:
            seen.add(key)
            parts.append(_fp_line(key, e.fingerprint))
        parts.append(_entry_line(e))
    return "".join(parts).encode()


def check_entries(root_fd: int, names: Sequence[Tuple[int, str]], entries: Dict[int, IndexEntry],
                  K: int) -> Tuple[Dict[int, IndexEntry], List[int]]:
    """Split the steps found on disk: ({step: entry} whose stamps match and are not racy, [steps with an
    entry that no longer matches or is racy]). Steps without an entry are in neither."""
    trusted: Dict[int, IndexEntry] = {}
    changed: List[int] = []
    for step, name in names:
        entry = entries.get(step)
        if entry is None:
            continue
        stamp = read_stamp(root_fd, name, K)
        if stamp is None or stamp[0] != entry.stamp or entry.racy or stamp[1] != entry.newest_mtime_ns:
            changed.append(step)
        else:
            trusted[step] = entry
    return trusted, changed
