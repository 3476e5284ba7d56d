"""Real multi-process runs (torchrun, accelerate launch; gloo on CPU) and Hydra multirun sweeps."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_e2e import TINY, TRAIN, env_for, metrics, recorded, training_metrics

pytestmark = pytest.mark.slow


def launch(tmp_path: Path, launcher: list, run: str, *overrides: str):
    cmd = [*launcher, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY, *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TWO_RANKS = ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2"]
# the torchrun tests below start from one recording on two ranks (recorded(): made once per worker)
ON_TWO_RANKS = pytest.mark.xdist_group("torchrun_recording")


@ON_TWO_RANKS
def test_torchrun_two_ranks_shards_commits_and_hits(tmp_path_factory, tmp_path):
    mode = TWO_RANKS
    recorded(tmp_path_factory, tmp_path, *mode, launcher=tuple(TORCHRUN))
    launch(tmp_path, TORCHRUN, "again", *mode)
    first, again = metrics(tmp_path / "first"), metrics(tmp_path / "again")
    assert [r["cache"] for r in first] == ["miss"] * 4 and [r["cache"] for r in again] == ["hit"] * 4
    assert training_metrics(first) == training_metrics(again)
    [ns] = (tmp_path / "cache").glob("*/GBS*")
    assert ns.name == "GBS8_N2_in6_out6_K2_W2"
    assert sorted(p.name for p in (ns / "4" / "1").iterdir()) == [
        "meta_rank0.json", "meta_rank1.json", "tq_batch_rank0.pt", "tq_batch_rank1.pt"
    ]
    commit = json.loads((ns / "4" / "commit.json").read_text())
    assert commit["W"] == 2 and commit["K"] == 2
    # one process spoke for the run: the per-step lines and the replay check's verdict appear once
    log = (tmp_path / "again" / "train.log").read_text()
    assert log.count("step 4: hit") == 1
    assert log.count("replay: 4 of 4 served steps reproduced (") == 1


@ON_TWO_RANKS
@pytest.mark.parametrize("cleanup", ["delete", "quarantine"])
def test_torchrun_rank_shard_corruption_makes_every_rank_regenerate(tmp_path_factory, tmp_path, cleanup):
    recorded(tmp_path_factory, tmp_path, *TWO_RANKS, launcher=tuple(TORCHRUN))
    [ns] = (tmp_path / "cache").glob("*/GBS*")
    shard = ns / "2" / "1" / "tq_batch_rank1.pt"     # rank 1's shard of step 2's second sample call
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    launch(tmp_path, TORCHRUN, "again", *TWO_RANKS, f"skip.rollout_tq.cleanup={cleanup}")
    rows = metrics(tmp_path / "again")
    assert [r["cache"] for r in rows] == ["hit", "miss", "hit", "hit"]
    # rank 0 set the step aside as cleanup says, though only rank 1's shard was bad
    kept = list((ns / ".quarantine").glob("2-*/1/tq_batch_rank1.pt"))
    assert (kept[0].read_bytes() == bytes(data)) if cleanup == "quarantine" else not kept
    assert training_metrics(rows) == training_metrics(metrics(tmp_path / "first"))
    log = (tmp_path / "again" / "train.log").read_text()
    assert "[rank 1]" in log and "tq_batch_rank1.pt" in log


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not on PATH")
def test_accelerate_launch_two_processes(tmp_path):
    acc = [shutil.which("accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0"]   # a free port (its default 29500 collides with a parallel run)
    launch(tmp_path, acc, "first")
    launch(tmp_path, acc, "again")
    assert [r["cache"] for r in metrics(tmp_path / "again")] == ["hit"] * 4
    assert [p.name for p in (tmp_path / "cache").glob("*/GBS*")] == ["GBS8_N2_in6_out6_K1_W2"]


def test_bad_world_size_split_names_the_key(tmp_path):
    cmd = [*TORCHRUN, str(TRAIN), f"hydra.run.dir={tmp_path / 'run'}", *TINY, "data.train_batch_size=7"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "data.train_batch_size" in out and "K x W" in out
    # torchrun's own agent prints a traceback when a worker exits non-zero; ours print none
    import re

    assert not re.search(r'File ".*(skip_harness|train\.py)", line', out), out


def sweep(tmp_path: Path, name: str, *extra: str):
    cmd = [
        sys.executable, str(TRAIN), "-m", *TINY, "trainer.total_training_steps=2",
        # big enough that torch splits reductions across threads, so a thread-count drift would show
        "data.train_batch_size=64", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.model.d_model=64",
        "trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1,2",
        f"hydra.sweep.dir={tmp_path / name}", *extra,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = sorted(p.parent for p in (tmp_path / name).glob("*/metrics.jsonl"))
    assert len(runs) == 2
    return runs


BASIC: list = []
JOBLIB = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]


def test_sweep_over_k_gets_own_namespaces_and_rerun_hits(tmp_path):
    # Recorded under the basic launcher, rerun under joblib's: joblib's workers train on what basic's jobs
    # recorded, and the metrics are compared bit for bit, so a joblib job training differently shows here.
    # (The other order, joblib then basic, compared the same training under the same two launchers: what a
    # job generates is served back as recorded in either order, so it told nothing this one does not.)
    first = sweep(tmp_path, "sweep1", *BASIC)
    again = sweep(tmp_path, "sweep2", *JOBLIB)
    leaves = sorted(p.name for p in (tmp_path / "cache").glob("*/GBS*"))
    assert leaves == ["GBS64_N8_in6_out6", "GBS64_N8_in6_out6_K2_W1"]
    for a, b in zip(first, again):
        assert [r["cache"] for r in metrics(a)] == ["miss", "miss"]
        assert [r["cache"] for r in metrics(b)] == ["hit", "hit"]
        # the same bits under either launcher (joblib's workers would default to one torch thread)
        assert training_metrics(metrics(a)) == training_metrics(metrics(b))
    # each sweep's table: a few words per job (the recording's jobs, then the replays that reproduced them)
    for name, verdict, counts in (("sweep1", "recorded", "0 / 2"), ("sweep2", "2/2 reproduced", "2 / 0")):
        rows = (tmp_path / name / "sweep_summary.md").read_text().splitlines()[2:]
        assert [r.split(" | ")[2:4] for r in rows] == [[counts, verdict]] * 2, rows


@pytest.mark.parametrize("launcher", [BASIC, JOBLIB], ids=["basic", "joblib"])
def test_a_sweep_runs_every_job_when_one_stops_and_exits_nonzero_naming_it(tmp_path, launcher):
    from skip_harness.store.layout import NamespaceKey

    # The K = 2 job's namespace cannot be used (its .lock is a symbolic link, never followed): that job
    # stops; the K = 1 and K = 4 jobs still run. (A namespace another run holds no longer stops a job:
    # it reads beside that run, tests/test_replays.py.)
    held = NamespaceKey("separate_async_seed0", "skip_harness_demo", 8, 2, 6, 6, K=2).layout(tmp_path / "cache")
    held.root.mkdir(parents=True)
    (held.root / ".lock").symlink_to(tmp_path / "elsewhere")
    cmd = [sys.executable, str(TRAIN), "-m", *TINY, "trainer.total_training_steps=2", "trainer_mode=separate_async",
           "trainer.v1.separate_async.parameter_sync_step=1,2,4", f"hydra.sweep.dir={tmp_path / 'sweep'}", *launcher]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    runs = sorted(p.parent.name for p in (tmp_path / "sweep").glob("*/metrics.jsonl"))
    assert runs == ["0_separate_async_K1", "2_separate_async_K4"], out
    assert "sweep job 1 (" in out and "parameter_sync_step=2" in out and "symbolic link" in out
    assert "1 of the sweep's jobs failed" in out and "Traceback" not in out
