"""The namespace lease on a real S3 server: held -> refused naming the holder; expired -> taken over;
renewed on its thread; released; a stale holder's renewal fails and its release leaves the new
holder's lease alone; lock_timeout waits; a read-only credential gets no lease and writes nothing."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from skip_harness.errors import LockHeldError
from objstore_namespace import ObjectNamespace
from skip_harness.store.objstore.client import ObjectClient
from skip_harness.store.objstore.lease import LEASE_KEY, NamespaceLease, LeaseLost

TESTS = os.path.dirname(os.path.abspath(__file__))     # where objstore_namespace.py is, for the subprocesses


@pytest.fixture
def client(s3_bucket):
    return ObjectClient(f"s3://{s3_bucket}/exp_proj/GBS8_N2_in16_out32")


def lease(client, holder, ttl_s=30.0):
    return NamespaceLease(client, ttl_s=ttl_s, skew_s=0.0, holder=holder)


def test_held_lease_refuses_naming_holder_host_pid_since(client):
    a = lease(client, "run-A").acquire()
    try:
        with pytest.raises(LockHeldError) as info:
            lease(client, "run-B").acquire()
        msg = str(info.value)
        assert "run-A" in msg and f"pid {os.getpid()}" in msg and socket.gethostname() in msg
        assert "since 20" in msg and "skip.rollout_tq.lock_timeout" in msg and client.url in msg
        rec, _ = a.read()
        assert (rec.holder, rec.pid, rec.host) == ("run-A", os.getpid(), socket.gethostname())
    finally:
        a.release()


def test_release_frees_it_at_once(client, caplog):
    a = lease(client, "run-A").acquire()
    a.release()
    rec, _ = a.read()
    assert rec.expires_at == 0.0
    caplog.set_level(logging.WARNING)
    b = lease(client, "run-B").acquire()
    assert b.read()[0].holder == "run-B" and "took over" not in caplog.text
    b.release()


@pytest.mark.slow
def test_expired_lease_is_taken_over_and_the_stale_holder_stops(client, caplog):
    a = lease(client, "run-A", ttl_s=1.5)
    a.acquire()
    a._stop.set()                      # run A stalls: no more renewals (a kill -9 does the same)
    time.sleep(2.0)
    caplog.set_level(logging.WARNING)
    b = lease(client, "run-B", ttl_s=30).acquire()
    try:
        assert "took over the expired lease of run-A" in caplog.text
        with pytest.raises(LeaseLost, match="taken over"):
            a.renew()
        assert a.lost.is_set() and not a.held
        a.release()                    # must not remove or expire B's lease
        rec, _ = b.read()
        assert rec.holder == "run-B" and rec.expires_at > time.time() + 20
        with pytest.raises(LockHeldError, match="run-B"):
            lease(client, "run-C").acquire()
    finally:
        b.release()


@pytest.mark.slow
def test_renewed_while_held(client):
    a = lease(client, "run-A", ttl_s=1.5).acquire()
    try:
        first_etag, first = a.etag, a.read()[0].expires_at
        time.sleep(2.5)               # longer than the ttl: only renewals keep it
        rec, etag = a.read()
        assert rec.holder == "run-A" and rec.expires_at > first and etag == a.etag != first_etag
        with pytest.raises(LockHeldError):
            lease(client, "run-B").acquire()
    finally:
        a.release()


@pytest.mark.slow
def test_lock_timeout_waits_for_the_holder(client):
    a = lease(client, "run-A").acquire()
    threading.Timer(1.5, a.release).start()
    t0 = time.monotonic()
    b = lease(client, "run-B").acquire(timeout=20)
    assert 1.0 < time.monotonic() - t0 < 20 and b.read()[0].holder == "run-B"
    b.release()
    c = lease(client, "run-C").acquire()
    t0 = time.monotonic()
    with pytest.raises(LockHeldError, match="waited 1 s"):
        lease(client, "run-D").acquire(timeout=1)
    assert time.monotonic() - t0 >= 1.0
    c.release()


def test_read_only_credential_gets_no_lease_and_writes_nothing(s3_server, s3_bucket, monkeypatch):
    url = f"s3://{s3_bucket}/ro/ns"
    before = s3_server.keys(s3_bucket)
    for k, v in s3_server.env("reader").items():
        monkeypatch.setenv(k, v)
    ns = ObjectNamespace(url)
    assert ns.acquire() is None and ns.read_only
    assert s3_server.keys(s3_bucket) == before
    assert LEASE_KEY not in [m["path"] for m in ObjectClient(url).list()]


def test_a_run_that_lost_its_lease_writes_nothing_more(client):
    ns = ObjectNamespace(client.url, client)
    held = ns.acquire(ttl_s=30, skew_s=0.0, holder="run-A")
    ns.write(1, "tq_batch.pt", b"x" * 10)
    held._stop.set()
    # another run takes the lease over (as after A stalled past its expiry)
    _, etag = held.read()
    client.put(LEASE_KEY, lease(client, "run-B")._record(1e12), mode={"e_tag": etag})
    with pytest.raises(LeaseLost):
        held.renew()
    with pytest.raises(LeaseLost, match="lost the namespace's lease"):
        ns.write(1, "meta.json", b"{}")
    with pytest.raises(LeaseLost):
        ns.commit(1, b"{}")
    assert ns.read_commit(1) is None
    ns.release()
    assert held.read()[0].holder == "run-B"


def test_a_lease_still_held_at_exit_is_released(s3_server, s3_bucket, tmp_path):
    import subprocess
    import sys
    from conftest import subprocess_env
    url = f"s3://{s3_bucket}/exit/ns"
    code = (f"import sys; sys.path.insert(0, {TESTS!r})\nfrom objstore_namespace import ObjectNamespace\n"
            f"ns = ObjectNamespace({url!r}); ns.acquire(holder='run-exit'); print('held')\n")
    env = subprocess_env()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "held" in proc.stdout, proc.stderr
    rec, _ = NamespaceLease(ObjectClient(url), holder="probe").read()
    assert rec.holder == "run-exit" and rec.expires_at == 0.0


# --------------------------------------------------------------------------------------------
# a killed run on this host: its lease is taken over at once, not after its ttl


HOLD = ("import sys, time\n"
        f"sys.path.insert(0, {TESTS!r})\n"
        "from objstore_namespace import ObjectNamespace\n"
        "ns = ObjectNamespace(sys.argv[1]); ns.acquire(holder=sys.argv[2], ttl_s=30)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


def holder_process(url, holder):
    """A real process that takes the namespace's lease (ttl 30 s) and keeps it until killed."""
    import subprocess
    import sys
    from conftest import subprocess_env
    proc = subprocess.Popen([sys.executable, "-c", HOLD, url, holder], env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "held" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=60)
        raise AssertionError(f"the holder process did not take the lease: {err[-3000:]}")
    return proc


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_killed_holder_on_this_host_is_taken_over_at_once(client, caplog, reaped):
    import signal
    proc = holder_process(client.url, "run-killed")
    try:
        rec, _ = lease(client, "probe").read()
        assert (rec.holder, rec.pid, rec.host) == ("run-killed", proc.pid, socket.gethostname())
        assert rec.expires_at > time.time() + 20
        with pytest.raises(LockHeldError, match="run-killed"):     # alive: refused, as before
            lease(client, "run-B").acquire()
        proc.send_signal(signal.SIGKILL)
        if reaped:
            proc.wait(timeout=30)
        else:                       # killed, not yet reaped by its parent: a zombie renews nothing
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with open(f"/proc/{proc.pid}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].startswith(b" Z"):
                        break
                time.sleep(0.05)
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        b = lease(client, "run-B").acquire()
        took = time.monotonic() - t0
        try:
            assert took < 10, took                                    # not the 30 s ttl
            assert f"took over the lease of dead holder run-killed (pid {proc.pid} on host " \
                   f"{socket.gethostname()}" in caplog.text
            rec, _ = b.read()
            assert rec.holder == "run-B" and rec.pid == os.getpid()
        finally:
            b.release()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_live_or_foreign_holder_is_still_waited_out(client):
    from skip_harness.store.objstore.lease import LeaseRecord
    import subprocess
    import sys
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)                         # a pid that no longer exists
    me = lease(client, "probe")
    now = time.time()
    for who, host, host_id, pid in [
        ("other-host", socket.gethostname() + "-elsewhere", me.host_id, gone.pid),
        ("other-namespace", socket.gethostname(), "another-boot pid:[1]", gone.pid),
        ("live-here", socket.gethostname(), me.host_id, os.getppid()),
    ]:
        record = LeaseRecord(who, host, pid, now, 30.0, now + 30.0, host_id)
        client.put(LEASE_KEY, record.to_bytes())
        assert not me.holder_dead(record)
        with pytest.raises(LockHeldError, match=who):
            lease(client, "run-B").acquire()
    # the same dead pid on this host (no host_id: a record written before it existed) is taken over
    client.put(LEASE_KEY, LeaseRecord("old-format", socket.gethostname(), gone.pid, now, 30.0, now + 30.0).to_bytes())
    b = lease(client, "run-B").acquire()
    assert b.read()[0].holder == "run-B"
    b.release()


def test_holder_is_read_without_taking_anything(s3_bucket):
    """What a dry run (`clean --dry-run`, `import-verl --dry-run`) asks: who holds the namespace, and
    nothing written."""
    ns = ObjectNamespace(f"s3://{s3_bucket}/exp_proj/GBS8_N2_in16_out32")
    assert ns.holder() is None
    assert lease(ns.client, "probe").read() == (None, None)      # asking created no lease
    a = lease(ns.client, "run-A").acquire()
    try:
        said = ns.holder()
        assert said is not None and "run-A" in said and f"pid {os.getpid()}" in said
    finally:
        a.release()
    assert ns.holder() is None                 # released: an expired record holds nothing
