"""A Hydra app's run directory and command line, before the job (scripts/train.py and the startup callback).

- :func:`run_id`: the run (or sweep) directory's name, `{process start time}_pid{pid}`: two launches in the
  same second never share one (the start time alone has one-second resolution). Under torchrun /
  accelerate every rank of one launch composes its own config, so there it is named after the launcher
  process the ranks share (their parent): `{its start time}_launch{its pid}`, the same on every rank.
- :func:`claim_run_dir`: the run directory is this launch's while it runs (`.run.lock` in it: an flock and
  a record of who holds it). Another live launch holding it stops this one with :class:`RunDirTakenError`
  before anything is written there (two runs writing one `metrics.jsonl` and `train.log` corrupt both);
  a directory an earlier, finished run used (a fixed `hydra.run.dir`) is reused, as Hydra does, with a
  warning naming it.
- :func:`refuse_unknown_overrides`: `key=value` for a key the config's schema does not have is refused with
  the message the `+key=value` form gets (`did you mean ...?`), instead of Hydra's advice to append it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from skip_harness.config import check_known_keys
from skip_harness.errors import SkipHarnessError

log = logging.getLogger("skip_harness")

CLAIM_FILE = ".run.lock"
_STAMP = "%Y-%m-%d_%H-%M-%S"
_CLAIMS: Dict[str, int] = {}     # run directory -> the claim's file descriptor, open (and locked) for the process's life
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class RunDirTakenError(SkipHarnessError):
    """Another live launch holds the run directory (two runs would write the same files)."""


def _launcher() -> Any:
    """The process that names this launch: the torchrun / accelerate launcher (every rank's parent), else
    this process."""
    import psutil

    return psutil.Process(os.getppid() if "LOCAL_RANK" in os.environ else os.getpid())


def run_id() -> str:
    """The run directory's name: unique per launch, identical on every rank of one torchrun / accelerate
    launch: when the launch started (its launcher process, else this one) and its pid."""
    launcher = _launcher()
    kind = "launch" if "LOCAL_RANK" in os.environ else "pid"
    return f"{datetime.fromtimestamp(launcher.create_time()).strftime(_STAMP)}_{kind}{launcher.pid}"


def launch_id() -> str:
    """What every rank of one launch shares and no other launch has: host, launcher pid and start time."""
    launcher = _launcher()
    return f"{socket.gethostname()}:{launcher.pid}:{launcher.create_time():.3f}"


def _read(fd: int) -> Optional[dict]:
    try:
        doc = json.loads(os.pread(fd, 65536, 0) or b"null")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _who(doc: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc.get("since", 0) or 0)))
    return f"pid {doc.get('pid')} on host {doc.get('host')} since {when}"


def claim_run_dir(path: Path, wait: float = 10.0, key: str = "hydra.run.dir") -> None:
    """Hold `path` (a run or sweep directory, created if needed; `key`: the setting that names it) for this
    launch until the process exits. RunDirTakenError when another live launch holds it; a WARNING when an
    earlier run used it."""
    import fcntl

    if str(path) in _CLAIMS:
        return
    path.mkdir(parents=True, exist_ok=True)
    me = {"launch": launch_id(), "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    fd = os.open(path / CLAIM_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                other = _read(fd)
                if other is not None and other.get("launch") == me["launch"]:
                    _CLAIMS[str(path)] = fd        # another rank of this launch holds it: ours too
                    return
                if other is not None or time.monotonic() > deadline:
                    raise RunDirTakenError(
                        f"run directory {path} is in use by another run "
                        f"({_who(other) if other else 'its holder did not say who'}): two runs writing one "
                        "directory would corrupt each other's metrics.jsonl and train.log; nothing was "
                        f"written there. Set another {key}, or wait for it to end") from None
                time.sleep(0.05)                    # its holder has not written its record yet
        earlier = _read(fd)
        others = sorted(p.name for p in path.iterdir() if p.name != CLAIM_FILE)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    _CLAIMS[str(path)] = fd
    if others:
        by = f" by {_who(earlier)}" if earlier and earlier.get("launch") != me["launch"] else ""
        log.warning("run directory %s was used before%s (it holds %s): this run writes its files there too "
                    "(metrics.jsonl is replaced, train.log appended to); set %s for a directory of its own",
                    path, by, ", ".join(others[:6]) + (", ..." if len(others) > 6 else ""), key)


def refuse_unknown_overrides(schema: type, args: Sequence[str]) -> None:
    """ConfigError for the first plain `a.b.c=value` override in `args` (a Hydra command line) whose dotted key
    `schema` does not have: the same message as the `+` form gets from the config check
    (`skip.rollout_tq.actoin: unknown key (not in `skip.rollout_tq`); did you mean `action`?`). Anything
    else (config group choices, `hydra.*`, `+`/`++`/`~` overrides, what does not parse) is left to Hydra."""
    try:
        from hydra._internal.utils import get_args_parser
        from hydra.core.override_parser.overrides_parser import OverridesParser

        overrides = get_args_parser().parse_known_args(list(args))[0].overrides or []
        parsed = OverridesParser.create().parse_overrides(overrides)
    except (Exception, SystemExit):  # noqa: BLE001 - Hydra reports what it cannot parse
        return
    sections = {f.name for f in dataclasses.fields(schema)}
    for override in parsed:
        key = override.key_or_group
        if override.is_add() or override.is_force_add() or override.is_delete() or override.package is not None:
            continue
        if not _DOTTED.fullmatch(key) or key.split(".", 1)[0] == "hydra" or ("." not in key and key not in sections):
            continue   # `name=choice` with no dot may be a config group's choice (trainer_mode=sync)
        nested: Dict[str, Any] = {}
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = None
        check_known_keys(schema, nested)
