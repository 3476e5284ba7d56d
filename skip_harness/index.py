"""The namespace index: a hint that makes the startup scan cost milliseconds, never the truth.

`{namespace}/.index.jsonl` holds a header line and one JSON line per committed step, appended (and
fsync'ed) by `StepStore.commit` after the step's commit record is durable. A line records what the
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

This module does no logging and imports nothing from `store` or `scan`.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from skip_harness.layout import COMMIT_NAME, TMP_PREFIX, Layout

INDEX_NAME = ".index.jsonl"
INDEX_FORMAT = 1
RACY_NS = 250_000_000          # mtimes this close to the entry's own writing are rechecked (> any local fs tick)

Stamp = Tuple[Any, ...]


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

    def to_line(self) -> str:
        return json.dumps({"s": self.step, "b": self.bytes, "f": self.fingerprint, "c": self.created,
                           "g": self.gen_s, "t": _stamp_json(self.stamp), "w": self.written_ns},
                          separators=(",", ":"), allow_nan=False) + "\n"

    @property
    def racy(self) -> bool:
        return _max_mtime(self.stamp) >= self.written_ns - RACY_NS


class IndexUnusable(Exception):
    """The index file is missing or cannot be trusted at all; the message says which and why."""


def index_path(layout: Layout) -> str:
    return os.path.join(os.fspath(layout.root), INDEX_NAME)


def _header(layout: Layout) -> str:
    return json.dumps({"skip_harness_index": INDEX_FORMAT, "K": layout.K, "W": layout.W},
                      separators=(",", ":")) + "\n"


# --------------------------------------------------------------------------------------------
# stamps


def _stamp_json(stamp: Stamp) -> List[Any]:
    return [list(x) if isinstance(x, tuple) else x for x in stamp]


def _max_mtime(stamp: Stamp) -> int:
    step_dir, commit, inner = stamp
    return max([step_dir[1], commit[2], *(m for _ino, m in inner)])


def read_stamp(root_fd: int, name: str, K: int) -> Optional[Stamp]:
    """The stamp of step directory `name` in the namespace directory root_fd, None if any part of it is
    missing or not what a committed step has (a link, a file where a directory belongs)."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        if not _is_dir(st.st_mode):
            return None
        commit = os.stat(f"{name}/{COMMIT_NAME}", dir_fd=root_fd, follow_symlinks=False)
        if not _is_reg(commit.st_mode):
            return None
        inner: List[Tuple[int, int]] = []
        if K > 1:
            for i in range(K):
                ist = os.stat(f"{name}/{i}", dir_fd=root_fd, follow_symlinks=False)
                if not _is_dir(ist.st_mode):
                    return None
                inner.append((ist.st_ino, ist.st_mtime_ns))
    except OSError:
        return None
    return ((st.st_ino, st.st_mtime_ns), (commit.st_ino, commit.st_size, commit.st_mtime_ns), tuple(inner))


def _is_dir(mode: int) -> bool:
    return (mode & 0o170000) == 0o040000


def _is_reg(mode: int) -> bool:
    return (mode & 0o170000) == 0o100000


def _parse_stamp(doc: Any, K: int) -> Stamp:
    step_dir, commit, inner = doc
    if len(step_dir) != 2 or len(commit) != 3 or len(inner) != (K if K > 1 else 0):
        raise ValueError("stamp of the wrong shape")
    ints = [*step_dir, *commit, *(x for pair in inner for x in pair)]
    if not all(type(x) is int for x in ints) or any(len(pair) != 2 for pair in inner):
        raise ValueError("stamp holds a non-integer")
    return (tuple(step_dir), tuple(commit), tuple(tuple(p) for p in inner))


def make_entry(layout: Layout, step: int, nbytes: int, fingerprint: Optional[Dict[str, Any]],
               created: float, gen_s: Optional[float]) -> Optional[IndexEntry]:
    """An entry for a step as it is on disk now (None if its stamp cannot be read)."""
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
    return IndexEntry(step, nbytes, fingerprint, created, gen_s, stamp, time.time_ns())


# --------------------------------------------------------------------------------------------
# reading and writing


def read(layout: Layout) -> Dict[int, IndexEntry]:
    """{step: its latest entry}. IndexUnusable if the file is missing, for another K/W, or any line of
    it does not parse (a torn append included: the index is then rebuilt)."""
    path = index_path(layout)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise IndexUnusable("missing") from None
    except OSError as exc:
        raise IndexUnusable(f"cannot be opened: {exc.strerror or exc}") from None
    try:
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as exc:
        raise IndexUnusable(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    if not lines or lines[0] + b"\n" != _header(layout).encode():
        raise IndexUnusable("corrupt: unexpected header (another format, K or W)")
    if lines[-1] != b"":
        raise IndexUnusable("corrupt: the last line is cut short (an interrupted append)")
    out: Dict[int, IndexEntry] = {}
    K = layout.K
    for n, line in enumerate(lines[1:-1], start=2):
        try:
            doc = json.loads(line)
            step, nbytes, created, gen_s, written = doc["s"], doc["b"], doc["c"], doc["g"], doc["w"]
            fp = doc["f"]
            if (type(step) is not int or step < 0 or type(nbytes) is not int or nbytes < 0
                    or type(written) is not int or not isinstance(created, (int, float))
                    or not (gen_s is None or isinstance(gen_s, (int, float)))
                    or not (fp is None or isinstance(fp, dict))):
                raise ValueError("a field has the wrong type")
            out[step] = IndexEntry(step, nbytes, fp, float(created), None if gen_s is None else float(gen_s),
                                   _parse_stamp(doc["t"], K), written)
        except (ValueError, KeyError, TypeError) as exc:
            raise IndexUnusable(f"corrupt: line {n} does not parse ({exc})") from None
    return out


def append(layout: Layout, entry: Optional[IndexEntry]) -> bool:
    """Append one entry durably (creating the index with its header if there is none). Returns False
    if it could not be written: the index is a hint, and the next scan finds the step anyway."""
    if entry is None:
        return False
    path = index_path(layout)
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags)
            data = entry.to_line().encode()
        except FileNotFoundError:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            data = (_header(layout) + entry.to_line()).encode()
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def rewrite(layout: Layout, entries: Iterable[IndexEntry]) -> Optional[str]:
    """Replace the index atomically with `entries`. None on success, else why it could not be written."""
    root = os.fspath(layout.root)
    tmp = os.path.join(root, f"{TMP_PREFIX}{INDEX_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    body = _header(layout) + "".join(e.to_line() for e in sorted(entries, key=lambda e: e.step))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, body.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, index_path(layout))
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return exc.strerror or str(exc)
    return None


def remove(layout: Layout) -> None:
    """Delete the index (tests, and callers that want the next scan to be a full one)."""
    try:
        os.unlink(index_path(layout))
    except FileNotFoundError:
        pass


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
        if name != str(step) or entry.racy or read_stamp(root_fd, name, K) != entry.stamp:
            changed.append(step)
        else:
            trusted[step] = entry
    return trusted, changed
