"""The replay check end to end: scripts/train.py under torchrun with two ranks (gloo), as a user runs it."""
from __future__ import annotations

import subprocess

import pytest

from replay_rig import namespace_in, serve_other_rollouts
from test_distributed_and_sweeps import ON_TWO_RANKS, TORCHRUN, TWO_RANKS
from test_train_e2e import TINY, TRAIN, env_for, recorded

pytestmark = pytest.mark.slow


def _torchrun(tmp_path, run, *overrides):
    cmd = [*TORCHRUN, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY, *TWO_RANKS, *overrides]
    return subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=600)


@ON_TWO_RANKS
def test_two_ranks_record_replay_explain_and_stop(tmp_path_factory, tmp_path):
    """The recording on two ranks is test_distributed_and_sweeps' (one per worker); its replay there says
    "replay: 4 of 4 served steps reproduced" once (rank 0 speaks for the run)."""
    recorded(tmp_path_factory, tmp_path, *TWO_RANKS, launcher=tuple(TORCHRUN))
    lr = _torchrun(tmp_path, "lr", "actor_rollout_ref.actor.optim.lr=0.006")
    assert lr.returncode == 0
    log = (tmp_path / "lr" / "train.log").read_text()
    assert log.count("WARNING] - replay diverged at step ") == 1
    assert "actor_rollout_ref.actor.optim.lr: 0.003 -> 0.006" in log

    serve_other_rollouts(namespace_in(tmp_path / "cache"), src=2, dst=3)
    stop = _torchrun(tmp_path, "stop", "skip.rollout_tq.replay_check=error")
    assert stop.returncode != 0                                             # every rank stopped there
    log = (tmp_path / "stop" / "train.log").read_text()
    assert "replay diverged at step 3: " in log and "stopping (skip.rollout_tq.replay_check=error)" in log
    # torchrun reports its failed children with its own traceback; ours has none (one message per rank)
    assert "ReplayDivergedError" not in stop.stderr.split("torch.distributed.elastic")[0], stop.stderr[-3000:]
    assert 'skip_harness/run/' not in stop.stderr
