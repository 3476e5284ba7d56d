"""A namespace on an object store: write a payload, commit a step, list, read verified, remove,
set aside, lease.

Keys are those of the POSIX layout, relative to the namespace URL (`s3://bucket/prefix/{exp}_{proj}/
GBS...`): `{step}/[{i}/]tq_batch[_rank{r}].pt`, `.../meta[_rank{r}].json`, `{step}/commit.json`,
`.lock` (the lease), `.quarantine/...`.

- There is no rename on an object store, and a PUT is atomic (readers see no object or all of it),
  so a payload is put at its final key and its size checked with a HEAD before anything counts on
  it.
- The commit record is the last object of a step, written create-only (`If-None-Match: *`) after
  every payload of the step is written and its size checked: a second committer is told, never
  silently overwrites. A step with payloads and no commit record is incomplete.
- Removal deletes the commit record first, so a half-removed step is incomplete, never "complete".
- Set aside = server-side copies under `.quarantine/{step}-{reason}-{time}/`, then removal.
- Listing = one recursive listing of the namespace (1000 keys a request), grouped by step and
  sorted numerically (keys come in byte order: `10` before `2`). Change stamps are ETags.
- Verified reads check the size and the xxh3-128 of the stored bytes against the commit record.
- A credential that may only read is `read_only`: it serves and writes nothing.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import xxhash

from skip_harness.store.objstore.client import ObjectClient, join_url
from skip_harness.store.objstore.errors import (
    ObjectAccessDenied,
    ObjectCorrupt,
    ObjectMissing,
    ObjectStoreError,
)
from skip_harness.store.objstore.lease import DEFAULT_TTL_S, LEASE_KEY, Lease, LeaseLost

logger = logging.getLogger("skip_harness.store.objstore")

COMMIT_NAME = "commit.json"
QUARANTINE_DIR = ".quarantine"


def _step_of(name: str) -> Optional[int]:
    return int(name) if name.isdigit() and (name == "0" or not name.startswith("0")) else None


@dataclass
class StepObjects:
    """One step's objects from one listing: rel path -> size, rel path -> ETag (the change stamp)."""
    step: int
    sizes: Dict[str, int] = field(default_factory=dict)
    stamps: Dict[str, str] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return COMMIT_NAME in self.sizes

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())


class ObjectNamespace:
    """The namespace at `url` (an object-store URL)."""

    def __init__(self, url: str, client: Optional[ObjectClient] = None):
        self.client = client or ObjectClient(url)
        self.url = self.client.url
        self.read_only = False
        self.held: Optional[Lease] = None     # the lease this object took, if any

    def __repr__(self) -> str:
        return f"ObjectNamespace({self.url!r})"

    @staticmethod
    def step_key(step: int, rel: str = "") -> str:
        return f"{int(step)}/{rel}" if rel else str(int(step))

    def key_url(self, key: str) -> str:
        return join_url(self.url, key)

    # ------------------------------------------------------------------------------ writes
    def _writable(self, key: str) -> None:
        if self.read_only:
            raise ObjectAccessDenied(self.key_url(key), "read-only: this credential may not write here")
        if self.held is not None and self.held.lost.is_set():
            raise LeaseLost(self.key_url(key), "this run lost the namespace's lease to another run: "
                                               "nothing more is written")

    def write(self, step: int, rel: str, data: Any) -> int:
        """Put one payload (or meta) object of `step` and check its stored size; returns the size."""
        key = self.step_key(step, rel)
        self._writable(key)
        n = memoryview(data).nbytes
        try:
            self.client.put(key, data)
        except ObjectAccessDenied:
            self.read_only = True
            raise
        got = self.client.head(key)["size"]
        if got != n:
            raise ObjectCorrupt(self.key_url(key), f"stored {got} bytes, wrote {n}")
        return got

    def commit(self, step: int, record: bytes) -> str:
        """Write the commit record of `step`, create-only: ObjectRaceLost if one is there already.
        Call it only after every payload of the step is written and its size checked."""
        key = self.step_key(step, COMMIT_NAME)
        self._writable(key)
        return self.client.put(key, record, mode="create")

    # ------------------------------------------------------------------------------ listing
    def objects(self) -> Iterator[Dict[str, Any]]:
        """Every object of the namespace (one recursive listing)."""
        return self.client.list(None)

    def list_steps(self) -> List[StepObjects]:
        """Every step with objects, in numeric order, from one recursive listing."""
        steps: Dict[int, StepObjects] = {}
        for m in self.client.list(None):
            head, _, rel = m["path"].partition("/")
            step = _step_of(head)
            if step is None or not rel:
                continue          # .lock, .quarantine/, index objects
            s = steps.setdefault(step, StepObjects(step))
            s.sizes[rel] = int(m["size"])
            s.stamps[rel] = m.get("e_tag") or ""
        return [steps[k] for k in sorted(steps)]

    def step_numbers(self) -> List[int]:
        """Only the step numbers (a delimiter listing: one request per 1000 steps)."""
        return sorted(s for s in (_step_of(d) for d in self.client.list_dirs(None)) if s is not None)

    # ------------------------------------------------------------------------------ reads
    def read(self, step: int, rel: str) -> Any:
        """The stored bytes (an obstore.Bytes, buffer protocol), unverified: for small records."""
        return self.client.get(self.step_key(step, rel))[0]

    def read_commit(self, step: int) -> Optional[bytes]:
        try:
            return bytes(self.read(step, COMMIT_NAME))
        except ObjectMissing:
            return None

    def read_verified(self, step: int, rel: str, size: int, xxh3_128: str, out: Any = None) -> Any:
        """The object's bytes after checking size and xxh3-128 against the commit record. With `out`
        (a writable buffer of at least `size` bytes) they are copied into it and `out` is returned;
        else the obstore.Bytes itself (zero-copy) is."""
        key = self.step_key(step, rel)
        if out is None:
            data = self.client.get(key)[0]
            view = memoryview(data)
            if view.nbytes != size:
                raise ObjectCorrupt(self.key_url(key), f"{view.nbytes} bytes, the commit record says {size}")
            got = xxhash.xxh3_128_hexdigest(view)
            if got != xxh3_128:
                raise ObjectCorrupt(self.key_url(key), f"checksum {got} differs from the commit record's {xxh3_128}")
            return data
        # streamed: each chunk is hashed and copied while the next one arrives
        meta, chunks = self.client.stream(key)
        if int(meta["size"]) != size:
            raise ObjectCorrupt(self.key_url(key), f"{meta['size']} bytes, the commit record says {size}")
        dst = memoryview(out).cast("B")
        if dst.nbytes < size:
            raise ValueError(f"read_verified: buffer of {dst.nbytes} bytes for {size}")
        h, pos = xxhash.xxh3_128(), 0
        for chunk in chunks:
            mv = memoryview(chunk)
            if pos + mv.nbytes > size:
                raise ObjectCorrupt(self.key_url(key), f"more than the {size} bytes the commit record says")
            dst[pos:pos + mv.nbytes] = mv
            h.update(mv)
            pos += mv.nbytes
        if pos != size:
            raise ObjectCorrupt(self.key_url(key), f"{pos} bytes, the commit record says {size}")
        if h.hexdigest() != xxh3_128:
            raise ObjectCorrupt(self.key_url(key), f"checksum {h.hexdigest()} differs from the commit record's {xxh3_128}")
        return out

    # ------------------------------------------------------------------------------ removal
    def _step_keys(self, step: int) -> List[str]:
        return [m["path"] for m in self.client.list(self.step_key(step))]

    def remove_step(self, step: int) -> int:
        """Remove every object of `step`, the commit record first; returns the bytes removed."""
        commit = self.step_key(step, COMMIT_NAME)
        self._writable(commit)
        metas = list(self.client.list(self.step_key(step)))
        keys = [m["path"] for m in metas]
        if commit in keys:
            self.client.delete([commit])
            keys.remove(commit)
        if keys:
            self.client.delete(keys)
        return sum(int(m["size"]) for m in metas)

    def set_aside(self, step: int, reason: str) -> str:
        """Copy `step` under .quarantine/ (server side), then remove it; returns where it went."""
        dest = f"{QUARANTINE_DIR}/{int(step)}-{reason}-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9:09d}"
        self._writable(dest)
        for key in self._step_keys(step):
            self.client.copy(key, f"{dest}/{key.partition('/')[2]}")
        self.remove_step(step)
        return self.key_url(dest)

    # ------------------------------------------------------------------------------ lock
    def lease(self, *, ttl_s: float = DEFAULT_TTL_S, holder: Optional[str] = None, **kw: Any) -> Lease:
        return Lease(self.client, key=LEASE_KEY, ttl_s=ttl_s, holder=holder, **kw)

    def acquire(self, timeout: float = 0.0, **kw: Any) -> Optional[Lease]:
        """Hold the namespace (LockHeldError names the holder). A credential that may not write
        makes this namespace `read_only` and returns None: serve, write nothing."""
        lease = self.lease(**kw)
        try:
            self.held = lease.acquire(timeout)
            return self.held
        except ObjectAccessDenied as exc:
            self.read_only = True
            logger.info("%s: cannot be written (%s): complete steps are served, nothing is locked, "
                        "cleaned or written", self.url, exc.reason)
            return None

    def release(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None


def list_namespaces(dump_dir_url: str, client: Optional[ObjectClient] = None) -> List[str]:
    """The namespace URLs under a dump_dir URL: `{dump_dir}/{exp}_{proj}/{leaf}`."""
    client = client or ObjectClient(dump_dir_url)
    out = []
    for group in client.list_dirs(None):
        for leaf in client.list_dirs(group):
            out.append(join_url(client.url, group, leaf))
    return out


__all__ = ["ObjectNamespace", "StepObjects", "COMMIT_NAME", "QUARANTINE_DIR", "list_namespaces",
           "ObjectStoreError"]
