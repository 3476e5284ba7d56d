"""Issue 28, items 4 and 5: `skip.rollout_tq.replay_from` serves a run from another recording of the same
batch, re-chunked to its K and re-sharded to its ranks, read only. In-process runs of the plain-dict API
here (the rig of tests/reshard_rig.py: rows known by content); real `scripts/train.py` and torchrun runs
in tests/test_replay_from_e2e.py."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

import reshard_rig
from skip_harness import SkipHarness
from skip_harness.config import settings_from
from skip_harness.errors import ConfigError
from skip_harness.store.index import INDEX_NAME

NS = {"experiment_name": "rig", "project_name": "reshard", "train_batch_size": reshard_rig.B, "n": reshard_rig.N}


def run(dump: Path, K: int, steps: int, replay_from=None, fingerprint=None, **ns) -> tuple:
    """One W = 1 run of the rig's loop: ({step: (outcome, [row ids of each call])}, summary, trainer)."""
    settings = {"enable": True, "dump_dir": str(dump)}
    if replay_from is not None:
        settings["replay_from"] = replay_from
    harness = SkipHarness.create(settings, namespace={**NS, **ns, "K": K}, fingerprint=fingerprint or {"seed": 0})
    trainer = reshard_rig.Trainer(K, 1, 0)
    harness.wrap(trainer)
    out = {}
    for step in range(1, steps + 1):
        trainer.prepare_data(step)
        calls = [trainer.sample(step)["ids"].tolist() for _ in range(K)]
        out[step] = (str(harness.outcome(step)), calls)
        harness.observe(step, rows=float(sum(len(c) for c in calls)), reward_mean=float(step))
    return out, harness.close(), trainer


def snapshot(root: Path) -> dict:
    """Every file under `root` with its size and modification time (ns), less the replays' values
    (`.values/runs/`: create-only records each replay_from run leaves beside the recording's, and the
    `.values` directory's time that they change): the rollouts and the recording's values."""
    return {rel: (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() or p.is_dir()
            for rel in [str(p.relative_to(root))] if rel != ".values" and not rel.startswith(".values/runs")}


def replays_of(root: Path) -> dict:
    """{run id: [steps whose values it kept]} under the recording's `.values/runs/`."""
    runs = root / ".values" / "runs"
    return {} if not runs.is_dir() else {
        d.name: sorted(int(f.stem) for f in d.glob("*.json") if f.stem.isdigit()) for d in sorted(runs.iterdir())}


def rows_of(step: int, lo: int, hi: int) -> list:
    return [step * 1000 + g for g in range(lo, hi)]


def test_the_key_is_checked():
    assert settings_from({"replay_from": " auto "}).replay_from == "auto"
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: empty"):
        settings_from({"replay_from": ""})
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: .*needs two slashes"):
        settings_from({"replay_from": "s3:/bucket/x"})
    assert settings_from({}).replay_from is None


@pytest.mark.parametrize("K", [2, 1, 8])
def test_a_k4_recording_serves_another_k_in_recorded_order_and_stays_untouched(tmp_path, K, caplog):
    run(tmp_path, 4, 3)
    source = tmp_path / "rig_reshard" / "GBS8_N2_K4_W1"
    (source / INDEX_NAME).unlink()       # a scan that may write would write it again
    before = snapshot(source)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        served, summary, trainer = run(tmp_path, K, 3, replay_from="auto")
    assert trainer.generated == 0 and summary.hits == 3 and summary.misses == 0
    each = 16 // K
    for step, (outcome, calls) in served.items():
        assert outcome == "hit"
        assert calls == [rows_of(step, i * each, (i + 1) * each) for i in range(K)]
    assert snapshot(source) == before            # read only: nothing written, no lock, no index rewritten
    assert list(replays_of(source).values()) == [[1, 2, 3]]    # its values: the recording's replay
    own = tmp_path / "rig_reshard" / ("GBS8_N2" if K == 1 else f"GBS8_N2_K{K}_W1")
    assert not own.exists()                      # it only read: no namespace of its own
    log = caplog.text
    assert f"step 2: hit, K={K}, loaded" in log and f"served re-chunked from K=4 to K={K}" in log
    line = summary.replay_line
    assert "diverged" not in line and "values recorded at K=4; rows not compared (they depend on K); " \
        "reward_mean compared within rounding noise (32 x float32 eps)" in line, line


def test_without_replay_from_another_k_generates(tmp_path):
    run(tmp_path, 4, 2)
    served, summary, trainer = run(tmp_path, 2, 2)
    assert summary.misses == 2 and trainer.generated == 4


def test_a_path_serves_the_same_as_auto_and_a_missing_step_is_generated_into_the_runs_own(tmp_path, caplog):
    run(tmp_path, 4, 2)
    source = tmp_path / "rig_reshard" / "GBS8_N2_K4_W1"
    before = snapshot(source)
    served, summary, trainer = run(tmp_path, 2, 3, replay_from=str(source))
    assert [served[s][0] for s in (1, 2, 3)] == ["hit", "hit", "miss"] and trainer.generated == 2
    assert snapshot(source) == before and not (source / "3").exists()
    own = tmp_path / "rig_reshard" / "GBS8_N2_K2_W1"
    assert sorted(p.name for p in own.iterdir() if p.name.isdigit()) == ["3"]   # only what it generated
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        served, summary, trainer = run(tmp_path, 2, 3, replay_from=str(source))
    assert trainer.generated == 0 and summary.hits == 3
    assert "step 2: hit, K=2" in caplog.text and "served re-chunked from K=4 to K=2" in caplog.text
    step3 = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3: hit")]
    assert step3 and "served" not in step3[0]                # from its own namespace, at its own K
    assert served[3][1] == [rows_of(3, 0, 8), rows_of(3, 8, 16)]


def test_a_verl_async_recording_refused_to_a_sync_run_says_why(tmp_path):
    """verl names an async-mode recording GBS1 (it sets data.gen_batch_size = 1 there): a sync run of
    train_batch_size 4 is refused saying so, not only that the batch sizes differ; a recording of another
    size than 1 is refused without the hint."""
    from skip_harness.run.recording import check_replay_from
    from skip_harness.store.api import NamespaceKey
    root = tmp_path / "cache" / "kx_verl_cpu"
    async_rec, other = root / "GBS1_N2_in16_out16_K2_W1", root / "GBS8_N2_in16_out16"
    async_rec.mkdir(parents=True), other.mkdir()
    key = NamespaceKey("kx", "verl_cpu", train_batch_size=4, n=2, max_prompt_length=16, max_response_length=16)
    for rec, hint in ((async_rec, True), (other, False)):
        with pytest.raises(ConfigError) as caught:
            check_replay_from(settings_from({"enable": True, "replay_from": str(rec)}), key)
        text = str(caught.value)
        assert "another batch (data.train_batch_size: the recording has" in text, text
        assert ("data.gen_batch_size = 1" in text and "replay in the recording's trainer.v1.trainer_mode" in text) is hint, text


def test_another_batch_is_a_config_error_naming_the_key(tmp_path):
    run(tmp_path, 4, 1)
    source = tmp_path / "rig_reshard" / "GBS8_N2_K4_W1"
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: .*another batch "
                                          r"\(data\.train_batch_size: the recording has 8, this run has 16\)"):
        run(tmp_path, 2, 1, replay_from=str(source), train_batch_size=16)
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: .*another generator \(seed: cache has 0, "
                                          r"this run has 1\)"):
        run(tmp_path, 2, 1, replay_from=str(source), fingerprint={"seed": 1})
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: .*not a namespace name"):
        run(tmp_path, 2, 1, replay_from=str(tmp_path / "rig_reshard"))


def test_auto_with_no_recording_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: auto: no namespace under .*rig_reshard "
                                          r"holds this run's batch"):
        run(tmp_path, 2, 1, replay_from="auto")
    own = tmp_path / "rig_reshard" / "GBS8_N2_K2_W1"
    assert not own.exists()      # refused before anything was created
    empty = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path)}, namespace={**NS, "K": 2},
                               fingerprint={"seed": 0})
    empty.start()
    empty.close()                # its own namespace, holding no step yet: refused the same (and let go)
    assert own.is_dir()
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: auto: no namespace under .*rig_reshard "
                                          r"holds this run's batch"):
        run(tmp_path, 2, 1, replay_from="auto")
    run(tmp_path, 2, 1)          # its own namespace holds the batch: auto serves from it, no error
    served, summary, _ = run(tmp_path, 2, 1, replay_from="auto")
    assert summary.hits == 1


def test_auto_picks_the_recording_with_the_most_steps(tmp_path, caplog):
    run(tmp_path, 4, 1)
    run(tmp_path, 8, 2)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        served, summary, trainer = run(tmp_path, 2, 2, replay_from="auto")
    assert trainer.generated == 0
    assert "serving from GBS8_N2_K8_W1 (K=8, W=1, 2 complete steps: the most of the 2 recordings" in caplog.text
    assert "also holding it: GBS8_N2_K4_W1" in caplog.text


def test_values_at_another_k_compare_only_rollout_values_and_a_real_difference_diverges(tmp_path):
    run(tmp_path, 4, 2)
    settings = {"enable": True, "dump_dir": str(tmp_path), "replay_from": "auto"}
    harness = SkipHarness.create(settings, namespace={**NS, "K": 2}, fingerprint={"seed": 0})
    trainer = reshard_rig.Trainer(2, 1, 0)
    harness.wrap(trainer)
    trainer.prepare_data(1)
    trainer.sample(1), trainer.sample(1)
    harness.observe(1, rows=99.0, reward_mean=1.0)         # rows depends on K: not compared
    trainer.prepare_data(2)
    trainer.sample(2), trainer.sample(2)
    harness.observe(2, rows=16.0, reward_mean=2.5)         # the rollouts' reward is not the recorded one
    line = harness.close().replay_line
    assert line.startswith("replay diverged at step 2 (reward_mean 2 recorded, 2.5 now)"), line


def test_a_step_in_the_runs_own_namespace_is_served_from_there_first(tmp_path, caplog):
    run(tmp_path, 4, 2)
    run(tmp_path, 2, 1)              # this K's own recording of step 1
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        served, summary, trainer = run(tmp_path, 2, 2, replay_from="auto")
    assert trainer.generated == 0 and summary.hits == 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[0].startswith("step 1: hit, K=2") and "served" not in lines[0], lines
    assert lines[1].endswith("served re-chunked from K=4 to K=2"), lines


def test_merged_gives_the_steps_rows_as_this_run_was_served_them(tmp_path):
    run(tmp_path, 4, 1)
    harness = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path), "replay_from": "auto"},
                                 namespace={**NS, "K": 2}, fingerprint={"seed": 0})
    trainer = reshard_rig.Trainer(2, 1, 0)
    harness.wrap(trainer)
    trainer.prepare_data(1)
    trainer.sample(1), trainer.sample(1)
    try:
        assert harness.merged(1)["ids"].tolist() == rows_of(1, 0, 16)
    finally:
        harness.close()


def test_a_recorded_mini_batch_served_whole_restores_its_rng_state(tmp_path):
    """restore_rng (on for TRL): a step served from another recording at the same split restores the global
    RNG state recorded after its generation, as a plain replay does, so what the trainer draws next is the
    recorded run's (without it a TRL replay through `skip-harness replay` diverged at its last step)."""
    import torch

    def draws(dump: Path, replay_from=None) -> tuple:
        settings = {"enable": True, "dump_dir": str(dump), "restore_rng": True}
        if replay_from is not None:
            settings["replay_from"] = replay_from
        harness = SkipHarness.create(settings, namespace={**NS, "K": 1}, fingerprint={"seed": 0})
        trainer = reshard_rig.Trainer(1, 1, 0)
        harness.wrap(trainer)
        torch.manual_seed(0)
        out = []
        for step in (1, 2):
            trainer.prepare_data(step)
            if harness.outcome(step) != "hit":
                torch.rand(3)                    # what generating draws: a hit skips it
            trainer.sample(step)
            out.append((str(harness.outcome(step)), torch.rand(1).item()))
        harness.close()
        return tuple(out)

    recorded = draws(tmp_path / "rec")
    (ns,) = (tmp_path / "rec").glob("*/GBS*")
    replayed = draws(tmp_path / "other", replay_from=str(ns))
    assert [o for o, _ in replayed] == ["hit", "hit"]
    assert [x for _, x in replayed] == [x for _, x in recorded]


def _train(dump: Path, K: int, mini: int, lr: float, rows: float, replay_from=None) -> str:
    """One step of the rig at K with verl's training keys: `mini` updates per step (verl's
    actor.ppo_mini_batch_size, which separate_async ties to K: train_batch_size = K x mini), `rows` the value
    that depends on K. The replay line of its summary."""
    settings = {"enable": True, "dump_dir": str(dump), **({"replay_from": replay_from} if replay_from else {})}
    # verl writes trainer.total_training_steps x K into each optimizer's config
    config = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini,
                                              "optim": {"lr": lr, "total_training_steps": 3 * K}}},
              "critic": {"ppo_mini_batch_size": mini, "optim": {"total_training_steps": 3 * K}},
              "trainer": {"total_training_steps": 3}}
    harness = SkipHarness.create(settings, namespace={**NS, "K": K}, fingerprint={"seed": 0}, training_config=config)
    trainer = reshard_rig.Trainer(K, 1, 0)
    harness.wrap(trainer)
    trainer.prepare_data(1)
    for _ in range(K):
        trainer.sample(1)
    harness.observe(1, rows=rows, reward_mean=1.0)
    return harness.close().replay_line


def test_verls_mini_batch_size_is_how_the_batch_is_split_so_a_k1_replay_is_the_baseline(tmp_path):
    """verl's separate_async asserts train_batch_size = K x actor.ppo_mini_batch_size, and verl writes
    trainer.total_training_steps x K into each optimizer's total_training_steps: a replay at K = 1 of a K = 2
    recording has other values for them because it has another K. The first such replay is still the
    reference of the later ones (run.baseline), so a second reproduces it and a 1% learning-rate change is
    caught, naming the key (measured on verl's main_ppo: docs/verl.md)."""
    _train(tmp_path, 2, 4, 1e-6, 2.0)
    source = str(tmp_path / "rig_reshard" / "GBS8_N2_K2_W1")
    first = _train(tmp_path, 1, 8, 1e-6, 1.0, replay_from=source)
    assert "rows not compared (they depend on K)" in first, first
    again = _train(tmp_path, 1, 8, 1e-6, 1.0, replay_from=source)
    assert again.startswith("replay: 1 of 1 served step reproduced (2 values each)"), again
    assert "rows compared with replay " in again, again
    lr = _train(tmp_path, 1, 8, 1.01e-6, 1.25, replay_from=source)
    assert lr.startswith("replay diverged at step 1 (rows 1 recorded, 1.25 now"), lr
    assert "training side changed: actor_rollout_ref.actor.optim.lr 1e-06 -> 1.01e-06" in lr, lr


@pytest.mark.parametrize("packed", [False, True], ids=["namespace", "pack"])
def test_the_recording_is_opened_once_on_a_rank(tmp_path, packed, monkeypatch):
    """Issue 41: a rank opens the recording once (rank 0 where it checked it, `run.recording`) and reads every
    step and `merged` through that one opening; before, rank 0 opened it twice (to check it, then again to
    serve it). Counted where the store makes a namespace of a directory or a pack file."""
    from skip_harness.store import api, open as opener

    run(tmp_path, 4, 2)
    recording = tmp_path / "rig_reshard" / "GBS8_N2_K4_W1"
    if packed:
        api.write_pack(recording, tmp_path / "rec.pack")
        recording = tmp_path / "rec.pack"
    opened = []

    def counted(real):
        def opening(backend, layout):
            opened.append(Path(str(layout.root)))
            return real(backend, layout)
        return opening

    # every namespace is opened through its backend's `namespace(layout)` (store.registry)
    monkeypatch.setattr(opener.PosixBackend, "namespace", counted(opener.PosixBackend.namespace))
    monkeypatch.setattr(opener.PackBackend, "namespace", counted(opener.PackBackend.namespace))
    harness = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path), "replay_from": str(recording)},
                                 namespace={**NS, "K": 2}, fingerprint={"seed": 0})
    trainer = reshard_rig.Trainer(2, 1, 0)
    harness.wrap(trainer)
    for step in (1, 2):
        trainer.prepare_data(step)
        trainer.sample(step), trainer.sample(step)
    assert harness.merged(2)["ids"].tolist() == rows_of(2, 0, 16)
    summary = harness.close()
    assert summary.hits == 2 and trainer.generated == 0
    assert opened.count(recording) == 1, opened
