"""verl's own rollout dump, read only: where its steps are, and the one unpickling in skip_harness.

verl (`verl/utils/skip/rollout_skip.py`) writes, per step, in
`{dump_dir}/{exp}_{proj}/GBS{g}_N{n}_in{p}_out{r}/`:

    {step}/tq_batch.pt        skip.rollout_tq, K = 1, verl main between #6897 and #7032 (verl's docs)
    {step}/0/tq_batch.pt      skip.rollout_tq, K = 1, verl 0.9.0 / 0.9.1
    {step}/{i}/tq_batch.pt    skip.rollout_tq, K = parameter_sync_step > 1 (i = 0..K-1)
    {step}/gen_batch.dp       skip.rollout (V0 agent loop): a pickled DataProto

each next to a `meta.json`. Finding the steps reads directory entries (never following a link) and
small JSON files only; `load_trusted` unpickles a payload, and `cli.import_verl` calls it only when the
user said the files are trusted (`--trust`). Converting them into skip_harness steps is
`cli.import_verl`'s job, through the store's writer.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from skip_harness.store.layout import NamespaceKey, parse_step_name

VERL_PAYLOAD = "tq_batch.pt"
VERL_V0_PAYLOAD = "gen_batch.dp"
VERL_META = "meta.json"
_VERL_LEAF_RE = re.compile(r"^GBS(\d+)_N(\d+)_in(\d+)_out(\d+)$")
_INNER_RE = re.compile(r"^(0|[1-9][0-9]*)$")


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


def read_meta(path: Path) -> Dict[str, Any]:
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
        read_meta(d / VERL_META)
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


def load_trusted(path: Path) -> Any:
    """The one unpickling in skip_harness: verl's payloads, only when the caller trusts them.
    `tq_batch.pt` with `torch.load(weights_only=False)`; `gen_batch.dp` as verl's
    `DataProto.load_from_disk` reads it (a plain pickle)."""
    if Path(path).name == VERL_V0_PAYLOAD:
        import pickle

        with open(path, "rb") as f:
            return pickle.load(f)  # noqa: S301 - only with --trust; verl's DataProto.load_from_disk
    return torch.load(path, weights_only=False, map_location="cpu")  # noqa: S614 - only with --trust
