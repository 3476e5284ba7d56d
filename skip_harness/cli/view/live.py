"""Who is at a namespace now: the run recording it (the lock's holder) and the replays reading it, found
without taking or writing anything, so a page of a namespace still being recorded can say so and
refresh itself (an HTTP `Refresh` header: no script) until the recording ends.

- The recording: on a local cache, the lock's holder record (`.lock.holder.json`: pid, host, since),
  read without following a link and never by trying the lock (a trial lock would be a lock); the run is
  live when its pid runs on this host and started no later than the record says (a pid reused by a
  later process is not the holder). A record from another host cannot be checked from here: it is shown
  as such, and trusted (a run removes its record when it ends: "no holder record outlives its run").
  On an object store, the lease, read without writing (one that has run out, or whose process is known
  dead, holds nothing).
- The replays: each replay that served a hit leaves `.values/runs/{run_id}/run.json` (started, host,
  pid); one is live when that pid runs on this host and started no later than the record. Replays of
  other hosts are counted, their liveness unknown. A replay that has not served a hit yet has left no
  record and is not seen. The newest RUNS_READ records are read.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from skip_harness.cli.view.data import Cache, ViewedNamespace
from skip_harness.store.api import ValuesStore, process_runs_since, read_lock_holder

RUNS_READ = 20            # replay records read per namespace (the newest)
REFRESH_S = 5             # the overview and a namespace page refresh this often while a recording runs
REFRESH_STEP_S = 10       # a step page (longer to read)


@dataclass(frozen=True)
class Holder:
    """A run at the namespace: its pid, host and since when (None: not recorded), and whether it runs
    (None: on another host, unknowable here)."""

    pid: Optional[int]
    host: str
    since: Optional[float]
    alive: Optional[bool]
    run_id: str = ""
    text: str = ""            # the lease's own description (object stores)

    def describe(self) -> str:
        if self.text:
            return self.text
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since)) if self.since else "?"
        return f"pid {self.pid} on host {self.host} since {when}"


@dataclass(frozen=True)
class Live:
    recording: Optional[Holder] = None
    replays: List[Holder] = field(default_factory=list)    # live ones, this host
    elsewhere: int = 0                                      # replay records from other hosts (liveness unknown)

    @property
    def refreshing(self) -> bool:
        """Being recorded now (or by a run on another host that still holds its record)."""
        return self.recording is not None and self.recording.alive is not False

    def to_json(self) -> Dict[str, Any]:
        rec = self.recording
        return {"recording": None if rec is None else {"pid": rec.pid, "host": rec.host, "since": rec.since,
                                                        "alive": rec.alive, "holder": rec.describe()},
                "replaying": [{"run": r.run_id, "pid": r.pid, "host": r.host, "since": r.since} for r in self.replays],
                "replays_on_other_hosts": self.elsewhere}


def _alive(pid: int, host: str, since: Optional[float]) -> Optional[bool]:
    return process_runs_since(pid, since) if host == socket.gethostname() else None


def _recording(cache: Cache, ns: ViewedNamespace) -> Optional[Holder]:
    layout = ns.layout
    if layout.packed:                              # a pack file: nobody records it
        return None
    if isinstance(layout.root, Path):
        record = read_lock_holder(layout)          # never through a link, never by trying the lock
        if record is None:
            return None
        alive = _alive(record.pid, record.host, record.since)
        return None if alive is False else Holder(record.pid, record.host, record.since, alive)
    try:
        text = cache.reader(ns).namespace.holder()      # the lease, read without writing
    except Exception:  # noqa: BLE001 - a store out of reach: nothing to say about its holder
        return None
    return None if text is None else Holder(None, "", None, True, text=text)


def _replays(cache: Cache, ns: ViewedNamespace) -> Live:
    values = ValuesStore(cache.reader(ns).namespace)
    here, others = [], 0
    for run_id in values.list_runs()[-RUNS_READ:]:
        doc = values.read_run(run_id) or {}
        try:
            pid, host, since = int(doc["pid"]), str(doc["host"]), float(doc["started"])
        except (KeyError, TypeError, ValueError):
            continue
        alive = _alive(pid, host, since)
        if alive is None:
            others += 1
        elif alive:
            here.append(Holder(pid, host, since, True, run_id=run_id))
    return Live(None, here, others)


def live(cache: Cache, ns: ViewedNamespace) -> Live:
    """Who records `ns` now and which replays read it (see the module's docstring)."""
    replays = _replays(cache, ns)
    return Live(_recording(cache, ns), replays.replays, replays.elsewhere)
