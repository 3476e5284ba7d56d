"""`skip-harness export` (a cache as Parquet / JSON lines) and `skip-harness import-verl` (a verl cache
as committed skip_harness steps)."""
from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

from rich.markup import escape
from rich.table import Table

from skip_harness.cli import export as _export
from skip_harness.cli import import_verl as _verl
from skip_harness.cli.clean import n_steps
from skip_harness.store.api import Layout

from skip_harness.cli._common import (
    EXIT_CORRUPT,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    emit_json,
    human_bytes,
    logger,
    progress,
    short_path,
    stdout_console,
)


def select_namespaces(layouts: List[Layout], base: Path, patterns: Sequence[str]) -> List[Layout]:
    """Namespaces matching any pattern: their path relative to DUMP_DIR, their group or leaf name,
    or a shell-style pattern (`sync_*`) over any of those."""
    if not patterns:
        return layouts
    out = []
    for lay in layouts:
        names = {short_path(lay, base), lay.root.name, lay.root.parent.name, str(lay.root)}
        if any(fnmatch.fnmatchcase(n, p) or n == p.rstrip("/") for p in patterns for n in names):
            out.append(lay)
    if not out:
        raise CliError(f"--namespace {' '.join(patterns)}: matches none of the {len(layouts)} namespaces under {base}")
    return out


def cmd_export(layouts: List[Layout], base: Path, out: Path, fmt: Optional[str], patterns: Sequence[str],
               steps_text: Optional[str], as_json: bool) -> int:
    try:
        steps: Optional[Set[int]] = _export.parse_step_set(steps_text) if steps_text else None
    except ValueError as exc:
        raise CliError(f"--steps: {exc}") from None
    chosen = select_namespaces(layouts, base, patterns)
    fmt = _export.format_for(out, fmt)
    with progress() as bar:
        state = {"open": False}

        def on_namespace(name: str, n: int) -> None:
            if state["open"]:
                bar.finish()
            bar.start(f"exporting {name}", n)
            state["open"] = True

        try:
            result = _export.export_cache([(short_path(lay, base), lay) for lay in chosen], out, fmt, steps,
                                          on_namespace=on_namespace, on_step=bar.advance)
        except _export.NoStepsError as exc:   # `--steps 50-60` on 20 steps: a usage error, no empty file
            raise CliError(f"--steps {steps_text}: {exc}") from None
        except _export.ExportError as exc:
            raise CliError(str(exc), EXIT_CORRUPT) from None
        if state["open"]:
            bar.finish()
    for name, step, reason in result.skipped:
        logger.warning("%s step %d not exported: %s", name, step, reason)
    size = out.stat().st_size
    if as_json:
        emit_json({"path": str(out), "format": fmt, "rows": result.rows, "mini_batches": result.mini_batches,
                   "bytes": size, "steps": [{"namespace": n, "step": s} for n, s in result.steps],
                   "skipped": [{"namespace": n, "step": s, "reason": r} for n, s, r in result.skipped]})
    else:
        stdout_console().print(
            f"wrote {out} ({fmt}, {human_bytes(size)}): {result.rows} rows from {n_steps(len(result.steps))} "
            f"({result.mini_batches} mini-batches) of {len(chosen)} namespace{'s' if len(chosen) != 1 else ''}"
            + (f"; {n_steps(len(result.skipped))} skipped (see the warnings)" if result.skipped else ""))
    return EXIT_OK


def cmd_import_verl(source: Path, dump_dir: Path, trust: bool, dry_run: bool, as_json: bool) -> int:
    if not trust and not dry_run:
        raise CliError(_verl.UNTRUSTED_MESSAGE.format(path=source), EXIT_USAGE)
    with progress() as bar:
        state = {"open": False}

        def on_namespace(name: str, n: int) -> None:
            if state["open"]:
                bar.finish()
            bar.start(f"converting {name}", n)
            state["open"] = True

        try:
            result = _verl.import_verl(source, dump_dir, trust=trust, dry_run=dry_run, on_namespace=on_namespace,
                                       on_step=bar.advance)
        except _verl.VerlImportError as exc:
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
