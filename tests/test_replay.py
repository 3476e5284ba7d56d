"""Did the replay reproduce? Values recorded with each step, checked on every replay (run.replay_check,
store.values), in-process: the README's plain-dict trainer and the demo in every mode.

Each way in is shown three replays of one recording: the same config (every served step reproduced),
another learning rate (a divergence the WARNING explains by naming the learning rate), and other rollouts
than were recorded at step 3 (tests/replay_rig.py serves step 2's mini-batches there: a divergence at
step 3 that nothing in the config explains).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from replay_rig import namespace_in, serve_other_rollouts
from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from skip_harness.store.open import open_store
from skip_harness import SkipHarness
from skip_harness.errors import ConfigError, ReplayDivergedError
from skip_harness.run.callbacks import HarnessCallback
from skip_harness.store.stepstore import StepStore
from skip_harness.store.values import ValuesStore, flatten_config

CONF = Path(__file__).resolve().parents[1] / "conf"


# --------------------------------------------------------------------------- the README's plain-dict trainer
class MyLoop:
    """The README's plain-dict loop, with a training step: a linear scorer fitted to each batch's reward."""

    def __init__(self, lr: float):
        self.lr = lr
        self.w = torch.zeros(16, dtype=torch.float64)

    def generate(self, step):
        g = torch.Generator().manual_seed(step)
        return {"ids": torch.randint(0, 100, (8, 16), generator=g), "reward": torch.rand(8, generator=g)}

    def train_on(self, batch) -> dict:
        x = batch["ids"].to(torch.float64) / 100
        err = x @ self.w - batch["reward"].to(torch.float64)
        loss = float((err ** 2).mean())
        w_norm = torch.linalg.norm(self.w)                   # a one-element tensor: recorded as a number
        self.w -= self.lr * 2 * (x.T @ err) / len(err)
        return {"loss": loss, "reward_mean": float(batch["reward"].mean()), "w_norm": w_norm,
                "gen_s": 0.123, "note": "not a number"}


class Heard(HarnessCallback):
    def __init__(self):
        self.divergences = []

    def on_replay_divergence(self, *, step, key, recorded, now, **kwargs):
        self.divergences.append((step, key, recorded, now, kwargs["config_changes"]))


def plain_run(dump_dir: Path, *, lr: float = 0.5, steps: int = 5, callbacks=(), **settings):
    loop = MyLoop(lr)
    harness = SkipHarness.create(
        {"enable": True, "dump_dir": str(dump_dir), **settings},
        namespace={"experiment_name": "my_run", "project_name": "demo", "K": 1, "n": 8},
        fingerprint={"model": "my-model-v1", "temperature": 1.0},
        training_config={"optim": {"lr": lr}, "loss": "mse"},
        callbacks=callbacks,
    )
    harness.wrap(loop, sample="generate", prepare_data=None)
    try:
        for step in range(1, steps + 1):
            metrics = loop.train_on(loop.generate(step))
            harness.observe(step, **metrics)
    finally:
        summary = harness.close()
    return harness, summary


def test_plain_loop_records_then_every_served_step_reproduces(tmp_path, caplog):
    _, first = plain_run(tmp_path)
    assert first.replay_line == ""                           # nothing served: nothing to say
    layout = namespace_in(tmp_path)
    reader = open_store(layout).reader
    recorded = reader.read_values(3)
    assert set(recorded) == {"loss", "reward_mean", "w_norm", "gen_s"}   # numbers only: "note" left out
    assert all(isinstance(v, float) for v in recorded.values())
    assert open_store(layout).status(3).status == "complete"
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        _, second = plain_run(tmp_path)
    assert second.hits == 5
    # gen_s is a timing (replay_ignore's default *_s): 3 values compared per step
    assert second.replay_line == "replay: 5 of 5 served steps reproduced (3 values each)"
    assert (first.replay_short, second.replay_short) == ("", "5/5 reproduced")   # a sweep table's cell
    # print(summary): the line the run logs, where the cache went included -- not a dataclass's repr (issue 40)
    assert str(second) == next(r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout cache summary"))
    assert str(second).startswith("rollout cache summary: 5 steps: 5 hits, 0 repeats, 0 misses")
    assert str(second).endswith(f"; cache in {layout.root}") and str(first).endswith(f"; cache in {layout.root}")
    assert "replay: 5 of 5 served steps reproduced (3 values each)" in caplog.text   # the summary line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_another_learning_rate_is_a_divergence_the_config_explains(tmp_path, caplog):
    plain_run(tmp_path)
    heard = Heard()
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        _, summary = plain_run(tmp_path, lr=0.25, callbacks=[heard])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "skip_harness"]
    assert len(warnings) == 1, warnings                      # one WARNING: the first divergence only
    # step 1 trains on the same batch from the same weights: its loss reproduces; the weights then differ
    assert warnings[0].startswith("replay diverged at step 2: loss ")
    assert "optim.lr: 0.5 -> 0.25" in warnings[0] and "the training-side config differs" in warnings[0]
    assert summary.replay_line.startswith("replay diverged at step 2 (loss ")
    # the summary's replay line names the training-side change (a sweep's table shows it per job)
    assert summary.replay_line.endswith("; 1 step reproduced before it; training side changed: optim.lr 0.5 -> 0.25")
    assert summary.replay_short == "diverged at 2: loss"
    assert len(heard.divergences) == 1
    step, key, recorded, now, changes = heard.divergences[0]
    assert (step, key) == (2, "loss") and recorded != now and changes == (("optim.lr", 0.5, 0.25),)


def test_other_rollouts_at_step_3_are_an_unexplained_divergence_at_step_3(tmp_path, caplog):
    plain_run(tmp_path)
    serve_other_rollouts(namespace_in(tmp_path), src=2, dst=3)
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        _, summary = plain_run(tmp_path)
    assert summary.hits == 5
    assert summary.replay_line.startswith("replay diverged at step 3 (loss ")
    assert summary.replay_line.endswith("; 2 steps reproduced before it")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "skip_harness"]
    assert "the training-side config is the recorded run's: nothing in it explains this" in warning


def test_replay_check_error_stops_the_run_at_the_divergence(tmp_path, caplog):
    plain_run(tmp_path)
    loop_steps = []

    class Count(HarnessCallback):
        def on_step_end(self, *, record, **kwargs):
            loop_steps.append(record.step)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skip_harness"), \
            pytest.raises(ReplayDivergedError, match=r"replay diverged at step 2: loss .*optim\.lr: 0\.5 -> 0\.25.*"
                                                     r"replay_check=error"):
        plain_run(tmp_path, lr=0.25, replay_check="error", callbacks=[Count()])
    assert loop_steps == [1, 2]                              # stopped there
    # the error says it, once (the front ends print it as ERROR): no WARNING with the same words before it
    assert not [r.getMessage() for r in caplog.records if "replay diverged" in r.getMessage()]


def test_replay_check_off_compares_nothing(tmp_path, caplog):
    plain_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        _, summary = plain_run(tmp_path, lr=0.25, replay_check="off")
    assert not caplog.records
    assert summary.replay_line == "replay: 5 served steps, not checked (skip.rollout_tq.replay_check=off)"
    assert summary.replay_short == "not checked"


def test_tolerances_and_ignored_keys(tmp_path):
    plain_run(tmp_path)
    # another lr changes loss and w_norm: left out by pattern, the rest reproduces
    _, summary = plain_run(tmp_path, lr=0.5000001, replay_ignore=["loss", "w_*", "*_s"])
    assert summary.replay_line == "replay: 5 of 5 served steps reproduced (1 value each)"   # not "1 values"
    _, summary = plain_run(tmp_path, lr=0.5000001, replay_rtol=1e-3)
    assert summary.replay_line == "replay: 5 of 5 served steps reproduced (3 values each)"
    _, summary = plain_run(tmp_path, lr=0.5000001)            # exact by default
    assert summary.replay_line.startswith("replay diverged at step 2")
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_check: Invalid value 'loud', expected one of \[off, warn, error\]"):
        plain_run(tmp_path, replay_check="loud")
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_atol: must be >= 0"):
        plain_run(tmp_path, replay_atol=-1)


def test_a_step_without_values_is_complete_and_unchecked(tmp_path):
    """Older caches (no values) load as before; a replay says which served steps it could not check."""
    plain_run(tmp_path)
    layout = namespace_in(tmp_path)
    for s in (4, 5):
        (layout.root / ".values" / f"{s}.json").unlink()
    assert open_store(layout).status(4).status == "complete"
    _, summary = plain_run(tmp_path)
    assert summary.hits == 5
    assert summary.replay_line == "replay: 3 of 5 served steps reproduced (3 values each); 2 unchecked (no recorded values)"
    assert summary.replay_short == "3/5 reproduced, 2 unchecked"
    for s in (1, 2, 3):
        (layout.root / ".values" / f"{s}.json").unlink()
    _, summary = plain_run(tmp_path)
    assert summary.replay_line == "replay: 5 served steps unchecked (no recorded values)"
    assert summary.replay_short == "5 unchecked"


def test_values_belong_to_the_commit_they_were_recorded_with(tmp_path):
    """A step written again (another commit) no longer has the old step's values."""
    plain_run(tmp_path)
    layout = namespace_in(tmp_path)
    store = open_store(layout)
    assert store.reader.read_values(2) is not None
    entries = store.writer.write_inner(2, 0, 0, {"ids": torch.zeros(8, 16, dtype=torch.int64)}, {})
    store.writer.commit(2, entries, None)
    assert store.reader.read_values(2) is None
    assert store.reader.read_values(99) is None              # no such step


def test_values_are_written_after_the_commit_and_a_failed_write_leaves_the_step_complete(tmp_path, caplog, monkeypatch):
    from skip_harness.store import values as values_module

    def refuse(self, step, values, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(values_module.ValuesStore, "write_step", refuse)
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        _, summary = plain_run(tmp_path, steps=2)
    assert summary.committed == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "skip_harness"]
    assert len(warnings) == 2 and all("could not record step" in w and "No space left" in w for w in warnings)
    layout = namespace_in(tmp_path)
    assert [open_store(layout).status(s).status for s in (1, 2)] == ["complete", "complete"]


def test_non_finite_values_round_trip_and_match(tmp_path):
    from skip_harness.store.open import open_namespace

    layout = namespace_in(plain_run(tmp_path, steps=1)[0].layout.root.parents[1])
    store = ValuesStore(open_namespace(layout))
    store.write_step(1, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5}, commit_created=1.0)
    doc = json.loads((layout.root / ".values" / "1.json").read_text())   # plain JSON, no NaN literal
    assert doc["values"] == {"a": "NaN", "b": "Infinity", "c": "-Infinity", "d": 1.5}
    back = store.read_step(1).values
    assert math.isnan(back["a"]) and back["b"] == math.inf and back["c"] == -math.inf and back["d"] == 1.5


def test_flatten_config():
    assert flatten_config({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": "[1, 2]", "d": None}


# --------------------------------------------------------------------------- the demo, every mode
def _demo(tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from skip_harness.demo import TINY_OVERRIDES
    from skip_harness.demo.config import register_demo_configs
    from skip_harness.demo.run import train

    register_demo_configs()
    OmegaConf.register_new_resolver("skip_harness_run_id", lambda: "run", replace=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_OVERRIDES, "trainer.total_training_steps=4", "trainer.torch_threads=1",
                                           f"skip.rollout_tq.dump_dir={tmp_path / 'cache'}", *overrides])
    GlobalHydra.instance().clear()
    return train(cfg, run_dir=tmp_path / "run")


DEMO_MODES = {
    "sync": ["trainer_mode=sync"],
    "colocate_async": ["trainer_mode=colocate_async"],
    "separate_async_K2": ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2"],
    "separate_async_K4": ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4"],
}


@pytest.mark.parametrize("mode", list(DEMO_MODES))
def test_demo_replays_reproduce_or_say_why_not(tmp_path, caplog, mode):
    overrides = DEMO_MODES[mode]
    _demo(tmp_path, *overrides)
    same = _demo(tmp_path, *overrides)
    assert same.summary.hits == 4
    assert same.summary.replay_line.startswith("replay: 4 of 4 served steps reproduced (")

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        lr = _demo(tmp_path, *overrides, "actor_rollout_ref.actor.optim.lr=0.006")
    assert lr.summary.replay_line.startswith("replay diverged at step ")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "skip_harness"]
    assert "actor_rollout_ref.actor.optim.lr: 0.003 -> 0.006" in warning

    serve_other_rollouts(namespace_in(tmp_path / "cache"), src=2, dst=3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        other = _demo(tmp_path, *overrides)
    assert other.summary.replay_line.startswith("replay diverged at step 3 ("), other.summary.replay_line
    assert other.summary.replay_line.endswith("; 2 steps reproduced before it")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "skip_harness"]
    assert "nothing in it explains this" in warning


def test_demo_replay_check_error_stops_the_script_with_a_message(tmp_path):
    _demo(tmp_path)
    with pytest.raises(ReplayDivergedError, match="replay_check=error"):
        _demo(tmp_path, "actor_rollout_ref.actor.optim.lr=0.006", "skip.rollout_tq.replay_check=error")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(rows) < 4                                # stopped at the divergent step


# --------------------------------------------------------------------------- skip-harness diff
def _cli(*argv):
    import contextlib
    import io

    from skip_harness.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_diff_tells_two_runs_apart_step_by_step(tmp_path):
    from skip_harness.cli.diff import compare

    plain_run(tmp_path / "A")
    plain_run(tmp_path / "B", lr=0.25)                       # same rollouts, other training values
    plain_run(tmp_path / "C")
    serve_other_rollouts(namespace_in(tmp_path / "C"), src=2, dst=3)   # other rollouts at step 3

    code, text = _cli("diff", str(tmp_path / "A"), str(tmp_path / "A"))
    assert code == 0 and text.rstrip().splitlines()[-1].startswith("identical")

    doc = compare(str(tmp_path / "A"), str(tmp_path / "B"))
    assert doc["identical"] is False
    assert doc["config"] == [{"key": "optim.lr", "a": 0.5, "b": 0.25}]
    (ns,) = doc["namespaces"]
    assert ns["name"] == "my_run_demo/N8" and ns["rollouts_same"] == 5 and ns["rollouts_differ"] == 0
    assert [s["rollouts"] for s in ns["steps"]] == ["same"] * 5
    assert "trajectories_differ" not in ns["steps"][0]          # checksums matched: no payload read
    assert ns["values"]["first_divergence"]["step"] == 2 and ns["values"]["first_divergence"]["key"] == "loss"
    assert ns["values"]["max_abs_diff"]["reward_mean"] == 0.0 and ns["values"]["max_abs_diff"]["loss"] > 0
    assert "gen_s" not in ns["values"]["max_abs_diff"]            # timings left out, as the replay check does

    doc = compare(str(namespace_in(tmp_path / "A").root), str(namespace_in(tmp_path / "C").root))
    (ns,) = doc["namespaces"]
    assert doc["config"] == [] and ns["rollouts_differ"] == 1
    step3 = ns["steps"][2]
    assert step3["rollouts"] == "differ" and step3["trajectories_differ"] == 8 and step3["trajectories"] == 8
    g2, g3 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    torch.randint(0, 100, (8, 16), generator=g2), torch.randint(0, 100, (8, 16), generator=g3)
    assert step3["reward_mean_delta"] == pytest.approx(float(torch.rand(8, generator=g2).mean() - torch.rand(8, generator=g3).mean()))
    assert ns["values"]["first_divergence"] is None             # the recorded values are step 3's, both sides

    code, text = _cli("diff", str(tmp_path / "A"), str(tmp_path / "B"))
    assert code == 1
    assert "optim.lr: 0.5 -> 0.25" in text and "values first differ at step 2: loss" in text
    code, text = _cli("diff", str(tmp_path / "A"), str(tmp_path / "C"), "--json")
    assert code == 1 and json.loads(text) == json.loads(json.dumps(compare(str(tmp_path / "A"), str(tmp_path / "C"))))


def test_diff_bad_input_exits_2(tmp_path, capsys):
    plain_run(tmp_path / "A", steps=1)
    assert _cli("diff", str(tmp_path / "A"), str(tmp_path / "missing"))[0] == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert _cli("diff", str(tmp_path / "A"), str(tmp_path / "empty"))[0] == 2
    assert _cli("diff", str(namespace_in(tmp_path / "A").root), str(tmp_path / "A"))[0] == 2


def test_values_and_diff_on_an_object_store(s3_bucket, s3_env, tmp_path):
    """Recorded, checked and diffed through the object-store backend (a real S3 server)."""
    from skip_harness.cli.diff import compare

    url = f"s3://{s3_bucket}/dump"
    plain_run(url, steps=3)
    _, again = plain_run(url, steps=3)
    assert again.replay_line == "replay: 3 of 3 served steps reproduced (3 values each)"
    plain_run(tmp_path / "local", steps=3, lr=0.25)
    doc = compare(url, str(tmp_path / "local"))
    (ns,) = doc["namespaces"]
    assert ns["rollouts_same"] == 3 and ns["values"]["first_divergence"]["step"] == 2
    assert doc["config"] == [{"key": "optim.lr", "a": 0.5, "b": 0.25}]
