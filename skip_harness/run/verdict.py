"""A run's replay report for `skip-harness replay`: what it served, what it generated, where it diverged.

`skip-harness replay PACK -- COMMAND` (cli/replay.py) starts COMMAND with `$SKIP_HARNESS_REPLAY_REPORT`
naming a directory; every harness of that run which closes writes one JSON document there
(`{run_id}.json`, rank 0, whole: a temporary name renamed into place), whatever trainer built it (the
demo, TRL, verl's plug-in, a plain loop), and the command reads them all for its verdict:

    {"format": 1, "run_id": ..., "pid": ..., "namespace": ..., "replay_from": ..., "replay_check": ...,
     "steps": {"1": "hit", ...},           every step the harness decided (hit, repeat, miss, off)
     "generated": [{"step": 4, "why": "miss: ..."}],   steps it generated: a miss, an uncached step, a hit
                                                        whose inputs differed (regenerated)
     "replay": {"served": 3, "checked": 3, "reproduced": 3, "unchecked": 0, "line": "replay: ..."},
     "divergence": null | {"step", "key", "recorded", "now", "config_changes": [[key, recorded, now]],
                           "config_known", "tolerance", "line"},
     "values": {"1": {"loss": ...}},       the numbers the trainer reported per step (what --bless keeps)
     "training_config": {...} | null,      its training-side config, flattened
     "machine": {"torch", "cpu", ...}}     what computed the values (run.machine; --bless records it)

Nothing here runs unless the variable is set: the writer is not even built.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

from skip_harness.run.callbacks import HarnessCallback
from skip_harness.run.machine import this_machine
from skip_harness.run.stats import HIT, MISS, REPEAT, RunSummary, StepRecord
from skip_harness.store.api import numbers_of

log = logging.getLogger("skip_harness")

REPLAY_REPORT_ENV = "SKIP_HARNESS_REPLAY_REPORT"
REPORT_FORMAT = 1


def _json_number(x: float) -> Any:
    return x if math.isfinite(x) else str(x)


def divergence_doc(d: Any) -> Dict[str, Any]:
    """A :class:`~skip_harness.run.divergence.Divergence` as the report holds it."""
    return {"step": d.step, "key": d.key, "recorded": _json_number(d.recorded), "now": _json_number(d.now),
            "config_changes": [[k, a, b] for k, a, b in d.config_changes], "config_known": d.config_known,
            "tolerance": d.tolerance, "line": d.describe()}


class ReplayReportWriter(HarnessCallback):
    """Collects a run's steps, values and first divergence; writes the report when the harness closes."""

    def __init__(self, directory: str, settings: Any, run_id: Callable[[], Optional[str]],
                 training_config: Callable[[], Optional[Mapping[str, Any]]]):
        self.directory = Path(directory)
        self.settings = settings
        self._run_id = run_id
        self._training_config = training_config
        self.steps: Dict[int, str] = {}
        self.generated: List[Dict[str, Any]] = []
        self.values: Dict[int, Dict[str, float]] = {}
        self.divergence: Optional[Dict[str, Any]] = None
        self.machine: Optional[Dict[str, str]] = None

    @classmethod
    def from_env(cls, settings: Any, is_main: bool, run_id: Callable[[], Optional[str]],
                 training_config: Callable[[], Optional[Mapping[str, Any]]]) -> List[HarnessCallback]:
        """[a writer] when `$SKIP_HARNESS_REPLAY_REPORT` is set and this is rank 0, else []."""
        directory = os.environ.get(REPLAY_REPORT_ENV, "").strip()
        if not directory or not is_main:
            return []
        return [cls(directory, settings, run_id, training_config)]

    def on_step_end(self, *, record: StepRecord, **kwargs: Any) -> None:
        self.steps[record.step] = str(record.kind)
        if record.kind not in (HIT, REPEAT) or record.regenerated:
            why = ("a hit whose inputs differed from the recorded ones" if record.regenerated else
                   f"{record.kind}: {record.reason or ('not in the recording' if record.kind == MISS else 'uncached')}")
            self.generated.append({"step": record.step, "why": why})

    def on_values(self, *, step: int, outcome: str, values: Any, machine: Any = None, **kwargs: Any) -> None:
        if machine is not None and self.machine is None:
            self.machine = dict(machine)       # what the replay check compared with (run.machine)
        numbers, _ = numbers_of(values)
        self.values[step] = {**self.values.get(step, {}), **numbers}

    def on_replay_divergence(self, *, divergence: Any = None, stopping: bool = False, **kwargs: Any) -> None:
        if divergence is not None and self.divergence is None:
            self.divergence = divergence_doc(divergence)
            if stopping:     # written now: a trainer may die of the error before the harness closes (verl's Ray)
                self._write(None, None)

    def on_end(self, *, summary: RunSummary, **kwargs: Any) -> None:
        self._write(summary.replay, summary.namespace)

    def _write(self, report: Any, namespace: Optional[str]) -> None:
        run_id = self._run_id() or f"pid{os.getpid()}"
        doc = {
            "format": REPORT_FORMAT, "run_id": run_id, "pid": os.getpid(), "namespace": namespace,
            "replay_from": self.settings.replay_from, "replay_check": str(self.settings.replay_check.value),
            "steps": {str(s): k for s, k in sorted(self.steps.items())},
            "generated": self.generated,
            "replay": None if report is None else {
                "served": report.served, "checked": report.checked, "reproduced": report.reproduced,
                "unchecked": report.unchecked, "line": report.describe()},
            "divergence": self.divergence,
            "values": {str(s): {k: _json_number(v) for k, v in vals.items()} for s, vals in sorted(self.values.items())},
            "training_config": self._training_config(),
            "machine": self.machine or this_machine(),
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".tmp-{run_id}.{os.getpid()}"
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
            os.replace(tmp, self.directory / f"{run_id}.json")
        except OSError as exc:
            log.warning("%s: the replay report could not be written (%s)", self.directory, exc)


__all__ = ["REPLAY_REPORT_ENV", "REPORT_FORMAT", "ReplayReportWriter", "divergence_doc"]
