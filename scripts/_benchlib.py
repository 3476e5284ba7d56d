"""What the benchmark scripts share (bench.py, bench_s3.py and bench_view.py import it; none imports
another script): the payloads (a verl-like rollout batch, its jagged and MoE variants), timing helpers,
the synthetic trainer and compute, a training block run through the harness, and the namespace of many
committed steps the scan rows read."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness.store.open import open_store
from skip_harness import codec
from skip_harness.config import RolloutTQConfig
from skip_harness.run.harness import SkipHarness
from skip_harness.store.layout import COMMIT_NAME, Layout

log = logging.getLogger("skip_harness.bench")

MiB = 1 << 20
PROMPT_LEN = 1024
RESPONSE_LEN = 3072
VOCAB = 151_936
SCAN_K = 4
MOE_LAYERS, MOE_TOPK, MOE_EXPERTS = 48, 8, 128
MOE_ROW_DIVISOR = 64          # the MoE batch has rows / 64 trajectories (its routed experts are 384 int16 a token)
ZSTD_LEVEL = RolloutTQConfig.compression_level      # the default level a run with compression=zstd uses
ZSTD = codec.stored_form("zstd", ZSTD_LEVEL)
NARROW = codec.StoredForm(narrow=True)
COMPUTE_FACTOR = 4.0          # the synthetic step computes this many bare durable saves long
SCAN_BUILD_FORMAT = 2         # bump when the cached scan namespace's construction changes


class BenchError(Exception):
    """A measurement could not be made as intended (the message says which and why)."""


# --------------------------------------------------------------------------------------------
# payload


def make_payload(rows: int, seed: int = 0, prompt_len: int = PROMPT_LEN, response_len: int = RESPONSE_LEN
                 ) -> Dict[str, Any]:
    """A rollout mini-batch of `rows` trajectories: left-padded prompts and right-padded responses."""
    P, R, B = prompt_len, response_len, max(1, rows)
    g = torch.Generator().manual_seed(seed)
    prompt_len_t = torch.randint(P // 4, P + 1, (B, 1), generator=g)
    response_len_t = torch.randint(R // 8, R + 1, (B, 1), generator=g)
    prompt_mask = torch.arange(P).flip(0).unsqueeze(0) < prompt_len_t
    response_mask = torch.arange(R).unsqueeze(0) < response_len_t
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    input_ids = zipf_token_ids((B, P + R), g) * attention_mask
    rmask = response_mask.float()
    old_log_probs = -torch.rand(B, R, generator=g) * 6 * rmask
    scores = torch.rand(B, generator=g)
    token_level_rewards = torch.zeros(B, R)
    token_level_rewards[torch.arange(B), response_len_t.squeeze(1) - 1] = scores
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask.long(),
        "old_log_probs": old_log_probs,
        "token_level_rewards": token_level_rewards,
        "scores": scores,
        "response_length": response_len_t.squeeze(1),
        "uid": [f"{i // 8:08x}" for i in range(B)],
        "data_source": ["bench/sort_digits" if i % 2 else "bench/gsm8k" for i in range(B)],
        "global_steps": 1,
    }


def zipf_token_ids(shape: Tuple[int, ...], g: torch.Generator, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids drawn Zipf-like (rank k with probability ~ 1/k) over `vocab`, ranks mapped to ids by a
    fixed permutation (frequent tokens are not all small ids), as int64 like a tokenizer's output."""
    ranks = torch.pow(float(vocab), torch.rand(shape, generator=g, dtype=torch.float64)).long().clamp_(1, vocab) - 1
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(151_936))
    return perm[ranks]


def make_jagged_payload(rows: int, seed: int = 0, prompt_len: int = PROMPT_LEN, response_len: int = RESPONSE_LEN
                        ) -> Dict[str, Any]:
    """The same trajectories as verl's V1 trainer saves a mini-batch: {"tensordict", "tags", "keys",
    "global_steps"}, the tensordict built by verl's own list_of_dict_to_tensordict when verl is installed
    (else the same layout by hand): jagged prompts / responses / input_ids / response_mask / log-probs,
    chat messages and uids as NonTensorStack."""
    dense = make_payload(rows, seed, prompt_len, response_len)
    P = prompt_len
    plen = dense["attention_mask"][:, :P].sum(1).tolist()
    rlen = dense["response_length"].tolist()
    trajectories = []
    for i in range(len(plen)):
        prompt = dense["input_ids"][i, P - plen[i]:P].clone()
        response = dense["input_ids"][i, P:P + rlen[i]].clone()
        trajectories.append({
            "prompts": prompt, "responses": response, "input_ids": torch.cat([prompt, response]),
            "response_mask": torch.ones(rlen[i], dtype=torch.int64),
            "rollout_log_probs": dense["old_log_probs"][i, :rlen[i]].clone(),
            "rewards": dense["scores"][i].clone(),
            "messages": [{"role": "user", "content": f"question {i // 8} of the bench"}],
            "uid": dense["uid"][i],
        })
    return v1_minibatch(trajectories, seed)


def v1_minibatch(trajectories: List[Dict[str, Any]], seed: int) -> Dict[str, Any]:
    """Trajectories (dicts of tensors, `messages` and `uid`) as verl's V1 trainer saves a mini-batch: the
    tensordict by verl's own list_of_dict_to_tensordict when verl is installed, else the same layout by hand."""
    from tensordict import NonTensorStack, TensorDict

    try:
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        td = list_of_dict_to_tensordict(trajectories)
    except ImportError:
        keys = [k for k in trajectories[0] if isinstance(trajectories[0][k], torch.Tensor)]
        data = {k: (torch.stack([t[k] for t in trajectories]) if trajectories[0][k].dim() == 0 else
                    torch.nested.as_nested_tensor([t[k] for t in trajectories], layout=torch.jagged)) for k in keys}
        data.update({k: NonTensorStack(*[t[k] for t in trajectories]) for k in ("messages", "uid")})
        td = TensorDict(data, batch_size=[len(trajectories)])
    return {"tensordict": td, "tags": [{"status": "ready"} for _ in trajectories],
            "keys": [f"{seed}_{i}" for i in range(len(trajectories))], "global_steps": seed}


def make_moe_payload(rows: int, seed: int = 0) -> Dict[str, Any]:
    """The dense batch with the routers' choices of an MoE model, as verl replays them: routed_experts,
    int16 [rows, tokens, 48 layers, top-8 of 128 experts], each layer's router skewed towards some
    experts, zero on padding."""
    batch = make_payload(rows, seed)
    B, T = batch["input_ids"].shape
    g = torch.Generator().manual_seed(seed + 7)
    experts = torch.empty(B * T, MOE_LAYERS, MOE_TOPK, dtype=torch.int16)
    for layer in range(MOE_LAYERS):
        bias = torch.randn(MOE_EXPERTS, generator=g) * 0.25      # this layer's favoured experts
        for start in range(0, B * T, 1 << 16):
            n = min(1 << 16, B * T - start)
            scores = torch.rand(n, MOE_EXPERTS, generator=g).add_(bias)
            experts[start:start + n, layer] = torch.topk(scores, MOE_TOPK, dim=1).indices.to(torch.int16)
    experts = experts.view(B, T, MOE_LAYERS, MOE_TOPK) * batch["attention_mask"].view(B, T, 1, 1).to(torch.int16)
    batch["routed_experts"] = experts
    return batch


def stored_bytes(payload: Any, form: Optional[codec.StoredForm], path: Path) -> int:
    with open(path, "wb") as f:
        n = codec.save_to(f, payload, form)
    path.unlink()
    return n


def torch_save_bytes(payload: Any, path: Path) -> int:
    torch.save(payload, path)
    n = path.stat().st_size
    path.unlink()
    return n


def disk_ratios(payload: Any, work: Path) -> Dict[str, float]:
    """Bytes stored narrowed + zstd ("zstd") and narrowed alone ("narrow") over verl's torch.save of the
    same batch (tests/test_compression.py checks the store writes the same ratio)."""
    work.mkdir(parents=True, exist_ok=True)
    verl = torch_save_bytes(payload, work / "verl.pt")
    return {"zstd": stored_bytes(payload, ZSTD, work / "z.bin") / verl,
            "narrow": stored_bytes(payload, NARROW, work / "n.bin") / verl, "verl_bytes": verl}


def iter_tensors(obj: Any):
    """Every tensor's storage-backed leaf: a nested tensor's values, a TensorDict's leaves."""
    if isinstance(obj, torch.Tensor):
        yield obj.values() if obj.is_nested else obj
    elif hasattr(obj, "batch_size") and hasattr(obj, "items"):      # a TensorDict (verl V1's batch)
        for v in obj.values(include_nested=True, leaves_only=True):
            if isinstance(v, torch.Tensor):
                yield from iter_tensors(v)
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
    return {k: (v.clone() if isinstance(v, torch.Tensor) or hasattr(v, "batch_size") else v)
            for k, v in payload.items()}


# --------------------------------------------------------------------------------------------
# timing


@dataclass
class Arm:
    name: str
    run: Callable[[], object]               # timed (its result is dropped)
    setup: Callable[[], object] = lambda: None  # untimed, before each run


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
# training steps through the harness


class SyntheticTrainer:
    """prepare_data / sample like a real trainer: sample returns a fresh copy of the payload (a
    generation's new tensors), or with `in_memory` the payload itself (the batch already in memory)."""

    def __init__(self, payload: Any, in_memory: bool = False):
        self.payload = payload
        self.in_memory = in_memory
        self.dispatched = 0
        self.generated = 0

    def prepare_data(self, step: int, dispatch: bool = True) -> None:
        if dispatch:
            self.dispatched += 1

    def sample(self, step: int) -> Any:
        self.generated += 1
        return self.payload if self.in_memory else fresh_copy(self.payload)


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


NAMESPACE = {"experiment_name": "bench", "project_name": "skip_harness", "n": 1}


def make_harness(mode: str, dump_dir: Path, compression: str = "none") -> SkipHarness:
    settings = {"enable": mode != "off", "dump_dir": str(dump_dir), "async_write": mode != "sync",
                "prefetch": True, "compression": compression, "compression_level": ZSTD_LEVEL}
    return SkipHarness.create(settings=settings, namespace=NAMESPACE)


def _split_mode(mode: str) -> Tuple[str, str]:
    """'async_zstd' -> ('async', 'zstd'): an arm's caching mode and its compression."""
    return (mode[:-5], "zstd") if mode.endswith("_zstd") else (mode, "none")


@dataclass(frozen=True)
class Block:
    """What `run_training_block` measured: seconds of each step, seconds until the block was durable,
    and where its namespace is (None with caching off)."""

    times: List[float]
    durable_s: float
    layout: Optional[Layout]


def run_training_block(mode: str, payload: Any, compute: Compute, steps: int, dump_dir: Any,
                       keep: bool = False, compression: str = "none") -> Block:
    """`steps` training steps in `dump_dir` (a directory or an object-store URL) with caching `mode`:
    'off', 'async', 'sync' (misses in a fresh namespace), 'hit' (every step served from the cache a
    block before wrote) or 'memory' (caching off, the batch already in memory)."""
    harness = make_harness("off" if mode == "memory" else ("async" if mode == "hit" else mode), dump_dir, compression)
    trainer = SyntheticTrainer(payload, in_memory=mode == "memory")
    harness.wrap(trainer)
    harness.start()
    per_step: List[float] = []
    try:
        t_block = time.perf_counter()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            trainer.prepare_data(step)
            batch = trainer.sample(step)
            touch(batch)
            compute.run()
            per_step.append(time.perf_counter() - t0)
            del batch
        harness.flush()
        total = time.perf_counter() - t_block
        outcomes = {harness.outcome(s) for s in range(1, steps + 1)}
        layout = harness.layout if harness.enabled else None
    finally:
        summary = harness.close()
    expected = {"off": "off", "memory": "off", "hit": "hit"}.get(mode, "miss")
    if outcomes != {expected}:
        raise BenchError(f"caching {mode}: steps were {sorted(outcomes)}, expected every one to be a {expected}")
    if mode in ("async", "sync") and summary.misses != steps:
        raise BenchError(f"caching {mode}: {summary.misses} of {steps} steps were committed")
    if mode == "hit" and trainer.generated:
        raise BenchError(f"caching {mode}: {trainer.generated} generations ran on hit steps")
    if not keep:
        shutil.rmtree(dump_dir, ignore_errors=True)
    return Block(per_step, total, layout)


def _with_threads(threads: int, fn: Callable[[], Dict[str, float]]) -> Dict[str, float]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------
# the scan namespace (scripts/bench.py's scan rows, scripts/bench_view.py's overview)


def build_scan_namespace(root: Path, steps: int, K: int = SCAN_K) -> Layout:
    """A namespace of `steps` committed steps x K inner indices, as a run leaves it.

    Step 1 is written and committed through StepStore; every other step gets hard links to step 1's
    payload and meta files and its own commit record (step 1's record with the step number changed,
    serialized as StepWriter.commit does, but without the per-file fsync that would make building
    10,000 steps take minutes). The scan reads directory listings, lstat and commit records, so it
    sees exactly what it would see after a real run."""
    layout = Layout(root, K=K, W=1)
    store = open_store(layout)
    g = torch.Generator().manual_seed(2)
    entries: List[Any] = []
    for i in range(K):
        small = {"input_ids": torch.randint(0, VOCAB, (4, 16), generator=g), "old_log_probs": torch.randn(4, 16, generator=g)}
        entries += store.writer.write_inner(1, i, 0, small, {"bench": "scan"})
    record = store.writer.commit(1, entries, None)
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
