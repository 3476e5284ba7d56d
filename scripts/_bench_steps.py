"""The benchmark's training-step arms (scripts/bench.py): a trainer's step with caching off, a miss
written asynchronously or in the step, a hit, verl's torch.save, the durable-copy floor of a miss and
the page-cache floor of a hit -- all open at once and taking turns step by step, so a machine whose
load changes slows every arm alike."""
from __future__ import annotations

import ctypes
import math
import statistics
from concurrent.futures import Future
import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from _benchlib import (
    COMPUTE_FACTOR, ZSTD_LEVEL, BenchError, Compute, SyntheticTrainer, _split_mode, iter_tensors, log, make_harness, median,
    run_training_block, tensor_bytes, touch,
)

from skip_harness import codec
from skip_harness.run.coordinator import _lower_priority
from skip_harness.store.layout import Layout

_MADV_POPULATE_READ = 22      # Linux >= 5.14: map a file's cached pages now, read-only (no copy-on-write)


class StepArm:
    """One arm of the training-step comparison, open throughout. `produce(step)` is the arm's
    prepare_data + sample (with whatever write it does inside the step), timed together with touching
    the batch and the compute; `settle(step)` then finishes, untimed, what the step left in flight, so
    that no arm's write runs into another arm's step. CPU seconds are every thread's, writes included."""

    mode = ""

    def __init__(self) -> None:
        self.times: List[float] = []
        self.cpu: List[float] = []
        self.flush_s: List[float] = []

    def produce(self, step: int) -> Any:
        raise NotImplementedError

    def settle(self, step: int) -> None:
        pass

    def step(self, step: int, compute: Compute) -> None:
        c0 = time.process_time()
        t0 = time.perf_counter()
        batch = self.produce(step)
        touch(batch)
        compute.run()
        self.times.append(time.perf_counter() - t0)
        del batch
        t1 = time.perf_counter()
        self.settle(step)
        self.flush_s.append(time.perf_counter() - t1)
        self.cpu.append(time.process_time() - c0)

    def close(self, steps: int) -> None:
        pass


class FloorArm(StepArm):
    """The physical floor of any durable miss, side by side with the harness: each step's batch copied
    once into a reused buffer on the trainer's thread (the copy a write needs before the trainer may
    change its batch, by the same copier the store uses), then written and fsynced on a background
    thread with O_DIRECT, straight from that buffer -- no checksum, no meta.json, no commit record,
    no directory work. The thread runs at the harness's writer thread's niceness. Labelled `floor` in
    the results."""

    mode = "floor"

    def __init__(self, payload: Any, dump_dir: Path, zstd_level: Optional[int] = None):
        from concurrent.futures import ThreadPoolExecutor

        from skip_harness.store.bufferpool import BufferPool, round_up

        super().__init__()
        self.dir = dump_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trainer = SyntheticTrainer(payload)
        self.nbytes = tensor_bytes(payload)
        self.fields = [(t.dtype, t.numel()) for t in iter_tensors(payload)]
        self.zstd_level = zstd_level
        self.buffers = BufferPool(max_free=3)
        self.round_up = round_up
        # scheduled as the harness's writer thread is (nice +10, run.coordinator): the floor is the same work
        # done bare, not the same work given more of the cores than the harness gives its own
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="bench-floor-writer", initializer=_lower_priority)
        self.future: Optional[Future] = None
        self.written = 0

    def _compressed(self, lease: Any) -> Any:
        """The floor of a compressed miss (`floor_zstd`): the copied bytes of each tensor narrowed to its
        narrowest integer dtype and compressed at the same zstd level in the same chunks as the store's
        (`compression._compress_chunks`, one thread), the frames gathered into a second buffer. Nothing the
        store adds on top: no rows stored once, no byte shuffling, no header."""
        import zstandard

        from skip_harness.codec.compression import _compress_chunks, narrowest_dtype

        cctx = zstandard.ZstdCompressor(level=self.zstd_level, write_checksum=True)
        frames, off = [], 0
        for dtype, n in self.fields:
            t = torch.frombuffer(lease.array, dtype=dtype, count=n, offset=off) if n else torch.empty(0, dtype=dtype)
            off += n * dtype.itemsize
            if n:
                frames += _compress_chunks(cctx, t, narrowest_dtype(t), 1 << 22)[0]
        nbytes = sum(len(f) for f in frames)
        out = self.buffers.acquire(nbytes)
        base, pos = ctypes.addressof(out.array), 0
        for f in frames:
            ctypes.memmove(base + pos, f, len(f))
            pos += len(f)
        lease.release()
        return out, nbytes

    def _write(self, lease: Any, step: int) -> None:
        nbytes = self.nbytes
        if self.zstd_level is not None:
            lease, nbytes = self._compressed(lease)
        fd = os.open(self.dir / f"{step}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            view, end, done = lease.view(), self.round_up(nbytes), 0
            while done < end:
                done += os.pwrite(fd, view[done:end], done)
            os.fsync(fd)
        finally:
            os.close(fd)
            lease.release()
        self.written += 1

    def produce(self, step: int) -> Any:
        batch = self.trainer.sample(step)
        lease = self.buffers.acquire(self.nbytes)
        base, off = ctypes.addressof(lease.array), 0
        for t in iter_tensors(batch):
            n = t.numel() * t.element_size()
            self.buffers.copier.copy(base + off, t.data_ptr(), n)
            off += n
        self.future = self.pool.submit(self._write, lease, step)
        return batch

    def settle(self, step: int) -> None:
        self.future.result()

    def close(self, steps: int) -> None:
        self.pool.shutdown(wait=True)
        self.buffers.close()
        if self.written != steps:
            raise BenchError(f"floor writes: {self.written} of {steps} were written")


class AheadArm(StepArm):
    """A floor arm that loads each step's batch one step ahead on a background thread, as the harness
    prefetches: a subclass sets `steps` (the steps it can load) and implements `_load(step)`."""

    label = "floor"

    def __init__(self, steps: Iterable[int], thread_name: str):
        from concurrent.futures import ThreadPoolExecutor

        super().__init__()
        self.steps = set(steps)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.ahead: Dict[int, Any] = {}
        self.served = 0

    def _load(self, step: int) -> Any:
        raise NotImplementedError

    def _start(self, step: int) -> None:
        if step in self.steps and step not in self.ahead:
            self.ahead[step] = self.pool.submit(self._load, step)

    def produce(self, step: int) -> Any:
        self._start(step)
        batch = self.ahead.pop(step).result()
        self._start(step + 1)                       # one step ahead, as the harness's prefetch
        self.served += 1
        return batch

    def close(self, steps: int) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.served != steps:
            raise BenchError(f"{self.label}: {self.served} of {steps} steps were read")


class HitFloorArm(AheadArm):
    """The floor of any hit, side by side with the harness's: the same step reading the same bytes (the
    payload files of the cache the hit arm serves) bare from the page cache -- each step's file mapped
    (no copy: its pages are the page cache's) and decoded into tensors that view the mapping, one step
    ahead on a background thread as the harness prefetches. No listing, no commit record, no meta.json,
    no checksum; the decode is what the trainer needs (tensors and strings). The files are read once
    before the first step, so that every step finds its bytes in the page cache (a hit reads them from
    the disk, with O_DIRECT). Labelled `hit_floor` in the results."""

    mode = "hit_floor"
    label = "hit floor"

    def __init__(self, payload: Any, layout: Layout, steps: int):
        super().__init__(range(1, steps + 1), "bench-hit-floor")
        self.paths = {s: layout.payload_path(s, 0, 0) for s in self.steps}
        for path in self.paths.values():           # into the page cache, untimed
            with open(path, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass

    def _load(self, step: int) -> Any:
        path = self.paths[step]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            mapped.madvise(_MADV_POPULATE_READ)
        except (OSError, ValueError):
            pass                                    # an older kernel: the trainer's touch maps the pages
        return codec.load_buffer(mapped, size, path)


class VerlArm(StepArm):
    """A miss as verl's rollout skip writes it: `torch.save` of the batch to its file inside the step,
    synchronously (no fsync, no checksum). Labelled `verl` in the results."""

    mode = "verl"

    def __init__(self, payload: Any, dump_dir: Path):
        super().__init__()
        self.dir = dump_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trainer = SyntheticTrainer(payload)

    def produce(self, step: int) -> Any:
        batch = self.trainer.sample(step)
        torch.save(batch, self.dir / f"{step}.pt")
        return batch

    def settle(self, step: int) -> None:
        # The dirty pages written back and dropped now, so that the kernel's writeback never lands in
        # another arm's step.
        fd = os.open(self.dir / f"{step}.pt", os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self, steps: int) -> None:
        written = len(list(self.dir.glob("*.pt")))
        if written != steps:
            raise BenchError(f"verl-style writes: {written} of {steps} were written")


class TrainingArm(StepArm):
    """An arm with its own SkipHarness (or caching off), trainer and namespace."""

    def __init__(self, mode: str, payload: Any, dump_dir: Path):
        super().__init__()
        self.label = mode
        mode, compression = _split_mode(mode)
        self.mode = mode
        self.harness = make_harness("off" if mode == "memory" else ("async" if mode == "hit" else mode), dump_dir,
                                    compression)
        self.trainer = SyntheticTrainer(payload, in_memory=mode == "memory")
        self.harness.wrap(self.trainer)
        self.harness.start()

    def produce(self, step: int) -> Any:
        self.trainer.prepare_data(step)
        return self.trainer.sample(step)

    def settle(self, step: int) -> None:
        # the step's writes and its commit (queued behind them on the writer thread): nothing of this arm's
        # runs into the next arm's step
        self.harness.commit_finished()

    def close(self, steps: int) -> None:
        summary = self.harness.close()
        expected = {"off": "off", "memory": "off", "hit": "hit"}.get(self.mode, "miss")
        outcomes = {self.harness.outcome(s) for s in range(1, steps + 1)}
        if outcomes != {expected}:
            raise BenchError(f"caching {self.mode}: steps were {sorted(outcomes)}, expected every one to be a {expected}")
        if self.mode in ("async", "sync") and summary.misses != steps:
            raise BenchError(f"caching {self.mode}: {summary.misses} of {steps} steps were committed")
        if self.mode == "hit" and self.trainer.generated:
            raise BenchError(f"caching hit: {self.trainer.generated} generations ran on hit steps")


def bench_steps(payload: Any, work: Path, bare_save_s: float, steps: int, rounds: int, threads: int,
                modes: Sequence[str] = ("off", "async", "sync")) -> Dict[str, float]:
    """Per-step medians of the training-step arms `modes`. Every arm is open at once and the arms take
    turns step by step (A B C, C B A, ...), so a machine whose load changes slows every arm alike; the
    first step of each arm is a warm-up and not counted."""
    compute = Compute()
    compute_s = compute.calibrate(COMPUTE_FACTOR * bare_save_s)
    log.info("synthetic step on %d thread(s): %d matmuls, %.3f s of compute (%.1fx a bare durable save of %.3f s)",
             threads, compute.iters, compute_s, compute_s / bare_save_s, bare_save_s)
    total = 1 + steps * rounds
    hit_layouts: Dict[str, Layout] = {}
    for hit in ("hit", "hit_zstd"):  # the caches the hit arms and their floors read: written once, untimed
        if hit in modes or hit.replace("hit", "hit_floor") in modes:
            hit_layouts[hit] = run_training_block("async", payload, Compute(8), total, work / f"steps_{hit}",
                                                  keep=True, compression=_split_mode(hit)[1]).layout

    def arm(m: str) -> StepArm:
        if m in ("hit_floor", "hit_floor_zstd"):        # the same files as the hit arm's
            return HitFloorArm(payload, hit_layouts[m.replace("hit_floor", "hit")], total)
        if m in ("floor", "floor_zstd"):
            return FloorArm(payload, work / f"steps_{m}", ZSTD_LEVEL if m == "floor_zstd" else None)
        if m == "floor_protocol":                          # the floor plus SPEC's commit, bare
            from _bench_protocol import ProtocolFloorArm
            return ProtocolFloorArm(payload, work / f"steps_{m}")
        return VerlArm(payload, work / f"steps_{m}") if m == "verl" else TrainingArm(m, payload, work / f"steps_{m}")

    arms = {m: arm(m) for m in modes}
    try:
        for step in range(1, total + 1):
            order = list(modes) if step % 2 else list(reversed(modes))
            for mode in order:
                arms[mode].step(step, compute)
            if step > 1 and (step - 1) % steps == 0:
                log.info("training steps on %d thread(s), %d/%d: %s per step (medians)", threads, step - 1, total - 1,
                         ", ".join(f"{m} {median(arms[m].times[1:]):.3f} s" for m in modes))
    finally:
        for a in arms.values():
            if isinstance(a, TrainingArm):
                a.harness.close()
    for a in arms.values():
        a.close(total)
    for m in (*modes, "hit"):
        shutil.rmtree(work / f"steps_{m}", ignore_errors=True)
    out = {"compute_s": compute_s, **{f"{m}_s": median(arms[m].times[1:]) for m in modes}}
    out.update({f"{m}_cpu_s": median(arms[m].cpu[1:]) for m in modes})
    out.update({f"{m}_flush_s": median(arms[m].flush_s[1:]) for m in modes})
    # an arm against another step by step (the two ran next to each other, so a change of the machine's
    # load between steps moves both): the median of the per-step ratios
    for key, num, den in (("hit_vs_floor", "hit", "hit_floor"), ("async_vs_floor", "async", "floor"),
                          ("floor_vs_off", "floor", "off"), ("async_zstd_vs_floor", "async_zstd", "floor_zstd"),
                          ("hit_zstd_vs_floor", "hit_zstd", "hit_floor_zstd"),
                          ("async_vs_floor_protocol", "async", "floor_protocol"),
                          ("floor_protocol_vs_floor", "floor_protocol", "floor")):
        if num in modes and den in modes:
            ratios = [x / y for x, y in zip(arms[num].times[1:], arms[den].times[1:])]
            out[f"{key}_paired"] = median(ratios)
            se = median_se(ratios)
            if se is not None:
                out[f"{key}_paired_se"] = se
    return out


# the step-by-step figures (SPEC's names, `_grpo` added on the GRPO batch): each arm and its floor
PAIRS = (("step_vs_floor_ratio", "async", "floor"), ("hit_vs_floor_ratio", "hit", "hit_floor"),
         ("step_zstd_vs_floor_ratio", "async_zstd", "floor_zstd"), ("hit_zstd_vs_floor_ratio", "hit_zstd", "hit_floor_zstd"))


def bench_pairs(payload: Any, work: Path, bare_save_s: float, steps: int, threads: int,
                all_arms: Dict[str, float], suffix: str = "") -> Dict[str, float]:
    """Each step-by-step figure (PAIRS) measured again with only its two arms open, taking turns for `steps`
    steps: `{key}{suffix}` and its standard error `{key}{suffix}_se`; the same figure from `all_arms`
    (bench_steps' output with every arm open) stays as `{key}{suffix}_all_arms`. Beside ten other arms a
    figure's per-step ratios spread about 3.5 times as wide as beside its floor alone (their writes and
    reads crowd the page cache and the disk between the pair's steps): the 1.02 targets need the narrow one."""
    out: Dict[str, float] = {}
    for key, num, den in PAIRS:
        pair = f"{num}_vs_floor_paired"
        if pair in all_arms:
            out[f"{key}{suffix}_all_arms"] = all_arms[pair]
        log.info("%s%s: %s and %s alone, taking turns, %d steps each", key, suffix, num, den, steps)
        m = bench_steps(payload, work, bare_save_s, steps, 1, threads, (num, den))
        out[f"{key}{suffix}"] = m[pair]
        if f"{pair}_se" in m:
            out[f"{key}{suffix}_se"] = m[f"{pair}_se"]
    return out


def median_se(values: Sequence[float]) -> Optional[float]:
    """The standard error of the median of `values`, from their interquartile range (as for a normal
    sample: sigma = IQR / 1.349, and a median's error 1.2533 sigma / sqrt(n)) -- robust to the few steps
    a busy machine slows; how far a paired figure moves from run to run by chance. None for fewer than 4
    values (a quick run's few steps say nothing of it)."""
    if len(values) < 4:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4)
    return 1.2533 * (q3 - q1) / 1.349 / math.sqrt(len(values))
