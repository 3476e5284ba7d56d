"""Export a cache as rows anyone can open: Parquet (pyarrow) or JSON lines, one row per trajectory.

Columns: `step`, `inner_index`, `rank`, `trajectory_index`, then the mini-batch's fields (nested keys
joined with '.'), then `namespace`. A tensor whose first dimension is the mini-batch's length is
split into one value per row (a number, or a list for rows of 2+ dimensions); a scalar, a string or
a 0-dim tensor is repeated on every row of its mini-batch. A field named like one of the index
columns is written as `batch.<name>`.

In JSON lines, NaN and infinities are written as null (JSON has no such numbers). Written one
mini-batch at a time (a Parquet row group each), so memory holds one mini-batch, and
into a temporary file renamed into place at the end. Only servable steps are exported: complete
steps after their sizes and checksums verify, every payload through the codec's safe load.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Set, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from skip_harness.store.api import Layout, StepReader, StepReport, StepStatus, StepStore, open_store, scan_namespace
from skip_harness.errors import CorruptStepError, SkipHarnessError
from skip_harness.cli._common import (EXIT_CORRUPT, EXIT_OK, CliError, emit_json, human_bytes, progress, short_path,
                                      stdout_console)
from skip_harness.cli.clean import n_steps, step_ranges
from skip_harness.cli.export_rows import (  # noqa: F401  (ExportError, the columns: part of this command's API)
    FORMATS, INDEX_COLUMNS, NAMESPACE_COLUMN, ExportError, _ParquetSink, _table, _jsonl_rows, columns_of,
)

logger = logging.getLogger("skip_harness.cli.export")


def parse_step_set(text: str) -> Set[int]:
    """'1,3,10-20' -> {1, 3, 10, ..., 20}. ValueError naming the bad part."""
    out: Set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"{part!r} is not a step or a range of steps (e.g. 1,3,10-20)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"{part!r}: the range ends before it starts")
        out.update(range(lo, hi + 1))
    return out


def format_for(path: Path, fmt: Optional[str]) -> str:
    if fmt:
        return fmt
    return "jsonl" if path.suffix.lower() in (".jsonl", ".json", ".ndjson") else "parquet"


# --------------------------------------------------------------------------------------------
# the export


@dataclass
class ExportResult:
    path: Path
    format: str
    rows: int = 0
    mini_batches: int = 0
    steps: List[Tuple[str, int]] = field(default_factory=list)          # (namespace, step) exported
    skipped: List[Tuple[str, int, str]] = field(default_factory=list)   # (namespace, step, reason)


def _union_schema(layouts: Sequence[Tuple[str, StepStore]], steps: Optional[Set[int]]) -> Optional[pa.Schema]:
    """The columns of every namespace's first exportable mini-batch, in order of appearance, so that
    namespaces with different fields share one file (a field one of them lacks is null there)."""
    schemas: List[pa.Schema] = []
    for name, store in layouts:
        layout, reader = store.layout, store.reader
        for s in scan_namespace(layout, store.namespace).steps:
            if not s.servable or (steps is not None and s.step not in steps):
                continue
            try:
                payload = reader.read_inner(s.step, 0, 0)
            except (CorruptStepError, SkipHarnessError):
                continue
            where = str(layout.payload_path(s.step, 0, 0))
            n, cols = columns_of(payload, where)
            meta_cols = {"step": [s.step] * n, "inner_index": [0] * n, "rank": [0] * n,
                         "trajectory_index": list(range(n)), NAMESPACE_COLUMN: name}
            schemas.append(_table(meta_cols, n, cols, where).schema)
            break
    if not schemas:
        return None
    try:
        unified = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise ExportError(f"the namespaces' fields have types that do not agree ({exc}); export them separately "
                          f"(--namespace)") from None
    names = list(INDEX_COLUMNS) + [n for sch in schemas for n in sch.names
                                   if n not in INDEX_COLUMNS and n != NAMESPACE_COLUMN]
    names = list(dict.fromkeys(names)) + [NAMESPACE_COLUMN]
    return pa.schema([unified.field(n) for n in names])


class NoStepsError(ExportError):
    """`--steps` matches no step of the chosen namespaces: nothing is written."""


def export_cache(layouts: Sequence[Tuple[str, Layout]], out: Path, fmt: str = "parquet",
                 steps: Optional[Set[int]] = None,
                 on_namespace: Callable[[str, int], None] = lambda name, n: None,
                 on_step: Callable[[], None] = lambda: None) -> ExportResult:
    """Write every servable step of `layouts` ((name, layout) pairs; `steps` only, if given) to `out`."""
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out = Path(out)
    if out.is_dir():
        raise ExportError(f"-o {out} is a directory; name the file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    result = ExportResult(out, fmt)
    stores = [(name, open_store(layout)) for name, layout in layouts]   # each opened once
    sink = _ParquetSink(tmp, _union_schema(stores, steps) if len(stores) > 1 else None) if fmt == "parquet" else None
    jf = open(tmp, "w", encoding="utf-8") if fmt == "jsonl" else None
    held: Set[int] = set()   # the servable steps the namespaces hold
    matched = 0
    try:
        for name, store in stores:
            layout, reader = store.layout, store.reader
            report = scan_namespace(layout, store.namespace)
            chosen = [s for s in report.steps if steps is None or s.step in steps]
            held.update(s.step for s in report.steps)
            matched += len(chosen)
            on_namespace(name, len(chosen))
            for s in chosen:
                try:
                    _export_step(reader, s, name, sink, jf, result)
                finally:
                    on_step()
        if steps is not None and not matched:
            raise NoStepsError(f"no step of {'the namespace' if len(layouts) == 1 else f'the {len(layouts)} namespaces'} "
                               f"is in it ({'steps held: ' + step_ranges(sorted(held)) if held else 'no step held'}); "
                               f"nothing written")
        if sink is not None:
            sink.close()
            if sink.writer is None:  # nothing exported: still an empty, readable file
                pq.write_table(pa.table({k: pa.array([], type=pa.int64()) for k in INDEX_COLUMNS}), str(tmp))
        if jf is not None:
            jf.close()
        os.replace(tmp, out)
    except BaseException:
        if jf is not None:
            jf.close()
        if sink is not None and sink.writer is not None:
            try:
                sink.close()
            except Exception:
                pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return result


def _export_step(reader: StepReader, s: StepReport, name: str, sink: Optional[_ParquetSink], jf,
                 result: ExportResult) -> None:
    if not s.servable:
        result.skipped.append((name, s.step, f"{s.status}: {s.reason}"))
        return
    if s.status == StepStatus.COMPLETE:
        _status, reason = reader.verify(s.step, load=False)   # sizes and checksums; loading is next
        if reason is not None:
            result.skipped.append((name, s.step, f"corrupt: {reason}"))
            return
    lay = reader.layout
    batches = []
    for i, r, _p, _m in lay.expected_rels():   # load the step whole first: a bad file skips all of it
        try:
            batches.append((i, r, reader.read_inner(s.step, i, r)))
        except (CorruptStepError, SkipHarnessError) as exc:
            result.skipped.append((name, s.step, f"cannot be loaded safely: {exc}"))
            return
    for i, r, payload in batches:
        where = f"{lay.payload_path(s.step, i, r)}"
        n, cols = columns_of(payload, where)
        meta_cols = {"step": [s.step] * n, "inner_index": [i] * n, "rank": [r] * n,
                     "trajectory_index": list(range(n)), NAMESPACE_COLUMN: name}
        if sink is not None:
            sink.write(_table(meta_cols, n, cols, where), where)
        else:
            for line in _jsonl_rows(meta_cols, n, cols):
                jf.write(line + "\n")
        result.rows += n
        result.mini_batches += 1
    del batches
    result.steps.append((name, s.step))


# --------------------------------------------------------------------------------------------
# the command


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
        steps: Optional[Set[int]] = parse_step_set(steps_text) if steps_text else None
    except ValueError as exc:
        raise CliError(f"--steps: {exc}") from None
    chosen = select_namespaces(layouts, base, patterns)
    fmt = format_for(out, fmt)
    with progress() as bar:
        state = {"open": False}

        def on_namespace(name: str, n: int) -> None:
            if state["open"]:
                bar.finish()
            bar.start(f"exporting {name}", n)
            state["open"] = True

        try:
            result = export_cache([(short_path(lay, base), lay) for lay in chosen], out, fmt, steps,
                                          on_namespace=on_namespace, on_step=bar.advance)
        except NoStepsError as exc:   # `--steps 50-60` on 20 steps: a usage error, no empty file
            raise CliError(f"--steps {steps_text}: {exc}") from None
        except ExportError as exc:
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
