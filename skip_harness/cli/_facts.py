"""Facts about a step for the listings, read cheaply (the commit record and the small meta files), and the
trainer mode and seed guessed from a fingerprint's keys (verl's, TRL's or the demo's names)."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from skip_harness.store.api import StepReader, StepReport, StepStatus
from skip_harness.errors import CorruptStepError



# --------------------------------------------------------------------------------------------
# facts about a step, read cheaply (the commit record and the small meta files)


def step_written(reader: StepReader, report: StepReport) -> Optional[float]:
    """When the step was written: its commit record's time, else the newest mtime of its directory."""
    created = getattr(report, "created", None)
    if created:
        return float(created)
    if report.has_commit and report.status == StepStatus.COMPLETE:
        try:
            record = reader.read_commit(report.step)
        except (CorruptStepError, OSError):
            record = None
        if record is not None and record.created:
            return record.created
    return reader.namespace.modified(str(report.step)) if report.exists else None


def step_accessed(reader: StepReader, report: StepReport) -> Optional[float]:
    """When the step was last read: the newest access time of its payload files (a hit reads them; `ls`
    and the startup scan never do; `verify` and `clean` do), where the storage records reads (see
    `Namespace.last_read`). None when no payload was read since it was written."""
    if not report.exists:
        return None
    return reader.namespace.last_read(report.step, [prel for _i, _r, prel, _m in reader.layout.expected_rels()])


def step_metas(reader: StepReader, step: int) -> List[Dict[str, Any]]:
    """Every meta.json of a step that can be read (K x W small JSON files); unreadable ones left out."""
    out = []
    for i, r, _p, _m in reader.layout.expected_rels():
        try:
            out.append(reader.read_meta(step, i, r))
        except (CorruptStepError, OSError, Exception):  # a missing/odd meta only costs the number
            continue
    return out


def step_gen_s(reader: StepReader, report: StepReport, metas: Optional[List[Dict[str, Any]]] = None) -> Optional[float]:
    """Generation seconds the step's commit record or metas record (what a rerun saves by serving it);
    `metas`: the step's, when the caller has read them (`step_metas`)."""
    known = getattr(report, "gen_s", None)
    if known is not None:
        return float(known)
    if not report.servable:
        return None
    total, seen = 0.0, False
    for meta in step_metas(reader, report.step) if metas is None else metas:
        value = meta.get("gen_s")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total += float(value)
            seen = True
    return total if seen else None


_MODE_KEYS = ("trainer.v1.trainer_mode", "trainer_mode", "mode")
_SEED_KEYS = ("seed", "args.seed", "trainer.seed")


def fingerprint_value(values: Dict[str, Any], candidates: Sequence[str]) -> Any:
    for key in candidates:
        if key in values:
            return values[key]
    last = candidates[0].split(".")[-1]
    for key, value in values.items():
        if key.split(".")[-1] == last:
            return value
    return None


MIXED = "mixed"


def mode_and_seed(steps: Sequence[StepReport]) -> Tuple[Any, Any]:
    """(mode, seed) from the fingerprints of the given steps: None when none says, MIXED when they differ."""
    modes, seeds = set(), set()
    for s in steps:
        if s.fingerprint is None:
            continue
        modes.add(json.dumps(fingerprint_value(dict(s.fingerprint.values), _MODE_KEYS)))
        seeds.add(json.dumps(fingerprint_value(dict(s.fingerprint.values), _SEED_KEYS)))

    def one(found: set) -> Any:
        if len(found) > 1:
            return MIXED
        return json.loads(next(iter(found))) if found else None

    return one(modes), one(seeds)
