"""The harness from any trainer: plain-dict construction, optional prepare_data, step types, validation
predicates, wrapping rules, what happens after close, prefetch and back-pressure."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from skip_harness import SkipHarness
from skip_harness.config import RolloutTQConfig
from skip_harness.errors import ConfigError, HarnessUsageError, LockHeldError
from skip_harness.store.reader import StepReader


class GenOnly:
    """A trainer with only a generation call (no prepare_data), steps from 0, like TRL."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, *, training=True):
        self.calls.append(list(prompts))
        return {"ids": torch.tensor([[len(p)] * 3 for p in prompts]), "text": list(prompts)}


def make(tmp_path, K=1, **settings):
    return SkipHarness.create(
        {"enable": True, "dump_dir": str(tmp_path / "c"), **settings},
        namespace={"experiment_name": "e", "project_name": "p", "K": K, "n": 2},
        fingerprint={"model": "tiny", "temperature": 0.7},
    )


def run_gen_only(tmp_path, steps, K=1, prompts=lambda s, i: [f"p{s}-{i}", "q"], **settings):
    t = GenOnly()
    state = {"step": 0}
    h = make(tmp_path, K, **settings)
    h.wrap(t, sample="generate", prepare_data=None, step_of=lambda: np.int64(state["step"]), first_step=0,
           is_validation=lambda args, kwargs: not kwargs.get("training", True),
           call_digest=lambda args, kwargs: "|".join(args[0]))
    out = []
    for s in steps:
        state["step"] = s
        out.append([t.generate(prompts(s, i)) for i in range(K)])
        t.generate(["eval"], training=False)  # validation: never cached
    h.close()
    return h, t, out


def test_plain_dict_gen_only_zero_based_numpy_steps_round_trip(tmp_path):
    h1, t1, first = run_gen_only(tmp_path, [0, 1, 2], K=2)
    assert h1.layout.root.name == "N2_K2_W1" and (h1.layout.root / "0").is_dir()
    assert [h1.outcome(s) for s in (0, 1, 2)] == ["miss"] * 3
    h2, t2, again = run_gen_only(tmp_path, [0, 1, 2], K=2)
    assert [h2.outcome(s) for s in (0, 1, 2)] == ["hit"] * 3
    assert t2.calls == [["eval"]] * 3  # only the validation calls reached the trainer
    for a, b in zip(first, again):
        for x, y in zip(a, b):
            assert torch.equal(x["ids"], y["ids"]) and x["text"] == y["text"]


def test_changed_inputs_regenerate_the_step_with_a_warning(tmp_path, caplog):
    run_gen_only(tmp_path, [0, 1], K=2)
    changed = lambda s, i: [f"p{s}-{i}", "CHANGED" if (s, i) == (1, 1) else "q"]
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        h, t, out = run_gen_only(tmp_path, [0, 1], K=2, prompts=changed)
    assert h.outcome(0) == "hit" and h.outcome(1) == "miss"
    assert "step 1: the inputs of sample call 1 differ" in caplog.text
    assert t.calls.count(["p1-1", "CHANGED"]) == 1 and ["p1-0", "q"] not in t.calls  # inner 0 was served
    s = h.summary()
    assert (s.hits, s.misses, s.committed) == (1, 1, 1)
    # the step was rewritten whole: the next run serves the new inputs' batches
    h3, t3, out3 = run_gen_only(tmp_path, [0, 1], K=2, prompts=changed)
    assert [h3.outcome(s) for s in (0, 1)] == ["hit", "hit"] and t3.calls == [["eval"]] * 2
    assert out3[1][1]["text"] == ["p1-1", "CHANGED"]


def test_settings_from_dict_omegaconf_and_dataclass_and_errors_name_the_full_key(tmp_path):
    ns = {"experiment_name": "e", "project_name": "p"}
    for settings in ({"enable": True}, OmegaConf.create({"enable": True}), RolloutTQConfig(enable=True)):
        assert SkipHarness.create(settings, namespace=ns).enabled
    with pytest.raises(ConfigError, match=r"^skip\.rollout_tq\.action: "):
        SkipHarness.create({"action": "nope"}, namespace=ns)
    with pytest.raises(ConfigError, match=r"^skip\.rollout_tq\.actoin: "):
        SkipHarness.create({"actoin": "cache"}, namespace=ns)
    with pytest.raises(ConfigError, match=r"^namespace\.K: "):
        SkipHarness.create({}, namespace={**ns, "K": 0})
    with pytest.raises(ConfigError, match=r"^namespace\.experiment_name: "):
        SkipHarness.create({}, namespace={"project_name": "p"})
    with pytest.raises(ConfigError, match=r"^trainer\.v1\.trainer_mod: fingerprint key not found"):
        from skip_harness.demo.config import DemoConfig
        SkipHarness.from_config(DemoConfig(), fingerprint_keys=["trainer.v1.trainer_mod"])
    assert list(tmp_path.iterdir()) == []  # construction never touches the disk


class Loop:
    def __init__(self):
        self.dispatched, self.advanced, self.generated = [], [], 0

    def prepare_data(self, step):  # no `dispatch` parameter
        self.advanced.append(step)
        self.dispatched.append(step)

    def advance_only(self, step):
        self.advanced.append(step)

    def sample(self, step):
        self.generated += 1
        return torch.full((2,), float(step))


def test_prepare_data_without_dispatch_needs_a_declared_alternative(tmp_path):
    with pytest.raises(HarnessUsageError, match="on_hit_prepare"):
        make(tmp_path).wrap(Loop())
    for _ in range(2):
        t = Loop()
        h = make(tmp_path).wrap(t, on_hit_prepare="advance_only")
        for s in (1, 2):
            t.prepare_data(s)
            t.sample(s)
        h.close()
    assert t.advanced == [1, 2] and t.dispatched == [] and t.generated == 0


def test_wrapping_twice_and_after_close(tmp_path):
    t = Loop()
    h = make(tmp_path).wrap(t, dispatch_kwarg=None)
    with pytest.raises(HarnessUsageError, match="already wraps"):
        h.wrap(t, dispatch_kwarg=None)
    with pytest.raises(HarnessUsageError, match="already wrapped by a skip_harness harness"):
        make(tmp_path).wrap(t, dispatch_kwarg=None)
    t.prepare_data(1)
    wrapped_sample = t.sample
    t.sample(1)
    h.close()
    assert "sample" not in vars(t)  # the trainer's own method is back
    before = sorted(p.name for p in h.layout.root.iterdir())
    wrapped_sample(2)  # a reference kept from before close runs the trainer's own code
    assert sorted(p.name for p in h.layout.root.iterdir()) == before and t.generated == 2


def test_steps_below_first_step_and_non_integers_are_usage_errors(tmp_path):
    t = Loop()
    make(tmp_path).wrap(t, dispatch_kwarg=None)
    with pytest.raises(HarnessUsageError, match="first_step=0"):
        t.sample(0)
    with pytest.raises(HarnessUsageError, match="integer"):
        t.sample(1.5)
    t.sample(torch.tensor(3))  # integral tensors are steps too


def test_a_second_harness_on_a_held_namespace_is_refused(tmp_path):
    a, b = make(tmp_path), make(tmp_path)
    a.start()
    with pytest.raises(LockHeldError, match="already in use by this process"):
        b.start()
    a.close()
    b.start()
    b.close()


def test_prefetch_loads_the_next_hit_ahead_and_is_cancelled_at_close(tmp_path, monkeypatch):
    def run():
        t = Loop()
        h = make(tmp_path).wrap(t, dispatch_kwarg=None)
        for s in (1, 2, 3):
            t.sample(s)
        return h, t

    h, _ = run()
    h.close()
    loads = []
    real = StepReader.read_served

    def read_served(self, step, rank, **kw):
        loads.append((step, threading.current_thread().name))
        return real(self, step, rank, **kw)

    monkeypatch.setattr(StepReader, "read_served", read_served)
    h, t = run()
    assert [s for s, _ in loads] == [1, 2, 3]
    assert all(name.startswith("skip_harness-prefetch") for s, name in loads if s > 1)  # loaded ahead
    assert h._prefetcher._ahead is None  # nothing beyond step 3 is servable: nothing loaded ahead
    h.close()
    assert h._prefetcher._pool is None  # the reader thread is gone


def test_pending_writes_are_bounded(tmp_path, monkeypatch):
    from skip_harness.store.writer import StagedInner

    gate = threading.Event()
    real = StagedInner.complete

    def slow_complete(self):  # the writer's part of a write: fsync, rename, meta.json
        gate.wait(10)
        return real(self)

    monkeypatch.setattr(StagedInner, "complete", slow_complete)
    t = Loop()
    h = make(tmp_path, K=4, max_pending_writes=2).wrap(t, dispatch_kwarg=None)
    done = []

    def trainer():
        for _ in range(4):
            t.sample(1)
            done.append(time.monotonic())

    th = threading.Thread(target=trainer)
    th.start()
    time.sleep(0.5)
    assert len(done) == 2  # two handed over (one writing, one queued); the third sample waits
    gate.set()
    th.join(10)
    assert len(done) == 4
    assert h.close().committed == 1


def test_a_step_is_committed_on_the_writer_thread_once_its_writes_are_durable(tmp_path, monkeypatch):
    """One process: the commit follows the step's K writes on the writer thread, with no further call of the
    trainer's (it used to wait for the next prepare_data or sample, and ran beside the next generation)."""
    from skip_harness.store.writer import StepWriter

    committed = []
    real = StepWriter.commit

    def commit(self, step, *a, **kw):
        committed.append((step, threading.current_thread().name))
        return real(self, step, *a, **kw)

    monkeypatch.setattr(StepWriter, "commit", commit)
    t = Loop()
    h = make(tmp_path, K=2).wrap(t, dispatch_kwarg=None)
    t.prepare_data(1)
    t.sample(1)
    t.sample(1)
    record = h.layout.step_dir(1) / "commit.json"
    deadline = time.monotonic() + 10
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert record.exists() and committed == [(1, "skip_harness-writer")]
    assert h.close().committed == 1 and committed == [(1, "skip_harness-writer")]   # committed once


def test_a_write_that_fails_on_the_writer_thread_leaves_its_step_uncommitted(tmp_path, monkeypatch, caplog):
    from skip_harness.store.writer import StagedInner

    real = StagedInner.complete

    def complete(self):
        if self.payload_rel.startswith("1/") and self._step == 1:
            raise OSError(5, "Input/output error")
        return real(self)

    monkeypatch.setattr(StagedInner, "complete", complete)
    t = Loop()
    h = make(tmp_path, K=2).wrap(t, dispatch_kwarg=None)
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        for step in (1, 2):
            t.prepare_data(step)
            t.sample(step)
            t.sample(step)
        summary = h.close()
    assert summary.committed == 1 and not (h.layout.step_dir(1) / "commit.json").exists()
    assert (h.layout.step_dir(2) / "commit.json").exists()
    assert "write failed: OSError" in caplog.text and "commit failed" not in caplog.text


@dataclasses.dataclass
class Custom:
    x: torch.Tensor


def test_merged_serves_repeat_steps_too(tmp_path):
    t = Loop()
    h = make(tmp_path, K=2).wrap(t, dispatch_kwarg=None)
    for _ in range(2):
        t.sample(1)
    h.close()
    t = Loop()
    h = make(tmp_path, K=2, action="repeat").wrap(t, dispatch_kwarg=None)
    t.sample(5)
    t.sample(5)
    assert h.outcome(5) == "repeat"
    assert torch.equal(h.merged(5), torch.tensor([1.0, 1.0, 1.0, 1.0]))
    h.close()


class GlobalSampler:
    """Draws from the global torch generator, as TRL's generation does."""

    def prepare_data(self, step, *, dispatch=True):
        pass

    def sample(self, step):
        return {"x": torch.rand(4)}


def test_repeat_never_rewinds_the_rng_to_another_steps_state(tmp_path):
    def harness(**kw):
        return make(tmp_path, restore_rng=True, **kw).wrap(t)

    t = GlobalSampler()
    torch.manual_seed(0)
    h = harness()
    t.sample(1)
    recorded = torch.get_rng_state()  # what step 1's meta records
    h.close()
    torch.manual_seed(123)
    h = harness(action="repeat")
    before = torch.get_rng_state()
    t.sample(2)  # served step 1's rollouts
    assert h.outcome(2) == "repeat"
    assert torch.equal(torch.get_rng_state(), before) and not torch.equal(before, recorded)
    h.close()
    torch.manual_seed(123)
    h = harness()
    t.sample(1)  # a hit restores the state the miss left
    assert h.outcome(1) == "hit" and torch.equal(torch.get_rng_state(), recorded)
    h.close()


def test_registered_types_round_trip_and_an_unregistered_read_is_a_usage_error_not_corruption(tmp_path):
    from skip_harness import register_type
    from skip_harness.codec import UnregisteredTypeError, unregister_type

    class DataclassLoop(Loop):
        def sample(self, step):
            self.generated += 1
            return Custom(torch.full((3,), float(step)))

    register_type(Custom)
    try:
        for _ in range(2):
            t = DataclassLoop()
            h = make(tmp_path).wrap(t, dispatch_kwarg=None)
            out = t.sample(1)
            h.close()
        assert t.generated == 0 and type(out) is Custom and torch.equal(out.x, torch.full((3,), 1.0))
    finally:
        unregister_type(Custom)
    t = DataclassLoop()
    h = make(tmp_path).wrap(t, dispatch_kwarg=None)
    with pytest.raises(UnregisteredTypeError, match="register_type"):
        t.sample(1)
    h.close()
    assert (h.layout.step_dir(1) / "commit.json").exists()  # never cleaned as if it were corrupt


def test_a_step_loaded_ahead_and_never_asked_for_is_cancelled_at_close(tmp_path):
    t = Loop()
    h = make(tmp_path).wrap(t, dispatch_kwarg=None)
    for s in (1, 2, 3):
        t.sample(s)
    h.close()
    t = Loop()
    h = make(tmp_path).wrap(t, dispatch_kwarg=None)
    t.sample(1)
    t.sample(2)  # served; step 3 is now being loaded ahead
    assert h._prefetcher._ahead[0] == 3
    summary = h.close()  # the trainer stopped early: the load ahead is dropped, nothing is counted for it
    assert h._prefetcher._ahead is None and h._prefetcher._pool is None
    assert (summary.hits, summary.steps) == (2, 2) and t.generated == 0
