"""The buffers payloads are staged in and read into: reused, never while anything still uses them,
bounded; the copier; and what that means for a harness serving hits (the served tensors view pool
memory, so holding on to them must keep them intact)."""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os

import pytest
import torch

from skip_harness import SkipHarness
from skip_harness.bufferpool import ALIGN, BufferPool, Copier
from skip_harness.layout import Layout
from skip_harness.store import StepStore


def address(lease) -> int:
    return ctypes.addressof(lease.array)


def test_a_buffer_is_reused_only_once_nothing_made_from_it_is_alive():
    pool = BufferPool(max_free=2)
    lease = pool.acquire(10_000)
    first = address(lease)
    assert first % ALIGN == 0 and lease.capacity >= 10_000
    t = torch.frombuffer(lease.array, dtype=torch.uint8, count=100)
    lease.release()
    del lease
    gc.collect()
    other = pool.acquire(10_000)           # the tensor still views the first buffer: a new one
    assert address(other) != first and pool.allocated == 2
    del t
    gc.collect()
    again = pool.acquire(10_000)
    assert address(again) == first and pool.allocated == 2


def test_idle_buffers_are_bounded_and_close_drops_them():
    pool = BufferPool(max_free=2)
    leases = [pool.acquire(1 << 20) for _ in range(4)]
    del leases
    gc.collect()
    assert pool.idle == 2
    big = pool.acquire(3 << 20)            # no idle buffer is large enough: a new one
    assert big.capacity >= 3 << 20 and pool.allocated == 5
    pool.close()
    assert pool.idle == 0
    del big
    gc.collect()
    assert pool.idle == 0                  # a closed pool keeps nothing


@pytest.mark.parametrize("nbytes", [1, 4095, (8 << 20) - 1, 8 << 20, (20 << 20) + 3])
def test_copier_copies_every_byte(nbytes):
    copier = Copier(threads=3)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 2, dtype=torch.uint8)
    copier.copy(dst.data_ptr() + 1, src.data_ptr(), nbytes)
    copier.close()
    assert torch.equal(dst[1:-1], src) and dst[0] == 0 and dst[-1] == 0


def _write_in_child(root: str, payload, q) -> None:
    st = StepStore(Layout(__import__("pathlib").Path(root), K=1, W=1))
    st.commit(2, st.write_inner(2, 0, 0, payload, {}), None)
    q.put(st.verify(2))


def test_a_forked_child_writes_after_its_parent_copied_and_computed(tmp_path):
    """Copies use the copier's own threads, not torch's OpenMP pool, which hangs in a forked child (the
    child here runs no torch op of its own: those would hang too)."""
    st = StepStore(Layout(tmp_path / "ns", K=1, W=1))
    big = {"x": torch.randn(3 << 20)}
    st.commit(1, st.write_inner(1, 0, 0, big, {}), None)     # the parent used the copier...
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))   # ...and torch's intra-op threads
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_write_in_child, args=(str(tmp_path / "ns"), {"x": torch.arange(float(3 << 20))}, q))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child hung writing a payload")
    assert proc.exitcode == 0 and q.get(timeout=5) is None


class Loop:
    def __init__(self):
        self.generated = 0

    def sample(self, step):
        self.generated += 1
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(1 << 18, generator=g), "y": torch.randint(0, 9, (3, 5), generator=g), "s": step}


def expected(step):
    return Loop().sample(step)


def test_served_batches_stay_intact_while_held_and_buffers_are_reused_once_dropped(tmp_path):
    settings = {"enable": True, "dump_dir": str(tmp_path / "cache")}
    namespace = {"experiment_name": "pool", "project_name": "t"}
    steps = range(1, 9)
    first = Loop()
    h = SkipHarness.create(settings, namespace=namespace).wrap(first, prepare_data=None)
    h.start()
    for s in steps:
        first.sample(s)
    h.close()

    held, trainer = [], Loop()
    h = SkipHarness.create(settings, namespace=namespace).wrap(trainer, prepare_data=None)
    h.start()
    for s in steps:
        batch = trainer.sample(s)
        held.append(batch)                 # a trainer that keeps every batch: no buffer may be reused
    pool = h._runner.store.pool
    h.close()
    assert trainer.generated == 0
    for s, batch in zip(steps, held):
        want = expected(s)
        assert torch.equal(batch["x"], want["x"]) and torch.equal(batch["y"], want["y"]) and batch["s"] == s
    held[0]["x"].fill_(7.0)                # served tensors are the trainer's to change
    assert pool.allocated >= len(steps)

    trainer = Loop()
    h = SkipHarness.create(settings, namespace=namespace).wrap(trainer, prepare_data=None)
    h.start()
    for s in steps:
        batch = trainer.sample(s)          # dropped after each step: a few buffers go round
        assert torch.equal(batch["x"], expected(s)["x"])
        del batch
    pool = h._runner.store.pool
    h.close()
    assert trainer.generated == 0 and pool.allocated <= 3
