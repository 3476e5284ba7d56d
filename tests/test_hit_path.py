"""What a hit costs the trainer's thread: with prefetch on, serving a step that was loaded ahead asks
the storage nothing more there -- no listing, no commit record, no file opened (the reader thread
classified the step once and its size came with the load) -- and the step's size is still the one
`ls` shows. Watched at the os calls, so the check holds whatever the store's modules are called."""
from __future__ import annotations

import os
import threading

import torch

from skip_harness.store.open import open_store
from skip_harness import SkipHarness
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


def test_serving_a_prefetched_hit_touches_no_file_on_the_trainers_thread(tmp_path, monkeypatch):
    t = Trainer()
    h = make(tmp_path).wrap(t)
    for s in range(1, 5):                            # records steps 1-4
        t.prepare_data(s)
        t.sample(s)
    h.close()

    calls, watching = [], threading.Event()
    trainer_thread = threading.current_thread()

    def spy(real):
        def call(*args, **kwargs):
            if watching.is_set() and threading.current_thread() is trainer_thread:
                calls.append((real.__name__, args[0] if args else None))
            return real(*args, **kwargs)
        return call

    for name in ("open", "scandir", "stat", "lstat", "listdir"):
        monkeypatch.setattr(os, name, spy(getattr(os, name)))
    t = Trainer()
    h = make(tmp_path).wrap(t)
    t.prepare_data(1)
    t.sample(1)                                      # step 1 is read on the trainer's thread: nothing was ahead
    watching.set()
    for s in (2, 3, 4):                              # loaded ahead while the step before trained
        t.prepare_data(s)
        t.sample(s)
    watching.clear()
    summary = h.close()
    assert t.generated == 0 and summary.hits == 4
    assert calls == [], f"the trainer's thread reached the storage while serving prefetched hits: {calls}"
    # the size each hit reports is still the step's size on disk, as `ls` counts it
    store = open_store(h.layout)
    assert summary.bytes_read == sum(store.status(s).bytes for s in range(1, 5))
