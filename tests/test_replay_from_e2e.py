"""Issue 28, items 4 and 5, end to end: `scripts/train.py` recorded once at K = 4 and replayed at another K and
in the other modes with `skip.rollout_tq.replay_from`, generating nothing; torchrun runs re-sharded 2 -> 1,
1 -> 2 and 2 -> 4 ranks, the global batch checked by content (tests/reshard_rig.py); and the same from an
`s3://` cache on a real S3-compatible server."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from s3server import s3_server  # noqa: F401  (fixture)
from test_replay_from import snapshot
from test_train_e2e import TINY, TRAIN, env_for, metrics, recorded, train

pytestmark = pytest.mark.slow

RIG = REPO / "tests" / "reshard_rig.py"
SWEEP = ["trainer.experiment_name=sweep", "trainer.total_training_steps=3"]
K4 = ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4"]
# the tests replaying one recording (recorded() / rig_recording(): made once per worker) run on one worker
ONE_RECORDING = pytest.mark.xdist_group("replay_from_e2e_recordings")


def log_of(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@ONE_RECORDING
def test_a_k4_recording_serves_sync_and_colocate_async_generating_nothing(tmp_path_factory, tmp_path):
    recorded(tmp_path_factory, tmp_path, *SWEEP, *K4, run="record")
    source = tmp_path / "cache" / "sweep_skip_harness_demo" / "GBS8_N2_in6_out6_K4_W1"
    before = snapshot(source)
    replays = {   # another K in separate_async: the sweep below
        "sync": (["trainer_mode=sync"], 1),
        "colocate": (["trainer_mode=colocate_async"], 1),
    }
    for run, (overrides, K) in replays.items():
        where = "auto" if run != "colocate" else str(source)
        proc = train(tmp_path, *SWEEP, *overrides, f"skip.rollout_tq.replay_from={where}", run=run)
        rows = metrics(tmp_path / run)
        assert [r["cache"] for r in rows] == ["hit"] * 3, run
        log = log_of(proc)
        assert f"step 3: hit, K={K}, loaded" in log and f"served re-chunked from K=4 to K={K}" in log, log
        assert "0 misses" in log and "diverged" not in log, log
        if run == "sync":      # the first replay at K=1: the values that depend on K are not compared
            assert ("replay: 3 of 3 served steps reproduced (2 values each); re-chunked from K=4 to K=1: values "
                    "recorded at K=4; approx_kl, clip_frac, grad_norm, loss not compared (they depend on K); "
                    "response_len, reward_mean compared within rounding noise (32 x float32 eps)") in log, log
        else:                  # compared with the sync replay's (K=1, W=1, the recording's training side)
            assert ("replay: 3 of 3 served steps reproduced (6 values each); re-chunked from K=4 to K=1: values "
                    "recorded at K=4; approx_kl, clip_frac, grad_norm, loss compared with replay ") in log, log
    assert snapshot(source) == before


@ONE_RECORDING
def test_a_sweep_over_k_with_replay_from_generates_nothing(tmp_path_factory, tmp_path):
    """`parameter_sync_step=1,2,4,8` swept over one recording (Hydra's basic launcher) generates nothing."""
    recorded(tmp_path_factory, tmp_path, *SWEEP, *K4, run="record")
    cmd = [sys.executable, str(TRAIN), "-m", f"hydra.sweep.dir={tmp_path / 'multirun'}",
           *TINY, *SWEEP, "trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1,2,4,8",
           "skip.rollout_tq.replay_from=auto"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, log_of(proc)
    jobs = sorted((tmp_path / "multirun").glob("*_separate_async_K*"))
    assert len(jobs) == 4
    for job in jobs:
        assert [r["cache"] for r in metrics(job)] == ["hit"] * 3, job
    log = log_of(proc)
    assert log.count("0 misses") == 4, log
    for K in (1, 2, 8):
        assert f"step 3: hit, K={K}, loaded" in log and f"served re-chunked from K=4 to K={K}" in log, log
    assert "served re-chunked from K=4 to K=4" not in log     # K = 4 is served from its own namespace
    assert "diverged" not in log
    # every job is a replay of the one recording: counted there by `ls`, no namespace of its own (issue 40)
    ls = subprocess.run([sys.executable, "-m", "skip_harness.cli", "ls", str(tmp_path / "cache"), "--json"],
                        cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    [listed] = json.loads(ls.stdout)["namespaces"]
    assert listed["path"].endswith("GBS8_N2_in6_out6_K4_W1") and listed["replays"] == 4, listed


def rig(tmp_path: Path, nproc: int, K: int, out: str, *extra: str, env=None, dump=None) -> dict:
    launcher = [sys.executable, str(RIG)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(RIG)]
    cmd = [*launcher, str(dump or tmp_path / "cache"), str(K), "3", str(tmp_path / out), *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, log_of(proc)
    return {r: json.loads((tmp_path / out / f"rank{r}.json").read_text()) for r in range(nproc)}


_RIG_RECORDINGS: dict = {}


def rig_recording(tmp_path_factory, tmp_path: Path, nproc: int, K: int) -> None:
    """`rig(tmp_path, nproc, K, "record")`'s cache, recorded once per worker and copied into tmp_path."""
    if (nproc, K) not in _RIG_RECORDINGS:
        src = tmp_path_factory.mktemp("rig_recording")
        rig(src, nproc, K, "record")
        _RIG_RECORDINGS[nproc, K] = src
    shutil.copytree(_RIG_RECORDINGS[nproc, K] / "cache", tmp_path / "cache", symlinks=True)


def assert_global_batch(ranks: dict, K: int) -> None:
    """Every rank's calls, in the recorded order (call-major, rank-minor), are the step's whole global
    batch in order: the same rows, in the same order, as recorded; and each rank's part is the one it
    would have generated at this K and W."""
    W = len(ranks)
    for step in ("1", "2", "3"):
        assert all(ranks[r]["steps"][step]["outcome"] == "hit" for r in ranks)
        in_order = [row for i in range(K) for r in range(W) for row in ranks[r]["steps"][step]["calls"][i]]
        assert in_order == [int(step) * 1000 + g for g in range(16)], in_order
    assert all(ranks[r]["generated"] == 0 for r in ranks)


@pytest.mark.parametrize("record, replay", [((2, 2), (1, 2)), ((1, 4), (2, 4)), ((2, 2), (4, 1))],
                         ids=["2-to-1", "1-to-2", "2-to-4"])
@ONE_RECORDING
def test_torchrun_resharded_global_batch_is_the_recorded_one(tmp_path_factory, tmp_path, record, replay):
    (W0, K0), (W1, K1) = record, replay
    rig_recording(tmp_path_factory, tmp_path, W0, K0)    # 2-to-1 and 2-to-4 replay one recording
    ns = tmp_path / "cache" / "rig_reshard" / f"GBS8_N2_K{K0}_W{W0}"
    before = snapshot(ns)
    ranks = rig(tmp_path, W1, K1, "replay", "auto")
    assert_global_batch(ranks, K1)
    assert snapshot(ns) == before
    line = ranks[0]["summary"]
    if K0 == K1:
        assert line == f"replay: 3 of 3 served steps reproduced (1 value each); re-sharded from W={W0} to W={W1}; " \
                       "compared within rounding noise (32 x float32 eps)", line
    else:
        assert f"re-chunked from K={K0} to K={K1}" in line and f"re-sharded from W={W0} to W={W1}" in line, line


def test_torchrun_a_trainer_not_w_invariant_is_checked_against_the_first_replay_on_one_rank(tmp_path):
    """Issue 39, item 1 (run.shape): a trainer whose training values depend on W (TRL, a loss that is a mean
    of per-rank means), recorded on two ranks, replayed on one: the first replay reproduces its rollout
    values and says its training values were not compared; the next is checked on every value against it,
    and a learning rate 1% off is caught at its first diverging step, naming the key."""
    env = lambda lr: {**os.environ, "RIG_LR": lr}   # noqa: E731
    rig(tmp_path, 2, 2, "record", env=env("0.001"))
    first = rig(tmp_path, 1, 2, "replay", "auto", env=env("0.001"))[0]["summary"]
    assert first == ("replay: 3 of 3 served steps reproduced (1 value each); re-sharded from W=2 to W=1: values "
                     "recorded at W=2; loss not compared (they depend on W); reward_mean compared within rounding "
                     "noise (32 x float32 eps)"), first
    again = rig(tmp_path, 1, 2, "again", "auto", env=env("0.001"))[0]["summary"]
    assert again.startswith("replay: 3 of 3 served steps reproduced (2 values each); re-sharded from W=2 to W=1"), again
    assert "loss compared with replay " in again and "'s at K=2, W=1" in again, again
    changed = rig(tmp_path, 1, 2, "changed", "auto", env=env("0.00101"))[0]["summary"]
    assert changed.startswith("replay diverged at step 2 (loss "), changed
    assert "training side changed: optim.lr 0.001 -> 0.00101" in changed, changed


def test_demo_recorded_on_two_ranks_replays_on_one_within_the_named_tolerance(tmp_path):
    mode = ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2", *SWEEP]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN),
           f"hydra.run.dir={tmp_path / 'record'}", *TINY, *mode]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, log_of(proc)
    proc = train(tmp_path, *mode, "skip.rollout_tq.replay_from=auto", run="replay")
    log = log_of(proc)
    assert "step 3: hit, K=2" in log and "served re-sharded from W=2 to W=1" in log, log
    assert "replay: 3 of 3 served steps reproduced (6 values each); re-sharded from W=2 to W=1; compared within " \
           "rounding noise (32 x float32 eps)" in log, log
    assert [r["cache"] for r in metrics(tmp_path / "replay")] == ["hit"] * 3


def test_s3_recording_on_one_rank_serves_two(tmp_path, s3_server):  # noqa: F811  (fixture)
    bucket = s3_server.create_bucket()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env("writer"))
    env["SKIP_HARNESS_OBJSTORE_TIMEOUT_S"] = "10"
    url = f"s3://{bucket}/cache"
    rig(tmp_path, 1, 4, "record", env=env, dump=url)
    keys = s3_server.keys(bucket, "cache/rig_reshard/GBS8_N2_K4_W1/")
    ranks = rig(tmp_path, 2, 2, "replay", f"{url}/rig_reshard/GBS8_N2_K4_W1", env=env, dump=url)
    assert_global_batch(ranks, 2)
    after = s3_server.keys(bucket, "cache/rig_reshard/GBS8_N2_K4_W1/")
    replays = [k for k in after if "/.values/runs/" in k]        # the replay's values, beside the recording's
    assert [k for k in after if k not in replays] == keys and len(replays) == 4, after   # no rollout written
    assert not s3_server.keys(bucket, "cache/rig_reshard/GBS8_N2_K2_W2/")     # nor a namespace of its own
    assert "re-chunked from K=4 to K=2" in ranks[0]["summary"] and "re-sharded from W=1 to W=2" in ranks[0]["summary"]
    assert not (tmp_path / "s3:").exists()


LR = "actor_rollout_ref.actor.optim.lr"


def replay_line(proc: subprocess.CompletedProcess) -> str:
    [line] = [ln for ln in log_of(proc).splitlines() if "rollout cache summary" in ln]
    return line.split("loading ", 1)[1].split("; ", 1)[1]


def test_issue_39_two_ranks_replayed_on_one_reproduce_and_lr_off_by_1pct_is_caught(tmp_path):
    """The issue's repro (its batch, the default model): approx_kl is rounding noise around zero on both
    sides, not a divergence; the same replay with lr x 1.01 diverges at step 2, naming loss."""
    batch = ["data.train_batch_size=16", "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=3",
             "trainer.test_freq=0", "trainer.progress=false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN),
           f"hydra.run.dir={tmp_path / 'record'}", *batch]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, log_of(proc)
    lr = 0.003                                   # the demo's default
    for run, extra in (("same", []), ("lr", [f"{LR}={lr * 1.01}"])):
        cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *batch,
               "skip.rollout_tq.replay_from=auto", *extra]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, log_of(proc)
        line = replay_line(proc)
        if run == "same":
            assert line.startswith("replay: 3 of 3 served steps reproduced (6 values each); re-sharded from W=2 "
                                   "to W=1; compared within rounding noise"), line
        else:
            assert line.startswith("replay diverged at step 2 (loss "), line
            assert f"training side changed: {LR} 0.003 -> 0.00303" in line, line


@ONE_RECORDING
def test_a_k4_recording_replayed_at_k_1_2_8_reproduces_and_lr_off_by_1pct_is_caught(tmp_path_factory, tmp_path):
    """At another K the values that depend on K are compared with the first replay at that K (the
    recording's training side): it reproduces the recording; lr x 1.01 diverges at its first step."""
    recorded(tmp_path_factory, tmp_path, *SWEEP, *K4, run="record")
    first_step = {1: 2, 2: 1, 8: 1}          # at K > 1 the second update of step 1 already sees the lr
    for K, step in first_step.items():
        mode = ["trainer_mode=separate_async", f"trainer.v1.separate_async.parameter_sync_step={K}",
                "skip.rollout_tq.replay_from=auto"]
        line = replay_line(train(tmp_path, *SWEEP, *mode, run=f"K{K}"))
        assert line.startswith("replay: 3 of 3 served steps reproduced (2 values each); re-chunked from K=4 to "
                               f"K={K}"), line
        line = replay_line(train(tmp_path, *SWEEP, *mode, run=f"K{K}again"))     # compared with the first
        assert line.startswith("replay: 3 of 3 served steps reproduced (6 values each)"), line
        assert "approx_kl, clip_frac, grad_norm, loss compared with replay " in line, line
        line = replay_line(train(tmp_path, *SWEEP, *mode, f"{LR}=0.00303", run=f"K{K}lr"))
        assert line.startswith(f"replay diverged at step {step} (loss "), (K, line)
        assert f"training side changed: {LR} 0.003 -> 0.00303" in line, line
