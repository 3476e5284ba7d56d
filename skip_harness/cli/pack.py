"""`skip-harness pack NAMESPACE [--steps A-B] -o FILE` and `skip-harness unpack FILE DUMP_DIR`; what `ls` and
`show` say of a pack (when it was packed, when and why it was blessed)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from skip_harness.store.api import Layout, PackError, PackInfo, read_pack_info, unpack, write_pack

from skip_harness.cli._common import EXIT_OK, CliError, emit_json, human_bytes, logger, stdout_console


def parse_steps(text: Optional[str]) -> Optional[List[int]]:
    """`--steps`: `A-B`, `A-`, `-B`, `N`, or several joined by commas; None for every step."""
    if text is None:
        return None
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            if not dash:
                out.append(int(part))
                continue
            a = int(lo) if lo else 0
            b = int(hi) if hi else 1 << 62
        except ValueError:
            raise CliError(f"--steps: {part!r} is not a step or a range A-B (1-5, 3, 10-)") from None
        if a > b:
            raise CliError(f"--steps: {part!r} is an empty range")
        out.extend(range(a, min(b, a + 10_000_000) + 1))
    return out


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def _steps_text(steps: Any) -> str:
    steps = sorted(int(s) for s in steps)
    if not steps:
        return "no steps"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    return "steps " + ",".join(map(str, steps))


def blessing_text(entry: Dict[str, Any]) -> str:
    """`blessed 2026-12-04 22:10:03 (steps 1-3): lr x 1.01 [optim.lr: 0.001 -> 0.00101]`."""
    changes = entry.get("config_changes") or []
    shown = "; ".join(f"{c.get('key')}: {c.get('recorded')!r} -> {c.get('now')!r}" for c in changes[:4]
                      if isinstance(c, dict))
    more = f" (+{len(changes) - 4} more)" if len(changes) > 4 else ""
    what = f" [{shown}{more}]" if shown else ""
    return f"blessed {_when(entry.get('when'))} ({_steps_text(entry.get('steps') or [])}): {entry.get('reason') or ''}{what}"


def pack_lines(layout: Layout) -> List[str]:
    """What `ls` and `show` print under a pack: what it holds, when it was packed, each blessing."""
    if not layout.packed:
        return []
    try:
        info = read_pack_info(layout.root)
    except PackError as exc:
        return [f"{layout.root}: {exc.reason}"]
    lines = [f"{layout.root}: a pack of {info.namespace} ({_steps_text(info.steps)}, "
             f"{human_bytes(info.file_bytes)}), packed {_when(info.packed)}"]
    lines += [f"  {blessing_text(b)}" for b in info.blessed]
    if not info.blessed:
        lines.append("  never blessed: its values are the recording's")
    return lines


def pack_doc(layout: Layout) -> Optional[Dict[str, Any]]:
    """The `pack` member of a namespace's JSON (`ls --json`, `show --json`) when it is a pack."""
    if not layout.packed:
        return None
    try:
        info = read_pack_info(layout.root)
    except PackError as exc:
        return {"error": exc.reason}
    return _info_json(info)


def _info_json(info: PackInfo) -> Dict[str, Any]:
    return {"path": str(info.path), "namespace": info.namespace, "K": info.K, "W": info.W, "steps": list(info.steps),
            "bytes": info.bytes, "file_bytes": info.file_bytes, "overhead_bytes": info.overhead,
            "members": info.members, "packed": info.packed, "fingerprint": info.fingerprint,
            "blessed": list(info.blessed), "version": info.version}


def cmd_pack(namespace: Any, out: Path, steps: Optional[str], as_json: bool) -> int:
    wanted = parse_steps(steps)
    info = write_pack(namespace, out, wanted)
    if as_json:
        emit_json(_info_json(info))
        return EXIT_OK
    stdout_console().print(
        f"packed {info.namespace} ({_steps_text(info.steps)}) into {out}: {human_bytes(info.file_bytes)} "
        f"({info.file_bytes} bytes) for {info.bytes} bytes of the namespace "
        f"(+{info.overhead} bytes: the manifest and the ZIP headers of {info.members} members)", highlight=False)
    return EXIT_OK


def cmd_unpack(pack: Path, dump_dir: Any, as_json: bool) -> int:
    if not pack.is_file():
        raise CliError(f"FILE {pack} {'does not exist' if not pack.exists() else 'is not a file'}")
    info = read_pack_info(pack)
    root = unpack(pack, dump_dir)
    if as_json:
        emit_json({"pack": str(pack), "namespace": str(root), "steps": list(info.steps)})
        return EXIT_OK
    stdout_console().print(f"unpacked {pack}: {_steps_text(info.steps)} of {info.namespace} restored and verified "
                           f"at {root}", highlight=False)
    for b in info.blessed:
        logger.info("%s", blessing_text(b))
    return EXIT_OK


__all__ = ["blessing_text", "cmd_pack", "cmd_unpack", "pack_doc", "pack_lines", "parse_steps"]
