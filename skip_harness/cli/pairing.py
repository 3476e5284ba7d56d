"""How `skip-harness diff` pairs two sides that were not made alike (`compare.py` uses it).

- **Names as `ls` prints them** (relative to the cache root): a name that does not exist as written is looked
  up under the cache root `ls` lists by default (`$SKIP_HARNESS_DUMP_DIR`, else the per-user cache).
- **Values at another K or W**, as the replay check compares them (`run.replay_check`): at another K -- or
  another W, where a side's trainer said its training values depend on W (`run.json`'s `w_invariant`:
  run.shape) -- only the values that depend on the rollouts alone (`config.ROLLOUT_VALUES`), at another W
  of a W-invariant trainer every value, both within rounding noise (`run.tolerance`, the replay check's one
  comparison); at the same K and W, exactly. A replay's K and W are its `run.json`'s (a `replay_from`
  run's values are kept in the recording it replayed, at its own K and W; verl's W is its worker count,
  `run.json`'s `workers`, and the recording's is read from its recorded config); the recording's are its
  namespace's.
- **Tolerances**: those given on the command line (`--rtol`, `--atol`, `--tolerances`), else those the
  replay side's replay check compared within (its `run.json`'s `replay_check`: `replay_rtol`,
  `replay_atol`, `replay_tolerances`; B's when both sides are replays), else exact -- the rounding noise of
  another K or W added as the replay check adds it.
- **A replay's rollouts** are those it was served: the recording named by its `run.json`'s `replay_from`,
  else its namespace's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from skip_harness.cli._common import CliError
from skip_harness.config import WEIGHTS_PREFIX, KeyTolerance
from skip_harness.errors import SkipHarnessError
from skip_harness.run.replay_check import depends_on_rollouts, same_on_any_w
from skip_harness.run.machine import as_machine
from skip_harness.run.machine import difference as machine_difference
from skip_harness.run.shape import workers_of
from skip_harness.run.tolerance import EPS32, NOISE_ULPS, NOISE_WORDS, ToleranceModel
from skip_harness.store.api import (UrlPath, ValuesStore, is_url, namespace_leaf_values, namespaces_at,
                                    open_store)


@dataclass(frozen=True)
class Side:
    """One side's values: at which K and W they were reported, and where its rollouts came from."""

    K: int
    W: int
    rollouts_from: str        # the namespace whose rollouts the side trained on (its root, as text)
    replay_from: bool = False  # a replay_from run's values, kept in the recording it replayed
    run: Optional[str] = None  # the replay whose values these are (None: the recording's)
    check: Optional[Dict[str, Any]] = None   # the tolerances its replay check compared within (run.json)
    w_invariant: bool = True   # its trainer's training values are the same on any W (run.shape)
    workers: bool = False      # W is verl's worker count (run.json's `workers`), not the process group's
    machine: Optional[Dict[str, str]] = None   # what computed its values (run.machine); None: not said


def side_of(store: Any, run: Optional[str]) -> Side:
    """The recording's side (`run` None) or one replay's, from its `run.json`."""
    layout = store.layout
    values = ValuesStore(store.namespace)
    if run is None:
        return Side(layout.K, layout.W, str(layout.root), machine=_recording_machine(values))
    doc = values.read_run(run) or {}
    K, W = doc.get("K"), doc.get("W")
    source = doc.get("replay_from")
    check = doc.get("replay_check")
    workers = doc.get("workers")
    if isinstance(workers, int) and not isinstance(workers, bool):
        W = workers
    return Side(K if isinstance(K, int) else layout.K, W if isinstance(W, int) else layout.W,
                source if isinstance(source, str) else str(layout.root), isinstance(source, str), run,
                check if isinstance(check, dict) else None, doc.get("w_invariant") is not False,
                isinstance(workers, int), as_machine(doc.get("machine")))


def _recording_machine(values: Any) -> Optional[Dict[str, str]]:
    """The machine the recording's values were computed on (run.machine): one step's when every step that
    says agrees; None when none says; `{"several": N}` when its steps came from N machines, which no other
    side matches, so its values are compared within rounding noise, as the replay check's step by step
    comparison does for some of them."""
    seen: List[Dict[str, str]] = []
    for step in values.steps():
        found = values.read_step(step)
        machine = None if found is None else as_machine(found.machine)
        if machine is not None and machine not in seen:
            seen.append(machine)
    if len(seen) > 1:
        return {"several": str(len(seen))}
    return seen[0] if seen else None


def with_workers(side: Side, other: Side, config: Optional[Dict[str, Any]]) -> Side:
    """The recording's side at verl's worker count read from its recorded `config` (run.shape), when the other
    side is a replay whose W is one (`workers`); `side` as it is otherwise."""
    if side.workers or not other.workers:
        return side
    count = workers_of(config)
    return side if count is None else replace(side, W=count, workers=True, w_invariant=other.w_invariant)


@dataclass(frozen=True)
class Tolerances:
    """What values are compared within before the noise of another K or W: `model` and where it came from."""

    model: ToleranceModel
    source: str               # '' exact; `given` (the command line); `the replay's (run ID)`

    def describe(self) -> str:
        """`loss: rtol 0.01, atol 0; other keys exact (the replay check's of run ID)`; '' when exact."""
        if not self.source:
            return ""
        m = self.model
        rest = "exact" if not m.rtol and not m.atol else f"rtol {m.rtol:g}, atol {m.atol:g}"
        keys = ", ".join(f"{p}: rtol {t.rtol:g}, atol {t.atol:g}" for p, t in m.per_key)
        return (f"{keys}; other keys {rest}" if keys else rest) + f" ({self.source})"


def recorded_tolerances(a: Side, b: Side, given: Optional[ToleranceModel] = None) -> Tolerances:
    """The tolerances `diff` compares values within: `given` (the command line), else the replay side's
    replay check's (B's when both are replays), else exact."""
    if given is not None:
        return Tolerances(given, "given on the command line")
    for side in (b, a):
        if side.check is not None:
            try:
                model = ToleranceModel(float(side.check.get("rtol", 0.0)), float(side.check.get("atol", 0.0)),
                                       tuple((str(p).lower(), KeyTolerance(float(t.get("rtol", 0.0)),
                                                                           float(t.get("atol", 0.0))))
                                             for p, t in dict(side.check.get("tolerances") or {}).items()))
            except (TypeError, ValueError, AttributeError):
                continue          # a run.json not written by this version: its tolerances are not used
            if model.rtol or model.atol or model.per_key:
                return Tolerances(model, f"the replay check's of run {side.run}")
    return Tolerances(ToleranceModel(), "")


OTHER_MACHINES = "computed on other machines"


@dataclass(frozen=True)
class ValuesRule:
    """Which keys are compared, and within what, for two sides (the replay check's rule)."""

    compared: Callable[[str], bool]
    tolerances: ToleranceModel
    regrouped: str            # '' at the same K and W, else what differs: `K=4 vs K=1`, `W=2 vs W=1`
    within: str = ""          # the tolerances used when not exact, and where from (`Tolerances.describe`)
    depends_on: str = "K"     # what the values left out depend on (K; W for a trainer not W-invariant)

    @property
    def rtol(self) -> float:
        """The relative part of the rounding noise allowed (of a float32 value) when regrouped, else 0."""
        return NOISE_ULPS * EPS32 if self.tolerances.regrouped else 0.0

    def same(self, key: str, a: float, b: float) -> bool:
        return self.tolerances.same(key, a, b)

    def describe(self, left_out: List[str], compared: List[str]) -> str:
        """`re-chunked K=4 vs K=1: loss not compared (they depend on K); reward_mean compared within rounding noise (32 x eps)`."""
        if not self.regrouped:
            return ""
        parts = [self.regrouped]
        digests = [k for k in left_out if k.startswith(WEIGHTS_PREFIX)]      # replay_weights: one per parameter
        left_out = [k for k in left_out if not k.startswith(WEIGHTS_PREFIX)]
        if left_out:
            parts.append(f"{', '.join(left_out)} not compared (they depend on {self.depends_on})")
        if digests:
            why = "the machine" if self.regrouped.startswith(OTHER_MACHINES) else "K and W"
            parts.append(f"{WEIGHTS_PREFIX}* not compared (the weights change with {why})")
        if compared:
            parts.append(f"{', '.join(compared)} compared {NOISE_WORDS}")
        return "; ".join(parts)


def batch_of(layout: Any) -> str:
    """The batch a namespace holds, from its name: `GBS8_N2_in6_out6` (its K and W left out)."""
    return "_".join(t for t in str(layout.leaf).split("_") if t[:1] not in ("K", "W"))


def batch_difference(la: Any, lb: Any) -> str:
    """'' when two namespaces hold one batch (B, n and the lengths their names hold), else a sentence saying
    they are different runs."""
    va, vb = namespace_leaf_values(la.leaf), namespace_leaf_values(lb.leaf)
    if va is None or vb is None:
        return ""
    fields = ("train_batch_size", "n", "max_prompt_length", "max_response_length")
    if all(va.get(f) == vb.get(f) for f in fields):
        return ""
    return (f"other batches (A holds {batch_of(la)}, B {batch_of(lb)}): different runs on other prompts, "
            "their trajectories are not paired")


def values_rule(a: Side, b: Side, other_batch: str = "", tolerances: Optional[Tolerances] = None) -> ValuesRule:
    """How the two sides' values are compared: as the replay check compares a replay at another K or W with
    its recording; within `tolerances` alone when the two are different runs (`other_batch`) or at one K
    and W (exact unless the command line or the replay's check gave tolerances)."""
    tol = tolerances or Tolerances(ToleranceModel(), "")
    base, within = tol.model, tol.describe()
    if other_batch:
        return ValuesRule(lambda key: True, base.at(False), "", within)
    if a.K != b.K:
        how = f"re-chunked: K={a.K} (A) vs K={b.K} (B)" + (f", W={a.W} vs W={b.W}" if a.W != b.W else "")
        return ValuesRule(depends_on_rollouts, base.at(True), how, within)
    if a.W != b.W:
        how = (f"re-sharded: {a.W} (A) vs {b.W} (B) workers" if a.workers and b.workers else
               f"re-sharded: W={a.W} (A) vs W={b.W} (B)")
        if not (a.w_invariant and b.w_invariant):     # the training values depend on W: as at another K
            return ValuesRule(same_on_any_w, base.at(True), how, within, "W")
        return ValuesRule(lambda key: not key.startswith(WEIGHTS_PREFIX), base.at(True), how, within)
    if (a.machine or b.machine) and machine_difference(a.machine, b.machine or {}):   # not saying: another machine
        several = next((f"{n}'s values came from {m['several']} machines" for n, m in (("A", a.machine), ("B", b.machine))
                        if m and "several" in m), "")
        if several:
            how = f"{OTHER_MACHINES}: {several}"
        elif a.machine and b.machine:
            how = f"{OTHER_MACHINES}: {machine_difference(a.machine, b.machine)} (A -> B)"
        else:
            how = f"{OTHER_MACHINES}: {'A' if b.machine else 'B'}'s values do not say which machine computed them"
        return ValuesRule(lambda key: not key.startswith(WEIGHTS_PREFIX), base.at(True), how, within)
    return ValuesRule(lambda key: True, base.at(False), "", within)


def split_keys(keys: List[str], rule: ValuesRule) -> Tuple[List[str], List[str]]:
    """(keys compared, keys left out because they depend on K)."""
    return [k for k in keys if rule.compared(k)], [k for k in keys if not rule.compared(k)]


def kept_runs(store: Any) -> int:
    """How many replays kept their values in the namespace (`ls`'s replays)."""
    return len(ValuesStore(store.namespace).list_runs())


def run_steps(store: Any, run: Optional[str]) -> List[int]:
    """The steps a replay kept values for ([] for the recording's side: its steps are its namespace's)."""
    return [] if run is None else ValuesStore(store.namespace).run_steps(run)


def rule_json(rule: ValuesRule, left_out: Dict[str, None], compared: Dict[str, None]) -> Dict[str, Any]:
    return {"regrouped": rule.regrouped, "rtol": rule.rtol, "tolerances": rule.within or None,
            "not_compared": sorted(left_out),
            "compared_within_rtol": sorted(compared) if rule.regrouped else [],
            "describe": rule.describe(sorted(left_out), sorted(compared))}


def first_config(reader: Any, steps: Sequence[int]) -> Optional[Dict[str, Any]]:
    """The training-side config recorded with the first of `steps` that has one."""
    for s in steps:
        rec = reader.read_step_values(s)
        if rec is not None and rec.config:
            cfg = reader.read_training_config(rec.config)
            if cfg is not None:
                return cfg
    return None


def rollouts_store(store: Any, side: Side) -> Any:
    """The steps `side` trained on: a replay_from run's are its recording's (opened here), else `store`'s."""
    if side.rollouts_from == str(store.layout.root):
        return store
    where: Any = UrlPath(side.rollouts_from) if is_url(side.rollouts_from) else Path(side.rollouts_from)
    try:
        layouts = namespaces_at(where)
    except (OSError, SkipHarnessError):
        layouts = []
    if len(layouts) != 1:
        return store          # the recording is gone: its rollouts cannot be shown, the namespace's are
    return open_store(layouts[0])


def split_run(text: str) -> Tuple[str, Optional[str]]:
    """`NS@RUN_ID` (a replay's values, kept under its run id), `NS@latest` (the newest replay's) or
    `NS` (the recording's): (the namespace, the run id or None). A path that exists as written is
    never split."""
    where, sep, run = str(text).rpartition("@")
    if not sep or not where or "/" in run or Path(str(text)).exists():
        return str(text), None
    return where, run


def run_of(store: Any, run: Optional[str], arg: str) -> Optional[str]:
    if run is None:
        return None
    runs = ValuesStore(store.namespace).list_runs()
    if run == "latest":
        if not runs:
            raise CliError(f"{arg}: {store.layout.root} has no replay with values kept (no .values/runs/)")
        return runs[-1]
    if run not in runs:
        shown = ", ".join(runs[-5:]) or "none"
        raise CliError(f"{arg}: no run {run!r} kept values in {store.layout.root} (runs: {shown}; or @latest)")
    return run


class RunValues:
    """The values side of one namespace: the recording's (`run` None) or one replay's."""

    def __init__(self, store: Any, run: Optional[str]):
        self.store, self.run = store, run

    def read_values(self, step: int) -> Optional[Dict[str, float]]:
        if self.run is None:
            return self.store.reader.read_values(step)
        found = ValuesStore(self.store.namespace).read_run_step(self.run, step)
        return None if found is None else dict(found.values)

    def config(self, steps: Sequence[int]) -> Optional[Dict[str, Any]]:
        if self.run is None:
            return first_config(self.store.reader, steps)
        doc = ValuesStore(self.store.namespace).read_run(self.run) or {}
        if isinstance(doc.get("training_config"), dict):
            return doc["training_config"]
        digest = doc.get("config")
        return self.store.reader.read_training_config(digest) if isinstance(digest, str) else None



__all__ = ["RunValues", "Side", "ValuesRule", "batch_difference", "batch_of", "first_config", "kept_runs", "rollouts_store", "rule_json", "run_of",
           "recorded_tolerances", "run_steps", "side_of", "Tolerances", "split_keys", "split_run", "values_rule", "with_workers"]
