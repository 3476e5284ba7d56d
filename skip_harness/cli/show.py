"""`skip-harness show PATH [STEP [INNER]]`: what one cached mini-batch holds, loaded safely.

PATH is a namespace (or a directory holding exactly one), a step directory, or a payload file. The
payload is loaded with the codec (`torch.load(weights_only=True)`, then the codec's own records):
nothing stored in the file is ever run.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from rich.markup import escape
from rich.table import Table

from skip_harness.store.api import (Layout, StepReport, StepStore, UrlPath, classify_step, load_payload_file,
                                    is_pack, open_store, parse_namespace_leaf, parse_step_name, payload_file_fields,
                                    payload_file_meta, payload_file_size, payload_rel_at, scan_namespace)
from skip_harness.errors import CodecError, CorruptStepError, SkipHarnessError

from skip_harness.cli._common import EXIT_CORRUPT, EXIT_OK, CliError, fmt_time, human_bytes, namespaces_under, stdout_console
from skip_harness.cli._verify import VERL_HINT, _plain_reason
from skip_harness.cli.pack import pack_doc, pack_lines
from skip_harness.cli.describe import _MAX_ROWS, _meta_text, _ratio, _stored_table, describe, head_values  # noqa: F401

@dataclasses.dataclass
class Target:
    payload: Path
    layout: Optional[Layout] = None
    step: Optional[int] = None
    inner: int = 0
    rank: int = 0
    store: Optional[StepStore] = None      # the layout's steps, its namespace opened once by this command


# --------------------------------------------------------------------------------------------
# resolving PATH [STEP [INNER]]


def _enclosing_namespace(path: Union[Path, UrlPath]) -> Optional[Tuple[Layout, int, int, int]]:
    """(layout, step, inner, rank) when `path` is a payload file (or object) inside a namespace."""
    below, step_dir = [path.name], path.parent
    for _ in (2, 3):                     # ns/step/file or ns/step/inner/file
        ns = step_dir.parent
        if ns == step_dir:               # the top: nothing above
            return None
        kw, step = parse_namespace_leaf(ns.name), parse_step_name(step_dir.name)
        if kw is not None and step is not None:
            layout = Layout(ns, K=kw[0], W=kw[1])  # type: ignore[arg-type]  # Layout's root: a Path or a UrlPath
            where = layout.position_of("/".join(below))
            if where is not None:
                return layout, step, where[0], where[1]
        below.insert(0, step_dir.name)
        step_dir = ns
    return None


def resolve(path: Path, step: Optional[int], inner: Optional[int], rank: int) -> Target:
    if isinstance(path, UrlPath):       # an object store: a namespace, a step or a payload URL
        found = _enclosing_namespace(path)
        if found is None:
            return _resolve_in_namespace(path, step, inner, rank)
        if step is not None:
            raise CliError(f"{path} is a payload: STEP and INNER go with a namespace, not a payload")
        layout, s, i, r = found
        return _resolve_in_namespace(layout.root, s, i, r)  # type: ignore[arg-type]
    if path.is_file() and is_pack(path):        # a pack file: the namespace it holds, read in place
        return _resolve_in_namespace(path, step, inner, rank)
    if path.is_file():
        if step is not None:
            raise CliError(f"{path} is a payload file: STEP and INNER go with a namespace, not a file")
        found = _enclosing_namespace(path)
        if found is None:
            return Target(path)
        layout, s, i, r = found
        return Target(path, layout, s, i, r, open_store(layout))
    if not path.is_dir():
        raise CliError(f"{path} does not exist" if not path.exists() else f"{path} is not a file or directory")
    if step is None and parse_step_name(path.name) is not None and parse_namespace_leaf(path.parent.name):
        step, path = parse_step_name(path.name), path.parent       # a step directory
    return _resolve_in_namespace(path, step, inner, rank)


def _resolve_in_namespace(path: Path, step: Optional[int], inner: Optional[int], rank: int) -> Target:
    if isinstance(path, UrlPath) and step is None and parse_step_name(path.name) is not None \
            and parse_namespace_leaf(path.parent.name):
        step, path = parse_step_name(path.name), path.parent       # a step URL
    layouts = namespaces_under(path)
    if not layouts:
        raise CliError(f"{path}: no skip_harness namespace here (give a namespace, a step directory or a payload file)")
    if len(layouts) > 1:
        names = ", ".join(str(lay.root) for lay in layouts[:3]) + (" ..." if len(layouts) > 3 else "")
        raise CliError(f"{path} holds {len(layouts)} namespaces ({names}); name one of them")
    layout = layouts[0]
    store = open_store(layout)
    report = scan_namespace(layout, store.namespace)
    if step is None:
        servable = [s.step for s in report.steps if s.servable]
        if not servable:
            raise CliError(f"{layout.root}: no complete step to show", EXIT_CORRUPT)
        step = servable[-1]
    elif report.get(step) is None:
        have = [s.step for s in report.steps]
        raise CliError(f"{layout.root}: no step {step} (steps: {_ranges(have) or 'none'})")
    inner = 0 if inner is None else inner
    if not 0 <= inner < layout.K:
        raise CliError(f"INNER {inner} is outside 0..{layout.K - 1} (K={layout.K} in {layout.root})")
    if not 0 <= rank < layout.W:
        raise CliError(f"--rank {rank} is outside 0..{layout.W - 1} (W={layout.W} in {layout.root})")
    return Target(layout.step_dir(step) / payload_rel_at(layout, step, inner, rank, store.namespace), layout, step, inner,
                  rank, store)


def _ranges(steps: List[int]) -> str:
    out: List[str] = []
    run: List[int] = []
    for s in sorted(steps):
        if run and s == run[-1] + 1:
            run.append(s)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


# --------------------------------------------------------------------------------------------
# the command


def _payload_size(target: Target, record) -> Optional[int]:
    """The payload's stored size, through the store: as the commit record lists it, else as the namespace's
    listing of the step has it (a step without a commit record); a loose file's, from the file."""
    if target.store is None or target.layout is None or target.step is None:
        return payload_file_size(target.payload)
    rel = str(target.payload.relative_to(target.layout.step_dir(target.step)))
    sizes = {e.rel: e.bytes for e in record.files} if record is not None else {}
    if rel in sizes:
        return sizes[rel]
    try:
        listing = target.store.namespace.list_step(target.step)
    except (OSError, SkipHarnessError):
        return None
    found = listing.files.get(rel) if listing is not None else None
    return found.size if found is not None else None


def _header(target: Target, meta: Dict[str, Any], status: Optional[StepReport],
            record) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    t.add_row("file", escape(str(target.payload)))
    size = _payload_size(target, record)
    if size is not None:
        t.add_row("size", human_bytes(size))
    if target.layout is not None:
        t.add_row("namespace", f"{target.layout.root}  (K={target.layout.K} W={target.layout.W})")
        t.add_row("step", f"{target.step}   inner index {target.inner}   rank {target.rank}")
    if status is not None:
        t.add_row("status", escape(status.status + (f" ({status.reason})" if status.reason else "")))
    gen_s = meta.get("gen_s")
    if isinstance(gen_s, (int, float)):
        t.add_row("generation", f"{gen_s:.3f}s (this mini-batch)")
    created = meta.get("created") or (record.created if record is not None else None)
    if isinstance(created, (int, float)):
        t.add_row("written", fmt_time(created, time.time()))
    fp = record.fingerprint if record is not None else None
    if fp is not None:
        values = ", ".join(f"{k}={v!r}" for k, v in fp.values.items())
        t.add_row("fingerprint", escape(f"{fp.digest}  {values}"))
    elif target.layout is not None:
        t.add_row("fingerprint", "none recorded")
    return t


def cmd_show(path: Path, step: Optional[int], inner: Optional[int], rank: int, head: int, as_json: bool) -> int:
    target = resolve(path, step, inner, rank)
    meta: Dict[str, Any] = {}
    status = record = None
    if target.layout is not None and target.store is not None:
        reader = target.store.reader
        status = classify_step(target.layout, target.step, namespace=target.store.namespace)
        try:
            meta = reader.read_meta(target.step, target.inner, target.rank)
        except CorruptStepError:
            meta = {}
        try:
            record = reader.read_commit(target.step)
        except CorruptStepError:
            record = None
    else:
        meta = payload_file_meta(target.payload)
    try:
        if target.store is not None:          # a cache file: the verified read a hit uses
            payload = target.store.reader.read_inner(target.step, target.inner, target.rank)
        else:                                 # a file named on its own, outside any namespace
            payload = load_payload_file(target.payload)
    except (CodecError, CorruptStepError, OSError) as exc:
        reason = _plain_reason(str(exc))
        if "global_steps" in meta and "writer" not in meta:
            reason += f" ({VERL_HINT})"
        raise CliError(f"{reason}", EXIT_CORRUPT) from None
    rows = list(describe(payload))
    packed = target.layout is not None and target.layout.packed
    stored = [] if isinstance(target.payload, UrlPath) or packed else payload_file_fields(target.payload)
    if as_json:
        doc = {"file": str(target.payload), "namespace": None if target.layout is None else str(target.layout.root),
               "step": target.step, "inner_index": target.inner, "rank": target.rank,
               "status": None if status is None else status.status,
               "fingerprint": None if record is None or record.fingerprint is None else record.fingerprint.to_json(),
               "meta": meta, "structure": [dict(zip(("key", "type", "shape", "dtype", "bytes", "value"), r))
                                           for r in rows],
               "stored": [dict(vars(f), ratio=_ratio(f)) for f in stored]}
        if packed:
            doc["pack"] = pack_doc(target.layout)
        if head:
            doc["head"] = dict(head_values(payload, head))
        sys_out = json.dumps(doc, indent=1, default=str)
        stdout_console().out(sys_out, highlight=False)
        return EXIT_OK
    console = stdout_console()
    console.print(_header(target, meta, status, record))
    for line in pack_lines(target.layout) if packed else []:   # when it was packed, when and why blessed
        console.print(escape(line), highlight=False)
    t = Table(title="structure", title_justify="left")
    for col, justify in (("key", "left"), ("type", "left"), ("shape", "left"), ("dtype", "left"),
                         ("bytes", "right"), ("value", "left")):
        t.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]  # rich wants a Literal
    for r in rows[:_MAX_ROWS]:
        t.add_row(escape(r[0]), escape(r[1]), r[2], r[3], human_bytes(r[4]) if r[4] else "", escape(r[5]))
    if len(rows) > _MAX_ROWS:
        t.add_row(f"... {len(rows) - _MAX_ROWS} more", "", "", "", "", "")
    console.print(t)
    if stored:
        console.print(_stored_table(stored))
    if meta:
        console.print("meta", style="bold")
        console.out(_meta_text(meta), highlight=False)
    if head:
        h = Table(title=f"first {head} entries", title_justify="left")
        h.add_column("key")
        h.add_column("values", overflow="fold")
        for k, v in head_values(payload, head):
            h.add_row(escape(k), escape(v))
        console.print(h)
    return EXIT_OK
