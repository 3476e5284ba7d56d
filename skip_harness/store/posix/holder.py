"""The holder record of a POSIX namespace lock (`.lock.holder.json`: pid, host, since; records: whether the
holder has recorded -- generated and written -- a step of it since it took the lock, False while it only
replays), written and read
without ever following a link: written under a temporary name and renamed into place (which replaces a
link as a link), read with O_NOFOLLOW."""
from __future__ import annotations

import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from typing import Optional

from skip_harness.store.layout import Layout
from skip_harness.store.posix.fileops import CREATE_FLAGS, replace_via_temp

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    since: float
    records: Optional[bool] = None   # None: a record without the key (an older version's)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on host {self.host} since {when}"

    def to_json(self) -> dict:
        doc: dict = {"pid": self.pid, "host": self.host, "since": self.since}
        if self.records is not None:
            doc["records"] = self.records
        return doc

    def is_alive(self) -> Optional[bool]:
        """Whether the process it names is running: None when it is on another host (unknowable)."""
        if self.host != socket.gethostname():
            return None
        if self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            return True
        return True


def _read_small_json(dir_path, name: str) -> Optional[dict]:
    """A small JSON document `name` in `dir_path`, None if absent, not a regular file or unreadable."""
    try:
        fd = os.open(os.path.join(dir_path, name), _READ_FLAGS)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        doc = json.loads(os.read(fd, 65536))
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def read_holder(layout: Layout) -> Optional[LockHolder]:
    """The holder record of a namespace, None if absent or unreadable (never follows a symlink).
    It may be stale (its process killed): the next holder replaces it."""
    doc = _read_small_json(layout.root, layout.lock_holder_path.name)
    if doc is None:
        return None
    try:
        records = doc.get("records")
        return LockHolder(int(doc["pid"]), str(doc["host"]), float(doc["since"]),
                          records if isinstance(records, bool) else None)
    except (KeyError, TypeError, ValueError):
        return None


def write_small_file(dir_path, name: str, data: bytes) -> None:
    """Write `data` as `dir_path/name` atomically: a new temporary file (O_EXCL | O_NOFOLLOW), made
    durable, renamed into place (a link at `name` is replaced, never followed)."""
    dir_fd = os.open(dir_path, _DIR_FLAGS)
    try:
        def fill(tmp: str) -> None:
            fd = os.open(tmp, CREATE_FLAGS, 0o644, dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)

        replace_via_temp(dir_fd, name, fill)
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
    finally:
        os.close(dir_fd)


def remove_regular_file(dir_path, name: str, only_if=None) -> bool:
    """Unlink `dir_path/name` if it is a regular file (a link is removed as a link only when
    `only_if` is None); `only_if(doc)` must approve its JSON content. True if removed."""
    path = os.path.join(dir_path, name)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if only_if is not None:
        if not stat.S_ISREG(st.st_mode) or not only_if(_read_small_json(dir_path, name)):
            return False
    elif not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


__all__ = ["LockHolder", "read_holder", "remove_regular_file", "write_small_file"]
