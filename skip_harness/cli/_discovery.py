"""Where a command looks: the namespaces under a path the user named, how a namespace is shown relative to
it, and where runs write when nothing names another place."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Tuple

from skip_harness.store.namespaces import namespaces_at
from skip_harness.store.layout import Layout

from skip_harness.cli._output import CliError


def namespaces_under(path: Path) -> List[Layout]:
    """Namespaces at `path`: the path itself if it is a namespace, those in it if it is an
    `{experiment}_{project}` directory, else those two levels down (a dump dir)."""
    return namespaces_at(path)

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


def default_dump_dir() -> Tuple[Any, str]:
    """Where runs write when nothing names another place, and how that was decided (for the user)."""
    from skip_harness.config import DUMP_DIR_ENV, RolloutTQConfig

    path = RolloutTQConfig().resolved_dump_dir()
    if os.environ.get(DUMP_DIR_ENV):
        return path, f"${DUMP_DIR_ENV}"
    return path, f"the per-user default; ${DUMP_DIR_ENV} is not set"
