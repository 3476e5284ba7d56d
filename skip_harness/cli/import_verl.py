"""Convert a rollout cache that verl wrote into committed skip_harness steps.

verl (`verl/utils/skip/rollout_skip.py`) writes, per step, in
`{dump_dir}/{exp}_{proj}/GBS{g}_N{n}_in{p}_out{r}/`:

    {step}/tq_batch.pt        skip.rollout_tq, K = 1, verl main between #6897 and #7032 (verl's docs)
    {step}/0/tq_batch.pt      skip.rollout_tq, K = 1, verl 0.9.0 / 0.9.1
    {step}/{i}/tq_batch.pt    skip.rollout_tq, K = parameter_sync_step > 1 (i = 0..K-1)
    {step}/gen_batch.dp       skip.rollout (V0 agent loop): a pickled DataProto

each next to a `meta.json`. A V1 payload is a `torch.save`d dict `{"tensordict": TensorDict (jagged
nested tensors, NonTensorStack fields), "tags": [...], "keys": [...], "global_steps": int}`: a pickle, as
is `gen_batch.dp`, so loading either can run code stored in the file. This module is the only place in
skip_harness that unpickles, and only when the caller says it trusts the files (`trust=True`, `--trust`).

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

import json
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from skip_harness.store import scan as _scan
from skip_harness.errors import LockHeldError, SkipHarnessError
from skip_harness.store.backend import namespace_of
from skip_harness.store.layout import Layout, NamespaceKey, UrlPath, parse_step_name
from skip_harness.store.stepstore import StepStore

logger = logging.getLogger("skip_harness.cli.import_verl")

VERL_PAYLOAD = "tq_batch.pt"
VERL_V0_PAYLOAD = "gen_batch.dp"
VERL_META = "meta.json"
_VERL_LEAF_RE = re.compile(r"^GBS(\d+)_N(\d+)_in(\d+)_out(\d+)$")
_INNER_RE = re.compile(r"^(0|[1-9][0-9]*)$")

TRUST_WARNING = ("import-verl: loading verl's payloads with torch.load(weights_only=False) because --trust was "
                 "given: unpickling runs code stored in the files, so only import caches that you or your own "
                 "runs wrote")
UNTRUSTED_MESSAGE = ("import-verl: verl's tq_batch.pt and gen_batch.dp files are pickles (a torch.save'd TensorDict, "
                     "a pickled DataProto), and loading "
                     "them can run code stored in them, which skip_harness never does unless told to; pass --trust "
                     "if you or your own runs wrote {path} (--dry-run lists what would be converted without loading)")


class VerlImportError(SkipHarnessError):
    """The verl cache cannot be imported; the message names the path."""


@dataclass(frozen=True)
class VerlStep:
    step: int
    path: Path
    files: Tuple[Tuple[int, Path, Path], ...]    # (inner index, payload, meta)
    kind: str = "v1"                             # "v1": tq_batch.pt; "v0": gen_batch.dp (DataProto)


@dataclass(frozen=True)
class VerlNamespace:
    path: Path
    key: Optional[NamespaceKey]           # None when the group name cannot be split into experiment/project
    K: int
    steps: Tuple[VerlStep, ...]           # complete verl steps, by step
    skipped: Tuple[Tuple[int, str], ...]  # (step, why) for incomplete ones


@dataclass
class ImportResult:
    converted: List[Tuple[Path, int, int]] = field(default_factory=list)     # (target namespace, step, trajectories)
    failed: List[Tuple[Path, int, str]] = field(default_factory=list)        # (verl step dir, step, why not converted)
    kept: List[Tuple[Path, int, str]] = field(default_factory=list)          # (verl step dir, step, already servable)
    refused: List[Tuple[Path, str]] = field(default_factory=list)            # (target namespace, holder): locked


# --------------------------------------------------------------------------------------------
# finding verl's steps (stat and small JSON only: nothing is unpickled here)


def find_verl_namespaces(root: Path) -> List[Path]:
    """verl namespace directories at `root`: the root itself, its children, or its grandchildren."""
    root = Path(root)
    if _VERL_LEAF_RE.match(root.name) and _real_dir(root):
        return [root]
    out: List[Path] = []
    for child in sorted(_real_subdirs(root)):
        if _VERL_LEAF_RE.match(child.name):
            out.append(child)
            continue
        out.extend(leaf for leaf in sorted(_real_subdirs(child)) if _VERL_LEAF_RE.match(leaf.name))
    return out


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _real_subdirs(path: Path) -> List[Path]:
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
    except OSError:
        return []


def _real_file(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


def _read_meta(path: Path) -> Dict[str, Any]:
    with open(path, "rb") as f:
        doc = json.loads(f.read(1 << 20))
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def _pair_problem(d: Path, payload: str = VERL_PAYLOAD) -> Optional[str]:
    if not _real_file(d / payload):
        return f"{d / payload} is missing or empty"
    if not _real_file(d / VERL_META):
        return f"{d / VERL_META} is missing"
    try:
        _read_meta(d / VERL_META)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{d / VERL_META} cannot be read: {exc}"
    return None


def _namespace_key(ns_dir: Path, K: int) -> Optional[NamespaceKey]:
    m = _VERL_LEAF_RE.match(ns_dir.name)
    group = ns_dir.parent.name
    if not m or "_" not in group:
        return None
    experiment, project = group.rsplit("_", 1)
    g, n, p, r = (int(x) for x in m.groups())
    return NamespaceKey(experiment, project, train_batch_size=g, n=n, max_prompt_length=p, max_response_length=r,
                        K=K, W=1)


def scan_verl_namespaces(ns_dir: Path) -> List[VerlNamespace]:
    """The steps of one verl namespace, split by form: flat steps are K = 1; steps with inner
    directories have K = the most inner directories any step has (fewer: incomplete)."""
    flat: List[VerlStep] = []
    nested: Dict[int, Tuple[Path, List[int]]] = {}
    skipped_flat: List[Tuple[int, str]] = []
    for d in _real_subdirs(ns_dir):
        step = parse_step_name(d.name)
        if step is None:
            continue
        inners = sorted(int(c.name) for c in _real_subdirs(d) if _INNER_RE.match(c.name))
        if os.path.lexists(d / VERL_V0_PAYLOAD):
            problem = _pair_problem(d, VERL_V0_PAYLOAD)
            if problem is None and (os.path.lexists(d / VERL_PAYLOAD) or inners):
                problem = f"{d} holds both verl V0 ({VERL_V0_PAYLOAD}) and V1 ({VERL_PAYLOAD}) payloads"
            if problem is None:
                flat.append(VerlStep(step, d, ((0, d / VERL_V0_PAYLOAD, d / VERL_META),), kind="v0"))
            else:
                skipped_flat.append((step, problem))
            continue
        if os.path.lexists(d / VERL_PAYLOAD) or not inners:
            problem = _pair_problem(d)
            if problem is None:
                flat.append(VerlStep(step, d, ((0, d / VERL_PAYLOAD, d / VERL_META),)))
            else:
                skipped_flat.append((step, problem))
            continue
        nested[step] = (d, inners)
    out: List[VerlNamespace] = []
    if flat or skipped_flat:
        out.append(VerlNamespace(ns_dir, _namespace_key(ns_dir, 1), 1, tuple(sorted(flat, key=lambda s: s.step)),
                                 tuple(sorted(skipped_flat))))
    if nested:
        K = max(len(inners) for _d, inners in nested.values())
        steps: List[VerlStep] = []
        skipped: List[Tuple[int, str]] = []
        for step, (d, inners) in sorted(nested.items()):
            if inners != list(range(K)):
                missing = sorted(set(range(K)) - set(inners))
                skipped.append((step, f"inner directories {', '.join(map(str, missing)) or '?'} missing "
                                      f"(K={K} from the namespace's other steps)"))
                continue
            problem = next((p for i in inners if (p := _pair_problem(d / str(i))) is not None), None)
            if problem is not None:
                skipped.append((step, problem))
                continue
            steps.append(VerlStep(step, d, tuple((i, d / str(i) / VERL_PAYLOAD, d / str(i) / VERL_META)
                                                 for i in inners)))
        out.append(VerlNamespace(ns_dir, _namespace_key(ns_dir, K), K, tuple(steps), tuple(skipped)))
    return out


# --------------------------------------------------------------------------------------------
# converting


def load_trusted(path: Path) -> Any:
    """The one unpickling in skip_harness: verl's payloads, only when the caller trusts them.
    `tq_batch.pt` with `torch.load(weights_only=False)`; `gen_batch.dp` as verl's
    `DataProto.load_from_disk` reads it (a plain pickle)."""
    if Path(path).name == VERL_V0_PAYLOAD:
        import pickle

        with open(path, "rb") as f:
            return pickle.load(f)  # noqa: S301 - only with --trust; verl's DataProto.load_from_disk
    return torch.load(path, weights_only=False, map_location="cpu")  # noqa: S614 - only with --trust


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
    backend = namespace_of(layout)          # its lock file, or its lease on an object store
    if dry_run:
        holder = backend.holder()           # touches nothing
        if holder is not None:
            result.refused.append((layout.root, f"namespace {layout.root} is in use by {holder}"))
            return
    else:
        try:
            ns_lock = backend.lock(0)
        except LockHeldError as exc:
            result.refused.append((layout.root, str(exc)))
            return
        except OSError as exc:
            raise VerlImportError(f"DUMP_DIR cannot be written: {layout.root}: {exc.strerror or exc}") from None
        if ns_lock.read_only:
            raise VerlImportError(f"DUMP_DIR cannot be written: {layout.root}: {ns_lock.why or 'this process may only read it'}")
    try:
        existing = {s.step: s for s in _scan.scan_namespace(layout).steps}
        store = StepStore(layout)
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
            n = _read_meta(meta_path).get("num_trajectories")
        except (OSError, ValueError, UnicodeDecodeError):
            n = None
        total += n if isinstance(n, int) else 0
    return total


def _convert_step(store: StepStore, vstep: VerlStep, existing: Optional[_scan.StepReport],
                  result: ImportResult) -> None:
    layout = store.layout
    if existing is not None:   # an incomplete or corrupt step of ours: rewrite it whole
        store.writer.clear_step(vstep.step)
    entries = []
    trajectories = 0
    try:
        for inner, payload_path, meta_path in vstep.files:
            meta = _read_meta(meta_path)
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
