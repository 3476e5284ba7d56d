"""The replay check inside verl's trainer code (tests/verl_rig.py): verl's metrics reach the harness through
verl's own tracker, ``verl.utils.tracking.Tracking.log(data, step)`` -- the call verl's ``fit`` makes once per
step -- and a replay reports whether every served step reproduced them (integrations/verl_values.py)."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import verl_rig as rig  # noqa: E402
from replay_rig import namespace_in, serve_other_rollouts  # noqa: E402

pytestmark = pytest.mark.verl
STEPS = (1, 2, 3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import skip_harness.integrations.verl  # noqa: F401 - what VERL_USE_EXTERNAL_MODULES imports

    address = rig.start(rig.compose(str(tmp_path_factory.mktemp("boot"))))
    yield address
    rig.clear_queue()


def _train(dump_dir, *extra, salt=1):
    """verl's step loop, with what fit does after each step: its metrics logged through verl's Tracking."""
    from verl.utils.tracking import Tracking

    cfg = rig.compose(str(dump_dir), steps=STEPS, extra=list(extra))
    lr = float(cfg.actor_rollout_ref.actor.optim.lr)
    tracking = Tracking(project_name=rig.PROJECT, experiment_name=rig.EXPERIMENT, default_backend=[])

    def log_metrics(step, sampled):
        rewards = [float(t.sum()) for s in sampled for t in s.data["rm_scores"].unbind()]
        lengths = [t.numel() for s in sampled for t in s.data["responses"].unbind()]
        score = sum(rewards) / len(rewards)
        tracking.log(data={"critic/score/mean": score, "response_length/mean": sum(lengths) / len(lengths),
                           "actor/pg_loss": -lr * score, "timing_s/step": 0.01 * step, "perf/throughput": 1.0 / step,
                           # validation is generated again on every run (never cached): left out by default
                           "val-core/test/reward/mean@1": float(salt)},
                     step=step)

    return rig.run_steps(cfg, buffer="sync", salt=salt, steps=STEPS, after_step=log_metrics)


def test_verl_metrics_are_recorded_and_checked_on_replay(cluster, tmp_path, caplog):
    from skip_harness.store.open import open_store

    first = _train(tmp_path)
    assert first.outcomes == {1: "miss", 2: "miss", 3: "miss"}
    values = open_store(namespace_in(tmp_path)).reader.read_values(2)
    assert set(values) == {"critic/score/mean", "response_length/mean", "actor/pg_loss", "timing_s/step",
                           "val-core/test/reward/mean@1",
                           "perf/throughput"}
    same = _train(tmp_path, salt=2)
    assert same.train_generations == 0
    # timing_s/step and perf/throughput are left out (replay_ignore's defaults)
    assert same.summary.replay_line == "replay: 3 of 3 served steps reproduced (3 values each)"

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        lr = _train(tmp_path, "actor_rollout_ref.actor.optim.lr=0.5", salt=3)
    assert lr.summary.replay_line.startswith("replay diverged at step 1 (actor/pg_loss ")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "skip_harness"]
    assert "actor_rollout_ref.actor.optim.lr: 1e-06 -> 0.5" in warnings[-1], warnings

    serve_other_rollouts(namespace_in(tmp_path), src=2, dst=3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        other = _train(tmp_path, salt=4)
    assert other.outcomes == {1: "hit", 2: "hit", 3: "hit"}
    assert other.summary.replay_line.startswith("replay diverged at step 3 (critic/score/mean ")
    assert other.summary.replay_line.endswith("; 2 steps reproduced before it")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "skip_harness"
                  and "AutoModelForCausalLMWithValueHead" not in r.getMessage()]   # the TRL note (TRL >= 1.13)
    assert "nothing in it explains this" in warning


def test_replay_check_error_from_the_skip_harness_node_stops_verl_at_the_divergence(cluster, tmp_path):
    from skip_harness.errors import ReplayDivergedError

    _train(tmp_path)
    with pytest.raises(ReplayDivergedError, match=r"step 1: actor/pg_loss .*actor_rollout_ref\.actor\.optim\.lr"):
        _train(tmp_path, "actor_rollout_ref.actor.optim.lr=0.5", "+skip_harness.replay_check=error", salt=2)


def test_tracking_log_is_verls_own_once_uninstalled():
    from verl.utils.tracking import Tracking

    from skip_harness.integrations import verl_live, verl_values

    wrapped = Tracking.log
    verl_values.uninstall()
    try:
        assert Tracking.log is wrapped.__wrapped__
    finally:
        verl_values.install(verl_live.instances)
    assert Tracking.log is not wrapped.__wrapped__
