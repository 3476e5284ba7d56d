"""The object-store storage: a namespace is a key prefix of a bucket (`s3://bucket/prefix/{exp}_{proj}/GBS...`).

What stays of the measured design: a PUT at the final key (atomic: readers see no object or all of it;
one request up to S3's 5 GiB, which a killed run leaves no trace of), create-only puts
(`If-None-Match: *`, `put_if_absent`), the ETag as every object's change stamp, verified reads streamed
into a pool buffer and hashed chunk by chunk as they arrive, listings of 1000 keys a request. There is
no rename, no append, no directory, no link and no temporary: `caps` says so, and `store.namespace`
copies instead of renaming and rewrites the index once instead of appending. Who may write (the lease)
is `store.objstore.locker`'s. The contract is `store.storage`'s.

A credential found unable to write (`ObjectAccessDenied` on a write) is remembered in `denied`: the
locker then refuses every later write, and the run serves what is there.

Every write (put, create-only put, delete, copy) is sent with the namespace's `fence` (set by its
locker, `locker.LeaseLocker`): the namespace fences before a write, and the client asks the fence again
before every retry of it (`ObjectClient._fenced`), so a request that failed while the run stalled is not
sent again once the lease passed to another run.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from skip_harness.errors import CorruptStepError
from skip_harness.store.checksum import checksum_bytes, hasher
from skip_harness.store.objstore.client import ObjectClient
from skip_harness.store.objstore.errors import (
    ObjectAccessDenied, ObjectCorrupt, ObjectMissing, ObjectRaceLost, ObjectStoreUnavailable,
)
from skip_harness.store.storage import DIR, FILE, Capabilities, Entry, Storage
from skip_harness.store.urls import DUMP_DIR_KEY


def _ns(meta: Dict[str, Any]) -> Optional[int]:
    t = meta.get("last_modified")
    return None if t is None else int(t.timestamp() * 1e9)


def _view(data: Any, nbytes: Optional[int]) -> memoryview:
    view = data.view(nbytes) if hasattr(data, "view") and callable(data.view) else memoryview(data).cast("B")
    return view if nbytes is None else view[:nbytes]


class ObjectStorage(Storage):
    """The objects under `url` (an object-store URL). `dump_dir`: this storage is a whole dump_dir, so an
    outage on its first listing names `skip.rollout_tq.dump_dir`."""

    caps = Capabilities()          # no mmap, access times, append, rename or directories

    def __init__(self, url: str, client: Optional[ObjectClient] = None, *, dump_dir: bool = False):
        self.client = client or ObjectClient(url)
        self.url = self.client.url
        self.dump_dir = dump_dir
        self.denied: Optional[str] = None      # why this credential may not write, once a write was refused
        self.fence: Optional[Callable[[str], None]] = None   # asked before every retry of a write (the locker's)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    def _entry(self, m: Dict[str, Any], key: Optional[str] = None) -> Entry:
        return Entry(m["path"] if key is None else key, FILE, int(m["size"]), m.get("e_tag") or "", _ns(m))

    def _writing(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, fence=self.fence, **kw)
        except ObjectAccessDenied as exc:
            self.denied = exc.reason
            raise

    # ---- reading

    def get(self, key: str) -> Optional[bytes]:
        return self.get_stamped(key)[0]

    def get_stamped(self, key: str) -> Tuple[Optional[bytes], Optional[str]]:
        try:
            data, meta = self.client.get(key)
        except ObjectMissing:
            return None, None
        return bytes(data), meta.get("e_tag")

    def get_verified(self, key: str, size: int, checksum: str, pool: Any) -> Any:
        lease = pool.acquire(size)
        try:
            self.read_checked(key, size, checksum, lease.view(size))
        except ObjectMissing as exc:
            lease.release()
            raise CorruptStepError(exc.url, "missing") from None
        except BaseException:                  # ObjectCorrupt is a CorruptStepError as it is
            lease.release()
            raise
        return lease

    def read_checked(self, key: str, size: int, xxh3_128: str, out: Any = None) -> Any:
        """The object's bytes after checking size and xxh3-128. With `out` (a writable buffer of at least
        `size` bytes) they are streamed into it, each chunk hashed and copied while the next one arrives,
        and `out` is returned; else the obstore.Bytes itself (zero-copy). ObjectMissing, ObjectCorrupt."""
        url = self.where(key)
        if out is None:
            data = self.client.get(key)[0]
            view = memoryview(data)
            if view.nbytes != size:
                raise ObjectCorrupt(url, f"{view.nbytes} bytes, the commit record says {size}")
            got = checksum_bytes(view)
            if got != xxh3_128:
                raise ObjectCorrupt(url, f"checksum {got} differs from the commit record's {xxh3_128}")
            return data
        meta, chunks = self.client.stream(key)
        if int(meta["size"]) != size:
            raise ObjectCorrupt(url, f"{meta['size']} bytes, the commit record says {size}")
        dst = memoryview(out).cast("B")
        if dst.nbytes < size:
            raise ValueError(f"read_verified: buffer of {dst.nbytes} bytes for {size}")
        h, pos = hasher(), 0
        for chunk in chunks:
            mv = memoryview(chunk)
            if pos + mv.nbytes > size:
                raise ObjectCorrupt(url, f"more than the {size} bytes the commit record says")
            dst[pos:pos + mv.nbytes] = mv
            h.update(mv)
            pos += mv.nbytes
        if pos != size:
            raise ObjectCorrupt(url, f"{pos} bytes, the commit record says {size}")
        if h.hexdigest() != xxh3_128:
            raise ObjectCorrupt(url, f"checksum {h.hexdigest()} differs from the commit record's {xxh3_128}")
        return out

    def stat(self, key: str) -> Optional[Entry]:
        try:
            return self._entry(self.client.head(key), key)
        except ObjectMissing:
            return None

    def list(self, prefix: str = "") -> Iterator[Entry]:
        for m in self.client.list(prefix.rstrip("/") or None):
            yield self._entry(m)

    def list_dir(self, prefix: str = "") -> List[Entry]:
        top = prefix.rstrip("/")
        try:
            dirs, objects = self.client.list_dir(top or None)
        except ObjectStoreUnavailable as exc:
            if self.dump_dir and not top:       # the first request to the dump_dir: name the key
                raise ObjectStoreUnavailable(exc.url, exc.reason, key=DUMP_DIR_KEY) from None
            raise
        return [Entry(d, DIR) for d in dirs] + [self._entry(m) for m in objects]

    # ---- writing

    def put(self, key: str, data: Any, nbytes: Optional[int] = None) -> int:
        """One PUT (multipart only past 5 GiB); returns the bytes it stored."""
        view = _view(data, nbytes)
        self._writing(self.client.put, key, view)
        return view.nbytes

    def put_if_absent(self, key: str, data: Any) -> Optional[str]:
        try:
            return self._writing(self.client.put, key, data, mode="create")
        except ObjectRaceLost:
            return None

    def delete(self, key: str) -> int:
        found = self.stat(key)
        if found is None:
            return 0
        self._writing(self.client.delete, [key])
        return found.size

    def delete_prefix(self, prefix: str) -> int:
        found = list(self.list(prefix.rstrip("/") + "/"))
        if found:
            self._writing(self.client.delete, [e.key for e in found])
        return sum(e.size for e in found)

    def copy(self, src: str, dst: str) -> None:
        self._writing(self.client.copy, src, dst)


__all__ = ["ObjectStorage"]
