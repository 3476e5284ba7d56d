"""The run's statistics: one record per decided step, and a summary computed from those records.

The summary is an aggregate of the per-step records and nothing else, so it always adds up: every
decided step is counted once (hit, repeat, miss or uncached), every miss as committed or not, with
the reason. Owned and updated by the trainer's thread only.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from skip_harness.errors import HarnessUsageError


class Outcome(str, Enum):
    """What a step was served: a string-valued enum, so `outcome == "hit"`, a dict keyed by "hit", json
    and log lines all see the plain string (`str(Outcome.HIT) == "hit"`)."""

    HIT = "hit"
    MISS = "miss"
    REPEAT = "repeat"
    OFF = "off"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


HIT, MISS, REPEAT, OFF = Outcome.HIT, Outcome.MISS, Outcome.REPEAT, Outcome.OFF
KINDS = (HIT, REPEAT, MISS, OFF)

# Why a miss was not committed (the keys of RunSummary.uncommitted_reasons).
WRITE_FAILED = "write failed"
PAYLOAD_REFUSED = "payload refused"
SHORT_STEP = "short step"
OTHER_RANK_FAILED = "another rank failed"
COMMIT_FAILED = "commit failed"
READ_ONLY = "read-only cache"
OWN_ROLLOUTS = "own rollouts, not written"   # a reader's miss: another live run records the namespace
COMPARED = "compared with the recording, not written"   # skip.rollout_tq.action=compare


def not_written(reason: str) -> bool:
    """Whether a miss's reason says nothing was written for it (a read-only cache, a reader's own rollouts)."""
    return reason in (READ_ONLY, COMPARED) or reason.startswith(OWN_ROLLOUTS)


@dataclass(frozen=True)
class StepRecord:
    """What happened in one step, as its per-step log line reports it.

    bytes: for a hit, a repeat and a committed miss, the step's size on disk -- every rank's payload
        and meta.json files and the commit record, the size `skip-harness ls` shows; for a miss not
        committed, what this rank generated (the files it wrote; in a read-only cache, the bytes its
        mini-batches would have taken).
    gen_s: seconds spent generating (misses only); load_s: seconds to verify and load (hits, repeats).
    saved_s: generation seconds the served batches cost when they were recorded.
    committed: for a miss, whether the step was committed; reason says why not.
    """

    step: int
    kind: str
    K: int
    source_step: Optional[int] = None
    bytes: int = 0
    gen_s: float = 0.0
    load_s: float = 0.0
    saved_s: float = 0.0
    committed: Optional[bool] = None
    reason: str = ""
    unverified: bool = False
    regenerated: bool = False  # a hit whose inputs differed from the recorded ones, generated again
    served_from: str = ""      # a hit from another recording (replay_from): `re-chunked from K=4 to K=2`, ...
    compared: str = ""         # action=compare: how the step's rollouts drifted from the recording's (run.drift)


@dataclass
class PhaseTime:
    """A second-tier phase's time in the run (run.tier): seconds spent running it, seconds saved by serving
    its stored values (what they cost when recorded), and how many calls were served or computed."""

    spent_s: float = 0.0
    saved_s: float = 0.0
    served: int = 0
    computed: int = 0


@dataclass(frozen=True)
class RunSummary:
    hits: int
    repeats: int
    misses: int
    off: int
    committed: int
    uncommitted: int
    uncommitted_reasons: Dict[str, int]
    bytes_read: int
    bytes_written: int
    gen_s_spent: float
    gen_s_saved: float
    load_s: float
    bytes_not_written: int = 0   # a read-only cache: what the misses generated, which nothing wrote
    replay: Any = None      # a run.replay_check.ReplayReport: did the served steps reproduce their recorded values
    phases: Dict[str, PhaseTime] = field(default_factory=dict)   # the second tier: reward, reference, ...
    namespace: str = ""     # the cache's directory (the harness's layout.root), once the run started
    compared: str = ""      # action=compare: `rollouts compared: X of Y trajectories identical (...)`

    def __str__(self) -> str:
        """The summary line the run logs at its end (`rollout cache summary: 4 steps: 0 hits, 0 repeats, 4
        misses (4 committed, 0 not), ...; cache in /path/to/namespace`): what `print(harness.close())`
        shows. The fields one by one: `repr()`."""
        from skip_harness.run.callbacks import describe_summary   # the line is the logging callback's

        return describe_summary(self, self.namespace or None)

    @property
    def phases_line(self) -> str:
        """`generation 0.0s spent, 41.2s saved; reward 0.0s spent, 12.4s saved; reference ...`: the
        time each phase cost and saved (generation, then the second tier's phases, run.tier)."""
        parts = [f"generation {self.gen_s_spent:.1f}s spent, {self.gen_s_saved:.1f}s saved"]
        parts += [f"{name} {t.spent_s:.1f}s spent, {t.saved_s:.1f}s saved" for name, t in self.phases.items()]
        return "; ".join(parts)

    @property
    def replay_line(self) -> str:
        """`replay: 20 of 20 served steps reproduced (9 values each)`, or where the replay diverged;
        '' when no served step reported values."""
        return "" if self.replay is None else self.replay.describe()

    @property
    def replay_short(self) -> str:
        """The replay verdict in a few words (`4/4 reproduced`, `diverged at 2: loss`): a sweep table's
        cell; '' when no served step reported values."""
        return "" if self.replay is None else self.replay.short()

    @property
    def steps(self) -> int:
        return self.hits + self.repeats + self.misses + self.off


@dataclass
class RunStats:
    records: List[StepRecord] = field(default_factory=list)
    _seen: set = field(default_factory=set)

    def add(self, record: StepRecord) -> None:
        if record.step in self._seen:
            raise HarnessUsageError(f"step {record.step} was decided twice (the trainer went back to an earlier step?)")
        if record.kind not in KINDS:
            raise ValueError(f"unknown step kind {record.kind!r}")
        self._seen.add(record.step)
        self.records.append(record)

    def summary(self) -> RunSummary:
        kinds = Counter(r.kind for r in self.records)
        misses = [r for r in self.records if r.kind == MISS]
        served = [r for r in self.records if r.kind in (HIT, REPEAT)]
        reasons = Counter(r.reason.split(":")[0] for r in misses if not r.committed)
        return RunSummary(
            hits=kinds[HIT], repeats=kinds[REPEAT], misses=kinds[MISS], off=kinds[OFF],
            committed=sum(1 for r in misses if r.committed),
            uncommitted=sum(1 for r in misses if not r.committed),
            uncommitted_reasons=dict(sorted(reasons.items())),
            bytes_read=sum(r.bytes for r in served),
            bytes_written=sum(r.bytes for r in misses if not not_written(r.reason)),
            bytes_not_written=sum(r.bytes for r in misses if not_written(r.reason)),
            gen_s_spent=sum(r.gen_s for r in self.records),
            gen_s_saved=sum(r.saved_s for r in served),
            load_s=sum(r.load_s for r in served),
        )
