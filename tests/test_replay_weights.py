"""The policy's weights in the replay check (`skip.rollout_tq.replay_weights`, run.weights): a digest of each
parameter after each step's update, recorded as values and compared exactly on a replay at the same K and W.

The demo in-process (tests/test_replay.py's `_demo`): recorded and replayed with the key on, every step
reproduces and its values hold one digest per parameter; a replay with the learning rate changed by 1 %
diverges at step 1 naming the first parameter -- the loss of step 1 is computed before its update, so
without the digests the replay diverges only at step 2 -- even with a tolerance that lets every other value
pass; a replay at another K leaves them out and says so; with the key off there are none.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from replay_rig import namespace_in
from test_replay import _demo
from skip_harness import SkipHarness
from skip_harness.errors import ConfigError
from skip_harness.run.weights import DIGEST_BITS, tensor_digest, weight_digests
from skip_harness.store.open import open_store

ON = "skip.rollout_tq.replay_weights=true"
SYNC = "trainer_mode=sync"
FIRST = "weights/policy.tok.weight"          # the demo policy's first parameter


def _weights(values) -> dict:
    return {k: v for k, v in values.items() if k.startswith("weights/")}


def _policy_names() -> list:
    from skip_harness.demo.policy import Policy, PolicyConfig

    policy = Policy(PolicyConfig(max_len=16, d_model=16, n_layers=1, n_heads=2), seed=0)
    return [f"weights/policy.{n}" for n, _ in policy.named_parameters()]


# --------------------------------------------------------------------------- the digests themselves
def test_a_digest_is_an_integer_a_float_and_json_hold_exactly():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16), torch.tensor(2.5),
               torch.zeros(0, 4), torch.arange(6).reshape(2, 3).t()]            # 0-dim, empty, non-contiguous
    for t in tensors:
        d = tensor_digest(t)
        assert isinstance(d, int) and 0 <= d < 2 ** DIGEST_BITS
        assert int(json.loads(json.dumps(float(d)))) == d
    a = torch.randn(4, 4, generator=g)
    b = a.clone()
    b[2, 3] = torch.nextafter(b[2, 3], torch.tensor(math.inf))                  # one bit of one element
    assert tensor_digest(a) == tensor_digest(a.clone()) != tensor_digest(b)
    assert tensor_digest(a) != tensor_digest(a.reshape(16)) != tensor_digest(a.double())  # shape, dtype count


def test_digests_name_each_parameter_in_order_and_combine_the_ranks():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    one = weight_digests(model, name="critic")
    assert list(one) == ["weights/critic.0.weight", "weights/critic.0.bias", "weights/critic.1.weight",
                         "weights/critic.1.bias"]
    # replicas (DDP): every rank the same digest -> that digest, whatever the number of ranks
    assert weight_digests(model, name="critic", gather=lambda local: [local, local]) == one
    # shards (FSDP, ZeRO-3): the ranks' digests differ -> one value from all of them, in rank order
    other = [d ^ 1 for d in one.values()]
    sharded = weight_digests(model, name="critic", gather=lambda local: [local, other])
    swapped = weight_digests(model, name="critic", gather=lambda local: [other, local])
    for key in one:
        assert sharded[key] != one[key] and sharded[key] != swapped[key] and sharded[key] < 2 ** DIGEST_BITS


def test_the_key_is_validated_naming_it():
    ns = {"experiment_name": "e", "project_name": "p", "K": 1}
    assert SkipHarness.create({"enable": True, "replay_weights": True}, namespace=ns).settings.replay_weights is True
    assert SkipHarness.create({"enable": True}, namespace=ns).settings.replay_weights is False    # opt-in
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_weights: Value 'maybe' is not a valid bool"):
        SkipHarness.create({"enable": True, "replay_weights": "maybe"}, namespace=ns)


def test_with_the_key_off_nothing_is_computed(tmp_path):
    """Off (the default), `weight_values` returns {} without touching the model: not a module here, which
    the key on refuses."""
    harness = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path)},
                                 namespace={"experiment_name": "e", "project_name": "p", "K": 1})
    harness.start()
    try:
        assert harness.weight_values(object()) == {}
    finally:
        harness.close()
    on = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "on"), "replay_weights": True},
                            namespace={"experiment_name": "e", "project_name": "p", "K": 1})
    on.start()
    try:
        with pytest.raises(Exception, match="expected a torch module"):
            on.weight_values(object())
        assert set(on.weight_values(torch.nn.Linear(2, 2))) == {"weights/policy.weight", "weights/policy.bias"}
    finally:
        on.close()


# --------------------------------------------------------------------------- the demo
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The demo recorded with the key on (4 steps, sync)."""
    tmp = tmp_path_factory.mktemp("weights")
    _demo(tmp, SYNC, ON)
    return tmp


def _copy(recorded, tmp_path):
    import shutil

    shutil.copytree(recorded / "cache", tmp_path / "cache")
    for lock in (tmp_path / "cache").rglob("*.lock"):
        lock.unlink()
    return tmp_path


def test_the_demo_records_each_parameter_and_a_replay_reproduces_them(recorded, tmp_path):
    reader = open_store(namespace_in(recorded / "cache")).reader
    names = _policy_names()
    for step in range(1, 5):
        weights = _weights(reader.read_values(step))
        assert list(weights) == names                        # every parameter, in the model's order
        assert all(v == int(v) and 0 <= v < 2 ** DIGEST_BITS for v in weights.values())
    assert _weights(reader.read_values(1)) != _weights(reader.read_values(2))    # each step's update moves them
    same = _demo(_copy(recorded, tmp_path), SYNC, ON)
    assert same.summary.hits == 4
    assert same.summary.replay_line.startswith("replay: 4 of 4 served steps reproduced ("), same.summary.replay_line
    assert f"({len(names) + 6} values each)" in same.summary.replay_line      # 6 metrics (not timings), digests


def test_the_learning_rate_changed_by_one_percent_names_the_first_parameter_at_step_1(recorded, tmp_path, caplog):
    lr = _demo(_copy(recorded, tmp_path), SYNC, ON, "actor_rollout_ref.actor.optim.lr=0.00303")
    line = lr.summary.replay_line
    assert line.startswith(f"replay diverged at step 1 ({FIRST} digest "), line
    assert "training side changed: actor_rollout_ref.actor.optim.lr 0.003 -> 0.00303" in line


def test_digests_are_compared_exactly_whatever_the_tolerance(recorded, tmp_path):
    """replay_rtol=replay_atol=1e9 let every metric pass: the digests still do not (a digest is equal or not)."""
    line = _demo(_copy(recorded, tmp_path), SYNC, ON, "actor_rollout_ref.actor.optim.lr=0.00303",
                 "skip.rollout_tq.replay_rtol=1e9", "skip.rollout_tq.replay_atol=1e9").summary.replay_line
    assert line.startswith(f"replay diverged at step 1 ({FIRST} digest "), line


def test_a_replay_at_another_k_leaves_the_digests_out_and_says_so(recorded, tmp_path):
    replay = _demo(tmp_path, "trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2", ON,
                   f"skip.rollout_tq.replay_from={namespace_in(recorded / 'cache').root}")
    line = replay.summary.replay_line
    assert line.startswith("replay: 4 of 4 served steps reproduced ("), line
    assert "weights/* not compared (the weights change with K and W)" in line
    assert "weights/policy." not in line
    # `skip-harness diff` of the recording and this replay says the same, once
    from skip_harness.cli.diff import compare

    ns = namespace_in(recorded / "cache").root
    (side,) = compare(str(ns), f"{ns}@{replay.run_id}")["namespaces"]
    said = side["values"]["describe"]
    assert "weights/* not compared (the weights change with K and W)" in said and "weights/policy." not in said, said


def test_diff_at_another_w_leaves_the_digests_out():
    from skip_harness.cli.pairing import Side, values_rule

    rule = values_rule(Side(1, 2, "rec"), Side(1, 1, "rec", True))
    assert rule.compared("loss") and not rule.compared("weights/policy.tok.weight")
    assert values_rule(Side(1, 2, "rec"), Side(1, 2, "rec", True)).compared("weights/policy.tok.weight")


def test_with_the_key_off_the_demo_records_no_digest(tmp_path):
    _demo(tmp_path, SYNC, "trainer.total_training_steps=1")
    values = open_store(namespace_in(tmp_path / "cache")).reader.read_values(1)
    assert values and not _weights(values)


def test_verl_refuses_the_key_naming_it():
    """The verl plug-in cannot reach the weights (docs/verl.md): the key is refused, not quietly ignored."""
    from omegaconf import OmegaConf

    from skip_harness.integrations.verl_config import settings_of

    local = OmegaConf.create({"enable": True, "dump_dir": "/tmp/x", "steps": [], "action": "cache"})
    assert settings_of(local, OmegaConf.create({"skip_harness": {"tier": False}}))[0].replay_weights is False
    with pytest.raises(ConfigError, match=r"^skip_harness\.replay_weights: not supported in verl"):
        settings_of(local, OmegaConf.create({"skip_harness": {"replay_weights": True}}))


def test_the_viewer_charts_the_metrics_before_the_digests():
    from skip_harness.cli.view.values import default_order

    keys = ["weights/policy.blocks.0.ln1.weight", "weights/policy.clip_len.kl", "gen_s", "loss", "other"]
    assert default_order(keys) == ["loss", "other", "gen_s", "weights/policy.blocks.0.ln1.weight",
                                   "weights/policy.clip_len.kl"]
