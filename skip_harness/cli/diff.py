"""`skip-harness diff A B [--json]`: the comparison `skip_harness.cli.compare` makes, printed as tables (or
its document as JSON); exit 0 when the two are the same, 1 when they differ, 2 on bad input."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from skip_harness.cli._common import EXIT_OK, EXIT_USAGE, CliError, emit_json, fmt_value, stdout_console
from skip_harness.config import ROLLOUT_TQ_KEY, RolloutTQConfig
from skip_harness.errors import ConfigError
from skip_harness.run.tolerance import ToleranceModel
from skip_harness.cli.compare import compare, compare_namespaces  # noqa: F401  (importable from here as before)

EXIT_DIFFER = 1
_FEW = 5   # keys recorded on one side only: listed up to this many, else counted


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}"
    return fmt_value(x)


def _pair(a: Any, b: Any) -> Tuple[str, str]:
    """Both values short, but never printed alike when they differ."""
    sa, sb = _num(a), _num(b)
    return (repr(a), repr(b)) if sa == sb and a != b else (sa, sb)


def _steps(n: int) -> str:
    return "step" if n == 1 else "steps"


def _delta(x: Any) -> str:
    return "-" if x is None else f"{x:+.4g}"


def tolerances_of(rtol: Optional[float], atol: Optional[float], tolerances: Optional[str]) -> Optional[ToleranceModel]:
    """`--rtol`, `--atol`, `--tolerances` as the tolerance model `diff` compares values within (checked as
    `skip.rollout_tq.replay_rtol`, `replay_atol` and `replay_tolerances` are); None when none is given."""
    if rtol is None and atol is None and tolerances is None:
        return None
    per_key: Any = {}
    if tolerances is not None:
        try:
            per_key = json.loads(tolerances)
        except ValueError as exc:
            raise CliError(f"--tolerances: not JSON ({exc}); give {{\"KEY PATTERN\": {{\"rtol\": R, \"atol\": A}}}}") from None
    try:
        settings = RolloutTQConfig(replay_rtol=0.0 if rtol is None else rtol, replay_atol=0.0 if atol is None else atol,
                                   replay_tolerances=per_key)
    except ConfigError as exc:
        raise CliError(str(exc).replace(f"{ROLLOUT_TQ_KEY}.replay_tolerances", "--tolerances")
                       .replace(f"{ROLLOUT_TQ_KEY}.replay_rtol", "--rtol").replace(f"{ROLLOUT_TQ_KEY}.replay_atol", "--atol")) from None
    return ToleranceModel.of(settings)


def cmd_diff(a: str, b: str, as_json: bool, tolerances: Optional[ToleranceModel] = None) -> int:
    doc = compare(a, b, tolerances=tolerances)
    if as_json:
        emit_json(doc)
        return EXIT_OK if doc["identical"] else EXIT_DIFFER
    from rich.table import Table

    console = stdout_console()
    _print_config(console, doc["config"])
    for p in doc["namespaces"]:
        if p.get("only_in"):
            console.print(f"{p['name']}: only in {a if p['only_in'] == 'a' else b}")
            continue
        ra, rb = (f"@{r}" if r else "" for r in p.get("runs", (None, None)))
        # one line each, never wrapped inside a path or a run id (a terminal folds a long line whole)
        console.print(f"{p['name']}:", soft_wrap=True)
        console.print(f"  A {p['a']}{ra}", soft_wrap=True, highlight=False)
        console.print(f"  B {p['b']}{rb}", soft_wrap=True, highlight=False)
        table = Table()
        for col in ("step", "A", "B", "rollouts", "trajectories differ", "reward mean Δ", "length Δ", "values"):
            table.add_column(col, justify="right" if col not in ("rollouts", "values", "A", "B") else "left")
        for s in p["steps"]:
            td = s.get("trajectories_differ")
            traj = "not paired" if s.get("unpaired") else "-" if td is None else f"{td} of {s.get('trajectories')}"
            values = s.get("values", "-")
            if values == "differ":
                values = "differ: {} {} -> {}".format(s["first_key"], *_pair(s["a_value"], s["b_value"]))
            table.add_row(str(s["step"]), s["a"] or "-", s["b"] or "-", s["rollouts"], traj,
                          _delta(s.get("reward_mean_delta")), _delta(s.get("response_length_delta")), values)
        console.print(table)
        _print_summary(console, p)
    console.print(verdict(doc))
    return EXIT_OK if doc["identical"] else EXIT_DIFFER


def _print_config(console: Any, config: List[Dict[str, Any]]) -> None:
    """The training-side keys both sides recorded with other values; keys recorded on one side only (another
    trainer's whole config) are listed when few, else counted by their first part."""
    both = [c for c in config if c["a"] is not None and c["b"] is not None]
    one = {side: [c["key"] for c in config if c[other] is None] for side, other in (("a", "b"), ("b", "a"))}
    if not config:
        return
    console.print("training-side config (as recorded):")
    for c in both:
        console.print(f"  {c['key']}: {_num(c['a'])} -> {_num(c['b'])}")
    for side, keys in one.items():
        if not keys:
            continue
        if len(keys) <= _FEW:
            for c in config:
                if c["key"] in keys:
                    console.print(f"  {c['key']}: {_num(c['a'])} -> {_num(c['b'])}")
            continue
        parts = sorted({k.split(".", 1)[0] for k in keys})
        console.print(f"  {len(keys)} keys recorded in {side.upper()} only ({', '.join(p + '.*' for p in parts[:6])}"
                      f"{', ...' if len(parts) > 6 else ''}): not listed (`--json` lists them)")


def _print_summary(console: Any, p: Dict[str, Any]) -> None:
    """Below a namespace's table: the first divergence, the largest differences, what was compared."""
    if p.get("other_batch"):
        console.print(f"A and B hold {p['other_batch']}")
    unpaired = {s["unpaired"] for s in p["steps"] if s.get("unpaired")} - {p.get("other_batch")}
    for why in sorted(unpaired):
        steps = [str(s["step"]) for s in p["steps"] if s.get("unpaired") == why]
        console.print(f"trajectories not paired at {_steps(len(steps))} {', '.join(steps)}: {why} "
                      "(not the same trajectories: nothing counted)")
    left = sorted({f for s in p["steps"] for f in s.get("fields_not_compared", ())})
    if left:
        console.print(f"not one value per trajectory, not compared: {', '.join(left)}")
    v = p["values"]
    fd = v["first_divergence"]
    if fd is not None:
        console.print("values first differ at step {}: {} {} (A) vs {} (B)".format(fd["step"], fd["key"], *_pair(fd["a"], fd["b"])))
    big = {k: d for k, d in v["max_abs_diff"].items() if d}
    if big:
        console.print("largest difference per key: " + ", ".join(f"{k} {d:.3g}" for k, d in big.items()))
    for side in ("a", "b"):
        keys = v.get(f"keys_only_in_{side}") or []
        if keys:
            console.print(f"recorded in {side.upper()} only (not compared): " + ", ".join(keys))
    same, records = p["rollouts_same"], p.get("rollouts_same_records", 0)
    how = ""
    if records:
        how = f" ({records} by the same commit records: payloads not read)" if records < same else \
              " (same commit records: payloads not read)"
    apart = [f"only in {s.upper()}: {p[f'steps_only_in_{s}']}" for s in ("a", "b") if p.get(f"steps_only_in_{s}")]
    console.print(f"rollouts: {same} {_steps(same)} the same{how}, {p['rollouts_differ']} differ"
                  + ("; steps " + ", ".join(apart) if apart else "")
                  + f"; values compared on {v['steps_compared']} {_steps(v['steps_compared'])} (timings left out)")
    if v.get("describe") and v["steps_compared"]:     # at another K or W: as the replay check compares them
        console.print(f"values compared as the replay check compares them: {v['describe']}")
    if v.get("tolerances") and v["steps_compared"]:
        console.print(f"values compared within {v['tolerances']}")


def verdict(doc: Dict[str, Any]) -> str:
    """The last line: identical (saying when no payload was read, and how values at another K or W were
    compared), or that they differ -- never `the same` of steps that were not compared."""
    pairs = [p for p in doc["namespaces"] if not p.get("only_in")]
    regrouped = [p["values"]["describe"] for p in pairs if p["values"].get("describe")]
    if not doc["identical"]:
        if pairs and all(p["rollouts_differ"] == 0 and p["values"]["first_divergence"] is None and not p["config"]
                         for p in pairs) and len(pairs) == len(doc["namespaces"]):
            held = sum(p["rollouts_same"] for p in pairs)
            values = sum(p["values"]["steps_compared"] for p in pairs)
            if held == 0 and values == 0:
                line = "the two differ: they hold no step in common (nothing was compared)"
                p = pairs[0]      # a side that holds no rollouts but kept replays' values: name them
                hint = [side.upper() for side, n in zip("ab", p.get("replays", (0, 0)))
                        if n and not p[f"steps_only_in_{side}"] and not p["runs"]["ab".index(side)]]
                return line + (f"; {hint[0]} holds only the values of replays: {hint[0]}@latest names the newest"
                               if len(pairs) == 1 and hint else "")
            if held == 0:
                return (f"the two hold no rollouts in common; the values both kept agree on {values} "
                        f"{_steps(values)}" + (f" ({regrouped[0].split(';')[0]})" if regrouped else ""))
            return "the two differ only in the steps they hold (the steps both hold are the same)"
        if pairs and all(p.get("other_batch") for p in pairs):
            return "the two differ: they are different runs (other batches, other prompts)"
        return "the two differ"
    if regrouped:
        values = sum(p["values"]["steps_compared"] for p in pairs)
        return (f"reproduced: the same rollouts, and the values agree on {values} {_steps(values)} as the replay "
                f"check compares them ({regrouped[0].split(';')[0]})")
    if any(p.get("payloads_read") is False for p in doc["namespaces"] if not p.get("only_in")):
        return ("identical: same commit records (payloads not read; `skip-harness verify` checks each payload "
                "against its record)")
    within = [p["values"]["tolerances"] for p in pairs if p["values"].get("tolerances")]
    return "identical" + (f" (values within {within[0]})" if within else "")


__all__ = ["compare", "compare_namespaces", "cmd_diff", "tolerances_of", "EXIT_DIFFER", "EXIT_USAGE"]
