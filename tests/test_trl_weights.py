"""TRL with `skip.rollout_tq.replay_weights` (`attach(..., replay_weights=True)`; scripts/trl_demo.py
`--replay-weights`): each optimizer step's parameter digests are recorded after its log entry and compared
exactly on a replay. TRL logs the learning rate, so a learning-rate change is named by that value first;
the training-side change here is AdamW's weight decay, which step 0's logged values (computed before its
update: loss, grad_norm) cannot show and its update does: without the digests the replay diverges only at
step 1. CPU, the tiny model trl_demo builds from its seed, no downloads.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from replay_rig import namespace_in  # noqa: E402
from skip_harness.store.open import open_store  # noqa: E402
from test_trl import _run  # noqa: E402

pytestmark = [pytest.mark.xdist_group("test_trl_weights"), pytest.mark.slow]

STEPS = 3
ARGS = ("--steps", str(STEPS), "--eval-steps", "0")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Recorded with the digests on, then replayed alike: two trainings, each its own process."""
    workdir = tmp_path_factory.mktemp("trl_weights")
    dump_dir = workdir / "cache"
    record, _ = _run("record", workdir, dump_dir, workdir, *ARGS, "--replay-weights")
    replay, _ = _run("replay", workdir, dump_dir, workdir, *ARGS, "--replay-weights")
    return SimpleNamespace(workdir=workdir, dump_dir=dump_dir, record=record, replay=replay)


def _weights(values: dict) -> dict:
    return {k: v for k, v in values.items() if k.startswith("weights/")}


def test_every_step_records_each_parameter_after_its_log_entry_and_the_replay_reproduces(recorded):
    reader = open_store(namespace_in(recorded.dump_dir)).reader
    for step in range(STEPS):
        values = reader.read_values(step)
        weights = _weights(values)
        assert weights and all(k.startswith("weights/policy.model.") or k.startswith("weights/policy.lm_head")
                               for k in weights), sorted(weights)[:4]
        assert list(values).index(next(iter(weights))) > list(values).index("loss")   # the log entry first
        assert all(v == int(v) and 0 <= v < 2 ** 52 for v in weights.values())
    assert _weights(reader.read_values(0)) != _weights(reader.read_values(1))
    assert recorded.replay["summary"]["hits"] == STEPS
    assert recorded.replay["replay"].startswith(f"replay: {STEPS} of {STEPS} served steps reproduced ("), \
        recorded.replay["replay"]


def test_weight_decay_is_named_at_step_0_by_the_first_parameter(recorded, tmp_path):
    import shutil

    dump_dir = tmp_path / "cache"
    shutil.copytree(recorded.dump_dir, dump_dir)
    result, stderr = _run("replay", recorded.workdir, dump_dir, tmp_path, *ARGS, "--replay-weights",
                          "--weight-decay", "0.1")
    line = result["replay"]
    assert line.startswith("replay diverged at step 0 (weights/policy.model.embed_tokens.weight digest "), line
    assert "training side changed: trl.weight_decay 0.0 -> 0.1" in line
    assert "weights/policy.model.embed_tokens.weight digest" in stderr


def test_without_the_key_no_digest_is_recorded(tmp_path):
    _run("record", tmp_path, tmp_path / "cache", tmp_path, "--steps", "1", "--eval-steps", "0")
    values = open_store(namespace_in(tmp_path / "cache")).reader.read_values(0)
    assert values and "loss" in values and not _weights(values)
