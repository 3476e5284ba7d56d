"""The namespace index: a hint that makes the startup scan cost milliseconds, never the truth.

`{namespace}/.index.jsonl` holds a header line and one JSON line per committed step, appended by
`StepWriter.commit` after the step's commit record is durable (not fsync'ed: a tail lost or torn by a
crash is a corrupt or stale index, read in full and rewritten by the next scan). A line records what the
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
once (`rewrite`) when it found it missing, damaged or stale, and a run adds the steps it committed
once, when it gives its lease back (`flush`, a release hook of the namespace). A killed run's steps are
read in full once, at the next startup, and are indexed from then on.

Which of the two: a storage with real directories (`caps.directories`) gets directory stamps, any other
listing stamps; one that can append (`caps.append`) gets a line a commit, any other the rewrite at
release. This module logs only a failed rewrite at release (no caller is left to) and never imports the scan (`scan` imports it). It reads and writes
through the namespace (`store.namespace`), never a file.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import xxhash

from skip_harness.errors import CorruptStepError
from skip_harness.store.commit import parse_commit
from skip_harness.store.layout import COMMIT_NAME, Layout
from skip_harness.store.namespace import Namespace
from skip_harness.store.storage import DIR, FILE

logger = logging.getLogger("skip_harness.store.index")

INDEX_KEY = ".index.jsonl"
INDEX_NAME = INDEX_KEY
INDEX_FORMAT = 1
RACY_NS = 250_000_000          # mtimes this close to the entry's own writing are rechecked (> any local fs tick)

URL_STAMP = "etag"   # an object-store index's stamps: xxh3_64 over each object's (rel, size, ETag)

Stamp = int   # xxh3_64 of the change stamps of the step directory, its commit record and each inner directory


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


def _header(layout: Layout, namespace: Namespace) -> str:
    doc: Dict[str, Any] = {"skip_harness_index": INDEX_FORMAT, "K": layout.K, "W": layout.W}
    if not namespace.caps.directories:
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


def read_stamp(namespace: Namespace, name: str, K: int) -> Optional[Tuple[Stamp, int]]:
    """(stamp, newest mtime) of step directory `name`, from the change stamps of its directory, its commit
    record and its inner directories (`Storage.stamps_many`); None if any part of it is missing or not what a
    committed step has (a link, a file where a directory belongs)."""
    return read_stamps(namespace, [name], K)[0]


def read_stamps(namespace: Namespace, names: Sequence[str], K: int) -> List[Optional[Tuple[Stamp, int]]]:
    """`read_stamp` of each step directory in `names`, with one call to the storage
    (`Storage.stamps_many`)."""
    suffixes = _stamp_suffixes(K)
    return namespace.storage.stamps_many(names, suffixes, _stamp_kinds(len(suffixes)))


@functools.lru_cache(maxsize=16)
def _stamp_suffixes(K: int) -> Tuple[str, ...]:
    return ("", _COMMIT_SUFFIX) + (_inner_suffixes(K) if K > 1 else ())


@functools.lru_cache(maxsize=16)
def _stamp_kinds(n: int) -> Tuple[str, ...]:
    return (DIR, FILE) + (DIR,) * (n - 2)


_COMMIT_SUFFIX = "/" + COMMIT_NAME


@functools.lru_cache(maxsize=16)
def _inner_suffixes(K: int) -> Tuple[str, ...]:
    return tuple(f"/{i}" for i in range(K))


def make_entry(namespace: Namespace, layout: Layout, step: int, nbytes: int, fingerprint: Optional[Dict[str, Any]],
               created: float, gen_s: Optional[float]) -> Optional[IndexEntry]:
    """An entry for a step as it is stored now (None if its stamp cannot be read): directory stamps
    where the storage has directories, else the stamp of its listing."""
    if not namespace.caps.directories:
        listing = namespace.list_step(step)
        return None if listing is None else url_entry(step, nbytes, fingerprint, created, gen_s, listing_stamp(listing))
    stamp = read_stamp(namespace, str(step), layout.K)
    if stamp is None:
        return None
    return IndexEntry(step, nbytes, fingerprint, created, gen_s, stamp[0], time.time_ns(), stamp[1])


# --------------------------------------------------------------------------------------------
# reading and writing


def read(layout: Layout, namespace: Namespace) -> Dict[int, IndexEntry]:
    """{step: its latest entry}, read through the namespace. IndexUnusable if it is missing, cannot be
    read, is for another K/W or stamp kind, or any line of it does not parse (a torn append included:
    the index is then rebuilt)."""
    try:
        data = namespace.read_small(INDEX_KEY)
    except Exception as exc:  # OSError, a symlink (CorruptStepError), ObjectStoreError: only a hint
        raise IndexUnusable(f"cannot be read: {exc}") from None
    if data is None:
        raise IndexUnusable("missing")
    return parse(layout, namespace, bytes(data))


def parse(layout: Layout, namespace: Namespace, data: bytes) -> Dict[int, IndexEntry]:
    """{step: its latest entry} from the index's bytes; IndexUnusable when they cannot be trusted."""
    header = _header(layout, namespace).encode()
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


class IndexWriter:
    """What one step store's commits add to its namespace's index (its `StepWriter` owns one): a line
    appended at each commit where the storage appends, else the steps committed, remembered for the one
    rewrite when the run gives the namespace back (`flush`, a release hook of the namespace). It reads and
    writes through the namespace (fenced like every write), never a file. Safe to call from several
    threads."""

    def __init__(self, layout: Layout, namespace: Namespace):
        self.layout, self.namespace = layout, namespace
        self._guard = threading.Lock()
        self._committed: Dict[int, Tuple[bytes, str]] = {}   # a storage without append: step -> (record, stamp)
        self._appended: Optional[Tuple[Optional[str], Optional[str]]] = None   # (the index's stamp after our append, fp key)

    def committed(self, step: int, record: Any, record_bytes: bytes, stamp: str) -> None:
        """What a commit adds to the index (`StepWriter.commit`, after the commit record is durable): a line
        appended now where the storage appends, else the step remembered for `flush`. Never raises: a hint."""
        namespace, layout = self.namespace, self.layout
        if not namespace.caps.append:
            with self._guard:
                self._committed[int(step)] = (bytes(record_bytes), stamp)
            namespace.on_release(f"index-{id(self)}", self._flush_quietly)
            return
        fp = None if record.fingerprint is None else record.fingerprint.to_json()
        try:
            entry = make_entry(namespace, layout, step, record.nbytes, fp, record.created, record.gen_s)
        except (OSError, CorruptStepError):
            return
        self.append(entry)

    def append(self, entry: Optional[IndexEntry]) -> bool:
        """Append one entry (creating the index with its header if there is none, and writing the
        entry's fingerprint line unless our previous append to it did). Returns False if it could not be
        written: the index is a hint, and the next scan finds the step anyway."""
        namespace, layout = self.namespace, self.layout
        if entry is None or not namespace.caps.append:
            return False
        key = entry.fingerprint_key()
        with self._guard:
            try:
                found = namespace.stat(INDEX_KEY)
                prefix = "" if found is not None else _header(layout, namespace)
                if key is not None and (found is None or self._appended != (found.stamp, key)):
                    prefix += _fp_line(key, entry.fingerprint)
                namespace.append_small(INDEX_KEY, (prefix + _entry_line(entry)).encode())
                after = namespace.stat(INDEX_KEY)
                self._appended = (None if after is None else after.stamp, key)
            except (OSError, CorruptStepError):
                self._appended = None
                return False
        return True

    def flush(self) -> Optional[str]:
        """Add the steps committed through this writer to the index (a storage without append): one read
        of the index, one listing, one write (nothing when it committed nothing). An entry is made only for
        a step whose listed commit record has the stamp our put returned and lists exactly the sizes
        listed. Returns None when written (or nothing to do), else why not. Never raises: a hint."""
        with self._guard:
            committed_steps, self._committed = self._committed, {}
        return _flush(self.namespace, self.layout, committed_steps)

    def _flush_quietly(self) -> None:
        why = self.flush()
        if why is not None:
            logger.info(
                "%s: the namespace index was not updated (%s): the next startup reads the commit records of this "
                "run's steps", self.namespace.url, why)


def rewrite(layout: Layout, namespace: Namespace, entries: Iterable[IndexEntry]) -> Optional[str]:
    """Replace the index atomically with `entries`. None on success, else why it could not be written."""
    try:
        namespace.write_small(INDEX_KEY, render(layout, namespace, entries))   # temp + fsync + rename + dir fsync; one PUT
    except Exception as exc:  # noqa: BLE001 - OSError, an object store's error: only a hint
        return getattr(exc, "strerror", None) or str(exc)
    return None


def drop(layout: Layout, namespace: Namespace, steps: Iterable[int]) -> None:
    """Forget `steps` (removed by cleanup), so the next scan does not find the index stale. Best effort."""
    gone = set(steps)
    if not gone or not namespace.caps.directories:
        return
    try:
        entries = read(layout, namespace)
    except IndexUnusable:
        return
    if gone & set(entries):
        rewrite(layout, namespace, [e for s, e in entries.items() if s not in gone])


def remove(namespace: Namespace) -> None:
    """Delete the index (tests and benchmarks that want the next scan to be a full one)."""
    namespace.remove(INDEX_KEY)


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


def render(layout: Layout, namespace: Namespace, entries: Iterable[IndexEntry]) -> bytes:
    """The whole index (header, fingerprint lines, one line per entry in step order) as bytes."""
    parts = [_header(layout, namespace)]
    seen = set()
    for e in sorted(entries, key=lambda e: e.step):
        key = e.fingerprint_key()
        if key is not None and key not in seen:
            seen.add(key)
            parts.append(_fp_line(key, e.fingerprint))
        parts.append(_entry_line(e))
    return "".join(parts).encode()


def check_entries(namespace: Namespace, names: Sequence[Tuple[int, str]], entries: Dict[int, IndexEntry],
                  K: int) -> Tuple[Dict[int, IndexEntry], List[int]]:
    """Split the steps found: ({step: entry} whose stamps match and are not racy, [steps with an entry
    that no longer matches or is racy]). Steps without an entry are in neither."""
    trusted: Dict[int, IndexEntry] = {}
    changed: List[int] = []
    known = [(step, name, entries[step]) for step, name in names if step in entries]
    stamps = read_stamps(namespace, [name for _, name, _ in known], K)
    for (step, _, entry), stamp in zip(known, stamps):
        if stamp is None or stamp[0] != entry.stamp or entry.racy or stamp[1] != entry.newest_mtime_ns:
            changed.append(step)
        else:
            trusted[step] = entry
    return trusted, changed


# --------------------------------------------------------------------------------------------
# the rewrite at release (a storage without append)


def _flush(namespace: Namespace, layout: Layout, committed_steps: Dict[int, Tuple[bytes, str]]) -> Optional[str]:
    if not committed_steps:
        return None
    try:
        data = namespace.read_small(INDEX_KEY)           # an outage ends the flush here, not after more timeouts
        try:
            entries = {} if data is None else parse(layout, namespace, bytes(data))
        except IndexUnusable:
            entries = {}
        listed = {s.step: s for s in namespace.list_steps().steps}
        for step, (record, stamp) in committed_steps.items():
            entries.pop(step, None)
            s = listed.get(step)
            stored = None if s is None else s.files.get(COMMIT_NAME)
            if stored is None or not stamp or stored.stamp != stamp:
                continue                    # rewritten or removed since: the next scan reads it
            try:
                rec = parse_commit(record, layout, step, namespace.where(f"{step}/{COMMIT_NAME}"))
            except CorruptStepError:
                continue
            if any(s.files.get(f.rel) is None or s.files[f.rel].size != f.bytes for f in rec.files):
                continue
            fp = None if rec.fingerprint is None else rec.fingerprint.to_json()
            entries[step] = url_entry(step, s.total, fp, rec.created, rec.gen_s, listing_stamp(s))
        entries = {k: e for k, e in entries.items() if k in listed}
    except Exception as exc:  # noqa: BLE001 - an object store's error, a bad index: only a hint
        return str(exc)
    return rewrite(layout, namespace, entries.values())
