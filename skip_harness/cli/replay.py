"""`skip-harness replay PACK [--bless] [--json] -- COMMAND [ARGS...]`: a recording as a test.

COMMAND is any trainer built on skip_harness (the demo, a TRL script, verl's `main_ppo` with the plug-in).
It runs with

    $SKIP_HARNESS_REPLAY_FROM    = PACK: every step served from the recording (skip.rollout_tq.replay_from)
    $SKIP_HARNESS_REPLAY_CHECK   = error (warn with --bless): the replay check (skip.rollout_tq.replay_check)
    $SKIP_HARNESS_REPLAY_REPORT  = a temporary directory: each harness of the run writes its report there
                                   at close (run/verdict.py)
    $SKIP_HARNESS_DUMP_DIR       = a temporary cache root, for anything the run writes of its own

and the reports make the verdict (`judge`): 0 every step served from PACK and reproduced; 1 a divergence
(its step and key, recorded and now, and the training-side change that explains it, if one does); 2 the
run could not run, reported nothing, generated a step (named), or served steps with nothing recorded to
compare them with -- never a silent pass. `--bless` runs it through (the check warns instead of stopping)
and writes the run's values into PACK as its expected values, with the training-side change that made
them (cli/bless.py). The pytest plugin (skip_harness/testing/pytest_plugin.py) calls `replay` too.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from skip_harness.cli._output import EXIT_OK, EXIT_USAGE, CliError, emit_json, stdout_console
from skip_harness.config import DUMP_DIR_ENV, REPLAY_CHECK_ENV, REPLAY_FROM_ENV
from skip_harness.run.verdict import REPLAY_REPORT_ENV, REPORT_FORMAT

EXIT_DIVERGED = 1


@dataclass(frozen=True)
class RecordingPath:
    """What PACK names: a pack file, or one namespace directory."""

    path: Path
    kind: str          # "pack" or "namespace"


@dataclass
class ReplayVerdict:
    """The outcome of one replay: its exit status, the line that says it, and the runs' reports."""

    code: int
    line: str
    recording: Optional[RecordingPath] = None
    command: List[str] = field(default_factory=list)
    returncode: Optional[int] = None
    reports: List[Dict[str, Any]] = field(default_factory=list)
    blessed: Optional[str] = None       # the reason written with the blessed values

    def as_json(self) -> Dict[str, Any]:
        return {"exit": self.code, "verdict": self.line, "pack": None if self.recording is None else str(self.recording.path),
                "kind": None if self.recording is None else self.recording.kind, "command": self.command,
                "returncode": self.returncode, "blessed": self.blessed, "runs": self.reports}


def recording_at(text: Union[str, os.PathLike]) -> RecordingPath:
    """The recording PACK names, checked before anything runs: a pack file, a namespace directory, or a
    directory holding exactly one namespace (that one). CliError (exit 2) naming PACK otherwise."""
    from skip_harness.store.api import namespaces_at

    path = Path(text).expanduser().absolute()
    if not path.exists():
        raise CliError(f"PACK: {path} does not exist")
    if path.is_file():
        if _is_pack(path):
            return RecordingPath(path, "pack")
        raise CliError(f"PACK: {path} is not a skip_harness pack (`skip-harness pack` writes one) nor a namespace directory")
    found = namespaces_at(path)
    if not found:
        raise CliError(f"PACK: {path} holds no skip_harness namespace")
    if len(found) > 1:
        names = ", ".join(str(layout.root.relative_to(path)) for layout in found[:4])
        raise CliError(f"PACK: {path} holds {len(found)} namespaces ({names}{', ...' if len(found) > 4 else ''}); name one")
    return RecordingPath(Path(found[0].root), "namespace")


def _is_pack(path: Path) -> bool:
    from skip_harness.store.api import is_pack

    return bool(is_pack(path))


def command_of(command: Union[str, Sequence[str]]) -> List[str]:
    """COMMAND as an argument list (a string is split as a shell would, without running one)."""
    args = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise CliError("no COMMAND to run: skip-harness replay PACK -- COMMAND [ARGS...]")
    return args


def replay(pack: Union[str, os.PathLike], command: Union[str, Sequence[str]], *, bless: bool = False,
           env: Optional[Mapping[str, str]] = None, cwd: Union[str, os.PathLike, None] = None,
           output_to_stderr: bool = False) -> ReplayVerdict:
    """Run `command` serving every step from `pack`, and judge it (module doc). CliError for a PACK or
    COMMAND that cannot be used. `output_to_stderr`: the command's standard output goes to this process's
    standard error (so `--json` prints one document on stdout, nothing of the trainer's)."""
    recording = recording_at(pack)
    args = command_of(command)
    scratch = Path(tempfile.mkdtemp(prefix="skip-harness-replay-"))
    try:
        reports_dir = scratch / "reports"
        run_env = {**os.environ, **(env or {}),
                   REPLAY_FROM_ENV: str(recording.path), REPLAY_CHECK_ENV: "warn" if bless else "error",
                   REPLAY_REPORT_ENV: str(reports_dir), DUMP_DIR_ENV: str(scratch / "cache")}
        try:
            returncode = subprocess.run(args, env=run_env, cwd=cwd, check=False,
                                        stdout=sys.stderr.fileno() if output_to_stderr else None).returncode
        except OSError as exc:
            return ReplayVerdict(EXIT_USAGE, f"could not run {shlex.join(args)}: {exc.strerror or exc}", recording, args)
        reports = read_reports(reports_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    verdict = judge(recording, args, returncode, reports, bless=bless)
    if bless and verdict.code in (EXIT_OK, EXIT_DIVERGED):    # a divergence is what --bless accepts
        from skip_harness.cli.bless import bless_recording

        verdict = bless_recording(verdict)
    return verdict


def read_reports(directory: Path) -> List[Dict[str, Any]]:
    """The reports the run's harnesses wrote (run/verdict.py), in run-id order; unreadable ones skipped."""
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("format") == REPORT_FORMAT:
            out.append(doc)
    return out


def _steps_text(steps: Sequence[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:8]) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
    return f"step{'s' if len(steps) > 1 else ''} {shown}"


def _same_place(a: Any, b: Path) -> bool:
    return a is not None and os.path.realpath(str(a)) == os.path.realpath(str(b))


def judge(recording: RecordingPath, args: List[str], returncode: int, reports: List[Dict[str, Any]], *,
          bless: bool = False) -> ReplayVerdict:
    """The verdict of a replay's reports: exit 0, 1 or 2 and the line that says why (module doc)."""
    verdict = ReplayVerdict(EXIT_USAGE, "", recording, args, returncode, reports)
    name = shlex.join(args[:2]) if len(args) > 1 else args[0]

    def fail(code: int, line: str) -> ReplayVerdict:
        verdict.code, verdict.line = code, line
        return verdict

    if not reports and returncode != 0:
        return fail(EXIT_USAGE, f"{name} exited {returncode} before any skip_harness run reported a replay "
                                "(its own output above says why)")
    if not reports:
        return fail(EXIT_USAGE, f"{name} ran, but no skip_harness run reported a replay (is it a trainer built on "
                                "skip_harness, with caching on: skip.rollout_tq.enable?)")
    for doc in reports:
        if not _same_place(doc.get("replay_from"), recording.path):
            return fail(EXIT_USAGE, f"the run replayed from skip.rollout_tq.replay_from={doc.get('replay_from')}, not "
                                    f"PACK (a value its config sets wins over ${REPLAY_FROM_ENV}): nothing was tested")
        if doc.get("replay_check") == "off":
            return fail(EXIT_USAGE, "the run's skip.rollout_tq.replay_check is off (its config sets it, which wins over "
                                    f"${REPLAY_CHECK_ENV}): its values were not compared")
    generated = sorted({g["step"] for doc in reports for g in doc.get("generated", [])})
    why = next((g.get("why", "") for doc in reports for g in doc.get("generated", [])), "")
    gen_line = (f"{_steps_text(generated)} {'was' if len(generated) == 1 else 'were'} generated, not served from "
                f"{recording.path.name} ({why}): a replay that generates a step does not test it") if generated else ""
    divergence = next((doc["divergence"] for doc in reports if doc.get("divergence")), None)
    if divergence is not None:
        line = divergence.get("line") or f"replay diverged at step {divergence['step']}: {divergence['key']}"
        return fail(EXIT_DIVERGED, f"{line}{'; ' + gen_line if gen_line else ''}")
    if generated:
        return fail(EXIT_USAGE, gen_line)
    served = sum((doc.get("replay") or {}).get("served", 0) for doc in reports)
    unchecked = sum((doc.get("replay") or {}).get("unchecked", 0) for doc in reports)
    if served == 0:
        return fail(EXIT_USAGE, f"{name} served no step from {recording.path}")
    if unchecked:
        return fail(EXIT_USAGE, f"{unchecked} of {served} served steps have no recorded values in {recording.path.name}: "
                                "nothing to compare them with")
    lines = "; ".join((doc.get("replay") or {}).get("line", "") for doc in reports)
    if returncode != 0:
        return fail(EXIT_USAGE, f"{lines}; but {name} exited {returncode}")
    return fail(EXIT_OK, lines)


def cmd_replay(pack: str, command: Sequence[str], bless: bool, as_json: bool) -> int:
    """The command line's `replay`: run, print the verdict (or the JSON document), return its exit status."""
    verdict = replay(pack, command, bless=bless, output_to_stderr=as_json)
    if as_json:
        emit_json(verdict.as_json())
        return verdict.code
    console = stdout_console()
    where = verdict.recording.path if verdict.recording is not None else pack
    console.print(f"skip-harness replay {where}: {verdict.line}", markup=False, soft_wrap=True)
    if verdict.code == EXIT_DIVERGED:
        console.print(f"accept it as the recording's expected values: skip-harness replay {where} --bless -- "
                      f"{shlex.join(verdict.command)}", markup=False, soft_wrap=True)
    return verdict.code


__all__ = ["EXIT_DIVERGED", "RecordingPath", "ReplayVerdict", "cmd_replay", "command_of", "judge", "read_reports",
           "recording_at", "replay"]
