"""`skip-harness replay PACK --bless -- COMMAND`: accept a replay's values as the recording's expected ones.

The run's values for the steps it served (its replay report, run/verdict.py) replace the recorded ones,
with its training-side config and the reason: the training-side change that made them (what the
divergence named), or that none did. A pack is blessed by the pack's own writer (`bless_pack`, which
keeps when and why in the pack); a namespace directory through its `ValuesStore`: each step's values
bound to its commit record, the config under its digest, and the blessing appended to
`.values/blessed.json`. A run that reproduced every value leaves the recording as it is.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from skip_harness.cli._output import EXIT_OK, EXIT_USAGE

_SERVED = ("hit", "repeat")


def _cfg(v: Any) -> str:
    return "(absent)" if v is None else str(v)


def reason_of(divergence: Mapping[str, Any]) -> str:
    """Why the values changed, in words: the training-side keys that differ from the recorded run's."""
    changes = divergence.get("config_changes") or []
    if changes:
        shown = ", ".join(f"{k} {_cfg(a)} -> {_cfg(b)}" for k, a, b in changes[:8])
        return f"training side changed: {shown}{f' and {len(changes) - 8} more' if len(changes) > 8 else ''}"
    if not divergence.get("config_known", True):
        return "no training-side config was recorded to compare with; accepted as it is"
    return "no training-side change (another library, kernel or machine?); accepted as it is"


def _served_values(doc: Mapping[str, Any]) -> Dict[int, Dict[str, float]]:
    steps = doc.get("steps") or {}
    values = doc.get("values") or {}
    out: Dict[int, Dict[str, float]] = {}
    for step, kind in steps.items():
        if kind in _SERVED and isinstance(values.get(step), dict) and values[step]:
            out[int(step)] = {str(k): float(v) for k, v in values[step].items()}
    return dict(sorted(out.items()))


def bless_recording(verdict: Any) -> Any:
    """Write the values of `verdict`'s one run into its recording (module doc); the verdict, updated."""
    reports: List[Dict[str, Any]] = verdict.reports
    name = verdict.recording.path.name
    if len(reports) != 1:
        verdict.code, verdict.line = EXIT_USAGE, (f"--bless needs one run; the command ran {len(reports)} "
                                                  "(a sweep? bless each job's command on its own)")
        return verdict
    doc = reports[0]
    divergence = doc.get("divergence")
    if divergence is None:
        verdict.line = f"{verdict.line}; nothing to bless: every served step reproduced"
        return verdict
    values = _served_values(doc)
    if not values:
        verdict.code, verdict.line = EXIT_USAGE, "the run reported no values for the steps it served: nothing to bless"
        return verdict
    reason = reason_of(divergence)
    training_config = doc.get("training_config")
    if verdict.recording.kind == "pack":
        from skip_harness.store.api import bless_pack

        bless_pack(verdict.recording.path, values, training_config, reason, machine=doc.get("machine"))
    else:
        missing = bless_namespace(verdict.recording.path, values, training_config, reason, str(doc.get("run_id")),
                                  machine=doc.get("machine"))
        if missing:
            verdict.code, verdict.line = EXIT_USAGE, (f"steps {', '.join(map(str, missing))} of {name} have no commit "
                                                      "record (unverified): their values cannot be bound to them")
            return verdict
    verdict.code, verdict.blessed = EXIT_OK, reason
    verdict.line = (f"blessed: {name} now expects this run's values for {len(values)} steps (it diverged at step "
                    f"{divergence.get('step')}: {divergence.get('key')}); {reason}")
    return verdict


def bless_namespace(root: Path, values: Mapping[int, Mapping[str, float]], training_config: Optional[Mapping[str, Any]],
                    reason: str, run_id: str, machine: Optional[Mapping[str, str]] = None) -> List[int]:
    """Replace the recorded values of namespace `root`'s steps (computed on `machine`, run.machine); the steps
    without a commit record (nothing is written then)."""
    from skip_harness.store.api import Layout, ValuesStore, config_digest, namespaces_at, open_store

    layout: Layout = namespaces_at(root)[0]
    steps = open_store(layout)
    namespace, reader = steps.namespace, steps.reader
    records = {step: reader.read_commit(step) for step in values}
    missing = [step for step, record in records.items() if record is None]
    if missing:
        return missing
    store = ValuesStore(namespace)
    digest = None
    if training_config is not None:
        digest = config_digest(training_config)
        store.write_config(digest, training_config)
    for step, vals in values.items():
        store.write_step(step, vals, commit_created=records[step].created, config=digest,  # type: ignore[union-attr]
                         machine=machine if isinstance(machine, Mapping) else None)
    store.add_blessing({"blessed": time.time(), "reason": reason, "steps": sorted(values), "run": run_id,
                        "config": digest, "host": socket.gethostname(), "pid": os.getpid()})
    return []


__all__ = ["bless_namespace", "bless_recording", "reason_of"]
