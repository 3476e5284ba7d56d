"""Where a step's files are, checked on the way through the namespace (`Namespace.stat`): step and inner
directories only when they are real directories (never a symlink), files only when they are regular
files, K = 1 steps found in either layout. Raises CorruptStepError naming the path, or HarnessUsageError
for a position outside the namespace's K and W. No logging."""
from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any, Tuple

from skip_harness.errors import CorruptStepError, HarnessUsageError
from skip_harness.store.layout import Layout
from skip_harness.store.namespace import Namespace
from skip_harness.store.storage import DIR, FILE, LINK, Entry

_NOT_A_DIRECTORY = {LINK: "is a symlink (never followed)", FILE: "is a regular file, not a directory"}
_NOT_A_FILE = {LINK: "is a symlink (never followed)", DIR: "is a directory"}


def check_step(step: Any) -> None:
    """Steps are ints >= 0 (the harness turns a trainer's integral step into an int first)."""
    if type(step) is not int or step < 0:
        raise HarnessUsageError(f"step must be an int >= 0, got {step!r}")




def check_position(layout: Layout, step: int, inner_index: int, rank: int) -> None:
    check_step(step)
    if not 0 <= inner_index < layout.K:
        raise HarnessUsageError(f"inner index {inner_index} is outside 0..{layout.K - 1} (K={layout.K})")
    if not 0 <= rank < layout.W:
        raise HarnessUsageError(f"rank {rank} is outside 0..{layout.W - 1} (W={layout.W})")

def _what(e: Entry, table: dict) -> str:
    return table.get(e.kind, "is not a regular file or directory")


def real_file(layout: Layout, step: int, rel: str, namespace: Namespace) -> Path:
    """The path of step/rel after checking that no component is a symlink and it is a regular file
    (one `stat` per component: a storage without directories has only the file to check)."""
    step_dir = layout.step_dir(step)
    path = step_dir
    parts = PurePosixPath(rel).parts
    key = str(int(step))
    if namespace.caps.directories:
        e = namespace.stat(key)
        if e is None:
            raise CorruptStepError(path, "missing")
        if e.kind != DIR:
            raise CorruptStepError(step_dir, f"step directory {_what(e, _NOT_A_DIRECTORY)}")
    for i, part in enumerate(parts):
        path = path / part
        key = f"{key}/{part}"
        last = i == len(parts) - 1
        if not last and not namespace.caps.directories:
            continue
        e = namespace.stat(key)
        if e is None:
            raise CorruptStepError(path, "missing")
        if not last and e.kind != DIR:
            raise CorruptStepError(path, f"inner directory {_what(e, _NOT_A_DIRECTORY)}")
        if last and e.kind != FILE:
            raise CorruptStepError(path, f"{_what(e, _NOT_A_FILE)}; expected a regular file")
    return path


def stored_rels_at(layout: Layout, step: int, inner_index: int, rank: int, namespace: Namespace) -> Tuple[str, str]:
    """(payload rel, meta rel) of (inner_index, rank) as step `step` holds them (`Layout.stored_rels`)."""
    return layout.stored_rels(inner_index, rank, lambda rel: namespace.stat(f"{int(step)}/{rel}") is not None)


def payload_rel_at(layout: Layout, step: int, inner_index: int, rank: int, namespace: Namespace) -> str:
    return stored_rels_at(layout, step, inner_index, rank, namespace)[0]


def meta_rel_at(layout: Layout, step: int, inner_index: int, rank: int, namespace: Namespace) -> str:
    return stored_rels_at(layout, step, inner_index, rank, namespace)[1]


def without_path(message: str, path: Path) -> str:
    """`message` without a leading "{path}: " (a CorruptStepError names the path itself)."""
    prefix = f"{path}: "
    return message[len(prefix):] if message.startswith(prefix) else message
