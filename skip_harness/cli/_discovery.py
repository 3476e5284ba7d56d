"""Where a command looks: the namespaces under a path the user named, how a namespace is shown relative to
it, and where runs write when nothing names another place."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Tuple, Union

from skip_harness.store.api import Layout, UrlPath, dump_dir_problem, is_url, namespace_leaf_values, namespaces_at, place

from skip_harness.cli._output import CliError


def where_of(text: str, arg: str) -> Union[Path, UrlPath]:
    """What a command-line argument names: an object-store location for a URL, else a local path -- a relative
    one that is not here but is under where runs write (a namespace as `ls` names it) is that one. A URL
    look-alike (`s3:/x`, `gs:x`) is refused with the message a run gives for it, naming `arg` (the
    argument's metavar), rather than taken for a local folder of that name."""
    if is_url(text):
        return UrlPath(text)
    check_place(text, arg)
    path = Path(text)
    if not path.is_absolute() and not path.exists():
        return _in_default_dump_dir(path) or path
    return path


def check_place(text: str, arg: str) -> None:
    """Refuse a URL look-alike (`s3:/x`, `gs:x`) with the message a run gives for it, naming `arg`; nothing
    is looked up or resolved (the command resolves its own arguments, `where_of`)."""
    if is_url(text):
        return
    why = dump_dir_problem(text)
    if why is not None:
        raise CliError(f"{arg}: {why}")


_SAID: set = set()


def _in_default_dump_dir(rel: Path) -> Union[Path, UrlPath, None]:
    """A relative name that is not here, as `skip-harness ls` prints a namespace (`{experiment}_{project}/GBS..`,
    relative to where runs write; a step directory or file under it): that path under where runs write, when
    one of its parts is a namespace's name and, on a disk, it is there (said once on stderr); else None. The
    one rule of every command (`diff` had a second one of its own). Under an object store the URL is
    not looked up first: the command says what it finds there, naming the URL."""
    if not any(namespace_leaf_values(part) is not None for part in rel.parts):
        return None                       # not a namespace's name: a cache root or a group is named as it is
    try:
        base, _ = default_dump_dir()
    except Exception:  # noqa: BLE001 - no default place: the name stays as given, and says it does not exist
        return None
    found: Union[Path, UrlPath]
    if isinstance(base, UrlPath) or is_url(str(base)):
        found = UrlPath(f"{str(base).rstrip('/')}/{rel.as_posix()}")
    else:
        found = Path(base) / rel
        if not found.exists():
            return None
    if str(rel) not in _SAID:
        _SAID.add(str(rel))
        logging.getLogger("skip_harness.cli").info("%s is not here: %s, under where runs write", rel, found)
    return found


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


def default_dump_dir() -> Tuple[Union[Path, UrlPath], str]:
    """Where runs write when nothing names another place (an object store's as a UrlPath, never a str:
    a command given none opens it as it would one named), and how that was decided (for the user)."""
    from skip_harness.config import DUMP_DIR_ENV, RolloutTQConfig

    path = place(RolloutTQConfig().resolved_dump_dir())
    if os.environ.get(DUMP_DIR_ENV):
        return path, f"${DUMP_DIR_ENV}"
    return path, f"the per-user default; ${DUMP_DIR_ENV} is not set"
