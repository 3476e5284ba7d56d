"""`skip-harness ls | verify | clean DUMP_DIR`: look at and tidy a cache from the command line.

Exit codes: 0 fine; 1 a corrupt step (verify) or a failed removal (clean); 2 bad usage or DUMP_DIR
not a directory; 3 a namespace was locked by a running job (clean; other namespaces still handled).
DUMP_DIR may be the cache root, one `{experiment}_{project}` directory, or one namespace directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from skip_harness import lock as _lock
from skip_harness.callbacks import human_bytes
from skip_harness import scan as _scan
from skip_harness.errors import LockHeldError
from skip_harness.layout import Layout, parse_namespace_leaf
from skip_harness.store import StepStore

logger = logging.getLogger("skip_harness.cli")

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 3


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _err(text: str) -> None:
    sys.stderr.write(f"skip-harness: {text}\n")


def namespaces_under(path: Path) -> List[Layout]:
    """Namespaces at `path`: the path itself if it is a namespace, those in it if it is an
    `{experiment}_{project}` directory, else those two levels down (a dump dir)."""
    kw = parse_namespace_leaf(path.name)
    if kw is not None:
        return [Layout(path, K=kw[0], W=kw[1])]
    direct = []
    for child in sorted(path.iterdir()):
        kw = parse_namespace_leaf(child.name)
        if kw is not None and child.is_dir() and not child.is_symlink():
            direct.append(Layout(child, K=kw[0], W=kw[1]))
    return direct + _scan.find_namespaces(path)


def _step_json(s: _scan.StepReport) -> Dict[str, Any]:
    return {"step": s.step, "status": s.status, "bytes": s.bytes, "reason": s.reason,
            "fingerprint": None if s.fingerprint is None else s.fingerprint.digest}


def _ns_json(layout: Layout, steps: Sequence[_scan.StepReport]) -> Dict[str, Any]:
    return {"path": str(layout.root), "K": layout.K, "W": layout.W, "steps": [_step_json(s) for s in steps]}


def _print_namespace(layout: Layout, steps: Sequence[_scan.StepReport]) -> None:
    counts = {k: 0 for k in _scan.STATUSES}
    for s in steps:
        counts[s.status] += 1
    total = sum(s.bytes for s in steps)
    summary = " ".join(f"{k}={v}" for k, v in counts.items())
    _out(f"{layout.root}  K={layout.K} W={layout.W}  {len(steps)} steps: {summary}  {human_bytes(total)}")
    for s in steps:
        line = f"  {s.step:>8}  {s.status:<10}  {human_bytes(s.bytes):>10}"
        if s.reason:
            line += f"  {s.reason}"
        _out(line.rstrip())


def cmd_ls(layouts: List[Layout], as_json: bool) -> int:
    docs = []
    for layout in layouts:
        report = _scan.scan_namespace(layout)
        if as_json:
            docs.append(_ns_json(layout, report.steps))
        else:
            _print_namespace(layout, report.steps)
    if as_json:
        _out(json.dumps({"namespaces": docs}, indent=1))
    return EXIT_OK


def cmd_verify(layouts: List[Layout], as_json: bool) -> int:
    docs = []
    any_corrupt = False
    for layout in layouts:
        report = _scan.scan_namespace(layout)
        store = StepStore(layout)
        steps: List[_scan.StepReport] = []
        for s in report.steps:
            if s.status == "complete":  # the scan classified it: only the checksums are left to read
                reason = store.verify_checksums(s.step)
                if reason is not None:
                    s = dataclasses.replace(s, status="corrupt", reason=reason)
            steps.append(s)
            any_corrupt |= s.status == "corrupt"
        if as_json:
            docs.append(_ns_json(layout, steps))
        else:
            _print_namespace(layout, steps)
    if as_json:
        _out(json.dumps({"namespaces": docs}, indent=1))
    elif any_corrupt:
        _out("corrupt steps found (run `skip-harness clean` to remove them)")
    return EXIT_CORRUPT if any_corrupt else EXIT_OK


def cmd_clean(layouts: List[Layout], dry_run: bool, quarantine: bool, as_json: bool) -> int:
    action = "quarantine" if quarantine else "delete"
    verb = "quarantine" if quarantine else "remove"
    code = EXIT_OK
    docs = []
    for layout in layouts:
        doc: Dict[str, Any] = {"path": str(layout.root), "K": layout.K, "W": layout.W, "action": action,
                               "dry_run": dry_run}
        docs.append(doc)
        ns_lock = None
        if dry_run:
            holder = _lock.probe(layout)   # touches nothing
            refused = None if holder is None else f"namespace {layout.root} is in use by {holder}"
        else:
            ns_lock = _lock.NamespaceLock(layout, timeout=0)
            try:
                ns_lock.acquire()
                refused = None
            except LockHeldError as exc:
                refused, ns_lock = str(exc), None
        if refused is not None:
            _err(f"refusing to clean: {refused}")
            doc["refused"] = refused
            code = EXIT_LOCKED
            continue
        try:
            plan = _scan.plan_cleanup(_scan.scan_namespace(layout), action)
            doc["steps"] = [{"step": i.step, "status": i.status, "bytes": i.bytes, "reason": i.reason}
                            for i in plan.items]
            doc["expected_freed_bytes"] = plan.expected_freed_bytes
            if not as_json:
                _out(f"{layout.root}  K={layout.K} W={layout.W}")
                for i in plan.items:
                    _out(f"  {i.step:>8}  {i.status:<10}  {human_bytes(i.bytes):>10}  {i.reason}")
                if plan.leftovers:
                    _out(f"  + {len(plan.leftovers)} leftover trash/temp entries, "
                         f"{human_bytes(sum(x.bytes for x in plan.leftovers))}")
            if dry_run:
                if not as_json:
                    _out(f"  would {verb} {len(plan.items)} steps, {plan.bytes} bytes ({human_bytes(plan.bytes)})")
                continue
            result = plan.execute()
            doc["freed_bytes"] = result.freed_bytes
            doc["moved_bytes"] = result.moved_bytes
            doc["errors"] = list(result.errors)
            if not as_json:
                if quarantine:
                    _out(f"  quarantined {len(result.items)} steps, {result.moved_bytes} bytes, "
                         f"under {layout.quarantine_dir}; freed {result.freed_bytes} bytes")
                else:
                    _out(f"  removed {len(result.items)} steps, freed {result.freed_bytes} bytes "
                         f"({human_bytes(result.freed_bytes)})")
            for e in result.errors:
                _err(e)
            if result.errors and code == EXIT_OK:
                code = EXIT_CORRUPT
        finally:
            if ns_lock is not None:
                ns_lock.release()
    if as_json:
        _out(json.dumps({"namespaces": docs}, indent=1))
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skip-harness", description="Inspect and tidy a skip_harness rollout cache.")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="namespaces, steps, status and sizes")
    ls.add_argument("dump_dir", metavar="DUMP_DIR")
    ls.add_argument("--json", action="store_true", help="print one JSON document")
    ve = sub.add_parser("verify", help="check every step against its commit record, checksums included")
    ve.add_argument("dump_dir", metavar="DUMP_DIR")
    ve.add_argument("--json", action="store_true", help="print one JSON document")
    cl = sub.add_parser("clean", help="remove (or quarantine) incomplete and corrupt steps")
    cl.add_argument("dump_dir", metavar="DUMP_DIR")
    cl.add_argument("--dry-run", action="store_true", help="show what would be done, change nothing")
    cl.add_argument("--quarantine", action="store_true", help="move steps under {namespace}/.quarantine/")
    cl.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="skip-harness: %(levelname)s: %(message)s")
    dump_dir = Path(args.dump_dir)
    if not dump_dir.is_dir():
        what = "does not exist" if not dump_dir.exists() else "is not a directory"
        _err(f"{dump_dir} {what}")
        return EXIT_USAGE
    try:
        layouts = namespaces_under(dump_dir)
        if not layouts and not args.json:
            _out(f"no skip_harness namespaces under {dump_dir}")
        if args.command == "ls":
            return cmd_ls(layouts, args.json)
        if args.command == "verify":
            return cmd_verify(layouts, args.json)
        return cmd_clean(layouts, args.dry_run, args.quarantine, args.json)
    except OSError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
