"""Where a step's files are, checked on the way: step and inner directories entered only when they are
real directories (never a symlink), files only when they are regular files, K = 1 steps found in
either layout; and the step's directories prepared for writing. Raises CorruptStepError naming the
path, or HarnessUsageError for a position outside the namespace's K and W. No logging."""
from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Optional, Tuple

from skip_harness.errors import CorruptStepError, HarnessUsageError
from skip_harness.store.posix.fileops import NotARealDirectory, describe_mode, fsync_dir, lstat_at, open_dir_at, remove_entry_at
from skip_harness.store.layout import COMMIT_NAME, Layout


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

def step_dir_name(layout: Layout, step: int) -> str:
    return layout.step_dir(step).name

def open_root(layout: Layout, create: bool) -> Optional[int]:
    root = layout.root
    if create:
        os.makedirs(root, exist_ok=True)
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None

def open_step(layout: Layout, root_fd: int, step: int, create: bool) -> Tuple[int, bool]:
    try:
        return open_dir_at(step_dir_name(layout, step), root_fd, create=create)
    except NotARealDirectory as exc:
        raise CorruptStepError(layout.step_dir(step), f"step directory {exc.what}") from None
    except FileNotFoundError:
        raise CorruptStepError(layout.step_dir(step), "step directory does not exist") from None

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

def existing_rel(layout: Layout, step: int, rel: str, legacy_rel: str) -> str:
    """`rel`, or for K = 1 the older `0/` form `legacy_rel` when that is what exists."""
    if layout.K == 1 and not os.path.lexists(layout.step_dir(step) / rel):
        if os.path.lexists(layout.step_dir(step) / legacy_rel):
            return legacy_rel
    return rel

def payload_rel_at(layout: Layout, step: int, inner_index: int, rank: int) -> str:
    return existing_rel(layout, step, layout.payload_rel(inner_index, rank), layout.legacy_k1_rel(rank)[0])

def meta_rel_at(layout: Layout, step: int, inner_index: int, rank: int) -> str:
    return existing_rel(layout, step, layout.meta_rel(inner_index, rank), layout.legacy_k1_rel(rank)[1])


def open_inner_for_writing(layout: Layout, step: int, inner_index: int) -> int:
    """The fd of the directory an inner index's files are written in: the step's directories are
    created (an entry in their place that is a symlink or a file is removed first, never followed) and
    the step's commit record is removed (the step is being rewritten)."""
    step_name = step_dir_name(layout, step)
    root_fd = open_root(layout, create=True)
    try:
        try:
            step_fd, created = open_dir_at(step_name, root_fd, create=True)
        except NotARealDirectory:
            remove_entry_at(root_fd, step_name, layout.root)
            step_fd, created = open_dir_at(step_name, root_fd, create=True)
        if created:
            fsync_dir(root_fd)
    finally:
        os.close(root_fd)
    inner_fd = step_fd
    try:
        if lstat_at(COMMIT_NAME, step_fd) is not None:
            os.unlink(COMMIT_NAME, dir_fd=step_fd)
            fsync_dir(step_fd)
        inner_rel = layout.inner_rel(inner_index)
        if str(inner_rel) != ".":
            inner_name = inner_rel.name
            try:
                inner_fd, created = open_dir_at(inner_name, step_fd, create=True)
            except NotARealDirectory:
                os.unlink(inner_name, dir_fd=step_fd)
                inner_fd, created = open_dir_at(inner_name, step_fd, create=True)
            if created:
                fsync_dir(step_fd)
    except BaseException:
        if inner_fd != step_fd:
            os.close(inner_fd)
        os.close(step_fd)
        raise
    if inner_fd != step_fd:
        os.close(step_fd)
    return inner_fd


def without_path(message: str, path: Path) -> str:
    """`message` without a leading "{path}: " (a CorruptStepError names the path itself)."""
    prefix = f"{path}: "
    return message[len(prefix):] if message.startswith(prefix) else message
