"""What a hit costs the trainer's thread: with prefetch on, serving a step that was loaded ahead asks
the storage nothing more there -- no listing, no commit record (the reader thread classified the
step once and its size came with the load) -- and the step's size is still the one `ls` shows."""
from __future__ import annotations

import threading

import torch

from skip_harness import SkipHarness
from skip_harness.store import status as status_mod
from skip_harness.store.stepstore import StepStore


class Trainer:
    def __init__(self):
        self.generated = 0

    def prepare_data(self, step, dispatch=True):
        pass

    def sample(self, step):
        self.generated += 1
        return {"ids": torch.arange(64 * step).reshape(-1, 8), "text": [f"s{step}"] * 3}


def make(tmp_path):
    return SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c"), "prefetch": True},
                              namespace={"experiment_name": "e", "project_name": "p", "n": 1})


def run(tmp_path, steps=4):
    t = Trainer()
    h = make(tmp_path).wrap(t)
    for s in range(1, steps + 1):
        t.prepare_data(s)
        t.sample(s)
    summary = h.close()
    return h, t, summary


def test_serving_a_prefetched_hit_lists_nothing_on_the_trainers_thread(tmp_path, monkeypatch):
    run(tmp_path)                                   # records steps 1-4
    classified = []
    real = status_mod.classify_step

    def classify_step(layout, step, *args, **kwargs):
        classified.append((step, threading.current_thread().name))
        return real(layout, step, *args, **kwargs)

    monkeypatch.setattr(status_mod, "classify_step", classify_step)
    monkeypatch.setattr("skip_harness.store.stepstore.classify_step", classify_step)
    monkeypatch.setattr("skip_harness.store.reader.classify_step", classify_step)
    h, t, summary = run(tmp_path)
    assert t.generated == 0 and summary.hits == 4
    on_trainer = [s for s, name in classified if not name.startswith("skip_harness-prefetch") and s > 1]
    assert on_trainer == [], f"steps classified on the trainer's thread while served: {on_trainer}"
    assert sorted(s for s, _ in classified if s > 1) == [2, 3, 4]       # once each, ahead
    # the size each hit reports is the step's size on disk, as `ls` counts it
    store = StepStore(h.layout)
    assert summary.bytes_read == sum(store.status(s).bytes for s in range(1, 5))
