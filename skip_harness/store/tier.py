"""A step's second tier: values computed from its rollouts by parts training does not change.

Rewards (per reward function where the trainer keeps them apart) and reference log-probs are a pure
function of a step's rollouts and of parts the training never changes (the reward functions, the
reference model). They are kept beside the step, outside its commit record, so a committed step
without them is complete and caches written before the tier existed load as they did:

    {namespace}/.tier/{step}/{phase}/{key}/{inner}-r{rank}.tensors   the values (the codec's file image)
    {namespace}/.tier/{step}/{phase}/{key}/{inner}-r{rank}.json      their record, written last

`phase` is a short name (`reward`, `reference`, or a trainer's own), `key` the digest of the phase's
validity key (`key_digest`: the reward side's or the reference side's fingerprint, as
{component: digest} -- `reward function digit_reward: <digest of its source>`). One entry per
(step, phase, key, inner index, rank); entries for several keys of a phase live side by side, so a
replay under another reward keeps the first and adds its own.

Both files are written create-only (`put_if_absent`) and never replaced: the values first, the record
last, so a record always names values that are there. The record holds the key's components (so a
replay under another key can say which component changed), the values' size and xxh3-128 checksum
(checked before anything is served, like a payload against its commit record), the seconds the phase
took when it ran, and the creation time of the step's commit record it was computed from: a step
removed and generated again is another set of rollouts, and `read` then finds nothing. Nothing is
pickled: the values are the codec's file image (a JSON header and raw tensor bytes), the record JSON.
`Namespace.remove_step` and `set_aside` remove a step's tier with it.

This module does no logging: it raises or returns, and the harness reports.
"""
from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import xxhash

from skip_harness import codec
from skip_harness.errors import CodecError, CorruptStepError
from skip_harness.store.checksum import checksum_bytes
from skip_harness.store.layout import TIER_DIR
from skip_harness.store.namespace import Namespace

TIER_FORMAT = 1
VALUES_SUFFIX = ".tensors"
RECORD_SUFFIX = ".json"


def key_digest(key: Mapping[str, str]) -> str:
    """The digest of a phase's validity key ({component: value}, order-free): 16 hex digits."""
    canon = json.dumps({str(k): str(v) for k, v in key.items()}, sort_keys=True)
    return xxhash.xxh3_64_hexdigest(canon.encode())


def _check_phase(phase: str) -> str:
    if not phase or not all(c.isalnum() or c in "_-" for c in phase):
        raise ValueError(f"a tier phase is a short name of letters, digits, '_' and '-', got {phase!r}")
    return phase


def entry_stem(step: int, phase: str, digest: str, inner: int, rank: int) -> str:
    return f"{TIER_DIR}/{int(step)}/{_check_phase(phase)}/{digest}/{int(inner)}-r{int(rank)}"


def step_prefix(step: int) -> str:
    """Where a step's tier lives (removed with the step)."""
    return f"{TIER_DIR}/{int(step)}/"


@dataclass(frozen=True)
class TierRecord:
    """One stored entry's record: where it belongs, under which key, and what its values are."""

    step: int
    phase: str
    inner: int
    rank: int
    digest: str
    key: Dict[str, str]
    size: int
    checksum: str
    seconds: float
    commit_created: Optional[float]
    recorded: float


@dataclass(frozen=True)
class TierEntry:
    """An entry read back and verified: its record and its values (tensors, containers, scalars)."""

    record: TierRecord
    values: Any


def _parse_record(data: bytes) -> Optional[TierRecord]:
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != TIER_FORMAT:
            return None
        key = doc["key"]
        if not isinstance(key, dict):
            return None
        created = doc.get("commit_created")
        return TierRecord(
            step=int(doc["step"]), phase=str(doc["phase"]), inner=int(doc["inner"]), rank=int(doc["rank"]),
            digest=str(doc["digest"]), key={str(k): str(v) for k, v in key.items()}, size=int(doc["size"]),
            checksum=str(doc["checksum"]), seconds=float(doc.get("seconds", 0.0)),
            commit_created=float(created) if isinstance(created, (int, float)) and not isinstance(created, bool)
            else None,
            recorded=float(doc.get("recorded", 0.0)),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


class TierStore:
    """The tier of one namespace, through its backend (safe from any thread)."""

    def __init__(self, namespace: Namespace):
        self.namespace = namespace

    # ---- writing
    @staticmethod
    def encode(values: Any) -> bytes:
        """`values` (tensors on any device, containers, scalars) as the bytes `write` stores: the codec's
        file image. Raises what the codec raises for values the cache refuses."""
        buf = io.BytesIO()
        codec.save_to(buf, values)
        return buf.getvalue()

    def write(self, step: int, phase: str, inner: int, rank: int, key: Mapping[str, str], data: bytes, *,
              commit_created: Optional[float], seconds: float) -> bool:
        """Store `data` (`encode`'s bytes) for (step, phase, inner, rank) under `key`, create-only: the
        values, then the record. False when this write of the step (`commit_created`) has an entry for
        that key already (it is kept, never replaced); an entry bound to an earlier write of the step, or
        values left without their record, are removed first. Raises the storage's errors."""
        digest = key_digest(key)
        stem = entry_stem(step, phase, digest, inner, rank)
        storage = self.namespace.storage
        there = self.record_at(stem + RECORD_SUFFIX)
        if there is not None and there.commit_created == commit_created:
            return False                    # this write of the step has its entry: kept, never replaced
        if there is not None or storage.stat(stem + RECORD_SUFFIX) is not None \
                or storage.stat(stem + VALUES_SUFFIX) is not None:
            # an entry of an earlier write of the step (removed and generated again since), an unreadable
            # record, or values whose record never landed (an interrupted write): gone first, record first
            for suffix in (RECORD_SUFFIX, VALUES_SUFFIX):
                self.namespace.locker.fence(key=stem + suffix)
                storage.delete(stem + suffix)
        self.namespace.locker.fence(key=stem + VALUES_SUFFIX)
        if storage.put_if_absent(stem + VALUES_SUFFIX, data) is None:
            return False                    # another writer got there first
        doc = {
            "format": TIER_FORMAT, "step": int(step), "phase": phase, "inner": int(inner), "rank": int(rank),
            "digest": digest, "key": {str(k): str(v) for k, v in key.items()}, "size": len(data),
            "checksum": checksum_bytes(data), "seconds": float(seconds), "commit_created": commit_created,
            "recorded": time.time(),
        }
        self.namespace.locker.fence(key=stem + RECORD_SUFFIX)
        return storage.put_if_absent(stem + RECORD_SUFFIX, (json.dumps(doc, indent=1) + "\n").encode()) is not None

    # ---- reading
    def record(self, step: int, phase: str, digest: str, inner: int, rank: int) -> Optional[TierRecord]:
        """The record of one entry; None when absent or unreadable (a tier entry is never a fault of its step)."""
        try:
            data = self.namespace.read_small(entry_stem(step, phase, digest, inner, rank) + RECORD_SUFFIX)
        except CorruptStepError:
            return None
        return None if data is None else _parse_record(data)

    def read(self, step: int, phase: str, key: Mapping[str, str], inner: int, rank: int, *,
             commit_created: Optional[float]) -> Optional[TierEntry]:
        """The entry for (step, phase, inner, rank) under `key`, verified (size and checksum against its
        record) and bound to the step's commit record (`commit_created`); None when there is none or it
        belongs to another write of the step. CorruptStepError naming the file when its values are
        missing, of another size or checksum, or do not decode."""
        digest = key_digest(key)
        rec = self.record(step, phase, digest, inner, rank)
        if rec is None or rec.commit_created is None or rec.commit_created != commit_created:
            return None
        path = entry_stem(step, phase, digest, inner, rank) + VALUES_SUFFIX
        data = self.namespace.read_small(path)
        where = self.namespace.where(path)
        if data is None:
            raise CorruptStepError(where, "the tier record names values that are not there")
        if len(data) != rec.size:
            raise CorruptStepError(where, f"{len(data)} bytes, its record says {rec.size}")
        got = checksum_bytes(data)
        if got != rec.checksum:
            raise CorruptStepError(where, f"checksum {got} does not match its record's {rec.checksum}")
        try:
            values = codec.load_buffer(bytearray(data), len(data), where)
        except CodecError as exc:
            raise CorruptStepError(where, str(exc)) from None
        return TierEntry(rec, values)

    def keys(self, step: int, phase: str, *, commit_created: Optional[float] = None) -> List[TierRecord]:
        """One record per key stored for (step, phase), newest first (for saying which component of a
        key changed); with `commit_created`, only those bound to that write of the step."""
        prefix = f"{TIER_DIR}/{int(step)}/{_check_phase(phase)}/"
        first: Dict[str, str] = {}           # digest -> the key of one of its records
        try:
            for e in self.namespace.storage.list(prefix):
                digest, _, name = e.key[len(prefix):].partition("/")
                if name.endswith(RECORD_SUFFIX) and (digest not in first or e.key < first[digest]):
                    first[digest] = e.key
        except (OSError, CorruptStepError):
            return []
        out: List[TierRecord] = []
        for key in first.values():
            rec = self.record_at(key)
            if rec is not None and (commit_created is None or rec.commit_created == commit_created):
                out.append(rec)
        return sorted(out, key=lambda r: r.recorded, reverse=True)

    def record_at(self, key: str) -> Optional[TierRecord]:
        try:
            data = self.namespace.read_small(key)
        except CorruptStepError:
            return None
        return None if data is None else _parse_record(data)

    def step_records(self, step: int) -> List[TierRecord]:
        """Every record stored for `step` (any phase, key, inner index, rank), in that order."""
        out: List[TierRecord] = []
        try:
            entries = list(self.namespace.storage.list(step_prefix(step)))
        except (OSError, CorruptStepError):
            return out
        for e in entries:
            if e.key.endswith(RECORD_SUFFIX):
                rec = self.record_at(e.key)
                if rec is not None:
                    out.append(rec)
        return sorted(out, key=lambda r: (r.phase, r.recorded, r.inner, r.rank))


def read_step_tier(namespace: Namespace, step: int, *, commit_created: Optional[float]) -> Dict[str, Dict[Tuple[int, int], TierEntry]]:
    """What the tier holds for `step` (the viewer's read): {phase: {(inner, rank): entry}}, each entry
    verified and bound to the step's commit record (`commit_created`, the record's creation time);
    where a phase holds several keys, the newest recorded one. Entries that fail verification are
    left out. Read-only: nothing is written."""
    store = TierStore(namespace)
    out: Dict[str, Dict[Tuple[int, int], TierEntry]] = {}
    newest: Dict[str, str] = {}
    records = [r for r in store.step_records(step) if r.commit_created == commit_created]
    for rec in sorted(records, key=lambda r: r.recorded, reverse=True):
        newest.setdefault(rec.phase, rec.digest)
    for rec in records:
        if newest.get(rec.phase) != rec.digest:
            continue
        try:
            entry = store.read(step, rec.phase, rec.key, rec.inner, rec.rank, commit_created=commit_created)
        except CorruptStepError:
            continue
        if entry is not None:
            out.setdefault(rec.phase, {})[(rec.inner, rec.rank)] = entry
    return out


__all__ = ["TIER_DIR", "TierEntry", "TierRecord", "TierStore", "entry_stem", "key_digest", "read_step_tier",
           "step_prefix"]
