"""The records of a step and its status, from directory listings and lstat plus its commit record.

Status of a step (K and W come from the Layout), by `classify_step`; checksums are read by
`StepReader` only (its verified reads and `verify`):
- complete:   commit.json parses, its K/W match, it lists every needed file, and every file it lists is
              a regular file with the listed size;
- corrupt:    commit.json exists but does not parse / validate, or a listed file is missing or has
              another size;
- unverified: no commit.json, but each needed payload and meta file is there (for K = 1 the
              `{step}/0/` form counts too), no temporary files, and the files were not written by
              skip_harness itself (an older cache; our own uncommitted writes are interrupted ones);
- incomplete: anything else.

This module only reads, and does no logging.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from skip_harness.errors import CorruptStepError
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.backend import LINK, NamespaceBackend
from skip_harness.store.layout import COMMIT_NAME, Layout
from skip_harness.store.backend import namespace_of

STATUSES = ("complete", "unverified", "incomplete", "corrupt")
COMMIT_FORMAT = 1
WRITER_NAME = "skip_harness"      # meta.json "writer": tells our uncommitted writes from older caches


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


def parse_commit(data: bytes, layout: Layout, step: int, path: Union[Path, str]) -> CommitRecord:
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
# status of a step


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
    record: Optional[CommitRecord] = field(default=None, compare=False, repr=False)  # complete / corrupt-with-record

    @property
    def servable(self) -> bool:
        return self.status in ("complete", "unverified")


def _first(items: List[str]) -> str:
    items = sorted(items)
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return items[0] + more


def classify_step(layout: Layout, step: int, path: Optional[Path] = None,
                  backend: Optional[NamespaceBackend] = None) -> StepReport:
    """The status of one step, from one listing of it (plus its small commit record), through the
    namespace's backend (the POSIX one by default). `path` is only what the report names."""
    path = layout.step_dir(step) if path is None else path
    backend = backend if backend is not None else namespace_of(layout)

    def report(status: str, nbytes: int, reason: str, fp: Optional[Fingerprint] = None,
               has_commit: bool = False, exists: bool = True, record: Optional[CommitRecord] = None) -> StepReport:
        created = gen_s = None
        if record is not None:
            created, gen_s = record.created, record.gen_s
        return StepReport(step, path, status, nbytes, reason, fp, has_commit, exists, created, gen_s, record)

    try:
        listing = backend.list_step(step)
    except OSError as exc:
        return report("incomplete", 0, f"cannot list the step directory: {exc}")
    if listing is None:
        return report("incomplete", 0, "step directory does not exist", exists=False)
    if listing.entry == LINK:
        return report("incomplete", listing.total, "step directory is a symlink (never followed)")
    if listing.entry:
        return report("incomplete", listing.total, "step entry is not a directory")
    nbytes = listing.total
    links = [rel for rel, what in listing.odd if what == LINK]
    others = {rel for rel, what in listing.odd if what != LINK}
    has_commit = COMMIT_NAME in listing.files or COMMIT_NAME in links or COMMIT_NAME in others
    if links:
        return report("incomplete", nbytes, f"{_first(links)} is a symlink (never followed)", has_commit=has_commit)
    if has_commit:
        if COMMIT_NAME not in listing.files:
            return report("corrupt", nbytes, "commit record is not a regular file", has_commit=True)
        commit_path = os.path.join(str(path), COMMIT_NAME)
        try:
            data = backend.read_small(f"{step}/{COMMIT_NAME}")
            if data is None:
                raise FileNotFoundError(commit_path)
            record = parse_commit(data, layout, step, commit_path)
        except CorruptStepError as exc:
            return report("corrupt", nbytes, exc.reason, has_commit=True)
        except OSError as exc:
            return report("corrupt", nbytes, f"commit record cannot be read: {exc}", has_commit=True)
        for entry in record.files:
            found = listing.files.get(entry.rel)
            if found is None:
                return report("corrupt", nbytes, f"{entry.rel} (listed in the commit record) is missing",
                              record.fingerprint, True, record=record)
            if found.size != entry.bytes:
                return report("corrupt", nbytes,
                              f"{entry.rel} has {found.size} bytes, the commit record says {entry.bytes}",
                              record.fingerprint, True, record=record)
        return report("complete", nbytes, "", record.fingerprint, True, record=record)

    if listing.temporaries:
        return report("incomplete", nbytes, f"temporary file {_first(list(listing.temporaries))} (an interrupted write)")
    files = listing.files
    missing: List[str] = []
    empty: List[str] = []
    metas: List[str] = []
    for i, r, _p, _m in expected_rels(layout):
        prel, mrel = layout.stored_rels(i, r, files.__contains__)
        for rel in (prel, mrel):
            if rel not in files:
                missing.append(rel)
        if prel in files and files[prel].size == 0:
            empty.append(prel)
        metas.append(mrel)
    if missing:
        return report("incomplete", nbytes, f"missing {_first(missing)}")
    if empty:
        return report("incomplete", nbytes, f"{_first(empty)} is empty")
    if _written_by_us(backend, step, metas[0]):
        return report("incomplete", nbytes,
                      "no commit record: written by skip_harness, interrupted before the step was committed")
    return report("unverified", nbytes, "no commit record (an older cache); served without checksums")


def _written_by_us(backend: NamespaceBackend, step: int, meta_rel: str) -> bool:
    try:
        data = backend.read_small(f"{step}/{meta_rel}")
        doc = json.loads(data[: 1 << 20]) if data is not None else None
    except (OSError, CorruptStepError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("writer") == WRITER_NAME
