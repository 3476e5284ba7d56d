"""The benchmark's table (scripts/bench.py without --json): every figure of a run, each ratio beside
its target where the SPEC or an issue sets one."""
from __future__ import annotations

from typing import Any, Dict

from _benchlib import MiB, ZSTD_LEVEL

KEYS = ("save_ratio", "load_ratio", "step_overhead_ratio", "sync_overhead_ratio", "hit_overhead_ratio",  # SPEC
        "scan_10k_s", "load_peak_mem_ratio", "disk_ratio", "disk_ratio_narrow", "step_overhead_ratio_zstd",
        "hit_overhead_ratio_zstd")
TARGETS = {"s3_save_ratio": 1.1, "s3_load_ratio": 1.1, "save_ratio": 1.05, "load_ratio": 0.6, "step_overhead_ratio": 1.05, "hit_overhead_ratio": 1.05,
           "step_vs_floor_ratio": 1.02, "hit_vs_floor_ratio": 1.02, "s3_hit_vs_floor_ratio": 1.02,
           "scan_index_ratio": 0.1,
           "scan_10k_s": 0.25, "load_peak_mem_ratio": 1.1, "disk_ratio": 0.35, "step_overhead_ratio_zstd": 1.05,
           "hit_overhead_ratio_zstd": 1.05, "concurrent_hit_floor_ratio": 1.1,
           "disk_ratio_grpo": 0.15, "disk_floor_ratio_grpo": 1.1,
           "step_vs_floor_ratio_grpo": 1.02, "hit_vs_floor_ratio_grpo": 1.02, "step_zstd_vs_floor_ratio_grpo": 1.02,
           "hit_zstd_vs_floor_ratio_grpo": 1.02, "step_zstd_vs_floor_ratio": 1.02, "hit_zstd_vs_floor_ratio": 1.02,
           "replay_step_ratio_tier": 0.2}



def render_table(r: Dict[str, Any]) -> str:
    def row(name: str, ours: str, bare: str, ratio: str, target: str = "") -> str:
        return f"{name:<42}{ours:>14}{bare:>14}{ratio:>9}{target:>9}\n"

    def tgt(key: str) -> str:
        return f"<= {TARGETS[key]:g}" if key in TARGETS else ""

    def floor_row(name: str, ours: str, floor: str, paired: str) -> str:
        """An arm over its baseline, its floor over the same baseline, and the two step by step (with the
        step-by-step figure's standard error, where measured)."""
        return with_se(row(name, f"{r[ours]:.3f}", f"{r[floor]:.3f}", f"{r[paired]:.3f}", tgt(paired)), paired)

    def with_se(line: str, paired: str) -> str:
        return line[:-1] + f"  (s.e. {r[paired + '_se']:.3f})\n" if f"{paired}_se" in r else line

    def paired_row(name: str, paired: str) -> str:
        """A step-by-step figure of two arms neither of which is the step without caching
        (scripts/_bench_protocol.py), with its standard error."""
        return with_se(row(name, "", "", f"{r[paired]:.3f}", tgt(paired)), paired)

    scan_note = "scaled from the largest size measured" if r["scan_10k_extrapolated"] else "measured"
    out = (
        f"skip_harness benchmark: payload {r['payload_bytes'] / MiB:.1f} MiB ({r['payload_rows']} trajectories x "
        f"{r['payload_tokens']} tokens), medians of {r['repeats']} interleaved repeats, work dir on {r['work_fs']}, "
        f"{r['cpu_count']} cores\n\n"
        + row("", "skip_harness", "bare", "ratio", "target")
        + row("save (durable)", f"{r['save_s']:.3f} s", f"{r['bare_save_s']:.3f} s", f"{r['save_ratio']:.2f}",
              tgt("save_ratio"))
        + row("load (+ verify, every byte touched)", f"{r['load_s']:.3f} s", f"{r['bare_load_s']:.3f} s",
              f"{r['load_ratio']:.2f}", tgt("load_ratio"))
        + row(f"training step, miss, async ({r['compute_threads']} thr)", f"{r['step_s']:.3f} s",
              f"{r['step_off_s']:.3f} s", f"{r['step_overhead_ratio']:.2f}", tgt("step_overhead_ratio"))
        + row("training step, miss, async_write=false", f"{r['step_sync_s']:.3f} s", f"{r['step_off_s']:.3f} s",
              f"{r['sync_overhead_ratio']:.2f}")
        + row("training step, miss, torch.save (verl)", f"{r['step_verl_s']:.3f} s", f"{r['step_off_s']:.3f} s",
              f"{r['verl_sync_overhead_ratio']:.2f}")
        + row("training step, hit (prefetch) vs in memory", f"{r['step_hit_s']:.3f} s",
              f"{r['step_memory_s']:.3f} s", f"{r['hit_overhead_ratio']:.2f}", tgt("hit_overhead_ratio"))
        + row("training step, hit floor (page cache) vs in memory", f"{r['step_hit_floor_s']:.3f} s",
              f"{r['step_memory_s']:.3f} s", f"{r['hit_floor_ratio']:.2f}")
        + row("training step, miss, async, zstd", f"{r['step_zstd_s']:.3f} s", f"{r['step_off_s']:.3f} s",
              f"{r['step_overhead_ratio_zstd']:.2f}", tgt("step_overhead_ratio_zstd"))
        + row("training step, hit, zstd vs in memory", f"{r['step_hit_zstd_s']:.3f} s", f"{r['step_memory_s']:.3f} s",
              f"{r['hit_overhead_ratio_zstd']:.2f}", tgt("hit_overhead_ratio_zstd"))
        + row("disk: narrow + zstd / verl torch.save", f"{r['zstd_stored_bytes'] / MiB:.1f} MiB",
              f"{r['verl_bytes'] / MiB:.1f} MiB", f"{r['disk_ratio']:.3f}", tgt("disk_ratio"))
        + row("disk: narrowed alone / verl torch.save", "", "", f"{r['disk_ratio_narrow']:.3f}")
        + row("disk, jagged (verl V1): zstd / narrow", "", f"{r['verl_bytes_jagged'] / MiB:.1f} MiB",
              f"{r['disk_ratio_jagged']:.3f}", f"{r['disk_ratio_jagged_narrow']:.3f}")
        + row("disk, MoE routed experts: zstd / narrow", "", f"{r['verl_bytes_moe'] / MiB:.1f} MiB",
              f"{r['disk_ratio_moe']:.3f}", f"{r['disk_ratio_moe_narrow']:.3f}")
        + (row("disk, GRPO (verl V1, n = 8): zstd / verl", f"{r['stored_bytes_grpo'] / MiB:.1f} MiB",
               f"{r['verl_bytes_grpo'] / MiB:.1f} MiB", f"{r['disk_ratio_grpo']:.3f}", tgt("disk_ratio_grpo"))
           + row("disk, GRPO: zstd / its unique content's zstd", f"{r['stored_bytes_grpo'] / MiB:.1f} MiB",
                 f"{r['floor_bytes_grpo'] / MiB:.1f} MiB", f"{r['disk_floor_ratio_grpo']:.3f}",
                 tgt("disk_floor_ratio_grpo"))
           if "disk_ratio_grpo" in r else "")
        + row("peak memory of a load / payload", f"{r['load_peak_mem_ratio']:.2f}",
              f"{r['bare_load_peak_mem_ratio']:.2f}", "", tgt("load_peak_mem_ratio"))
        + row("startup scan, 10,000 steps x K=4", f"{r['scan_10k_s']:.3f} s", f"{r['scan_full_10k_s']:.3f} s",
              f"{r['scan_index_ratio']:.3f}", tgt("scan_index_ratio"))
        + "".join(
            row(label, "", "", f"{r[key]:.2f}", tgt(key))
            for label, key in (("object store: save vs bare put", "s3_save_ratio"),
                               ("object store: verified load vs bare get", "s3_load_ratio"),
                               ("object store: training step, miss vs off", "s3_step_overhead_ratio"),
                               ("object store: training step, hit vs memory", "s3_hit_overhead_ratio"))
            if key in r)
        + (row("object store: miss vs the put floor beside it", f"{r['s3_step_overhead_ratio']:.3f}",
               f"{r['s3_step_floor_ratio']:.3f}", f"{r['s3_step_vs_floor_ratio']:.3f}")
           if "s3_step_vs_floor_ratio" in r else "")
        + floor_row("miss async vs the durable-copy floor beside it", "step_overhead_ratio", "step_floor_ratio",
                    "step_vs_floor_ratio")
        + floor_row("hit vs the page-cache floor beside it", "hit_overhead_ratio", "hit_floor_ratio", "hit_vs_floor_ratio")
        + floor_row("zstd: miss vs its floor beside it", "step_overhead_ratio_zstd", "step_overhead_ratio_zstd_floor",
                    "step_zstd_vs_floor_ratio")
        + floor_row("zstd: hit vs its floor beside it", "hit_overhead_ratio_zstd", "hit_overhead_ratio_zstd_floor",
                    "hit_zstd_vs_floor_ratio")
        + (floor_row("GRPO batch: miss vs its durable-copy floor", "step_overhead_ratio_grpo", "step_floor_ratio_grpo",
                     "step_vs_floor_ratio_grpo")
           + floor_row("GRPO batch: hit vs its page-cache floor", "hit_overhead_ratio_grpo", "hit_floor_ratio_grpo",
                       "hit_vs_floor_ratio_grpo")
           + floor_row("GRPO batch, zstd: miss vs its floor", "step_overhead_ratio_zstd_grpo",
                       "step_overhead_ratio_zstd_floor_grpo", "step_zstd_vs_floor_ratio_grpo")
           + floor_row("GRPO batch, zstd: hit vs its floor", "hit_overhead_ratio_zstd_grpo",
                       "hit_overhead_ratio_zstd_floor_grpo", "hit_zstd_vs_floor_ratio_grpo")
           if "step_vs_floor_ratio_grpo" in r else "")
        + (paired_row("GRPO: SPEC's commit, bare, vs the floor", "protocol_floor_vs_floor_ratio_grpo")
           + paired_row("GRPO: miss vs SPEC's commit, bare", "step_vs_protocol_floor_ratio_grpo")
           if "protocol_floor_vs_floor_ratio_grpo" in r else "")
        + (row("object store: hit vs the bare-GET floor beside it", f"{r['s3_hit_overhead_ratio']:.3f}",
               f"{r['s3_hit_floor_ratio']:.3f}", f"{r['s3_hit_vs_floor_ratio']:.3f}", tgt("s3_hit_vs_floor_ratio"))
           if "s3_hit_vs_floor_ratio" in r else "")
        + (row(f"{r['concurrent_replays']} replays at once vs {r['concurrent_replays']} bare reads at once",
               f"{r['concurrent_hit_s']:.3f} s", f"{r['concurrent_floor_s']:.3f} s",
               f"{r['concurrent_hit_floor_ratio']:.2f}", tgt("concurrent_hit_floor_ratio"))
           if "concurrent_hit_floor_ratio" in r else "")
        + (row(f"{r['concurrent_replays']} replays at once vs a lone one", f"{r['concurrent_hit_s']:.3f} s",
               f"{r['lone_hit_s']:.3f} s", f"{r['concurrent_hit_ratio']:.2f}", tgt("concurrent_hit_ratio"))
           if "concurrent_hit_ratio" in r else "")
        + (row("second tier: replay step / recorded step", f"{r['tier_replay_step_s']:.3f} s",
               f"{r['tier_record_step_s']:.3f} s", f"{r['replay_step_ratio_tier']:.3f}", tgt("replay_step_ratio_tier"))
           + row("  the same, tier off (reward, reference rerun)", f"{r['tier_replay_no_tier_step_s']:.3f} s",
                 f"{r['tier_record_step_s']:.3f} s", f"{r['replay_step_ratio_no_tier']:.3f}")
           if "replay_step_ratio_tier" in r else "")
        + "\n"
        + (f"bytes the concurrent replays wrote into the namespace: {r['replays_bytes_written']}\n"
           if "replays_bytes_written" in r else "")
        + f"floor of any durable miss, side by side (one copy of the batch + a bare O_DIRECT write + fsync in the "
          f"background): {r['step_floor_ratio']:.3f} (CPU {r['floor_cpu_overhead_ratio']:.2f})\n"
        + f"CPU seconds per step (all threads): miss async {r['step_cpu_overhead_ratio']:.2f}, sync "
          f"{r['sync_cpu_overhead_ratio']:.2f}, hit {r['hit_cpu_overhead_ratio']:.2f} x the uncached step's\n"
        + (f"one-thread compute step: miss async {r['step_overhead_ratio_1thread']:.2f}, sync "
           f"{r['sync_overhead_ratio_1thread']:.2f}\n" if "step_overhead_ratio_1thread" in r else "")
        + f"scan: with the index vs the full scan ('bare' column; {scan_note}); first scan, building the index: "
          f"{r['scan_first_10k_s']:.2f} s\n"
        + f"throughput: save {r['save_mib_s']:.0f} / {r['save_small_mib_s']:.0f} MiB/s, load {r['load_mib_s']:.0f} / "
          f"{r['load_small_mib_s']:.0f} MiB/s ({r['payload_bytes'] / MiB:.0f} / {r['small_payload_bytes'] / MiB:.0f} MiB)\n"
        + f"floor of a save: bare write + fsync of the bytes {r['floor_write_fsync_s']:.3f} s (save / floor "
          f"{r['save_floor_ratio']:.2f}), memcpy {r['floor_memcpy_s']:.3f} s; writer CPU per save "
          f"{r['save_cpu_s']:.3f} s vs torch.save {r['bare_save_cpu_s']:.3f} s\n"
        + f"synthetic step computes {r['step_compute_s']:.3f} s; xxh3_128 {r['xxh3_gbps']:.1f} GB/s in memory\n"
        + f"zstd (level {ZSTD_LEVEL}): save {r['save_zstd_mib_s']:.0f} MiB/s, load {r['load_zstd_mib_s']:.0f} MiB/s (of the "
          f"batch's tensors); narrow + compress {r['zstd_compress_cpu_s']:.3f} CPU s, decompress {r['zstd_decompress_s']:.3f} s "
          f"a batch; CPU per step: miss {r['step_cpu_overhead_ratio_zstd']:.2f}, hit "
          f"{r['hit_cpu_overhead_ratio_zstd']:.2f} x the uncached step's\n"
    )
    return out

