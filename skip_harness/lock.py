"""The namespace lock and its holder record.

One process per run holds `{namespace}/.lock` (an flock, so the operating system releases it when
the process dies) for as long as the run lasts. The lock is re-entrant within a process: a Hydra
callback may take it first and the harness again. Whoever holds it writes `{namespace}/.lock.holder.json`
(pid, host, since) so that a refused run can say who is in the way.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import Optional

import filelock

from skip_harness.errors import LockHeldError
from skip_harness.layout import Layout
from skip_harness.store import write_file_at

logger = logging.getLogger("skip_harness.lock")

TIMEOUT_KEY = "skip.rollout_tq.lock_timeout"


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on host {self.host} since {when}"

    def to_json(self) -> dict:
        return {"pid": self.pid, "host": self.host, "since": self.since}


def read_holder(layout: Layout) -> Optional[LockHolder]:
    """The holder record of a namespace, None if absent or unreadable (never follows a symlink)."""
    try:
        fd = os.open(layout.lock_holder_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with open(fd, "rb", closefd=False) as f:
            doc = json.loads(f.read(65536))
        return LockHolder(int(doc["pid"]), str(doc["host"]), float(doc["since"]))
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def probe(layout: Layout) -> Optional[str]:
    """Without creating or writing anything: a description of who holds the namespace lock (any
    process, this one included), or None if nobody does."""
    try:
        fd = os.open(layout.lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unknown holder ({layout.lock_path}: {exc.strerror})"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = read_holder(layout)
                return holder.describe() if holder else "unknown holder"
            raise
        return None
    finally:
        os.close(fd)  # also drops the shared lock


class NamespaceLock:
    """Exclusive, process-wide, re-entrant lock on one namespace.

    `timeout` is how long `acquire` waits for another process: 0 gives up at once; a negative value
    waits forever."""

    def __init__(self, layout: Layout, timeout: float = 0.0):
        self.layout = layout
        self.timeout = float(timeout)
        self._lock: Optional[filelock.BaseFileLock] = None
        self._levels = 0
        self._guard = threading.Lock()

    def _file_lock(self) -> filelock.BaseFileLock:
        if self._lock is None:
            # Same path -> same instance within this process (is_singleton), shared by all threads.
            self._lock = filelock.FileLock(
                str(self.layout.lock_path), is_singleton=True, thread_local=False, fallback_to_soft=False
            )
        return self._lock

    def acquire(self) -> None:
        root = self.layout.root
        os.makedirs(root, exist_ok=True)
        lock = self._file_lock()
        with self._guard:
            try:
                lock.acquire(timeout=self.timeout, poll_interval=0.05)
            except filelock.Timeout:
                holder = read_holder(self.layout)
                who = holder.describe() if holder else "unknown holder"
                waited = "did not wait" if self.timeout == 0 else f"waited {self.timeout:g} s"
                raise LockHeldError(
                    f"namespace {root} is in use by {who} ({waited}; set {TIMEOUT_KEY} to wait longer, "
                    f"or use another trainer.experiment_name)"
                ) from None
            self._levels += 1
            if lock.lock_counter == 1:
                try:
                    self._write_holder()
                except OSError as exc:
                    logger.warning("%s: could not write the lock holder record: %s", root, exc)
        logger.debug("namespace lock %s taken (level %d)", self.layout.lock_path, lock.lock_counter)

    def _write_holder(self) -> None:
        holder = LockHolder(os.getpid(), socket.gethostname(), time.time())
        data = json.dumps(holder.to_json()).encode()
        root_fd = os.open(self.layout.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            write_file_at(root_fd, self.layout.lock_holder_path.name, lambda f: f.write(data))
        finally:
            os.close(root_fd)

    def release(self) -> None:
        with self._guard:
            if self._levels == 0 or self._lock is None:
                return
            lock = self._lock
            if lock.lock_counter == 1:
                self._remove_holder()
            lock.release()
            self._levels -= 1

    def _remove_holder(self) -> None:
        path = self.layout.lock_holder_path
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and (read_holder(self.layout) or LockHolder(0, "", 0)).pid == os.getpid():
                os.unlink(path)
        except OSError:
            pass

    def __enter__(self) -> "NamespaceLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held_by_this_process(self) -> bool:
        return self._file_lock().is_locked

    def holder(self) -> Optional[LockHolder]:
        return read_holder(self.layout)
