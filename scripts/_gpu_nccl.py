"""scripts/gpu_check.py's `nccl` check: two processes under an NCCL default process group (gloo with
--cpu-dry-run), a harness caching CUDA mini-batches (K = 2, W = 2) in each; the harness's collectives
on its own gloo group, never CPU tensors through NCCL."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

import torch

from _gpu_common import SKIPPED, _same, need

# ---------------------------------------------------------------------------------------------- nccl


class CudaToyTrainer:
    def __init__(self, device: torch.device, rank: int):
        self.device, self.rank = device, rank
        self.calls: Dict[str, int] = {}

    def prepare_data(self, step, dispatch=True):
        pass

    def sample(self, step):
        i = self.calls[step] = self.calls.get(step, -1) + 1
        g = torch.Generator(device=self.device).manual_seed(1000 * step + 10 * i + self.rank)
        return {"x": torch.randn(4, 8, device=self.device, generator=g),
                "ids": torch.randint(0, 100, (4,), device=self.device, generator=g)}


def _nccl_worker(rank: int, world: int, init_file: str, work: str, dry_run: bool) -> None:
    import torch.distributed as dist

    from skip_harness import SkipHarness
    from skip_harness.run.dist import DistContext

    result: Dict[str, Any] = {"rank": rank}
    try:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        if dry_run:
            device, backend = torch.device("cpu"), "gloo"
        else:
            device, backend = torch.device("cuda", rank % torch.cuda.device_count()), "nccl"
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        ctx = DistContext.current()
        result["default_backend"] = str(dist.get_backend_config())
        result["harness_group"] = None if ctx.group is None else str(dist.get_backend(ctx.group))
        result["collectives"] = [ctx.all_true(True), ctx.all_true(rank == 0), ctx.sum_floats([1.0, float(rank)]),
                                 ctx.broadcast({"from": rank}), ctx.gather(rank)]
        ctx.barrier()
        dump = str(Path(work) / "nccl-cache")
        for attempt in ("first", "again"):
            harness = SkipHarness.create(settings={"enable": True, "dump_dir": dump},
                                         namespace={"experiment_name": "gpu_check", "project_name": "nccl", "K": 2},
                                         fingerprint={"model": "cuda-toy"})
            trainer = CudaToyTrainer(device, rank)
            harness.wrap(trainer, sample="sample")
            served, outcomes = [], []
            for step in (1, 2):
                trainer.prepare_data(step)
                served += [trainer.sample(step) for _ in range(2)]
                outcomes.append(harness.outcome(step))
            summary = harness.close()
            expected = []
            reference = CudaToyTrainer(device, rank)
            for step in (1, 2):
                expected += [reference.sample(step) for _ in range(2)]
            result[attempt] = {
                "outcomes": outcomes, "committed": summary.committed, "uncommitted": summary.uncommitted,
                "devices": sorted({str(b[k].device) for b in served for k in b}),
                "equal": all(_same(e, s) is None for e, s in zip(expected, served)),
            }
        if not dry_run and torch.cuda.device_count() >= world:
            t = torch.ones(1, device=device)
            dist.all_reduce(t)  # the trainer's own NCCL collective still works next to the harness's group
            result["trainer_nccl_all_reduce"] = float(t.item())
        dist.destroy_process_group()
    except BaseException as exc:  # report, do not hang the other rank's join
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(work, f"nccl-rank{rank}.json").write_text(json.dumps(result, default=str))


def check_nccl(work: Path, dry_run: bool) -> str:
    import torch.multiprocessing as mp

    if not dry_run and not torch.distributed.is_nccl_available():
        return f"{SKIPPED}: torch has no NCCL backend"
    world = 2
    mp.spawn(_nccl_worker, args=(world, str(work / "nccl-init"), str(work), dry_run), nprocs=world, join=True)
    results = [json.loads((work / f"nccl-rank{r}.json").read_text()) for r in range(world)]
    for res in results:
        err = res.get("error")
        if err and "Duplicate GPU" in err:
            return f"{SKIPPED}: NCCL refused two ranks on one GPU ({err[:200]})"
        need(not err, f"rank {res['rank']}: {err}")
        need(res["collectives"] == [True, False, [2.0, 1.0], {"from": 0}, [0, 1]],
             f"rank {res['rank']}: collectives gave {res['collectives']}")
        if not dry_run:
            need(res["harness_group"] == "gloo", f"rank {res['rank']}: harness collectives on {res['harness_group']}")
        need(res["first"]["outcomes"] == ["miss", "miss"] and res["first"]["committed"] == 2,
             f"rank {res['rank']}: first run {res['first']}")
        need(res["again"]["outcomes"] == ["hit", "hit"], f"rank {res['rank']}: second run {res['again']}")
        for attempt in ("first", "again"):
            need(res[attempt]["equal"], f"rank {res['rank']}: {attempt} run served different values")
        need(len(res["again"]["devices"]) == 1 and res["again"]["devices"] == res["first"]["devices"],
             f"rank {res['rank']}: hits served on {res['again']['devices']}, generated on {res['first']['devices']}")
    shared = "" if dry_run or torch.cuda.device_count() >= world else " (both ranks on one GPU)"
    return (f"default group {results[0]['default_backend']}, harness collectives on "
            f"{results[0]['harness_group'] or 'the default group'}{shared}; K = 2, W = 2 CUDA mini-batches "
            f"committed, then served back on {', '.join(r['again']['devices'][0] for r in results)}")
