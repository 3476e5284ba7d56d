"""Issue 21, item 1: a run that lost its namespace lock writes nothing more.

Run A is stopped (SIGSTOP) past its lease's ttl -- in the middle of a request: the server is paused first,
so that A's threads wait on it when A stops; run B takes the expired lease over and trains to the end,
committing every step; A is resumed (SIGCONT). A must write nothing (the only writes it sends are
conditional ones the server refuses: its lease renewal, a retried create-only put), warn once naming B,
finish training without caching and exit 0; every object B left is untouched. Real processes, the real S3 server (moto), the demo's `scripts/train.py`.
The same scenario on a local dump_dir: the POSIX lock (flock) holds across SIGSTOP, so B never gets it.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from holding_proxy import HoldingProxy
from objstore_namespace import ObjectNamespace
from skip_harness.store.objstore.lease import LeaseLost
from test_objstore_scenarios import NS, TRAIN, assert_steps_whole, committed, env_of, metrics, train
from test_train_e2e import TINY, training_metrics


TTL = "3"          # SKIP_HARNESS_LEASE_TTL_S: B may take A's lease over 3 s + 2 s skew after A stopped renewing
N = 30
STEPS = f"trainer.total_training_steps={N}"
WRITES = re.compile(r'"(PUT|POST|DELETE|PATCH) (\S+) HTTP/[\d.]+" (\d+)')


def _objects(server, bucket: str) -> dict:
    """key -> ETag of every object in the bucket."""
    s3, out, token = server.boto3(), {}, None
    while True:
        kw = {"Bucket": bucket, **({"ContinuationToken": token} if token else {})}
        res = s3.list_objects_v2(**kw)
        out.update({o["Key"]: o["ETag"] for o in res.get("Contents", [])})
        token = res.get("NextContinuationToken")
        if not token:
            return out


def _start(tmp_path, env, url, run):
    cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY, STEPS,
           f"skip.rollout_tq.dump_dir={url}"]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, proc, timeout=300.0, what=""):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run ended ({proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_every_write_of_a_run_past_its_ttl_renews_first_and_is_refused_once_taken_over(s3_server, s3_env, s3_bucket):
    """Deterministic: A's renewal thread has not noticed the takeover (stopped here, as when it has not
    woken yet after the stall); every write, delete and commit of A must find out by itself."""
    url = f"s3://{s3_bucket}/exp_proj/GBS8_N2_in16_out32"
    a = ObjectNamespace(url)
    held = a.acquire(ttl_s=1.5, skew_s=0.0, holder="run-A")
    a.write(1, "tq_batch.pt", b"a" * 10)
    held._stop.set()
    held._thread.join()
    time.sleep(2.0)                                # A's ttl passes without a renewal
    b = ObjectNamespace(url)
    b.acquire(ttl_s=30, skew_s=0.0, holder="run-B")
    b.remove_step(1)
    for step in (1, 2):
        b.write(step, "tq_batch.pt", b"b" * 10)
        b.write_small(f"{step}/meta.json", b"{}")
        b.commit(step, b"{}")
    before = _objects(s3_server, s3_bucket)
    stale = [lambda: a.uncommit(2), lambda: a.write(2, "tq_batch.pt", b"a" * 10),
             lambda: a.write(3, "tq_batch.pt", b"a" * 10), lambda: a.write_small("2/meta.json", b"{}"),
             lambda: a.commit(3, b"{}"), lambda: a.remove_step(1), lambda: a.set_aside(2, "stale")]
    for op in stale:
        with pytest.raises(LeaseLost, match="taken over by run-B"):
            op()
    assert _objects(s3_server, s3_bucket) == before
    a.release()
    b.release()


@pytest.mark.parametrize("key", [".values/config-0123abcd.json", ".values/3.json"])
def test_a_record_beside_the_rollouts_sent_before_a_stall_is_not_sent_again_after_a_takeover(
        s3_server, s3_env, s3_bucket, monkeypatch, key):
    """Issue 40: the JSON records beside the rollouts (the recording's config and values) pass the fence as
    the rollouts do -- every attempt, the retries of a request included. A's request is held by the network
    (it left after A's fence let it go) while A's lease runs out and B takes the namespace over; then the
    request fails (its connection reset, as after a stall). Sent again as it was, it would land over B's
    record: A must find out it lost the lease first and send nothing."""
    url = f"s3://{s3_bucket}/exp_proj/GBS8_N2_in16_out32"
    proxy = HoldingProxy(s3_server.port)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)        # A talks to the server through the proxy
        a = ObjectNamespace(url)
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        held = a.acquire(ttl_s=1.5, skew_s=0.0, holder="run-A")
        held._stop.set()                             # A's renewal thread stalls with it
        held._thread.join()
        proxy.hold(b"PUT /" + f"{s3_bucket}/exp_proj/GBS8_N2_in16_out32/{key}".encode())
        outcome: list = []

        def write() -> None:
            try:
                a.write_small(key, b'{"by": "A"}')
                outcome.append("written")
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                outcome.append(exc)
        writer = threading.Thread(target=write)
        writer.start()
        assert proxy.held.wait(30), proxy.requests
        time.sleep(2.0)                              # A's ttl passes without a renewal
        b = ObjectNamespace(url)
        b.acquire(ttl_s=30, skew_s=0.0, holder="run-B")
        b.write_small(key, b'{"by": "B"}')
        before = _objects(s3_server, s3_bucket)
        proxy.cut()
        writer.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], LeaseLost), outcome
        assert "taken over by run-B" in str(outcome[0])
        assert _objects(s3_server, s3_bucket) == before                    # B's record untouched
        body = s3_server.boto3().get_object(Bucket=s3_bucket, Key=f"exp_proj/GBS8_N2_in16_out32/{key}")["Body"]
        assert body.read() == b'{"by": "B"}'
        a.release()
        b.release()
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_stalled_holder_resumed_after_a_takeover_writes_nothing(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url, prefix = f"s3://{bucket}/x", f"x/{NS}/"
    env = env_of(s3_server, SKIP_HARNESS_LEASE_TTL_S=TTL)
    a = _start(tmp_path, env, url, "A")
    try:
        # stop A once it has committed a step and is writing the next ones
        _wait_for(lambda: len(committed(s3_server, bucket, prefix)) >= 2, a, what="A's first commits")
        s3_server.pause()                          # A's next request waits on the server ...
        time.sleep(1.0)
        a.send_signal(signal.SIGSTOP)              # ... when A stops
        s3_server.resume()
        time.sleep(float(TTL) + 2 + 1.5)          # past A's expiry and the 2 s skew allowance
        b = train(tmp_path, s3_server, url, STEPS, run="B", SKIP_HARNESS_LEASE_TTL_S=TTL)
        assert "took over the expired lease of run-" in b.stdout + b.stderr
        b_holder = json.loads(s3_server.boto3().get_object(Bucket=bucket, Key=f"{prefix}.lock")["Body"].read())["holder"]
        assert committed(s3_server, bucket, prefix) == list(range(1, N + 1))
        before = _objects(s3_server, bucket)
        log_from = s3_server.log.stat().st_size
        a.send_signal(signal.SIGCONT)
        out, _ = a.communicate(timeout=600)
    finally:
        if a.poll() is None:
            a.send_signal(signal.SIGCONT)
            a.kill()
            a.wait()
    time.sleep(0.5)                                # the server's log line of A's last request
    with open(s3_server.log, "rb") as f:
        f.seek(log_from)
        after_resume = f.read().decode(errors="replace").splitlines()
    (tmp_path / "requests_after_resume.log").write_text("\n".join(after_resume) + "\n")
    writes = [m.groups() for m in map(WRITES.search, after_resume) if m]
    # the only writes A sends are conditional ones, refused (412: B's lease record, B's objects are there)
    assert all(method == "PUT" and status == "412" for method, _, status in writes), writes
    assert a.returncode == 0, out[-4000:]
    assert _objects(s3_server, bucket) == before                  # not one object of B's touched
    assert_steps_whole(s3_server, bucket, prefix)
    taken = [line for line in out.splitlines() if "taken over by" in line and "WARNING" in line]
    assert len(taken) == 1 and b_holder in taken[0], taken
    assert "Traceback" not in out
    runs_a = metrics(tmp_path / "A")
    assert len(runs_a) == N                      # A trained to the end, without caching
    assert training_metrics(runs_a) == training_metrics(metrics(tmp_path / "B"))


@pytest.mark.slow
def test_posix_lock_holds_across_sigstop(tmp_path, s3_server):
    """The same stall on a local dump_dir: flock is the kernel's, not a lease, so a stopped holder keeps
    the namespace: B reads beside A (naming it) and writes nothing, A resumes and finishes, every step whole."""
    dump = tmp_path / "cache"
    env = env_of(s3_server)
    a = _start(tmp_path, env, str(dump), "A")
    ns = dump / NS
    try:
        _wait_for(lambda: sum(1 for p in ns.glob("*/commit.json")) >= 2 if ns.is_dir() else False, a,
                  what="A's first commits")
        a.send_signal(signal.SIGSTOP)
        time.sleep(float(TTL) + 2 + 1.5)          # as long as the object-store test waits
        before = {str(p): p.read_bytes() for p in ns.rglob("*") if p.is_file() and not p.name.startswith(".")}
        b = train(tmp_path, s3_server, str(dump), STEPS, run="B", check=False)
        out_b = b.stdout + b.stderr + (tmp_path / "B" / "train.log").read_text()
        assert b.returncode == 0, out_b[-3000:]        # B reads beside A: it neither stops nor writes
        assert f"read beside pid {a.pid}" in out_b, out_b[-2000:]
        assert {str(p): p.read_bytes() for p in ns.rglob("*") if p.is_file() and not p.name.startswith(".")
                and str(p) in before} == before
        a.send_signal(signal.SIGCONT)
        out, _ = a.communicate(timeout=600)
    finally:
        if a.poll() is None:
            a.send_signal(signal.SIGCONT)
            a.kill()
            a.wait()
    assert a.returncode == 0, out[-4000:]
    assert sorted(int(p.parent.name) for p in ns.glob("*/commit.json")) == list(range(1, N + 1))
    served = [r["cache"] for r in metrics(tmp_path / "B")]     # B: A's committed steps, then its own rollouts
    assert served[0] == "hit" and set(served) == {"hit", "miss"} and served == sorted(served), served
