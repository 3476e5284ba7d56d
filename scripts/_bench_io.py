"""The benchmark's save / load micro-bench (scripts/bench.py): the durable save against torch.save and
the bare write floor, the verified load against torch.load, compression on, the checksum's speed, and
the peak memory of a load -- measured in a fresh process: this file run as a script is that process
(`python scripts/_bench_io.py ours|bare NS_ROOT BIG.pt SMALL.pt`, one JSON line on stdout)."""
from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import xxhash

from _benchlib import (
    MiB, ZSTD, Arm, BenchError, interleave, iter_tensors, median, tensor_bytes, touch,
)

from skip_harness.store.open import open_store
from skip_harness import codec
from skip_harness.errors import CorruptStepError
from skip_harness.store.layout import Layout
from skip_harness.store.stepstore import StepStore

# --------------------------------------------------------------------------------------------
# save and load, with the physical floor


def _bare_save(payload: Any, directory: Path) -> None:
    tmp, final = directory / f".tmp-tq_batch.pt.{os.getpid()}", directory / "tq_batch.pt"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _raw_write(payload: Any, directory: Path) -> None:
    """The floor of a durable save: the tensors' bytes written straight from memory, fsync, rename."""
    tmp, final = directory / f".tmp-raw.{os.getpid()}", directory / "raw.bin"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in iter_tensors(payload):
            if t.numel():
                os.write(fd, memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def bench_save(payload: Any, work: Path, repeats: int, floors: bool = True) -> Dict[str, float]:
    store = open_store(Layout(work / "save_ns", K=1, W=1))
    bare_dir = work / "save_bare"
    bare_dir.mkdir(parents=True, exist_ok=True)
    cpu: Dict[str, List[float]] = {"durable": [], "bare": []}

    def timed_cpu(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            c0 = time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c0)
        return run

    def clear_bare() -> None:
        for name in ("tq_batch.pt", "raw.bin"):
            (bare_dir / name).unlink(missing_ok=True)

    arms = [Arm("durable", timed_cpu("durable", lambda: store.writer.write_inner(1, 0, 0, payload, {"bench": "save"})),
                lambda: store.writer.clear_step(1)),
            Arm("bare", timed_cpu("bare", lambda: _bare_save(payload, bare_dir)), clear_bare)]
    if floors:
        dests = [torch.ones_like(t) for t in iter_tensors(payload)]   # allocated and faulted in once
        arms += [Arm("raw", lambda: _raw_write(payload, bare_dir), clear_bare),
                 Arm("memcpy", lambda: [d.copy_(t) for d, t in zip(dests, iter_tensors(payload))])]
    times = interleave(arms, repeats)
    store.writer.clear_step(1)
    clear_bare()
    nbytes = tensor_bytes(payload)
    out = {"save_s": median(times["durable"]), "bare_save_s": median(times["bare"]),
           "save_cpu_s": median(cpu["durable"][-repeats:]), "bare_save_cpu_s": median(cpu["bare"][-repeats:])}
    out["save_ratio"] = out["save_s"] / out["bare_save_s"]
    out["save_mib_s"] = nbytes / MiB / out["save_s"]
    out["bare_save_mib_s"] = nbytes / MiB / out["bare_save_s"]
    if floors:
        out["floor_write_fsync_s"] = median(times["raw"])
        out["floor_memcpy_s"] = median(times["memcpy"])
        out["save_floor_ratio"] = out["save_s"] / out["floor_write_fsync_s"]
    return out


def bench_zstd(payload: Any, work: Path, repeats: int) -> Dict[str, float]:
    """Durable save and verified load of the batch with compression on (StepStore as the harness makes it
    with compression=zstd), and the writer-thread work alone: narrowing + compressing the batch, and
    decompressing it, on one thread."""
    from skip_harness.codec import tensorfile

    store = open_store(Layout(work / "zstd_ns", K=1, W=1), form=ZSTD)
    nbytes = tensor_bytes(payload)
    saves, loads = [], []
    for _ in range(repeats + 1):
        store.writer.clear_step(1)
        t0 = time.perf_counter()
        entries = store.writer.write_inner(1, 0, 0, payload, {"bench": "zstd"})
        saves.append(time.perf_counter() - t0)
        store.writer.commit(1, entries, None)
        t0 = time.perf_counter()
        status, reason, batches, _metas = store.reader.read_served(1, 0)
        touch(batches)
        loads.append(time.perf_counter() - t0)
        if reason is not None:
            raise BenchError(f"a compressed step does not verify: {reason}")
        del batches
    stored = entries[0].bytes
    store.writer.clear_step(1)
    structure, names = codec.encode_named(payload)
    image = tensorfile.plan(structure, names)
    tensors = [t.contiguous() for t in image.tensors]
    compress, decompress = [], []
    for _ in range(repeats):
        t0 = time.thread_time()
        form_image = tensorfile.stored_image(image, tensors, ZSTD)
        compress.append(time.thread_time() - t0)
        lease = store.pool.acquire(form_image.nbytes)
        tensorfile.fill_stored(form_image, lease.array)
        t0 = time.perf_counter()
        tensorfile.read_buffer(lease.array, form_image.nbytes)
        decompress.append(time.perf_counter() - t0)
        lease.release()
    out = {"save_zstd_s": median(saves[1:]), "load_zstd_s": median(loads[1:]), "zstd_stored_bytes": stored,
           "zstd_compress_cpu_s": median(compress), "zstd_decompress_s": median(decompress)}
    out["save_zstd_mib_s"] = nbytes / MiB / out["save_zstd_s"]
    out["load_zstd_mib_s"] = nbytes / MiB / out["load_zstd_s"]
    return out


def write_committed_step(store: StepStore, step: int, payload: Any) -> Path:
    entries = store.writer.write_inner(step, 0, 0, payload, {"bench": "load"})
    store.writer.commit(step, entries, None)
    return store.layout.payload_path(step, 0, 0)


def load_verified(store: StepStore, step: int) -> Any:
    """One verified read, as `merged` / export / show / verify take it: size and checksum checked against
    the commit record in the pass that reads the file (a damaged file raises, naming it)."""
    try:
        return store.reader.read_inner(step, 0, 0)
    except CorruptStepError as exc:
        raise BenchError(f"step {step} of {store.layout.root} does not verify: {exc}") from None


def bench_load(store: StepStore, step: int, bare_path: Path, repeats: int, nbytes: int) -> Dict[str, float]:
    times = interleave(
        [
            Arm("ours", lambda: touch(load_verified(store, step))),
            Arm("bare", lambda: touch(torch.load(bare_path, weights_only=True))),
        ],
        repeats,
    )
    out = {"load_s": median(times["ours"]), "bare_load_s": median(times["bare"])}
    out["load_ratio"] = out["load_s"] / out["bare_load_s"]
    out["load_mib_s"] = nbytes / MiB / out["load_s"]
    out["bare_load_mib_s"] = nbytes / MiB / out["bare_load_s"]
    return out


def bench_checksum(payload: Any) -> float:
    """xxh3_128 throughput in GB/s over the payload's bytes, in memory (the hash the store's commit
    records use)."""
    data = b"".join(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for t in iter_tensors(payload))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        xxhash.xxh3_128_hexdigest(data)
        runs.append(time.perf_counter() - t0)
    return len(data) / min(runs) / 1e9



# --------------------------------------------------------------------------------------------
# peak memory (in a fresh process)


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_kib() -> Tuple[int, str]:
    """This process's peak RSS in KiB, and where it came from.

    VmHWM (the peak of this process's own memory map) where /proc exists: getrusage's ru_maxrss also
    counts the peak of the memory map this process replaced at exec -- the parent's, when it was
    started by vfork + exec, as subprocess does -- so a child of a big parent reports the parent's peak."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm, "VmHWM"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"


def child_mem(kind: str, ns_root: str, bare_big: str, bare_small: str) -> None:
    """In a fresh process (this file run as a script): load once small (warm-up), then the big payload;
    report the peak RSS growth as one JSON line."""
    store = open_store(Layout(Path(ns_root), K=1, W=1))
    if kind == "ours":
        touch(load_verified(store, 3))
    else:
        touch(torch.load(bare_small, weights_only=True))
    gc.collect()
    reset = _reset_peak_rss()
    base, source = _peak_rss_kib()
    if reset:
        base = _status_kib("VmRSS") or base
    if kind == "ours":
        obj = load_verified(store, 1)
    else:
        obj = torch.load(bare_big, weights_only=True)
    touch(obj)
    peak, _ = _peak_rss_kib()
    del obj
    sys.stdout.write(json.dumps({"base_kib": base, "peak_kib": peak, "source": source, "reset": reset}) + "\n")


def bench_mem(ns_root: Path, bare_big: Path, bare_small: Path, payload_bytes: int) -> Dict[str, float]:
    out = {}
    for kind, key in (("ours", "load_peak_mem_ratio"), ("bare", "bare_load_peak_mem_ratio")):
        cmd = [sys.executable, os.path.abspath(__file__), kind, str(ns_root), str(bare_big), str(bare_small)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise BenchError(f"memory measurement ({kind}) failed with exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        delta = (doc["peak_kib"] - doc["base_kib"]) * 1024
        out[key] = delta / payload_bytes
        out[key.replace("ratio", "bytes")] = delta
        out["peak_mem_source"] = doc["source"] + (" after reset" if doc["reset"] else "")
    return out


if __name__ == "__main__":
    child_mem(*sys.argv[1:5])
