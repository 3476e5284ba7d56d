"""A TRL recording served at another K (`replay_from`, here through `$SKIP_HARNESS_REPLAY_FROM` as
`skip-harness replay` sets it): TRL's K is `gradient_accumulation_steps / steps_per_generation`, so a
recording made with one generation call of 16 completions per optimizer step (K=1) serves a run that
makes two calls of 8 (K=2), re-chunked. Its rollout values (TRL's means over a call's rows) reproduce
within rounding; its training values are checked against the first replay at K=2 -- so a learning rate
1% off is caught at step 0. CPU, the tiny model trl_demo builds from its seed, no downloads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")

from replay_rig import namespace_in  # noqa: E402
from test_trl import DEMO, _env  # noqa: E402

pytestmark = [pytest.mark.xdist_group("test_trl_regroup"), pytest.mark.slow]

ARGS = ("--steps", "3", "--eval-steps", "0", "--grad-accum", "2")


def _train(role, workdir, dump_dir, *args, replay_from=None, nproc=1):
    env = _env()
    if replay_from is not None:
        env["SKIP_HARNESS_REPLAY_FROM"] = str(replay_from)
    result = workdir / f"{role}-{os.urandom(4).hex()}.json"
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run(
        [*launcher, str(DEMO), "--role", role, "--workdir", str(workdir), "--dump-dir", str(dump_dir),
         "--output-dir", str(workdir / f"out_{result.stem}"), "--result", str(result), *ARGS, *args],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text()), proc.stderr


def _summary(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if "rollout cache summary" in line)


def test_a_k1_recording_serves_k2_reproduced_and_a_changed_lr_is_caught(tmp_path):
    _, err = _train("record", tmp_path, tmp_path / "rec", "--steps-per-generation", "2")
    recording = namespace_in(tmp_path / "rec").root
    # K=2: two generation calls of 8 per optimizer step, served from the recording's one call of 16
    _, first = _train("replay", tmp_path, tmp_path / "own", "--steps-per-generation", "1", replay_from=recording)
    line = _summary(first)
    assert "3 hits" in line and "re-chunked from K=1 to K=2" in line, line
    assert "replay: 3 of 3 served steps reproduced" in line, line
    assert "reward, rewards/digit_reward/mean compared within rounding noise" in line, line
    assert "replay diverged" not in first
    # the same again: its training values now checked against the first replay at K=2
    _, again = _train("replay", tmp_path, tmp_path / "own", "--steps-per-generation", "1", replay_from=recording)
    assert "replay: 3 of 3 served steps reproduced" in _summary(again), _summary(again)
    assert "compared with replay " in _summary(again)
    # and a learning rate 1% off is caught at step 0, named
    _, changed = _train("replay", tmp_path, tmp_path / "own", "--steps-per-generation", "1", "--lr", "0.00101",
                        replay_from=recording)
    assert "replay diverged at step 0" in changed and "trl.learning_rate: 0.001 -> 0.00101" in changed, \
        _summary(changed)


def test_a_two_process_recording_replayed_by_one_reproduces_and_a_changed_lr_is_caught(tmp_path):
    """Issue 39, item 1: TRL is not W-invariant (AdamW turns grad_norm's rounding noise of another W into
    real updates), so at another W its training values are checked against the first replay by one process,
    its rollout values against the recording's within rounding noise (run.shape)."""
    _train("record", tmp_path, tmp_path / "rec", "--batch", "4", nproc=2)
    recording = namespace_in(tmp_path / "rec").root
    _, first = _train("replay", tmp_path, tmp_path / "own", "--batch", "8", replay_from=recording)
    line = _summary(first)
    assert "3 hits" in line and "replay: 3 of 3 served steps reproduced" in line, line
    assert "re-sharded from W=2 to W=1: values recorded at W=2" in line and "(they depend on W)" in line, line
    _, again = _train("replay", tmp_path, tmp_path / "own", "--batch", "8", replay_from=recording)
    assert "replay: 3 of 3 served steps reproduced" in _summary(again), _summary(again)
    assert "grad_norm" in _summary(again).split("compared with replay ")[0], _summary(again)
    _, changed = _train("replay", tmp_path, tmp_path / "own", "--batch", "8", "--lr", "0.00101",
                        replay_from=recording)
    assert "replay diverged at step 0" in changed and "trl.learning_rate: 0.001 -> 0.00101" in changed, \
        _summary(changed)
