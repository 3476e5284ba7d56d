"""Issue 40, `skip-harness diff` as a user meets it after many replays: names as `ls` prints them; the
recording beside a replay at another K, paired as the replay check pairs them (the same values, the same
tolerance, the same verdict); two namespaces without a step in common; trajectories counted only when they
are pairs (TRL's flattened token fields cut per trajectory, other prompts and other batches refused); only
the training-side config both sides recorded listed; a header that never wraps inside a run id."""
from __future__ import annotations

import contextlib
import io
import json
import logging

import torch

from skip_harness.cli import main
from skip_harness.integrations.trl_payload import add_prompts, encode_generation
from test_replay_from import run
from test_view_diff import record
from view_rig import demo_batch, write_namespace

REC = "rig_reshard/GBS8_N2_K4_W1"


def _cli(*argv, columns: int = 100):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def _recording_and_replay(tmp_path, K: int = 2):
    run(tmp_path, 4, 3)
    _, summary, _ = run(tmp_path, K, 3, replay_from=str(tmp_path / REC))
    assert "3 of 3 served steps reproduced" in summary.replay_line
    return tmp_path / REC


def test_a_name_as_ls_prints_it_is_found_under_the_cache_root(tmp_path, monkeypatch):
    _recording_and_replay(tmp_path)
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)            # the name does not exist relative to here
    code, out = _cli("diff", REC, f"{REC}@latest")
    assert code == 0, out
    assert f"A {tmp_path / REC}\n" in out
    code, out = _cli("diff", "rig_reshard/GBS8_N2_K5_W1", REC)
    assert code == 2


def test_the_recording_beside_its_replay_at_another_k_reproduces_as_the_replay_check_said(tmp_path, monkeypatch):
    rec = _recording_and_replay(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    code, out = _cli("diff", str(rec), f"{rec}@latest")
    assert code == 0, out
    text = " ".join(out.split())
    assert "values compared on 3 steps" in text
    assert ("values compared as the replay check compares them: re-chunked: K=4 (A) vs K=2 (B); rows not "
            "compared (they depend on K); reward_mean compared within rounding noise (32 x float32 eps)") in text
    assert text.endswith("reproduced: the same rollouts, and the values agree on 3 steps as the replay check "
                         "compares them (re-chunked: K=4 (A) vs K=2 (B))")
    # the header: one line per side, the run id whole on its line at 100 columns
    [b_line] = [line for line in out.splitlines() if line.startswith("  B ")]
    assert b_line.endswith("@" + sorted((rec / ".values" / "runs").iterdir())[-1].name)


def test_a_replay_at_another_k_whose_rollout_values_differ_is_a_difference(tmp_path):
    from skip_harness import SkipHarness
    import reshard_rig
    from test_replay_from import NS

    run(tmp_path, 4, 2)
    harness = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path), "replay_from": str(tmp_path / REC)},
                                 namespace={**NS, "K": 2}, fingerprint={"seed": 0})
    trainer = reshard_rig.Trainer(2, 1, 0)
    harness.wrap(trainer)
    for step, reward in ((1, 1.0), (2, 2.5)):          # step 2: not the recorded reward_mean (2.0)
        trainer.prepare_data(step)
        trainer.sample(step), trainer.sample(step)
        harness.observe(step, rows=99.0, reward_mean=reward)     # rows depends on K: never compared
    assert harness.close().replay_line.startswith("replay diverged at step 2 (reward_mean 2 recorded, 2.5 now)")
    code, out = _cli("diff", str(tmp_path / REC), f"{tmp_path / REC}@latest")
    assert code == 1 and "values first differ at step 2: reward_mean 2 (A) vs 2.5 (B)" in out, out
    assert out.strip().splitlines()[-1] == "the two differ"


def test_two_namespaces_without_a_step_in_common_are_not_called_the_same(tmp_path):
    a = write_namespace(tmp_path / "A", "run", {1: demo_batch(1), 2: demo_batch(2)})
    b = write_namespace(tmp_path / "B", "run", {5: demo_batch(5)})
    code, out = _cli("diff", str(a.root), str(b.root))
    assert code == 1, out
    assert out.strip().splitlines()[-1] == "the two differ: they hold no step in common (nothing was compared)"
    assert "the steps both hold are the same" not in out


def _trl(step: int, prompts, completions) -> dict:
    payload = encode_generation((completions, [[-0.5] * len(c) for c in completions]))
    add_prompts(payload, prompts)
    return payload


PROMPTS = [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]
COMPLETIONS = [[7, 8, 9], [7], [10, 11], [12, 13, 14, 15]]


def test_trl_trajectories_are_cut_per_trajectory_and_compared_without_exports_warnings(tmp_path, caplog):
    other = [list(c) for c in COMPLETIONS]
    other[2] = [10, 99]
    a = write_namespace(tmp_path / "A", "trl", {1: _trl(1, PROMPTS, COMPLETIONS)})
    b = write_namespace(tmp_path / "B", "trl", {1: _trl(1, PROMPTS, other)})
    with caplog.at_level(logging.WARNING):
        code, out = _cli("diff", str(a.root), str(b.root))
    assert code == 1 and "1 of 4" in out, out
    assert "left out of the export" not in caplog.text and "not one value per trajectory" not in out


def test_other_prompts_are_not_paired_and_nothing_is_counted(tmp_path):
    a = write_namespace(tmp_path / "A", "trl", {1: _trl(1, PROMPTS, COMPLETIONS)})
    b = write_namespace(tmp_path / "B", "trl", {1: _trl(1, [[6, 6]] * 2 + [[3, 4, 5]] * 2, COMPLETIONS)})
    code, out = _cli("diff", str(a.root), str(b.root))
    assert code == 1, out
    assert ("trajectories not paired at step 1: other prompts (prompt_ids differs in 2 of 4 trajectories)"
            in " ".join(out.split()))
    code, out = _cli("diff", str(a.root), str(b.root), "--json")
    [step] = json.loads(out)["namespaces"][0]["steps"]
    assert step["trajectories_differ"] is None and step["unpaired"].startswith("other prompts"), step


def test_a_demo_namespace_beside_a_trl_one_is_said_to_be_another_run(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    demo = write_namespace(tmp_path / "A", "demo", {1: demo_batch(1)})
    trl_root = tmp_path / "B" / "trl" / "GBS2_N2_out24"
    trl_root.parent.mkdir(parents=True)
    trl = write_namespace(tmp_path / "B", "trl", {1: _trl(1, PROMPTS, COMPLETIONS)})
    trl.root.rename(trl_root)
    from skip_harness.store.layout import Layout

    trl = Layout(trl_root, K=1, W=1)
    record(demo, {1: {"loss": 0.5}}, {"actor_rollout_ref.actor.optim.lr": 0.003, "data.val_batch_size": 8,
                                      "trainer.seed": 1})
    record(trl, {1: {"loss": 0.25}}, {**{f"trl.key{i}": i for i in range(80)}, "trainer.seed": 2})
    code, out = _cli("diff", str(demo.root), str(trl.root))
    assert code == 1, out
    text = " ".join(out.split())
    assert ("A and B hold other batches (A holds GBS6_N2_in4_out5, B GBS2_N2_out24): different runs on other "
            "prompts, their trajectories are not paired") in text
    assert "not paired" in out and " of " not in out.split("A and B hold")[0].split("┃")[-1]
    assert out.strip().splitlines()[-1] == "the two differ: they are different runs (other batches, other prompts)"
    assert "trainer.seed: 1 -> 2" in out                        # both recorded it: listed
    assert "80 keys recorded in B only (trl.*): not listed" in text and "trl.key7" not in out
    assert "2 keys recorded in A only" not in text and "actor_rollout_ref.actor.optim.lr: 0.003 -> -" in out
    assert torch is not None
