"""What caching costs, measured side by side with the bare alternative on one realistic payload.

    python scripts/bench.py [--json] [--json-out FILE] [--quick] [--rows N] [--repeats R] [--work-dir DIR] ...

The default payload is a rollout mini-batch as a verl-style trainer produces it: 1024 trajectories x
4096 tokens (1024 prompt + 3072 response) of int64 input ids, attention mask and response mask, float32
old log-probs and token-level rewards, per-sample scores and lengths, and per-sample uid / data-source
strings: about 112 MiB. `--quick` (CI) uses 64 trajectories and smaller counts everywhere.

Every figure comes from medians of interleaved runs (A B, B A, ...) so that a noisy machine slows both
arms alike. The keys of SPEC "Benchmark":

- save_ratio           StepWriter.write_inner (temp name, fsync, rename, directory fsync, meta.json, checksum
                       while writing) vs torch.save to a temp file + fsync + os.replace.
- load_ratio           StepReader.read_inner (one verified read: checksums in the pass that reads) + touching every tensor byte vs
                       torch.load(weights_only=True) + the same touch; both files in the page cache.
- step_overhead_ratio  a synthetic training step (prepare_data, sample, reading the batch, then a matmul loop
                       on every core computing ~4x as long as one bare durable torch.save) under a real
                       SkipHarness that misses every step and writes on its background thread, vs the same
                       step with caching off (per-step medians; every arm open at once, in its own
                       namespace, the arms taking turns step by step). `..._1thread`: the same on one thread.
- sync_overhead_ratio  the same, writing inside `sample` (async_write=False), synchronously as verl does;
                       verl_sync_overhead_ratio: the same step writing as verl's skip does (torch.save
                       of the batch inside the step, no fsync, no checksum).
                       (`*_cpu_overhead_ratio`: the same in the process's CPU seconds per step, every thread.)
- step_floor_ratio     (not a SPEC key) the physical floor of any durable miss, measured in the same run: the step
                       plus one copy of the batch into a reused buffer and a bare O_DIRECT write + fsync of
                       those bytes in the background (no checksum, no meta, no commit).
- hit_overhead_ratio   the same training step served from the cache by a SkipHarness with prefetch on, vs
                       the step with its batch already in memory (sample returns it, caching off).
- hit_floor_ratio      (not a SPEC key) the floor of any hit, measured in the same run: the same step reading
                       the same bytes (the files the hit arm serves) bare from the page cache -- mapped, no
                       copy, no listing, commit record, meta.json or checksum, decoded into tensors as the
                       trainer needs them, one step ahead on a background thread as the harness prefetches
                       -- vs the step with its batch in memory.
- hit_vs_floor_ratio   (not a SPEC key) the hit against that floor, step by step: the median of the per-step
                       ratios of the hit arm and the floor arm, alone, taking turns (target <= 1.02). What is
                       left above the floor is the checksum a hit must check and its O_DIRECT read from the
                       disk (the floor's bytes are in the page cache already).
- scan_10k_s           scan_namespace at 10,000 committed steps x K = 4, with the namespace index (warm:
                       median of three after the scan that builds the index); also at 1,000 steps, and
                       the full scan without the index (scan_full_*), for how the cost grows.
- scan_index_ratio     (not a SPEC key) scan_10k_s / scan_full_10k_s: the indexed scan against the full scan of
                       the same namespace in the same run (target <= 0.1).
- step_vs_floor_ratio  (not a SPEC key) the miss within 2% of the durable-copy floor measured beside it (target
                       <= 1.02): the median of the per-step ratios of the two arms alone, taking turns, as
                       hit_vs_floor_ratio; *_all_arms: the same beside every other arm (step_overhead_ratio's run).
- load_peak_mem_ratio  peak RSS growth of the verified read_inner + touching every tensor, in a fresh process
                       after a warm-up load, over the payload's tensor bytes.

Footprint and compression (issue 14; `skip.rollout_tq.compression=zstd`: integers narrowed losslessly, then
zstd at the default `compression_level`, on the writer thread):

- disk_ratio           bytes stored with narrowing + zstd over verl's torch.save of the same dense batch
                       (target <= 0.35); disk_ratio_narrow: narrowing alone. The same for a jagged batch as
                       verl's V1 trainer saves it ({"tensordict", "tags", "keys", "global_steps"}, jagged
                       nested tensors and NonTensorStack fields: disk_ratio_jagged, disk_ratio_jagged_narrow)
                       and for an MoE batch carrying routed experts (int16 [tokens, 48 layers, top-8 of 128]:
                       disk_ratio_moe, disk_ratio_moe_narrow).
- disk_ratio_grpo      bytes stored over verl's torch.save of a GRPO mini-batch (rows / 32 prompts x 8 samples,
                       verl V1's fields: scripts/_bench_grpo.py); disk_floor_ratio_grpo: over the zstd size of
                       its unique content (each prompt once, each response once, nothing derivable).
- step_vs_floor_ratio_grpo, hit_vs_floor_ratio_grpo, *_zstd_vs_floor_ratio_grpo (not SPEC keys) the step arms on the GRPO
                       batch, each against its floor; protocol_floor_vs_floor_ratio_grpo: SPEC's commit done bare (three files,
                       six fsyncs: scripts/_bench_protocol.py) against the floor, step_vs_protocol_floor_ratio_grpo: the miss
                       against it; *_se: each step-by-step figure's standard error.
- concurrent_hit_floor_ratio
                       four replays of one namespace at once (processes of their own, every one a reader beside
                       the recording that holds it): the slowest one's median hit step vs the slowest of four
                       bare verified reads at once, in the same processes, round by round (target <= 1.1);
                       concurrent_hit_ratio: the same slowest hit vs a lone replay's (a figure: on two cores
                       four CPU-bound readers cannot match one alone); replays_bytes_written: bytes of the
                       namespace the replays created or changed (must be 0). scripts/_bench_replays.py says how.
- step_overhead_ratio_zstd / hit_overhead_ratio_zstd
                       step_overhead_ratio and hit_overhead_ratio with compression on (targets unchanged);
                       their floors (`*_zstd_floor`) measured beside them: the miss's a bare copy narrowed and
                       compressed at the same level in the background, the hit's the same files mapped and
                       decoded bare; step_zstd_vs_floor_ratio / hit_zstd_vs_floor_ratio: step by step (<= 1.02).
                       save_zstd_mib_s / load_zstd_mib_s: durable save and verified load with compression on.

Token ids are Zipf-like over a 151,936-token vocabulary (rank k with probability ~ 1/k, ranks mapped to ids
by a fixed permutation): uniformly random ids are not what models emit and compress like noise.
Also: save/load throughput at two sizes (MiB/s), the writer's CPU seconds per save, and a save's floor.
The object-store rows (s3_*; `--no-s3` leaves them out) come from scripts/bench_s3.py (a moto S3 server
on 127.0.0.1); its docstring names its keys (s3_hit_vs_floor_ratio: against a bare GET of the same bytes).
Progress goes to stderr (logging); the result (a table, or JSON with --json) to stdout. The parts: _benchlib.py
(payloads, timing, the synthetic trainer), _bench_io.py (save / load / zstd / peak memory), _bench_steps.py (the
step arms and floors), _bench_protocol.py, _bench_grpo.py, _bench_scan.py, _bench_table.py (the table).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

# the bench's parts beside this file: `python scripts/bench.py` puts scripts/ first on sys.path
from _bench_grpo import GRPO_N, bench_grpo_steps, grpo_disk_ratios  # noqa: E402
from _bench_io import bench_checksum, bench_load, bench_mem, bench_save, bench_zstd, write_committed_step  # noqa: E402
from _bench_replays import REPLAYS, bench_replays  # noqa: E402
from _bench_scan import bench_scan, scan_namespace_for  # noqa: E402
from _bench_steps import bench_pairs, bench_steps  # noqa: E402
from _bench_table import KEYS, TARGETS, render_table  # noqa: E402,F401  (KEYS, TARGETS: read by tests)
from _benchlib import (  # noqa: E402,F401  (ZSTD_LEVEL, make_payload, disk_ratios: tests/test_compression.py reads them here)
    MOE_ROW_DIVISOR, PROMPT_LEN, RESPONSE_LEN, SCAN_K, ZSTD_LEVEL, MiB, BenchError, _with_threads, disk_ratios,
    log, make_jagged_payload, make_moe_payload, make_payload, tensor_bytes,
)

from skip_harness.store.open import open_store  # noqa: E402
from skip_harness.store.layout import Layout  # noqa: E402


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
        payload = make_payload(args.rows)
        small = make_payload(max(1, args.rows // 4), seed=1)
        payload_bytes, small_bytes = tensor_bytes(payload), tensor_bytes(small)
        log.info("payload: %d trajectories x %d tokens, %.1f MiB of tensors (and %.1f MiB); work dir %s (%s)",
                 args.rows, PROMPT_LEN + RESPONSE_LEN, payload_bytes / MiB, small_bytes / MiB, work, fs)
        result: Dict[str, Any] = {
            "payload_bytes": payload_bytes,
            "payload_rows": args.rows,
            "payload_tokens": PROMPT_LEN + RESPONSE_LEN,
            "small_payload_bytes": small_bytes,
            "repeats": args.repeats,
            "quick": bool(args.quick),
            "work_fs": fs,
            "cpu_count": os.cpu_count(),
            "compute_threads": args.compute_threads,
        }

        log.info("checksum throughput")
        result["xxh3_gbps"] = bench_checksum(payload)

        log.info("save: durable write_inner vs torch.save + fsync + rename (and the floor), %d repeats", args.repeats)
        result.update(bench_save(payload, work, args.repeats))
        small_save = bench_save(small, work, args.repeats, floors=False)
        result.update({"save_small_mib_s": small_save["save_mib_s"], "bare_save_small_mib_s": small_save["bare_save_mib_s"],
                       "save_small_ratio": small_save["save_ratio"]})

        log.info("load: verified read_inner vs torch.load(weights_only=True), %d repeats", args.repeats)
        load_store = open_store(Layout(work / "load_ns", K=1, W=1))
        big_file = write_committed_step(load_store, 1, payload)
        small_file = write_committed_step(load_store, 2, small)
        warm_file = write_committed_step(load_store, 3, make_payload(4, seed=3))
        bare = {n: work / f"load_bare_{n}.pt" for n in ("big", "small", "warm")}
        for name, obj in (("big", payload), ("small", small), ("warm", make_payload(4, seed=3))):
            torch.save(obj, bare[name])
        result.update(bench_load(load_store, 1, bare["big"], args.repeats, payload_bytes))
        small_load = bench_load(load_store, 2, bare["small"], args.repeats, small_bytes)
        result.update({"load_small_mib_s": small_load["load_mib_s"], "bare_load_small_mib_s": small_load["bare_load_mib_s"],
                       "load_small_ratio": small_load["load_ratio"]})
        del big_file, small_file, warm_file

        log.info("peak memory of a load, in fresh processes")
        result.update(bench_mem(load_store.layout.root, bare["big"], bare["warm"], payload_bytes))
        shutil.rmtree(load_store.layout.root, ignore_errors=True)
        for p in bare.values():
            p.unlink()

        log.info("footprint: narrowed + zstd and narrowed alone vs verl's torch.save (dense, jagged, MoE)")
        for tag, batch in (("", payload), ("_jagged", make_jagged_payload(args.rows, seed=4)),
                           ("_moe", make_moe_payload(max(1, args.rows // MOE_ROW_DIVISOR), seed=5))):
            ratios = disk_ratios(batch, work / "footprint")
            result.update({f"disk_ratio{tag}": ratios["zstd"], f"disk_ratio{tag}_narrow": ratios["narrow"],
                           f"verl_bytes{tag}": ratios["verl_bytes"]})
            del batch
        grpo_prompts = max(2, args.rows // 32)
        log.info("footprint of a GRPO mini-batch (%d prompts x %d samples, verl V1's fields) and of its unique "
                 "content", grpo_prompts, GRPO_N)
        result.update(grpo_disk_ratios(grpo_prompts, work / "footprint"))
        log.info("compressed save and load, %d repeats", args.repeats)
        result.update(bench_zstd(payload, work, args.repeats))

        log.info("training steps: caching off / async write / floor / sync write / verl-style / hit / hit floor / "
                 "batch in memory, and async / hit with compression=zstd, %d steps x %d rounds, on %d thread(s)",
                 args.steps_per_arm, args.step_rounds, args.compute_threads)
        # each arm next to its floor: a pair apart read the miss 1.8 % dearer (docs/benchmark.md)
        modes = ("off", "async", "floor", "sync", "verl", "hit", "hit_floor", "memory", *(f"{m}_zstd" for m in ("async", "floor", "hit", "hit_floor")))
        many = _with_threads(args.compute_threads, lambda: bench_steps(
            payload, work, result["bare_save_s"], args.steps_per_arm, args.step_rounds, args.compute_threads, modes))
        result.update({
            "step_compute_s": many["compute_s"], "step_off_s": many["off_s"], "step_s": many["async_s"],
            "step_sync_s": many["sync_s"], "step_hit_s": many["hit_s"], "step_memory_s": many["memory_s"],
            "step_overhead_ratio": many["async_s"] / many["off_s"],
            "sync_overhead_ratio": many["sync_s"] / many["off_s"],
            "verl_sync_overhead_ratio": many["verl_s"] / many["off_s"], "step_verl_s": many["verl_s"],
            "hit_overhead_ratio": many["hit_s"] / many["memory_s"],
            # The floor of any hit, side by side (see HitFloorArm): the same bytes mapped bare from the
            # page cache, one step ahead; the hit against it step by step.
            "step_hit_floor_s": many["hit_floor_s"], "hit_floor_ratio": many["hit_floor_s"] / many["memory_s"],
            "hit_floor_cpu_overhead_ratio": many["hit_floor_cpu_s"] / many["memory_cpu_s"],
            # CPU seconds of the whole process per step (compute threads, writer, prefetch): what the
            # step costs a machine whose every core is busy, independent of other jobs' load.
            "step_cpu_s": many["async_cpu_s"], "step_off_cpu_s": many["off_cpu_s"],
            "step_cpu_overhead_ratio": many["async_cpu_s"] / many["off_cpu_s"],
            "sync_cpu_overhead_ratio": many["sync_cpu_s"] / many["off_cpu_s"],
            "hit_cpu_overhead_ratio": many["hit_cpu_s"] / many["memory_cpu_s"],
            # Untimed waits after each step for its write to be durable: work an async write left undone.
            "step_flush_s": many["async_flush_s"],
            # The floor of any durable miss, measured side by side (see FloorArm): one copy of the batch,
            # and a bare O_DIRECT write + fsync of its bytes in the background.
            "step_floor_s": many["floor_s"], "step_floor_ratio": many["floor_s"] / many["off_s"],
            "floor_cpu_overhead_ratio": many["floor_cpu_s"] / many["off_cpu_s"],
            # compression=zstd: the same step and hit, the writer narrowing and compressing each batch
            "step_zstd_s": many["async_zstd_s"], "step_hit_zstd_s": many["hit_zstd_s"],
            "step_overhead_ratio_zstd": many["async_zstd_s"] / many["off_s"],
            "hit_overhead_ratio_zstd": many["hit_zstd_s"] / many["memory_s"],
            "step_cpu_overhead_ratio_zstd": many["async_zstd_cpu_s"] / many["off_cpu_s"],
            "hit_cpu_overhead_ratio_zstd": many["hit_zstd_cpu_s"] / many["memory_cpu_s"],
            "step_flush_zstd_s": many["async_zstd_flush_s"],
        })
        # Floors beside the zstd targets, measured side by side as the uncompressed ones: a bare copy whose
        # tensors are narrowed and compressed on a background thread (FloorArm), the hit's files mapped
        # and decoded bare (HitFloorArm).
        result.update({"step_overhead_ratio_zstd_floor": many["floor_zstd_s"] / many["off_s"],
                       "hit_overhead_ratio_zstd_floor": many["hit_floor_zstd_s"] / many["memory_s"]})
        # The miss and the hit against their floors step by step (target 1.02): each pair alone (bench_pairs)
        result.update(_with_threads(args.compute_threads, lambda: bench_pairs(
            payload, work, result["bare_save_s"], args.pair_steps, args.compute_threads, many)))
        if args.compute_threads != 1:
            log.info("training steps again with a one-thread compute step")
            one = _with_threads(1, lambda: bench_steps(payload, work, result["bare_save_s"], args.steps_per_arm,
                                                       args.step_rounds, 1, ("off", "async", "sync")))
            result.update({
                "step_compute_1thread_s": one["compute_s"],
                "step_overhead_ratio_1thread": one["async_s"] / one["off_s"],
                "sync_overhead_ratio_1thread": one["sync_s"] / one["off_s"],
            })

        log.info("training steps on the GRPO batch (%d prompts x %d samples): off / async / floor / hit / hit floor / "
                 "in memory / async and hit with zstd", grpo_prompts, GRPO_N)
        result.update(bench_grpo_steps(grpo_prompts, work, args.repeats, args.steps_per_arm, args.step_rounds,
                                       args.pair_steps, args.compute_threads, _with_threads))

        log.info("concurrent replays: %d replays of one namespace at once vs a lone replay beside them, %d steps",
                 REPLAYS, args.steps_per_arm)
        result.update(bench_replays(payload, work, args.steps_per_arm))

        for steps in args.scan_steps:
            log.info("startup scan: %d steps x K=%d", steps, SCAN_K)
            layout = scan_namespace_for(base if user_work else work, steps, reuse=user_work)
            scan = bench_scan(layout, steps)
            tag = f"{steps // 1000}k" if steps % 1000 == 0 else str(steps)
            result.update({f"scan_{tag}_s": scan["s"], f"scan_full_{tag}_s": scan["full_s"],
                           f"scan_first_{tag}_s": scan["first_s"]})
        largest = max(args.scan_steps)
        tag = f"{largest // 1000}k" if largest % 1000 == 0 else str(largest)
        result["scan_10k_extrapolated"] = largest != 10_000
        if largest != 10_000:  # scaled linearly from the largest size measured, and flagged
            for key in ("scan", "scan_full", "scan_first"):
                result[f"{key}_10k_s"] = result[f"{key}_{tag}_s"] * 10_000 / largest
        # Judged within one run (this VM's speed moves with its neighbours): the indexed scan against the full
        # scan of the same namespace (the miss against its floor: bench_pairs, above).
        result["scan_index_ratio"] = result["scan_10k_s"] / result["scan_full_10k_s"]
        if not args.no_s3:
            result.update(bench_object_store(args))
        if not args.no_tier:
            result.update(bench_second_tier(args))
        return result
    finally:
        log.info("removing %s", work)
        shutil.rmtree(work, ignore_errors=True)


def _rows_of(script: str, cmd_args: Sequence[str], what: str, ok=(0, 3)) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / script), "--json", *cmd_args],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode not in ok:
        raise BenchError(f"{what} (scripts/{script}) failed with exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def bench_object_store(args: argparse.Namespace) -> Dict[str, Any]:
    """The object-store rows: scripts/bench_s3.py run as a subprocess (it starts its own moto S3 server
    on 127.0.0.1): save / load vs a bare put / get of the same bytes, and the training steps with an
    s3:// dump_dir -- three steps a round, one round: moto stores every put in Python, so a full-size
    step arm on it takes minutes; the step ratios are judged against each other within the run, like
    the POSIX ones. Skipped, and said so, where obstore or moto is not installed (extra [dev] / [s3])."""
    log.info("object store (moto on 127.0.0.1): save / load vs bare put / get, and training steps")
    proc = _rows_of("bench_s3.py", ["--rows", str(args.rows), "--repeats", str(args.repeats), "--steps", "3",
                                    "--rounds", "1"], "the object-store rows")
    if proc.returncode == 3:            # bench_s3.py: obstore or moto missing
        reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "not installed"
        log.warning("object-store rows skipped: %s", reason)
        return {"s3_skipped": reason}
    return json.loads(proc.stdout)


def bench_second_tier(args: argparse.Namespace) -> Dict[str, Any]:
    """The second tier's rows (issue 32): scripts/bench_tier.py run as a subprocess -- the demo with a
    reference KL term and a reward costing as much as its generation, recorded and replayed with the
    tier and without it; replay_step_ratio_tier / _no_tier (its docstring says how)."""
    log.info("second tier: the demo replayed with rewards and reference log-probs served, and without")
    doc = json.loads(_rows_of("bench_tier.py", ["--quick"] if args.quick else [], "the second tier's rows", ok=(0,)).stdout)
    return {k: v for k, v in doc.items() if k.startswith(("tier_", "replay_step_ratio"))}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--json-out", default=None, metavar="FILE",
                   help="also write the JSON document to FILE (the table is still printed; CI keeps its quick run's)")
    p.add_argument("--rows", type=int, default=None,
                   help=f"trajectories per mini-batch of {PROMPT_LEN}+{RESPONSE_LEN} tokens (default 1024; --quick: 64)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats of save and load (default 7; --quick: 3)")
    p.add_argument("--scan-steps", type=int, nargs="+", default=None,
                   help="sizes of the scan namespaces (default 1000 10000; --quick: 1000)")
    p.add_argument("--steps-per-arm", type=int, default=None, help="training steps per arm and round (default 6; --quick: 3)")
    p.add_argument("--step-rounds", type=int, default=None, help="rounds of steps (default 6; --quick: 1; GRPO arms: twice): each arm runs 1 + steps x rounds steps")
    p.add_argument("--pair-steps", type=int, default=None, help="steps of each arm taking turns with its floor alone (default 40; --quick: 3; GRPO: twice)")
    p.add_argument("--compute-threads", type=int, default=None,
                   help="torch threads of the synthetic step (default: every core; the one-thread figure is reported too)")
    p.add_argument("--quick", action="store_true", help="small and short, for CI")
    p.add_argument("--work-dir", default=None,
                   help="where to write (default: a temp dir, removed at the end); the scan namespaces are kept there for reuse")
    p.add_argument("--no-s3", action="store_true", help="skip the object-store rows (they start a moto S3 server)")
    p.add_argument("--no-tier", action="store_true", help="skip the second tier's rows (the demo recorded and replayed)")
    p.add_argument("-v", "--verbose", action="store_true", help="also show the harness's own log lines")
    args = p.parse_args(argv)
    defaults = dict(rows=64 if args.quick else 1024, repeats=3 if args.quick else 7,
                    scan_steps=[1000] if args.quick else [1000, 10_000], steps_per_arm=3 if args.quick else 6,
                    step_rounds=1 if args.quick else 6, pair_steps=3 if args.quick else 40, compute_threads=os.cpu_count() or 1)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("rows", "repeats", "steps_per_arm", "step_rounds", "pair_steps", "compute_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.scan_steps):
        p.error(f"--scan-steps must be >= 1, got {args.scan_steps}")
    if args.json_out and not Path(args.json_out).expanduser().parent.is_dir():
        # checked before the run: a missing folder would lose minutes of measuring at the end
        p.error(f"--json-out {args.json_out}: its folder does not exist")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="[%(asctime)s][%(name)s] %(message)s")
    logging.getLogger("skip_harness").setLevel(logging.INFO if args.verbose else logging.WARNING)
    log.setLevel(logging.INFO)
    try:
        result = run(args)
    except BenchError as exc:
        log.error("%s", exc)
        return 1
    doc = json.dumps(result, indent=1) + "\n"
    if args.json_out:
        Path(args.json_out).expanduser().write_text(doc)
    if args.json:
        sys.stdout.write(doc)
    else:
        sys.stdout.write(render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
