"""lock: one process per namespace, re-entrant inside it, released by the OS when the holder dies."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from skip_harness.errors import LockHeldError
from skip_harness.layout import NamespaceKey
from skip_harness.lock import LockHolder, NamespaceLock, probe, read_holder


def layout(tmp_path, name="exp"):
    return NamespaceKey(name, "proj", 8, 2, 4, 4).layout(tmp_path / "cache")


def test_acquire_writes_the_holder_record_and_release_removes_it(tmp_path):
    lay = layout(tmp_path)
    lock = NamespaceLock(lay)
    assert not lay.root.exists()
    with lock:
        assert lay.root.is_dir()  # created
        assert lock.held_by_this_process
        holder = lock.holder()
        assert holder.pid == os.getpid() and holder.host == socket.gethostname()
        assert abs(holder.since - time.time()) < 60
        assert json.loads(lay.lock_holder_path.read_text())["pid"] == os.getpid()
    assert not lock.held_by_this_process
    assert not lay.lock_holder_path.exists()


def test_reentrant_within_one_process(tmp_path):
    lay = layout(tmp_path)
    outer, inner = NamespaceLock(lay), NamespaceLock(lay, timeout=0)
    outer.acquire()          # e.g. the Hydra callback
    inner.acquire()          # then the harness: does not block or fail
    assert inner.held_by_this_process
    since = read_holder(lay).since
    inner.release()
    assert outer.held_by_this_process and read_holder(lay).since == since   # still held, same record
    outer.release()
    assert not outer.held_by_this_process and read_holder(lay) is None
    outer.release()          # releasing again is harmless


def test_holder_describe():
    h = LockHolder(123, "foo", 1796044500.0)
    assert h.describe() == "pid 123 on host foo since 2026-11-30 13:15:00 UTC"


def test_unreadable_holder_record(tmp_path, lock_holder):
    lay = layout(tmp_path)
    holder = lock_holder(lay)
    lay.lock_holder_path.write_text("not json")
    with pytest.raises(LockHeldError, match="unknown holder"):
        NamespaceLock(lay).acquire()
    holder.kill()


def test_contention_between_two_processes(tmp_path, lock_holder):
    lay = layout(tmp_path)
    other = layout(tmp_path, "other")
    holder = lock_holder(lay)

    t0 = time.monotonic()
    with pytest.raises(LockHeldError) as err:
        NamespaceLock(lay, timeout=0).acquire()
    assert time.monotonic() - t0 < 1.0
    msg = str(err.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in msg
    assert str(lay.root) in msg and "skip.rollout_tq.lock_timeout" in msg
    assert probe(lay).startswith(f"pid {holder.pid}")

    t0 = time.monotonic()
    with pytest.raises(LockHeldError, match="waited 2 s"):
        NamespaceLock(lay, timeout=2).acquire()
    assert 1.9 <= time.monotonic() - t0 < 5

    with NamespaceLock(other):      # another namespace is not affected
        pass

    holder.kill()                   # SIGKILL: no cleanup code runs; the OS drops the flock
    lock = NamespaceLock(lay, timeout=0)
    lock.acquire()
    assert lock.holder().pid == os.getpid()
    assert probe(lay).startswith(f"pid {os.getpid()} ")
    lock.release()
    assert probe(lay) is None


def test_waiting_acquire_succeeds_when_the_holder_dies(tmp_path, lock_holder):
    lay = layout(tmp_path)
    holder = lock_holder(lay)
    import threading

    threading.Timer(0.5, holder.kill).start()
    t0 = time.monotonic()
    with NamespaceLock(lay, timeout=20):
        assert 0.4 <= time.monotonic() - t0 < 10


def test_probe_touches_nothing(tmp_path):
    lay = layout(tmp_path)
    assert probe(lay) is None
    assert not lay.root.exists()
