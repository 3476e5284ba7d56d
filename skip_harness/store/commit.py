"""The commit record: a step's last file, listing K, W, the generation fingerprint and every file's size
and checksum -- its format (`COMMIT_FORMAT`), its parts (`CommitRecord`, `FileEntry`), and the one
parser that validates it (`parse_commit`). Which files a step of a namespace needs (`required_rels`).

Pure: no I/O, no logging.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from skip_harness.errors import CorruptStepError
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import Layout

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
    # the step's size as committed: the files it lists and the record itself (not part of the JSON)
    nbytes: int = field(default=0, compare=False)

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
                        None if gen_s is None else float(gen_s), sum(f.bytes for f in files) + len(data))


__all__ = ["COMMIT_FORMAT", "WRITER_NAME", "CommitRecord", "FileEntry", "expected_rels", "is_safe_rel",
           "parse_commit", "required_rels"]
