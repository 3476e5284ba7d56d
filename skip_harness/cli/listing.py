"""`skip-harness ls` and `skip-harness verify`: what a cache holds, as tables or one JSON document."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from skip_harness.store.api import (Layout, STATUSES, StepReader, StepReport, StepStatus, StepStore, ValuesStore,
                                    open_store, scan_namespace)

from skip_harness.cli._common import (
    EXIT_CORRUPT,
    EXIT_OK,
    emit_json,
    fmt_ago,
    fmt_seconds,
    fmt_value,
    human_bytes,
    mode_and_seed,
    progress,
    short_path,
    stdout_console,
    step_accessed,
    step_gen_s,
    step_metas,
    step_written,
)
from skip_harness.cli._verify import verified_steps
from skip_harness.cli.pack import pack_doc, pack_lines


@dataclass(frozen=True)
class StepRow:
    report: StepReport
    written: Optional[float]
    gen_s: Optional[float]
    accessed: Optional[float] = None   # last read (the commit record's access time; see step_accessed)
    logical: Optional[int] = None      # bytes at full width (StepReader.logical_bytes; more than bytes when compressed)


@dataclass(frozen=True)
class NamespaceView:
    layout: Layout
    rows: Sequence[StepRow]
    runs: Sequence[str] = ()       # replays that kept their values here (`.values/runs/{run_id}/`), oldest first

    @property
    def steps(self) -> List[StepReport]:
        return [r.report for r in self.rows]

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {k.value: 0 for k in STATUSES}
        for r in self.rows:
            out[r.report.status] += 1
        return out

    @property
    def bytes(self) -> int:
        return sum(r.report.bytes for r in self.rows)

    @property
    def logical_bytes(self) -> int:
        return sum(r.report.bytes if r.logical is None else r.logical for r in self.rows)

    @property
    def written(self) -> Optional[float]:
        times = [r.written for r in self.rows if r.written is not None]
        return max(times) if times else None

    @property
    def gen_s(self) -> Optional[float]:
        known = [r.gen_s for r in self.rows if r.report.servable and r.gen_s is not None]
        return sum(known) if known else None

    @property
    def accessed(self) -> Optional[float]:
        times = [r.accessed for r in self.rows if r.accessed is not None]
        return max(times) if times else None


def view(store: StepStore, steps: Sequence[StepReport]) -> NamespaceView:
    layout, reader = store.layout, store.reader
    return NamespaceView(layout, [_row(reader, s) for s in steps], tuple(ValuesStore(reader.namespace).list_runs()))


def _row(reader: StepReader, s: StepReport) -> StepRow:
    """A step's row, its meta files read once (for its full-width size and, where its commit record has
    none, its generation seconds)."""
    metas = step_metas(reader, s.step) if s.servable else None
    return StepRow(s, step_written(reader, s), step_gen_s(reader, s, metas), step_accessed(reader, s),
                   None if metas is None else reader.logical_bytes(s.step, s.bytes, metas))


def sort_views(views: Sequence[NamespaceView], key: str, base: Path) -> List[NamespaceView]:
    """`name`: by path; `size`: largest first; `written`, `accessed`: most recent first (never: last)."""
    if key == "size":
        return sorted(views, key=lambda v: -v.bytes)
    if key in ("written", "accessed"):
        return sorted(views, key=lambda v: -(getattr(v, key) or float("-inf")))
    return sorted(views, key=lambda v: short_path(v.layout, base))


def grand_total(views: Sequence[NamespaceView]) -> str:
    """'3 namespaces, 42 steps, 35.2 MiB in all' (the line under the namespace table)."""
    n, steps = len(views), sum(len(v.rows) for v in views)
    return (f"{n} namespace{'' if n == 1 else 's'}, {steps} step{'' if steps == 1 else 's'}, "
            f"{human_bytes(sum(v.bytes for v in views))} in all")


# --------------------------------------------------------------------------------------------
# output


def _step_json(row: StepRow) -> Dict[str, Any]:
    s = row.report
    return {"step": s.step, "status": s.status, "bytes": s.bytes, "reason": s.reason,
            "fingerprint": None if s.fingerprint is None else s.fingerprint.digest,
            "written": row.written, "gen_s": row.gen_s, "accessed": row.accessed,
            "logical_bytes": s.bytes if row.logical is None else row.logical}


def namespace_json(v: NamespaceView) -> Dict[str, Any]:
    mode, seed = mode_and_seed([s for s in v.steps if s.servable])
    return {"path": str(v.layout.root), "K": v.layout.K, "W": v.layout.W, "steps": [_step_json(r) for r in v.rows],
            "counts": v.counts(), "total_bytes": v.bytes, "total_logical_bytes": v.logical_bytes,
            "written": v.written, "gen_s": v.gen_s,
            "accessed": v.accessed, "mode": mode, "seed": seed, "replays": len(v.runs), "runs": list(v.runs),
            **({"pack": pack_doc(v.layout)} if v.layout.packed else {})}


def namespace_table(views: Sequence[NamespaceView], base: Path, title: str) -> Table:
    now = time.time()
    t = Table(title=title, title_justify="left", show_lines=False)
    t.add_column("namespace", overflow="fold")
    t.add_column("K", justify="right")
    t.add_column("W", justify="right")
    t.add_column("mode")
    t.add_column("seed", justify="right")
    for status in STATUSES:
        t.add_column(status, justify="right")
    t.add_column("size", justify="right")
    t.add_column("last written")
    t.add_column("gen stored", justify="right")
    t.add_column("last read")
    t.add_column("replays", justify="right")
    for v in views:
        counts = v.counts()
        mode, seed = mode_and_seed([s for s in v.steps if s.servable])
        t.add_row(escape(short_path(v.layout, base)), str(v.layout.K), str(v.layout.W), escape(fmt_value(mode)),
                  escape(fmt_value(seed)),
                  *[_count(status, counts[status]) for status in STATUSES],
                  _size(v.bytes, v.logical_bytes), fmt_ago(v.written, now), fmt_seconds(v.gen_s), fmt_ago(v.accessed, now),
                  str(len(v.runs)))
    return t


def _size(stored: int, logical: int) -> str:
    """'5.4 MiB of 56.0 MiB' when compression made the files smaller than the batches, else the size."""
    return human_bytes(stored) if logical == stored else f"{human_bytes(stored)} of {human_bytes(logical)}"


def namespace_blocks(views: Sequence[NamespaceView], base: Path, title: str) -> Table:
    """The namespace table for a narrow console: one block of label/value lines per namespace."""
    now = time.time()
    t = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for n, v in enumerate(views):
        counts = v.counts()
        mode, seed = mode_and_seed([s for s in v.steps if s.servable])
        if n:
            t.add_row("", "")
        t.add_row("namespace", escape(short_path(v.layout, base)))
        t.add_row("K, W", f"{v.layout.K}, {v.layout.W}")
        t.add_row("mode, seed", f"{escape(fmt_value(mode))}, {escape(fmt_value(seed))}")
        t.add_row("steps", ", ".join(f"{_count(st, counts[st])} {st}" for st in STATUSES))
        t.add_row("size", _size(v.bytes, v.logical_bytes))
        t.add_row("last written", fmt_ago(v.written, now))
        t.add_row("gen stored", fmt_seconds(v.gen_s))
        t.add_row("last read", fmt_ago(v.accessed, now))
        t.add_row("replays", str(len(v.runs)))
    return t


def _count(status: str, n: int) -> str:
    if n and status == StepStatus.CORRUPT:
        return f"[bold red]{n}[/]"
    if n and status == StepStatus.INCOMPLETE:
        return f"[yellow]{n}[/]"
    return str(n)


_STATUS_STYLE = {StepStatus.COMPLETE: "green", StepStatus.UNVERIFIED: "cyan", StepStatus.INCOMPLETE: "yellow", StepStatus.CORRUPT: "bold red"}


def _stamp(ts: Optional[float]) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def steps_table(v: NamespaceView, base: Path, only: Optional[Sequence[str]] = None) -> Table:
    t = Table(title=f"{short_path(v.layout, base)}  (K={v.layout.K} W={v.layout.W})", title_justify="left")
    t.add_column("step", justify="right")
    t.add_column("status")
    t.add_column("size", justify="right")
    t.add_column("written")
    t.add_column("gen", justify="right")
    t.add_column("last read")
    t.add_column("fingerprint")
    t.add_column("reason", overflow="fold")
    for r in v.rows:
        s = r.report
        if only is not None and s.status not in only:
            continue
        style = _STATUS_STYLE.get(s.status, "")
        t.add_row(str(s.step), f"[{style}]{s.status}[/]" if style else s.status, human_bytes(s.bytes),
                  _stamp(r.written), fmt_seconds(r.gen_s), _stamp(r.accessed),
                  "-" if s.fingerprint is None else s.fingerprint.digest, escape(s.reason or ""))
    return t


def _print_views(views: Sequence[NamespaceView], base: Path, title: str, steps: bool,
                 only: Optional[Sequence[str]] = None) -> None:
    console = stdout_console()
    table = namespace_table(views, base, title)
    wanted = Measurement.get(console, console.options.update(max_width=100_000), table).maximum
    if wanted > console.width:   # the table would fold every column: a block per namespace instead
        table = namespace_blocks(views, base, title)
    console.print(table)
    if len(views) > 1:
        console.print(grand_total(views))
    for v in views:
        for line in pack_lines(v.layout):       # a pack: when it was packed, when and why it was blessed
            console.print(escape(line), highlight=False)
    for v in views:
        if steps or (only is not None and any(s.status in only for s in v.steps)):
            console.print(steps_table(v, base, None if steps else only))


# --------------------------------------------------------------------------------------------
# commands


def cmd_ls(layouts: List[Layout], base: Path, as_json: bool, steps: bool, sort: str = "name",
           where: str = "") -> int:
    """`where`: how the directory was chosen, when the user did not name it (said in the title)."""
    stores = [open_store(lay) for lay in layouts]
    views = sort_views([view(st, scan_namespace(st.layout, st.namespace).steps) for st in stores], sort, base)
    if as_json:
        emit_json({"dump_dir": str(base), "namespaces": [namespace_json(v) for v in views],
                   "total_bytes": sum(v.bytes for v in views)})
    elif views:
        _print_views(views, base, f"skip_harness cache {base}{f' ({where})' if where else ''}", steps)
    return EXIT_OK


def cmd_verify(layouts: List[Layout], base: Path, as_json: bool, steps: bool) -> int:
    views = []
    with progress() as bar:
        for lay in layouts:
            store = open_store(lay)
            report = scan_namespace(lay, store.namespace)
            bar.start(f"verifying {lay.root}", len(report.steps))
            checked, failed = verified_steps(store.reader, report, bar.advance)
            bar.finish(f"{len(failed)} corrupt" if failed else "")
            views.append(view(store, checked))
    n_corrupt = sum(v.counts()[StepStatus.CORRUPT] for v in views)
    if as_json:
        emit_json({"namespaces": [namespace_json(v) for v in views]})
    elif views:
        _print_views(views, base, f"verified {base}", steps, only=(StepStatus.INCOMPLETE, StepStatus.CORRUPT))
        console = stdout_console()
        if n_corrupt:
            fix = ("a pack is read only: pack it again from its namespace" if all(v.layout.packed for v in views)
                   else "run `skip-harness clean` to remove them, `--quarantine` to keep them aside")
            console.print(f"{n_corrupt} corrupt step{'s' if n_corrupt != 1 else ''} found ({fix})")
        else:
            console.print("every complete step verifies (sizes, checksums, safe load)")
    return EXIT_CORRUPT if n_corrupt else EXIT_OK
