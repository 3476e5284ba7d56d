"""What every `skip-harness` command prints with: exit codes, the error it stops with, consoles, progress,
JSON and the formatting of sizes, times and values."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn



logger = logging.getLogger("skip_harness.cli")

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 3
SORT_KEYS = ("name", "size", "written", "accessed")   # `skip-harness ls --sort`
_PLAIN_WIDTH = 200   # columns for tables when stdout is not a terminal (a pipe, a file, a test)


class CliError(Exception):
    """A one-line message for the user and the exit status it stops with."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        self.code = code
        super().__init__(message)


def about(place: object, exc: BaseException) -> str:
    """`exc`'s message about `place`, led by the place unless the message names it already (the store names
    a place it cannot open or reach itself, under the dump_dir's key: issue 21)."""
    why = str(exc)
    return why if f"{place}: " in why else f"{place}: {why}"


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
