"""`skip-harness diff A B [--json]`: the comparison `skip_harness.cli.compare` makes, printed as tables (or
its document as JSON); exit 0 when the two are the same, 1 when they differ, 2 on bad input."""
from __future__ import annotations

from typing import Any, Tuple

from skip_harness.cli._common import EXIT_OK, EXIT_USAGE, emit_json, fmt_value, stdout_console
from skip_harness.cli.compare import compare, compare_namespaces  # noqa: F401  (importable from here as before)

EXIT_DIFFER = 1


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


def cmd_diff(a: str, b: str, as_json: bool) -> int:
    doc = compare(a, b)
    if as_json:
        emit_json(doc)
        return EXIT_OK if doc["identical"] else EXIT_DIFFER
    from rich.table import Table

    console = stdout_console()
    if doc["config"]:
        console.print("training-side config (as recorded):")
        for c in doc["config"]:
            console.print(f"  {c['key']}: {_num(c['a'])} -> {_num(c['b'])}")
    for p in doc["namespaces"]:
        if p.get("only_in"):
            console.print(f"{p['name']}: only in {a if p['only_in'] == 'a' else b}")
            continue
        ra, rb = (f"@{r}" if r else "" for r in p.get("runs", (None, None)))
        table = Table(title=f"{p['name']}: A {p['a']}{ra}  B {p['b']}{rb}", title_justify="left")
        for col in ("step", "A", "B", "rollouts", "trajectories differ", "reward mean Δ", "length Δ", "values"):
            table.add_column(col, justify="right" if col not in ("rollouts", "values", "A", "B") else "left")
        for s in p["steps"]:
            td = s.get("trajectories_differ")
            traj = "-" if td is None else f"{td} of {s.get('trajectories')}"
            values = s.get("values", "-")
            if values == "differ":
                values = "differ: {} {} -> {}".format(s["first_key"], *_pair(s["a_value"], s["b_value"]))
            table.add_row(str(s["step"]), s["a"] or "-", s["b"] or "-", s["rollouts"], traj,
                          _delta(s.get("reward_mean_delta")), _delta(s.get("response_length_delta")), values)
        console.print(table)
        v = p["values"]
        fd = v["first_divergence"]
        if fd is not None:
            console.print("values first differ at step {}: {} {} (A) vs {} (B)".format(fd["step"], fd["key"], *_pair(fd["a"], fd["b"])))
        big = {k: d for k, d in v["max_abs_diff"].items() if d}
        if big:
            console.print("largest difference per key: " + ", ".join(f"{k} {d:.3g}" for k, d in big.items()))
        console.print(f"rollouts: {p['rollouts_same']} {_steps(p['rollouts_same'])} the same, {p['rollouts_differ']} "
                      f"differ; values compared on {v['steps_compared']} {_steps(v['steps_compared'])} (timings left out)")
    console.print("identical" if doc["identical"] else "the two differ")
    return EXIT_OK if doc["identical"] else EXIT_DIFFER


__all__ = ["compare", "compare_namespaces", "cmd_diff", "EXIT_DIFFER", "EXIT_USAGE"]
