"""Who may write an object-store namespace: its lease (`lease.NamespaceLease`) as a `locking.Locker`.

- `lock` takes the lease (LockHeldError naming its holder after the timeout); a credential that may not
  write gives a read-only hold: serve, write nothing.
- `fence` is what every write of the namespace passes -- every attempt of it: the storage asks it again
  before each retry of a request -- it goes out only while the lease is ours by this process's own clock, and `strict` (before a commit record is put or removed) renews it by a
  conditional write first (docs/storage.md, "The lease"). A rank that does not hold the lease itself
  (W > 1: rank 0 took it) follows rank 0's (`follow`, told by the run marker): the lease record must
  still name that holder and not have run out.
- A credential found unable to write (a refused write: `ObjectStorage.denied`) makes every later fence
  refuse, and `writable` say so.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from skip_harness.store.locking import Hold, Locker
from skip_harness.store.objstore.errors import ObjectAccessDenied, ObjectStoreError
from skip_harness.store.objstore.lease import LEASE_KEY, NamespaceLease, LeaseExpired, LeaseLost, ttl_from_env
from skip_harness.store.objstore.storage import ObjectStorage

logger = logging.getLogger("skip_harness.store.objstore")


class LeaseHold(Hold):
    """The namespace lock as a lease (or, for a credential that may only read, none: `why` set)."""

    def __init__(self, locker: "LeaseLocker", lease: Optional[NamespaceLease], why: str = ""):
        self._locker, self._lease, self.why = locker, lease, why

    @property
    def lost(self) -> bool:
        return self._lease is not None and self._lease.lost.is_set()

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self._locker.give_back(lease)


class LeaseLocker(Locker):
    """The lease of the namespace whose objects `storage` holds."""

    def __init__(self, storage: ObjectStorage):
        self.storage = storage
        self.held: Optional[NamespaceLease] = None      # the lease this process took, if any
        self._follow: Optional[str] = None     # W > 1, a rank other than 0: the holder of the lease it writes under
        self._follow_until = 0.0
        self._guard = threading.Lock()
        storage.fence = lambda key: self.fence(key=key)     # every retry of a write passes the fence again

    @property
    def url(self) -> str:
        return self.storage.url

    def lease(self, *, ttl_s: Optional[float] = None, holder: Optional[str] = None, **kw: Any) -> NamespaceLease:
        """A lease on this namespace (not taken yet); ttl `SKIP_HARNESS_LEASE_TTL_S`, else 30 s."""
        return NamespaceLease(self.storage.client, key=LEASE_KEY, ttl_s=ttl_from_env() if ttl_s is None else ttl_s,
                     holder=holder, **kw)

    def acquire(self, timeout: float = 0.0, **kw: Any) -> Optional[NamespaceLease]:
        """Hold the namespace (LockHeldError names the holder). A credential that may not write makes
        the namespace read-only and returns None: serve, write nothing."""
        lease = self.lease(**kw)
        try:
            self.held = lease.acquire(timeout)
            return self.held
        except ObjectAccessDenied as exc:
            self.storage.denied = exc.reason
            logger.info("%s: cannot be written (%s): complete steps are served, nothing is locked, "
                        "cleaned or written", self.url, exc.reason)
            return None

    def lock(self, timeout: float = 0.0) -> Hold:
        lease = self.acquire(timeout)
        return LeaseHold(self, lease, why="" if lease is not None else self.writable() or "read-only")

    def give_back(self, lease: NamespaceLease) -> None:
        lease.release()
        if self.held is lease:
            self.held = None

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
        if self.storage.denied is not None:
            return f"{self.url}: this credential may only read here"
        return None

    def fence(self, strict: bool = False, key: str = "") -> None:
        if self.storage.denied is not None:
            raise ObjectAccessDenied(self.storage.where(key), "read-only: this credential may not write here")
        if self.held is not None:
            self.held.fence(round_trip=strict)
        elif self._follow is not None:
            self._follow_fence(force=strict)

    def follow(self, holder: str) -> None:
        if self.held is None:
            self._follow = holder

    def holder_token(self) -> str:
        return self.held.holder if self.held is not None else ""

    def lost(self) -> bool:
        return self.held is not None and self.held.lost.is_set()

    def _follow_fence(self, force: bool = False) -> None:
        """For a rank that writes under rank 0's lease: the lease record still names that holder and has
        not run out (by the record's expiry less a margin, timed from when we asked); read again once
        that time is up. LeaseLost once another run holds it."""
        holder = self._follow
        with self._guard:
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
        with self._guard:
            self._follow_until = sent + left


__all__ = ["LeaseHold", "LeaseLocker"]
