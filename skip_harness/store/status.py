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

import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import List, Optional

from skip_harness.errors import CorruptStepError
from skip_harness.store.commit import WRITER_NAME, CommitRecord, expected_rels, parse_commit
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import COMMIT_NAME, Layout
from skip_harness.store.namespace import LINK_WHAT, Namespace, StepListing

class StepStatus(str, Enum):
    """A step's status: a string-valued enum (like `run.stats.Outcome`), so `status == "complete"`, a dict
    keyed by "complete", json and printed lines all see the plain string (`str(StepStatus.COMPLETE) ==
    "complete"`)."""

    COMPLETE = "complete"         # committed: every file its commit record lists, sizes matching
    UNVERIFIED = "unverified"     # an older cache's step without a commit record: served without checksums
    INCOMPLETE = "incomplete"     # an interrupted write: never served
    CORRUPT = "corrupt"           # a commit record that disagrees with the files: never served

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


STATUSES = tuple(StepStatus)     # in the order reports list them


# --------------------------------------------------------------------------------------------
# status of a step


@dataclass(frozen=True)
class StepReport:
    step: int
    path: Path
    status: StepStatus
    bytes: int
    reason: str
    fingerprint: Optional[Fingerprint]
    has_commit: bool
    exists: bool = True
    created: Optional[float] = None      # the commit record's time
    gen_s: Optional[float] = None        # generation seconds, when the commit record has them
    record: Optional[CommitRecord] = field(default=None, compare=False, repr=False)  # complete / corrupt-with-record
    record_stamp: Optional[str] = field(default=None, compare=False, repr=False)     # the stamp the record was read with

    @property
    def servable(self) -> bool:
        return self.status in (StepStatus.COMPLETE, StepStatus.UNVERIFIED)


def _first(items: List[str]) -> str:
    items = sorted(items)
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return items[0] + more


def classify_step(layout: Layout, step: int, path: Optional[Path] = None, *, namespace: Namespace,
                  listing: Optional[StepListing] = None) -> StepReport:
    """The status of one step, from one listing of it (plus its small commit record), through the
    namespace `namespace` (the layout's, as its run or command opened it). `path` is only what the report
    names; `listing` the step's listing when the caller has it already (a scan that listed every step)."""
    path = layout.step_dir(step) if path is None else path

    stamp: List[Optional[str]] = [None]

    def report(status: StepStatus, nbytes: int, reason: str, fp: Optional[Fingerprint] = None,
               has_commit: bool = False, exists: bool = True, record: Optional[CommitRecord] = None) -> StepReport:
        created = gen_s = None
        if record is not None:
            created, gen_s = record.created, record.gen_s
        return StepReport(step, path, status, nbytes, reason, fp, has_commit, exists, created, gen_s, record, stamp[0])

    if listing is None:
        try:
            listing = namespace.list_step(step)
        except OSError as exc:
            return report(StepStatus.INCOMPLETE, 0, f"cannot list the step directory: {exc}")
    if listing is None:
        return report(StepStatus.INCOMPLETE, 0, "step directory does not exist", exists=False)
    if listing.entry == LINK_WHAT:
        return report(StepStatus.INCOMPLETE, listing.total, "step directory is a symlink (never followed)")
    if listing.entry:
        return report(StepStatus.INCOMPLETE, listing.total, "step entry is not a directory")
    nbytes = listing.total
    links = [rel for rel, what in listing.odd if what == LINK_WHAT]
    others = {rel for rel, what in listing.odd if what != LINK_WHAT}
    has_commit = COMMIT_NAME in listing.files or COMMIT_NAME in links or COMMIT_NAME in others
    if links:
        return report(StepStatus.INCOMPLETE, nbytes, f"{_first(links)} is a symlink (never followed)", has_commit=has_commit)
    if has_commit:
        if COMMIT_NAME not in listing.files:
            return report(StepStatus.CORRUPT, nbytes, "commit record is not a regular file", has_commit=True)
        commit_path = os.path.join(str(path), COMMIT_NAME)
        try:
            data, stamp[0] = namespace.read_small_tagged(f"{step}/{COMMIT_NAME}")
            if data is None:
                raise FileNotFoundError(commit_path)
            record = parse_commit(data, layout, step, commit_path)
        except CorruptStepError as exc:
            return report(StepStatus.CORRUPT, nbytes, exc.reason, has_commit=True)
        except OSError as exc:
            return report(StepStatus.CORRUPT, nbytes, f"commit record cannot be read: {exc}", has_commit=True)
        for entry in record.files:
            found = listing.files.get(entry.rel)
            if found is None:
                return report(StepStatus.CORRUPT, nbytes, f"{entry.rel} (listed in the commit record) is missing",
                              record.fingerprint, True, record=record)
            if found.size != entry.bytes:
                return report(StepStatus.CORRUPT, nbytes,
                              f"{entry.rel} has {found.size} bytes, the commit record says {entry.bytes}",
                              record.fingerprint, True, record=record)
        return report(StepStatus.COMPLETE, nbytes, "", record.fingerprint, True, record=record)

    if listing.temporaries:
        return report(StepStatus.INCOMPLETE, nbytes, f"temporary file {_first(list(listing.temporaries))} (an interrupted write)")
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
        return report(StepStatus.INCOMPLETE, nbytes, f"missing {_first(missing)}")
    if empty:
        return report(StepStatus.INCOMPLETE, nbytes, f"{_first(empty)} is empty")
    if _written_by_us(namespace, step, metas[0]):
        return report(StepStatus.INCOMPLETE, nbytes,
                      "no commit record: written by skip_harness, interrupted before the step was committed")
    return report(StepStatus.UNVERIFIED, nbytes, "no commit record (an older cache); served without checksums")


def _written_by_us(namespace: Namespace, step: int, meta_rel: str) -> bool:
    try:
        data = namespace.read_small(f"{step}/{meta_rel}")
        doc = json.loads(data[: 1 << 20]) if data is not None else None
    except (OSError, CorruptStepError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("writer") == WRITER_NAME
