"""Issue 16, item 3: the cache on a real S3 server (moto on 127.0.0.1, tests/s3server.py), driven as a
user drives it -- `scripts/train.py skip.rollout_tq.dump_dir=s3://...`, torchrun agents, the CLI -- in
real subprocesses. Every scenario checks the bucket itself (boto3 listing), and that nothing was
written to a local directory instead."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from s3server import s3_server  # noqa: F401  (fixture)
from test_train_e2e import TINY, training_metrics

TRAIN = REPO / "scripts" / "train.py"
NS = "sync_seed0_skip_harness_demo/GBS8_N2_in6_out6"
NS_K4 = "separate_async_seed0_skip_harness_demo/GBS8_N2_in6_out6_K4_W1"

pytestmark = pytest.mark.slow


def env_of(server, user="writer", **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env(user))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["SKIP_HARNESS_OBJSTORE_TIMEOUT_S"] = "5"
    env.pop("SKIP_HARNESS_DUMP_DIR", None)
    env.pop("HYDRA_FULL_ERROR", None)
    env.update(extra)
    return env


def train(tmp_path, server, url, *overrides, run="run", user="writer", check=True, timeout=600, **extra):
    cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY,
           f"skip.rollout_tq.dump_dir={url}", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_of(server, user, **extra), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def committed(server, bucket, prefix) -> list:
    return sorted(int(k[len(prefix):].split("/")[0]) for k in server.keys(bucket, prefix)
                  if k.endswith("/commit.json") and k[len(prefix):].split("/")[0].isdigit())


def index_steps(s3, bucket, key) -> list:
    """The steps the namespace index object lists (entry lines are JSON arrays led by the step)."""
    lines = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode().splitlines()
    assert json.loads(lines[0]).get("stamp") == "etag", lines[0]
    return sorted(x[0] for x in map(json.loads, lines[1:]) if isinstance(x, list))


def assert_nothing_local(tmp_path):
    assert not (tmp_path / "s3:").exists(), "the s3:// URL was taken for a local path"


def assert_steps_whole(server, bucket, prefix):
    """Every step in the bucket is committed and holds exactly what its commit record lists."""
    s3 = server.boto3()
    keys = server.keys(bucket, prefix)
    steps = sorted({k[len(prefix):].split("/")[0] for k in keys if k[len(prefix):].split("/")[0].isdigit()})
    for step in steps:
        mine = {k[len(prefix) + len(step) + 1:] for k in keys if k.startswith(f"{prefix}{step}/")}
        assert "commit.json" in mine, f"step {step}: objects without a commit record: {sorted(mine)}"
        record = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}{step}/commit.json")["Body"].read())
        listed = {f["rel"] if isinstance(f, dict) and "rel" in f else f.get("path", "") for f in record["files"]}
        assert mine - {"commit.json"} == listed, f"step {step}: {sorted(mine)} vs the record's {sorted(listed)}"


def test_demo_twice_every_step_hits_identically(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    train(tmp_path, s3_server, url, run="first")
    # the run indexed its commits once, when it gave the namespace back; the rerun's startup takes
    # every step from that index (fresh: it rewrites nothing) and commits nothing new
    s3 = s3_server.boto3()
    index_key = f"x/{NS}/.index.jsonl"
    assert index_steps(s3, bucket, index_key) == [1, 2, 3, 4]
    etag = s3.head_object(Bucket=bucket, Key=index_key)["ETag"]
    train(tmp_path, s3_server, url, run="again")
    assert s3.head_object(Bucket=bucket, Key=index_key)["ETag"] == etag
    first, again = metrics(tmp_path / "first"), metrics(tmp_path / "again")
    assert [r["cache"] for r in first] == ["miss"] * 4 and [r["cache"] for r in again] == ["hit"] * 4
    assert training_metrics(first) == training_metrics(again)
    assert committed(s3_server, bucket, f"x/{NS}/") == [1, 2, 3, 4]
    assert_steps_whole(s3_server, bucket, f"x/{NS}/")
    assert_nothing_local(tmp_path)


def test_k4_killed_mid_step_then_rerun_cleans_and_never_mixes(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    prefix = f"x/{NS_K4}/"
    mode = ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4",
            "trainer.total_training_steps=30"]
    train(tmp_path, s3_server, url, *mode, "skip.rollout_tq.enable=false", run="uncached")
    cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / 'killed'}", *TINY,
           f"skip.rollout_tq.dump_dir={url}", *mode]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_of(s3_server), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline, partial = time.time() + 300, None
    try:
        while time.time() < deadline and partial is None and proc.poll() is None:
            keys = s3_server.keys(bucket, prefix)
            done = {k.split("/")[-2] for k in keys if k.endswith("/commit.json")}
            started = {k[len(prefix):].split("/")[0] for k in keys if k.endswith(".pt")}
            if len(done) >= 2 and started - done:
                partial = sorted(started - done, key=int)[0]   # payloads, no commit record yet
            else:
                time.sleep(0.02)
        assert partial is not None and proc.poll() is None, "no moment mid-step to kill the run at"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # no OS releases a killed run's lease on an object store, but its holder was a process of this
    # host that is gone: the rerun takes the lease over at once (lock_timeout 0: no waiting out the ttl)
    train(tmp_path, s3_server, url, *mode, "skip.rollout_tq.lock_timeout=0", run="resumed")
    rows = metrics(tmp_path / "resumed")
    assert rows[0]["cache"] == "hit" and rows[-1]["cache"] == "miss"
    assert training_metrics(rows) == training_metrics(metrics(tmp_path / "uncached"))
    log = (tmp_path / "resumed" / "train.log").read_text()
    assert "took over the lease of dead holder" in log and f"(pid {proc.pid} on host" in log, log[-3000:]
    assert "incomplete" in log and f"[{partial}" in log.split("incomplete", 1)[1][:200], log[-3000:]
    assert_steps_whole(s3_server, bucket, prefix)
    assert committed(s3_server, bucket, prefix) == list(range(1, 31))
    assert_nothing_local(tmp_path)


def test_two_nodes_without_a_shared_directory_share_the_bucket(tmp_path, s3_server, monkeypatch):
    from test_multinode import metrics as node_metrics, two_nodes
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    for k, v in env_of(s3_server).items():
        monkeypatch.setenv(k, v)
    for code, out in two_nodes(tmp_path, [url, url], "first"):
        assert code == 0, out[-5000:]
    first = node_metrics(tmp_path, "first")
    assert [r["cache"] for r in first] == ["miss", "miss"]
    [prefix] = sorted({k.rsplit("/", 2)[0] + "/" for k in s3_server.keys(bucket, "x/") if k.endswith("/commit.json")})
    assert prefix.endswith("_W2/"), prefix
    assert committed(s3_server, bucket, prefix) == [1, 2]
    assert sorted(k[len(prefix) + 2:] for k in s3_server.keys(bucket, f"{prefix}1/")) == [
        "commit.json", "meta_rank0.json", "meta_rank1.json", "tq_batch_rank0.pt", "tq_batch_rank1.pt"]
    for code, out in two_nodes(tmp_path, [url, url], "again"):
        assert code == 0, out[-5000:]
    again = node_metrics(tmp_path, "again")
    assert [r["cache"] for r in again] == ["hit", "hit"]
    assert training_metrics(first) == training_metrics(again)
    assert_nothing_local(tmp_path)


def test_held_lease_refuses_and_an_expired_one_is_taken_over(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    s3 = s3_server.boto3()
    lease_key = f"x/{NS}/.lock"
    record = {"holder": "run-elsewhere", "host": "node-17", "pid": 4242, "since": time.time() - 60,
              "ttl_s": 30.0, "expires_at": time.time() + 3600}
    s3.put_object(Bucket=bucket, Key=lease_key, Body=json.dumps(record).encode())
    proc = train(tmp_path, s3_server, url, "skip.rollout_tq.lock_timeout=1", check=False, run="refused")
    out = proc.stdout + proc.stderr + (tmp_path / "refused" / "train.log").read_text()
    assert proc.returncode == 0, out[-3000:]        # a live lease: this run reads beside its holder
    assert "read beside" in out and "run-elsewhere" in out and "node-17" in out, out[-3000:]
    assert "own rollouts, not written" in out
    assert "Traceback" not in out
    assert committed(s3_server, bucket, f"x/{NS}/") == []
    record["expires_at"] = time.time() - 600        # its run was killed ten minutes ago
    s3.put_object(Bucket=bucket, Key=lease_key, Body=json.dumps(record).encode())
    proc = train(tmp_path, s3_server, url, run="after")
    assert "took over the expired lease of run-elsewhere" in proc.stdout + proc.stderr + \
        (tmp_path / "after" / "train.log").read_text()
    assert committed(s3_server, bucket, f"x/{NS}/") == [1, 2, 3, 4]
    lease = json.loads(s3.get_object(Bucket=bucket, Key=lease_key)["Body"].read())
    assert lease["expires_at"] < time.time()          # released when the run ended


def test_read_only_credential_serves_and_writes_nothing(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    train(tmp_path, s3_server, url, "trainer.total_training_steps=2", run="writer")
    s3 = s3_server.boto3()
    before = {k: s3.head_object(Bucket=bucket, Key=k)["ETag"] for k in s3_server.keys(bucket)}
    proc = train(tmp_path, s3_server, url, run="reader", user="reader")  # 4 steps: 2 hits, 2 misses
    rows = metrics(tmp_path / "reader")
    assert [r["cache"] for r in rows] == ["hit", "hit", "miss", "miss"]
    assert training_metrics(rows[:2]) == training_metrics(metrics(tmp_path / "writer"))
    after = {k: s3.head_object(Bucket=bucket, Key=k)["ETag"] for k in s3_server.keys(bucket)}
    assert after == before
    assert "read-only" in proc.stdout + proc.stderr + (tmp_path / "reader" / "train.log").read_text()


def test_server_stopped_mid_run_warns_goes_on_and_half_commits_nothing(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    prefix = f"x/{NS}/"
    steps = ["trainer.total_training_steps=12"]
    cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / 'outage'}", *TINY,
           f"skip.rollout_tq.dump_dir={url}", *steps]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_of(s3_server, SKIP_HARNESS_OBJSTORE_TIMEOUT_S="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not committed(s3_server, bucket, prefix) and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the outage"
        s3_server.pause()
        time.sleep(8)
        s3_server.resume()
        out, _ = proc.communicate(timeout=600)
    finally:
        s3_server.resume()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-5000:]
    assert "WARNING" in out and "unavailable" in out, out[-5000:]
    rows = metrics(tmp_path / "outage")
    assert len(rows) == 12
    done = committed(s3_server, bucket, prefix)
    assert 1 <= len(done) < 12, done
    train(tmp_path, s3_server, url, *steps, run="after")    # cleans what the outage left
    assert_steps_whole(s3_server, bucket, prefix)
    again = metrics(tmp_path / "after")
    assert [r["step"] for r in again if r["cache"] == "hit"] == done
    assert training_metrics(again) == training_metrics(rows)


def cli(server, *argv, user="writer", cwd=None):
    proc = subprocess.run([sys.executable, "-m", "skip_harness.cli", *argv], capture_output=True, text=True,
                          env=env_of(server, user), cwd=cwd, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_on_the_bucket(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    train(tmp_path, s3_server, url, "trainer.total_training_steps=3", run="first")
    code, out, err = cli(s3_server, "ls", url, "--json")
    assert code == 0, err
    [ns] = json.loads(out)["namespaces"]
    assert [s["status"] for s in ns["steps"]] == ["complete"] * 3 and ns["path"].startswith(url)
    assert index_steps(s3_server.boto3(), bucket, f"x/{NS}/.index.jsonl") == [1, 2, 3]
    code, again, err = cli(s3_server, "ls", url, "--json")        # from the index: the same answer
    assert code == 0 and json.loads(again)["namespaces"] == json.loads(out)["namespaces"], err
    code, out, err = cli(s3_server, "verify", url, "--json")
    assert code == 0, err
    code, out, err = cli(s3_server, "show", f"{url}/{NS}", "2")
    assert code == 0 and ("input_ids" in out or "responses" in out), out + err
    # the payload's own URL shows the same mini-batch (it was "no skip_harness namespace here")
    code, same, err = cli(s3_server, "show", f"{url}/{NS}/2/tq_batch.pt")
    assert code == 0, err
    assert [line for line in same.splitlines() if not line.startswith("written")] == \
        [line for line in out.splitlines() if not line.startswith("written")]
    code, out, err = cli(s3_server, "export", url, "-o", str(tmp_path / "rollouts.jsonl"), "--format", "jsonl")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 2, 3] and len(rows) == 3 * 16
    # damage step 2: verify fails naming it, clean sets it aside under .quarantine/
    s3 = s3_server.boto3()
    key = f"x/{NS}/2/tq_batch.pt"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    code, out, err = cli(s3_server, "verify", url)
    assert code == 1 and "2" in out, out + err
    code, out, err = cli(s3_server, "clean", url, "--quarantine")
    assert code == 0, err
    assert committed(s3_server, bucket, f"x/{NS}/") == [1, 3]
    assert any(k.startswith(f"x/{NS}/.quarantine/2-") for k in s3_server.keys(bucket))
    code, out, err = cli(s3_server, "ls", url, "--json")          # the set-aside step is not indexed back
    assert code == 0, err
    assert [s["step"] for s in json.loads(out)["namespaces"][0]["steps"]] == [1, 3]
    assert index_steps(s3_server.boto3(), bucket, f"x/{NS}/.index.jsonl") == [1, 3]
    # import-verl into the bucket
    sys.path.insert(0, str(REPO / "tests"))
    from test_import_verl import verl_batch, write_verl_step
    verl = tmp_path / "verl" / "exp_proj" / "GBS4_N2_in7_out4"
    for step in (1, 2):
        write_verl_step(verl / str(step), verl_batch(step, 0))
    code, out, err = cli(s3_server, "import-verl", str(tmp_path / "verl"), f"s3://{bucket}/imported", "--trust")
    assert code == 0, out + err
    assert committed(s3_server, bucket, "imported/exp_proj/GBS4_N2_in7_out4/") == [1, 2]
    assert_nothing_local(tmp_path)


# Nodes that cannot see one directory are told of the object store: test_multinode.py's
# test_nodes_with_separate_cache_dirs_stop_at_startup (the same two-agent run, once).


def test_a_node_that_cannot_reach_the_object_store_stops_every_node_with_its_reason(tmp_path, s3_server, monkeypatch):
    """W = 2 over two agents, node B pointed at an endpoint where nothing listens: the startup's
    shared-cache check names node B's rank and why, on every node, and no node is left waiting."""
    from test_multinode import free_port, two_nodes
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    for k, v in env_of(s3_server, SKIP_HARNESS_OBJSTORE_TIMEOUT_S="1").items():
        monkeypatch.setenv(k, v)
    dead = f"http://127.0.0.1:{free_port()}"
    results = two_nodes(tmp_path, [url, url], "unreachable", timeout=300, envs=[{}, {"AWS_ENDPOINT_URL": dead}])
    output = "\n".join(out for _, out in results)
    assert all(code != 0 for code, _ in results), output[-5000:]
    assert "rank 1 on" in output and "cannot see the rollout cache" in output, output[-5000:]
    assert "unavailable" in output, output[-5000:]
    assert "ObjectStoreUnavailable" not in output and f'File "{REPO / "skip_harness"}' not in output, \
        output[-5000:]          # a message, not our traceback (torchrun prints its own ChildFailedError)
