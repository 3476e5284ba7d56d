"""Holding a namespace, and the multi-node run marker: two small protocols beside the storage.

- `Locker`: one run holds a namespace for writing (`lock` -> `Hold`); who holds it now (`holder`, for
  a dry run: touches nothing); whether this process may write there at all (`writable`); and the
  fence every write passes (`fence`). A POSIX namespace's locker is an flock file
  (`store.posix.lock.FlockLocker`: the operating system releases it when the process dies, so its
  fence is a no-op); an object store's is a lease object with a time to live (`store.objstore.lease`),
  whose fence refuses a write once the lease may have passed to another run, and renews it by a
  conditional write first when `strict` (before a commit record is put or removed).
- `RunMarkers`: rank 0 leaves a marker, every rank looks for it, rank 0 removes it: the check that
  every node of a run sees the same cache. `StorageRunMarkers` keeps them as small files of the
  namespace (`.run-marker-{token}`), on any storage.

"Read-only" is said once: a `Hold` whose `why` is set (a read-only mount, a credential that may only
read): the run serves complete steps and writes nothing.
"""
from __future__ import annotations

import abc
import json
import os
import re
import secrets
import socket
import time
from typing import Any, Optional

from skip_harness.errors import CorruptStepError, LockHeldError, SkipHarnessError

RUN_MARKER_PREFIX = ".run-marker-"
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class HeldByThisProcess(LockHeldError):
    """Another harness of this very process holds the namespace: a usage error (close that one
    first), never a reason to read beside it."""


class Hold(abc.ABC):
    """A namespace as held by this run. `why` is set when this process may only read there (why, for
    the message): serve, write nothing. `lost` is set when another run took the namespace over (a
    lease that ran out): stop writing."""

    why: str = ""

    @property
    def read_only(self) -> bool:
        return bool(self.why)

    @property
    def lost(self) -> bool:
        return False

    @abc.abstractmethod
    def release(self) -> None:
        """Give the namespace back (idempotent)."""

    def note_recording(self) -> None:
        """This run records the namespace (it writes a step), not only replays it: said where the holder
        is described to other runs (`Locker.holder_records`). A no-op where nothing says it."""
        return None


class Locker(abc.ABC):
    """The lock of one namespace, for this process."""

    @abc.abstractmethod
    def lock(self, timeout: float = 0.0) -> Hold:
        """Hold the namespace for writing (LockHeldError naming the holder after `timeout` seconds; a
        negative timeout waits forever). A namespace this process may only read gives a read-only Hold
        (`why` set). Any other failure to reach it raises a SkipHarnessError or an OSError."""

    def holder(self) -> Optional[str]:
        """Who holds the namespace now, described for a message, or None -- without creating, writing
        or taking anything."""
        return None

    def holder_records(self) -> Optional[bool]:
        """Whether the run holding the namespace now has recorded a step of it since it took the hold
        (False: it only replays so far); None when nobody holds it or it is not known here."""
        return None

    @abc.abstractmethod
    def writable(self) -> Optional[str]:
        """None when this process may write here (as far as is known without writing), else why not."""

    def fence(self, strict: bool = False, key: str = "") -> None:
        """Return only while this process may write the namespace; raise (a SkipHarnessError naming
        why) once it may not. The namespace calls it before every write (`key`: what it is about to
        write, for the message), with `strict` before a commit record is put or removed (an object
        store's lease is then renewed by a round trip first). A no-op where the lock cannot be lost
        while its process lives (flock)."""
        return None

    def follow(self, holder: str) -> None:
        """A rank that writes under the lock another process of its run holds (W > 1, rank 0 took it):
        fence against that holder (`RunMarkers` tells it). A no-op where the fence is one."""
        return None

    def holder_token(self) -> str:
        """What names this process's hold for `follow` ('' when it holds nothing or there is no need)."""
        return ""


class RunMarkers(abc.ABC):
    """The shared-storage check of a multi-process run."""

    @abc.abstractmethod
    def put(self, token: str) -> None:
        """Rank 0: leave the marker `token` of this run."""

    @abc.abstractmethod
    def sees(self, token: str, wait: float = 0.0) -> bool:
        """Every rank: whether the marker `token` is visible here, polling up to `wait` seconds."""

    @abc.abstractmethod
    def remove(self, token: str) -> None:
        """Rank 0, after every rank looked: remove the marker (idempotent)."""


def new_run_token() -> str:
    """A fresh token for a run marker (rank 0 makes it and broadcasts it)."""
    return secrets.token_hex(8)


def marker_key(token: str) -> str:
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError(f"run marker token must be 1-64 letters, digits, '_' or '-', got {token!r}")
    return RUN_MARKER_PREFIX + token


class StorageRunMarkers(RunMarkers):
    """Markers as small JSON files of the namespace's storage; the marker names the lock's holder
    (`Locker.holder_token`), and a rank that sees it follows that holder's fence (`Locker.follow`)."""

    def __init__(self, storage: Any, locker: Optional[Locker] = None, poll_s: float = 0.05):
        self.storage = storage
        self.locker = locker
        self.poll_s = poll_s

    def put(self, token: str) -> None:
        key = marker_key(token)
        doc = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
               "lease_holder": self.locker.holder_token() if self.locker is not None else ""}
        if self.locker is not None:
            self.locker.fence(key=key)
        self.storage.put(key, json.dumps(doc).encode())

    def sees(self, token: str, wait: float = 0.0) -> bool:
        key = marker_key(token)
        deadline = time.monotonic() + max(0.0, float(wait))
        while True:
            try:
                data = self.storage.get(key)
                doc = json.loads(data) if data is not None else None
            except (OSError, CorruptStepError, ValueError, UnicodeDecodeError):   # unreadable, a link: not seen
                doc = None            # (a storage that cannot be reached raises: the caller says why)
            if isinstance(doc, dict) and doc.get("token") == token:
                holder = doc.get("lease_holder")
                if holder and self.locker is not None:
                    self.locker.follow(str(holder))
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)

    def remove(self, token: str) -> None:
        key = marker_key(token)
        try:
            if self.locker is not None:
                self.locker.fence(key=key)        # a read-only run, or one whose lease was lost: nothing
            self.storage.delete(key)
        except (OSError, SkipHarnessError):
            pass


__all__ = ["RUN_MARKER_PREFIX", "HeldByThisProcess", "Hold", "Locker", "RunMarkers", "StorageRunMarkers", "marker_key", "new_run_token"]
