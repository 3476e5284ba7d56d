"""The harness against a small trainer with real tensors and a real cache in tmp_path."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch

from skip_harness.store.open import open_namespace, open_store
from skip_harness.run.callbacks import HarnessCallback
from skip_harness.config import RolloutTQConfig
from skip_harness.errors import FingerprintMismatchError, HarnessUsageError
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.run.harness import SkipHarness
from skip_harness.run.settings import RunSettings
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.scan import scan_namespace
from skip_harness.store.stepstore import StepStore
from skip_harness.store.writer import StepWriter


class Trainer:
    """Records what the harness lets through. Each mini-batch depends on (tag, step, inner index)."""

    def __init__(self, tag: int = 0):
        self.tag = tag
        self.prepared, self.dispatched, self.generated = [], [], []
        self.calls = Counter()

    def prepare_data(self, step, *, dispatch=True, validate=False):
        self.prepared.append((step, validate))
        if dispatch:
            self.dispatched.append(step)

    def sample(self, step, *, validate=False):
        i = self.calls[(step, validate)]
        self.calls[(step, validate)] += 1
        self.generated.append((step, i, validate))
        g = torch.Generator().manual_seed(1000 * self.tag + 10 * step + i)
        return {"x": torch.randn(4, 3, generator=g), "ids": torch.arange(4) + step, "where": (step, i)}


def make(tmp_path, K=1, trainer=None, fingerprint=None, callbacks=(), **kw):
    settings = RolloutTQConfig(enable=True, dump_dir=str(tmp_path / "cache"), **kw)
    key = NamespaceKey("exp", "proj", 8, 2, 4, 4, K=K, W=1)
    h = SkipHarness(RunSettings(settings, key, fingerprint=fingerprint or Fingerprint({"seed": 0})), callbacks=callbacks)
    t = trainer or Trainer()
    h.wrap(t)
    return h, t


def run_steps(h, t, steps, K):
    out = {}
    for s in steps:
        t.prepare_data(s)
        out[s] = [t.sample(s) for _ in range(K)]
    h.close()
    return out


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("K", [1, 3])
def test_first_run_misses_rerun_hits_same_batches(tmp_path, K, caplog):
    h, t = make(tmp_path, K)
    first = run_steps(h, t, [1, 2, 3], K)
    assert t.dispatched == [1, 2, 3] and len(t.generated) == 3 * K
    assert [h.outcome(s) for s in (1, 2, 3)] == ["miss"] * 3
    report = scan_namespace(h.layout, open_namespace(h.layout))
    assert [s.status for s in report.steps] == ["complete"] * 3

    h2, t2 = make(tmp_path, K, trainer=Trainer(tag=7))  # a different generator would give other data
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        second = run_steps(h2, t2, [1, 2, 3], K)
    assert f"step 3: hit, K={K}" in caplog.text  # committed steps are verified hits, not "unverified"
    assert t2.generated == [] and t2.dispatched == []
    assert [p for p, _ in t2.prepared] == [1, 2, 3]  # the data stream still advances
    assert [h2.outcome(s) for s in (1, 2, 3)] == ["hit"] * 3
    for s in (1, 2, 3):
        for a, b in zip(first[s], second[s]):
            assert same(a, b)
    summary = h2.close()
    assert (summary.hits, summary.misses, summary.bytes_read > 0) == (3, 0, True)


def test_k1_layout_is_the_legacy_one(tmp_path):
    h, t = make(tmp_path, 1)
    run_steps(h, t, [1], 1)
    step_dir = h.layout.step_dir(1)
    assert sorted(p.name for p in step_dir.iterdir()) == ["commit.json", "meta.json", "tq_batch.pt"]


def test_more_than_k_samples_is_an_error(tmp_path):
    h, t = make(tmp_path, 2)
    t.prepare_data(1)
    t.sample(1), t.sample(1)
    with pytest.raises(HarnessUsageError, match="more than K = 2"):
        t.sample(1)
    h.close()


def test_short_step_is_not_committed_and_warned(tmp_path, caplog):
    h, t = make(tmp_path, 3)
    t.prepare_data(1)
    t.sample(1)
    t.sample(1)
    t.prepare_data(2)
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        for _ in range(3):
            t.sample(2)
        h.close()
    assert "after 2 of K = 3" in caplog.text
    statuses = {s.step: s.status for s in scan_namespace(h.layout, open_namespace(h.layout)).steps}
    assert statuses == {1: "incomplete", 2: "complete"}


def test_written_batch_is_what_sample_returned_even_if_changed_in_place(tmp_path):
    h, t = make(tmp_path, 1)
    t.prepare_data(1)
    batch = t.sample(1)
    original = batch["x"].clone()
    batch["x"].add_(100.0)
    h.close()
    stored = open_store(h.layout).reader.read_inner(1, 0, 0)
    assert torch.equal(stored["x"], original)


def test_validation_calls_and_unlisted_steps_are_untouched(tmp_path):
    h, t = make(tmp_path, 1, steps=[2])
    t.prepare_data(1, validate=True)
    t.sample(1, validate=True)
    t.prepare_data(1)
    t.sample(1)
    t.prepare_data(2)
    t.sample(2)
    h.close()
    assert h.outcome(1) == "off" and h.outcome(2) == "miss"
    assert [s.step for s in scan_namespace(h.layout, open_namespace(h.layout)).steps] == [2]
    assert (1, 0, True) in t.generated


def test_mixed_steps_then_full_rerun(tmp_path):
    h, t = make(tmp_path, 2, steps=[1, 3])
    run_steps(h, t, [1, 2, 3], 2)
    h2, t2 = make(tmp_path, 2)
    run_steps(h2, t2, [1, 2, 3, 4], 2)
    assert [h2.outcome(s) for s in (1, 2, 3, 4)] == ["hit", "miss", "hit", "miss"]
    assert sorted({s for s, _, _ in t2.generated}) == [2, 4]


def test_repeat_serves_nearest_complete_step(tmp_path, caplog):
    h, t = make(tmp_path, 1)
    run_steps(h, t, [2], 1)
    h2, t2 = make(tmp_path, 1, action="repeat")
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        out = run_steps(h2, t2, [1, 2, 3], 1)
    assert t2.generated == []
    assert [h2.outcome(s) for s in (1, 2, 3)] == ["repeat", "hit", "repeat"]
    assert out[1][0]["where"] == (2, 0) and out[3][0]["where"] == (2, 0)
    assert "step 3: repeat (served step 2)" in caplog.text


def test_repeat_with_nothing_cached_behaves_as_cache(tmp_path):
    h, t = make(tmp_path, 1, action="repeat")
    run_steps(h, t, [1, 2], 1)
    # step 1 was written, so step 2 repeats it only if it was not generated: it was the first step's
    # miss that made step 1 servable, and step 2 then repeats it.
    assert h.outcome(1) == "miss"
    assert h.outcome(2) == "repeat"


def test_corrupt_payload_is_warned_and_regenerated_whole(tmp_path, caplog):
    h, t = make(tmp_path, 2)
    run_steps(h, t, [1], 2)
    path = h.layout.payload_path(1, 1, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    h2, t2 = make(tmp_path, 2)
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        run_steps(h2, t2, [1], 2)
    assert h2.outcome(1) == "miss"
    assert str(h2.layout.step_dir(1)) in caplog.text
    assert [(s, i) for s, i, _ in t2.generated] == [(1, 0), (1, 1)]
    assert open_store(h2.layout).reader.verify(1)[1] is None


def test_stale_partial_step_is_cleaned_and_never_served(tmp_path):
    """An older run left step 1 with inner 0 only (other data): it is cleaned, then regenerated whole."""
    stale = Trainer(tag=99)
    h, t = make(tmp_path, 3, trainer=stale)
    t.prepare_data(1)
    t.sample(1)
    h.flush()
    # the process dies here: no close, no commit. Simulate by dropping the harness's lock.
    h._startup.release()
    h2, t2 = make(tmp_path, 3)
    out = run_steps(h2, t2, [1], 3)
    assert [(s, i) for s, i, _ in t2.generated] == [(1, 0), (1, 1), (1, 2)]
    g = torch.Generator().manual_seed(10 * 1 + 0)
    assert torch.equal(out[1][0]["x"], torch.randn(4, 3, generator=g))
    assert torch.equal(open_store(h2.layout).reader.read_inner(1, 0, 0)["x"], out[1][0]["x"])


@pytest.mark.parametrize("cleanup", ["off", "quarantine"])
def test_cleanup_off_and_quarantine_rewrite_from_inner_zero(tmp_path, cleanup):
    h, t = make(tmp_path, 2, trainer=Trainer(tag=5))
    t.prepare_data(1)
    t.sample(1)
    h.flush()
    h._startup.release()
    h2, t2 = make(tmp_path, 2, cleanup=cleanup)
    out = run_steps(h2, t2, [1], 2)
    assert h2.outcome(1) == "miss"
    stored = open_store(h2.layout).reader.read_inner(1, 0, 0)
    assert torch.equal(stored["x"], out[1][0]["x"])
    quarantined = list(h2.layout.quarantine_dir.glob("*")) if h2.layout.quarantine_dir.exists() else []
    assert len(quarantined) == (1 if cleanup == "quarantine" else 0)


def test_fingerprint_mismatch_stops_before_any_work(tmp_path):
    h, t = make(tmp_path, 1, fingerprint=Fingerprint({"seed": 0, "mode": "sync"}))
    run_steps(h, t, [1, 2], 1)
    h2, t2 = make(tmp_path, 1, fingerprint=Fingerprint({"seed": 1, "mode": "sync"}))
    with pytest.raises(FingerprintMismatchError) as err:
        h2.start()
    msg = str(err.value)
    assert "seed" in msg and "mode" not in msg.split("another config:")[1].split(".")[0]
    assert "trainer.experiment_name" in msg and "on_mismatch=regenerate" in msg
    assert t2.prepared == [] and t2.generated == []
    # the lock was released: regenerate works right away and replaces the steps as they come
    h3, t3 = make(tmp_path, 1, fingerprint=Fingerprint({"seed": 1, "mode": "sync"}), on_mismatch="regenerate")
    run_steps(h3, t3, [1], 1)
    assert h3.outcome(1) == "miss"
    statuses = {s.step: s.fingerprint.values["seed"] for s in scan_namespace(h3.layout, open_namespace(h3.layout)).steps}
    assert statuses == {1: 1, 2: 0}


def test_failed_write_warns_and_training_goes_on(tmp_path, caplog, monkeypatch):
    h, t = make(tmp_path, 1)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StepWriter, "stage_inner", boom)
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        out = run_steps(h, t, [1, 2], 1)
    assert len(out) == 2 and "No space left on device" in caplog.text
    assert scan_namespace(h.layout, open_namespace(h.layout)).steps == ()


def test_restore_rng_leaves_the_process_as_a_miss_would(tmp_path):
    class GlobalRngTrainer(Trainer):
        def sample(self, step, *, validate=False):
            self.generated.append(step)
            return {"x": torch.rand(3)}  # draws from the global generator

    def run(h, t):
        torch.manual_seed(0)
        draws = []
        for s in (1, 2):
            t.prepare_data(s)
            t.sample(s)
            draws.append(torch.rand(1).item())  # training-side randomness after generation
        h.close()
        return draws

    h, t = make(tmp_path, 1, trainer=GlobalRngTrainer(), restore_rng=True)
    first = run(h, t)
    h2, t2 = make(tmp_path, 1, trainer=GlobalRngTrainer(), restore_rng=True)
    second = run(h2, t2)
    assert t2.generated == [] and first == second
    (tmp_path / "b").mkdir()
    h3, t3 = make(tmp_path / "b", 1, trainer=GlobalRngTrainer())
    run(h3, t3)
    h4, t4 = make(tmp_path / "b", 1, trainer=GlobalRngTrainer())
    assert run(h4, t4) != first  # without restore_rng a hit drifts


def test_unwrap_restores_the_trainer(tmp_path):
    t = Trainer()
    original = t.sample
    h, _ = make(tmp_path, 1, trainer=t)
    assert t.sample is not original
    h.unwrap()
    assert t.sample == original and "sample" not in vars(t)


def test_callbacks_observe_events(tmp_path):
    class Recorder(HarnessCallback):
        def __init__(self):
            self.events = []

        def on_step_start(self, *, step, decision, **kw):
            self.events.append(("start", step, decision.kind))

        def on_write(self, *, step, inner_index, **kw):
            self.events.append(("write", step, inner_index))

        def on_commit(self, *, step, **kw):
            self.events.append(("commit", step))

        def on_serve(self, *, step, inner_index, **kw):
            self.events.append(("serve", step, inner_index))

    rec = Recorder()
    h, t = make(tmp_path, 2, callbacks=[rec])
    run_steps(h, t, [1], 2)
    assert rec.events == [("start", 1, "miss"), ("write", 1, 0), ("write", 1, 1), ("commit", 1)]
    rec2 = Recorder()
    h2, t2 = make(tmp_path, 2, callbacks=[rec2])
    run_steps(h2, t2, [1], 2)
    assert rec2.events == [("start", 1, "hit"), ("serve", 1, 0), ("serve", 1, 1)]


def test_logging_lines(tmp_path, caplog):
    h, t = make(tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        run_steps(h, t, [1], 2)
    text = caplog.text
    assert "rollout cache" in text and "0 complete" in text
    assert "step 1: miss, K=2" in text
    assert "1 miss (" in text and "1 misses" not in text


@pytest.mark.parametrize("legacy_dir", ["", "0/"])
def test_legacy_cache_without_commit_is_served_as_unverified(tmp_path, caplog, legacy_dir):
    """A verl-era cache: {step}/tq_batch.pt (or {step}/0/tq_batch.pt) + meta.json, no commit record."""
    key = NamespaceKey("exp", "proj", 8, 2, 4, 4)
    step_dir = key.layout(tmp_path / "cache").step_dir(1) / legacy_dir
    step_dir.mkdir(parents=True)
    batch = {"x": torch.randn(4, 3), "ids": torch.arange(4)}
    torch.save(batch, step_dir / "tq_batch.pt")
    (step_dir / "meta.json").write_text('{"global_steps": 1}')
    h, t = make(tmp_path, 1)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        again = run_steps(h, t, [1, 2], 1)
    assert h.outcome(1) == "hit" and h.outcome(2) == "miss"
    assert [s for s, _, _ in t.generated] == [2]
    assert same(batch, again[1][0])
    assert "1 unverified" in caplog.text and "step 1: hit (unverified" in caplog.text


@pytest.mark.slow  # a second process
def test_a_namespace_held_by_another_process_is_read_beside_it(tmp_path):
    """Another live run holds the namespace: this one reads beside it (serves what is committed, writes
    nothing) instead of stopping, after waiting lock_timeout seconds for the hold."""
    h, t = make(tmp_path, 1)
    h.start()
    code = textwrap.dedent(
        f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from skip_harness.config import RolloutTQConfig
        from skip_harness.run.harness import SkipHarness
        from skip_harness.store.fingerprint import Fingerprint
        from skip_harness.store.layout import NamespaceKey
        s = RolloutTQConfig(enable=True, dump_dir={str(tmp_path / 'cache')!r}, lock_timeout=0.5)
        from skip_harness.run.settings import RunSettings
        h = SkipHarness(RunSettings(s, NamespaceKey("exp", "proj", 8, 2, 4, 4), fingerprint=Fingerprint({{"seed": 0}})))
        h.start()
        print("reader", h._startup.reader)
        h.close()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    h.close()
    assert proc.returncode == 0, proc.stderr
    import os

    assert "reader True" in proc.stdout and f"read beside pid {os.getpid()}" in proc.stdout, proc.stdout


def test_merged_step_concatenates_inner_batches_in_order(tmp_path):
    h, t = make(tmp_path, 3)
    out = run_steps(h, t, [1], 3)
    merged = h.merged(1)
    assert torch.equal(merged["x"], torch.cat([b["x"] for b in out[1]]))
    assert torch.equal(merged["ids"], torch.cat([b["ids"] for b in out[1]]))
