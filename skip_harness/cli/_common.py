"""What every `skip-harness` command shares: exit codes, consoles, progress, paths, step facts."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from skip_harness.store import scan as _scan
from skip_harness.errors import CorruptStepError
from skip_harness.store.layout import Layout
from skip_harness.store.reader import StepReader

from skip_harness.units import human_bytes

logger = logging.getLogger("skip_harness.cli")

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 3
SORT_KEYS = ("name", "size", "written", "accessed")   # `skip-harness ls --sort`
_PLAIN_WIDTH = 200   # columns for tables when stdout is not a terminal (a pipe, a file, a test)


class CliError(Exception):
    """A one-line message for the user and the exit status it stops with."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        self.code = code
        super().__init__(message)


class _PlainConsole(Console):
    """A console for a pipe or a file: no colour, and no trailing blanks on the lines of a table."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        with self.capture() as captured:
            super().print(*objects, **kwargs)
        self.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))
        self.file.flush()


def stdout_console() -> Console:
    """The console a command writes its output to (stdout). Wide and colourless when not a terminal,
    so that piped output is whole lines."""
    if sys.stdout.isatty():
        return Console(file=sys.stdout, highlight=False)
    width = int(os.environ.get("COLUMNS", "0") or 0) or _PLAIN_WIDTH
    return _PlainConsole(file=sys.stdout, width=max(width, 80), no_color=True, highlight=False, soft_wrap=False,
                         color_system=None)


class Progress_:
    """A progress bar on stderr when it is a terminal; plain log lines (start and end) otherwise."""

    def __init__(self, progress: Optional[Progress]):
        self._progress = progress
        self._task: Any = None
        self._what = ""
        self._t0 = 0.0

    def start(self, what: str, total: int) -> None:
        self._what, self._t0 = what, time.monotonic()
        if self._progress is not None:
            self._task = self._progress.add_task(what, total=total)
        else:
            logger.info("%s: %d step%s", what, total, "" if total == 1 else "s")

    def advance(self, n: int = 1) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)

    def finish(self, note: str = "") -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self._progress.tasks[-1].total)
        elif self._what:
            logger.info("%s: done in %.1fs%s", self._what, time.monotonic() - self._t0, f" ({note})" if note else "")


@contextmanager
def progress() -> Iterator[Progress_]:
    if not sys.stderr.isatty():
        yield Progress_(None)
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(file=sys.stderr), transient=True)
    with bar:
        yield Progress_(bar)


def namespaces_under(path: Path) -> List[Layout]:
    """Namespaces at `path`: the path itself if it is a namespace, those in it if it is an
    `{experiment}_{project}` directory, else those two levels down (a dump dir)."""
    return _scan.namespaces_at(path)

def require_dir(path: Path, flag: str = "") -> Path:
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise CliError(f"{flag + ' ' if flag else ''}{path} {what}")
    return path


def short_path(layout: Layout, base: Path) -> str:
    """The namespace relative to the directory the user named (the whole path if it is that one)."""
    try:
        rel = layout.root.relative_to(base)
    except ValueError:
        return str(layout.root)
    return str(rel) if str(rel) != "." else str(layout.root)


# --------------------------------------------------------------------------------------------
# facts about a step, read cheaply (the commit record and the small meta files)


def step_written(reader: StepReader, report: _scan.StepReport) -> Optional[float]:
    """When the step was written: its commit record's time, else the newest mtime of its directory."""
    created = getattr(report, "created", None)
    if created:
        return float(created)
    if report.has_commit and report.status == "complete":
        try:
            record = reader.read_commit(report.step)
        except (CorruptStepError, OSError):
            record = None
        if record is not None and record.created:
            return record.created
    return reader.backend.modified(str(report.step)) if report.exists else None


def step_accessed(reader: StepReader, report: _scan.StepReport) -> Optional[float]:
    """When the step was last read: the newest access time of its payload files (a hit reads them; `ls`
    and the startup scan never do; `verify` and `clean` do), where the storage records reads (see
    `NamespaceBackend.last_read`). None when no payload was read since it was written."""
    if not report.exists:
        return None
    return reader.backend.last_read(report.step, [prel for _i, _r, prel, _m in reader.layout.expected_rels()])

def default_dump_dir() -> Tuple[Any, str]:
    """Where runs write when nothing names another place, and how that was decided (for the user)."""
    from skip_harness.config import DUMP_DIR_ENV, RolloutTQConfig

    path = RolloutTQConfig().resolved_dump_dir()
    if os.environ.get(DUMP_DIR_ENV):
        return path, f"${DUMP_DIR_ENV}"
    return path, f"the per-user default; ${DUMP_DIR_ENV} is not set"


def step_metas(reader: StepReader, step: int) -> List[Dict[str, Any]]:
    """Every meta.json of a step that can be read (K x W small JSON files); unreadable ones left out."""
    out = []
    for i, r, _p, _m in reader.layout.expected_rels():
        try:
            out.append(reader.read_meta(step, i, r))
        except (CorruptStepError, OSError, Exception):  # a missing/odd meta only costs the number
            continue
    return out


def step_gen_s(reader: StepReader, report: _scan.StepReport) -> Optional[float]:
    """Generation seconds the step's metas record (what a rerun saves by serving it)."""
    known = getattr(report, "gen_s", None)
    if known is not None:
        return float(known)
    if not report.servable:
        return None
    total, seen = 0.0, False
    for meta in step_metas(reader, report.step):
        value = meta.get("gen_s")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total += float(value)
            seen = True
    return total if seen else None


_MODE_KEYS = ("trainer.v1.trainer_mode", "trainer_mode", "mode")
_SEED_KEYS = ("seed", "args.seed", "trainer.seed")


def fingerprint_value(values: Dict[str, Any], candidates: Sequence[str]) -> Any:
    for key in candidates:
        if key in values:
            return values[key]
    last = candidates[0].split(".")[-1]
    for key, value in values.items():
        if key.split(".")[-1] == last:
            return value
    return None


MIXED = "mixed"


def mode_and_seed(steps: Sequence[_scan.StepReport]) -> Tuple[Any, Any]:
    """(mode, seed) from the fingerprints of the given steps: None when none says, MIXED when they differ."""
    modes, seeds = set(), set()
    for s in steps:
        if s.fingerprint is None:
            continue
        modes.add(json.dumps(fingerprint_value(dict(s.fingerprint.values), _MODE_KEYS)))
        seeds.add(json.dumps(fingerprint_value(dict(s.fingerprint.values), _SEED_KEYS)))

    def one(found: set) -> Any:
        if len(found) > 1:
            return MIXED
        return json.loads(next(iter(found))) if found else None

    return one(modes), one(seeds)


def fmt_value(value: Any) -> str:
    return "-" if value is None else str(value)


def fmt_time(ts: Optional[float], now: Optional[float] = None) -> str:
    """'2026-12-01 09:30 (5m ago)' in local time."""
    if ts is None:
        return "-"
    now = time.time() if now is None else now
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(ts))} ({fmt_age(now - ts)} ago)"


def fmt_ago(ts: Optional[float], now: Optional[float] = None) -> str:
    """'5m ago' (the day too once it is more than a day old)."""
    if ts is None:
        return "-"
    now = time.time() if now is None else now
    if now - ts > 86400:
        return f"{time.strftime('%Y-%m-%d', time.localtime(ts))} ({fmt_age(now - ts)} ago)"
    return f"{fmt_age(now - ts)} ago"


def fmt_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}" if seconds >= 10 * size else f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def fmt_seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}s"


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")


__all__ = ["CliError", "EXIT_OK", "EXIT_CORRUPT", "EXIT_USAGE", "EXIT_LOCKED", "human_bytes", "logger",
           "namespaces_under", "progress", "stdout_console"]
