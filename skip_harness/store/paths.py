"""Where a step's files are, checked on the way: step and inner directories entered only when they are
real directories (never a symlink), files only when they are regular files, K = 1 steps found in
either layout (writing goes through the backend, `store.posix.backend`). Raises CorruptStepError naming the
path, or HarnessUsageError for a position outside the namespace's K and W. No logging."""
from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Tuple

from skip_harness.errors import CorruptStepError, HarnessUsageError
from skip_harness.store.posix.fileops import describe_mode
from skip_harness.store.layout import Layout


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

def real_file(layout: Layout, step: int, rel: str) -> Path:
    """The path of step/rel after checking that no component is a symlink and it is a regular file."""
    step_dir = layout.step_dir(step)
    path = step_dir
    parts = PurePosixPath(rel).parts
    try:
        st = os.lstat(step_dir)
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptStepError(step_dir, f"step directory {describe_mode(st.st_mode)}")
        for i, part in enumerate(parts):
            path = path / part
            st = os.lstat(path)
            last = i == len(parts) - 1
            if not last and not stat.S_ISDIR(st.st_mode):
                raise CorruptStepError(path, f"inner directory {describe_mode(st.st_mode)}")
            if last and not stat.S_ISREG(st.st_mode):
                raise CorruptStepError(path, f"{describe_mode(st.st_mode)}; expected a regular file")
    except FileNotFoundError:
        raise CorruptStepError(path, "missing") from None
    return path

def stored_rels_at(layout: Layout, step: int, inner_index: int, rank: int) -> Tuple[str, str]:
    """(payload rel, meta rel) of (inner_index, rank) as step `step` holds them on disk
    (`Layout.stored_rels`; an object store never held the older K = 1 form)."""
    if layout.is_url:
        return layout.payload_rel(inner_index, rank), layout.meta_rel(inner_index, rank)
    step_dir = layout.step_dir(step)
    return layout.stored_rels(inner_index, rank, lambda rel: os.path.lexists(step_dir / rel))


def payload_rel_at(layout: Layout, step: int, inner_index: int, rank: int) -> str:
    return stored_rels_at(layout, step, inner_index, rank)[0]


def meta_rel_at(layout: Layout, step: int, inner_index: int, rank: int) -> str:
    return stored_rels_at(layout, step, inner_index, rank)[1]


def without_path(message: str, path: Path) -> str:
    """`message` without a leading "{path}: " (a CorruptStepError names the path itself)."""
    prefix = f"{path}: "
    return message[len(prefix):] if message.startswith(prefix) else message
