"""Did the replay reproduce? What each step produced, recorded on a miss and checked on a hit.

The trainer reports a step's values (`SkipHarness.observe(step, **values)`, on its own thread). For a
step it generated (a miss), the values are recorded with the step once it is committed -- on the
writer thread, after the commit and apart from it (`store.values`), so a step without values is still
complete. For a step served from the cache (a hit), they are compared with the recorded ones
(`skip.rollout_tq.replay_check`, `replay_rtol`, `replay_atol`, `replay_ignore`): the first difference
is one `Divergence`, told to the callbacks (`on_replay_divergence`; the logging one warns), naming the
step, the key, both values and the training-side config keys whose values differ from the recorded
run's; with `replay_check=error` it then stops the run (`ReplayDivergedError`). `ReplayReport` is what
the summary says.

Only numbers are recorded and compared (ints, floats, bools, numpy scalars, one-element tensors); any
other value is left out (said once per key at DEBUG). Rank 0 records; every rank checks (a trainer's
reported values are the same on every rank), rank 0 speaks.

A served step whose recording has no values (its recorder was killed after the commit, before it
reported them) gets this run's, create-only, once this run -- a reader -- took the hold when the
recording ended and its replay of an earlier step reproduced the recorded values with no divergence
up to that step: then its values are the recording's, and later replays are checked on that step too.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from skip_harness.config import ROLLOUT_VALUES, WEIGHTS_PREFIX, WORKER_KEYS, Action, ReplayCheck, RolloutTQConfig
from skip_harness.errors import ReplayDivergedError
from skip_harness.run.baseline import Baseline, find_baseline
from skip_harness.run.discards import DiscardReporting, Discards   # a step's discards go with its values
from skip_harness.run.divergence import Divergence
from skip_harness.run.drift import trajectory_firsts
from skip_harness.run.machine import describe as describe_machine
from skip_harness.run.machine import difference as machine_difference
from skip_harness.run.machine import this_machine
from skip_harness.run.replay_report import ReplayReport, _steps
from skip_harness.run.shape import Regroup, shard_key, worker_change, workers_of
from skip_harness.run.stats import HIT, MISS
from skip_harness.run.tolerance import NOISE_WORDS, ToleranceModel, learning_rate
from skip_harness.store.api import config_changes, config_digest, numbers_of

log = logging.getLogger("skip_harness")


def _rollout_value(key: str) -> bool:
    low = key.lower()
    return any(fnmatch.fnmatchcase(low, p) for p in ROLLOUT_VALUES)


def depends_on_rollouts(key: str) -> bool:
    """Whether a value depends on a step's rollouts alone (config.ROLLOUT_VALUES): compared at another K."""
    return _rollout_value(key)


def same_on_any_w(key: str) -> bool:
    """Whether a value is the same on any W for any trainer: the rollout values and the learning rate (set by
    a schedule, not reduced over ranks). At another W of a trainer not W-invariant these are compared with the
    recording's, so a changed learning rate is caught on the first replay at that W."""
    return _rollout_value(key) or learning_rate(key)


@dataclass
class _Served:
    compared: int = 0
    diverged: bool = False


def check_settings(settings: RolloutTQConfig) -> Dict[str, Any]:
    """The tolerances a run's replay check compares values within, as its `run.json` keeps them (`diff` reads
    them back: `cli.pairing.recorded_tolerances`)."""
    return {"rtol": float(settings.replay_rtol), "atol": float(settings.replay_atol),
            "tolerances": {str(p): {"rtol": float(t.rtol), "atol": float(t.atol)}
                           for p, t in (settings.replay_tolerances or {}).items()}}


class ValuesTracker:
    """Records a miss step's values once it is committed; checks a hit step's against the recorded ones.
    Trainer's thread only (writes go to the coordinator's writer thread)."""

    def __init__(self, settings: RolloutTQConfig, reader: Any, coordinator: Any, callbacks: Any, is_main: bool,
                 training_config: Optional[Mapping[str, Any]] = None, w_invariant: bool = True,
                 workers_from_config: bool = False):
        self.settings = settings
        # run.shape: whether the training values are invariant under W, and whether W is verl's worker count
        self.w_invariant, self.workers_from_config = w_invariant, workers_from_config
        self._shape: Optional[Regroup] = None       # the recording's K and W and this run's, once a step told
        self._machine: Optional[Dict[str, str]] = None   # what computes this run's values (run.machine), once asked
        self._recorded_machine: Optional[Dict[str, str]] = None   # the recording's, as its first compared step says
        self.check = ReplayCheck(settings.replay_check)
        # action=compare (run.drift): nothing is recorded; the run's values (its drift figures included) are
        # kept under its run id from its first step, as a replay's are
        self.comparing = settings.action == Action.compare
        self.reader = reader
        self.coordinator = coordinator
        self.callbacks = callbacks
        self.is_main = is_main
        self.discards = Discards(coordinator, is_main)     # what a filter dropped from a step (run.discards)
        self._ignore = [p.lower() for p in settings.replay_ignore]
        self.set_training_config(training_config)
        self._config_written = False
        self._pending: Dict[int, Dict[str, float]] = {}       # a miss's values waiting for its commit
        self._committed: Dict[int, float] = {}                 # a committed miss: its commit record's time
        self._recorded: Dict[int, Dict[str, float]] = {}      # what was recorded for a committed miss
        self._served: Dict[int, _Served] = {}
        self._recorded_configs: Dict[str, Optional[Dict[str, Any]]] = {}
        self._left_out: Set[str] = set()
        self.divergence: Optional[Divergence] = None
        # a replay's own values, kept under its run id (store.values): from its first served step on
        self.run_id: Optional[str] = None
        self._observed: Dict[int, Dict[str, float]] = {}
        self._replaying = False
        self._run_doc: Optional[Dict[str, Any]] = None   # this replay's run.json, once written
        self._source: Any = None                      # replay_from: the recording's store, K and W
        self._from_source: Callable[[int], bool] = lambda step: False
        self._K, self._W = 1, 1
        self._not_compared: Set[str] = set()          # at another K: training values recorded there
        self._runs_into: Any = None                  # where the run's values go (None: this run's namespace)
        self._runs_note = ""                          # said once when they cannot go where ls counts them
        self._keep_runs = True
        self._compared_rollout: Set[str] = set()
        self._weights_left_out = False                # weights/* served at another K or W (run.weights)
        self._tolerances = ToleranceModel.of(settings)             # same shape: replay_rtol / replay_atol
        self._regrouped_tol = self._tolerances.at(regrouped=True)   # another K or W: rounding noise too
        self._baseline: Optional[Baseline] = None                  # at another K: an earlier replay at this K
        self._baseline_compared: Set[str] = set()
        self._baseline_looked = False
        self._created = time.time()                 # a baseline replay started before this run
        # served steps the recording has no values for (its recorder ended first): filled in once this
        # reader took the hold (`holds`, set by the harness)
        self.holds: Callable[[], bool] = lambda: False
        self._gaps: Dict[int, Dict[str, float]] = {}

    def serve_from(self, source: Any, K: int, W: int, from_source: Callable[[int], bool], deferred: bool = False) -> None:
        """Steps for which `from_source(step)` are served from `source` (a `run.recording.Recording`, another K
        or W): their recorded values live there. At another K -- or another W, for a trainer whose training
        values depend on W (run.shape) -- the values that depend on the rollouts alone are compared with the
        recording's (config.ROLLOUT_VALUES), the others with those of the recording's first replay at this
        run's K and W and the recording's training side, if one kept them (run.baseline); at another W for a
        W-invariant trainer every value; within rounding noise (run.tolerance). The run's own values are kept in the recording (under its run id); where it
        cannot be written, in this run's namespace -- not at all when that was not created (`deferred`)."""
        self._source, self._K, self._W, self._from_source = source, K, W, from_source
        # a replay_from run is a replay of the recording: its values are kept there, where `ls` counts them
        why = source.store.namespace.writable()
        self._runs_into = source.store.writer if why is None else None
        if why is not None:
            where = "not kept" if deferred else f"kept in {self.reader.layout.root} instead"
            self._runs_note = f"this replay's values are {where}: the recording {source.layout.url} cannot be written ({why})"
            self._keep_runs = not deferred

    def set_training_config(self, flat: Optional[Mapping[str, Any]]) -> None:
        self.training_config = None if flat is None else dict(flat)
        self.config_digest = None if flat is None else config_digest(self.training_config)
        self._config_written = False

    @property
    def machine(self) -> Dict[str, str]:
        """The machine this run's values are computed on (run.machine), stored beside each step's values;
        taken at the first values reported (the trainer has set its threads and devices by then)."""
        if self._machine is None:
            self._machine = this_machine()
        return self._machine

    # ---- the trainer's calls
    def observe(self, step: int, outcome: str, values: Mapping[str, Any]) -> None:
        numbers, left_out = numbers_of(values)
        for key in left_out:
            if key not in self._left_out:
                self._left_out.add(key)
                log.debug("observe: %r is not a number (%s); left out of the replay check",
                          key, type(values[key]).__name__)
        self._fill_gaps(before=step)
        if outcome == MISS:
            if not self.comparing:
                self._record(step, numbers)
        elif outcome == HIT and self.check != ReplayCheck.off:
            try:
                self._compare(step, numbers)
            finally:
                self._keep(step, outcome, numbers)
            return
        elif outcome == HIT:
            self._served.setdefault(step, _Served())
        self._keep(step, outcome, numbers)

    def compared(self, step: int, figures: Mapping[str, float]) -> None:
        """action=compare: a step's drift figures (run.drift), kept with the run's values under its run id;
        each trajectory's first differing token beside them (`Figures.batches`)."""
        self._keep(step, MISS, dict(figures))
        batches = getattr(figures, "batches", ())
        if batches and self._replaying and self._keep_runs and self.is_main and self.run_id is not None:
            K, W = (self._K, self._W) if self._source is not None else (self.reader.layout.K, self.reader.layout.W)
            firsts = trajectory_firsts(batches, K, W)
            if firsts:
                self.coordinator.record_run_drift(self.run_id, step, K, W, firsts, self._runs_into)

    def committed(self, step: int, created: Optional[float]) -> None:
        """A miss step's commit record landed (rank 0 knows `created`): record what it produced."""
        if created is None or not self.is_main:
            return
        self.discards.committed(step, created)
        self._committed[step] = created
        pending = self._pending.pop(step, None)
        if pending is not None:
            self._write(step, pending)

    # ---- a replay's own values (under its run id: never over the recording's)
    def _keep(self, step: int, outcome: str, numbers: Dict[str, float]) -> None:
        """Keep what this run reported; once it served a step (it is a replay), write every step's
        values under its run id -- the ones reported before too -- and each one as it comes."""
        if not self.is_main or self.run_id is None:
            return
        starts = outcome == HIT or self.comparing
        if not self._keep_runs:
            if starts and not self._replaying:
                self._replaying = True
                log.warning("%s", self._runs_note)
            return
        if numbers:
            self._observed[step] = {**self._observed.get(step, {}), **numbers}
        into = self._runs_into
        if starts and not self._replaying:
            self._replaying = True
            if self._runs_note:
                log.warning("%s", self._runs_note)
            doc = {"started": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                   "config": self.config_digest, "training_config": self.training_config,
                   "namespace": str(self.reader.layout.root), "K": self.reader.layout.K,
                   "W": self.reader.layout.W, "w_invariant": self.w_invariant, "machine": self.machine}
            if self.workers_from_config:     # verl: W for the check is its worker count (run.shape)
                doc["workers"] = workers_of(self.training_config)
            if self._source is not None:
                doc["replay_from"] = str(self._source.layout.url)
            if self.comparing:
                doc["action"] = Action.compare.value
            doc["replay_check"] = check_settings(self.settings)        # `diff` compares as this run did
            if self.divergence is not None:                            # at its first served step
                doc["diverged_at"] = self.divergence.step
            self._run_doc = doc
            self.coordinator.record_run(self.run_id, doc, into)
            for s in sorted(self._observed):
                self.coordinator.record_run_values(self.run_id, s, self._observed[s], self.config_digest, into,
                                                   machine=self.machine)
        elif self._replaying and numbers:
            self.coordinator.record_run_values(self.run_id, step, self._observed[step], self.config_digest, into,
                                               machine=self.machine)

    def _write_config(self) -> None:
        if self.training_config is not None and not self._config_written:
            self._config_written = True
            self.coordinator.record_config(self.config_digest, self.training_config)

    # ---- recording
    def _record(self, step: int, numbers: Dict[str, float]) -> None:
        if not self.is_main or not numbers:
            return
        if step in self._committed:
            merged = {**self._recorded.get(step, {}), **numbers}
            self._write(step, merged)
        else:
            self._pending[step] = {**self._pending.get(step, {}), **numbers}

    def _write(self, step: int, values: Dict[str, float]) -> None:
        self._recorded[step] = values
        self._write_config()
        self.coordinator.record_values(step, values, self._committed[step], self.config_digest, machine=self.machine)

    def _fill_gaps(self, before: int) -> None:
        """Record this run's values for served steps before `before` that the recording has none for,
        create-only, once this run holds the namespace and reproduced an earlier step (module doc)."""
        if not self._gaps or not self.is_main or not self.holds():
            return
        if self._shape is not None and (self._shape.rechunked or self._shape.resharded):
            self._gaps.clear()      # values at another K or W are not what the recording would have recorded
            return
        for step in sorted(s for s in self._gaps if s < before):
            if self.divergence is not None and self.divergence.step <= step:
                self._gaps.clear()             # this run is not the recorded one from here on
                return
            reproduced = [s for s, v in self._served.items() if s < step and v.compared and not v.diverged]
            if not reproduced:
                continue                       # nothing vouches for this run's values yet
            values = self._gaps.pop(step)
            try:
                record = self.reader.read_commit(step)
            except Exception:  # noqa: BLE001 - an unreadable record: the step stays unchecked
                record = None
            if record is None:
                continue
            self._write_config()
            self.coordinator.record_values(step, values, record.created, self.config_digest, create_only=True,
                                           machine=self.machine)
            log.info("step %d: the recording has no values for it (its run ended before it reported them): "
                     "recorded this run's, which reproduced %d earlier %s", step, len(reproduced),
                     _steps(len(reproduced)))

    # ---- checking
    def _ignored(self, key: str) -> bool:
        low = key.lower()     # a parameter's digest: only patterns of weights/ keys (not `*time*` ...) leave it out
        weights = low.startswith(WEIGHTS_PREFIX)
        return any(fnmatch.fnmatchcase(low, p) for p in self._ignore if not weights or p.startswith(WEIGHTS_PREFIX))

    def _compare(self, step: int, numbers: Dict[str, float]) -> None:
        served = self._served.setdefault(step, _Served())
        if self.divergence is not None:
            return                         # past the first divergence nothing is compared
        from_source = self._source is not None and self._from_source(step)
        reader = self._source.store.reader if from_source else self.reader
        recorded = reader.read_step_values(step)
        # at another K or W (not a recording, or a pack, of this run's shape): rounding noise is no divergence
        if recorded is None:
            if not from_source and self.is_main and numbers:
                self._gaps[step] = {**self._gaps.get(step, {}), **numbers}
            return
        # at another K or W, or on another machine: rounding noise is no divergence
        shape = self._shape_of(from_source, recorded.config, reader, recorded.machine)
        keys = [k for k in numbers if k in recorded.values and not self._ignored(k)]   # as reported
        tolerances = self._regrouped_tol if shape.regrouped else self._tolerances
        later: List[str] = []
        if shape.regrouped:  # weight digests change legitimately at another K or W (the update sums in another order)
            self._weights_left_out |= any(k.startswith(WEIGHTS_PREFIX) for k in keys)
            keys = [k for k in keys if not k.startswith(WEIGHTS_PREFIX)]
        if shape.depends_on:   # the training values: against a baseline replay at this K and W (run.baseline)
            here = same_on_any_w if shape.depends_on == "W" else _rollout_value
            later = [k for k in keys if not here(k)]
            keys = [k for k in keys if here(k)]
            self._compared_rollout.update(keys)
        for key in keys:
            served.compared += 1
            exact = key.startswith(WEIGHTS_PREFIX)          # a digest: equal or not, never within a tolerance
            if not (recorded.values[key] == numbers[key] if exact else
                    tolerances.same(key, recorded.values[key], numbers[key])):
                served.diverged = True
                changes, known = self._changes(recorded.config, reader)
                if shape.resharded:     # the keys that change with W are the re-sharding, not an explanation
                    changes = tuple(c for c in changes if not shard_key(c[0]))
                self._diverged(Divergence(step, key, recorded.values[key], numbers[key], changes, known,
                                          tolerance="exact" if exact else tolerances.of_key(key).describe()))
                return
        self._compare_baseline(step, served, numbers, later, from_source, self._recorded_config(recorded.config, reader))

    def _shape_of(self, from_source: bool, digest: Optional[str], reader: Any,
                  machine: Optional[Dict[str, str]] = None) -> Regroup:
        """The recording's K and W and this run's (run.shape): the recording's namespace's, or verl's worker
        counts read from the recorded training-side config and this run's; and how the machine that recorded
        the step's values (`machine`, None when they do not say) differs from this one (run.machine)."""
        src = self._source
        K0, W0 = (src.K, src.W) if from_source else (self.reader.layout.K, self.reader.layout.W)
        K1, W1 = (self._K, self._W) if from_source else (K0, W0)
        workers = worker_change(self._recorded_config(digest, reader), self.training_config) if self.workers_from_config else None
        if workers is not None:
            W0, W1 = workers[0], workers[1]
        differs = machine_difference(machine, self.machine)
        shape = Regroup(K0, K1, W0, W1, self.w_invariant, () if workers is None else workers[2] or WORKER_KEYS[1:],
                        differs)
        if from_source or workers is not None or differs:
            if differs and (self._shape is None or not self._shape.machine):
                self._recorded_machine = machine
                if machine is None and self.is_main:
                    log.warning("the recording's values do not say which machine computed them (recorded before "
                                "skip_harness kept it): compared within rounding noise, not exactly, and weight "
                                "digests not at all; record the steps again, or bless a replay, to compare them "
                                "exactly on this machine")
            self._shape = shape
        return shape

    def _compare_baseline(self, step: int, served: _Served, numbers: Dict[str, float], keys: List[str],
                          from_source: bool, recorded: Optional[Dict[str, Any]]) -> None:
        """At another K (or W, for a trainer not invariant under W): the values that depend on it, compared with
        the earlier replay's at this K and W (same shape: replay_rtol / replay_atol, exact by default); not
        compared when none kept them."""
        if not keys:
            return
        if not self._baseline_looked:          # looked up once, at the first step compared (run_id known)
            self._baseline_looked = True
            namespace = self._source.store.namespace if from_source else self.reader.namespace
            K, W = (self._K, self._W) if from_source else (self.reader.layout.K, self.reader.layout.W)
            self._baseline = find_baseline(namespace, recorded, K, W, self.run_id, self._created, self.training_config,
                                           self.machine)
        base = self._baseline
        theirs = None if base is None else base.values(step)
        if base is None or theirs is None:
            self._not_compared.update(keys)
            return
        self._not_compared.update(k for k in keys if k not in theirs)
        # the baseline replay computed on another machine (or not saying): within rounding noise
        tolerances = self._regrouped_tol if machine_difference(base.machine(step), self.machine) else self._tolerances
        for key in (k for k in keys if k in theirs):
            served.compared += 1
            self._baseline_compared.add(key)
            if not tolerances.same(key, theirs[key], numbers[key]):
                served.diverged = True
                now = self.training_config
                changes = () if now is None else tuple(config_changes(base.training_config, now))
                at = self._shape.at() if self._shape is not None else f"K={self._K}, W={self._W}"
                self._diverged(Divergence(step, key, theirs[key], numbers[key], changes, self.training_config is not None,
                                          tolerance=tolerances.of_key(key).describe(),
                                          reference=f"; recorded by replay {base.run} at {at}"))
                return

    def _regrouped_note(self) -> str:
        """What a replay at another K or W, or on another machine, compared, and how (the summary's replay line)."""
        shape = self._shape
        if shape is None or not shape.regrouped:
            return ""
        parts: List[str] = []
        if shape.rechunked:
            parts.append(f"re-chunked from K={shape.K0} to K={shape.K1}: values recorded at K={shape.K0}")
        if shape.resharded:
            at = f"{shape.W0} workers" if shape.workers else f"W={shape.W0}"
            parts.append(shape.resharded_words() + (f": values recorded at {at}" if shape.depends_on == "W" else ""))
        if shape.machine and not (shape.rechunked or shape.resharded):   # at another K or W that says it all
            if self._recorded_machine is None:      # values recorded before machines were kept
                parts.append(shape.machine)
            else:
                parts.append(f"computed on another machine (recorded on {describe_machine(self._recorded_machine)}: "
                             f"{shape.machine})")
        if shape.depends_on:
            if self._baseline_compared and self._baseline is not None:
                parts.append(f"{', '.join(sorted(self._baseline_compared))} compared with replay "
                             f"{self._baseline.run}'s at {shape.at()}")
            if self._not_compared - self._baseline_compared:
                parts.append(f"{', '.join(sorted(self._not_compared - self._baseline_compared))} not compared "
                             f"(they depend on {shape.depends_on})")
            if self._compared_rollout:
                parts.append(f"{', '.join(sorted(self._compared_rollout))} compared {NOISE_WORDS}")
        else:
            parts.append(f"compared {NOISE_WORDS}")
        if self._weights_left_out:
            why = "K and W" if shape.rechunked or shape.resharded else "the machine"
            parts.append(f"{WEIGHTS_PREFIX}* not compared (the weights change with {why})")
        return "; ".join(parts)

    def _recorded_config(self, digest: Optional[str], reader: Any = None) -> Optional[Dict[str, Any]]:
        """The training-side config recorded under `digest` (read once)."""
        if digest is None:
            return None
        if digest not in self._recorded_configs:
            self._recorded_configs[digest] = (reader or self.reader).read_training_config(digest)
        return self._recorded_configs[digest]

    def _changes(self, digest: Optional[str], reader: Any = None) -> Tuple[Tuple[Tuple[str, Any, Any], ...], bool]:
        if digest is None or self.training_config is None:
            return (), False
        then = self._recorded_config(digest, reader)
        if then is None:
            return (), False
        return tuple(config_changes(then, self.training_config)), True

    def _diverged(self, d: Divergence) -> None:
        self.divergence = d
        if self._run_doc is not None and "diverged_at" not in self._run_doc:
            # said in its run.json: a replay that diverged is never another's reference (run.baseline)
            self._run_doc["diverged_at"] = d.step
            self.coordinator.record_run(self.run_id, self._run_doc, self._runs_into)
        self.callbacks.on_replay_divergence(divergence=d, step=d.step, key=d.key, recorded=d.recorded, now=d.now,
                                            config_changes=d.config_changes, stopping=self.check == ReplayCheck.error)
        if self.check == ReplayCheck.error:
            raise ReplayDivergedError(f"{d.describe()}; stopping (skip.rollout_tq.replay_check=error)", d)

    # ---- the report
    def report(self) -> ReplayReport:
        checked = {s: v for s, v in self._served.items() if v.compared}
        div = self.divergence
        reproduced = [s for s, v in checked.items() if not v.diverged]
        counts = [v.compared for s, v in checked.items() if not v.diverged] or [0]
        before = sum(1 for s in reproduced if div is None or s < div.step)
        return ReplayReport(self.check.value, len(self._served), len(checked), len(reproduced),
                            (min(counts), max(counts)), div, before, self._regrouped_note())


__all__ = ["DiscardReporting", "Divergence", "ReplayReport", "ValuesTracker", "depends_on_rollouts", "same_on_any_w"]
