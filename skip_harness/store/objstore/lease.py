"""The namespace lock on an object store: a lease object.

There is no flock on S3 and nothing the server releases when a process dies, so one run holds the
namespace by a small JSON object at `{namespace}/.lock` (holder, host, pid, since, ttl_s,
expires_at), with conditional writes deciding every race:

- acquire: create it with a create-only put (`If-None-Match: *`). If it exists and has not expired,
  the namespace is held: refuse naming holder, host, pid and since (after waiting `timeout`
  seconds, as `skip.rollout_tq.lock_timeout` asks). If it has expired (its run was killed and
  stopped renewing), take it over with an If-Match put on the ETag read; losing that race is a
  refusal too.
- renew: a thread rewrites it every ttl/3 with If-Match on our last ETag. A mismatch means another
  run took it over (this run was stalled past its expiry): `lost` is set and the run must stop
  writing. A transient failure is a warning and the next renewal tries again.
- release: a conditional put of an already-expired record (obstore has no conditional delete), so a
  run that lost its lease never removes its successor's.
- fence: every write, delete and commit of the namespace first asks `fence()`. It goes out only while
  the lease is still ours by this process's own monotonic clock: the last successful renewal (the
  moment its request was SENT) + ttl - `margin_s` has not passed. Past that, `fence` renews first
  (an If-Match put); a mismatch means another run took it over: `lost`, and the write never goes out.
  The monotonic clock keeps running while the process is stopped (SIGSTOP, a VM freeze), so a run
  resumed after its lease expired finds out before its next request, not when its renewal thread
  next wakes. `fence(round_trip=True)` always renews first: a commit record or a removal then follows
  a conditional write on the lease by one request (S3 cannot condition a write on another object).

A credential that may only read cannot create the lease: `ObjectAccessDenied`, which the caller
turns into "serve complete steps, write nothing".

Expiry compares wall clocks of different hosts: a lease counts as expired only `skew_s` seconds
after its `expires_at`.

A killed run on THIS host need not be waited out: when the record's host is this hostname (and,
where the record carries it, the same boot and pid namespace: `host_id`) and its pid is gone
(`os.kill(pid, 0)` -> ProcessLookupError, or a zombie nobody reaped yet), the lease is taken over at
once with the same If-Match put as an expired one. A live pid, a pid that is not ours to signal, or
another host: wait for the expiry as before.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from skip_harness.errors import CacheWritesStopped, LockHeldError
from skip_harness.store.objstore.client import ObjectClient
from skip_harness.store.objstore.errors import ObjectMissing, ObjectRaceLost, ObjectStoreError, ObjectStoreUnavailable

logger = logging.getLogger("skip_harness.store.objstore")

LEASE_KEY = ".lock"
DEFAULT_TTL_S = 30.0
DEFAULT_SKEW_S = 2.0
TTL_ENV = "SKIP_HARNESS_LEASE_TTL_S"      # the ttl a run's lease gets (tests make it short)


def ttl_from_env() -> float:
    """The lease ttl: `SKIP_HARNESS_LEASE_TTL_S` (seconds, > 0), else 30 s."""
    from skip_harness.store.objstore.errors import ObjectStoreConfigError
    raw = os.environ.get(TTL_ENV)
    if not raw:
        return DEFAULT_TTL_S
    try:
        value = float(raw)
        if not value > 0:
            raise ValueError
        return value
    except ValueError:
        raise ObjectStoreConfigError(repr(raw), "must be a positive number of seconds", key=TTL_ENV) from None


def _host_id() -> str:
    """This machine's boot and pid namespace ('' where unknown): two containers may share a hostname
    but not a pid namespace, and a pid is only meaningful inside its own."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        return ""
    return " ".join(parts)


def _pid_gone(pid: int) -> bool:
    """Whether process `pid` of this host is dead: no such process, or a zombie (killed, not yet
    reaped: it renews nothing). A process we may not signal counts as alive."""
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:          # PermissionError: alive, someone else's
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].startswith(b"Z")
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    host: str
    pid: int
    since: float
    ttl_s: float
    expires_at: float
    host_id: str = ""       # boot id + pid namespace of the holder (records written before: "")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> Optional["LeaseRecord"]:
        try:
            doc = json.loads(bytes(data))
            return cls(str(doc["holder"]), str(doc["host"]), int(doc["pid"]), float(doc["since"]),
                       float(doc["ttl_s"]), float(doc["expires_at"]), str(doc.get("host_id") or ""))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"{self.holder} (pid {self.pid} on host {self.host} since {when})"


_held: "set[NamespaceLease]" = set()
_held_mutex = threading.Lock()


def _release_at_exit() -> None:
    """No lease outlives its run: one still held at interpreter exit is released (a killed run's
    expires after its ttl)."""
    with _held_mutex:
        leases = list(_held)
    for lease in leases:
        try:
            lease.release()
        except Exception:  # exit: nothing more to do
            pass


atexit.register(_release_at_exit)


class LeaseLost(ObjectStoreError, CacheWritesStopped):
    """Another run took the lease over: this run must stop writing (for good)."""


class LeaseExpired(ObjectStoreUnavailable):
    """By this process's own clock the lease has run out and it could not be renewed (the store out of
    reach): nothing is written until a renewal succeeds."""


class NamespaceLease:
    """One run's hold on a namespace URL. `acquire(timeout)`, then `release()` (or a `with`)."""

    def __init__(self, client: ObjectClient, *, key: str = LEASE_KEY, ttl_s: float = DEFAULT_TTL_S,
                 skew_s: float = DEFAULT_SKEW_S, holder: Optional[str] = None):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 s, got {ttl_s}")
        self.client, self.key, self.ttl_s, self.skew_s = client, key, float(ttl_s), float(skew_s)
        # how long before the end of the ttl (by our clock) we stop trusting the lease: covers the time a
        # request takes to reach the server after `fence` let it go
        self.margin_s = min(self.ttl_s / 3, 5.0)
        self._valid_until = 0.0          # time.monotonic() until which the lease is ours (see fence)
        self.taken_by: Optional[str] = None   # who took it over, once lost
        self.holder = holder or f"run-{uuid.uuid4().hex[:12]}"
        self.host, self.pid, self.host_id = socket.gethostname(), os.getpid(), _host_id()
        self.since = 0.0
        self.etag: Optional[str] = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._mutex = threading.Lock()

    @property
    def url(self) -> str:
        return self.client.key_url(self.key)

    @property
    def held(self) -> bool:
        return self.etag is not None and not self.lost.is_set()

    def _record(self, expires_at: float) -> bytes:
        return LeaseRecord(self.holder, self.host, self.pid, self.since, self.ttl_s, expires_at,
                           self.host_id).to_bytes()

    def holder_dead(self, record: LeaseRecord) -> bool:
        """Whether `record`'s holder is a process of this host that is gone (killed): its lease may be
        taken over before it expires."""
        if record.host != self.host or record.pid <= 0:
            return False
        if record.host_id and self.host_id and record.host_id != self.host_id:
            return False         # same hostname, another boot or pid namespace: its pid means nothing here
        return _pid_gone(record.pid)

    def read(self) -> "tuple[Optional[LeaseRecord], Optional[str]]":
        """(the current record, its ETag), (None, None) when there is none."""
        try:
            data, meta = self.client.get(self.key)
        except ObjectMissing:
            return None, None
        return LeaseRecord.parse(data), meta.get("e_tag")

    def try_acquire(self) -> Optional[LeaseRecord]:
        """Take the lease if it is free or expired: None on success, else the record in the way."""
        sent = time.monotonic()
        self.since = time.time()
        try:
            self.etag = self.client.put(self.key, self._record(self.since + self.ttl_s), mode="create")
            self._valid_until = sent + self.ttl_s - self.margin_s
            return None
        except ObjectRaceLost:
            pass
        current, seen = self.read()
        if self._ours(current, seen):       # our create landed, its reply was lost and the retry refused
            self.etag = seen
            self._valid_until = sent + self.ttl_s - self.margin_s
            return None
        if seen is None:      # released and removed between our two calls: try again next round
            return LeaseRecord("(released just now)", "?", 0, time.time(), 0.0, time.time() + 1)
        dead = False
        if current is not None and current.expires_at + self.skew_s > time.time():
            dead = self.holder_dead(current)
            if not dead:
                return current
        sent = time.monotonic()
        try:
            self.etag = self.client.put(self.key, self._record(self.since + self.ttl_s), mode={"e_tag": seen})
            self._valid_until = sent + self.ttl_s - self.margin_s
        except (ObjectRaceLost, ObjectMissing):
            return current or LeaseRecord("(another run taking it over)", "?", 0, time.time(), 0.0, time.time() + 1)
        if dead:
            logger.warning("%s: took over the lease of dead holder %s: its process is gone (killed?), "
                           "%.0f s before the lease would have expired", self.url, current.describe(),
                           max(0.0, current.expires_at - time.time()))
        elif current is not None and current.expires_at > 0:
            logger.warning("%s: took over the expired lease of %s", self.url, current.describe())
        return None

    def acquire(self, timeout: float = 0.0) -> "NamespaceLease":
        """Hold the lease, waiting up to `timeout` seconds (negative: forever) for another run's to
        end or expire; then LockHeldError naming the holder."""
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            blocker = self.try_acquire()
            if blocker is None:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                waited = "did not wait" if timeout == 0 else f"waited {timeout:g} s"
                expires = max(0.0, blocker.expires_at + self.skew_s - time.time())
                raise LockHeldError(
                    f"{self.url}: the namespace is locked by {blocker.describe()}; its lease expires "
                    f"in {expires:.0f} s unless renewed ({waited}; skip.rollout_tq.lock_timeout sets "
                    "how long to wait)")
            time.sleep(min(1.0, self.ttl_s / 3, left if left is not None else 1.0))
        self.lost.clear()
        self.taken_by = None
        self._stop.clear()
        with _held_mutex:
            _held.add(self)
        self._thread = threading.Thread(target=self._renew_loop, name="skip-harness-lease", daemon=True)
        self._thread.start()
        return self

    def renew(self) -> None:
        """Extend the lease by ttl; LeaseLost when another run took it over."""
        with self._mutex:
            self._renew()

    def _renew(self) -> None:
        if self.lost.is_set():
            raise self._lost_error()
        if self.etag is None:
            raise LeaseLost(self.url, "not held")
        sent = time.monotonic()
        try:
            self.etag = self.client.put(self.key, self._record(time.time() + self.ttl_s),
                                        mode={"e_tag": self.etag})
        except (ObjectRaceLost, ObjectMissing):
            current, seen = self.read()
            if not self._ours(current, seen):
                self._mark_lost(current)
                raise self._lost_error() from None
            # our own earlier renewal reached the server after its reply was lost (a request that
            # timed out, then landed): the record is still ours; renew on the ETag it has now
            self.etag = self.client.put(self.key, self._record(time.time() + self.ttl_s), mode={"e_tag": seen})
        self._valid_until = sent + self.ttl_s - self.margin_s

    def _ours(self, record: Optional[LeaseRecord], etag: Optional[str]) -> bool:
        """Whether `record` is this lease's own, not yet released (holder names are unique per run)."""
        return (record is not None and etag is not None and record.holder == self.holder
                and record.pid == self.pid and record.host == self.host and record.expires_at > 0)

    def _mark_lost(self, current: Optional[LeaseRecord]) -> None:
        """Another run holds the lease now: say so once (naming it); nothing more is written."""
        if self.lost.is_set():
            return
        self.taken_by = current.describe() if current else "nobody (the lease object is gone)"
        self.lost.set()
        logger.warning("%s: this run's lease on the namespace was taken over by %s after this run stalled "
                       "past its expiry: this run writes nothing more to the cache (training goes on "
                       "without caching)", self.url, self.taken_by)

    def _lost_error(self) -> LeaseLost:
        return LeaseLost(self.url, f"this run lost the namespace's lease: taken over by "
                                   f"{self.taken_by or 'another run'}; nothing more is written")

    def fence(self, *, round_trip: bool = False) -> None:
        """Return only while this run may write: the lease is ours by our own clock (renewed first when
        its time is up, or always with `round_trip`). LeaseLost when another run took it over;
        LeaseExpired when it ran out and the store cannot be reached to renew it."""
        with self._mutex:
            if self.lost.is_set():
                raise self._lost_error()
            if self.etag is None:
                raise LeaseLost(self.url, "the namespace's lease is not held (released): nothing is written")
            if not round_trip and time.monotonic() < self._valid_until:
                return
            try:
                self._renew()
            except ObjectStoreUnavailable as exc:
                if round_trip and time.monotonic() < self._valid_until:
                    raise
                raise LeaseExpired(self.url, f"the lease ran out by this run's clock and could not be "
                                             f"renewed ({exc.reason}): nothing is written until it is") from None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except LeaseLost:
                return                   # said once, by _mark_lost
            except ObjectStoreUnavailable as exc:
                logger.warning("%s: lease not renewed, trying again in %.0f s (%s)",
                               self.url, self.ttl_s / 3, exc.reason)
            except Exception as exc:  # a bug: say so, keep the thread's death visible
                logger.warning("%s: lease renewal failed: %s", self.url, exc)

    def release(self) -> None:
        """Give the lease up (an expired record, written only if it is still ours)."""
        self._stop.set()
        with _held_mutex:
            _held.discard(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.client.timeout_s + 5)
        self._thread = None
        with self._mutex:
            if self.etag is None or self.lost.is_set():
                self.etag = None
                return                   # taken over: the record is the new holder's
            try:
                self.client.put(self.key, self._record(0.0), mode={"e_tag": self.etag})
            except (ObjectRaceLost, ObjectMissing):
                pass                     # not ours any more: leave the new holder's alone
            except ObjectStoreError as exc:
                logger.warning("%s: lease not released (%s); it expires in %.0f s", self.url, exc.reason, self.ttl_s)
            self.etag = None

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __enter__(self) -> "NamespaceLease":
        if self.etag is None:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
