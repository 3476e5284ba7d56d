"""Convert a rollout cache that verl wrote into committed skip_harness steps.

verl (`verl/utils/skip/rollout_skip.py`) writes `{step}/tq_batch.pt`, `{step}/0/tq_batch.pt`,
`{step}/{i}/tq_batch.pt` (K > 1) or `{step}/gen_batch.dp` (V0), each next to a `meta.json`; finding
them and loading them is `store.verl_dump`'s job. Both payload kinds are pickles, so loading either can
run code stored in the file: `store.verl_dump.load_trusted` is the only unpickling in skip_harness, and
this module calls it only when the caller says it trusts the files (`trust=True`, `--trust`).

A V1 payload is stored as it is (the codec keeps jagged tensors and non-tensor fields without pickle):
the same mini-batch the verl plug-in (`skip_harness.integrations.verl`) records, so it serves the
imported steps. A V0 `DataProto` is stored as the codec's registered DataProto kind.

K is not in verl's key: it is the number of inner directories of the namespace's complete steps (1 for
the flat forms). Steps are written with `StepWriter.write_inner` + `commit` (fingerprint None: a verl
cache records no generator fingerprint, and such steps serve any run) into the matching namespace,
which carries `_K{K}_W1` when K > 1. A verl step that cannot be converted (a missing payload or meta,
fewer inner directories than K, a meta that does not parse, a trajectory count that disagrees with the
payload, a payload that does not load or encode) is reported as failed with its reason; steps already
servable in the target are kept as they are.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from rich.markup import escape
from rich.table import Table

from skip_harness.store.api import (Layout, StepReport, StepStore, UrlPath, VerlNamespace, VerlStep,
                                    find_verl_namespaces, load_trusted, open_namespace, read_verl_meta,
                                    scan_namespace, scan_verl_namespaces)
from skip_harness.errors import LockHeldError, SkipHarnessError
from skip_harness.cli._common import (EXIT_CORRUPT, EXIT_LOCKED, EXIT_OK, EXIT_USAGE, CliError, emit_json, progress,
                                      short_path, stdout_console)

logger = logging.getLogger("skip_harness.cli.import_verl")

TRUST_WARNING = ("import-verl: loading verl's payloads with torch.load(weights_only=False) because --trust was "
                 "given: unpickling runs code stored in the files, so only import caches that you or your own "
                 "runs wrote")
UNTRUSTED_MESSAGE = ("import-verl: verl's tq_batch.pt and gen_batch.dp files are pickles (a torch.save'd TensorDict, "
                     "a pickled DataProto), and loading "
                     "them can run code stored in them, which skip_harness never does unless told to; pass --trust "
                     "if you or your own runs wrote {path} (--dry-run lists what would be converted without loading)")


class VerlImportError(SkipHarnessError):
    """The verl cache cannot be imported; the message names the path."""


@dataclass
class ImportResult:
    converted: List[Tuple[Path, int, int]] = field(default_factory=list)     # (target namespace, step, trajectories)
    failed: List[Tuple[Path, int, str]] = field(default_factory=list)        # (verl step dir, step, why not converted)
    kept: List[Tuple[Path, int, str]] = field(default_factory=list)          # (verl step dir, step, already servable)
    refused: List[Tuple[Path, str]] = field(default_factory=list)            # (target namespace, holder): locked


# --------------------------------------------------------------------------------------------
# converting


def _check_payload(obj: Any, meta: Dict[str, Any], path: Path, kind: str = "v1") -> Optional[str]:
    if kind == "v0":
        if type(obj).__name__ != "DataProto" or not hasattr(obj, "non_tensor_batch"):
            return f"{path}: not a verl DataProto (skip.rollout's gen_batch.dp), but a {type(obj).__name__}"
        return None
    if not isinstance(obj, dict) or "tensordict" not in obj:
        return f"{path}: not a verl rollout_tq payload (a dict with 'tensordict', 'tags', 'keys', 'global_steps')"
    want = meta.get("num_trajectories")
    keys = obj.get("keys")
    if isinstance(want, int) and isinstance(keys, (list, tuple)) and len(keys) != want:
        return f"{path}: holds {len(keys)} trajectories, its meta.json says {want}"
    return None


def import_verl(source: Path, dump_dir: Path, *, trust: bool, dry_run: bool = False,
                on_namespace: Callable[[str, int], None] = lambda name, n: None,
                on_step: Callable[[], None] = lambda: None) -> ImportResult:
    """Convert every complete verl step under `source` into `dump_dir`. Without `trust`, only a dry
    run is allowed (nothing is loaded). Steps already servable in the target are left as they are."""
    source = Path(source)
    dump_dir = dump_dir if isinstance(dump_dir, UrlPath) else Path(dump_dir)
    if not trust and not dry_run:
        raise VerlImportError(UNTRUSTED_MESSAGE.format(path=source))
    namespaces = [v for ns in find_verl_namespaces(source) for v in scan_verl_namespaces(ns)]
    if not namespaces:
        raise VerlImportError(f"{source}: no verl cache found (expected {{exp}}_{{proj}}/GBS{{g}}_N{{n}}_in{{p}}_out"
                              f"{{r}}/{{step}}/tq_batch.pt, .../{{step}}/{{i}}/tq_batch.pt or .../{{step}}/gen_batch.dp)")
    if trust and not dry_run:
        logger.warning(TRUST_WARNING)
    result = ImportResult()
    for vns in namespaces:
        for step, why in vns.skipped:
            result.failed.append((vns.path / str(step), step, f"incomplete verl step: {why}"))
        if vns.key is None:
            for s in vns.steps:
                result.failed.append((s.path, s.step, f"{vns.path.parent.name!r} is not '{{experiment}}_{{project}}'"))
            continue
        layout = vns.key.layout(dump_dir)
        if not layout.is_url and _same_dir(layout.root, vns.path):
            raise VerlImportError(f"DUMP_DIR {dump_dir} would overwrite the verl cache it converts ({vns.path}); "
                                  f"name another DUMP_DIR")
        on_namespace(f"{vns.path} -> {layout.root}", len(vns.steps))
        _import_namespace(vns, layout, dry_run, result, on_step)
    return result


def _same_dir(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _import_namespace(vns: VerlNamespace, layout: Layout, dry_run: bool, result: ImportResult,
                      on_step: Callable[[], None]) -> None:
    ns_lock = None
    namespace = open_namespace(layout)        # its lock file, or its lease on an object store
    if dry_run:
        holder = namespace.holder()           # touches nothing
        if holder is not None:
            result.refused.append((layout.root, f"namespace {layout.root} is in use by {holder}"))
            return
    else:
        try:
            ns_lock = namespace.lock(0)
        except LockHeldError as exc:
            result.refused.append((layout.root, str(exc)))
            return
        except OSError as exc:
            raise VerlImportError(f"DUMP_DIR cannot be written: {layout.root}: {exc.strerror or exc}") from None
        if ns_lock.read_only:
            raise VerlImportError(f"DUMP_DIR cannot be written: {layout.root}: {ns_lock.why or 'this process may only read it'}")
    try:
        existing = {s.step: s for s in scan_namespace(layout, namespace).steps}
        store = StepStore(layout, namespace)
        for vstep in vns.steps:
            try:
                have = existing.get(vstep.step)
                if have is not None and have.servable:
                    result.kept.append((vstep.path, vstep.step,
                                        f"already in {layout.root} ({have.status}); left as it is"))
                    continue
                if dry_run:
                    result.converted.append((layout.root, vstep.step, _count_from_metas(vstep)))
                    continue
                _convert_step(store, vstep, have, result)
            finally:
                on_step()
    finally:
        if ns_lock is not None:
            ns_lock.release()


def _count_from_metas(vstep: VerlStep) -> int:
    total = 0
    for _i, _p, meta_path in vstep.files:
        try:
            n = read_verl_meta(meta_path).get("num_trajectories")
        except (OSError, ValueError, UnicodeDecodeError):
            n = None
        total += n if isinstance(n, int) else 0
    return total


def _convert_step(store: StepStore, vstep: VerlStep, existing: Optional[StepReport],
                  result: ImportResult) -> None:
    layout = store.layout
    if existing is not None:   # an incomplete or corrupt step of ours: rewrite it whole
        store.writer.clear_step(vstep.step)
    entries: List[Any] = []
    trajectories = 0
    try:
        for inner, payload_path, meta_path in vstep.files:
            meta = read_verl_meta(meta_path)
            try:
                obj = load_trusted(payload_path)
            except Exception as exc:
                raise VerlImportError(f"{payload_path}: cannot be loaded: {type(exc).__name__}: {exc}") from None
            problem = _check_payload(obj, meta, payload_path, vstep.kind)
            if problem is not None:
                raise VerlImportError(problem)
            trajectories += _trajectories(obj)
            entries += store.writer.write_inner(vstep.step, inner, 0, obj,
                                         {"source": "verl" if vstep.kind == "v1" else "verl-v0",
                                          "verl_meta": meta, "verl_payload": str(payload_path)})
            del obj
        store.writer.commit(vstep.step, entries, None)
    except (SkipHarnessError, OSError, ValueError) as exc:
        store.writer.clear_step(vstep.step)   # nothing half-converted stays behind
        result.failed.append((vstep.path, vstep.step, str(exc)))
        return
    result.converted.append((layout.root, vstep.step, trajectories))


def _trajectories(obj: Any) -> int:
    if isinstance(obj, dict):
        keys = obj.get("keys")
        return len(keys) if isinstance(keys, (list, tuple)) else 0
    try:
        return len(obj)   # a DataProto: its batch size
    except TypeError:
        return 0


# --------------------------------------------------------------------------------------------
# the command


def cmd_import_verl(source: Path, dump_dir: Path, trust: bool, dry_run: bool, as_json: bool) -> int:
    if not trust and not dry_run:
        raise CliError(UNTRUSTED_MESSAGE.format(path=source), EXIT_USAGE)
    with progress() as bar:
        state = {"open": False}

        def on_namespace(name: str, n: int) -> None:
            if state["open"]:
                bar.finish()
            bar.start(f"converting {name}", n)
            state["open"] = True

        try:
            result = import_verl(source, dump_dir, trust=trust, dry_run=dry_run, on_namespace=on_namespace,
                                       on_step=bar.advance)
        except VerlImportError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        if state["open"]:
            bar.finish()
    for target, why in result.refused:
        logger.error("refusing to import into %s: %s", target, why)
    for path, step, reason in result.failed:
        logger.error("step %d (%s) was not converted: %s", step, path, reason)
    verb = "would convert" if dry_run else "converted"
    if as_json:
        emit_json({"dry_run": dry_run,
                   "converted": [{"namespace": str(t), "step": s, "trajectories": n} for t, s, n in result.converted],
                   "failed": [{"path": str(p), "step": s, "reason": r} for p, s, r in result.failed],
                   "kept": [{"path": str(p), "step": s, "reason": r} for p, s, r in result.kept],
                   "refused": [{"namespace": str(t), "reason": r} for t, r in result.refused]})
    else:
        console = stdout_console()
        t = Table(title=f"import-verl {source} -> {dump_dir}", title_justify="left")
        t.add_column("namespace", overflow="fold")
        t.add_column("steps " + verb, justify="right")
        t.add_column("trajectories", justify="right")
        by_ns: Dict[Any, Any] = {}
        for target, _step, n in result.converted:
            steps, traj = by_ns.get(target, (0, 0))
            by_ns[target] = (steps + 1, traj + n)
        for target, (steps, traj) in by_ns.items():
            t.add_row(short_path(Layout(target), dump_dir), str(steps), str(traj))
        console.print(t)
        for title, rows in (("not converted", result.failed), ("kept (already in DUMP_DIR)", result.kept)):
            if rows:
                s = Table(title=title, title_justify="left")
                s.add_column("step", justify="right")
                s.add_column("verl step", overflow="fold")
                s.add_column("reason", overflow="fold")
                for path, step, reason in rows:
                    s.add_row(str(step), escape(str(path)), escape(reason))
                console.print(s)
        console.print(f"{verb} {len(result.converted)} steps, kept {len(result.kept)}, failed {len(result.failed)}"
                      + (f", refused {len(result.refused)} namespaces" if result.refused else ""))
    if result.refused:
        return EXIT_LOCKED
    return EXIT_CORRUPT if result.failed else EXIT_OK
