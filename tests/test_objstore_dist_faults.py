"""Issue 21, item 4: two ranks (torchrun, W = 2) on the S3 server while the server is paused again and again
(SIGSTOP moto, requests time out after 1 s) in the middle of the run's commits: each step is committed once
or not at all, never one that a rank sees committed and the other not. The run trains on and exits 0; every
step in the bucket is whole; the rerun (W = 2) serves exactly the committed steps on both ranks (they agree
or the harness stops) and reproduces the first run's training metrics."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from s3server import s3_server  # noqa: F401  (fixture)
from test_objstore_scenarios import TRAIN, assert_steps_whole, env_of, metrics
from test_train_e2e import TINY, training_metrics

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
STEPS = 14


def _commits(server, bucket):
    """{namespace prefix: [committed steps]} in the bucket."""
    out = {}
    for key in server.keys(bucket, "x/"):
        if key.endswith("/commit.json"):
            ns, step = key.rsplit("/", 2)[:2]
            if step.isdigit():
                out.setdefault(ns + "/", []).append(int(step))
    return {k: sorted(v) for k, v in out.items()}


def _torchrun(tmp_path, server, url, run, env):
    cmd = [*TORCHRUN, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY,
           f"trainer.total_training_steps={STEPS}", f"skip.rollout_tq.dump_dir={url}"]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_ranks_with_the_server_paused_mid_commit_commit_once_or_not_at_all(tmp_path, s3_server):
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    env = env_of(s3_server, SKIP_HARNESS_OBJSTORE_TIMEOUT_S="1", OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    first = _torchrun(tmp_path, s3_server, url, "first", env)
    try:
        deadline = time.time() + 300
        while not _commits(s3_server, bucket) and first.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert first.poll() is None, "the run ended before the outage: " + first.stdout.read()[-3000:]
        for _ in range(3):                    # the first commit just landed: the next ones are on their way
            s3_server.pause()
            time.sleep(3)
            s3_server.resume()
            time.sleep(0.7)
        out, _ = first.communicate(timeout=600)
    finally:
        s3_server.resume()
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, out[-5000:]
    assert "unavailable" in out, out[-5000:]          # the outage reached the run
    assert "taken over" not in out, out[-5000:]       # a renewal that landed after its reply was lost is ours
    [(prefix, committed)] = _commits(s3_server, bucket).items()
    assert prefix.endswith("_W2/"), prefix
    assert 0 < len(committed) < STEPS, committed
    # no step half-committed: what a commit record names is there, and nothing else but incomplete steps
    # (cleaned by the rerun's startup)
    again = subprocess.run([*TORCHRUN, str(TRAIN), f"hydra.run.dir={tmp_path / 'again'}", *TINY,
                            f"trainer.total_training_steps={STEPS}", f"skip.rollout_tq.dump_dir={url}"],
                           cwd=tmp_path, env=env_of(s3_server, OMP_NUM_THREADS="1"), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    rows = metrics(tmp_path / "again")
    hits = [r["step"] for r in rows if r["cache"] == "hit"]
    assert hits == committed, (hits, committed)       # both ranks served exactly the committed steps
    assert training_metrics(rows) == training_metrics(metrics(tmp_path / "first"))
    assert_steps_whole(s3_server, bucket, prefix)
    assert sorted(_commits(s3_server, bucket)[prefix]) == list(range(1, STEPS + 1))
    assert json.loads(s3_server.boto3().get_object(Bucket=bucket, Key=f"{prefix}1/commit.json")["Body"].read())["W"] == 2
