"""A namespace on an object store: write a payload, commit a step, list, read verified, remove,
set aside, lease.

Keys are those of the POSIX layout, relative to the namespace URL (`s3://bucket/prefix/{exp}_{proj}/
GBS...`): `{step}/[{i}/]tq_batch[_rank{r}].pt`, `.../meta[_rank{r}].json`, `{step}/commit.json`,
`.lock` (the lease), `.quarantine/...`.

- There is no rename on an object store, and a PUT is atomic (readers see no object or all of it),
  so a payload is put at its final key, create-only, and its size checked with a HEAD before
  anything counts on it.
- Fencing: every write, delete and commit first asks the lease (`_writable`): it goes out only while
  the lease is ours by this process's own clock; a commit record and the deletion of one follow a
  conditional renewal of the lease (docs/storage.md, "The lease").
- The commit record is the last object of a step, written create-only (`If-None-Match: *`) after
  every payload of the step is written and its size checked: a second committer is told, never
  silently overwrites. A step with payloads and no commit record is incomplete.
- Removal deletes the commit record first, so a half-removed step is incomplete, never "complete".
- Set aside = server-side copies under `.quarantine/{step}-{reason}-{time}/`, then removal.
- Listing = one recursive listing of the namespace (1000 keys a request), grouped by step and
  sorted numerically (keys come in byte order: `10` before `2`). Change stamps are ETags.
- Verified reads check the size and the xxh3-128 of the stored bytes against the commit record.
- A credential that may only read is `read_only`: it serves and writes nothing.
- The namespace index (`store.index`, `.index.jsonl`) is one object: the startup scan rewrites it
  when it is stale, and a run that committed steps rewrites it once more when it gives the namespace
  back (`release`, `flush_index`: one GET, one LIST and one PUT at the end of the run, never one a
  commit), so the next startup reads no commit record of a step this run wrote.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import xxhash

from skip_harness.errors import CorruptStepError
from skip_harness.store.backend import (
    COMMIT_NAME, DUMP_DIR_KEY, DumpDir, Hold, NamespaceBackend, NamespaceListing, StepListing, StoredFile,
)
from skip_harness.store.layout import parse_namespace_leaf, parse_step_name
from skip_harness.store.objstore.client import ObjectClient, join_url
from skip_harness.store.objstore.errors import (
    ObjectAccessDenied,
    ObjectCorrupt,
    ObjectMissing,
    ObjectRaceLost,
    ObjectStoreError,
    ObjectStoreUnavailable,
)
from skip_harness.store.objstore.lease import LEASE_KEY, Lease, LeaseExpired, LeaseLost, ttl_from_env

logger = logging.getLogger("skip_harness.store.objstore")

QUARANTINE_DIR = ".quarantine"
RUN_MARKER_PREFIX = ".run-marker-"


class LeaseHold(Hold):
    """The namespace lock as a lease (or, for a credential that may only read, none: `read_only`)."""

    def __init__(self, ns: "ObjectNamespace", lease: Optional[Lease], read_only: bool = False):
        self._ns, self._lease, self.read_only = ns, lease, read_only

    @property
    def lost(self) -> bool:
        return self._lease is not None and self._lease.lost.is_set()

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self._ns.give_back(lease)


def _corrupt(exc: ObjectStoreError) -> CorruptStepError:
    return CorruptStepError(exc.url, exc.reason)


class ObjectNamespace(NamespaceBackend):
    """The namespace at `url` (an object-store URL)."""

    def __init__(self, url: str, client: Optional[ObjectClient] = None):
        self.client = client or ObjectClient(url)
        self.url = self.client.url
        self.read_only = False
        self.held: Optional[Lease] = None     # the lease this object took, if any
        self._committed: Dict[int, Tuple[bytes, str]] = {}   # step -> (commit record, its ETag) put here
        self._committed_guard = threading.Lock()
        self._follow: Optional[str] = None    # W > 1, a rank other than 0: the holder of the lease it writes under
        self._follow_until = 0.0

    def __repr__(self) -> str:
        return f"ObjectNamespace({self.url!r})"

    @staticmethod
    def step_key(step: int, rel: str = "") -> str:
        return f"{int(step)}/{rel}" if rel else str(int(step))

    def key_url(self, key: str) -> str:
        return join_url(self.url, key)

    # ------------------------------------------------------------------------------ writes
    def _writable(self, key: str, *, round_trip: bool = False) -> None:
        """Return only while this process may write `key`: not read-only, and the namespace's lease
        still ours by our own clock (`Lease.fence`; with `round_trip`, renewed by a conditional put
        first). A rank that does not hold the lease itself (W > 1) follows rank 0's (`_follow_fence`)."""
        if self.read_only:
            raise ObjectAccessDenied(self.key_url(key), "read-only: this credential may not write here")
        if self.held is not None:
            self.held.fence(round_trip=round_trip)
        elif self._follow is not None:
            self._follow_fence(force=round_trip)

    def _follow_fence(self, force: bool = False) -> None:
        """For a rank that writes under rank 0's lease: the lease record still names that holder and has
        not run out (by the record's expiry less a margin, timed from when we asked); read again once
        that time is up. LeaseLost once another run holds it."""
        holder = self._follow
        with self._committed_guard:
            if not force and time.monotonic() < self._follow_until:
                return
        sent = time.monotonic()
        probe = self.lease()
        record, _ = probe.read()
        if record is None or record.holder != holder:
            who = record.describe() if record is not None else "nobody (the lease object is gone)"
            raise LeaseLost(probe.url, f"the lease of this run ({holder}) is now {who}'s: nothing more is written")
        left = record.expires_at - time.time() - min(record.ttl_s / 3, 5.0)
        if left <= 0:
            raise LeaseExpired(probe.url, f"the lease of this run ({holder}) ran out without renewal: "
                                          "nothing is written until it is renewed")
        with self._committed_guard:
            self._follow_until = sent + left

    def write(self, step: int, rel: str, data: Any) -> int:
        """Put one payload (or meta) object of `step` and check its stored size; returns the size. The
        put is create-only: a step is normally cleared (`remove_step`) before it is written, and a
        request of a stalled run that reaches the server after another run took the namespace over
        (a put obstore retries) then writes nothing over that run's files. An object already there
        (a step rewritten in place) is replaced only after a conditional renewal of the lease."""
        key = self.step_key(step, rel)
        self._writable(key)
        n = memoryview(data).nbytes
        self._put(key, data, step_file=True)
        got = self.client.head(key)["size"]
        if got != n:
            raise ObjectCorrupt(self.key_url(key), f"stored {got} bytes, wrote {n}")
        return got

    def _put(self, key: str, data: Any, *, step_file: bool) -> None:
        try:
            try:
                self.client.put(key, data, mode="create" if step_file else None)
            except ObjectRaceLost:
                # a file of a step being rewritten in place: replaced only right after a conditional
                # renewal of the lease proved it ours (a stale run's retried put never gets here)
                self._writable(key, round_trip=True)
                self.client.put(key, data)
        except ObjectAccessDenied:
            self.read_only = True
            raise

    def write_payload(self, step: int, rel: str, buffer: Any, nbytes: int) -> int:
        view = buffer.view(nbytes) if hasattr(buffer, "view") and callable(buffer.view) else \
            memoryview(buffer).cast("B")[:nbytes]
        return self.write(step, rel, view)

    def write_small(self, key: str, data: bytes) -> None:
        """A small object: a step's (a meta file) create-only as in `write`; the index and markers
        replace what is there."""
        self._writable(key)
        self._put(key, data, step_file=parse_step_name(key.partition("/")[0]) is not None)

    def commit(self, step: int, record: bytes) -> None:
        """Write the commit record of `step`, create-only (CorruptStepError if one is there already).
        Call it only after every payload of the step is written and its size checked."""
        key = self.step_key(step, COMMIT_NAME)
        self._writable(key, round_trip=True)
        try:
            etag = self.client.put(key, record, mode="create")
        except ObjectRaceLost:
            raise CorruptStepError(self.key_url(key), "a commit record is there already") from None
        with self._committed_guard:
            self._committed[int(step)] = (bytes(record), etag)

    def uncommit(self, step: int) -> None:
        key = self.step_key(step, COMMIT_NAME)
        self._writable(key)
        self._forget(step)
        try:
            self.client.head(key)              # the usual case: none there, nothing to delete
        except ObjectMissing:
            return
        self._writable(key, round_trip=True)
        self.client.delete([key])

    def _forget(self, step: int) -> None:
        with self._committed_guard:
            self._committed.pop(int(step), None)

    # ------------------------------------------------------------------------------ index
    def flush_index(self) -> Optional[str]:
        """Add the steps this object committed to the index object: one GET of the index, one
        listing, one PUT (nothing when it committed nothing). An entry is made only for a step whose
        listed commit record has the ETag our put returned and lists exactly the sizes listed.
        Returns None when written (or nothing to do), else why not. Never raises: a hint."""
        from skip_harness.store import index
        from skip_harness.store.layout import Layout, UrlPath
        from skip_harness.store.status import parse_commit

        with self._committed_guard:
            committed, self._committed = self._committed, {}
        if not committed or self.read_only:
            return None
        kw = parse_namespace_leaf(self.url.rstrip("/").rsplit("/", 1)[-1])
        if kw is None:
            return None
        layout = Layout(UrlPath(self.url), K=kw[0], W=kw[1])
        try:
            data = self.read_index()           # an outage ends the flush here, not after more timeouts
            try:
                entries = {} if data is None else index.parse(layout, bytes(data))
            except index.IndexUnusable:
                entries = {}
            listed = {s.step: s for s in self.list_steps().steps}
            for step, (record, etag) in committed.items():
                entries.pop(step, None)
                s = listed.get(step)
                stored = None if s is None else s.files.get(COMMIT_NAME)
                if stored is None or not etag or stored.stamp != etag:
                    continue                    # rewritten or removed since: the next scan reads it
                try:
                    rec = parse_commit(record, layout, step, self.key_url(self.step_key(step, COMMIT_NAME)))
                except CorruptStepError:
                    continue
                if any(s.files.get(f.rel) is None or s.files[f.rel].size != f.bytes for f in rec.files):
                    continue
                fp = None if rec.fingerprint is None else rec.fingerprint.to_json()
                entries[step] = index.url_entry(step, s.total, fp, rec.created, rec.gen_s, index.listing_stamp(s))
            entries = {k: e for k, e in entries.items() if k in listed}
        except (ObjectStoreError, ValueError) as exc:
            return str(exc)
        return index.write_url(layout, self, entries.values())

    def _flush_index_quietly(self) -> None:
        why = self.flush_index()
        if why is not None:
            logger.info("%s: the namespace index was not updated (%s): the next startup reads the "
                        "commit records of this run's steps", self.url, why)

    # ------------------------------------------------------------------------------ listing
    def objects(self) -> Iterator[Dict[str, Any]]:
        """Every object of the namespace (one recursive listing)."""
        return self.client.list(None)

    def list_steps(self) -> NamespaceListing:
        """Every step with objects, in numeric order, from one recursive listing (1000 keys a
        request); the ETag is each object's change stamp. An object store has no temporaries and
        no links: a step's objects are all it has."""
        steps: Dict[int, Dict[str, StoredFile]] = {}
        for m in self.client.list(None):
            head, _, rel = m["path"].partition("/")
            step = parse_step_name(head)
            if step is None or not rel:
                continue          # .lock, .index, .quarantine/, run markers
            steps.setdefault(step, {})[rel] = StoredFile(rel, int(m["size"]), m.get("e_tag") or "")
        return NamespaceListing(tuple(StepListing(k, steps[k], total=sum(f.size for f in steps[k].values()))
                                      for k in sorted(steps)))

    def list_step(self, step: int) -> Optional[StepListing]:
        prefix = self.step_key(step)
        files = {m["path"][len(prefix) + 1:]: StoredFile(m["path"][len(prefix) + 1:], int(m["size"]), m.get("e_tag") or "")
                 for m in self.client.list(prefix)}
        return StepListing(int(step), files, total=sum(f.size for f in files.values())) if files else None

    def modified(self, key: str = "") -> Optional[float]:
        """The newest last-modified time of the objects under `key` (a step number; '' the namespace)."""
        newest = None
        for m in self.client.list(key or None):
            t = m.get("last_modified")
            if t is not None and (newest is None or t.timestamp() > newest):
                newest = t.timestamp()
        return newest

    def step_numbers(self) -> List[int]:
        """Only the step numbers (a delimiter listing: one request per 1000 steps)."""
        return sorted(s for s in (parse_step_name(d) for d in self.client.list_dirs(None)) if s is not None)

    # ------------------------------------------------------------------------------ reads
    def read(self, step: int, rel: str) -> Any:
        """The stored bytes (an obstore.Bytes, buffer protocol), unverified: for small records."""
        return self.client.get(self.step_key(step, rel))[0]

    def read_small(self, key: str) -> Optional[bytes]:
        try:
            return bytes(self.client.get(key)[0])
        except ObjectMissing:
            return None

    def read_small_tagged(self, key: str) -> Tuple[Optional[bytes], Optional[str]]:
        """(bytes, the ETag they came with) of a small object; (None, None) when there is none. The
        scan indexes a step only when its commit record's ETag is the one its listing gave."""
        try:
            data, meta = self.client.get(key)
        except ObjectMissing:
            return None, None
        return bytes(data), meta.get("e_tag")

    def read_commit(self, step: int) -> Optional[bytes]:
        return self.read_small(self.step_key(step, COMMIT_NAME))

    def read_verified(self, step: int, rel: str, size: int, checksum: str, pool: Any) -> Tuple[Any, int]:
        """Streamed into a buffer leased from `pool`, each chunk hashed as it arrives; CorruptStepError
        naming the object when it is missing, of another size or checksum."""
        lease = pool.acquire(size)
        try:
            self.read_checked(step, rel, size, checksum, lease.view(size))
        except ObjectMissing as exc:
            lease.release()
            raise CorruptStepError(exc.url, "missing") from None
        except ObjectCorrupt as exc:
            lease.release()
            raise _corrupt(exc) from None
        except BaseException:
            lease.release()
            raise
        return lease, size

    def read_checked(self, step: int, rel: str, size: int, xxh3_128: str, out: Any = None) -> Any:
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
        self._forget(step)
        metas = list(self.client.list(self.step_key(step)))
        keys = [m["path"] for m in metas]
        if commit in keys:
            self._writable(commit, round_trip=True)
            self.client.delete([commit])
            keys.remove(commit)
        if keys:
            self._writable(keys[0])
            self.client.delete(keys)
        return sum(int(m["size"]) for m in metas)

    def set_aside(self, step: int, reason: str) -> str:
        """Copy `step` under .quarantine/ (server side), then remove it; returns where it went."""
        dest = f"{QUARANTINE_DIR}/{int(step)}-{reason}-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9:09d}"
        for key in self._step_keys(step):
            self._writable(dest)
            self.client.copy(key, f"{dest}/{key.partition('/')[2]}")
        self.remove_step(step)
        return self.key_url(dest)

    # ------------------------------------------------------------------------------ lock
    def lease(self, *, ttl_s: Optional[float] = None, holder: Optional[str] = None, **kw: Any) -> Lease:
        """A lease on this namespace (not taken yet); ttl `SKIP_HARNESS_LEASE_TTL_S`, else 30 s."""
        return Lease(self.client, key=LEASE_KEY, ttl_s=ttl_from_env() if ttl_s is None else ttl_s,
                     holder=holder, **kw)

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
            self.give_back(self.held)

    def give_back(self, lease: Lease) -> None:
        """Release `lease`, first adding this run's commits to the index while the namespace is still
        ours (not when the lease was lost: another run holds it now)."""
        if not lease.lost.is_set():
            self._flush_index_quietly()
        lease.release()
        if self.held is lease:
            self.held = None

    def lock(self, timeout: float = 0.0) -> Hold:
        lease = self.acquire(timeout)
        return LeaseHold(self, lease, read_only=lease is None)

    def holder(self) -> Optional[str]:
        """The holder of a lease that has not expired (and whose process is not known dead), read
        without writing anything; None when nobody holds the namespace or the lease cannot be read."""
        lease = self.lease()
        try:
            record, _etag = lease.read()
        except ObjectStoreError:
            return None
        if record is None or record.expires_at + lease.skew_s <= time.time() or lease.holder_dead(record):
            return None
        return record.describe()

    def writable(self) -> Optional[str]:
        """What is known without writing: a credential found read-only (a denied write or lease)."""
        if self.read_only:
            return f"{self.url}: this credential may only read here"
        return None

    def put_run_marker(self, token: str) -> None:
        """The marker names the lease this run holds: the other ranks write under it (`_follow_fence`)."""
        holder = self.held.holder if self.held is not None else ""
        self.write_small(RUN_MARKER_PREFIX + token, json.dumps({"lease_holder": holder}).encode())

    def sees_run_marker(self, token: str, wait: float = 0.0) -> bool:
        deadline = time.monotonic() + wait
        while True:
            data = self.read_small(RUN_MARKER_PREFIX + token)
            if data is not None:
                try:
                    holder = json.loads(data).get("lease_holder") if data else None
                except ValueError:
                    holder = None
                if holder and self.held is None:
                    self._follow = str(holder)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def remove_run_marker(self, token: str) -> None:
        if self.read_only or (self.held is not None and self.held.lost.is_set()):
            return
        self._writable(RUN_MARKER_PREFIX + token)
        self.client.delete([RUN_MARKER_PREFIX + token])


class ObjectDumpDir(DumpDir):
    """A dump_dir URL: namespaces are key prefixes `{experiment}_{project}/{leaf}/` under it."""

    def __init__(self, url: str):
        self.client = ObjectClient(url)
        self.url = self.client.url

    def namespace(self, rel: str) -> ObjectNamespace:
        leaf = rel.rstrip("/").rsplit("/", 1)[-1]
        if parse_namespace_leaf(leaf) is None:
            raise ValueError(f"{join_url(self.url, rel)}: {leaf!r} is not a namespace name")
        return ObjectNamespace(join_url(self.url, rel))

    def list_namespaces(self) -> List[str]:
        try:
            return self._list_namespaces()
        except ObjectStoreUnavailable as exc:     # the first request to the dump_dir: name the key
            raise ObjectStoreUnavailable(exc.url, exc.reason, key=DUMP_DIR_KEY) from None

    def _list_namespaces(self) -> List[str]:
        out = []
        for group in self.client.list_dirs(None):
            if group.startswith("."):
                continue
            out += [f"{group}/{leaf}" for leaf in self.client.list_dirs(group) if parse_namespace_leaf(leaf) is not None]
        return sorted(out)


def open_dump_dir(url: str) -> ObjectDumpDir:
    """The hook `store.backend.open_dump_dir` calls for a URL."""
    return ObjectDumpDir(url)


def list_namespaces(dump_dir_url: str, client: Optional[ObjectClient] = None) -> List[str]:
    """The namespace URLs under a dump_dir URL: `{dump_dir}/{exp}_{proj}/{leaf}`."""
    client = client or ObjectClient(dump_dir_url)
    out = []
    for group in client.list_dirs(None):
        for leaf in client.list_dirs(group):
            out.append(join_url(client.url, group, leaf))
    return out


__all__ = ["LeaseHold", "ObjectDumpDir", "ObjectNamespace", "QUARANTINE_DIR", "list_namespaces", "open_dump_dir"]
