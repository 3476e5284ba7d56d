"""A storage backend as a package outside skip_harness would write one: `dict://BUCKET/PREFIX`, a dict per
bucket in this process (keys under a prefix, no directories: an object store's shape).

Written against the backend seam alone -- `store.registry.Backend`, `store.storage.Storage` (the
operations' docstrings are the contract), `store.locking.Locker`, `store.checksum` -- and registered
through the registry (tests/test_backend_registry.py: `register_backend`, and the entry point group
`skip_harness.backends` in a subprocess). It passes `skip_harness.testing.store_tests.StoreTests`.
Nothing registers it on import.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

from skip_harness.errors import CorruptStepError, LockHeldError
from skip_harness.store.checksum import check_read
from skip_harness.store.locking import Hold, Locker
from skip_harness.store.registry import Backend
from skip_harness.store.storage import DIR, FILE, Capabilities, Entry, Storage

SCHEME = "dict"

_buckets: Dict[str, Dict[str, Tuple[bytes, str]]] = {}     # bucket -> {key: (bytes, stamp)}
_holders: Dict[str, str] = {}                               # namespace URL -> who holds it
_guard = threading.RLock()
_writes = itertools.count(1)


def _bytes(data: Any, nbytes: Optional[int]) -> bytes:
    view = data.view(nbytes) if callable(getattr(data, "view", None)) else memoryview(data).cast("B")
    return bytes(view if nbytes is None else view[:nbytes])


class DictStorage(Storage):
    """The keys of one bucket under one prefix."""

    caps = Capabilities()          # nothing beyond the common operations

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        bucket, _, prefix = self.url.partition("://")[2].partition("/")
        with _guard:
            self._files = _buckets.setdefault(bucket, {})
        self._prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    def _entry(self, full: str) -> Entry:
        data, stamp = self._files[full]
        return Entry(full[len(self._prefix):], FILE, len(data), stamp)

    def get(self, key: str) -> Optional[bytes]:
        with _guard:
            found = self._files.get(self._prefix + key)
        return None if found is None else found[0]

    def get_verified(self, key: str, size: int, checksum: str, pool: Any) -> Any:
        data, where = self.get(key), self.where(key)
        if data is None:
            raise CorruptStepError(where, "missing")
        if len(data) != size:
            raise CorruptStepError(where, f"{len(data)} bytes, the commit record says {size}")
        lease = pool.acquire(size)
        lease.view(size)[:] = data
        return check_read(where, lease, size, size, checksum)

    def stat(self, key: str) -> Optional[Entry]:
        with _guard:
            return self._entry(self._prefix + key) if self._prefix + key in self._files else None

    def list(self, prefix: str = "") -> Iterator[Entry]:
        start = self._prefix + prefix
        with _guard:
            return iter([self._entry(k) for k in self._files if k.startswith(start)])

    def list_dir(self, prefix: str = "") -> List[Entry]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        out: Dict[str, Entry] = {}
        for e in self.list(prefix):
            head, sep, _ = e.key[len(prefix):].partition("/")
            out[prefix + head] = Entry(prefix + head, DIR) if sep else e
        return list(out.values())

    def put(self, key: str, data: Any, nbytes: Optional[int] = None) -> int:
        blob = _bytes(data, nbytes)
        with _guard:
            self._files[self._prefix + key] = (blob, f"w{next(_writes)}")
        return len(blob)

    def put_if_absent(self, key: str, data: Any) -> Optional[str]:
        with _guard:
            if self._prefix + key in self._files:
                return None
            self.put(key, data)
            return self._files[self._prefix + key][1]

    def delete(self, key: str) -> int:
        with _guard:
            found = self._files.pop(self._prefix + key, None)
        return 0 if found is None else len(found[0])

    def delete_prefix(self, prefix: str) -> int:
        start = self._prefix + prefix.rstrip("/") + "/"
        with _guard:
            return sum(len(self._files.pop(k)[0]) for k in [k for k in self._files if k.startswith(start)])

    def copy(self, src: str, dst: str) -> None:
        data = self.get(src)
        if data is None:
            raise CorruptStepError(self.where(src), "missing")
        self.put(dst, data)


class _DictHold(Hold):
    def __init__(self, url: str):
        self._url: Optional[str] = url

    def release(self) -> None:
        url, self._url = self._url, None
        if url is not None:
            with _guard:
                _holders.pop(url, None)


class DictLocker(Locker):
    """One holder per namespace URL in this process."""

    def __init__(self, url: str):
        self.url = url

    def lock(self, timeout: float = 0.0) -> Hold:
        with _guard:
            if self.url in _holders:
                raise LockHeldError(f"namespace {self.url} is held by {_holders[self.url]}")
            _holders[self.url] = "this process"
        return _DictHold(self.url)

    def holder(self) -> Optional[str]:
        with _guard:
            return _holders.get(self.url)

    def writable(self) -> Optional[str]:
        return None


class DictBackend(Backend):
    """`dict://BUCKET/PREFIX`: the dump_dir's keys under PREFIX, each namespace's under its own."""

    schemes = (SCHEME,)

    def dump_dir(self, url: str) -> Storage:
        return DictStorage(url)

    def namespace(self, layout: Any) -> Tuple[Storage, Locker]:
        url = str(layout.root)
        return DictStorage(url), DictLocker(url)


__all__ = ["DictBackend", "DictLocker", "DictStorage", "SCHEME"]
