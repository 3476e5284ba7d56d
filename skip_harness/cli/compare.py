"""What `skip-harness diff A B` compares: two namespaces, or two cache roots, step by step (the viewer's
compare page shows the same document; `diff.py` prints it).

Rollouts first by the checksums the commit records list (no payload is read when they match: the
document says `same commit records (payloads not read)`, and `skip-harness verify` is what reads them),
then, where they differ, by content: how many trajectories differ, and how the reward mean and the
response length moved. Steps present on one side only are counted apart (`steps_only_in_a` / `_b`), not
as differing rollouts. Then the values the trainer recorded for each step (store.values), on the keys
both sides recorded: the first step and key that differ and the largest difference per key; keys
recorded on one side only are listed apart (`keys_only_in_a` / `_b`) and never make a divergence. The
training-side configs recorded with the values are compared on top, less the keys that cannot change
training (run length, thread counts, paths, logging: `NOT_EXPLANATIONS`); a null and an absent key are
the same. `compare(a, b)` returns the document `diff --json` prints; bad input is a CliError (exit 2).
"""
from __future__ import annotations

import fnmatch
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness.cli._common import CliError, about, where_of
from skip_harness.cli.pair_rows import rows_of, unpaired
from skip_harness.cli.pairing import (RunValues, ValuesRule, batch_difference, kept_runs, recorded_tolerances,
                                      rollouts_store, rule_json, run_of, run_steps, side_of, split_keys, split_run, values_rule,
                                      with_workers)
from skip_harness.config import DEFAULT_REPLAY_IGNORE
from skip_harness.errors import CorruptStepError, SkipHarnessError
from skip_harness.run.tolerance import ToleranceModel
from skip_harness.store.api import (Layout, PAYLOAD_NAME, StepReport, UrlPath, config_changes, is_pack,
                                    namespaces_at, open_store, parse_namespace_leaf, scan_namespace)

PAYLOAD_STEM = PAYLOAD_NAME.rsplit(".", 1)[0]      # tq_batch.pt, tq_batch_rank{r}.pt
_REWARD_NAMES = ("reward", "score")
_MASK_NAMES = ("response_mask", "completion_mask")
_LENGTH_NAMES = ("response_length", "response_lengths", "lengths", "completion_lengths")
_RESPONSE_NAMES = ("responses", "completion_ids", "response_ids")

#: Config keys (their last dotted part, lower case) that cannot change what a step trains on: how long the
#: run is, how many threads or workers it uses, where it writes, how it logs. A difference in them is not
#: offered as an explanation of a divergence.
NOT_EXPLANATIONS = (
    "total_training_steps", "total_epochs", "num_train_epochs", "max_steps", "*threads*", "*num_workers*",
    "*_dir", "*dir", "*path", "*_path*", "*_file", "output_*", "logger", "log_*", "*logging*", "*_log", "report_to",
    "project_name", "experiment_name", "run_name", "save_*", "*_freq", "resume_*", "*checkpoint*", "tensorboard*",
    "wandb*", "disable_tqdm", "*progress*", "val_before_train", "val_only", "test_freq", "*_dump*",
)


# --------------------------------------------------------------------------------------------
# opening the two sides


def _namespaces(text: str, arg: str) -> Tuple[bool, Dict[str, Layout]]:
    """(whether `text` (the argument `arg`) names one namespace, {its name relative to what was named: Layout})."""
    where: Any = where_of(text, arg)   # a Path or a UrlPath: both have the few operations used below
    if not isinstance(where, UrlPath):
        if not where.exists():
            raise CliError(f"{text} does not exist")
        if not where.is_dir() and not is_pack(where):
            raise CliError(f"{text} is not a directory or a pack file")
    try:
        layouts = namespaces_at(where)
    except (OSError, SkipHarnessError) as exc:
        raise CliError(about(text, exc)) from None
    single = parse_namespace_leaf(where.name) is not None or (len(layouts) == 1 and layouts[0].packed)
    if not layouts:
        raise CliError(f"{text}: no skip_harness namespace there")
    out = {}
    for lay in layouts:
        try:
            rel = str(lay.root.relative_to(where)) if not single else lay.leaf
        except ValueError:
            rel = str(lay.root)
        out[rel] = lay
    return single, out


# --------------------------------------------------------------------------------------------
# one pair of namespaces


def _files(report: Any) -> Optional[Dict[str, str]]:
    record = getattr(report, "record", None)
    if record is None:
        return None
    # payloads only: a meta.json holds its writing time, so it differs between any two writes
    return {e.rel: e.checksum for e in record.files if e.rel.rsplit("/", 1)[-1].startswith(PAYLOAD_STEM)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_nested or b.is_nested:
            return all(_same(x, y) for x, y in zip(a.unbind(), b.unbind()))
        if a.is_floating_point():
            return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
        return bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - arrays and the like
        return repr(a) == repr(b)


def _find(fields: Dict[str, List[Any]], names: Sequence[str], contains: bool = False) -> Optional[str]:
    for name in fields:
        low = name.rsplit(".", 1)[-1].lower()
        if (any(n in low for n in names) if contains else low in names):
            return name
    return None


def _row_number(value: Any, how: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if how == "sum":
            return float(value.float().sum())
        if how == "numel":
            return float(value.numel())
        return float(value.float().mean()) if value.numel() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list) and how == "numel":
        return float(len(value))
    return None


def _mean(fields: Dict[str, List[Any]], name: Optional[str], how: str) -> Optional[float]:
    if name is None:
        return None
    xs = [x for x in (_row_number(v, how) for v in fields[name]) if x is not None]
    return sum(xs) / len(xs) if xs else None


def _length_field(fields: Dict[str, List[Any]]) -> Tuple[Optional[str], str]:
    name = _find(fields, _MASK_NAMES)
    if name is not None:
        return name, "sum"
    name = _find(fields, _LENGTH_NAMES)
    if name is not None:
        return name, "mean"
    return _find(fields, _RESPONSE_NAMES), "numel"


def _in_order(reader: Any, step: int) -> List[Any]:
    """A step's K x W mini-batches in recorded order (mini-batch i of rank r is part i x W + r: the order a
    step's rows are split in, whatever K and W), so two sides at another K or W pair row by row."""
    K, W = reader.layout.K, reader.layout.W
    return [reader.read_inner(step, i, r) for i in range(K) for r in range(W)]


def _content(reader_a: Any, reader_b: Any, step: int, other_batch: str = "") -> Dict[str, Any]:
    """Trajectories that differ (only of rows that are pairs: `pair_rows.unpaired`), and the change in
    reward mean and response length, from the payloads."""
    pa, pb = _in_order(reader_a, step), _in_order(reader_b, step)
    na, fa, left_a = rows_of(pa)
    nb, fb, left_b = rows_of(pb)
    why = other_batch or unpaired(na, fa, nb, fb, _same)
    out: Dict[str, Any] = {"trajectories": max(na, nb), "trajectories_differ": None}
    if why:
        out["unpaired"] = why
    else:
        common = [k for k in fa if k in fb]
        out["trajectories_differ"] = sum(1 for i in range(na) if any(not _same(fa[k][i], fb[k][i]) for k in common))
    if left_a or left_b:
        out["fields_not_compared"] = sorted(set(left_a) | set(left_b))
    ra, rb = _mean(fa, _find(fa, _REWARD_NAMES, True), "mean"), _mean(fb, _find(fb, _REWARD_NAMES, True), "mean")
    la, lb = _mean(fa, *_length_field(fa)), _mean(fb, *_length_field(fb))
    out["reward_mean"] = [ra, rb]
    out["reward_mean_delta"] = None if ra is None or rb is None else rb - ra
    out["response_length"] = [la, lb]
    out["response_length_delta"] = None if la is None or lb is None else lb - la
    return out


def _ignored(key: str) -> bool:
    low = key.lower()
    return any(fnmatch.fnmatchcase(low, p) for p in DEFAULT_REPLAY_IGNORE)


def _compare_values(a: Optional[Dict[str, float]], b: Optional[Dict[str, float]], rule: ValuesRule,
                    seen: Tuple[Dict[str, None], Dict[str, None]]
                    ) -> Tuple[str, Optional[Tuple[str, float, float]], Dict[str, float], Tuple[List[str], List[str]]]:
    """('same' | 'differ' | 'unrecorded', the first differing key (in A's recorded order) with both values,
    |a - b| by key, (keys only A recorded, keys only B recorded)). Only keys both sides recorded are
    compared, as the replay check compares them (`rule`: at another K the values that depend on the
    rollouts alone, within a tolerance; `seen`: the keys compared and those left out, filled in); timings
    are left out, as the replay check leaves them out by default."""
    if a is None or b is None:
        return "unrecorded", None, {}, ([], [])
    a = {k: v for k, v in a.items() if not _ignored(k)}
    b = {k: v for k, v in b.items() if not _ignored(k)}
    first = None
    diffs: Dict[str, float] = {}
    compared, left_out = split_keys([k for k in a if k in b], rule)
    seen[0].update(dict.fromkeys(compared))
    seen[1].update(dict.fromkeys(left_out))
    if not compared:        # nothing both recorded that may be compared: not "the same"
        return "unrecorded", None, {}, (sorted(set(a) - set(b)), sorted(set(b) - set(a)))
    for key in compared:
        x, y = a[key], b[key]
        same = rule.same(key, x, y)
        d = 0.0 if same else (abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf)
        diffs[key] = d
        if not same and first is None:
            first = (key, x, y)
    only = (sorted(set(a) - set(b)), sorted(set(b) - set(a)))
    return ("same" if first is None else "differ"), first, diffs, only


def explains_nothing(key: str) -> bool:
    """A config key that cannot change what a step trains on (`NOT_EXPLANATIONS`)."""
    last = key.rsplit(".", 1)[-1].lower()
    return any(fnmatch.fnmatchcase(last, p) for p in NOT_EXPLANATIONS)


def config_diff(ca: Optional[Dict[str, Any]], cb: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The training-side keys whose recorded values differ and could explain a divergence: a null and an
    absent key are the same; run length, threads, paths and logging are left out."""
    if ca is None or cb is None:
        return []
    return [{"key": k, "a": x, "b": y} for k, x, y in config_changes(ca, cb)
            if not explains_nothing(k) and not (x is None and y is None)]


def compare_namespaces(la: Layout, lb: Layout, read_payloads: bool = True, run_a: Optional[str] = None,
                       run_b: Optional[str] = None, tolerances: Optional[ToleranceModel] = None) -> Dict[str, Any]:
    """One pair of namespaces, step by step. `read_payloads=False` (the viewer's compare page, which pairs
    one step's trajectories itself): steps whose checksums differ are not read (`rollouts: "not read"`).
    `run_a`, `run_b`: compare that replay's values (its run id, or 'latest') instead of the recording's.
    `tolerances`: what values are compared within (else the replay side's replay check's: cli.pairing)."""
    sa, sb = open_store(la), open_store(lb)
    va_of, vb_of = RunValues(sa, run_of(sa, run_a, "A")), RunValues(sb, run_of(sb, run_b, "B"))
    side_a, side_b = side_of(sa, va_of.run), side_of(sb, vb_of.run)
    seen: Tuple[Dict[str, None], Dict[str, None]] = ({}, {})
    sa_values, sb_values = sa, sb
    named = [str(la.root), str(lb.root)]
    sa, sb = rollouts_store(sa, side_a), rollouts_store(sb, side_b)   # a replay_from run's: its recording's
    la, lb = sa.layout, sb.layout
    other = batch_difference(la, lb)
    ra = {s.step: s for s in scan_namespace(la, sa.namespace, use_index=False).steps}
    rb = ra if la.root == lb.root else {s.step: s for s in scan_namespace(lb, sb.namespace, use_index=False).steps}
    # verl: a replay's W is its worker count, the recording's read from its recorded config (run.shape)
    side_a = with_workers(side_a, side_b, None if side_b.run is None or va_of.run is not None else va_of.config(sorted(ra)))
    side_b = with_workers(side_b, side_a, None if side_a.run is None or vb_of.run is not None else vb_of.config(sorted(rb)))
    rule = values_rule(side_a, side_b, other, recorded_tolerances(side_a, side_b, tolerances))
    steps_out: List[Dict[str, Any]] = []
    first_values = None
    max_diff: Dict[str, float] = {}
    same_rollouts = differ_rollouts = same_records = unread = 0
    only = {"a": 0, "b": 0, "neither": 0}
    keys_only: Tuple[Dict[str, None], Dict[str, None]] = ({}, {})
    values_compared = 0
    # a replay keeps values of steps whose rollouts it does not hold: they are compared too
    for step in sorted(set(ra) | set(rb) | set(run_steps(sa_values, va_of.run)) | set(run_steps(sb_values, vb_of.run))):
        a, b = ra.get(step), rb.get(step)
        row: Dict[str, Any] = {"step": step, "a": None if a is None else a.status, "b": None if b is None else b.status}
        side = _one_side(a, b)
        fa, fb = _files(a), _files(b)
        if side is not None:                    # counted apart: not a difference of rollouts
            row["rollouts"] = "in neither" if side == "neither" else f"only in {side}"
            only[side] += 1
        elif fa is not None and fa == fb:
            row["rollouts"] = "same"
            row["by"] = "commit records"         # payloads not read
            same_rollouts += 1
            same_records += 1
        elif not read_payloads:
            row["rollouts"] = "not read"
            unread += 1
        else:
            try:
                content = _content(sa.reader, sb.reader, step, other)
            except (CorruptStepError, SkipHarnessError, OSError) as exc:
                row["rollouts"] = "unreadable"
                row["reason"] = str(exc)
                differ_rollouts += 1
                steps_out.append(row)
                continue
            row.update(content)
            same = content["trajectories_differ"] == 0
            row["rollouts"] = "same" if same else "differ"
            if same:
                same_rollouts += 1
            else:
                differ_rollouts += 1
        va, vb = va_of.read_values(step), vb_of.read_values(step)
        verdict, first, diffs, (only_a, only_b) = _compare_values(va, vb, rule, seen)
        keys_only[0].update(dict.fromkeys(only_a))
        keys_only[1].update(dict.fromkeys(only_b))
        row["values"] = verdict
        if verdict != "unrecorded":
            values_compared += 1
        if first is not None:
            row["first_key"], row["a_value"], row["b_value"] = first
            if first_values is None:
                first_values = {"step": step, "key": first[0], "a": first[1], "b": first[2]}
        for k, d in diffs.items():
            max_diff[k] = max(max_diff.get(k, 0.0), d)
        steps_out.append(row)
    ca = va_of.config(sorted(ra))
    cb = vb_of.config(sorted(rb))
    cfg = config_diff(ca, cb)
    return {
        "a": named[0], "b": named[1], "K": [la.K, lb.K], "W": [la.W, lb.W],
        "other_batch": other, "runs": [va_of.run, vb_of.run], "replays": [kept_runs(sa_values), kept_runs(sb_values)], "values_at": [[side_a.K, side_a.W], [side_b.K, side_b.W]],
        "rollouts_from": [str(la.root), str(lb.root)],
        "config": cfg, "config_recorded": [ca is not None, cb is not None],
        "steps": steps_out,
        "rollouts_same": same_rollouts, "rollouts_differ": differ_rollouts,
        "rollouts_same_records": same_records, "payloads_read": same_records < same_rollouts + differ_rollouts,
        **({"rollouts_not_read": unread} if not read_payloads else {}),
        "steps_only_in_a": only["a"], "steps_only_in_b": only["b"], "steps_in_neither": only["neither"],
        "values": {"steps_compared": values_compared, "first_divergence": first_values,
                   "max_abs_diff": {k: max_diff[k] for k in sorted(max_diff)},
                   "keys_only_in_a": sorted(keys_only[0]), "keys_only_in_b": sorted(keys_only[1]),
                   **rule_json(rule, seen[1], seen[0])},
        "identical": differ_rollouts == 0 and first_values is None and not cfg and not only["a"] and not only["b"]
        and not unread,
    }


def _one_side(a: Optional[StepReport], b: Optional[StepReport]) -> Optional[str]:
    """'a' / 'b' when only that side has the step servable, 'neither' when none has, None when both have."""
    in_a, in_b = a is not None and a.servable, b is not None and b.servable
    if in_a and in_b:
        return None
    return "a" if in_a else "b" if in_b else "neither"


def compare(a: str, b: str, read_payloads: bool = True, tolerances: Optional[ToleranceModel] = None) -> Dict[str, Any]:
    """`skip-harness diff A B --json`'s document: A and B are two namespaces, or two cache roots (local
    paths or object-store URLs; namespaces paired by name). A namespace may name one of its replays,
    `NS@RUN_ID` or `NS@latest`: its values are then that run's. CliError (exit 2) on bad input.
    `read_payloads=False`: rollouts compared by their commit records only (see compare_namespaces);
    `tolerances`: what values are compared within (`diff --rtol/--atol/--tolerances`)."""
    a, run_a = split_run(str(a))
    b, run_b = split_run(str(b))
    single_a, nsa = _namespaces(str(a), "A")
    single_b, nsb = _namespaces(str(b), "B")
    if (run_a or run_b) and not (single_a and single_b):
        raise CliError("NS@RUN names one replay of one namespace: give two namespaces, not cache roots")
    pairs: List[Dict[str, Any]] = []
    if single_a or single_b:
        if not (single_a and single_b):
            raise CliError(f"diff compares two namespaces or two cache roots; {a if single_a else b} is a "
                           f"namespace and {b if single_a else a} is not")
        pairs.append(dict(name=next(iter(nsa)), **compare_namespaces(next(iter(nsa.values())), next(iter(nsb.values())),
                                                                     read_payloads, run_a, run_b, tolerances)))
    else:
        for name in sorted(set(nsa) | set(nsb)):
            if name not in nsb or name not in nsa:
                pairs.append({"name": name, "only_in": "a" if name in nsa else "b", "identical": False,
                              "a": str(nsa[name].root) if name in nsa else None,
                              "b": str(nsb[name].root) if name in nsb else None})
                continue
            pairs.append(dict(name=name, **compare_namespaces(nsa[name], nsb[name], read_payloads,
                                                              tolerances=tolerances)))
    config = []
    for p in pairs:
        for c in p.get("config", []):
            if c not in config:
                config.append(c)
    return {"a": str(a), "b": str(b), "identical": all(p["identical"] for p in pairs),
            "config": config, "namespaces": pairs}


__all__ = ["compare", "compare_namespaces"]
