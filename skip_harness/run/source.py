"""`skip.rollout_tq.replay_from`: serving a run from another recording of the same batch, whatever its
K and W.

A step's trajectories are the same B x n rows for every K and every number of ranks: K only splits them
into mini-batches, W into shards. The recorded order of a step is its K x W files inner-major, rank-minor
(mini-batch i of rank r is part i x W + r), the order in which the demo and verl split a step's prompts
(K chunks, each cut into W shards). A run at K' on W' ranks is served part i' x W' + r' of the same rows
split into K' x W' equal parts for its call i' on rank r' (`codec.regroup` / `codec.take`): re-chunked
and re-sharded.

:func:`start_source` finds the recording (a namespace path or URL, or `auto`: the namespace under this
run's dump_dir and experiment holding the same batch), checks that it holds the same batch (B, n and
the lengths from its name; the generation fingerprint from its commit records, less the keys that only
split the batch: :data:`~skip_harness.config.BATCH_SPLIT_KEYS`) and scans it read-only: no lock, no
cleanup, no index rewritten, nothing written (the read-only mode of the startup scan). Rank 0 does it;
every rank learns the outcome (or rank 0's error). :func:`load_regrouped` loads this rank's K' parts of
a step from it, each file verified against the step's commit record as a hit's are.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Union

from skip_harness import codec
from skip_harness.config import BATCH_SPLIT_KEYS, REPLAY_FROM_KEY, Cleanup, RolloutTQConfig
from skip_harness.errors import CodecError, ConfigError, CorruptStepError, SkipHarnessError
from skip_harness.run.dist import DistContext
from skip_harness.run.prefetch import Loaded
from skip_harness.run.startup import StartupResult, _rebuild
from skip_harness.store.api import (Fingerprint, Layout, Namespace, NamespaceKey, StepStatus, StepStore, UrlPath,
                                    is_pack, is_url, local_path, namespace_leaf_values, namespaces_at, open_dump_dir,
                                    open_namespace, scan_namespace)

log = logging.getLogger("skip_harness")

_BATCH_FIELDS = (("train_batch_size", "data.train_batch_size"), ("n", "actor_rollout_ref.rollout.n"),
                 ("max_prompt_length", "data.max_prompt_length"),
                 ("max_response_length", "data.max_response_length"))


@dataclass
class Source:
    """The recording a run is served from: its namespace (its K and W), its servable steps, and (on
    every rank, once opened) its read-only store."""

    layout: Layout
    servable: FrozenSet[int]
    store: Optional[StepStore] = field(default=None, repr=False)

    @property
    def K(self) -> int:
        return self.layout.K

    @property
    def W(self) -> int:
        return self.layout.W

    def opened(self) -> "Source":
        """The recording's store on this rank (its namespace opened once, here)."""
        self.store = StepStore(self.layout, open_namespace(self.layout))
        return self

    def regrouped(self, K: int, W: int) -> str:
        """`re-chunked from K=4 to K=2`, `re-sharded from W=2 to W=1`, both, or '' (the same split)."""
        parts = []
        if self.K != K:
            parts.append(f"re-chunked from K={self.K} to K={K}")
        if self.W != W:
            parts.append(f"re-sharded from W={self.W} to W={W}")
        return " and ".join(parts)


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


def _batch_difference(layout: Layout, key: NamespaceKey) -> Optional[str]:
    values = namespace_leaf_values(layout.leaf) or {}
    for name, config_key in _BATCH_FIELDS:
        theirs, ours = values.get(name), getattr(key, name)
        if theirs != ours:
            return (f"{config_key}: the recording has {'none' if theirs is None else theirs}, this run has "
                    f"{'none' if ours is None else ours}")
    return None


def _scan(layout: Layout, ns: Namespace) -> StartupResult:
    """The recording scanned read-only (the startup's read-only mode: no lock, no cleanup, no index rewritten)."""
    return StartupResult(layout, ns, scan_namespace(layout, ns, rewrite_index=False), None, Cleanup.off.value, None,
                         True, f"read by {REPLAY_FROM_KEY}")


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


def _check(layout: Layout, key: NamespaceKey, fingerprint: Optional[Fingerprint]) -> Tuple[FrozenSet[int], str]:
    """(servable steps, '') when the recording at `layout` holds this run's batch, else (empty, why not)."""
    diff = _batch_difference(layout, key)
    if diff is not None:
        return frozenset(), f"another batch ({diff})"
    scanned = _scan(layout, open_namespace(layout))
    fp = batch_fingerprint(fingerprint)
    servable = scanned.servable_steps(fp)
    if not servable:
        mismatched = scanned.mismatched_steps(fp) if fp is not None else ()
        if mismatched:
            return frozenset(), f"another generator ({fp.describe_difference(mismatched[0][1])})"  # type: ignore[union-attr]
        return frozenset(), "no complete step"
    return servable, ""


def resolve(settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
            own: Layout, own_ns: Namespace) -> Optional[Source]:
    """The recording `settings.replay_from` names, checked (rank 0): None when there is none to read
    (not set, or `auto` finding only this run's own namespace holding steps). ConfigError naming
    skip.rollout_tq.replay_from when it cannot serve this run."""
    spec = settings.replay_from
    if spec is None:
        return None
    if spec == "auto":
        return _auto(settings, key, fingerprint, own, own_ns)
    layout = _layout_at(spec)
    if str(layout.root).rstrip("/") == str(own.root).rstrip("/"):
        log.info("%s=%s is this run's own namespace: served as a plain replay", REPLAY_FROM_KEY, spec)
        return None
    servable, why = _check(layout, key, fingerprint)
    if why:
        raise ConfigError(REPLAY_FROM_KEY, f"{layout.url} cannot serve this run: {why}")
    return Source(layout, servable)


def _auto(settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint],
          own: Layout, own_ns: Namespace) -> Optional[Source]:
    dump_dir = settings.resolved_dump_dir()
    group = key.group_name
    found: List[Tuple[int, str, Source]] = []
    refused: List[str] = []
    for rel in open_dump_dir(dump_dir).list_namespaces():
        grp, _, leaf = rel.rstrip("/").rpartition("/")
        if grp != group or leaf == own.root.name:
            continue
        layout = _layout_at(str(own.root.parent / leaf))
        servable, why = _check(layout, key, fingerprint)
        if why:
            refused.append(f"{leaf}: {why}")
        else:
            found.append((len(servable), leaf, Source(layout, servable)))
    if not found:
        own_steps = _scan(own, own_ns).servable_steps(batch_fingerprint(fingerprint))
        if own_steps:
            log.info("%s=auto: no other recording of this batch under %s; served from this run's own namespace",
                     REPLAY_FROM_KEY, own.root.parent)
            return None
        seen = f" (found {'; '.join(refused)})" if refused else ""
        raise ConfigError(REPLAY_FROM_KEY, f"auto: no namespace under {own.root.parent} holds this run's batch "
                          f"({own.root.name} at any K and W, same generation fingerprint){seen}; record it first "
                          "(a run without replay_from), or set a namespace path or URL")
    found.sort(key=lambda f: (-f[0], f[1]))
    count, leaf, source = found[0]
    others = f"; also holding it: {', '.join(f[1] for f in found[1:])}" if len(found) > 1 else ""
    which = "the only recording" if len(found) == 1 else f"the most of the {len(found)} recordings"
    log.info("%s=auto: serving from %s (K=%d, W=%d, %d complete steps: %s of this batch under %s)%s",
             REPLAY_FROM_KEY, leaf, source.K, source.W, count, which, own.root.parent, others)
    return source


def start_source(settings: RolloutTQConfig, key: NamespaceKey, fingerprint: Optional[Fingerprint], own: Layout,
                 own_ns: Namespace, dist: DistContext) -> Optional[Source]:
    """Every rank calls it together: rank 0 resolves and checks the recording; every rank gets it (opened
    read-only), or rank 0's error as the same class. `own_ns`: this run's namespace, as its startup opened it."""
    if settings.replay_from is None:
        return None
    outcome: Any = None
    error: Optional[BaseException] = None
    if dist.is_main:
        try:
            source = resolve(settings, key, fingerprint, own, own_ns)
            outcome = ("ok", None) if source is None else \
                ("ok", (source.layout.url, source.K, source.W, sorted(source.servable)))
        except SkipHarnessError as exc:
            error, outcome = exc, ("error", type(exc).__name__, getattr(exc, "key", None), str(exc))
        except BaseException as exc:  # a bug: the other ranks stop too
            error, outcome = exc, ("error", "SkipHarnessError", None, f"rank 0 failed reading the recording: {exc!r}")
    outcome = dist.broadcast(outcome)
    if error is not None:
        raise error
    if outcome[0] == "error":
        raise _rebuild(*outcome[1:])
    if outcome[1] is None:
        return None
    url, K, W, steps = outcome[1]
    if not is_url(url) and is_pack(url):
        return Source(_layout_at(url), frozenset(steps)).opened()
    root: Union[Path, UrlPath] = UrlPath(url) if is_url(url) else Path(url)
    return Source(Layout(root, K=K, W=W), frozenset(steps)).opened()  # type: ignore[arg-type]


def wanted_parts(K: int, W: int, rank: int) -> List[int]:
    """The parts (of K x W, in recorded order) that rank `rank` is served: i x W + rank for i < K."""
    return [i * W + rank for i in range(K)]


def load_regrouped(source: Source, step: int, K: int, W: int, rank: int) -> Loaded:
    """This rank's K mini-batches of `step` from the recording, re-chunked and re-sharded: the parts of the
    step's rows split K x W ways that this rank would have generated, read from only the recorded files
    they overlap (each verified against the step's commit record). Never raises for a bad step."""
    t0 = time.perf_counter()
    store = source.store
    assert store is not None, "Source.opened() first"
    P, Q = source.K * source.W, K * W
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
                    i, r = divmod(j, source.W)
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
            if (source.K, source.W) == (K, W):   # the recorded call itself: its RNG state and inputs too
                meta.update({k: metas[js[0]][k] for k in ("rng", "call_digest") if k in metas[js[0]]})
            out_metas.append(meta)
    except (CorruptStepError, CodecError, OSError, ValueError) as exc:
        return Loaded(step, seconds=time.perf_counter() - t0, reason=str(exc))
    except SkipHarnessError as exc:      # an object store out of reach: a miss, the step is not blamed
        return Loaded(step, seconds=time.perf_counter() - t0, reason=f"cannot be read now: {exc}", unavailable=True)
    return Loaded(step, batches, out_metas, report.status == StepStatus.UNVERIFIED, time.perf_counter() - t0,
                  step_bytes=report.bytes, regrouped=source.regrouped(K, W) or f"from {source.layout.url}")
