"""What the startup scan finds, and what cleanup will do about it.

Scan -> frozen report; plan -> frozen plan with its expected freed size; `plan.execute()` -> result.
Scanning only reads (directory listings, lstat, the small commit records); nothing changes on disk
until a plan is executed. Symlinks are never followed: a step or inner directory that is a link
makes its step incomplete, and cleanup removes the link itself.

Status of a step (K and W come from the Layout):
- complete:   commit.json parses, its K/W match, it lists every needed file, and every file it lists is
              a regular file with the listed size (checksums are read by `StepStore.verify` only);
- corrupt:    commit.json exists but does not parse / validate, or a listed file is missing or has
              another size;
- unverified: no commit.json, but each needed payload and meta file is there (for K = 1 the
              `{step}/0/` form counts too), no temporary files, and the files were not written by
              skip_harness itself (an older cache; our own uncommitted writes are interrupted ones);
- incomplete: anything else.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Tuple

from skip_harness import store as _store
from skip_harness.errors import ConfigError, CorruptStepError
from skip_harness.fingerprint import Fingerprint
from skip_harness.layout import (
    COMMIT_NAME,
    TMP_PREFIX,
    TRASH_PREFIX,
    Layout,
    parse_namespace_leaf,
    parse_step_name,
)

logger = logging.getLogger("skip_harness.scan")

STATUSES = ("complete", "unverified", "incomplete", "corrupt")
CLEANUP_ACTIONS = ("delete", "quarantine", "off")
_PARALLEL_FROM = 256      # steps; below this a scan is quick enough serially
_SCAN_THREADS = 4


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

    @property
    def servable(self) -> bool:
        return self.status in ("complete", "unverified")


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
        out = {k: 0 for k in STATUSES}
        for s in self.steps:
            out[s.status] += 1
        return out

    def get(self, step: int) -> Optional[StepReport]:
        for s in self.steps:
            if s.step == step:
                return s
        return None


# --------------------------------------------------------------------------------------------
# classification


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


def classify_step(layout: Layout, step: int) -> StepReport:
    """The status of one step, from directory listings and lstat (plus its small commit record)."""
    return _classify(layout, step, layout.step_dir(step))


def _classify(layout: Layout, step: int, path: Path) -> StepReport:
    spath = str(path)

    def report(status: str, nbytes: int, reason: str, fp: Optional[Fingerprint] = None,
               has_commit: bool = False, exists: bool = True) -> StepReport:
        return StepReport(step, path, status, nbytes, reason, fp, has_commit, exists)

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
                record = _store.parse_commit(f.read(), layout, step, commit_path)
        except CorruptStepError as exc:
            return report("corrupt", nbytes, exc.reason, has_commit=True)
        except OSError as exc:
            return report("corrupt", nbytes, f"commit record cannot be read: {exc}", has_commit=True)
        for entry in record.files:
            size = listing.files.get(entry.rel)
            if size is None:
                return report("corrupt", nbytes, f"{entry.rel} (listed in the commit record) is missing",
                              record.fingerprint, True)
            if size != entry.bytes:
                return report("corrupt", nbytes,
                              f"{entry.rel} has {size} bytes, the commit record says {entry.bytes}",
                              record.fingerprint, True)
        return report("complete", nbytes, "", record.fingerprint, True)

    if listing.temps:
        return report("incomplete", nbytes, f"temporary file {_first(listing.temps)} (an interrupted write)")
    files = listing.files
    missing: List[str] = []
    empty: List[str] = []
    metas: List[str] = []
    for _i, r, prel, mrel in _store.expected_rels(layout):
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
    return isinstance(doc, dict) and doc.get("writer") == _store.WRITER_NAME


def scan_namespace(layout: Layout) -> NamespaceReport:
    """Classify every step of a namespace (read-only). Only int-named entries are steps; '.lock',
    '.quarantine' and the like are ignored; '.trash-'/'.tmp-' debris is reported as leftovers."""
    root = layout.root
    leftovers: List[LeftoverEntry] = []
    try:
        it = os.scandir(root)
    except (FileNotFoundError, NotADirectoryError):
        return NamespaceReport(layout, ())
    with it:
        entries = list(it)
    found: List[Tuple[int, str]] = []
    for e in entries:
        step = parse_step_name(e.name)
        if step is not None:
            found.append((step, e.name))
        elif e.name.startswith(TRASH_PREFIX) or e.name.startswith(TMP_PREFIX):
            leftovers.append(LeftoverEntry(root / e.name, _store.tree_bytes(e.path)))

    def classify(item: Tuple[int, str]) -> StepReport:
        return _classify(layout, item[0], root / item[1])  # one Path per step, none per file

    if len(found) >= _PARALLEL_FROM:
        # Listing and lstat release the GIL: a few threads hide the disk's latency on a cold cache.
        with ThreadPoolExecutor(max_workers=_SCAN_THREADS, thread_name_prefix="skip_harness-scan") as pool:
            steps = list(pool.map(classify, found, chunksize=64))
    else:
        steps = [classify(item) for item in found]
    steps.sort(key=lambda s: s.step)
    leftovers.sort(key=lambda x: x.path.name)
    return NamespaceReport(layout, tuple(steps), tuple(leftovers))


def find_namespaces(dump_dir: Path) -> List[Layout]:
    """Namespaces under a dump dir: directories {dump_dir}/{any}/{leaf} whose leaf name parses as a
    namespace name (which gives K and W). Symlinks are never followed. Sorted by path."""
    dump_dir = Path(dump_dir)
    out: List[Layout] = []
    try:
        groups = list(os.scandir(dump_dir))
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
            kw = parse_namespace_leaf(leaf.name)
            if kw is not None and leaf.is_dir(follow_symlinks=False):
                out.append(Layout(dump_dir / g.name / leaf.name, K=kw[0], W=kw[1]))
    out.sort(key=lambda lay: str(lay.root))
    return out


# --------------------------------------------------------------------------------------------
# cleanup


@dataclass(frozen=True)
class CleanupItem:
    step: int
    path: Path
    status: str
    reason: str
    bytes: int
    action: str          # "delete" | "quarantine"


@dataclass(frozen=True)
class CleanupResult:
    items: Tuple[CleanupItem, ...]      # the items handled
    freed_bytes: int                     # bytes deleted (steps and leftovers)
    errors: Tuple[str, ...]
    moved_bytes: int = 0                 # bytes moved under .quarantine/
    quarantined: Tuple[Path, ...] = ()   # where each quarantined step went


@dataclass(frozen=True)
class CleanupPlan:
    """What cleanup will do; nothing happens until `execute()`."""

    layout: Layout
    action: str
    items: Tuple[CleanupItem, ...]
    leftovers: Tuple[LeftoverEntry, ...] = ()

    @property
    def bytes(self) -> int:
        """Bytes of the steps the plan handles (deleted or moved)."""
        return sum(i.bytes for i in self.items)

    @property
    def expected_freed_bytes(self) -> int:
        """Bytes that executing the plan frees (quarantined steps are moved, not freed)."""
        steps = self.bytes if self.action == "delete" else 0
        return steps + sum(x.bytes for x in self.leftovers)

    @property
    def steps(self) -> Tuple[int, ...]:
        return tuple(i.step for i in self.items)

    def describe(self) -> str:
        verb = {"delete": "remove", "quarantine": "quarantine"}.get(self.action, "leave")
        return f"{verb} {len(self.items)} steps, {self.bytes} bytes"

    def execute(self) -> CleanupResult:
        layout = self.layout
        root = layout.root
        done: List[CleanupItem] = []
        errors: List[str] = []
        quarantined: List[Path] = []
        freed = moved = 0
        store = _store.StepStore(layout)
        for item in self.items:
            if item.path.parent != root or item.path != layout.step_dir(item.step):
                errors.append(f"{item.path}: not a step of namespace {root}; left alone")
                continue
            log = logger.info  # the caller reports (WARNING for corrupt steps): the result lists every item
            try:
                if item.action == "delete":
                    freed += store.clear_step(item.step)
                    log("%s: %s step %d deleted (%s, %d bytes)", root, item.status, item.step, item.reason, item.bytes)
                elif item.action == "quarantine":
                    dst = _quarantine(layout, item.step)
                    moved += item.bytes
                    quarantined.append(dst)
                    log("%s: %s step %d moved to %s (%s, %d bytes)", root, item.status, item.step, dst,
                        item.reason, item.bytes)
                else:
                    errors.append(f"{item.path}: unknown action {item.action!r}")
                    continue
                done.append(item)
            except OSError as exc:
                errors.append(f"{item.path}: {item.action} failed: {exc}")
        if self.leftovers:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for lo in self.leftovers:
                    if lo.path.parent != root:
                        continue
                    try:
                        freed += _store.remove_entry_at(root_fd, lo.path.name, root)
                    except OSError as exc:
                        errors.append(f"{lo.path}: removal failed: {exc}")
            finally:
                os.close(root_fd)
        return CleanupResult(tuple(done), freed, tuple(errors), moved, tuple(quarantined))


def _quarantine(layout: Layout, step: int) -> Path:
    """Move a step entry (directory, file or link: never followed) under {namespace}/.quarantine/."""
    qdir = layout.quarantine_dir
    try:
        os.mkdir(qdir)
    except FileExistsError:
        pass
    st = os.lstat(qdir)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{qdir} is not a real directory; refusing to move anything into it")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    src = layout.step_dir(step)
    dst = qdir / f"{src.name}-{stamp}-{secrets.token_hex(3)}"
    os.rename(src, dst)
    for d in (layout.root, qdir):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return dst


def plan_cleanup(report: NamespaceReport, action: str) -> CleanupPlan:
    """Plan to handle every incomplete and corrupt step: "delete", "quarantine", or "off" (empty plan).
    Leftover '.trash-'/'.tmp-' debris is deleted by both "delete" and "quarantine"."""
    if action not in CLEANUP_ACTIONS:
        raise ConfigError("skip.rollout_tq.cleanup", f"must be one of {', '.join(CLEANUP_ACTIONS)}, got {action!r}")
    if action == "off":
        return CleanupPlan(report.layout, action, ())
    items = tuple(
        CleanupItem(s.step, s.path, s.status, s.reason, s.bytes, action)
        for s in report.steps
        if s.status in ("incomplete", "corrupt")
    )
    return CleanupPlan(report.layout, action, items, report.leftovers)
