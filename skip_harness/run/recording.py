"""Reading a recording: `skip.rollout_tq.replay_from` (another recording of the same batch, whatever its
K and W), and this run's own namespace read for `action=compare`. Everything replay_from does lives here.

A step's trajectories are the same B x n rows for every K and every number of ranks: K only splits them
into mini-batches, W into shards. The recorded order of a step is its K x W files inner-major, rank-minor
(mini-batch i of rank r is part i x W + r), the order in which the demo and verl split a step's prompts
(K chunks, each cut into W shards). A run at K' on W' ranks is served part i' x W' + r' of the same rows
split into K' x W' equal parts for its call i' on rank r' (`codec.regroup` / `codec.take`): re-chunked
and re-sharded.

:func:`start_run` is the startup of every run: the recording is found and checked first, before anything
is created; then this run's own namespace is started (`run.startup`), or deferred (`run.deferred`: not
created until the run must write a step the recording lacks). :func:`open_recording` finds the recording
(a namespace path or URL, a pack file, or `auto`: the namespace under this run's dump_dir and experiment
holding the same batch), checks that it holds the same batch (B, n and the lengths from its name; the
generation fingerprint from its commit records, less the keys that only split the batch:
:data:`~skip_harness.config.BATCH_SPLIT_KEYS`) and scans it read-only: no lock, no cleanup, no index
rewritten, nothing written. Rank 0 does it; every rank learns the outcome (or rank 0's error) and has the
recording opened once: rank 0 the namespace it checked, each other rank its own opening. The
:class:`Recording` is a `run.step_source.StepSource`: :func:`load_regrouped` loads this rank's K' parts
of a step from it, each file verified against the step's commit record as a hit's are.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Union

from skip_harness import codec
from skip_harness.config import BATCH_SPLIT_KEYS, REPLAY_FROM_KEY, Action, Cleanup, RolloutTQConfig
from skip_harness.errors import CodecError, ConfigError, CorruptStepError, SkipHarnessError
from skip_harness.run.dist import DistContext
from skip_harness.run.prefetch import Loaded
from skip_harness.run.startup import StartedRun, StartupResult, start_namespace
from skip_harness.run.step_source import StepSource
from skip_harness.store.api import (Fingerprint, Layout, Namespace, NamespaceKey, StepStatus, StepStore, UrlPath,
                                    is_pack, is_url, local_path, namespace_leaf_values, namespaces_at, open_dump_dir,
                                    open_namespace, scan_namespace)

log = logging.getLogger("skip_harness")

_BATCH_FIELDS = (("train_batch_size", "data.train_batch_size"), ("n", "actor_rollout_ref.rollout.n"),
                 ("max_prompt_length", "data.max_prompt_length"),
                 ("max_response_length", "data.max_response_length"))


class Recording(StepSource):
    """The recording a run is served from: its namespace (its K and W) opened once on this rank, read only,
    its servable steps (`steps`: those checked at startup, less any that failed to load), each loaded
    re-chunked to this run's K and re-sharded to its W."""

    def __init__(self, layout: Layout, servable: FrozenSet[int], namespace: Namespace, K: int, W: int, rank: int):
        super().__init__(set(servable))
        self.layout = layout
        self.store = StepStore(layout, namespace)
        self.run_K, self.run_W, self.rank = K, W, rank

    @property
    def K(self) -> int:
        return self.layout.K

    @property
    def W(self) -> int:
        return self.layout.W

    def load(self, step: int) -> Loaded:
        return load_regrouped(self, step, self.run_K, self.run_W, self.rank)

    def regrouped(self, K: int, W: int) -> str:
        """`re-chunked from K=4 to K=2`, `re-sharded from W=2 to W=1`, both, or '' (the same split)."""
        parts = []
        if self.K != K:
            parts.append(f"re-chunked from K={self.K} to K={K}")
        if self.W != W:
            parts.append(f"re-sharded from W={self.W} to W={W}")
        return " and ".join(parts)


# ---------------------------------------------------------------------------- a run's startup
def exists(namespace: Namespace) -> bool:
    """Whether anything of the namespace is there (a directory, a `.lock`, an object under its prefix)."""
    try:
        return bool(namespace.list_dir(""))
    except (OSError, SkipHarnessError):
        return False


def start_run(layout: Layout, settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
              dist: DistContext) -> Tuple[StartedRun, Optional[Recording]]:
    """Every rank calls it together: the recording `replay_from` names (checked before anything is
    created), then this run's own namespace started -- or, when it is served from a recording and its own
    namespace does not exist, deferred (`StartedRun.deferred`: nothing created, read-only until a miss)."""
    if settings.replay_from is None and settings.action != Action.compare:
        return start_namespace(layout, settings, fingerprint, dist), None
    own = open_namespace(layout)               # opened only: nothing is created by opening
    if settings.action == Action.compare:
        return _start_compare(layout, settings, key, fingerprint, dist, own)
    recording, unless_own = open_recording(settings, key, fingerprint, layout, own, dist)
    if recording is not None and not dist.broadcast(exists(own) if dist.is_main else None):
        if dist.is_main:
            kept = ("a pack file is read only: its values are not kept" if recording.layout.packed else
                    "its values are kept there, under its run id")
            log.info("rollout cache %s: not created (this run replays %s; %s); created when the run generates a "
                     "step the recording lacks", layout.root, recording.layout.url, kept)
        return StartedRun(own, None, frozenset(), True, False, deferred=True), recording
    run = start_namespace(layout, settings, fingerprint, dist, own)
    if unless_own:         # auto found no other recording: this run's own namespace must hold steps
        if not run.servable:
            if run.startup is not None:
                run.startup.release()
            raise ConfigError(REPLAY_FROM_KEY, unless_own)
        if dist.is_main:
            log.info("%s=auto: no other recording of this batch under %s; served from this run's own namespace",
                     REPLAY_FROM_KEY, layout.root.parent)
    return run, recording


COMPARE_READ = "read by skip.rollout_tq.action=compare"


def _start_compare(layout: Layout, settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
                   dist: DistContext, own_namespace: Namespace) -> Tuple[StartedRun, Optional[Recording]]:
    """`action=compare` (run.drift): the recording -- this run's namespace, or `replay_from`'s -- is read only:
    no lock, no cleanup, nothing created. Every complete step is compared, whatever generator made it: a
    changed generation fingerprint is what this mode measures, not an error (the log says what differs)."""
    if settings.replay_from is not None:
        recording, _ = open_recording(settings, key, None, layout, own_namespace, dist)   # None: any generator
        if recording is not None:
            if dist.is_main:
                _say_generator(recording.layout.url, batch_fingerprint(fingerprint),
                               [recording.store.reader.read_commit(s) for s in sorted(recording.steps)[:1]])
            return StartedRun(own_namespace, None, frozenset(), True, False), recording
    startup: Optional[StartupResult] = None

    def scan() -> List[int]:
        nonlocal startup
        startup = StartupResult(layout, own_namespace, scan_namespace(layout, own_namespace, rewrite_index=False), None,
                                Cleanup.off.value, None, True, COMPARE_READ)
        servable = sorted(startup.servable_steps(None))
        mismatched = startup.mismatched_steps(fingerprint) if fingerprint is not None else ()
        if mismatched:
            log.info("action=compare: %d of the recording's %d steps were generated with another generation "
                     "config (%s): the drift this run measures", len(mismatched), len(servable),
                     fingerprint.describe_difference(mismatched[0][1]))   # type: ignore[union-attr]
        if not servable:
            log.warning("action=compare: %s holds no complete step: nothing to compare with, every step is "
                        "generated and not written", layout.root)
        return servable

    servable = dist.from_main(scan, "reading the recording")
    return StartedRun(own_namespace, startup, frozenset(servable), True, False), None


def _say_generator(url: str, fingerprint: Optional[Fingerprint], records: Any) -> None:
    """action=compare from another recording: what differs in its generation config (INFO), if anything."""
    recorded = next((r.fingerprint for r in records if r is not None and r.fingerprint is not None), None)
    if fingerprint is not None and recorded is not None and not fingerprint.matches(recorded):
        log.info("action=compare: %s was generated with another generation config (%s): the drift this run "
                 "measures", url, fingerprint.describe_difference(recorded))


# ---------------------------------------------------------------------------- finding and checking it
def batch_fingerprint(fingerprint: Optional[Fingerprint]) -> Optional[Fingerprint]:
    """`fingerprint` less the keys that only split the batch or say when it was generated (K, the mode)."""
    if fingerprint is None:
        return None
    return Fingerprint({k: v for k, v in fingerprint.values.items() if k not in BATCH_SPLIT_KEYS})


def _layout_at(text: str) -> Layout:
    """The namespace at a path or URL, or in a pack file (its name and shape from the pack's manifest);
    ConfigError naming replay_from when its last part is no namespace name."""
    if not is_url(text) and is_pack(local_path(text)):
        try:
            return namespaces_at(local_path(text))[0]
        except SkipHarnessError as exc:
            raise ConfigError(REPLAY_FROM_KEY, str(exc)) from None
    root: Union[Path, UrlPath] = UrlPath(text.rstrip("/")) if is_url(text) else local_path(text)
    leaf = str(root).rstrip("/").rsplit("/", 1)[-1]
    values = namespace_leaf_values(leaf)
    if values is None:
        raise ConfigError(REPLAY_FROM_KEY, f"{text}: {leaf!r} is not a namespace name (a recording's namespace "
                          "is {dump_dir}/{experiment}_{project}/GBS.._N.._in.._out..[_K.._W..]; or set `auto`)")
    return Layout(root, K=values["K"], W=values["W"])  # type: ignore[arg-type]  # Layout.root: a Path or a UrlPath


# verl's colocate_async and separate_async fetch one prompt at a time: verl sets data.gen_batch_size = 1 there
# (trainer_base.py:727-739) and names the namespace after it, GBS1, as verl's own skip does
_ONE_PROMPT_MODES = ("a verl recording made in colocate_async or separate_async is named GBS1 (verl sets "
                     "data.gen_batch_size = 1 in those modes: one prompt per fetch) and a run in those modes is "
                     "too; the two fetch other batches, so one replays the other's rollouts in neither direction: "
                     "replay in the recording's trainer.v1.trainer_mode, at any parameter_sync_step")


def _batch_difference(layout: Layout, key: NamespaceKey) -> Optional[str]:
    values = namespace_leaf_values(layout.leaf) or {}
    for name, config_key in _BATCH_FIELDS:
        theirs, ours = values.get(name), getattr(key, name)
        if theirs != ours:
            hint = f"; {_ONE_PROMPT_MODES}" if name == "train_batch_size" and 1 in (theirs, ours) else ""
            return (f"{config_key}: the recording has {'none' if theirs is None else theirs}, this run has "
                    f"{'none' if ours is None else ours}{hint}")
    return None


def check_replay_from(settings: RolloutTQConfig, key: NamespaceKey) -> None:
    """What can be known of `replay_from` without reading the recording, checked when the harness is made
    (before any run directory or namespace is created): a local path that exists, a namespace's name,
    and the batch that name says it holds. ConfigError naming skip.rollout_tq.replay_from and the path.
    The rest (complete steps, the generation fingerprint; an object store's URL) is checked at start."""
    spec = settings.replay_from
    if spec is None or spec == "auto":
        return
    if not is_url(spec) and not local_path(spec).exists():
        raise ConfigError(REPLAY_FROM_KEY, f"{spec} does not exist (set a recording's namespace or pack file, "
                          "{dump_dir}/{experiment}_{project}/GBS.._N.._in.._out..[_K.._W..], or `auto`)")
    layout = _layout_at(spec)
    diff = _batch_difference(layout, key)
    if diff is not None:
        raise ConfigError(REPLAY_FROM_KEY, f"{layout.url} cannot serve this run: another batch ({diff})")


# a recording found and checked on rank 0: its layout, its namespace (opened once, there), its servable steps
_Found = Tuple[Layout, Namespace, FrozenSet[int]]


def _check(layout: Layout, key: NamespaceKey, fingerprint: Optional[Fingerprint]) -> Tuple[Optional[_Found], str]:
    """(the recording at `layout`, opened and scanned read-only, '') when it holds this run's batch, else
    (None, why not)."""
    diff = _batch_difference(layout, key)
    if diff is not None:
        return None, f"another batch ({diff})"
    namespace = open_namespace(layout)
    scanned = StartupResult(layout, namespace, scan_namespace(layout, namespace, rewrite_index=False), None,
                            Cleanup.off.value, None, True, f"read by {REPLAY_FROM_KEY}")
    fp = batch_fingerprint(fingerprint)
    servable = scanned.servable_steps(fp)
    if not servable:
        mismatched = scanned.mismatched_steps(fp) if fp is not None else ()
        if mismatched:
            return None, f"another generator ({fp.describe_difference(mismatched[0][1])})"  # type: ignore[union-attr]
        return None, "no complete step"
    return (layout, namespace, servable), ""


def _resolve(settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
             own: Layout, own_namespace: Namespace) -> Tuple[Optional[_Found], str]:
    """The recording `settings.replay_from` names, checked (rank 0), or None when there is none to read (this
    run's own namespace named, or `auto` finding no other: then, as the second item, the error to raise when
    this run's own namespace holds no step either). ConfigError naming skip.rollout_tq.replay_from when it
    cannot serve this run."""
    spec = settings.replay_from
    if spec == "auto":
        return _auto(settings, key, fingerprint, own, own_namespace)
    layout = _layout_at(str(spec))
    if str(layout.root).rstrip("/") == str(own.root).rstrip("/"):
        log.info("%s=%s is this run's own namespace: served as a plain replay", REPLAY_FROM_KEY, spec)
        return None, ""
    found, why = _check(layout, key, fingerprint)
    if why:
        raise ConfigError(REPLAY_FROM_KEY, f"{layout.url} cannot serve this run: {why}")
    return found, ""


def _auto(settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
          own: Layout, own_namespace: Namespace) -> Tuple[Optional[_Found], str]:
    dump_dir = settings.resolved_dump_dir()
    group = key.group_name
    found: List[Tuple[int, str, _Found]] = []
    refused: List[str] = []
    for rel in open_dump_dir(dump_dir).list_namespaces():
        grp, _, leaf = rel.rstrip("/").rpartition("/")
        if grp != group or leaf == own.root.name:
            continue
        checked, why = _check(_layout_at(str(own.root.parent / leaf)), key, fingerprint)
        if checked is None:
            refused.append(f"{leaf}: {why}")
        else:
            found.append((len(checked[2]), leaf, checked))
    if not found:
        seen = f" (found {'; '.join(refused)})" if refused else ""
        unless_own = (f"auto: no namespace under {own.root.parent} holds this run's batch ({own.root.name} at any "
                      f"K and W, same generation fingerprint){seen}; record it first (a run without replay_from), "
                      "or set a namespace path or URL")
        if not exists(own_namespace):        # nor does this run's own: nothing there, nothing created
            raise ConfigError(REPLAY_FROM_KEY, unless_own)
        return None, unless_own              # checked once its startup scanned it (start_run)
    found.sort(key=lambda f: (-f[0], f[1]))
    count, leaf, chosen = found[0]
    others = f"; also holding it: {', '.join(f[1] for f in found[1:])}" if len(found) > 1 else ""
    which = "the only recording" if len(found) == 1 else f"the most of the {len(found)} recordings"
    log.info("%s=auto: serving from %s (K=%d, W=%d, %d complete steps: %s of this batch under %s)%s",
             REPLAY_FROM_KEY, leaf, chosen[0].K, chosen[0].W, count, which, own.root.parent, others)
    return chosen, ""


def open_recording(settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint], own: Layout,
                   own_namespace: Namespace, dist: DistContext) -> Tuple[Optional[Recording], str]:
    """Every rank calls it together (one broadcast): rank 0 finds and checks the recording; every rank gets it,
    opened once (rank 0: the namespace it checked), or rank 0's error as the same class. The second item:
    `auto` found no other recording, and this is the error when this run's own namespace holds no step."""
    found: Optional[_Found] = None

    def resolve() -> Any:
        nonlocal found
        found, unless_own = _resolve(settings, key, fingerprint, own, own_namespace)
        if found is None:
            return None, unless_own
        layout, _, servable = found
        return (str(layout.root), layout.K, layout.W, layout.name, sorted(servable)), ""

    shared, unless_own = dist.from_main(resolve, "reading the recording")
    if shared is None:
        return None, unless_own
    if found is not None:                # rank 0: the namespace it checked
        layout, namespace, servable = found
    else:                                # the other ranks: their one opening of it
        root, K, W, name, steps = shared
        path: Union[Path, UrlPath] = UrlPath(root) if is_url(root) else Path(root)
        layout = Layout(path, K=K, W=W, name=name)  # type: ignore[arg-type]  # Layout.root: a Path or a UrlPath
        namespace, servable = open_namespace(layout), frozenset(steps)
    return Recording(layout, servable, namespace, own.K, dist.world_size, dist.rank), ""


# ---------------------------------------------------------------------------- its steps, regrouped
def wanted_parts(K: int, W: int, rank: int) -> List[int]:
    """The parts (of K x W, in recorded order) that rank `rank` is served: i x W + rank for i < K."""
    return [i * W + rank for i in range(K)]


def load_regrouped(recording: Recording, step: int, K: int, W: int, rank: int) -> Loaded:
    """This rank's K mini-batches of `step` from the recording, re-chunked and re-sharded: the parts of the
    step's rows split K x W ways that this rank would have generated, read from only the recorded files
    they overlap (each verified against the step's commit record). Never raises for a bad step."""
    t0 = time.perf_counter()
    store = recording.store
    P, Q = recording.K * recording.W, K * W
    try:
        report = store.status(step)
        if report.status not in (StepStatus.COMPLETE, StepStatus.UNVERIFIED):
            return Loaded(step, seconds=time.perf_counter() - t0, reason=f"{report.status}: {report.reason}",
                          step_bytes=report.bytes)
        pieces: Dict[int, Any] = {}
        metas: Dict[int, Dict[str, Any]] = {}
        for part in wanted_parts(K, W, rank):
            for j in range(P):
                if j * Q < (part + 1) * P and (j + 1) * Q > part * P and j not in pieces:
                    i, r = divmod(j, recording.W)
                    pieces[j] = store.reader.read_inner(step, i, r)
                    metas[j] = store.reader.read_meta(step, i, r)
        sizes = {j: codec.batch_rows(p) for j, p in pieces.items()}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            return Loaded(step, seconds=time.perf_counter() - t0, step_bytes=report.bytes,
                          reason=f"its mini-batches are not of one size along the batch dimension ({sizes})")
        rows = next(iter(sizes.values()))
        assert rows is not None
        if (rows * P) % Q:
            return Loaded(step, seconds=time.perf_counter() - t0, step_bytes=report.bytes,
                          reason=f"its {rows * P} rows do not split into K x W = {Q} equal parts")
        each = rows * P // Q
        batches, out_metas = [], []
        for part in wanted_parts(K, W, rank):
            start, stop = part * each, (part + 1) * each
            first, last = start // rows, (stop - 1) // rows
            js = list(range(first, last + 1))
            batches.append(codec.take([pieces[j] for j in js], [rows] * len(js), start - first * rows, stop - first * rows))
            share = {j: (min(stop, (j + 1) * rows) - max(start, j * rows)) / rows for j in js}
            meta = {
                "gen_s": sum(float(metas[j].get("gen_s", 0.0) or 0.0) * share[j] for j in js),
                "bytes": int(sum(int(metas[j].get("bytes", 0) or 0) * share[j] for j in js)),
            }
            if (recording.K, recording.W) == (K, W):   # the recorded call itself: its RNG state and inputs too
                meta.update({k: metas[js[0]][k] for k in ("rng", "call_digest") if k in metas[js[0]]})
            out_metas.append(meta)
    except (CorruptStepError, CodecError, OSError, ValueError) as exc:
        return Loaded(step, seconds=time.perf_counter() - t0, reason=str(exc))
    except SkipHarnessError as exc:      # an object store out of reach: a miss, the step is not blamed
        return Loaded(step, seconds=time.perf_counter() - t0, reason=f"cannot be read now: {exc}", unavailable=True)
    return Loaded(step, batches, out_metas, report.status == StepStatus.UNVERIFIED, time.perf_counter() - t0,
                  step_bytes=report.bytes, regrouped=recording.regrouped(K, W) or f"from {recording.layout.url}")
