"""Issue 39, item 1: the tolerance model (skip_harness/run/tolerance.py) and `replay_tolerances`.

The numbers are the ones real replays printed (docs/replay_check.md, "The tolerance model"): rounding noise
of a regrouped replay reproduces, a learning rate 1% off does not; a same-shape replay stays exact."""
from __future__ import annotations

import pytest

from skip_harness.config import settings_from
from skip_harness.errors import ConfigError
from skip_harness.run.tolerance import ToleranceModel
from test_replay import plain_run


def test_rounding_noise_of_a_regrouped_replay_reproduces_and_a_real_change_does_not():
    regrouped = ToleranceModel(regrouped=True)
    # W 2 -> 1 of the issue: a KL of the policy with itself, both forms rounding noise around zero
    assert regrouped.same("approx_kl", 6.421051841273839e-15, 7.024912640799744e-15)
    assert regrouped.same("loss", 0.20845061540603638, 0.20845064520835876)        # 1 ulp of float32
    assert regrouped.same("loss", -0.025707971304655075, -0.02570798248052597)     # near zero, its scale ~0.2
    assert regrouped.same("reward_mean", 0.06919643003493547, 0.0691964365541935)  # K 4 -> 2: a mean of means
    # the same replay with lr x 1.01, at its first diverging step
    assert not regrouped.same("loss", 0.12018229067325592, 0.12016)
    assert not regrouped.same("grad_norm", 0.510757565498352, 0.5101543068885803)
    # a learning rate passes through no reduction: exact even when regrouped
    assert not regrouped.same("learning_rate", 1e-6, 1.01e-6)
    # same K and W: exact by default
    exact = ToleranceModel()
    assert not exact.same("loss", 0.20845061540603638, 0.20845064520835876)
    assert not exact.same("approx_kl", 6.421051841273839e-15, 7.024912640799744e-15)
    assert exact.same("nan", float("nan"), float("nan")) and not regrouped.same("x", float("inf"), 1.0)


def test_replay_tolerances_are_validated_naming_the_key():
    ok = settings_from({"replay_tolerances": {"loss": {"rtol": 1e-3}, "critic/*": {"atol": 2}}})
    assert ok.replay_tolerances["loss"].rtol == 1e-3 and ok.replay_tolerances["critic/*"].atol == 2
    bad = {
        r"replay_tolerances\.loss\.rtl": {"loss": {"rtl": 1}},
        r"replay_tolerances\.loss\.rtol: must be a number >= 0": {"loss": {"rtol": -1}},
        r"replay_tolerances\.loss\.atol": {"loss": {"atol": "wide"}},
        r"replay_tolerances\.loss": {"loss": 3},
    }
    for message, value in bad.items():
        with pytest.raises(ConfigError, match=r"skip\.rollout_tq\." + message):
            settings_from({"replay_tolerances": value})


def test_replay_tolerances_apply_per_key_on_a_same_shape_replay(tmp_path):
    plain_run(tmp_path)
    _, summary = plain_run(tmp_path, lr=0.5000001)            # exact by default
    assert summary.replay_line.startswith("replay diverged at step 2 (loss"), summary.replay_line
    tol = {"LOSS": {"rtol": 1e-3}}                             # case-insensitive pattern
    _, summary = plain_run(tmp_path, lr=0.5000001, replay_tolerances=tol)
    assert summary.replay_line.startswith("replay diverged at step 2 (w_norm"), summary.replay_line
    tol = {"loss": {"rtol": 1e-3}, "w_*": {"atol": 1e-3}}
    _, summary = plain_run(tmp_path, lr=0.5000001, replay_tolerances=tol)
    assert summary.replay_line == "replay: 5 of 5 served steps reproduced (3 values each)", summary.replay_line


def test_diff_compares_a_replays_values_within_its_replay_tolerances(tmp_path, capsys):
    """`skip-harness diff NS NS@RUN` gives the replay check's verdict: within the tolerances the replay ran
    with (its run.json), unless the command line gives others (`--rtol`, `--atol`, `--tolerances`)."""
    import json

    from skip_harness.cli import main

    plain_run(tmp_path)
    tol = {"loss": {"rtol": 1e-3}, "w_*": {"atol": 1e-3}}
    replay, summary = plain_run(tmp_path, lr=0.5000001, replay_tolerances=tol)
    assert summary.replay_line == "replay: 5 of 5 served steps reproduced (3 values each)", summary.replay_line
    ns = str(replay.layout.root)
    # the two differ in lr (a training-side key: listed, exit 1), but their values agree as the replay check said
    assert main(["diff", ns, f"{ns}@{replay.run_id}"]) == 1
    out = capsys.readouterr().out
    assert "values first differ" not in out and "optim.lr" in out
    assert f"loss: rtol 0.001, atol 0, w_*: rtol 0, atol 0.001; other keys exact (the replay check's of run " \
           f"{replay.run_id})" in out
    assert main(["diff", ns, f"{ns}@latest", "--tolerances", '{"loss": {"rtol": 1e-3}}']) == 1   # given: w_norm exact
    assert "values first differ at step 2: w_norm" in capsys.readouterr().out
    assert main(["diff", ns, f"{ns}@latest", "--rtol", "1e-3", "--json"]) == 1
    values = json.loads(capsys.readouterr().out)["namespaces"][0]["values"]
    assert values["tolerances"] == "rtol 0.001, atol 0 (given on the command line)" and values["first_divergence"] is None
    assert main(["diff", ns, f"{ns}@latest", "--tolerances", '{"loss": {"rtol": -1}}']) == 2
    assert "--tolerances.loss.rtol: must be a number >= 0" in capsys.readouterr().err
    exact, _ = plain_run(tmp_path, lr=0.5000001)                             # a replay with exact settings
    assert main(["diff", ns, f"{ns}@{exact.run_id}", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["namespaces"][0]["values"]["first_divergence"]["key"] == "loss"
