"""The demo trainer: task, policy, the three modes, and bit-exact determinism with cached steps."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from skip_harness.demo.policy import Policy, PolicyConfig, response_mask
from skip_harness.demo.task import EOS, PAD, SortTask
from skip_harness.demo.trainer import BATCH_KEYS, DemoSettings, DemoTrainer, group_advantages

REPO = Path(__file__).resolve().parents[1]

SMALL = DemoSettings(
    seed=7, mode="sync", K=1, train_batch_size=8, n=4, max_prompt_length=6, max_response_length=6,
    temperature=1.0, lr=3e-3, d_model=32, n_layers=1, n_heads=2, val_size=8,
)
SMALL_BY_MODE = {
    "sync": SMALL,
    "colocate_async": replace(SMALL, mode="colocate_async"),
    "separate_async": replace(SMALL, mode="separate_async", K=2),
}


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def training_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("_s")}


def run(settings, accelerator, steps, *, test_freq=0, patch=None):
    """Fit a fresh trainer; `patch(trainer)` may replace its prepare_data/sample. Returns (trainer, rows)."""
    trainer = DemoTrainer(settings, accelerator)
    if patch is not None:
        patch(trainer)
    rows = []
    trainer.fit(steps, on_step_end=lambda step, m: rows.append((step, m)), test_freq=test_freq)
    return trainer, rows


def recording(store):
    """Wrap `sample` on the instance, keeping a deep copy of every training mini-batch by (step, inner index)."""

    def patch(trainer):
        original = trainer.sample
        counts = {}

        def sample(step, *, validate=False):
            batch = original(step, validate=validate)
            if not validate:
                i = counts.get(step, 0)
                counts[step] = i + 1
                store[(step, i)] = {k: v.clone() for k, v in batch.items()}
            return batch

        trainer.sample = sample

    return patch


def serving(store, cached_steps, served):
    """Simulate the harness on a hit: prepare_data(step, dispatch=False), then answer sample from `store`."""

    def patch(trainer):
        original_prepare, original_sample = trainer.prepare_data, trainer.sample
        counts = {}

        def prepare_data(step, *, dispatch=True, validate=False):
            if step in cached_steps and not validate:
                return original_prepare(step, dispatch=False)
            return original_prepare(step, dispatch=dispatch, validate=validate)

        def sample(step, *, validate=False):
            if step in cached_steps and not validate:
                i = counts.get(step, 0)
                counts[step] = i + 1
                served.append((step, i))
                return copy.deepcopy(store[(step, i)])
            return original_sample(step, validate=validate)

        trainer.prepare_data, trainer.sample = prepare_data, sample

    return patch


# --------------------------------------------------------------------------- task and policy


def test_data_stream_depends_only_on_seed_and_step():
    task = SortTask(8, 8)
    a = task.make_prompts(1, 5, 16)
    assert a.shape == (16, 8) and a.dtype == torch.long
    assert torch.equal(a, task.make_prompts(1, 5, 16))
    assert not torch.equal(a, task.make_prompts(1, 6, 16))
    assert not torch.equal(a, task.make_prompts(2, 5, 16))
    assert not torch.equal(task.validation_prompts(1, 16), task.make_prompts(1, 0, 16))
    assert (a[:, 1:-1] < 10).all()


def test_reward_gives_partial_credit():
    task = SortTask(6, 6)  # 4 digits; scored: 4 digits + EOS
    prompts = torch.tensor([[10, 3, 1, 2, 0, 11]])
    perfect = torch.tensor([[0, 1, 2, 3, EOS, PAD]])
    assert torch.equal(task.targets(prompts), perfect)
    assert task.reward(prompts, perfect).tolist() == [1.0]
    half = torch.tensor([[0, 1, 9, 9, 9, 9], [9, 9, 9, 9, 9, 9]])
    assert task.reward(prompts, half).tolist() == [pytest.approx(0.4), 0.0]  # prompts repeated over 2 samples


def test_generate_shapes_masks_and_seeded_sampling():
    policy = Policy(PolicyConfig(max_len=12, d_model=16, n_layers=1, n_heads=2), seed=0)
    prompts = SortTask(6, 6).make_prompts(0, 1, 3)
    out1 = policy.generate(prompts, 6, n=2, temperature=1.0, generator=torch.Generator().manual_seed(3))
    out2 = policy.generate(prompts, 6, n=2, temperature=1.0, generator=torch.Generator().manual_seed(3))
    responses, logprobs, mask = out1
    assert responses.shape == logprobs.shape == mask.shape == (6, 6)
    for x, y in zip(out1, out2):
        assert torch.equal(x, y)
    assert torch.equal(mask, response_mask(responses))
    assert (logprobs[~mask] == 0).all() and (logprobs[mask] < 0).all()
    # teacher-forced logprobs agree with the sampling ones on the masked-in tokens
    tf = policy.logprobs(prompts.repeat_interleave(2, dim=0), responses)
    assert torch.allclose(tf[mask], logprobs[mask], atol=1e-5)
    with pytest.raises(ValueError):
        policy.generate(prompts, 6, n=2, temperature=1.0)  # no generator: refuse the global RNG


def test_response_mask_stops_after_first_eos():
    r = torch.tensor([[1, EOS, 3, EOS], [1, 2, 3, 4]])
    assert response_mask(r).tolist() == [[True, True, False, False], [True, True, True, True]]


def test_group_advantages():
    adv = group_advantages(torch.tensor([0.0, 1.0, 0.5, 0.5]), 2)
    assert adv[0] < 0 < adv[1] and adv[2] == adv[3] == 0
    assert torch.equal(group_advantages(torch.tensor([0.3, 0.7]), 1), torch.zeros(2))


def test_settings_are_checked(accelerator):
    with pytest.raises(ValueError, match="mode"):
        replace(SMALL, mode="fast")
    with pytest.raises(ValueError, match="K must be 1"):
        replace(SMALL, K=2)
    with pytest.raises(ValueError, match="multiple of K"):
        replace(SMALL, mode="separate_async", K=3)


# --------------------------------------------------------------------------- the trainer


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_undispatched_step_generates_on_demand_with_the_step_start_weights(mode, accelerator):
    settings = SMALL_BY_MODE[mode]
    batches = {}
    for dispatch in (True, False):
        trainer = DemoTrainer(settings, accelerator)
        trainer.prepare_data(1, dispatch=dispatch)
        batches[dispatch] = []
        for _ in range(settings.K):
            batches[dispatch].append(trainer.sample(1))
            trainer.train_on(1, batches[dispatch][-1])
        trainer.close()
    for a, b in zip(batches[True], batches[False]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_cached_steps_give_bit_identical_metrics(mode, accelerator):
    settings = SMALL_BY_MODE[mode]
    store = {}
    _, first = run(settings, accelerator, 4, test_freq=2, patch=recording(store))
    assert len(store) == 4 * settings.K
    for (step, i), batch in store.items():
        assert set(batch) == set(BATCH_KEYS)
        assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in batch.values())
        per_call = settings.train_batch_size // settings.K
        assert batch["prompts"].shape[0] == per_call * settings.n
        assert batch["uid"].unique().tolist() == list(range(i * per_call, (i + 1) * per_call))
        assert (batch["step"].item(), batch["inner_index"].item()) == (step, i)

    plain, again = run(settings, accelerator, 4, test_freq=2)
    served = []
    cached, replayed = run(settings, accelerator, 4, test_freq=2, patch=serving(store, {1, 3}, served))

    assert served == [(s, i) for s in (1, 3) for i in range(settings.K)]
    assert cached.generations == plain.generations - 2 * settings.K  # hits started no generation
    expected = [(s, training_metrics(m)) for s, m in first]
    assert [(s, training_metrics(m)) for s, m in again] == expected
    assert [(s, training_metrics(m)) for s, m in replayed] == expected
    keys = set(expected[1][1])
    assert {"loss", "reward_mean", "response_len", "val_reward"} <= keys
    assert all({"gen_s", "train_s", "step_s"} <= set(m) for _, m in replayed)
    assert all(math.isfinite(v) for _, m in replayed for v in m.values())


def test_global_rng_untouched_and_validation_changes_nothing(accelerator):
    before = torch.random.get_rng_state()
    _, with_val = run(SMALL_BY_MODE["colocate_async"], accelerator, 3, test_freq=1)
    assert torch.equal(before, torch.random.get_rng_state())
    _, without_val = run(SMALL_BY_MODE["colocate_async"], accelerator, 3, test_freq=0)
    assert all("val_reward" in m for _, m in with_val)
    strip = lambda rows: [(s, {k: v for k, v in training_metrics(m).items() if k != "val_reward"}) for s, m in rows]
    assert strip(with_val) == strip(without_val)


def test_colocate_generates_one_step_off_policy(accelerator):
    _, sync = run(SMALL_BY_MODE["sync"], accelerator, 3)
    _, colo = run(SMALL_BY_MODE["colocate_async"], accelerator, 3)
    # step 1 and step 2 are generated by the initial weights in colocate, step 2 by the updated ones in sync
    assert training_metrics(sync[0][1]) == training_metrics(colo[0][1])
    assert sync[1][1]["reward_mean"] != colo[1][1]["reward_mean"]


def test_prepare_without_dispatch_starts_no_generation(accelerator):
    for settings in SMALL_BY_MODE.values():
        trainer = DemoTrainer(settings, accelerator)
        trainer.prepare_data(1, dispatch=False)
        trainer.prepare_data(2)
        for _ in range(settings.K):
            trainer.train_on(2, trainer.sample(2))
        with pytest.raises(RuntimeError, match="more than K"):
            trainer.sample(2)
        trainer.close()
        assert trainer.generations == settings.K


@pytest.mark.slow  # the demo's learning over 25 steps (about a minute), not the cache
def test_reward_rises(accelerator):
    settings = replace(SMALL, train_batch_size=16, n=8, max_prompt_length=8, max_response_length=8, n_heads=2, n_layers=2)
    _, rows = run(settings, accelerator, 25, test_freq=25)
    first = sum(m["reward_mean"] for _, m in rows[:3]) / 3
    last = sum(m["reward_mean"] for _, m in rows[-3:]) / 3
    assert last > first + 0.04, (first, last)  # about 0.13 -> 0.20 at this seed
    assert rows[-1][1]["val_reward"] > 0.2  # a random policy scores about 0.1


DIST_SCRIPT = """
import copy, json, sys
from dataclasses import replace
import torch
from accelerate import Accelerator
sys.path.insert(0, {tests!r})
from test_demo_trainer import SMALL_BY_MODE, run, recording, serving, training_metrics

acc = Accelerator(cpu=True)
out = {{}}
for mode, settings in SMALL_BY_MODE.items():
    settings = replace(settings, train_batch_size=8)
    store = {{}}
    trainer, first = run(settings, acc, 3, test_freq=3, patch=recording(store))
    served = []
    _, replayed = run(settings, acc, 3, test_freq=3, patch=serving(store, {{2}}, served))
    out[mode] = {{
        "world": trainer.world_size,
        "first": [training_metrics(m) for _, m in first],
        "replayed": [training_metrics(m) for _, m in replayed],
        "uids": sorted(v for (s, i), b in store.items() if s == 1 for v in b["uid"].unique().tolist()),
    }}
with open({out!r} + f"/rank{{acc.process_index}}.json", "w") as f:
    json.dump(out, f)
"""


@pytest.mark.slow  # torchrun, two processes
def test_two_ranks_under_torchrun(tmp_path):
    script = tmp_path / "dist_demo.py"
    script.write_text(DIST_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    for mode in SMALL_BY_MODE:
        assert r0[mode]["world"] == 2
        assert r0[mode]["first"] == r1[mode]["first"]  # metrics reduced over ranks
        assert r0[mode]["replayed"] == r0[mode]["first"]  # a served step changes nothing
        assert r1[mode]["replayed"] == r1[mode]["first"]
        assert sorted(r0[mode]["uids"] + r1[mode]["uids"]) == list(range(8))  # ranks split each step's prompts
