"""What each step produced: the values a trainer reported for it, and the run's training-side config.

Kept beside the steps, outside their commit records, so a committed step without values is complete
and simply unchecked, and caches written before values existed load as they did:

    {namespace}/.values/{step}.json          the step's values, bound to its commit record
    {namespace}/.values/config-{digest}.json the training-side config they were recorded under (flattened)
    {namespace}/.values/runs/{run_id}/{step}.json  what one replay reported for the step (never the recording's)
    {namespace}/.values/runs/{run_id}/run.json     that run: when, where, its training-side config's digest
    {namespace}/.values/blessed.json         when and why the recorded values were replaced (`skip-harness replay --bless`)

The recording's values (`{step}.json`) are what a replay is checked against; a replay's own values go
under its run id (`new_run_id`: UTC time, host and pid), so replays of one recording never overwrite it
or each other, and `skip-harness diff NS@RUN_ID ...` can put any of them beside another.

A step's values document names the commit record it belongs to (the record's creation time): a step
removed and written again by another run is no longer the step those values describe, and
`StepReader.read_values` then answers None rather than values of other rollouts. Every file is JSON
(never pickle), written whole through the namespace's backend (`write_small`: a temporary name, fsync
and rename on POSIX; one PUT on an object store), so a reader sees the old file, the new one, or none.
Non-finite numbers are stored as the strings "NaN", "Infinity" and "-Infinity".

This module does no logging: it raises or returns, and the harness reports.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Tuple

import xxhash

from skip_harness.nodes import plain
from skip_harness.store.layout import VALUES_DIR
from skip_harness.store.namespace import Namespace

VALUES_FORMAT = 1
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


RUNS_DIR = f"{VALUES_DIR}/runs"
BLESSED = f"{VALUES_DIR}/blessed.json"
RUN_DOC = "run.json"
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


_ISSUED: Dict[str, int] = {}


def new_run_id() -> str:
    """A run's id: `20261203T120501Z-host-1234` (UTC start time, host, pid), `-2`, `-3`, ... appended for a
    second run of one process in one second (in-process runs, a launcher reusing its workers): every run
    of a recording keeps its own values."""
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", socket.gethostname())[:40] or "host"
    base = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{host}-{os.getpid()}"
    n = _ISSUED[base] = _ISSUED.get(base, 0) + 1
    return base if n == 1 else f"{base}-{n}"


def run_order(run_id: str) -> List[Any]:
    """A sort key putting run ids in the order they were issued: by start time, then a process's second,
    third, ... run of one second (`-2` ... `-10`, `-11`: numbers compared as numbers, where plain text
    put `-10` before `-9`)."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", run_id))]


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"a run id is 1-128 letters, digits, '.', '_' or '-', got {run_id!r}")
    return run_id


def run_values_key(run_id: str, step: int) -> str:
    return f"{RUNS_DIR}/{check_run_id(run_id)}/{int(step)}.json"


def run_drift_key(run_id: str, step: int) -> str:
    """An `action=compare` run's per-trajectory drift at `step` (beside its values)."""
    return f"{RUNS_DIR}/{check_run_id(run_id)}/{int(step)}.drift.json"


def run_doc_key(run_id: str) -> str:
    return f"{RUNS_DIR}/{check_run_id(run_id)}/{RUN_DOC}"


def values_key(step: int) -> str:
    return f"{VALUES_DIR}/{int(step)}.json"


def config_key(digest: str) -> str:
    return f"{VALUES_DIR}/config-{digest}.json"


@dataclass(frozen=True)
class StepValues:
    """A step's recorded values: `values` by key, the commit record they belong to (its creation
    time), the digest of the training-side config they were recorded under, and when."""

    step: int
    values: Dict[str, float]
    commit_created: Optional[float]
    config: Optional[str]
    recorded: float
    machine: Optional[Dict[str, str]] = None   # what computed them (run.machine); None: not said (older values)


# --------------------------------------------------------------------------------------------
# numbers and configs


def as_number(value: Any) -> Optional[float]:
    """`value` as a float when it is a number (int, float, bool, a numpy scalar, a one-element tensor or
    array); None for anything else (a string, None, a list, a tensor of several elements)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    size = getattr(value, "size", None)
    numel = getattr(value, "numel", None)
    try:
        n = numel() if callable(numel) else (size if isinstance(size, int) else None)
    except Exception:  # noqa: BLE001 - not a tensor after all
        n = None
    if callable(item) and n == 1:
        try:
            out = item()
        except Exception:  # noqa: BLE001
            return None
        return float(out) if isinstance(out, (int, float)) else None
    return None


def numbers_of(values: Mapping[str, Any]) -> Tuple[Dict[str, float], List[str]]:
    """(the numeric values as floats, the keys left out because they are not numbers)."""
    kept: Dict[str, float] = {}
    left_out: List[str] = []
    for key, value in values.items():
        number = as_number(value)
        if number is None:
            left_out.append(str(key))
        else:
            kept[str(key)] = number
    return kept, left_out


def _machine_field(machine: Optional[Mapping[str, str]]) -> Dict[str, Any]:
    """A values document's `machine` key (what computed the values), absent when not known."""
    return {"machine": {str(k): str(v) for k, v in machine.items()}} if machine else {}


def _encode(x: float) -> Any:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _decode(x: Any) -> Optional[float]:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return _NON_FINITE.get(x) if isinstance(x, str) else None


def flatten_config(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """A nested config (dicts, lists, an OmegaConf node, a dataclass) as {dotted key: leaf}; leaves are
    JSON scalars, anything else its text. Lists are kept whole, as JSON text."""
    # resolved, as the fingerprint records its keys; an interpolation that cannot resolve here (a resolver only
    # a Hydra run registers, an unset environment variable) leaves the node's `${...}` text instead
    obj = plain(obj, or_text=True)
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    out: Dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
                out.update(flatten_config(v, key))
            else:
                out[key] = _leaf(v)
        return out
    if prefix:
        out[prefix] = _leaf(obj)
    return out


def _leaf(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return _encode(v)
    if isinstance(v, Enum):
        return v.value
    try:
        return json.dumps(v, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(v)


def config_digest(flat: Mapping[str, Any]) -> str:
    """A short digest of a flattened config (its canonical JSON)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(dict(flat), sort_keys=True, default=str).encode())


def config_changes(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> List[Tuple[str, Any, Any]]:
    """(key, recorded value, value now) for every key whose value differs (absent: None), sorted."""
    out = []
    for key in sorted(set(recorded) | set(now)):
        a, b = recorded.get(key), now.get(key)
        if a != b:
            out.append((key, a, b))
    return out


# --------------------------------------------------------------------------------------------
# the files


class ValuesStore:
    """The values files of one namespace, through its backend (safe from any thread)."""

    def __init__(self, namespace: Namespace):
        self.namespace = namespace

    def write_step(self, step: int, values: Mapping[str, float], *, commit_created: Optional[float],
                   config: Optional[str] = None, create_only: bool = False,
                   machine: Optional[Mapping[str, str]] = None) -> bool:
        """Store the step's values whole, replacing earlier ones atomically; with `create_only` only where
        the step has none (False when it has: they are kept). `machine`: what computed them (`run.machine`)."""
        doc = {
            "format": VALUES_FORMAT,
            "step": int(step),
            "commit_created": commit_created,
            "config": config,
            "recorded": time.time(),
            "values": {str(k): _encode(float(v)) for k, v in values.items()},
            **_machine_field(machine),
        }
        data = (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()
        if create_only:
            self.namespace.locker.fence(key=values_key(step))
            return self.namespace.storage.put_if_absent(values_key(step), data) is not None
        self.namespace.write_small(values_key(step), data)
        return True

    def write_run_step(self, run_id: str, step: int, values: Mapping[str, float], *, config: Optional[str] = None,
                       commit_created: Optional[float] = None, machine: Optional[Mapping[str, str]] = None) -> None:
        """Store what run `run_id` (a replay) reported for `step`, whole, beside the recording's."""
        doc = {
            "format": VALUES_FORMAT,
            "step": int(step),
            "run": run_id,
            "commit_created": commit_created,
            "config": config,
            "recorded": time.time(),
            "values": {str(k): _encode(float(v)) for k, v in values.items()},
            **_machine_field(machine),
        }
        self.namespace.write_small(run_values_key(run_id, step), (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())

    def write_run(self, run_id: str, doc: Mapping[str, Any]) -> None:
        """Store run `run_id`'s own document (when, where, its config digest, what it served)."""
        body = {"format": VALUES_FORMAT, "run": run_id, **dict(doc)}
        self.namespace.write_small(run_doc_key(run_id), (json.dumps(body, indent=1, sort_keys=True, default=str) + "\n").encode())

    def write_run_drift(self, run_id: str, step: int, K: int, W: int, firsts: Mapping[str, Optional[int]]) -> None:
        """Store an `action=compare` run's per-trajectory drift at `step`: each trajectory's first differing
        response token by its ref `{inner}.{rank}.{index}` at the run's K and W (None: identical)."""
        doc = {"format": VALUES_FORMAT, "step": int(step), "run": run_id, "K": int(K), "W": int(W),
               "first_difference": {str(k): (None if v is None else int(v)) for k, v in firsts.items()}}
        self.namespace.write_small(run_drift_key(run_id, step), (json.dumps(doc, indent=1) + "\n").encode())

    def read_run_drift(self, run_id: str, step: int) -> Optional[Dict[str, Any]]:
        """What `write_run_drift` stored for `step` ({"K", "W", "first_difference"}); None when nothing (or
        nothing readable)."""
        try:
            data = self.namespace.read_small(run_drift_key(run_id, step))
            doc = json.loads(data) if data is not None else None
        except Exception:  # noqa: BLE001 - unreadable: the step simply shows no per-trajectory drift
            return None
        if (not isinstance(doc, dict) or doc.get("format") != VALUES_FORMAT or doc.get("step") != int(step)
                or not isinstance(doc.get("first_difference"), dict)):
            return None
        firsts = {str(k): v for k, v in doc["first_difference"].items()
                  if v is None or (isinstance(v, int) and not isinstance(v, bool))}
        K, W = doc.get("K"), doc.get("W")
        return {"K": K if isinstance(K, int) else None, "W": W if isinstance(W, int) else None,
                "first_difference": firsts}

    def list_runs(self) -> List[str]:
        """The run ids that recorded values beside the recording (replays), oldest first (ids start
        with their UTC start time); [] when none or unreadable."""
        try:
            entries = self.namespace.list_dir(RUNS_DIR)
        except Exception:  # noqa: BLE001 - no runs directory (a POSIX ENOENT), or out of reach
            return []
        names = {e.name.rstrip("/") for e in entries}
        return sorted((n for n in names if _RUN_ID.fullmatch(n)), key=run_order)

    def read_run(self, run_id: str) -> Optional[Dict[str, Any]]:
        """Run `run_id`'s document; None when absent or unreadable."""
        try:
            data = self.namespace.read_small(run_doc_key(run_id))
            doc = json.loads(data) if data is not None else None
        except Exception:  # noqa: BLE001
            return None
        return doc if isinstance(doc, dict) else None

    def read_run_step(self, run_id: str, step: int) -> Optional[StepValues]:
        """What run `run_id` reported for `step`; None when nothing (or nothing readable)."""
        return self._read(run_values_key(run_id, step), step)

    def steps(self) -> List[int]:
        """The steps the recording holds values for (`{step}.json` under .values/), in order."""
        try:
            entries = self.namespace.list_dir(VALUES_DIR)
        except Exception:  # noqa: BLE001
            return []
        return sorted(int(e.name[:-5]) for e in entries if e.name.endswith(".json") and e.name[:-5].isdigit())

    def run_steps(self, run_id: str) -> List[int]:
        """The steps run `run_id` recorded values for, in order."""
        try:
            entries = self.namespace.list_dir(f"{RUNS_DIR}/{check_run_id(run_id)}")
        except Exception:  # noqa: BLE001
            return []
        out = []
        for e in entries:
            stem = e.name[:-5] if e.name.endswith(".json") else ""
            if stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    def read_step(self, step: int) -> Optional[StepValues]:
        """The step's values document as stored (not checked against the commit record); None when
        there is none or it does not parse (a values file is never a fault of the step)."""
        return self._read(values_key(step), step)

    def _read(self, key: str, step: int) -> Optional[StepValues]:
        try:
            data = self.namespace.read_small(key)
        except Exception:  # noqa: BLE001 - unreadable values: the step is simply unchecked
            return None
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(doc, dict) or doc.get("format") != VALUES_FORMAT or doc.get("step") != int(step):
            return None
        raw = doc.get("values")
        if not isinstance(raw, dict):
            return None
        values = {}
        for k, v in raw.items():
            x = _decode(v)
            if x is not None:
                values[str(k)] = x
        created = doc.get("commit_created")
        created = float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else None
        config = doc.get("config") if isinstance(doc.get("config"), str) else None
        recorded = doc.get("recorded") if isinstance(doc.get("recorded"), (int, float)) else 0.0
        machine = doc.get("machine")
        machine = ({str(k): str(v) for k, v in machine.items() if isinstance(v, (str, int, float))}
                   if isinstance(machine, dict) else None)
        return StepValues(int(step), values, created, config, float(recorded), machine or None)

    def add_blessing(self, doc: Mapping[str, Any]) -> None:
        """Append one blessing (when, why: the training-side change, which steps) to the namespace's list."""
        body = {"format": VALUES_FORMAT, "blessings": [*self.read_blessings(), dict(doc)]}
        self.namespace.write_small(BLESSED, (json.dumps(body, indent=1, sort_keys=True, default=str) + "\n").encode())

    def read_blessings(self) -> List[Dict[str, Any]]:
        """Every blessing of the recorded values, oldest first; [] when none or unreadable."""
        try:
            data = self.namespace.read_small(BLESSED)
            doc = json.loads(data) if data is not None else None
        except Exception:  # noqa: BLE001
            return []
        found = doc.get("blessings") if isinstance(doc, dict) else None
        return [b for b in found if isinstance(b, dict)] if isinstance(found, list) else []

    def write_config(self, digest: str, flat: Mapping[str, Any]) -> None:
        """Store a flattened training-side config under its digest (once: it never changes)."""
        doc = {"format": VALUES_FORMAT, "digest": digest, "config": dict(flat)}
        self.namespace.write_small(config_key(digest),
                                 (json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n").encode())

    def read_config(self, digest: str) -> Optional[Dict[str, Any]]:
        """The flattened config stored under `digest`; None when absent or unreadable."""
        try:
            data = self.namespace.read_small(config_key(digest))
            doc = json.loads(data) if data is not None else None
        except Exception:  # noqa: BLE001
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
            return None
        return doc["config"]


__all__ = [
    "RUNS_DIR", "VALUES_DIR", "StepValues", "ValuesStore", "as_number", "check_run_id", "config_changes",
    "config_digest", "config_key", "flatten_config", "new_run_id", "numbers_of", "run_doc_key", "run_values_key",
    "values_key",
]
