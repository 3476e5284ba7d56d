"""An in-memory storage: the reference backend, written from `store.storage`'s docstrings alone.

A dict of key -> bytes under one lock; stamps count writes; no directories, links or temporaries (an
object store's shape), but an atomic `move` and an `append` (a POSIX file system's), so the tests that
run every backend (`tests/test_backend.py`) cover both sides of each capability between POSIX, memory
and S3. `MemoryLocker` holds a namespace within this process. Nothing here is persistent: a test
fixture, and a namespace for code that must not touch a disk.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from skip_harness.errors import CorruptStepError, LockHeldError
from skip_harness.store.checksum import check_read
from skip_harness.store.locking import Hold, Locker
from skip_harness.store.storage import DIR, FILE, Capabilities, Entry, Storage


def _bytes_of(data: Any, nbytes: Optional[int]) -> bytes:
    view = data.view(nbytes) if hasattr(data, "view") and callable(data.view) else memoryview(data).cast("B")
    return bytes(view if nbytes is None else view[:nbytes])


class MemoryStorage(Storage):
    """The namespace `url` (`memory:{name}`, for messages) held in this process's memory."""

    caps = Capabilities(mmap=False, access_times=False, append=True, atomic_rename=True, directories=False)

    def __init__(self, url: str = "memory:namespace"):
        self.url = url
        self._files: Dict[str, Tuple[bytes, str, int]] = {}     # key -> (bytes, stamp, mtime_ns)
        self._guard = threading.Lock()
        self._writes = itertools.count(1)

    def _store(self, key: str, data: bytes) -> str:
        stamp = f"w{next(self._writes)}"
        self._files[key] = (data, stamp, time.time_ns())
        return stamp

    def _entry(self, key: str) -> Entry:
        data, stamp, mtime = self._files[key]
        return Entry(key, FILE, len(data), stamp, mtime, None)

    # ---- reading

    def get(self, key: str) -> Optional[bytes]:
        return self.get_stamped(key)[0]

    def get_stamped(self, key: str) -> Tuple[Optional[bytes], Optional[str]]:
        with self._guard:
            found = self._files.get(key)
        return (None, None) if found is None else (found[0], found[1])

    def get_verified(self, key: str, size: int, checksum: str, pool: Any) -> Any:
        data = self.get(key)
        where = self.where(key)
        if data is None:
            raise CorruptStepError(where, "missing")
        if len(data) != size:
            raise CorruptStepError(where, f"{len(data)} bytes, the commit record says {size}")
        lease = pool.acquire(size)
        lease.view(size)[:] = data
        return check_read(where, lease, size, size, checksum)

    def stat(self, key: str) -> Optional[Entry]:
        with self._guard:
            return self._entry(key) if key in self._files else None

    def list(self, prefix: str = "") -> Iterator[Entry]:
        with self._guard:
            return iter([self._entry(k) for k in self._files if k.startswith(prefix)])

    def list_dir(self, prefix: str = "") -> List[Entry]:
        out: Dict[str, Entry] = {}
        with self._guard:
            for k in self._files:
                if not k.startswith(prefix):
                    continue
                head, sep, _ = k[len(prefix):].partition("/")
                key = prefix + head
                out[key] = Entry(key, DIR) if sep else self._entry(key)
        return list(out.values())

    # ---- writing

    def put(self, key: str, data: Any, nbytes: Optional[int] = None) -> int:
        blob = _bytes_of(data, nbytes)
        with self._guard:
            self._store(key, blob)
        return len(blob)

    def put_if_absent(self, key: str, data: Any) -> Optional[str]:
        with self._guard:
            if key in self._files:
                return None
            return self._store(key, bytes(data))

    def append(self, key: str, data: bytes) -> int:
        with self._guard:
            old = self._files.get(key, (b"", "", 0))[0]
            self._store(key, old + bytes(data))
            return len(old)

    def delete(self, key: str) -> int:
        with self._guard:
            found = self._files.pop(key, None)
        return 0 if found is None else len(found[0])

    def delete_prefix(self, prefix: str) -> int:
        prefix = prefix.rstrip("/") + "/"
        with self._guard:
            keys = [k for k in self._files if k.startswith(prefix)]
            return sum(len(self._files.pop(k)[0]) for k in keys)

    def move(self, src_prefix: str, dst_prefix: str) -> None:
        src, dst = src_prefix.rstrip("/") + "/", dst_prefix.rstrip("/") + "/"
        with self._guard:
            for k in [k for k in self._files if k.startswith(src)]:
                self._files[dst + k[len(src):]] = self._files.pop(k)

    def copy(self, src: str, dst: str) -> None:
        with self._guard:
            found = self._files.get(src)
            if found is None:
                raise CorruptStepError(self.where(src), "missing")
            self._store(dst, found[0])


class _MemoryHold(Hold):
    def __init__(self, locker: "MemoryLocker"):
        self._locker: Optional[MemoryLocker] = locker

    def release(self) -> None:
        locker, self._locker = self._locker, None
        if locker is not None:
            locker._release()


class MemoryLocker(Locker):
    """A namespace held within this process (one holder at a time)."""

    def __init__(self, url: str = "memory:namespace"):
        self.url = url
        self._held = False
        self._guard = threading.Condition()

    def lock(self, timeout: float = 0.0) -> Hold:
        with self._guard:
            if not self._guard.wait_for(lambda: not self._held, None if timeout < 0 else timeout):
                raise LockHeldError(f"namespace {self.url} is in use by this process")
            self._held = True
        return _MemoryHold(self)

    def _release(self) -> None:
        with self._guard:
            self._held = False
            self._guard.notify_all()

    def holder(self) -> Optional[str]:
        return f"pid this process ({self.url})" if self._held else None

    def writable(self) -> Optional[str]:
        return None


__all__ = ["MemoryLocker", "MemoryStorage"]
