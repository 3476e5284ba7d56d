"""Where the namespaces are: a path that is one (a directory, or a pack file), an `{experiment}_{project}`
directory holding them, or a dump dir two levels above them -- local or an object-store URL. Reads listings only, through the
storage (`store.open.open_dump_dir`), never a directory by itself."""
from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import List, Union

from skip_harness.store.layout import Layout, UrlPath, is_url_text, parse_namespace_leaf
from skip_harness.store.open import open_dump_dir, pack_layout
from skip_harness.store.packfile import PackError
from skip_harness.store.storage import DIR, FILE

logger = logging.getLogger("skip_harness.store")

__all__ = ["namespaces_at", "find_namespaces"]


def namespaces_at(path: Union[Path, UrlPath]) -> List[Layout]:
    """Namespaces at `path`: the path itself if it is a namespace (a directory or a pack file), those in it if
    it is an `{experiment}_{project}` directory, else those two levels down (a dump dir); and the pack files
    directly in it (`skip-harness pack`'s, told by their first bytes, whatever their names), after the
    directories. A file that starts like a pack but whose manifest cannot be read is left out with a warning
    naming it. Links are never followed."""
    if is_url_text(path):
        return _namespaces_at_url(UrlPath(str(path)))
    path = Path(str(path))
    packed = pack_layout(path)
    if packed is not None:
        return [packed]         # a pack file: the one namespace it holds
    kw = parse_namespace_leaf(path.name)
    if kw is not None:
        return [Layout(path, K=kw[0], W=kw[1])]
    storage = open_dump_dir(path).storage         # listed through the storage: links never followed
    children = storage.list_dir("")
    if not children and storage.stat("") is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    direct, packs = [], []
    for child in sorted(children, key=lambda e: e.name):
        kw = parse_namespace_leaf(child.name)
        if kw is not None and child.kind == DIR:
            direct.append(Layout(path / child.name, K=kw[0], W=kw[1]))
        elif child.kind == FILE:
            try:
                packed = pack_layout(path / child.name)
            except PackError as exc:
                logger.warning("%s; not listed", exc)        # the error names the file
                continue
            if packed is not None:
                packs.append(packed)
    return direct + find_namespaces(path) + packs


def _namespaces_at_url(url: UrlPath) -> List[Layout]:
    """`namespaces_at` for an object-store URL: the namespace it names, else those its dump_dir lists."""
    kw = parse_namespace_leaf(url.name)
    if kw is not None:
        # nothing under its prefix: no namespace there (a typo), as a local path that does not exist -- not
        # an empty namespace whose every step reads as missing (one LIST)
        if not open_dump_dir(str(url)).storage.list_dir(""):
            raise FileNotFoundError(f"{url} does not exist (nothing under that prefix)")
        return [Layout(url, K=kw[0], W=kw[1])]  # type: ignore[arg-type]  # Layout's root: a Path or a UrlPath
    out = []
    for rel in open_dump_dir(str(url)).list_namespaces():
        kw = parse_namespace_leaf(rel.rsplit("/", 1)[-1])
        if kw is not None:
            out.append(Layout(url / rel, K=kw[0], W=kw[1]))  # type: ignore[arg-type]
    return out


def find_namespaces(dump_dir: Path) -> List[Layout]:
    """Namespaces under a local dump dir: directories {dump_dir}/{any}/{leaf} whose leaf name parses as
    a namespace name (which gives K and W), as the POSIX backend lists them (symlinks never followed).
    Sorted by path."""
    dump_dir = Path(dump_dir)
    out: List[Layout] = []
    for rel in open_dump_dir(dump_dir).list_namespaces():
        K, W = parse_namespace_leaf(rel.rpartition("/")[2])
        out.append(Layout(dump_dir / rel, K=K, W=W))
    return out
