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

from skip_harness.store.open import open_store
from skip_harness import SkipHarness
from skip_harness.store.bufferpool import ALIGN, BufferPool, Copier
from skip_harness.store.layout import Layout
from skip_harness.store.stepstore import StepStore


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
    st = open_store(Layout(__import__("pathlib").Path(root), K=1, W=1))
    st.writer.commit(2, st.writer.write_inner(2, 0, 0, payload, {}), None)
    q.put(st.reader.verify(2)[1])


def test_a_forked_child_writes_after_its_parent_copied_and_computed(tmp_path):
    """Copies use the copier's own threads, not torch's OpenMP pool, which hangs in a forked child (the
    child here runs no torch op of its own: those would hang too)."""
    st = open_store(Layout(tmp_path / "ns", K=1, W=1))
    big = {"x": torch.randn(3 << 20)}
    st.writer.commit(1, st.writer.write_inner(1, 0, 0, big, {}), None)     # the parent used the copier...
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


# ---------------------------------------------------------------------- found in review


def test_an_interrupted_copy_waits_for_its_helpers_before_the_buffer_can_go(monkeypatch):
    """The helpers hold only the buffer's address: a Ctrl-C while the caller waits must not let the
    caller release the buffer (and the pool hand it out again) while they still write into it."""
    import threading
    import time as _time
    import types

    from skip_harness.store import bufferpool

    real_memmove = ctypes.memmove

    def memmove(dst, src, n):
        if threading.current_thread().name.startswith("skip_harness-copy"):
            _time.sleep(0.2)
        return real_memmove(dst, src, n)

    calls = []
    real_wait = bufferpool.wait

    def wait(fs):
        calls.append(len(fs))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(fs)

    monkeypatch.setattr(bufferpool, "ctypes", types.SimpleNamespace(memmove=memmove))
    monkeypatch.setattr(bufferpool, "wait", wait)
    copier = Copier(threads=2)
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    with pytest.raises(KeyboardInterrupt):
        copier.copy(dst.data_ptr(), src.data_ptr(), src.numel())
    assert torch.equal(dst, src)              # every part had landed when the interrupt went up
    copier.close()


def test_a_step_that_changes_status_while_read_is_never_served_empty(tmp_path, monkeypatch):
    from skip_harness.store.status import StepReport

    st = open_store(Layout(tmp_path / "ns", K=1, W=1))
    st.writer.commit(1, st.writer.write_inner(1, 0, 0, {"x": torch.ones(3)}, {}), None)
    from skip_harness.store import reader as reader_mod

    real = reader_mod.classify_step
    seen = []

    def status(layout, step, **k):
        seen.append(step)
        report = real(layout, step, **k)
        # incomplete when first looked at, complete again by any later look
        if len(seen) == 1:
            return StepReport(step, report.path, "incomplete", 0, "being rewritten", None, False)
        return report

    monkeypatch.setattr(reader_mod, "classify_step", status)
    got_status, reason, batches, _ = st.reader.read_served(1, 0)
    assert got_status == "incomplete" and reason == "incomplete: being rewritten" and batches == []


def _write_spied(tmp_path, monkeypatch, nbytes, short_at=None):
    """write_buffer_at of `nbytes` patterned bytes, recording each pwrite as (offset, length, direct) and
    every ftruncate; with `short_at`, the first direct write of more than a block reports stopping there."""
    import fcntl

    from skip_harness.store.posix import directio

    pool = BufferPool()
    lease = pool.acquire(nbytes)
    lease.view(nbytes)[:] = (bytes(range(256)) * (nbytes // 256 + 1))[:nbytes]
    writes, truncates = [], []
    real_pwrite, real_truncate = os.pwrite, os.ftruncate

    def spy(fd, data, offset):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        writes.append((offset, len(data), direct))
        n = real_pwrite(fd, data, offset)
        return short_at if short_at is not None and direct and offset == 0 and n > 4096 else n

    monkeypatch.setattr(os, "pwrite", spy)
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: (truncates.append(n), real_truncate(fd, n)))
    out = tmp_path / f"{nbytes}"
    out.mkdir()
    dir_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        directio.write_buffer_at(dir_fd, "f.bin", lease, nbytes)
    finally:
        os.close(dir_fd)
        monkeypatch.undo()
    assert (out / "f.bin").read_bytes() == bytes(lease.view(nbytes))
    return writes, truncates


def test_a_payloads_whole_blocks_go_direct_and_its_tail_through_the_page_cache(tmp_path, monkeypatch):
    """No direct write past the payload, so no truncate: truncating into a block the page cache does not
    hold reads that block back from the disk first (a synchronous read on every payload)."""
    writes, truncates = _write_spied(tmp_path, monkeypatch, 3 * 4096 + 808)
    assert writes == [(0, 3 * 4096, True), (3 * 4096, 808, False)] and truncates == []
    writes, truncates = _write_spied(tmp_path, monkeypatch, 2 * 4096)           # whole blocks: all direct
    assert writes == [(0, 2 * 4096, True)] and truncates == []
    writes, truncates = _write_spied(tmp_path, monkeypatch, 1000)                # less than a block: none direct
    assert writes == [(0, 1000, False)] and truncates == []


def test_a_short_direct_write_is_finished_through_the_page_cache(tmp_path, monkeypatch):
    writes, truncates = _write_spied(tmp_path, monkeypatch, 3 * 4096 + 808, short_at=5100)
    assert writes == [(0, 3 * 4096, True), (5100, 3 * 4096 + 808 - 5100, False)] and truncates == []


def _mapped_in_child(addr: int) -> bool:
    """In a forked child: whether `addr` lies in one of its mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def _fork_and_look(addr: int) -> bool:
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _mapped_in_child(addr) else 3)
    return os.waitpid(pid, 0)[1] == 0


def test_a_fork_during_direct_io_neither_waits_nor_gets_the_buffer(tmp_path, monkeypatch):
    """Pool buffers are private memory: on older kernels a fork during direct I/O into one can leave the
    parent stale bytes. A buffer in flight is left out of forks (MADV_DONTFORK for the transfer's
    window), so a fork (a DataLoader worker starting) never waits for the disk; after the transfer
    forks get the buffer again, and the bytes written and read back are the parent's."""
    import ctypes
    import threading
    import time as _time

    from skip_harness.store.posix import directio

    pool = BufferPool()
    lease = pool.acquire(1 << 20)
    lease.view()[:] = bytes(range(256)) * 4096
    addr = ctypes.addressof(lease.array)
    events, seen, real = [], {}, os.pwrite
    started, forked = threading.Event(), threading.Event()

    def slow(fd, data, offset):
        events.append("io start")
        started.set()
        forked.wait(10)
        _time.sleep(0.05)
        n = real(fd, data, offset)
        events.append("io end")
        return n

    monkeypatch.setattr(os, "pwrite", slow)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    t = threading.Thread(target=directio.write_buffer_at, args=(dir_fd, "f.bin", lease, 1 << 20))
    t.start()
    started.wait(5)
    seen["during"] = _fork_and_look(addr)
    events.append("forked")
    forked.set()
    t.join()
    os.close(dir_fd)
    monkeypatch.setattr(os, "pwrite", real)
    assert events == ["io start", "forked", "io end"]           # the fork did not wait for the transfer
    assert seen["during"] is False                               # ...and the child did not get the buffer
    assert _fork_and_look(addr) is True                          # after it, forks get it again
    assert (tmp_path / "f.bin").read_bytes() == bytes(lease.view())
    got, n = directio.read_into(str(tmp_path / "f.bin"), pool)
    assert n == 1 << 20 and bytes(got.view(n)) == bytes(lease.view()) and _fork_and_look(ctypes.addressof(got.array))



@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sizes", [(), (0,), (3, 100_000), (5_000_001, 7, 0, 4_194_305), (40_000_000,)])
def test_copying_and_hashing_at_once_hashes_exactly_the_file_it_copies(threads, sizes):
    """`pack_parts` + `Copier.copy_hashed` (a miss's staging: the copy on this thread, the hash of the
    sources on a helper that then takes copy work from the far end) give the same buffer as `pack_into`
    and the xxh3-128 of that buffer, byte for byte -- small and large, contiguous or not, empty tensors,
    odd lengths (padding between them), one core or two."""
    from skip_harness import codec
    from skip_harness.codec import tensorfile
    from skip_harness.store.checksum import checksum_bytes, hasher

    g = torch.Generator().manual_seed(len(sizes) * 7 + threads)
    payload = {f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) for i, n in enumerate(sizes)}
    payload["strided"] = torch.randn(64, 48, generator=g).t()            # copied by torch, hashed from the buffer
    payload["bf16"] = torch.randn(3, 1000, generator=g).to(torch.bfloat16)
    payload["messages"] = [{"role": "user", "content": "hi"}] * 3
    image = codec.plan(payload)
    pool = BufferPool()
    pool.copier = Copier(threads)
    reference, staged = pool.acquire(image.nbytes), pool.acquire(image.nbytes)
    ctypes.memset(address(staged), 0xAB, staged.capacity)                  # no byte left from before counts
    tensorfile.pack_into(image, reference.array, Copier(1).copy)
    copies, pieces = tensorfile.pack_parts(image, staged.array)
    digest = pool.copier.copy_hashed(copies, pieces, hasher())
    assert bytes(staged.view(image.nbytes)) == bytes(reference.view(image.nbytes))
    assert digest == checksum_bytes(reference.view(image.nbytes))
    assert sum(len(memoryview(p).cast("B")) for p in pieces) == image.nbytes
    reference.release(), staged.release()
    pool.close()
