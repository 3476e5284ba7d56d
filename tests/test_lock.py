"""lock: one process per namespace and one lock per process (hand-over only when asked), released by the
OS when the holder dies, no holder record outliving its run, no link ever followed, read-only caches
recognised, and the shared-filesystem run marker."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import subprocess_env
from skip_harness.errors import LockHeldError, SkipHarnessError
from skip_harness.store.layout import Layout, NamespaceKey
from skip_harness.store.locking import new_run_token
from skip_harness.store.open import open_namespace
from skip_harness.store.posix import lock as lock_mod
from skip_harness.store.posix.lock import (
    LockHolder,
    NamespaceLock,
    ReadOnlyCache,
    UnsafeLockFileError,
    probe,
    read_holder,
)


def write_run_marker(lay, token):
    open_namespace(lay).put_run_marker(token)


def sees_run_marker(lay, token, wait=0.0):
    return open_namespace(lay).sees_run_marker(token, wait)


def remove_run_marker(lay, token):
    open_namespace(lay).remove_run_marker(token)


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
        assert not [p for p in lay.root.iterdir() if p.name.startswith(".tmp-")]
    assert not lock.held_by_this_process
    assert not lay.lock_holder_path.exists()


def test_a_second_lock_in_this_process_is_refused_unless_reentrant(tmp_path):
    lay = layout(tmp_path)
    first = NamespaceLock(lay)
    first.acquire()          # e.g. one harness
    with pytest.raises(LockHeldError, match=f"already in use by this process \\(pid {os.getpid()} "):
        NamespaceLock(lay, timeout=0).acquire()   # a second harness on the same namespace
    with pytest.raises(LockHeldError):
        NamespaceLock(lay, timeout=1).acquire()   # waiting does not help: it is this process
    assert read_holder(lay).pid == os.getpid()   # the refusal changed nothing
    first.release()
    assert not first.held_by_this_process and read_holder(lay) is None


def test_reentrant_hand_over_keeps_one_holder_record(tmp_path):
    lay = layout(tmp_path)
    outer, inner = NamespaceLock(lay), NamespaceLock(lay, timeout=0, reentrant=True)
    outer.acquire()          # the Hydra callback
    inner.acquire()          # then the harness, asking for the hand-over
    assert inner.held_by_this_process
    since = read_holder(lay).since
    inner.release()
    assert outer.held_by_this_process and read_holder(lay).since == since   # still held, same record
    outer.release()
    assert not outer.held_by_this_process and read_holder(lay) is None
    outer.release()          # releasing again is harmless


def test_one_lock_object_nests(tmp_path):
    lay = layout(tmp_path)
    lock = NamespaceLock(lay)
    with lock:
        with lock:
            assert lock.held_by_this_process
        assert lock.held_by_this_process and read_holder(lay) is not None
    assert not lock.held_by_this_process and read_holder(lay) is None


def test_holder_describe():
    h = LockHolder(123, "foo", 1796044500.0)
    assert h.describe() == "pid 123 on host foo since 2026-11-30 13:15:00 UTC"
    assert h.is_alive() is None                     # another host: unknowable
    assert LockHolder(os.getpid(), socket.gethostname(), 0).is_alive() is True


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
    threading.Timer(0.5, holder.kill).start()
    t0 = time.monotonic()
    with NamespaceLock(lay, timeout=20):
        assert 0.4 <= time.monotonic() - t0 < 10


def test_probe_touches_nothing(tmp_path):
    lay = layout(tmp_path)
    assert probe(lay) is None
    assert not lay.root.exists()
    with NamespaceLock(lay):
        pass
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in lay.root.iterdir()}
    assert probe(lay) is None
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in lay.root.iterdir()} == before


def test_probe_asks_filelock_not_fcntl(tmp_path, lock_holder, monkeypatch):
    """probe's answer comes from filelock's own non-blocking acquire, not a raw flock of its own."""
    lay = layout(tmp_path)
    holder = lock_holder(lay)
    calls = []
    real = lock_mod.filelock.FileLock

    def spy(*a, **k):
        calls.append(k.get("is_singleton", False))
        return real(*a, **k)

    monkeypatch.setattr(lock_mod.filelock, "FileLock", spy)
    assert probe(lay).startswith(f"pid {holder.pid} ")
    assert False in calls      # a trial instance of its own
    holder.kill()
    assert probe(lay) is None


# ------------------------------------------------------------------------------ links are never followed


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    lay = layout(tmp_path)
    lay.root.mkdir(parents=True)
    outside = tmp_path / "precious.txt"
    outside.write_text("do not truncate me")
    before = outside.stat()
    lay.lock_path.symlink_to(outside)
    with pytest.raises(UnsafeLockFileError, match="symbolic link"):
        NamespaceLock(lay).acquire()
    assert probe(lay) is None
    assert outside.read_text() == "do not truncate me"
    assert outside.stat().st_mtime_ns == before.st_mtime_ns
    assert lay.lock_path.is_symlink() and not lay.lock_holder_path.exists()
    assert issubclass(UnsafeLockFileError, SkipHarnessError)


def test_a_dangling_lock_symlink_creates_nothing_outside(tmp_path):
    lay = layout(tmp_path)
    lay.root.mkdir(parents=True)
    target = tmp_path / "would-be-created"
    lay.lock_path.symlink_to(target)
    with pytest.raises(UnsafeLockFileError):
        NamespaceLock(lay).acquire()
    assert not target.exists()


def test_a_holder_record_that_is_a_symlink_is_replaced_not_followed(tmp_path):
    lay = layout(tmp_path)
    lay.root.mkdir(parents=True)
    outside = tmp_path / "precious.json"
    outside.write_text('{"pid": 1, "host": "x", "since": 0}')
    lay.lock_holder_path.symlink_to(outside)
    with NamespaceLock(lay):
        assert not lay.lock_holder_path.is_symlink()
        assert read_holder(lay).pid == os.getpid()
    assert outside.read_text() == '{"pid": 1, "host": "x", "since": 0}'
    assert not os.path.lexists(lay.lock_holder_path)


def test_read_holder_does_not_follow_a_link(tmp_path):
    lay = layout(tmp_path)
    lay.root.mkdir(parents=True)
    outside = tmp_path / "h.json"
    outside.write_text(json.dumps({"pid": 5, "host": "h", "since": 1.0}))
    lay.lock_holder_path.symlink_to(outside)
    assert read_holder(lay) is None


# ------------------------------------------------------------------------------ no holder outlives its run


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("ending", ["raise RuntimeError('config error')", "sys.exit(2)"])
def test_a_run_that_stops_on_an_error_leaves_no_holder_record(tmp_path, ending):
    lay = layout(tmp_path)
    proc = _run(
        f"""
        import sys
        from pathlib import Path
        from skip_harness.store.layout import Layout
        from skip_harness.store.posix.lock import NamespaceLock
        NamespaceLock(Layout(Path({str(lay.root)!r}), K={lay.K}, W={lay.W})).acquire()
        assert Path({str(lay.lock_holder_path)!r}).exists()
        {ending}
        """,
        tmp_path,
    )
    assert proc.returncode != 0 and "AssertionError" not in proc.stderr, proc.stderr
    assert not os.path.lexists(lay.lock_holder_path)
    assert lay.lock_path.exists()  # the lock file itself stays (waiters share its inode)


def test_a_killed_holders_record_is_stale_and_replaced(tmp_path, lock_holder):
    lay = layout(tmp_path)
    holder = lock_holder(lay)
    holder.kill()
    assert read_holder(lay).pid == holder.pid          # SIGKILL: left behind
    assert probe(lay) is None                          # not reported as a holder
    # and the next holder replaces one anyway
    lay.lock_holder_path.write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "since": 1.0}))
    with NamespaceLock(lay):
        assert read_holder(lay).pid == os.getpid()
    assert read_holder(lay) is None


def test_refusal_says_when_the_record_names_a_dead_process(tmp_path, lock_holder):
    lay = layout(tmp_path)
    holder = lock_holder(lay)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lay.lock_holder_path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": 1.0}))
    with pytest.raises(LockHeldError, match=f"names pid {dead.pid} on this host, which is not running"):
        NamespaceLock(lay).acquire()
    holder.kill()


def test_release_unlocks_even_when_removing_the_record_fails(tmp_path, monkeypatch):
    lay = layout(tmp_path)
    lock = NamespaceLock(lay)
    lock.acquire()

    def broken(*a, **k):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(lock_mod, "remove_regular_file", broken)
    with pytest.raises(RuntimeError):
        lock.release()
    assert not lock.held_by_this_process
    monkeypatch.undo()
    with NamespaceLock(lay):       # takeable again, and the record is replaced
        assert read_holder(lay).pid == os.getpid()


def test_holder_write_failure_other_than_read_only_warns_and_keeps_the_lock(tmp_path, monkeypatch, caplog):
    lay = layout(tmp_path)

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock_mod, "write_small_file", enospc)
    with NamespaceLock(lay) as lock:
        assert lock.held_by_this_process
    assert "could not write the lock holder record" in caplog.text


# ------------------------------------------------------------------------------ read-only caches


@pytest.fixture
def read_only_dump_dir(tmp_path):
    """A dump_dir on a real read-only mount holding one namespace (with a .lock from its writer)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount(8) for a real read-only filesystem")
    try:
        lay = NamespaceKey("exp", "proj", 8, 2, 4, 4).layout(mnt)
        with NamespaceLock(lay):
            (lay.root / "1").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_read_only_dump_dir_raises_read_only_cache_and_writes_nothing(read_only_dump_dir):
    mnt = read_only_dump_dir
    existing = NamespaceKey("exp", "proj", 8, 2, 4, 4).layout(mnt)
    missing = NamespaceKey("new", "proj", 8, 2, 4, 4).layout(mnt)
    before = sorted(str(p) for p in mnt.rglob("*"))
    for lay in (existing, missing):
        with pytest.raises(ReadOnlyCache) as err:
            NamespaceLock(lay, timeout=1).acquire()
        assert "skip.rollout_tq.dump_dir" in str(err.value) and "read-only" in str(err.value).lower()
        assert probe(lay) is None
    assert sorted(str(p) for p in mnt.rglob("*")) == before
    assert not NamespaceLock(existing).held_by_this_process
    assert issubclass(ReadOnlyCache, SkipHarnessError)


def test_permission_denied_is_a_read_only_cache(tmp_path, monkeypatch):
    """Where the process may not write (EACCES, e.g. another user's finished cache)."""
    lay = layout(tmp_path)
    real = os.makedirs

    def denied(path, *a, **k):
        if str(path) == str(lay.root):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(lock_mod.os, "makedirs", denied)
    with pytest.raises(ReadOnlyCache, match="Permission denied"):
        NamespaceLock(lay).acquire()


# ------------------------------------------------------------------------------ run marker


def test_run_marker_round_trip(tmp_path):
    lay = layout(tmp_path)
    lay.root.mkdir(parents=True)
    token = new_run_token()
    assert not sees_run_marker(lay, token)
    write_run_marker(lay, token)
    assert sees_run_marker(lay, token)
    assert not sees_run_marker(lay, new_run_token())
    other = Layout(tmp_path / "elsewhere" / lay.root.name)   # a node with its own cache dir
    other.root.mkdir(parents=True)
    assert not sees_run_marker(other, token)
    assert not [p for p in lay.root.iterdir() if p.name.startswith(".tmp-")]
    remove_run_marker(lay, token)
    assert not sees_run_marker(lay, token)
    assert [p.name for p in lay.root.iterdir()] == []
    remove_run_marker(lay, token)   # harmless twice


def test_run_marker_never_follows_a_link(tmp_path):
    lay = layout(tmp_path)
    lay.root.mkdir(parents=True)
    token = new_run_token()
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"token": token}))
    marker = lay.root / f".run-marker-{token}"
    marker.symlink_to(outside)
    assert not sees_run_marker(lay, token)       # not read through the link
    write_run_marker(lay, token)                 # replaces the link
    assert not marker.is_symlink() and sees_run_marker(lay, token)
    assert json.loads(outside.read_text()) == {"token": token}
    remove_run_marker(lay, token)
    marker.symlink_to(outside)
    remove_run_marker(lay, token)                # a link is removed as a link
    assert not os.path.lexists(marker) and outside.exists()


def test_run_marker_token_is_checked(tmp_path):
    lay = layout(tmp_path)
    for bad in ("", "../x", "a/b", "x" * 65, 5):
        with pytest.raises(ValueError):
            write_run_marker(lay, bad)


def test_sees_run_marker_waits_for_a_late_marker(tmp_path):
    lay = layout(tmp_path)
    lay.root.mkdir(parents=True)
    token = new_run_token()
    threading.Timer(0.3, write_run_marker, args=(lay, token)).start()
    assert sees_run_marker(lay, token, wait=20)


def test_waiting_on_one_namespace_does_not_hold_up_another(tmp_path, lock_holder):
    busy, free = layout(tmp_path, "busy"), layout(tmp_path, "free")
    holder = lock_holder(busy)
    waiting = NamespaceLock(busy, timeout=60)
    waiter = threading.Thread(target=waiting.acquire)
    waiter.start()
    time.sleep(0.3)
    with NamespaceLock(free):          # taken while the other thread still waits
        assert waiter.is_alive()
    holder.kill()
    waiter.join(60)
    assert waiting.held_by_this_process
    waiting.release()
