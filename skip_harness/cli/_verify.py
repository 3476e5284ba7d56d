"""Verify a step as a run would before serving it: sizes, checksums, and a safe load of every payload."""
from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Tuple

from skip_harness.store.api import NamespaceReport, StepReader, StepReport, StepStatus

_UNSAFE_ADVICE = re.compile(r"(Weights only load failed|weights_only).*", re.IGNORECASE | re.DOTALL)
VERL_HINT = "if verl wrote it, `skip-harness import-verl VERL_DUMP_DIR DUMP_DIR --trust` converts it"


def _plain_reason(reason: str) -> str:
    """A reason without torch's advice to load with weights_only=False (never to be followed here)."""
    return _UNSAFE_ADVICE.sub("it needs pickled code to load, which skip_harness never runs", reason).strip()


def _looks_like_verl(reader: StepReader, step: int) -> bool:
    try:
        meta = reader.read_meta(step, 0, 0)
    except Exception:
        return False
    return "global_steps" in meta and meta.get("writer") is None


def verify_step(reader: StepReader, report: StepReport) -> Optional[str]:
    """None if a servable step would be served, else the reason (naming the file) it would be refused.
    `StepReader.verify` (sizes and checksums of a complete step, and that every payload loads
    safely: nothing executed, no registered type needed here). Unverified (older) steps have no
    checksums: the load check only."""
    if not report.servable:
        return None
    _status, reason = reader.verify(report.step)
    if reason is None:
        return None
    reason = _plain_reason(reason)
    if report.status == StepStatus.UNVERIFIED and _looks_like_verl(reader, report.step):
        reason += f" ({VERL_HINT})"
    return reason


def verified_steps(reader: StepReader, report: NamespaceReport, tick=lambda: None
                   ) -> Tuple[List[StepReport], List[Tuple[int, str]]]:
    """Every step of the report, servable ones checked by `verify_step`: those that fail become
    'corrupt' with the reason. Also returns the (step, reason) pairs that failed."""
    out: List[StepReport] = []
    failed: List[Tuple[int, str]] = []
    for s in report.steps:
        if s.servable:
            reason = verify_step(reader, s)
            if reason is not None:
                s = dataclasses.replace(s, status=StepStatus.CORRUPT, reason=reason)
                failed.append((s.step, reason))
        out.append(s)
        tick()
    return out, failed
