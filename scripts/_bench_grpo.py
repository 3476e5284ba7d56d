"""The bench's GRPO mini-batch and its floor (SPEC, "Benchmark": `disk_ratio_grpo`, `disk_floor_ratio_grpo`).

What a GRPO step of verl's V1 trainer holds, unlike the bench's other batches: `n` samples share each
prompt, and the batch carries fields that follow from others. Per trajectory, as verl's V1 trainer saves a
mini-batch (`{"tensordict", "tags", "keys", "global_steps"}`, the tensordict made by verl's own
`list_of_dict_to_tensordict` when verl is installed, else the same layout by hand):

- `prompts` (the group's prompt: the same ids `n` times over), `responses`, `input_ids` = prompt + response;
- `attention_mask` (ones over prompt + response), `position_ids` (0 .. prompt + response - 1) and
  `response_mask` (ones over the response): they follow from the two lengths;
- `rollout_log_probs` (the generator's) and `old_log_probs` (the trainer's recomputation: the same values
  up to float noise), float32 over the response;
- `rewards` (one float), `uid` (the group's id) and `messages` (the group's chat prompt): non-tensor.

Prompt lengths are drawn from [P/4, P], response lengths from [R/8, R] (P = 1,024, R = 3,072 tokens), ids
Zipf-like over the 151,936-token vocabulary (`_benchlib.zipf_token_ids`).

The floor is what storing each thing once would cost with the codec's own narrowing and zstd: the zstd
size (`codec.save_to`, the bench's stored form) of the batch's unique content -- each distinct prompt once,
each response once, both log-prob fields, the rewards, and each group's uid and messages once -- with
nothing derivable (input_ids, masks, position ids) stored at all.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import torch

from _benchlib import PROMPT_LEN, RESPONSE_LEN, ZSTD, stored_bytes, torch_save_bytes, v1_minibatch, zipf_token_ids

GRPO_N = 8                    # samples per prompt (a common GRPO setting)


def grpo_trajectories(prompts: int, n: int = GRPO_N, seed: int = 0, prompt_len: int = PROMPT_LEN,
                      response_len: int = RESPONSE_LEN) -> List[Dict[str, Any]]:
    """`prompts` groups of `n` trajectories, as dicts of verl V1's per-trajectory fields."""
    g = torch.Generator().manual_seed(seed)
    out: List[Dict[str, Any]] = []
    for p in range(prompts):
        plen = int(torch.randint(prompt_len // 4, prompt_len + 1, (1,), generator=g))
        prompt = zipf_token_ids((plen,), g)
        uid = f"{seed:04x}{p:08x}"
        messages = [{"role": "user", "content": f"question {p} of the bench, seed {seed}"}]
        for _ in range(n):
            rlen = int(torch.randint(response_len // 8, response_len + 1, (1,), generator=g))
            response = zipf_token_ids((rlen,), g)
            rollout = -torch.rand(rlen, generator=g) * 6
            old = rollout + torch.randn(rlen, generator=g) * 1e-3     # the trainer's recomputation
            out.append({
                "prompts": prompt.clone(), "responses": response, "input_ids": torch.cat([prompt, response]),
                "attention_mask": torch.ones(plen + rlen, dtype=torch.int64),
                "position_ids": torch.arange(plen + rlen, dtype=torch.int64),
                "response_mask": torch.ones(rlen, dtype=torch.int64),
                "rollout_log_probs": rollout, "old_log_probs": old,
                "rewards": torch.rand((), generator=g),
                "messages": messages, "uid": uid,
            })
    return out


def make_grpo_payload(prompts: int, n: int = GRPO_N, seed: int = 0) -> Dict[str, Any]:
    """The GRPO mini-batch as verl's V1 trainer saves it."""
    return v1_minibatch(grpo_trajectories(prompts, n, seed), seed)


def unique_content(prompts: int, n: int = GRPO_N, seed: int = 0) -> Dict[str, Any]:
    """The same batch's content with each thing once: distinct prompts, responses, the two log-prob fields,
    rewards, and one uid and one chat prompt a group. Nothing derivable."""
    trajectories = grpo_trajectories(prompts, n, seed)
    groups = trajectories[::n]
    jagged = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return {
        "prompts": jagged([t["prompts"] for t in groups]),
        "responses": jagged([t["responses"] for t in trajectories]),
        "rollout_log_probs": jagged([t["rollout_log_probs"] for t in trajectories]),
        "old_log_probs": jagged([t["old_log_probs"] for t in trajectories]),
        "rewards": torch.stack([t["rewards"] for t in trajectories]),
        "uid": [t["uid"] for t in groups],
        "messages": [t["messages"] for t in groups],
    }


def grpo_disk_ratios(prompts: int, work: Path, n: int = GRPO_N, seed: int = 6) -> Dict[str, float]:
    """disk_ratio_grpo: bytes stored (narrowed + zstd) over verl's torch.save of the GRPO batch;
    disk_floor_ratio_grpo: bytes stored over the zstd size of the batch's unique content."""
    work.mkdir(parents=True, exist_ok=True)
    batch = make_grpo_payload(prompts, n, seed)
    verl = torch_save_bytes(batch, work / "grpo_verl.pt")
    stored = stored_bytes(batch, ZSTD, work / "grpo_z.bin")
    del batch
    floor = stored_bytes(unique_content(prompts, n, seed), ZSTD, work / "grpo_floor.bin")
    return {"disk_ratio_grpo": stored / verl, "disk_floor_ratio_grpo": stored / floor,
            "verl_bytes_grpo": verl, "stored_bytes_grpo": stored, "floor_bytes_grpo": floor,
            "grpo_prompts": prompts, "grpo_n": n}


# A GRPO step is about a third of the dense one, and 2 % of it is 4 ms: at 18 paired steps a run's median
# ratio moved by +-1.5 % around the 1.014 that 60 steps read (docs/benchmark.md); twice the rounds cost
# less time than the dense arms' and narrow that.
ROUNDS_FACTOR = 2


def bench_grpo_steps(prompts: int, work: Path, repeats: int, steps: int, rounds: int, pair_steps: int, threads: int,
                     with_threads: Any) -> Dict[str, float]:
    """The training-step arms on the GRPO batch (issue: "the miss and hit within 1.02 of their floors on
    every batch"): caching off, the miss and its durable-copy floor, the hit and its page-cache floor, the
    batch in memory, and the miss and hit with compression=zstd -- side by side, as on the dense batch,
    for ROUNDS_FACTOR times `rounds`. Keys end in `_grpo`."""
    from _bench_io import bench_save
    from _bench_steps import bench_pairs, bench_steps

    batch = make_grpo_payload(prompts, GRPO_N, seed=7)
    bare_save_s = bench_save(batch, work, repeats, floors=False)["bare_save_s"]
    modes = ("off", "async", "floor", "hit", "hit_floor", "memory", "async_zstd", "floor_zstd", "hit_zstd",
             "hit_floor_zstd")
    m = with_threads(threads, lambda: bench_steps(batch, work, bare_save_s, steps, ROUNDS_FACTOR * rounds, threads,
                                                  modes))
    return {
        "step_off_s_grpo": m["off_s"], "step_s_grpo": m["async_s"], "step_hit_s_grpo": m["hit_s"],
        "step_overhead_ratio_grpo": m["async_s"] / m["off_s"], "step_floor_ratio_grpo": m["floor_s"] / m["off_s"],
        "hit_overhead_ratio_grpo": m["hit_s"] / m["memory_s"],
        "hit_floor_ratio_grpo": m["hit_floor_s"] / m["memory_s"],
        "step_overhead_ratio_zstd_grpo": m["async_zstd_s"] / m["off_s"],
        "hit_overhead_ratio_zstd_grpo": m["hit_zstd_s"] / m["memory_s"],
        # the zstd figures' floors, measured beside them as the uncompressed ones: the miss's copies and
        # compresses each tensor bare (FloorArm), the hit's maps and decodes the hit's files bare (HitFloorArm)
        "step_overhead_ratio_zstd_floor_grpo": m["floor_zstd_s"] / m["off_s"],
        "hit_overhead_ratio_zstd_floor_grpo": m["hit_floor_zstd_s"] / m["memory_s"],
        # each arm against its floor step by step, the two alone (bench_pairs), for twice the dense pairs' steps
        **with_threads(threads, lambda: bench_pairs(batch, work, bare_save_s, ROUNDS_FACTOR * pair_steps, threads, m,
                                                    "_grpo")),
        **with_threads(threads, lambda: _protocol(batch, work, bare_save_s, ROUNDS_FACTOR * pair_steps, threads)),
    }


def _protocol(batch: Any, work: Path, bare_save_s: float, steps: int, threads: int) -> Dict[str, float]:
    """The miss, its floor and the floor with SPEC's commit protocol done bare (scripts/_bench_protocol.py),
    the three alone, taking turns for `steps` steps: `step_vs_protocol_floor_ratio_grpo` (what the harness's
    own code costs over the contract) and `protocol_floor_vs_floor_ratio_grpo` (what the contract costs over
    the durable copy, on this disk), each with its `_se`."""
    from _bench_steps import bench_steps

    m = bench_steps(batch, work, bare_save_s, steps, 1, threads, ("async", "floor_protocol", "floor"))
    out = {}
    for key, pair in (("step_vs_protocol_floor_ratio_grpo", "async_vs_floor_protocol_paired"),
                      ("protocol_floor_vs_floor_ratio_grpo", "floor_protocol_vs_floor_paired")):
        out[key] = m[pair]
        if f"{pair}_se" in m:
            out[f"{key}_se"] = m[f"{pair}_se"]
    return out
