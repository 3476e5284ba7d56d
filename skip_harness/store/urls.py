"""Where a cache is: a local directory or an object-store URL -- the one URL test, from the text alone.

A leaf: it imports nothing of skip_harness, so the config (`skip_harness.config`), the layout, the
object-store client and the factory (`store.open`) all ask the same `is_url`.
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Optional, Union

DUMP_DIR_KEY = "skip.rollout_tq.dump_dir"
URL_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "memory")   # the object stores' URLs

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_ANY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$", re.S)


class UrlPath:
    """An object-store location (`s3://bucket/prefix/ns/3`) with the few `Path` operations the layout's
    messages use (`/`, `name`, `parent`, `str`). Deliberately not path-like (no `__fspath__`): nothing
    can open it as a local file by mistake."""

    __slots__ = ("url",)

    def __init__(self, url: str):
        self.url = url.rstrip("/") if not url.endswith("://") else url

    def __truediv__(self, other: object) -> "UrlPath":
        other = str(other)
        if other in ("", "."):
            return self
        return UrlPath(f"{self.url}/{other.lstrip('/')}")

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "UrlPath":
        head, sep, _ = self.url.rpartition("/")
        return UrlPath(head) if sep and not head.endswith(":/") else self

    def relative_to(self, base: object) -> PurePosixPath:
        base = str(base).rstrip("/")
        if self.url == base:
            return PurePosixPath(".")
        if not self.url.startswith(base + "/"):
            raise ValueError(f"{self.url} is not under {base}")
        return PurePosixPath(self.url[len(base) + 1:])

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"UrlPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UrlPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(("UrlPath", self.url))


def is_url(where: object) -> bool:
    """Whether `where` names an object store (`s3://`, `gs://`, `az://`, `memory://`, a `UrlPath`, ...);
    a `file://` URL, a plain path and a `Path` are local."""
    if isinstance(where, UrlPath):
        return True
    if not isinstance(where, str):
        return False
    m = _SCHEME.match(where)
    return bool(m) and m.group(1).lower() != "file"


def place(where: Union[str, os.PathLike, "UrlPath"]) -> Union[Path, "UrlPath"]:
    """A dump_dir or a namespace as the store addresses it: a `UrlPath` for an object-store URL (a `Path`
    would fold its `//`), else a `Path`."""
    return UrlPath(str(where)) if is_url(where) else Path(str(where))


def url_scheme(where: object) -> Optional[str]:
    """The scheme of a URL (`s3` of `s3://bucket/prefix`), lower case; None for a local path."""
    if isinstance(where, UrlPath):
        where = where.url
    m = _SCHEME.match(where) if isinstance(where, str) else None
    return m.group(1).lower() if m else None


def dump_dir_problem(dump_dir: Union[str, os.PathLike, None]) -> Optional[str]:
    """Why a dump_dir cannot be used, from its text alone; None when it may be. An object store's
    scheme without its `//` (`s3:/x`, `s3:x`, `gs:/x`) is refused rather than taken for a local folder
    of that name, and so is a URL without a bucket (`s3://`, `s3:///x`)."""
    if dump_dir is None or isinstance(dump_dir, os.PathLike):
        return None
    text = str(dump_dir)
    m = _SCHEME_ANY.match(text)
    if m is None or m.group(1).lower() not in URL_SCHEMES:
        return None
    scheme, slashes, rest = m.groups()
    if len(slashes) < 2:
        return (f"{text!r} looks like an object-store URL but is not one ({scheme}: needs two slashes): "
                f"write {scheme}://BUCKET/PREFIX, or ./{text} for a local folder of that name")
    if scheme.lower() != "memory" and (len(slashes) > 2 or not rest.partition("/")[0]):
        return f"{text!r} names no bucket: an object-store URL is {scheme}://BUCKET/PREFIX"
    return None


def local_path(dump_dir: Union[str, os.PathLike]) -> Path:
    """A local dump_dir as a Path (`~` expanded, a `file://` prefix dropped)."""
    s = os.fspath(dump_dir)
    if s.lower().startswith("file://"):
        s = s[len("file://"):]
    return Path(s).expanduser()


def join_url(url: str, *parts: str) -> str:
    """`url` with `parts` appended, one '/' between each."""
    out = url.rstrip("/")
    for p in parts:
        p = str(p).strip("/")
        if p:
            out += "/" + p
    return out


__all__ = ["DUMP_DIR_KEY", "URL_SCHEMES", "UrlPath", "dump_dir_problem", "is_url", "join_url", "local_path", "url_scheme"]
