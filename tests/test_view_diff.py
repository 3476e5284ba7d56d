"""`skip-harness diff` says only what it knows (issue 31, item 6): keys recorded on one side only are listed
apart and never make a divergence; steps on one side only are counted apart; identical checksums are
called `same commit records (payloads not read)`; config keys that cannot change training are not offered
as explanations, and a null and an absent key are the same."""
from __future__ import annotations

import contextlib
import io

from skip_harness.store.open import open_store
from skip_harness.cli import main
from skip_harness.cli.compare import compare
from skip_harness.store.stepstore import StepStore
from skip_harness.store.values import ValuesStore
from view_rig import demo_batch, write_namespace


def _cli(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def record(layout, values, config=None):
    """{step: {key: value}} recorded beside the committed steps; `config` the training side under one digest."""
    store = open_store(layout)
    if config is not None:
        store.writer.write_training_config("cfg0", config)
    for s, v in values.items():
        created = store.reader.read_commit(s).created
        ValuesStore(store.namespace).write_step(s, v, commit_created=created, config="cfg0" if config else None)


def test_a_key_on_one_side_only_is_not_a_divergence(tmp_path):
    a = write_namespace(tmp_path / "A", "run", {s: demo_batch(s) for s in (1, 2)})
    b = write_namespace(tmp_path / "B", "run", {s: demo_batch(s) for s in (1, 2)})
    record(a, {1: {"loss": 0.5}, 2: {"loss": 0.25}})
    record(b, {1: {"loss": 0.5, "val_reward": 0.214286}, 2: {"loss": 0.25}})
    doc = compare(str(a.root), str(b.root))
    (ns,) = doc["namespaces"]
    assert ns["values"]["first_divergence"] is None and doc["identical"] is True
    assert ns["values"]["keys_only_in_b"] == ["val_reward"] and ns["values"]["keys_only_in_a"] == []
    code, text = _cli("diff", str(a.root), str(b.root))
    assert code == 0, text
    assert "recorded in B only (not compared): val_reward" in text and "differ: val_reward" not in text


def test_steps_on_one_side_only_are_counted_apart(tmp_path):
    a = write_namespace(tmp_path / "A", "run", {s: demo_batch(s) for s in range(1, 5)})
    b = write_namespace(tmp_path / "B", "run", {s: demo_batch(s) for s in (1, 2)})
    (ns,) = compare(str(a.root), str(b.root))["namespaces"]
    assert ns["rollouts_differ"] == 0 and ns["rollouts_same"] == 2
    assert ns["steps_only_in_a"] == 2 and ns["steps_only_in_b"] == 0
    code, text = _cli("diff", str(a.root), str(b.root))
    assert code == 1
    assert "0 differ; steps only in A: 2" in text
    assert text.rstrip().endswith("the two differ only in the steps they hold (the steps both hold are the same)")


def test_same_checksums_say_payloads_were_not_read(tmp_path):
    a = write_namespace(tmp_path / "A", "run", {s: demo_batch(s) for s in (1, 2)})
    b = write_namespace(tmp_path / "B", "run", {s: demo_batch(s) for s in (1, 2)})
    payload = b.step_dir(2) / "tq_batch.pt"
    data = bytearray(payload.read_bytes())
    data[-3] ^= 0xFF                                  # a flipped byte: `verify` would fail B
    payload.write_bytes(bytes(data))
    doc = compare(str(a.root), str(b.root))
    (ns,) = doc["namespaces"]
    assert ns["payloads_read"] is False and ns["rollouts_same_records"] == 2
    assert [s.get("by") for s in ns["steps"]] == ["commit records"] * 2
    code, text = _cli("diff", str(a.root), str(b.root))
    assert "same commit records (payloads not read" in text.splitlines()[-1]
    assert text.splitlines()[-1] != "identical"


def test_config_keys_that_cannot_change_training_are_not_explanations(tmp_path):
    a = write_namespace(tmp_path / "A", "run", {1: demo_batch(1)})
    b = write_namespace(tmp_path / "B", "run", {1: demo_batch(1)})
    record(a, {1: {"loss": 0.5}}, {"trainer.total_training_steps": 4, "trainer.torch_threads": None,
                                   "trainer.default_local_dir": "/a", "trainer.logger": "console",
                                   "optim.lr": 0.5, "algo.beta": None})
    record(b, {1: {"loss": 0.5}}, {"trainer.total_training_steps": 12, "trainer.torch_threads": 1,
                                   "trainer.default_local_dir": "/b", "trainer.logger": "wandb",
                                   "optim.lr": 0.25})
    doc = compare(str(a.root), str(b.root))
    assert doc["config"] == [{"key": "optim.lr", "a": 0.5, "b": 0.25}]     # algo.beta: null == absent
    code, text = _cli("diff", str(a.root), str(b.root))
    assert "total_training_steps" not in text and "torch_threads" not in text and "optim.lr: 0.5 -> 0.25" in text
