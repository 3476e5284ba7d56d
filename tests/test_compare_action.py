"""`skip.rollout_tq.action=compare` (issue 39, item 6): every step generated and trained on, each mini-batch
compared with the recording's; the drift per step and in the summary, the figures kept under the run id,
nothing written into the recording, a changed generation fingerprint measured instead of refused."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from skip_harness import SkipHarness
from skip_harness.config import Action, settings_from
from skip_harness.errors import ConfigError
from skip_harness.run.drift import compare_batches

from test_train_e2e import recorded, train


# --------------------------------------------------------------------------- the comparison itself
def _demo_batch(responses, logprobs=None, prompts=None):
    r = torch.tensor(responses)
    return {"prompts": torch.tensor(prompts or [[1, 2]] * len(responses)), "responses": r,
            "response_mask": r != 0, "old_logprobs": torch.tensor(logprobs) if logprobs else -torch.ones(r.shape)}


def test_padded_batches_first_differing_token_and_logprob_difference_on_the_shared_prefix():
    rec = _demo_batch([[5, 6, 7, 0], [5, 6, 0, 0]], [[-1.0, -2.0, -3.0, 0.0], [-1.0, -2.0, 0.0, 0.0]])
    same = compare_batches(rec, rec)
    assert (same.identical, same.trajectories, same.first_diff, same.max_logprob_diff) == (2, 2, None, 0.0)
    gen = _demo_batch([[5, 6, 8, 0], [5, 6, 0, 0]], [[-1.5, -2.0, -9.0, 0.0], [-1.0, -2.25, 0.0, 0.0]])
    d = compare_batches(gen, rec)
    # row 0 differs at token 2: its shared prefix is tokens 0-1 (difference 0.5, not token 2's 6.0)
    assert (d.identical, d.trajectories, d.first_diff, d.max_logprob_diff) == (1, 2, 2, 0.5)
    assert d.describe() == ("compared: 1 of 2 trajectories identical, first differing token 2, largest log-prob "
                            "difference 0.5 on the shared prefix")
    assert d.values()["compare/identical_share"] == 0.5 and d.values()["compare/first_diff_token"] == 2


def test_a_shorter_response_differs_where_it_ends_and_trl_flat_payloads_are_cut_by_lengths():
    rec = {"completion_ids": torch.tensor([3, 4, 5, 3, 4]), "lengths": torch.tensor([3, 2]), "logprobs": None,
           "prompt_ids": torch.tensor([9, 9, 8]), "prompt_lengths": torch.tensor([2, 1])}
    gen = {**rec, "completion_ids": torch.tensor([3, 4, 5, 3, 4, 6]), "lengths": torch.tensor([3, 3])}
    d = compare_batches(gen, rec)
    assert (d.identical, d.trajectories, d.first_diff, d.max_logprob_diff) == (1, 2, 2, None)
    assert "log-prob" not in d.describe()          # TRL stored no log-probs: none reported


def test_trajectories_that_are_not_the_same_are_not_paired():
    rec = _demo_batch([[5, 6], [5, 6]], prompts=[[1, 2], [3, 4]])
    other = _demo_batch([[5, 6], [5, 6]], prompts=[[1, 2], [3, 5]])
    assert compare_batches(other, rec).describe() == "not compared: other prompts (1 of 2 trajectories)"
    assert compare_batches(_demo_batch([[5, 6]]), rec).describe() == "not compared: 1 trajectories generated, 2 recorded"
    assert compare_batches({"x": torch.ones(2)}, rec).values() == {}


def test_compare_is_an_action_and_a_bad_one_names_the_key():
    assert settings_from({"action": "compare"}).action == Action.compare
    with pytest.raises(ConfigError, match="skip.rollout_tq.action"):
        settings_from({"action": "comapre"})


# --------------------------------------------------------------------------- a plain trainer
class Sampler:
    """A trainer whose rollouts depend on its sampling temperature (part of the fingerprint)."""

    def __init__(self, temperature: float):
        self.temperature = temperature

    def sample(self, step):
        g = torch.Generator().manual_seed(step)
        logits = torch.randn(4, 5, 3, generator=g) / self.temperature
        probs = logits.softmax(-1)
        ids = torch.multinomial(probs.view(-1, 3), 1, generator=g).view(4, 5)
        logp = probs.log().gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return {"prompts": torch.arange(8).view(4, 2), "responses": ids + 1, "old_logprobs": logp}


def _run(tmp_path, temperature, experiment="e", **settings):
    h = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c"), **settings},
                           namespace={"experiment_name": experiment, "project_name": "p", "K": 1, "n": 2},
                           fingerprint={"temperature": temperature})
    trainer = Sampler(temperature)
    h.wrap(trainer, prepare_data=None)
    for step in (1, 2, 3):
        trainer.sample(step)
        h.observe(step, loss=float(step))
    return h, h.close()


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and ".values/runs" not in p.as_posix()}


def test_another_temperature_is_measured_not_refused_and_nothing_is_written(tmp_path, caplog):
    rec, _ = _run(tmp_path, 1.0)
    ns = rec.layout.root
    before = _files(ns)
    same, summary = _run(tmp_path, 1.0, action="compare")
    assert summary.compared == "rollouts compared: 12 of 12 trajectories identical (3 steps)"
    assert (summary.hits, summary.misses, summary.committed) == (0, 3, 0)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        hot, summary = _run(tmp_path, 0.5, action="compare")      # the fingerprint differs: no error
    assert "another generation config (temperature: cache has 1.0, this run has 0.5)" in caplog.text
    assert summary.compared.startswith("rollouts compared: ") and "of 12 trajectories identical" in summary.compared
    assert "12 of 12" not in summary.compared
    assert "first differing token" in caplog.text and "largest log-prob difference" in caplog.text
    assert _files(ns) == before                                   # the recording, byte for byte
    kept = json.loads((ns / ".values" / "runs" / hot.run_id / "2.json").read_text())["values"]
    assert 0 <= kept["compare/identical_share"] < 1 and kept["loss"] == 2.0 and "compare/max_logprob_diff" in kept
    assert json.loads((ns / ".values" / "runs" / hot.run_id / "run.json").read_text())["action"] == "compare"
    assert rec.run_id not in {p.name for p in (ns / ".values" / "runs").iterdir()}   # the recording kept none


def test_compare_with_another_recording_reads_it_and_creates_nothing(tmp_path):
    rec, _ = _run(tmp_path, 1.0)
    before = _files(rec.layout.root)
    h, summary = _run(tmp_path, 0.5, experiment="other", action="compare", replay_from=str(rec.layout.root))
    assert summary.compared.startswith("rollouts compared: ") and "of 12 trajectories identical (3 steps)" in summary.compared
    assert not (tmp_path / "c" / "other_p").exists()              # this run's own namespace: never created
    assert _files(rec.layout.root) == before
    assert (rec.layout.root / ".values" / "runs" / h.run_id / "3.json").is_file()   # kept where a replay's are


def test_a_step_the_recording_lacks_is_generated_and_said_not_compared(tmp_path):
    h = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c"), "steps": [1]},
                           namespace={"experiment_name": "e", "project_name": "p", "K": 1, "n": 2},
                           fingerprint={"temperature": 1.0})
    t = Sampler(1.0)
    h.wrap(t, prepare_data=None)
    t.sample(1)
    h.close()
    _, summary = _run(tmp_path, 1.0, action="compare")
    assert summary.compared == ("rollouts compared: 4 of 4 trajectories identical (1 step); 2 steps not compared "
                                "(the recording has no complete step 2)")


# --------------------------------------------------------------------------- the demo, as a user runs it
@pytest.mark.slow
def test_demo_compare_with_the_recordings_config_is_identical(tmp_path_factory, tmp_path):
    recorded(tmp_path_factory, tmp_path)
    train(tmp_path, "skip.rollout_tq.action=compare", run="compare")
    log = (tmp_path / "compare" / "train.log").read_text()
    assert "rollouts compared: 64 of 64 trajectories identical (4 steps)" in log
    assert log.count("compared: 16 of 16 trajectories identical, no differing token, largest log-prob "
                     "difference 0 on the shared prefix") == 4


@pytest.mark.slow
def test_demo_compare_with_another_temperature_reports_the_drift_per_step(tmp_path_factory, tmp_path):
    recorded(tmp_path_factory, tmp_path)
    ns = next((tmp_path / "cache").glob("*/GBS*"))
    before = _files(ns)
    proc = train(tmp_path, "skip.rollout_tq.action=compare", "actor_rollout_ref.rollout.temperature=0.5",
                 run="hot")
    log = (tmp_path / "hot" / "train.log").read_text()
    assert "actor_rollout_ref.rollout.temperature: cache has 1.0, this run has 0.5" in log, proc.stderr[-3000:]
    steps = [line for line in log.splitlines() if "not committed (compared with the recording" in line]
    assert len(steps) == 4 and all("largest log-prob difference" in line for line in steps)
    assert any("first differing token" in line for line in steps)
    assert "rollouts compared: " in log and "64 of 64" not in log
    assert _files(ns) == before
    (run,) = (ns / ".values" / "runs").iterdir()
    for step in (1, 2, 3, 4):
        kept = json.loads((run / f"{step}.json").read_text())["values"]
        assert {"compare/identical_share", "compare/max_logprob_diff", "loss"} <= set(kept)


def test_view_charts_the_newest_compare_runs_figures_beside_the_recorded_values(tmp_path):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from skip_harness.cli.view.app import build_app
    from skip_harness.cli.view.data import Cache
    from skip_harness.cli.view.decode import Decoder

    rec, _ = _run(tmp_path, 1.0)
    _run(tmp_path, 0.5, action="compare")
    ns = rec.layout.root
    c = TestClient(build_app(Cache([tmp_path / "c"]), Decoder(), ["testserver"]), raise_server_exceptions=True)
    svg = c.get(f"/ns/0/{ns.parent.name}/{ns.name}/charts").text
    assert "recorded: loss" in svg and "recorded: compare/identical_share" in svg
    assert "compare/max_logprob_diff" in c.get(f"/ns/0/{ns.parent.name}/{ns.name}/step/2").text


def test_each_trajectorys_first_differing_token_is_kept_beside_the_figures(tmp_path):
    """The viewer marks drift per trajectory: the run keeps each trajectory's first differing token by its ref
    (None: identical), agreeing with the step's figures; the recording is not written."""
    from skip_harness.store.api import ValuesStore, open_namespace

    rec, _ = _run(tmp_path, 1.0)
    same, _ = _run(tmp_path, 1.0, action="compare")
    hot, _ = _run(tmp_path, 0.5, action="compare")
    store = ValuesStore(open_namespace(rec.layout))
    for step in (1, 2, 3):
        doc = store.read_run_drift(same.run_id, step)
        assert doc is not None and (doc["K"], doc["W"]) == (1, 1)
        assert doc["first_difference"] == {f"0.0.{j}": None for j in range(4)}
        doc = store.read_run_drift(hot.run_id, step)
        values = store.read_run_step(hot.run_id, step).values
        firsts = doc["first_difference"]
        assert sorted(firsts) == [f"0.0.{j}" for j in range(4)]
        assert sum(v is None for v in firsts.values()) == values["compare/identical"]
        differing = [v for v in firsts.values() if v is not None]
        assert min(differing, default=None) == values.get("compare/first_diff_token")
    assert store.read_run_drift(rec.run_id, 1) is None
