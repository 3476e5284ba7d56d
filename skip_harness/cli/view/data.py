"""What the viewer reads, and only how the store lets it: read-only scans, verified step reads.

Every namespace is found as `ls` finds it (`namespaces_at`) and scanned with the index but never
rewriting it (`scan_namespace(rewrite_index=False)`): the viewer writes nothing, takes no lock, and
can run beside a training job on the same namespace. A step's mini-batches come from
`StepReader.read_served` -- the verified read a hit uses (sizes and checksums against the commit
record in the pass that reads them, nothing unpickled); a step that is incomplete or corrupt is
reported with its reason and none of its bytes.

A step's second tier (docs/api.md#the-second-tier: the rewards per reward function TRL computed from
its rollouts) is read by `read_step_tier`, verified and bound to the step's commit record; a step
without one (older caches, the tier off) simply has none.

The recorded per-step values (`StepReader.read_values`) and `skip-harness diff`'s `compare` come
from the replay check (docs/replay_check.md).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Generic, Hashable, List, Optional, Sequence, Tuple, TypeVar, Union

import torch

from skip_harness.cli._common import about, mode_and_seed, step_gen_s, step_written
from skip_harness.cli.listing import NamespaceView, StepRow, namespace_json
from skip_harness.errors import CorruptStepError, SkipHarnessError
from skip_harness.store.api import (Discarded, ValuesStore, Layout, NamespaceReport, StepReader, StepReport,
                                    UrlPath, namespaces_at, open_store, read_step_tier, scan_namespace)
from skip_harness.run.tier import REWARD as REWARD_PHASE
from skip_harness.cli.view.samples import StepTable, StoredRewards, group_size_of, step_table

from skip_harness.cli.compare import compare as _diff_compare   # the same dict `diff --json` prints

logger = logging.getLogger("skip_harness.cli.view")

Where = Union[Path, UrlPath]
# `action=compare` runs' figures (run.drift) shown beside the recorded values: the chosen run's (the newest by
# default) among every such run of a namespace, looked for again after COMPARE_RUN_TTL_S seconds
COMPARE_PREFIX = "compare/"
COMPARE_RUN_TTL_S = 5.0

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
REWARD_FUNCTION = "reward function "      # run.tier's key component for one reward function (trl_tier.reward_key)


class Kept(Generic[K, V]):
    """Values kept while their stamp stays the same (a step's commit record: time, size, status): the one
    cache of the viewer's pages. `size` bounds how many are kept (the least recently used go first, and
    before a new one is computed: a step's buffers go back to the pools before the next step is read)."""

    def __init__(self, size: Optional[int] = None) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._kept: "OrderedDict[K, Tuple[Any, V]]" = OrderedDict()

    def get(self, key: K, stamp: Any, compute: Callable[[], V]) -> V:
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and kept[0] == stamp:
                self._kept.move_to_end(key)
                return kept[1]
            self._kept.pop(key, None)
            while self.size is not None and len(self._kept) >= self.size:
                self._kept.popitem(last=False)
        del kept
        value = compute()
        with self._lock:
            self._kept[key] = (stamp, value)
            while self.size is not None and len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return value

    def peek(self, key: K, stamp: Any) -> Optional[V]:
        """The value kept for `key` if its stamp is still `stamp`, else None (nothing computed)."""
        with self._lock:
            kept = self._kept.get(key)
            return kept[1] if kept is not None and kept[0] == stamp else None

# ls --json keys the viewer leaves out: `accessed` (a stat per payload) and `logical_bytes` (every meta.json
# read) cost a read per step, and the overview of a 10,000-step namespace comes from its index alone.
_COSTLY_KEYS = ("accessed", "logical_bytes", "total_logical_bytes")


@dataclass(frozen=True)
class ViewedNamespace:
    """One namespace the viewer serves: `key` is its URL segment (`{root}/{group}/{leaf}`)."""

    key: str
    root_index: int
    layout: Layout

    @property
    def group(self) -> str:
        return self.layout.group

    @property
    def leaf(self) -> str:
        return self.layout.leaf

    @property
    def label(self) -> str:
        return f"{self.group}/{self.leaf}"


@dataclass(frozen=True)
class StepRead:
    """One step as the verified read found it: the mini-batches of every rank, or why there are none."""

    namespace: ViewedNamespace
    step: int
    status: str                        # complete | unverified | incomplete | corrupt | missing
    reason: Optional[str]              # None when the step was read
    batches: List[Tuple[int, int, Any]]   # (inner index, rank, mini-batch)
    metas: List[Tuple[int, int, Dict[str, Any]]]

    @property
    def ok(self) -> bool:
        return self.reason is None


def step_stamp(s: StepReport) -> Tuple[Optional[float], int, str]:
    """What says a step is the one read before: its commit record's time, its size, its status."""
    return (s.created, s.bytes, s.status)


def fingerprint_values(s: Optional[StepReport]) -> Optional[Dict[str, Any]]:
    return None if s is None or s.fingerprint is None else dict(s.fingerprint.values)


def _reader(layout: Layout) -> StepReader:
    """A reader of the namespace (no writer is built: the viewer never writes)."""
    return open_store(layout).reader


class Cache:
    """The caches the viewer was started on: each root a dump dir, a group directory or a namespace."""

    def __init__(self, roots: Sequence[Where]):
        self.roots = list(roots)
        self._lock = threading.Lock()
        self._readers: Dict[str, StepReader] = {}
        self._compare_runs: Dict[str, Tuple[List[Dict[str, Any]], float]] = {}   # action=compare runs, found when
        self._run_docs: Dict[Tuple[str, str], Dict[str, Any]] = {}         # each run's run.json, read once
        self._diffs: Kept[Tuple[str, str], Dict[str, Any]] = Kept()
        # the last step read and turned into trajectories: a step page's links to its trajectories (and
        # back) read it once; one kept, so a step's buffers go back to the pool before the next is read
        self._tables: Kept[Tuple[str, int], Tuple[StepRead, Optional[StepTable]]] = Kept(size=1)

    # ---- namespaces

    def namespaces(self) -> List[ViewedNamespace]:
        out = []
        for i, root in enumerate(self.roots):
            try:
                layouts = namespaces_at(root)
            except (OSError, SkipHarnessError) as exc:
                logger.warning("%s; its namespaces are not listed", about(root, exc))
                continue
            for lay in layouts:
                out.append(ViewedNamespace(f"{i}/{lay.group}/{lay.leaf}", i, lay))     # a pack: the name it holds
        return out

    def namespace(self, key: str) -> Optional[ViewedNamespace]:
        """The namespace named by `key`, found by listing (a key never becomes a path by itself)."""
        for ns in self.namespaces():
            if ns.key == key:
                return ns
        return None

    def reader(self, ns: ViewedNamespace) -> StepReader:
        with self._lock:
            reader = self._readers.get(ns.key)
            if reader is None or reader.layout != ns.layout:
                reader = self._readers[ns.key] = _reader(ns.layout)
            return reader

    def scan(self, ns: ViewedNamespace) -> NamespaceReport:
        """The namespace's steps from its index where it vouches for them; the index is never written."""
        return scan_namespace(ns.layout, self.reader(ns).namespace, rewrite_index=False)

    def namespace_view(self, ns: ViewedNamespace, report: Optional[NamespaceReport] = None, *,
                       read_metas: bool = True) -> NamespaceView:
        """`ls`'s view of the namespace from its scan: when each step was written and its generation
        seconds come from the commit records the index holds; a step whose record does not say its
        generation seconds has them read from its meta files, as `ls` does -- unless `read_metas` is
        False (the overview: a 10,000-step namespace from its index alone)."""
        report = self.scan(ns) if report is None else report
        reader = self.reader(ns)
        return NamespaceView(ns.layout, [StepRow(s, step_written(reader, s), step_gen_s(reader, s) if read_metas
                                                 else s.gen_s) for s in report.steps])

    def namespace_doc(self, ns: ViewedNamespace, view: Optional[NamespaceView] = None) -> Dict[str, Any]:
        """`ls --json`'s document of one namespace (without the keys that cost a read per step), plus
        the viewer's `key`."""
        view = self.namespace_view(ns) if view is None else view
        doc = namespace_json(view)
        for k in _COSTLY_KEYS:
            doc.pop(k, None)
        for s in doc["steps"]:
            for k in _COSTLY_KEYS:
                s.pop(k, None)
        doc["key"] = ns.key
        doc["root"] = str(self.roots[ns.root_index])
        return doc

    def mode_seed(self, view: NamespaceView) -> Tuple[Any, Any]:
        return mode_and_seed([s for s in view.steps if s.servable])

    # ---- one step

    def read_step(self, ns: ViewedNamespace, step: int) -> StepRead:
        """Every mini-batch of `step` (all K inner indices of every rank) by the verified read."""
        reader = self.reader(ns)
        batches: List[Tuple[int, int, Any]] = []
        metas: List[Tuple[int, int, Dict[str, Any]]] = []
        status = "complete"
        for rank in range(ns.layout.W):
            try:
                status, reason, got, got_metas = reader.read_served(step, rank)
            except CorruptStepError as exc:
                status, reason = "corrupt", str(exc)
            except (SkipHarnessError, OSError) as exc:   # an unregistered type, an unreachable store
                status, reason = "unreadable", f"{type(exc).__name__}: {exc}"
            if reason is not None:
                return StepRead(ns, step, status, reason, [], [])
            batches += [(i, rank, b) for i, b in enumerate(got)]
            metas += [(i, rank, m) for i, m in enumerate(got_metas)]
        return StepRead(ns, step, status, None, batches, metas)

    def table(self, ns: ViewedNamespace, s: StepReport) -> Tuple[StepRead, Optional[StepTable]]:
        """`s`'s verified read and its trajectories (None when it cannot be read), with the rewards its
        second tier holds; kept while its commit record (time, size, status) stays the same."""
        def compute() -> Tuple[StepRead, Optional[StepTable]]:
            read = self.read_step(ns, s.step)
            if not read.ok:
                return read, None
            return read, step_table(read.batches, group_size_of(fingerprint_values(s)),
                                    self.stored_rewards(ns, s.step, s.created))
        return self._tables.get((ns.key, s.step), step_stamp(s), compute)

    def stored_rewards(self, ns: ViewedNamespace, step: int, created: Optional[float]
                       ) -> Dict[Tuple[int, int], StoredRewards]:
        """The rewards the second tier holds for `step` ({(inner, rank): rewards per reward function}),
        verified and bound to the step's commit record (`created`, its creation time); {} when it holds
        none (an older cache, the tier off) or cannot be read (a warning: the step itself still shows)."""
        if created is None:
            return {}
        try:
            tier = read_step_tier(self.reader(ns).namespace, step, commit_created=created)
        except (SkipHarnessError, OSError) as exc:
            logger.warning("%s: the second tier of step %d cannot be read: %s", ns.layout.root, step, exc)
            return {}
        out: Dict[Tuple[int, int], StoredRewards] = {}
        for (inner, rank), entry in tier.get(REWARD_PHASE, {}).items():
            values = entry.values
            if isinstance(values, torch.Tensor) and not values.is_nested and values.dim() in (1, 2):
                names = [k[len(REWARD_FUNCTION):] for k in entry.record.key if k.startswith(REWARD_FUNCTION)]
                out[(inner, rank)] = StoredRewards(names, values)
        return out

    # ---- what the replay check recorded

    def values(self, ns: ViewedNamespace, step: int, compare_run: Optional[str] = None) -> Optional[Dict[str, float]]:
        """The values the trainer reported for `step` (its metrics), None when none were recorded; with an
        `action=compare` run's figures for the step beside them (`compare/...`: run.drift): `compare_run`'s,
        else the newest such run's."""
        try:
            recorded = self.reader(ns).read_values(step)
            run = compare_run or self.newest_compare_run(ns)
            kept = None if run is None else ValuesStore(self.reader(ns).namespace).read_run_step(run, step)
        except (CorruptStepError, SkipHarnessError, OSError, ValueError) as exc:
            logger.warning("%s: recorded values of step %d cannot be read: %s", ns.layout.root, step, exc)
            return None
        drift = {} if kept is None else {k: v for k, v in kept.values.items() if k.startswith(COMPARE_PREFIX)}
        return {**(recorded or {}), **drift} if drift else recorded

    def discarded(self, ns: ViewedNamespace, step: int) -> Tuple[Discarded, ...]:
        """What a filter discarded from `step` when it was recorded (store.discards: group, reason, rewards),
        bound to the step's commit record; () when nothing was (or it cannot be read)."""
        try:
            found = self.reader(ns).read_discarded(step)
        except (CorruptStepError, SkipHarnessError, OSError) as exc:
            logger.warning("%s: the discarded groups of step %d cannot be read: %s", ns.layout.root, step, exc)
            return ()
        return () if found is None else found.discarded

    def compare_runs(self, ns: ViewedNamespace) -> List[Dict[str, Any]]:
        """Every `action=compare` run that kept its figures in the namespace, oldest first: {"run", "started",
        "K", "W", "replay_from", "host"} (the runs looked for again after COMPARE_RUN_TTL_S seconds; a run's
        document is read once)."""
        now = time.monotonic()
        with self._lock:
            found = self._compare_runs.get(ns.key)
        if found is not None and now - found[1] <= COMPARE_RUN_TTL_S:
            return found[0]
        store = ValuesStore(self.reader(ns).namespace)
        out = []
        for run in store.list_runs():
            with self._lock:
                doc = self._run_docs.get((ns.key, run))
            if doc is None:
                doc = store.read_run(run) or {}
                with self._lock:
                    self._run_docs[(ns.key, run)] = doc
            if doc.get("action") == "compare":
                out.append({"run": run, "started": doc.get("started"), "K": doc.get("K"), "W": doc.get("W"),
                            "replay_from": doc.get("replay_from"), "host": doc.get("host")})
        with self._lock:
            self._compare_runs[ns.key] = (out, now)
        return out

    def newest_compare_run(self, ns: ViewedNamespace) -> Optional[str]:
        runs = self.compare_runs(ns)
        return runs[-1]["run"] if runs else None

    def drift(self, ns: ViewedNamespace, step: int, run: str) -> Dict[str, Any]:
        """`action=compare` run `run`'s drift at `step`: its figures (`compare/...`) and each trajectory's first
        differing token by ref (`first_difference`; None when the run kept none, or kept them at another K or
        W than the namespace's: `note` says so)."""
        store = ValuesStore(self.reader(ns).namespace)
        kept = store.read_run_step(run, step)
        figures = {} if kept is None else {k[len(COMPARE_PREFIX):]: v for k, v in kept.values.items()
                                          if k.startswith(COMPARE_PREFIX)}
        rows = store.read_run_drift(run, step)
        note = None
        firsts = None if rows is None else rows["first_difference"]
        if rows is not None and (rows["K"], rows["W"]) != (ns.layout.K, ns.layout.W):
            note = (f"run {run} generated at K={rows['K']} W={rows['W']}, this namespace holds K={ns.layout.K} "
                    f"W={ns.layout.W}: its trajectories are not this step's, only the step's figures are shown")
            firsts = None
        return {"run": run, "figures": figures, "first_difference": firsts, "note": note}

    def diff(self, a: ViewedNamespace, b: ViewedNamespace,
             scans: Optional[Sequence[NamespaceReport]] = None) -> Dict[str, Any]:
        """`skip-harness diff --json`'s document for two namespaces, rollouts by their commit records only
        (the compare page pairs one step's trajectories itself; reading every differing step of two runs
        would cost a read per step per side). Kept while both namespaces' steps stay as they were (`scans`:
        both namespaces' scans when the caller has just made them)."""
        sa, sb = scans if scans is not None else (self.scan(a), self.scan(b))
        return self._diffs.get((a.key, b.key), (self._stamp(sa), self._stamp(sb)),
                               lambda: _diff_compare(str(a.layout.root), str(b.layout.root), read_payloads=False))

    @staticmethod
    def _stamp(report: NamespaceReport) -> Tuple[Tuple[int, Any, int, str], ...]:
        return tuple((s.step, s.created, s.bytes, s.status) for s in report.steps)
