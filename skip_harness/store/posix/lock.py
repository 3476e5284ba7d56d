"""The POSIX namespace lock (`FlockLocker`, the `locking.Locker` of a directory) and its holder record.

One process per run holds `{namespace}/.lock` (an flock through `filelock`, so the operating system
releases it when the process dies) for as long as the run lasts, and writes
`{namespace}/.lock.holder.json` (pid, host, since) so that a refused run can say who is in the way.

- Links are never followed: a `.lock` that is not a regular file is refused (never opened), the
  holder record is written under a temporary name and renamed into place
  (which replaces a link as a link) and read with O_NOFOLLOW.
- A second lock on a namespace this process already holds is refused like another process's
  (`LockHeldError`), unless it is taken with `reentrant=True` (the Hydra startup callback hands the
  namespace over to the harness that way).
- A namespace that cannot be written (a read-only mount, no permission) raises `ReadOnlyCache`, so
  the caller can still serve complete steps with no lock, no cleanup and no writes.
- No holder record outlives its run: the last release removes it even when the run stops on an
  error (every lock still held is released at interpreter exit), and a record left by a killed
  process is replaced by the next holder and reported as stale, never as the holder.
"""
from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import stat
import threading
import time
from typing import Dict, List, Optional

import filelock

from skip_harness.errors import LockHeldError, SkipHarnessError, StoreError
from skip_harness.store.posix.holder import LockHolder, read_holder, remove_regular_file, write_small_file  # noqa: F401
from skip_harness.store.layout import Layout
from skip_harness.store.urls import DUMP_DIR_KEY
from skip_harness.store.locking import HeldByThisProcess, Hold, Locker

logger = logging.getLogger("skip_harness.store.lock")

TIMEOUT_KEY = "skip.rollout_tq.lock_timeout"

READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_READ_ONLY_ERRNOS = READ_ONLY_ERRNOS


class ReadOnlyCache(StoreError):
    """The namespace cannot be written (read-only mount, no permission): serve complete steps only,
    with no lock, no cleanup and no writes."""

    def __init__(self, path, reason: str):
        self.path = path
        self.reason = reason
        SkipHarnessError.__init__(self, 
            f"{path}: cannot be written ({reason}); {DUMP_DIR_KEY} is read-only here, so complete steps "
            "are served and nothing is locked, cleaned or written"
        )


class UnsafeLockFileError(SkipHarnessError):
    """`.lock` is a symbolic link or another non-regular file: never opened or followed."""


# ---------------------------------------------------------------------------------------- the lock


def _file_lock(path: str) -> filelock.BaseFileLock:
    # One instance per path in this process (is_singleton), shared by all threads. No soft-lock
    # fallback: a lock must be released by the operating system when its process dies.
    return filelock.FileLock(path, is_singleton=True, thread_local=False, fallback_to_soft=False)


def _check_lock_file(layout: Layout) -> None:
    path = layout.lock_path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise UnsafeLockFileError(
            f"{path} is {kind}; skip_harness never follows or opens it (nothing outside the namespace "
            "is written): remove it (the link itself, not its target) and rerun"
        )


def _describe_holder(layout: Layout) -> str:
    holder = read_holder(layout)
    if holder is None:
        return "unknown holder"
    if holder.is_alive() is False:
        return f"unknown holder (the holder record names pid {holder.pid} on this host, which is not running)"
    return holder.describe()


# Check-then-acquire and release are atomic within the process, per lock file (a wait on one namespace
# never holds up another).
_GUARDS: Dict[str, threading.RLock] = {}
_GUARDS_GUARD = threading.Lock()
_HELD: List["NamespaceLock"] = []  # locks this process holds, released at exit if the run did not


def _guard(path: str) -> threading.RLock:
    with _GUARDS_GUARD:
        return _GUARDS.setdefault(path, threading.RLock())


@atexit.register
def _release_at_exit() -> None:
    for lock in reversed(list(_HELD)):
        try:
            lock.release(all_levels=True)
        except Exception:  # pragma: no cover - best effort at interpreter exit
            pass


class NamespaceLock:
    """Exclusive lock on one namespace, for this process.

    `timeout`: how long `acquire` waits for another process (0 gives up at once, negative waits
    forever). `reentrant`: take a namespace that another NamespaceLock of this process already holds
    (a hand-over, e.g. Hydra callback -> harness); without it that is refused with LockHeldError.
    The same NamespaceLock object may be acquired several times (released as often)."""

    def __init__(self, layout: Layout, timeout: float = 0.0, *, reentrant: bool = False):
        self.layout = layout
        self.timeout = float(timeout)
        self.reentrant = bool(reentrant)
        self._lock: Optional[filelock.BaseFileLock] = None
        self._levels = 0
        self._holder: Optional[LockHolder] = None   # the holder record this object wrote

    def _file_lock(self) -> filelock.BaseFileLock:
        if self._lock is None:
            self._lock = _file_lock(str(self.layout.lock_path))
        return self._lock

    def acquire(self) -> None:
        """Take the lock. Raises LockHeldError (held by another process, or by another lock of this
        process without `reentrant`), ReadOnlyCache (the namespace cannot be written),
        UnsafeLockFileError (`.lock` is a link), or OSError (e.g. the path is not a directory)."""
        root = self.layout.root
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            if exc.errno in _READ_ONLY_ERRNOS:
                raise ReadOnlyCache(root, exc.strerror or str(exc)) from None
            raise
        _check_lock_file(self.layout)
        lock = self._file_lock()
        with _guard(lock.lock_file):
            if self._levels == 0 and lock.is_locked and not self.reentrant:
                raise HeldByThisProcess(
                    f"namespace {root} is already in use by this process ({_describe_holder(self.layout)}): "
                    "another harness holds it; close that one first or use another trainer.experiment_name"
                )
            try:
                lock.acquire(timeout=self.timeout, poll_interval=0.05)
            except filelock.Timeout:
                waited = "did not wait" if self.timeout == 0 else f"waited {self.timeout:g} s"
                raise LockHeldError(
                    f"namespace {root} is in use by {_describe_holder(self.layout)} ({waited}; set "
                    f"{TIMEOUT_KEY} to wait longer, or use another trainer.experiment_name)"
                ) from None
            except OSError as exc:
                if exc.errno in _READ_ONLY_ERRNOS:
                    raise ReadOnlyCache(root, exc.strerror or str(exc)) from None
                raise
            self._levels += 1
            with _GUARDS_GUARD:
                if self not in _HELD:
                    _HELD.append(self)
            if lock.lock_counter == 1:
                try:
                    self._write_holder()
                except OSError as exc:
                    if exc.errno in _READ_ONLY_ERRNOS:
                        self.release(all_levels=True)
                        raise ReadOnlyCache(root, exc.strerror or str(exc)) from None
                    logger.warning("%s: could not write the lock holder record: %s", root, exc)
        logger.debug("namespace lock %s taken (level %d)", self.layout.lock_path, lock.lock_counter)

    def _write_holder(self, records: bool = False) -> None:
        held = self._holder or (read_holder(self.layout) if records else None)   # a hand-over: the record it found
        since = held.since if held is not None and held.pid == os.getpid() else time.time()
        holder = LockHolder(os.getpid(), socket.gethostname(), since, records)
        write_small_file(self.layout.root, self.layout.lock_holder_path.name, json.dumps(holder.to_json()).encode())
        self._holder = holder

    def note_recording(self) -> None:
        """The holder record says from now on that this run records the namespace (it writes a step), not
        only replays it: what a run reading beside it is told. Once; a failure to write is a warning."""
        if self._levels == 0 or (self._holder is not None and self._holder.records):
            return
        try:
            self._write_holder(records=True)
        except OSError as exc:
            logger.warning("%s: could not update the lock holder record: %s", self.layout.root, exc)

    def release(self, *, all_levels: bool = False) -> None:
        """Give back one level (every level of this object with `all_levels`). The last level held in
        the process removes the holder record, then unlocks; neither failure stops the other."""
        if self._lock is None:
            return
        with _guard(self._lock.lock_file):
            while self._levels > 0 and self._lock is not None:
                lock = self._lock
                self._levels -= 1
                try:
                    if lock.lock_counter <= 1:
                        self._remove_holder()
                        self._holder = None
                finally:
                    try:
                        lock.release()
                    except Exception as exc:  # never leave the run holding the lock over a release error
                        logger.warning("%s: releasing the namespace lock failed (%s); forcing it",
                                       self.layout.lock_path, exc)
                        try:
                            lock.release(force=True)
                        except Exception:
                            pass
                if not all_levels:
                    break
            with _GUARDS_GUARD:
                if self._levels == 0 and self in _HELD:
                    _HELD.remove(self)

    def _remove_holder(self) -> None:
        try:
            remove_regular_file(
                self.layout.root, self.layout.lock_holder_path.name,
                only_if=lambda doc: doc is not None and doc.get("pid") == os.getpid(),
            )
        except OSError as exc:
            logger.warning("%s: could not remove the lock holder record: %s", self.layout.lock_holder_path, exc)

    def __enter__(self) -> "NamespaceLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held_by_this_process(self) -> bool:
        """Whether this process holds the namespace (through this object or another one)."""
        return self._file_lock().is_locked

    def holder(self) -> Optional[LockHolder]:
        return read_holder(self.layout)


def probe(layout: Layout) -> Optional[str]:
    """Without creating or writing anything: a description of who holds the namespace lock (any
    process, this one included), or None if nobody does (a stale holder record is not a holder)."""
    path = layout.lock_path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unknown holder ({path}: {exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return None  # nobody can hold a lock through a link: acquire refuses it
    if _file_lock(str(path)).is_locked:
        return _describe_holder(layout)
    # Another process? Ask filelock with a non-blocking try on an instance of our own.
    trial = filelock.FileLock(str(path), thread_local=False, fallback_to_soft=False)
    try:
        trial.acquire(blocking=False)
    except filelock.Timeout:
        return _describe_holder(layout)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return None  # a read-only mount: no run can hold it for writing
        return f"unknown holder ({path}: {exc.strerror})"
    trial.release()
    return None


# ---------------------------------------------------------------------------------------- the Locker


class _FileHold(Hold):
    def __init__(self, lock: Optional[NamespaceLock], why: str = ""):
        self._lock = lock
        self.why = why

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(all_levels=True)

    def note_recording(self) -> None:
        if self._lock is not None:
            self._lock.note_recording()


class FlockLocker(Locker):
    """The lock of a namespace directory: `.lock` (flock, released by the operating system when the
    process dies: nothing to fence) and `.lock.holder.json`."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def lock(self, timeout: float = 0.0) -> Hold:
        """The namespace's lock file, the directory created if needed. A read-only mount or a directory
        this process may not write gives a read-only Hold; a `.lock` that is a link raises
        UnsafeLockFileError, a path that is not a directory an OSError."""
        lock = NamespaceLock(self.layout, timeout)
        try:
            lock.acquire()
        except ReadOnlyCache as exc:
            return _FileHold(None, why=exc.reason)
        except OSError as exc:
            if exc.errno in READ_ONLY_ERRNOS:
                return _FileHold(None, why=exc.strerror or str(exc))
            raise
        return _FileHold(lock)

    def holder(self) -> Optional[str]:
        return probe(self.layout) if os.path.isdir(self.layout.root) else None

    def holder_records(self) -> Optional[bool]:
        holder = read_holder(self.layout) if os.path.isdir(self.layout.root) else None
        return None if holder is None else holder.records

    def writable(self) -> Optional[str]:
        probe_at = self.layout.root
        while not probe_at.exists() and probe_at.parent != probe_at:
            probe_at = probe_at.parent
        if not os.access(probe_at, os.W_OK | os.X_OK):
            return f"{probe_at}: this process may not write here"
        return None
