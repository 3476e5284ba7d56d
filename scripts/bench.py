"""What caching costs, measured side by side with the bare alternative on one realistic payload.

    python scripts/bench.py [--json] [--payload-mib N] [--repeats R] [--scan-steps N] [--quick] [--work-dir DIR]

Every figure is a ratio "skip_harness / bare", from medians of interleaved runs (A B, B A, ...) so
that a noisy machine slows both arms alike:

- save_ratio           StepStore.write_inner (temp name, fsync, rename, directory fsync, meta.json,
                       checksum while writing) vs torch.save to a temp file + fsync + os.replace.
- load_ratio           StepStore.verify (checksums) + StepStore.read_inner vs torch.load(weights_only=True)
                       of an identical file; both touch every byte of every tensor (a memory-mapped load
                       is lazy). Both files are in the page cache: this is the warm-cache cost.
- step_overhead_ratio  a synthetic training step (a matmul loop on --compute-threads torch threads, default 1,
                       computing ~4x as long as one bare durable save) under a real SkipHarness that misses
                       every step and writes on its background thread, vs the same step with caching off;
                       medians of per-step wall time over interleaved blocks of steps, each in a fresh
                       namespace (extra key step_overhead_ratio_block: whole blocks, waiting for the last
                       write included).
- sync_overhead_ratio  the same, writing inside `sample` (async_write=False), as verl does.
- scan_10k_s           scan_namespace over 10,000 committed steps x K = 4 (warm: median of three scans after
                       a first one; with --scan-steps N != 10,000, scaled linearly and flagged).
- load_peak_mem_ratio  peak RSS growth of verify + read_inner + touching every tensor, in a fresh process
                       after a warm-up load, over the payload's tensor bytes (bare_load_peak_mem_ratio: the
                       same for torch.load).

Progress goes to stderr through logging; the result (a table, or one JSON document with --json) to stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness import store as store_mod
from skip_harness.config import RolloutTQConfig
from skip_harness.harness import SkipHarness
from skip_harness.layout import COMMIT_NAME, Layout, NamespaceKey
from skip_harness.scan import scan_namespace
from skip_harness.store import StepStore

log = logging.getLogger("skip_harness.bench")

MiB = 1 << 20
PROMPT_LEN = 512
RESPONSE_LEN = 1536
VOCAB = 151_936
SCAN_K = 4
COMPUTE_FACTOR = 4.0          # the synthetic step computes this many bare durable saves long
SCAN_BUILD_FORMAT = 1         # bump when the cached scan namespace's construction changes


class BenchError(Exception):
    """A measurement could not be made as intended (the message says which and why)."""


# --------------------------------------------------------------------------------------------
# payload


def make_payload(target_bytes: int, seed: int = 0) -> Dict[str, Any]:
    """A verl-like rollout mini-batch of about `target_bytes` tensor bytes: int64 token ids, masks and
    positions over prompt + response, float32 per-token log-probs, masks, advantages and rewards,
    plus the small non-tensor fields a batch carries (uids, data source)."""
    P, R = PROMPT_LEN, RESPONSE_LEN
    L = P + R
    per_row = 8 * (P + R + 3 * L) + 4 * 6 * R
    B = max(2, target_bytes // per_row)
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(P // 4, P + 1, (B, 1), generator=g)
    response_len = torch.randint(R // 8, R + 1, (B, 1), generator=g)
    prompt_mask = (torch.arange(P).flip(0).unsqueeze(0) < prompt_len).long()     # left-padded prompts
    response_mask = (torch.arange(R).unsqueeze(0) < response_len).long()         # right-padded responses
    prompts = torch.randint(0, VOCAB, (B, P), generator=g) * prompt_mask
    responses = torch.randint(0, VOCAB, (B, R), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    rmask = response_mask.float()
    old_log_probs = -torch.rand(B, R, generator=g) * 6 * rmask
    ref_log_prob = old_log_probs + 0.01 * torch.randn(B, R, generator=g) * rmask
    scores = torch.rand(B, generator=g)
    token_level_rewards = torch.zeros(B, R)
    token_level_rewards[torch.arange(B), response_len.squeeze(1) - 1] = scores
    advantages = (scores - scores.mean()).unsqueeze(1) * rmask
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": rmask,
        "old_log_probs": old_log_probs,
        "ref_log_prob": ref_log_prob,
        "advantages": advantages,
        "returns": advantages.clone(),
        "token_level_rewards": token_level_rewards,
        "uid": [f"{i // 8:08x}" for i in range(B)],
        "data_source": "bench/sort_digits",
        "global_steps": 1,
    }


def iter_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def tensor_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


def touch(obj: Any) -> float:
    """Read every byte of every tensor (forces a memory-mapped load in, as a trainer would)."""
    return float(sum(float(t.sum()) for t in iter_tensors(obj)))


def fresh_copy(payload: Dict[str, Any]) -> Dict[str, Any]:
    """New tensors each call, as a generator's output would be."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in payload.items()}


# --------------------------------------------------------------------------------------------
# timing


@dataclass
class Arm:
    name: str
    run: Callable[[], None]                 # timed
    setup: Callable[[], None] = lambda: None  # untimed, before each run


def interleave(arms: Sequence[Arm], repeats: int, warmup: int = 1) -> Dict[str, List[float]]:
    """Run the arms in turn (A B, B A, A B ...), `warmup` untimed rounds first; seconds per run."""
    times: Dict[str, List[float]] = {a.name: [] for a in arms}
    for r in range(warmup + repeats):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            arm.setup()
            t0 = time.perf_counter()
            arm.run()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[arm.name].append(dt)
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# --------------------------------------------------------------------------------------------
# save and load


def bench_save(payload: Any, work: Path, repeats: int) -> Dict[str, float]:
    store = StepStore(Layout(work / "save_ns", K=1, W=1))
    bare_dir = work / "save_bare"
    bare_dir.mkdir(parents=True, exist_ok=True)
    final = bare_dir / "tq_batch.pt"

    def durable() -> None:
        store.write_inner(1, 0, 0, payload, {"bench": "save"})

    def bare() -> None:
        tmp = bare_dir / f".tmp-tq_batch.pt.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)

    def bare_setup() -> None:
        final.unlink(missing_ok=True)

    times = interleave(
        [Arm("durable", durable, lambda: store.clear_step(1)), Arm("bare", bare, bare_setup)], repeats
    )
    store.clear_step(1)
    bare_setup()
    out = {"save_s": median(times["durable"]), "bare_save_s": median(times["bare"])}
    out["save_ratio"] = out["save_s"] / out["bare_save_s"]
    return out


def write_committed_step(store: StepStore, step: int, payload: Any) -> Path:
    entries = store.write_inner(step, 0, 0, payload, {"bench": "load"})
    store.commit(step, entries, None)
    return store.layout.payload_path(step, 0, 0)


def load_verified(store: StepStore, step: int) -> Any:
    reason = store.verify(step)
    if reason is not None:
        raise BenchError(f"step {step} of {store.layout.root} does not verify: {reason}")
    return store.read_inner(step, 0, 0)


def bench_load(store: StepStore, bare_path: Path, repeats: int) -> Dict[str, float]:
    times = interleave(
        [
            Arm("ours", lambda: touch(load_verified(store, 1))),
            Arm("bare", lambda: touch(torch.load(bare_path, weights_only=True))),
        ],
        repeats,
    )
    out = {"load_s": median(times["ours"]), "bare_load_s": median(times["bare"])}
    out["load_ratio"] = out["load_s"] / out["bare_load_s"]
    return out


def bench_checksum(payload: Any) -> float:
    """xxh3_128 throughput in GB/s over the payload's bytes, in memory (the store's hash function)."""
    data = b"".join(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for t in iter_tensors(payload))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        store_mod.checksum_bytes(data)
        runs.append(time.perf_counter() - t0)
    return len(data) / min(runs) / 1e9


# --------------------------------------------------------------------------------------------
# training-step overhead


class SyntheticTrainer:
    """prepare_data / sample like a real trainer: sample returns a fresh copy of the payload."""

    def __init__(self, payload: Any):
        self.payload = payload
        self.dispatched = 0

    def prepare_data(self, step: int, dispatch: bool = True) -> None:
        if dispatch:
            self.dispatched += 1

    def sample(self, step: int) -> Any:
        return fresh_copy(self.payload)


class Compute:
    """A matmul loop standing in for the training computation."""

    def __init__(self, n: int = 384):
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(n, n, generator=g) / math.sqrt(n)
        self.b = torch.randn(n, n, generator=g) / math.sqrt(n)
        self.out = torch.empty(n, n)
        self.iters = 1

    def run(self, iters: Optional[int] = None) -> None:
        for _ in range(self.iters if iters is None else iters):
            torch.mm(self.a, self.b, out=self.out)

    def calibrate(self, seconds: float) -> float:
        """Choose the iteration count so one run takes about `seconds`; returns the seconds measured."""
        self.run(20)
        per_iter = []
        for _ in range(5):
            t0 = time.perf_counter()
            self.run(50)
            per_iter.append((time.perf_counter() - t0) / 50)
        self.iters = max(1, round(seconds / median(per_iter)))
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            self.run()
            runs.append(time.perf_counter() - t0)
        return median(runs)


def run_training_block(mode: str, payload: Any, compute: Compute, steps: int, dump_dir: Path,
                       key: NamespaceKey) -> Tuple[List[float], float]:
    """`steps` training steps with caching `mode` ('off', 'async', 'sync') in a fresh namespace.
    Returns (seconds of each step, seconds until every write of the block was durable)."""
    settings = RolloutTQConfig(enable=mode != "off", dump_dir=str(dump_dir), async_write=mode == "async")
    harness = SkipHarness(settings, key)
    trainer = SyntheticTrainer(payload)
    harness.wrap(trainer)
    harness.start()
    per_step: List[float] = []
    try:
        t_block = time.perf_counter()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            trainer.prepare_data(step)
            batch = trainer.sample(step)
            compute.run()
            per_step.append(time.perf_counter() - t0)
            del batch
        harness.flush()
        total = time.perf_counter() - t_block
        outcomes = {harness.outcome(s) for s in range(1, steps + 1)}
    finally:
        summary = harness.close()
        harness.unwrap()
    expected = "off" if mode == "off" else "miss"
    if outcomes != {expected}:
        raise BenchError(f"caching {mode}: steps were {sorted(outcomes)}, expected every one to be a {expected}")
    if mode != "off" and summary.misses != steps:
        raise BenchError(f"caching {mode}: {summary.misses} of {steps} steps were committed")
    if trainer.dispatched != steps:
        raise BenchError(f"caching {mode}: generation dispatched {trainer.dispatched} times for {steps} steps")
    shutil.rmtree(dump_dir, ignore_errors=True)
    return per_step, total


def bench_step(payload: Any, work: Path, bare_save_s: float, steps: int, rounds: int,
               threads: int) -> Dict[str, float]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _bench_step(payload, work, bare_save_s, steps, rounds)
    finally:
        torch.set_num_threads(previous)


def _bench_step(payload: Any, work: Path, bare_save_s: float, steps: int, rounds: int) -> Dict[str, float]:
    compute = Compute()
    compute_s = compute.calibrate(COMPUTE_FACTOR * bare_save_s)
    log.info("synthetic step: %d matmuls, %.3f s of compute (%.1fx a bare durable save of %.3f s)",
             compute.iters, compute_s, compute_s / bare_save_s, bare_save_s)
    key = NamespaceKey("bench", "skip_harness", train_batch_size=8, n=1,
                       max_prompt_length=PROMPT_LEN, max_response_length=RESPONSE_LEN)
    modes = ("off", "async", "sync")
    per_step: Dict[str, List[float]] = {m: [] for m in modes}
    totals: Dict[str, List[float]] = {m: [] for m in modes}
    for r in range(rounds + 1):  # round 0 (two steps an arm) warms every arm up and is not counted
        order = modes if r % 2 == 0 else tuple(reversed(modes))
        for mode in order:
            n = steps if r > 0 else min(2, steps)
            times, total = run_training_block(mode, payload, compute, n, work / f"steps_{mode}_{r}", key)
            if r > 0:
                per_step[mode].extend(times)
                totals[mode].append(total)
        if r > 0:
            log.info("training steps, round %d/%d: off %.3f s, async %.3f s, sync %.3f s per step (medians)",
                     r, rounds, *(median(per_step[m]) for m in modes))
    out = {
        "step_compute_s": compute_s,
        "step_off_s": median(per_step["off"]),
        "step_s": median(per_step["async"]),
        "step_sync_s": median(per_step["sync"]),
    }
    out["step_overhead_ratio"] = out["step_s"] / out["step_off_s"]
    out["sync_overhead_ratio"] = out["step_sync_s"] / out["step_off_s"]
    # Whole blocks including the wait for the last write: the end-to-end cost over `steps` steps.
    out["step_overhead_ratio_block"] = median(totals["async"]) / median(totals["off"])
    return out


# --------------------------------------------------------------------------------------------
# startup scan


def build_scan_namespace(root: Path, steps: int, K: int = SCAN_K) -> Layout:
    """A namespace of `steps` committed steps x K inner indices, as a run leaves it.

    Step 1 is written and committed through StepStore; every other step gets hard links to step 1's
    payload and meta files and its own commit record (step 1's record with the step number changed,
    serialized as StepStore.commit does, but without the per-file fsync that would make building
    10,000 steps take minutes). The scan reads directory listings, lstat and commit records, so it
    sees exactly what it would see after a real run."""
    layout = Layout(root, K=K, W=1)
    store = StepStore(layout)
    g = torch.Generator().manual_seed(2)
    entries = []
    for i in range(K):
        small = {"input_ids": torch.randint(0, VOCAB, (4, 16), generator=g), "old_log_probs": torch.randn(4, 16, generator=g)}
        entries += store.write_inner(1, i, 0, small, {"bench": "scan"})
    record = store.commit(1, entries, None)
    first = layout.step_dir(1)
    inner_names = sorted({str(Path(e.rel).parent) for e in record.files} - {"."})
    for step in range(2, steps + 1):
        d = layout.step_dir(step)
        d.mkdir()
        for name in inner_names:
            (d / name).mkdir()
        for e in record.files:
            os.link(first / e.rel, d / e.rel)
        doc = dataclasses.replace(record, step=step).to_json()
        (d / COMMIT_NAME).write_bytes((json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
        if step % 2000 == 0:
            log.info("building the scan namespace: %d / %d steps", step, steps)
    return layout


def scan_namespace_for(work: Path, steps: int, reuse: bool) -> Layout:
    """The scan namespace under `work`, built once; with `reuse` an earlier build is kept."""
    base = work / f"scan_{steps}x{SCAN_K}"
    marker = base / "built.json"
    root = base / "bench_skip_harness" / f"GBS8_N1_in16_out16_K{SCAN_K}_W1"
    want = {"format": SCAN_BUILD_FORMAT, "steps": steps, "K": SCAN_K}
    if reuse and marker.is_file():
        try:
            if json.loads(marker.read_text()) == want:
                log.info("reusing the scan namespace in %s", root)
                return Layout(root, K=SCAN_K, W=1)
        except ValueError:
            pass
    shutil.rmtree(base, ignore_errors=True)
    t0 = time.perf_counter()
    layout = build_scan_namespace(root, steps)
    marker.write_text(json.dumps(want))
    log.info("built %d steps x K=%d in %.1f s", steps, SCAN_K, time.perf_counter() - t0)
    return layout


def bench_scan(layout: Layout, steps: int, warm_runs: int = 3) -> Dict[str, Any]:
    """Time scan_namespace: once right after the build, then `warm_runs` more (their median is the
    warm figure). The first is no cold-cache figure either: the build has just walked every directory."""
    times = []
    for _ in range(1 + warm_runs):
        t0 = time.perf_counter()
        report = scan_namespace(layout)
        times.append(time.perf_counter() - t0)
        counts = report.counts()
        if counts["complete"] != steps or len(report.steps) != steps:
            raise BenchError(f"scan of {layout.root} found {counts}, expected {steps} complete steps")
    scale = 10_000 / steps
    warm = median(times[1:])
    return {
        "scan_steps": steps,
        "scan_K": SCAN_K,
        "scan_s": warm,
        "scan_first_s": times[0],
        "scan_10k_s": warm * scale,
        "scan_10k_first_s": times[0] * scale,
        "scan_10k_extrapolated": steps != 10_000,
        "scan_warm_runs_s": times[1:],
    }


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
    """--_child mode: load once small (warm-up), then the big payload; report the peak RSS growth."""
    store = StepStore(Layout(Path(ns_root), K=1, W=1))
    if kind == "ours":
        touch(load_verified(store, 2))
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
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, str(ns_root), str(bare_big), str(bare_small)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise BenchError(f"memory measurement ({kind}) failed with exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        delta = (doc["peak_kib"] - doc["base_kib"]) * 1024
        out[key] = delta / payload_bytes
        out[key.replace("ratio", "bytes")] = delta
        out["peak_mem_source"] = doc["source"] + (" after reset" if doc["reset"] else "")
    return out


# --------------------------------------------------------------------------------------------
# driver


def fs_type(path: Path) -> str:
    """The filesystem type holding `path` (from /proc/mounts), or 'unknown'."""
    best, kind = "", "unknown"
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def run(args: argparse.Namespace) -> Dict[str, Any]:
    user_work = args.work_dir is not None
    if user_work:
        base = Path(args.work_dir).expanduser().resolve()
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    else:
        base = work = Path(tempfile.mkdtemp(prefix="skip_harness_bench-"))
    fs = fs_type(work)
    if fs in ("tmpfs", "ramfs"):
        log.warning("%s is on %s: fsync costs nothing there, so save figures are not those of a disk "
                    "(pass --work-dir on the disk that holds your cache)", work, fs)
    try:
        payload = make_payload(int(args.payload_mib * MiB))
        payload_bytes = tensor_bytes(payload)
        B = payload["input_ids"].shape[0]
        log.info("payload: %d rows x %d tokens, %.1f MiB of tensors; work dir %s (%s)",
                 B, PROMPT_LEN + RESPONSE_LEN, payload_bytes / MiB, work, fs)
        result: Dict[str, Any] = {
            "payload_bytes": payload_bytes,
            "payload_rows": B,
            "payload_tokens": PROMPT_LEN + RESPONSE_LEN,
            "repeats": args.repeats,
            "quick": bool(args.quick),
            "work_fs": fs,
            "compute_threads": args.compute_threads,
        }

        log.info("checksum throughput")
        result["xxh3_gbps"] = bench_checksum(payload)

        log.info("save: durable write_inner vs torch.save + fsync + rename, %d repeats", args.repeats)
        result.update(bench_save(payload, work, args.repeats))

        log.info("load: verify + read_inner vs torch.load(weights_only=True), %d repeats", args.repeats)
        load_store = StepStore(Layout(work / "load_ns", K=1, W=1))
        big_file = write_committed_step(load_store, 1, payload)
        small_file = write_committed_step(load_store, 2, make_payload(256 << 10, seed=3))
        bare_big, bare_small = work / "load_bare.pt", work / "load_bare_small.pt"
        shutil.copyfile(big_file, bare_big)
        shutil.copyfile(small_file, bare_small)
        result.update(bench_load(load_store, bare_big, args.repeats))

        log.info("peak memory of a load, in fresh processes")
        result.update(bench_mem(load_store.layout.root, bare_big, bare_small, payload_bytes))
        shutil.rmtree(load_store.layout.root, ignore_errors=True)
        bare_big.unlink()
        bare_small.unlink()

        log.info("training steps: caching off / async write / sync write, %d steps x %d rounds",
                 args.steps_per_arm, args.step_rounds)
        result.update(bench_step(payload, work, result["bare_save_s"], args.steps_per_arm, args.step_rounds,
                                 args.compute_threads))

        log.info("startup scan: %d steps x K=%d", args.scan_steps, SCAN_K)
        layout = scan_namespace_for(base if user_work else work, args.scan_steps, reuse=user_work)
        result.update(bench_scan(layout, args.scan_steps))
        return result
    finally:
        log.info("removing %s", work)
        shutil.rmtree(work, ignore_errors=True)


KEYS = ("save_ratio", "load_ratio", "step_overhead_ratio", "sync_overhead_ratio", "scan_10k_s", "load_peak_mem_ratio")


def render_table(r: Dict[str, Any]) -> str:
    def row(name: str, ours: str, bare: str, ratio: str) -> str:
        return f"{name:<38}{ours:>14}{bare:>14}{ratio:>9}\n"

    scan_note = f"{r['scan_steps']:,} steps, scaled" if r["scan_10k_extrapolated"] else "10,000 steps"
    out = (
        f"skip_harness benchmark: payload {r['payload_bytes'] / MiB:.1f} MiB "
        f"({r['payload_rows']} rows x {r['payload_tokens']} tokens), medians of {r['repeats']} interleaved "
        f"repeats, work dir on {r['work_fs']}\n\n"
        + row("", "skip_harness", "bare", "ratio")
        + row("save (durable)", f"{r['save_s']:.3f} s", f"{r['bare_save_s']:.3f} s", f"{r['save_ratio']:.2f}")
        + row("load (+ verify, every byte touched)", f"{r['load_s']:.3f} s", f"{r['bare_load_s']:.3f} s",
              f"{r['load_ratio']:.2f}")
        + row("training step, async write (miss)", f"{r['step_s']:.3f} s", f"{r['step_off_s']:.3f} s",
              f"{r['step_overhead_ratio']:.2f}")
        + row("training step, sync write (miss)", f"{r['step_sync_s']:.3f} s", f"{r['step_off_s']:.3f} s",
              f"{r['sync_overhead_ratio']:.2f}")
        + row("peak memory of a load / payload", f"{r['load_peak_mem_ratio']:.2f}",
              f"{r['bare_load_peak_mem_ratio']:.2f}", "")
        + "\n"
        + f"startup scan, 10,000 steps x K={r['scan_K']}: {r['scan_10k_s']:.2f} s warm (median of 3) "
          f"(first scan after building: {r['scan_10k_first_s']:.2f} s; {scan_note})\n"
        + f"synthetic step computes {r['step_compute_s']:.3f} s; async overhead over whole blocks, last write "
          f"included: {r['step_overhead_ratio_block']:.2f}\n"
        + f"xxh3_128 checksum: {r['xxh3_gbps']:.1f} GB/s in memory\n"
    )
    return out


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--payload-mib", type=float, default=None, help="payload size in MiB (default 64; --quick: 8)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats of save and load (default 7; --quick: 3)")
    p.add_argument("--scan-steps", type=int, default=None, help="steps in the scan namespace (default 10000; --quick: 1000)")
    p.add_argument("--steps-per-arm", type=int, default=None, help="training steps per block (default 8; --quick: 4)")
    p.add_argument("--step-rounds", type=int, default=None, help="interleaved rounds of training blocks (default 4; --quick: 2)")
    p.add_argument("--compute-threads", type=int, default=1,
                   help="torch threads of the synthetic step (default 1: the background writer then has a core "
                        "to itself, as next to a GPU step; all cores of a shared machine make matmul timings erratic)")
    p.add_argument("--quick", action="store_true", help="small and short, for tests")
    p.add_argument("--work-dir", default=None,
                   help="where to write (default: a temp dir, removed at the end); the scan namespace is kept there for reuse")
    p.add_argument("-v", "--verbose", action="store_true", help="also show the harness's own log lines")
    p.add_argument("--_child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = dict(payload_mib=8 if args.quick else 64, repeats=3 if args.quick else 7,
                    scan_steps=1000 if args.quick else 10_000, steps_per_arm=4 if args.quick else 8,
                    step_rounds=2 if args.quick else 4)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not args.payload_mib > 0 or not math.isfinite(args.payload_mib):
        p.error(f"--payload-mib must be > 0, got {args.payload_mib}")
    for name in ("repeats", "scan_steps", "steps_per_arm", "step_rounds", "compute_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="[%(asctime)s][%(name)s] %(message)s")
    logging.getLogger("skip_harness").setLevel(logging.INFO if args.verbose else logging.WARNING)
    log.setLevel(logging.INFO)
    if args._child is not None:
        child_mem(*args._child)
        return 0
    try:
        result = run(args)
    except BenchError as exc:
        log.error("%s", exc)
        return 1
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        sys.stdout.write(render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
