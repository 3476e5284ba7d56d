"""What the startup scan finds: scan -> a frozen report. (What cleanup does about it is `cleanup`'s; where
the namespaces are, `namespaces`'.)

Scanning reads directory listings, lstat and the small commit records, and nothing changes on disk until
a plan is executed -- except the namespace index (`index`), a hint the scan rewrites when it finds it
missing, corrupt or stale. Symlinks are never followed: a step or inner directory that is a link makes
its step incomplete, and cleanup removes the link itself. The status of a step is `stepstatus.classify_step`'s
(see `stepstatus` for the four statuses). Nothing here logs: the report and the result say everything, and
the caller reports it.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Tuple

from skip_harness.store import index as _index
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import COMMIT_NAME, TIER_DIR, TMP_PREFIX, TRASH_PREFIX, Layout, parse_step_name
from skip_harness.store.namespace import Namespace, StepListing
from skip_harness.store import status as _status
from skip_harness.store.status import STATUSES, StepReport
from skip_harness.store.storage import DIR, TEMPORARY
from skip_harness.store.values import VALUES_DIR
from skip_harness.store.status import StepStatus

__all__ = ["DEBRIS_AGE_S", "STATUSES", "StepReport", "classify_step", "LeftoverEntry", "NamespaceReport",
           "scan_namespace", "stale_temporaries"]


_PARALLEL_FROM = 256      # steps; below this a scan is quick enough serially
_SCAN_THREADS = 4
_CHUNK = 256              # steps: what a full scan times to choose between classifying serially or on threads
_RETRY_EVERY = 8          # chunks: the slower way is timed again on every 8th (a cache warms and cools)


@dataclass(frozen=True)
class LeftoverEntry:
    """Debris in the namespace directory itself: a '.trash-' directory or a '.tmp-' file left by a crash."""

    path: Path
    bytes: int


@dataclass(frozen=True)
class NamespaceReport:
    layout: Layout
    steps: Tuple[StepReport, ...]          # sorted by step
    leftovers: Tuple[LeftoverEntry, ...] = ()
    index_note: Optional[str] = None       # set when the index was missing / corrupt / stale and rebuilt
    index_used: bool = False               # steps were taken from the index (their stamps matched)

    def by_status(self, status: str) -> Tuple[StepReport, ...]:
        return tuple(s for s in self.steps if s.status == status)

    @property
    def complete_steps(self) -> FrozenSet[int]:
        """Steps that can be served: complete and unverified."""
        return frozenset(s.step for s in self.steps if s.servable)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {k.value: 0 for k in STATUSES}
        for s in self.steps:
            out[s.status] += 1
        return out

    def get(self, step: int) -> Optional[StepReport]:
        for s in self.steps:
            if s.step == step:
                return s
        return None


# --------------------------------------------------------------------------------------------
# scanning


def classify_step(layout: Layout, step: int, path: Optional[Path] = None, *, namespace: Namespace,
                  listing: Optional[StepListing] = None) -> StepReport:
    """`status.classify_step` of a step of `namespace`, the layout's."""
    return _status.classify_step(layout, step, path, namespace=namespace, listing=listing)


def scan_namespace(layout: Layout, namespace: Namespace, *, use_index: bool = True,
                   rewrite_index: bool = True) -> NamespaceReport:
    """Classify every step of a namespace. Only int-named entries are steps; '.lock', '.quarantine' and
    the like are ignored; '.trash-'/'.tmp-' debris is reported as leftovers.

    With `use_index` (the default) a committed step whose index entry still matches the disk is taken
    from the index; every other step is classified in full, and an index found missing, corrupt or
    stale is rewritten (`report.index_note` says so, for the caller's INFO line). The result is the
    one a full scan (`use_index=False`, which neither reads nor writes the index) gives.

    `rewrite_index=False` (a reader beside a running job: `skip-harness view`) uses the index but never
    writes it: the steps it cannot vouch for are classified in full, and the note says it is stale.

    `namespace`: the layout's namespace, as the run or command opened it (`store.open.open_namespace`)."""
    with _gc_paused():
        return _scan_namespace(layout, namespace, use_index, rewrite_index)


@contextlib.contextmanager
def _gc_paused():
    """The scan allocates tens of thousands of small objects that all stay alive: the cyclic garbage
    collector would walk them again and again for nothing (it doubled a 10,000-step scan's time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _values_debris(namespace: Namespace, root: Path) -> List[LeftoverEntry]:
    """'.tmp-' files a run killed while it wrote a step's recorded values left in '.values/'."""
    try:
        return [LeftoverEntry(root / VALUES_DIR / e.name, e.size) for e in namespace.list_dir(VALUES_DIR)
                if e.name.startswith(TMP_PREFIX)]
    except OSError:
        return []


DEBRIS_AGE_S = 600.0     # a temporary file of a reader's record untouched this long is a killed writer's


def _writer_alive(name: str) -> bool:
    """Whether the pid a temporary file's name carries (`.tmp-{name}.{pid}.{token}`) is a live process of
    this host: its write may be in flight (stopped, say), so the file is kept whatever its age."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) <= 0:
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except OSError:                  # not ours to signal: alive
        return True
    return True


def stale_temporaries(layout: Layout, namespace: Namespace, *, older_than_s: float = DEBRIS_AGE_S,
                      now: Optional[float] = None) -> Tuple[LeftoverEntry, ...]:
    """Temporary files that writers of the records beside the steps left when they were killed: under
    `.values/runs/` (a replay's values, which readers write beside the holder) and `.tier/` (second-tier
    entries). Readers write there while the holder runs, so a temporary file is debris only when nothing
    can still be writing it: unchanged for `older_than_s` seconds (a record's write takes milliseconds;
    the file's mtime moves while it is written) and its writer's pid is not a live process of this host
    (on a shared filesystem another host's pid cannot be checked: the age decides). Only where the
    storage has temporaries (POSIX); the holder's startup removes them (`plan_cleanup`'s leftovers)."""
    if not namespace.caps.directories:
        return ()
    cutoff = (time.time() if now is None else now) - older_than_s
    out: List[LeftoverEntry] = []
    for top in (f"{VALUES_DIR}/runs", TIER_DIR):
        try:
            entries = list(namespace.storage.list(top + "/"))
        except OSError:
            continue
        for e in entries:
            name = e.key.rsplit("/", 1)[-1]
            if e.kind != TEMPORARY or not name.startswith(TMP_PREFIX):
                continue
            if e.mtime_ns is None or e.mtime_ns / 1e9 > cutoff or _writer_alive(name):
                continue
            out.append(LeftoverEntry(layout.root / e.key, e.size))
    return tuple(sorted(out, key=lambda x: str(x.path)))


def _scan_namespace(layout: Layout, namespace: Namespace, use_index: bool, rewrite_index: bool = True) -> NamespaceReport:
    if not namespace.caps.directories:
        return _scan_listed(layout, namespace, use_index, rewrite_index)
    root = layout.root
    leftovers: List[LeftoverEntry] = []
    if namespace.stat("") is None:         # no namespace yet: nothing to report, nothing written
        return NamespaceReport(layout, ())
    entries = namespace.list_dir("")
    found: List[Tuple[int, str]] = []
    for e in entries:
        step = parse_step_name(e.name)
        if step is not None:
            found.append((step, e.name))
        elif e.name.startswith(TRASH_PREFIX) or e.name.startswith(TMP_PREFIX):
            leftovers.append(LeftoverEntry(root / e.name, namespace.tree_bytes(e.name)))
        elif e.name == VALUES_DIR and e.kind == DIR:
            leftovers.extend(_values_debris(namespace, root))
    leftovers.sort(key=lambda x: x.path.name)

    if not use_index:
        steps = _classify_all(layout, namespace, found)
        return NamespaceReport(layout, tuple(sorted(steps, key=lambda s: s.step)), tuple(leftovers))

    note: Optional[str] = None
    try:
        indexed = _index.read(layout, namespace)
    except _index.IndexUnusable as exc:
        indexed, note = {}, f"index {exc}"
    trusted: Dict[int, _index.IndexEntry] = {}
    changed: List[int] = []
    if indexed:
        trusted, changed = _index.check_entries(namespace, found, indexed, layout.K)
    rest = [(step, name) for step, name in found if step not in trusted]
    fingerprints: Dict[int, Optional[Fingerprint]] = {}
    steps = [_from_entry(layout, e, fingerprints) for e in trusted.values()] + _classify_all(layout, namespace, rest)
    steps.sort(key=lambda s: s.step)

    by_step = {s.step: s for s in steps}
    stale = [s for s in changed if not (indexed[s].racy and _agrees(indexed[s], by_step[s]))]
    on_disk = set(by_step)
    gone = [s for s in indexed if s not in on_disk]
    unindexed = [s.step for s in steps if s.status == StepStatus.COMPLETE and s.step not in indexed]
    note = note or _stale_note(stale, gone, unindexed)
    if rewrite_index and (note is not None or changed):  # changed but agreeing: racy, rewritten later-stamped
        fresh = list(trusted.values())
        for s in steps:
            if s.status == StepStatus.COMPLETE and s.step not in trusted:
                fp = None if s.fingerprint is None else s.fingerprint.to_json()
                made = _index.make_entry(namespace, layout, s.step, s.bytes, fp, s.created or 0.0, s.gen_s)
                if made is not None:
                    fresh.append(made)
        failed = _index.rewrite(layout, namespace, fresh)
        if note is not None:
            note += "; rebuilt from a full scan" if failed is None else f"; could not be rebuilt: {failed}"
    return NamespaceReport(layout, tuple(steps), tuple(leftovers), note, bool(trusted))


def _scan_listed(layout: Layout, namespace: Namespace, use_index: bool = True, rewrite_index: bool = True) -> NamespaceReport:
    """A namespace without directories (an object store): one listing of every step; a committed step
    whose index entry's stamp (its objects' rel, size and ETag) matches that listing is taken from the
    entry, every other step is classified from the listing and its commit record. The index is rewritten
    once, at the end, when it was missing, damaged or stale."""
    listing = namespace.list_steps()
    listed: Dict[int, StepListing] = {s.step: s for s in listing.steps}

    def classify(s: StepListing) -> StepReport:
        return classify_step(layout, s.step, layout.step_dir(s.step), namespace=namespace, listing=s)

    if not use_index:
        return NamespaceReport(layout, tuple(classify(s) for s in listing.steps))
    note: Optional[str] = None
    try:
        indexed = _index.read(layout, namespace)
    except _index.IndexUnusable as exc:
        indexed, note = {}, f"index {exc}"
    fingerprints: Dict[int, Optional[Fingerprint]] = {}
    stamps: Dict[int, Optional[int]] = {}
    trusted: Dict[int, _index.IndexEntry] = {}
    changed: List[int] = []
    steps: List[StepReport] = []
    for s in listing.steps:
        stamp = stamps[s.step] = _index.listing_stamp(s) if s.committed else None
        entry = indexed.get(s.step)
        if entry is not None:
            if stamp is not None and stamp == entry.stamp and entry.bytes == s.total:
                try:
                    steps.append(_from_entry(layout, entry, fingerprints))
                    trusted[s.step] = entry
                    continue
                except (TypeError, ValueError, AttributeError):   # a damaged fingerprint: read the step
                    pass
            changed.append(s.step)
        steps.append(classify(s))
    steps.sort(key=lambda r: r.step)

    gone = [step for step in indexed if step not in stamps]
    fresh = list(trusted.values())
    unindexed = []
    for r in steps:
        if r.status != StepStatus.COMPLETE or r.step in trusted:
            continue
        # indexed only when the record read is the object listed (no write slipped in between)
        etag = r.record_stamp
        found = listed.get(r.step)
        stamp = stamps.get(r.step)
        if stamp is None or not etag or found is None or found.files[COMMIT_NAME].stamp != etag:
            continue
        fp = None if r.fingerprint is None else r.fingerprint.to_json()
        fresh.append(_index.url_entry(r.step, r.bytes, fp, r.created or 0.0, r.gen_s, stamp))
        if r.step not in indexed:
            unindexed.append(r.step)
    note = note or _stale_note(changed, gone, unindexed)
    if note == "index missing" and not fresh:
        note = None              # nothing to index yet: no object is written into the namespace
    if note is not None and rewrite_index:
        failed = _index.rewrite(layout, namespace, fresh)
        note += "; rebuilt from a full scan" if failed is None else f"; could not be rebuilt: {failed}"
    return NamespaceReport(layout, tuple(steps), (), note, bool(trusted))


def _stale_note(changed: List[int], gone: List[int], unindexed: List[int]) -> Optional[str]:
    """What the scan says of an index that no longer matches the namespace; None when it matches."""
    parts = [f"{len(x)} {what}" for x, what in ((changed, "changed"), (gone, "removed"), (unindexed, "unindexed")) if x]
    noun = "step" if len(changed) + len(gone) + len(unindexed) == 1 else "steps"
    return f"index stale ({', '.join(parts)} {noun})" if parts else None


def _agrees(entry: _index.IndexEntry, report: StepReport) -> bool:
    fp = None if report.fingerprint is None else report.fingerprint.to_json()
    return (report.status == StepStatus.COMPLETE and report.bytes == entry.bytes and fp == entry.fingerprint
            and report.created == entry.created and report.gen_s == entry.gen_s)


def _from_entry(layout: Layout, e: _index.IndexEntry, fingerprints: Dict[int, Optional[Fingerprint]]) -> StepReport:
    key = id(e.fingerprint)  # entries of one fingerprint share its parsed JSON
    fp = fingerprints.get(key)
    if fp is None and e.fingerprint is not None:
        fp = fingerprints[key] = Fingerprint.from_json(e.fingerprint)
    return StepReport(e.step, _child(layout.root, str(e.step)), StepStatus.COMPLETE, e.bytes, "", fp, True, True,
                      e.created, e.gen_s)


def _child(root: Path, name: str) -> Path:
    """root / name, without pathlib's parsing of `name` (a plain step number) where this Python has it."""
    make = getattr(root, "_make_child_relpath", None)
    return make(name) if make is not None else root / name


def _classify_all(layout: Layout, namespace: Namespace, found: List[Tuple[int, str]]) -> List[StepReport]:
    root = layout.root

    def classify(item: Tuple[int, str]) -> StepReport:
        return classify_step(layout, item[0], root / item[1], namespace=namespace)  # one Path per step, none per file

    if len(found) < _PARALLEL_FROM:
        return [classify(item) for item in found]
    pace = _Pace()
    out: List[StepReport] = []
    with ThreadPoolExecutor(max_workers=_SCAN_THREADS, thread_name_prefix="skip_harness-scan") as pool:
        for start in range(0, len(found), _CHUNK):
            chunk = found[start:start + _CHUNK]
            threaded = pace.threaded()
            t0 = time.perf_counter()
            out.extend(pool.map(classify, chunk) if threaded else map(classify, chunk))
            pace.took(threaded, (time.perf_counter() - t0) / len(chunk))
    return out


class _Pace:
    """Whether a full scan classifies its next chunk of steps on threads or serially: the way that took
    less a step on its last chunk. On a warm cache classifying is CPU-bound and threads only contend for
    the GIL (10,000 steps x K = 4 here: 2.9 s serially, 6.2 s on four threads); on a cold cache or a
    network filesystem every listing and stat waits, and threads overlap the waits (here 10 s serially,
    7.8 s on four). Each way is timed on a chunk first; the slower again on every `_RETRY_EVERY`th."""

    def __init__(self) -> None:
        self.chunks = 0
        self.per_step: Dict[bool, float] = {}      # threaded? -> seconds a step on its last chunk

    def threaded(self) -> bool:
        self.chunks += 1
        if len(self.per_step) < 2:
            return False in self.per_step           # serially first, then on threads
        faster = self.per_step[True] < self.per_step[False]
        return not faster if self.chunks % _RETRY_EVERY == 0 else faster

    def took(self, threaded: bool, seconds_a_step: float) -> None:
        self.per_step[threaded] = seconds_a_step
