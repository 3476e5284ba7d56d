"""Issue 39, item 1: a replay at another W never cries wolf, and still catches a real change (run.shape).

A trainer whose training values depend on W (TRL, verl) is checked at another W as at another K: its rollout
values against the recording's within rounding noise, its training values against the first replay at this
K and W with the recording's training side (run.baseline), exactly. verl's W is its worker count,
trainer.nnodes x trainer.n_gpus_per_node, read from the recorded training-side config: the plug-in's harness
always runs at W = 1 in verl's driver, so a recording made on two GPUs replayed on one is the same namespace.
In-process runs with the verl plug-in's own settings (`verl_config.plan_of`) and the rig's rows; the same
at another process-group W is in tests/test_replay_from_e2e.py (torchrun), TRL's in tests/test_trl_regroup.py.
"""
from __future__ import annotations

import dataclasses
import json

import reshard_rig
from test_run_settings import verl_keyed, verl_local

from skip_harness.cli.diff import compare
from skip_harness.integrations.verl_config import plan_of
from skip_harness.run.harness import SkipHarness
from skip_harness.run.training import training_side

LR = 1e-3


def loss_at(step: int, gpus: int, lr: float = LR) -> float:
    """What a trainer that is not W-invariant reports: other values on another worker count (far beyond
    rounding), and a learning rate 1% off moves it at step 2 (step 1's loss is computed before any update)."""
    return 0.5 + 0.1 * step + 1e-3 * gpus + (step - 1) * (lr - LR) * 10


def verl_run(tmp_path, gpus: int, lr: float = LR, reward: float = 0.0, loss=loss_at, w_invariant=None,
             report_lr: bool = False) -> str:
    """Two steps through the verl plug-in's settings at `gpus` workers: the summary's replay line."""
    cfg = verl_keyed(tmp_path, n_gpus_per_node=gpus, nnodes=1)
    cfg["actor_rollout_ref"]["actor"] = {"optim": {"lr": lr}}
    cfg["skip_harness"] = {"all_steps": True}
    cfg["ray_kwargs"] = {"ray_init": {"num_gpus": gpus}}   # changes with the workers too (config.SHARD_KEYS)
    plan = plan_of(verl_local(tmp_path), cfg)
    run = plan.run if w_invariant is None else dataclasses.replace(plan.run, w_invariant=w_invariant)
    harness = SkipHarness(run)
    harness.set_training_config(training_side(cfg, list(plan.fingerprint)))   # as verl_values.feed does
    trainer = reshard_rig.Trainer(run.K, 1, 0)
    harness.wrap(trainer)
    for step in (1, 2):
        trainer.prepare_data(step)
        for _ in range(run.K):
            trainer.sample(step)
        harness.observe(step, **{"critic/score/mean": step + reward, "actor/pg_loss": loss(step, gpus, lr),
                                 **({"actor/lr": lr} if report_lr else {})})
    return harness.close().replay_line


def test_verl_on_another_worker_count_reproduces_then_a_1pct_lr_change_is_caught(tmp_path):
    verl_run(tmp_path, 2)                       # recorded on 2 GPUs
    first = verl_run(tmp_path, 1)               # replayed on 1: another pg_loss, by design
    assert first == ("replay: 2 of 2 served steps reproduced (1 value each); re-sharded from 2 to 1 workers "
                     "(trainer.n_gpus_per_node): values recorded at 2 workers; actor/pg_loss not compared (they "
                     "depend on W); critic/score/mean compared within rounding noise (32 x float32 eps)"), first
    again = verl_run(tmp_path, 1)               # checked on every value: against the first replay on 1
    assert again.startswith("replay: 2 of 2 served steps reproduced (2 values each); re-sharded from 2 to 1 "
                            "workers (trainer.n_gpus_per_node)"), again
    assert "actor/pg_loss compared with replay " in again and "'s at K=1, 1 workers" in again, again
    changed = verl_run(tmp_path, 1, lr=LR * 1.01)
    assert changed.startswith("replay diverged at step 2 (actor/pg_loss "), changed
    assert "training side changed: actor_rollout_ref.actor.optim.lr 0.001 -> 0.00101;" in changed, changed
    # the replays kept their worker count and that they are not W-invariant, for `diff`
    runs = sorted((tmp_path / "e_p").glob("*/.values/runs/*/run.json"))
    assert [json.loads(r.read_text())["workers"] for r in runs] == [1, 1, 1]
    assert not any(json.loads(r.read_text())["w_invariant"] for r in runs)
    # and `diff` compares the first replay with the recording as the check did: rollout values only
    ns = runs[0].parents[3]
    values = compare(str(ns), f"{ns}@{runs[0].parent.name}")["namespaces"][0]["values"]
    assert values["first_divergence"] is None and values["not_compared"] == ["actor/pg_loss"], values
    assert values["describe"] == ("re-sharded: 2 (A) vs 1 (B) workers; actor/pg_loss not compared (they depend "
                                  "on W); critic/score/mean compared within rounding noise (32 x float32 eps)"), values


def test_a_baseline_is_one_at_this_runs_worker_count(tmp_path):
    """A replay on 4 workers is not compared with the one on 1: not compared, and said."""
    verl_run(tmp_path, 2)
    verl_run(tmp_path, 1)
    other = verl_run(tmp_path, 4)
    assert "re-sharded from 2 to 4 workers" in other and "actor/pg_loss not compared (they depend on W)" in other, other


def test_the_worker_count_explains_nothing_of_a_rollout_value_that_moved(tmp_path):
    verl_run(tmp_path, 2)
    line = verl_run(tmp_path, 1, reward=0.25)
    assert line.startswith("replay diverged at step 1 (critic/score/mean 1 recorded, 1.25 now)"), line
    assert "training side changed" not in line, line


def test_the_same_worker_count_stays_exact(tmp_path):
    verl_run(tmp_path, 2)
    assert verl_run(tmp_path, 2) == "replay: 2 of 2 served steps reproduced (2 values each)"
    nudged = verl_run(tmp_path, 2, loss=lambda step, gpus, lr: loss_at(step, gpus, lr) * (1 + 2 ** -22))
    assert nudged.startswith("replay diverged at step 1 (actor/pg_loss "), nudged


def test_a_w_invariant_trainer_compares_every_value_within_rounding_noise_at_another_w(tmp_path):
    """The demo's behaviour (its token means are over the whole mini-batch across ranks): at another W every
    value against the recording's, within rounding noise; a real difference still diverges."""
    flat = lambda step, gpus, lr: loss_at(step, 2, lr) * (1 + (gpus - 2) * 2 ** -23)   # noqa: E731  rounding
    verl_run(tmp_path, 2, loss=flat, w_invariant=True)
    line = verl_run(tmp_path, 1, loss=flat, w_invariant=True)
    assert line == ("replay: 2 of 2 served steps reproduced (2 values each); re-sharded from 2 to 1 workers "
                    "(trainer.n_gpus_per_node); compared within rounding noise (32 x float32 eps)"), line
    assert verl_run(tmp_path, 1, w_invariant=True).startswith("replay diverged at step 1 (actor/pg_loss ")


def test_a_changed_learning_rate_is_caught_on_the_first_replay_at_another_worker_count(tmp_path):
    """With no replay at this W yet, the training values are not compared; the learning rate is (no reduction
    over ranks computes it): a 1% change is caught at step 1, naming it, not passed as reproduced."""
    verl_run(tmp_path, 2, report_lr=True)
    line = verl_run(tmp_path, 1, lr=LR * 1.01, report_lr=True)
    assert line.startswith("replay diverged at step 1 (actor/lr 0.001 recorded, 0.00101 now)"), line
    assert "training side changed: actor_rollout_ref.actor.optim.lr 0.001 -> 0.00101;" in line, line
    first = verl_run(tmp_path, 1, report_lr=True)           # the recording's lr: reproduced, lr compared exactly
    assert first.startswith("replay: 2 of 2 served steps reproduced (2 values each)"), first
    assert "actor/pg_loss not compared (they depend on W); actor/lr, critic/score/mean compared" in first, first



def test_a_baseline_on_this_machine_is_preferred_to_an_older_one_on_another(tmp_path, monkeypatch):
    """The first replay at this W ran on another machine; a later one ran here. A replay here compares with
    the one here, exactly -- a nudge of rounding size is caught -- not with the older one within rounding
    noise, which would pass it."""
    import skip_harness.run.replay_check as replay_check

    here = replay_check.this_machine()
    verl_run(tmp_path, 2)
    monkeypatch.setattr(replay_check, "this_machine", lambda: {**here, "cpu": "another CPU"})
    verl_run(tmp_path, 1)                       # the oldest replay on 1 worker: another machine's
    monkeypatch.setattr(replay_check, "this_machine", lambda: here)
    first_here = verl_run(tmp_path, 1)          # compared with it within rounding noise
    assert first_here.startswith("replay: 2 of 2 served steps reproduced (2 values each)"), first_here
    nudged = verl_run(tmp_path, 1, loss=lambda step, gpus, lr: loss_at(step, gpus, lr) * (1 + 2 ** -22))
    assert nudged.startswith("replay diverged at step 1 (actor/pg_loss "), nudged


def test_a_replay_here_that_diverged_is_never_this_machines_reference(tmp_path, monkeypatch):
    """The first replay on this machine diverged from the other machine's (a real change): its run.json says
    so, and it is not the reference here; a later replay with the recording's training side still compares
    with the other machine's and reproduces, and one with the change is still caught."""
    import skip_harness.run.replay_check as replay_check

    here = replay_check.this_machine()
    verl_run(tmp_path, 2)
    monkeypatch.setattr(replay_check, "this_machine", lambda: {**here, "cpu": "another CPU"})
    verl_run(tmp_path, 1)
    monkeypatch.setattr(replay_check, "this_machine", lambda: here)
    changed = lambda step, gpus, lr: loss_at(step, gpus, lr) * 1.01      # noqa: E731  a real change
    first_here = verl_run(tmp_path, 1, loss=changed)
    assert first_here.startswith("replay diverged at step 1 (actor/pg_loss "), first_here
    from skip_harness.store.values import run_order

    docs = [json.loads(r.read_text()) for r in sorted((tmp_path / "e_p").glob("*/.values/runs/*/run.json"),
                                                      key=lambda p: run_order(p.parent.name))]   # as they ran
    assert [d.get("diverged_at") for d in docs] == [None, 1]
    assert verl_run(tmp_path, 1).startswith("replay: 2 of 2 served steps reproduced (2 values each)")
    assert verl_run(tmp_path, 1, loss=changed).startswith("replay diverged at step 1 (actor/pg_loss ")
