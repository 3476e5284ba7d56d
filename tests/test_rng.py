"""rng: the global generators' record is JSON-able data, restore puts torch / numpy / python back exactly,
and the CUDA generators of every device are in it when CUDA is in use (exercised here with a stand-in
for torch.cuda; scripts/gpu_check.py does it on a real device)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from skip_harness.run import rng


def draws():
    return (torch.rand(5).tolist(), torch.randint(0, 1000, (3,)).tolist(), np.random.rand(3).tolist(),
            np.random.normal(size=2).tolist(), random.random(), random.gauss(0, 1))


def test_record_is_json_and_holds_no_code():
    state = rng.capture()
    text = json.dumps(state)
    assert json.loads(text) == state
    assert set(state) >= {"torch", "python", "numpy"}

    def plain(x):
        return x is None or isinstance(x, (str, int, float, bool)) or (
            isinstance(x, (list, dict)) and all(plain(v) for v in (x.values() if isinstance(x, dict) else x)))

    assert plain(state)


@pytest.mark.parametrize("through_json", [False, True])
def test_restore_leaves_every_generator_exactly_as_captured(through_json):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    random.gauss(0, 1)            # python keeps a cached gaussian: part of the state
    np.random.normal()            # numpy too
    state = rng.capture()
    if through_json:
        state = json.loads(json.dumps(state))
    expected = draws()
    after_first = rng.capture()
    draws(), draws()              # move everything on
    rng.restore(state)
    assert rng.capture() == state
    assert draws() == expected
    assert rng.capture() == after_first


def test_record_without_cuda_leaves_cuda_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = rng.capture()
    assert "cuda" not in state
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: pytest.fail("touched CUDA"))
    rng.restore(state)
    rng.restore({**state, "cuda": ["AAAA"]})    # recorded on a GPU machine, restored without CUDA: skipped


class FakeCuda:
    """Two CUDA devices' generators, as torch.cuda exposes them."""

    def __init__(self, initialised=True):
        self.initialised = initialised
        self.states = [torch.tensor([1, 2, 3, 4], dtype=torch.uint8), torch.tensor([9, 8, 7, 6], dtype=torch.uint8)]
        self.set_calls = []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialised)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=0: self.states[int(device)].clone())

        def set_rng_state(state, device=0):
            self.set_calls.append(int(device))
            self.states[int(device)] = state.clone()

        monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
        return self


def test_every_cuda_device_is_recorded_and_restored(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    state = json.loads(json.dumps(rng.capture()))
    assert len(state["cuda"]) == 2
    cuda.states = [torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    rng.restore(state)
    assert sorted(cuda.set_calls) == [0, 1]
    assert cuda.states[0].tolist() == [1, 2, 3, 4] and cuda.states[1].tolist() == [9, 8, 7, 6]


def test_cuda_not_initialised_is_not_touched(monkeypatch):
    cuda = FakeCuda(initialised=False).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=0: pytest.fail("would create CUDA contexts"))
    assert "cuda" not in rng.capture()
    assert cuda.set_calls == []


def test_fewer_devices_than_recorded_restores_those_present(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    state = rng.capture()
    cuda.states = cuda.states[:1]
    rng.restore(state)
    assert cuda.set_calls == [0]
