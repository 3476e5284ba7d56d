"""A trainer loop run under torchrun (or alone) for the replay_from tests: each step's global batch is B x n
rows known by content (row g of step s holds s * 1000 + g), split as the demo and verl split it: K
mini-batches, each cut into W rank shards; rank r's call i gets part i x W + r.

    python reshard_rig.py DUMP_DIR K STEPS OUT [REPLAY_FROM]

Writes OUT/rank{r}.json: what each sample call returned ({step: [[row ids of call 0], ...]}), whether
it was generated or served, and the harness's summary line; with REPLAY_FROM it sets
skip.rollout_tq.replay_from.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from skip_harness import SkipHarness

B, N = 8, 2


def part(step: int, K: int, W: int, inner: int, rank: int) -> dict:
    rows = B * N // (K * W)
    start = (inner * W + rank) * rows
    ids = torch.arange(start, start + rows) + step * 1000
    lengths = (ids % 3 + 1).tolist()
    return {
        "ids": ids,
        "tokens": ids.unsqueeze(1).repeat(1, 3).to(torch.int32),
        "ragged": torch.nested.nested_tensor([torch.full((n,), float(i)) for n, i in zip(lengths, ids.tolist())],
                                             layout=torch.jagged),
        "rank": torch.tensor(rank),
    }


class Trainer:
    def __init__(self, K: int, W: int, rank: int):
        self.K, self.W, self.rank = K, W, rank
        self.generated = 0
        self._calls = 0

    def prepare_data(self, step: int, dispatch: bool = True) -> None:
        self._calls = 0

    def sample(self, step: int) -> dict:
        self.generated += 1
        inner, self._calls = self._calls, self._calls + 1
        return part(step, self.K, self.W, inner, self.rank)


def main() -> None:
    dump_dir, K, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    replay_from = sys.argv[5] if len(sys.argv) > 5 else None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    W = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    settings = {"enable": True, "dump_dir": dump_dir, "prefetch": rank % 2 == 0}
    if replay_from:
        settings["replay_from"] = replay_from
    # $RIG_LR: a trainer whose training value (`loss`) depends on W and on its learning rate; else the rig
    # reports the global batch's size, the same on any W (w_invariant)
    lr = float(os.environ["RIG_LR"]) if os.environ.get("RIG_LR") else None
    harness = SkipHarness.create(settings, namespace={"experiment_name": "rig", "project_name": "reshard",
                                                      "train_batch_size": B, "n": N, "K": K},
                                 fingerprint={"seed": 0}, w_invariant=lr is None,
                                 training_config=None if lr is None else {"optim": {"lr": lr}})
    trainer = Trainer(K, W, rank)
    harness.wrap(trainer)
    served: dict = {}
    for step in range(1, steps + 1):
        trainer.prepare_data(step)
        calls = []
        for _ in range(K):
            batch = trainer.sample(step)
            ragged = [r.tolist() for r in batch["ragged"].unbind(0)]
            ids = batch["ids"].tolist()
            assert batch["tokens"][:, 0].tolist() == ids
            assert ragged == [[float(i)] * (i % 3 + 1) for i in ids], "a jagged row travelled apart from its id"
            calls.append(ids)
        served[step] = {"outcome": str(harness.outcome(step)), "calls": calls}
        if lr is None:
            harness.observe(step, rows=float(sum(len(c) for c in calls) * W))   # the global batch: the same on any W
        else:   # a mean of per-rank means: another value on another W; step 1's is before any update
            harness.observe(step, reward_mean=float(step), loss=0.5 + 0.1 * step + 1e-3 * W + (step - 1) * (lr - 1e-3) * 10)
    summary = harness.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"W": W, "K": K, "generated": trainer.generated,
                                                       "steps": served, "summary": summary.replay_line}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.enable()     # a C++ abort shows each thread's Python stack (or none: the interpreter's exit)
    main()
    # Done, results written: leave without the interpreter's finalization. CI saw a rank of this rig abort
    # once ("terminate called without an active exception", no Python frame printed) in many hundreds of
    # runs; test_dist's worker did the same after all its work, at exit: a torch thread dropping a
    # tensor while the interpreter is torn down (pytorch/pytorch#190489's thread). If it comes mid-run,
    # faulthandler prints where.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
