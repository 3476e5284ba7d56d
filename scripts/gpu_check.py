"""The GPU-only checks of skip_harness, run whenever a machine with an accelerator is at hand.

    python scripts/gpu_check.py [--json] [--only payload,rng,nccl,demo,trl] [--demo-override KEY=VALUE ...]

Checks (each prints `held`, `FAILED` or `skipped` with what it saw):
- payload: a payload of CUDA tensors (several dtypes, every device up to two, nested, mixed with CPU
  tensors) written and committed through StepStore comes back equal, each tensor on the device it
  came from; verify passes; read in a process that sees no CUDA device, it comes back on the CPU.
- rng: rng.capture() records every CUDA device's generator; rng.restore() puts them back (CUDA draws
  repeat exactly), in this process and in a fresh one.
- nccl: two processes under an NCCL default process group: DistContext runs the harness's collectives
  on its own gloo group (never CPU tensors through NCCL), and a harness caching CUDA mini-batches
  (K = 2, W = 2) commits, then serves every step back on each rank's device, values equal.
  With one GPU both ranks share it (the harness itself never needs an NCCL communicator).
- demo: `torchrun --standalone --nproc_per_node 2 scripts/train.py trainer.total_training_steps=2 ...`
  twice on one cache: the second run hits every step with identical training metrics.
- trl: `scripts/trl_demo.py --device cuda` (when the TRL integration and trl are installed): the
  replay's log history is identical to the recorded one.

Without a CUDA device it says so and exits 0. Exit status 1 when a check failed.
`--cpu-dry-run` runs the same checks on the CPU with gloo (to check this script where no GPU is).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from skip_harness.demo import TINY_OVERRIDES  # noqa: E402

HELD, FAILED, SKIPPED = "held", "FAILED", "skipped"
TINY = list(TINY_OVERRIDES)


class CheckFailed(AssertionError):
    pass


def need(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "HYDRA_FULL_ERROR"):
        env.pop(name, None)
    env.update(extra)
    return env


def _devices(dry_run: bool) -> List[torch.device]:
    if dry_run:
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]


def _leaves(obj: Any, prefix: str = "") -> List[Tuple[str, Any]]:
    if isinstance(obj, dict):
        return [x for k in obj for x in _leaves(obj[k], f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _leaves(v, f"{prefix}[{i}]")]
    return [(prefix, obj)]


def _same(a: Any, b: Any, *, devices_too: bool = True) -> Optional[str]:
    """None when `b` equals `a` in structure, types, dtypes, shapes, values (and devices); else why not."""
    if type(a) is not type(b):
        return f"type {type(a).__name__} came back as {type(b).__name__}"
    la, lb = _leaves(a), _leaves(b)
    if [k for k, _ in la] != [k for k, _ in lb]:
        return f"structure {[k for k, _ in la]} came back as {[k for k, _ in lb]}"
    for (key, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor):
                return f"{key}: a tensor came back as {type(y).__name__}"
            if devices_too and x.device != y.device:
                return f"{key}: saved on {x.device}, loaded on {y.device}"
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
                return f"{key}: dtype/shape/values differ ({x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)})"
        elif x != y or type(x) is not type(y):
            return f"{key}: {x!r} came back as {y!r}"
    return None


# ---------------------------------------------------------------------------------------------- payload


READ_WITHOUT_CUDA = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from skip_harness.store.layout import Layout
    from skip_harness.store.stepstore import StepStore
    [back] = StepStore(Layout(Path(sys.argv[1]), K=1, W=1)).reader.read_step(1, 0)
    def leaves(o):
        if isinstance(o, dict): return [x for v in o.values() for x in leaves(v)]
        if isinstance(o, (list, tuple)): return [x for v in o for x in leaves(v)]
        return [o]
    print(json.dumps({"cuda": torch.cuda.is_available(),
                      "devices": sorted({str(t.device) for t in leaves(back) if isinstance(t, torch.Tensor)})}))
    """
)


def check_payload(work: Path, dry_run: bool) -> str:
    from skip_harness.store.layout import Layout
    from skip_harness.store.stepstore import StepStore

    devices = _devices(dry_run)
    d0 = devices[0]
    g = torch.Generator(device=d0).manual_seed(0)
    payload = {
        "ids": torch.randint(0, 50_000, (8, 32), device=d0, generator=g),
        "logp": torch.randn(8, 32, device=d0, generator=g),
        "logp_bf16": torch.randn(8, 32, device=d0, generator=g).to(torch.bfloat16),
        "logp_fp16": torch.randn(8, 32, device=d0, generator=g).to(torch.float16),
        "mask": torch.rand(8, 32, device=d0, generator=g) > 0.5,
        "on_cpu": torch.arange(10),
        "per_device": [torch.full((3,), float(i), device=d) for i, d in enumerate(devices)],
        "info": {"n": 3, "name": "gpu_check", "pair": (1, 2.5)},
    }
    layout = Layout(work / "payload" / "ns", K=1, W=1)
    store = StepStore(layout)
    entries = list(store.writer.write_inner(1, 0, 0, payload, {"note": "gpu_check"}))
    store.writer.commit(1, entries, None)
    _status, problem = store.reader.verify(1)
    need(problem is None, f"verify: {problem}")
    [back] = store.reader.read_step(1, 0)
    why = _same(payload, back)
    need(why is None, f"round trip: {why}")
    proc = subprocess.run([sys.executable, "-c", READ_WITHOUT_CUDA, str(layout.root)], capture_output=True,
                          text=True, env=_env(CUDA_VISIBLE_DEVICES=""), timeout=300)
    need(proc.returncode == 0, f"reading without CUDA failed: {proc.stderr[-2000:]}")
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    need(not seen["cuda"] and seen["devices"] == ["cpu"], f"read without a CUDA device: {seen}")
    return (f"{len(_leaves(payload))} values on {', '.join(map(str, devices))} came back equal on their devices; "
            "read where no CUDA device is visible, they come back on the CPU")


# ---------------------------------------------------------------------------------------------- rng


RESTORE_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys
    import torch
    from skip_harness.run import rng
    rng.restore(json.loads(open(sys.argv[1]).read()))
    n = int(sys.argv[2])
    draws = [torch.rand(4, device=f"cuda:{i}").cpu().tolist() for i in range(n)] if n else []
    print(json.dumps({"cuda": draws, "cpu": torch.rand(2).tolist()}))
    """
)


def check_rng(work: Path, dry_run: bool) -> str:
    from skip_harness.run import rng

    devices = _devices(dry_run)
    cuda = [d for d in devices if d.type == "cuda"]
    torch.manual_seed(1234)
    for d in cuda:
        torch.rand(1, device=d)  # CUDA initialised, generators in use
    need(not cuda or torch.cuda.is_initialized(), "CUDA should be initialised")
    state = json.loads(json.dumps(rng.capture()))
    if cuda:
        need(len(state.get("cuda", [])) == torch.cuda.device_count(),
             f"record has {len(state.get('cuda', []))} CUDA generators, {torch.cuda.device_count()} devices")

    def draw():
        return {"cuda": [torch.rand(4, device=d).cpu().tolist() for d in cuda], "cpu": torch.rand(2).tolist()}

    expected = draw()
    for d in cuda:
        torch.rand(1000, device=d)
    torch.rand(1000)
    rng.restore(state)
    need(draw() == expected, "draws after restore differ from the draws after capture")
    path = work / "rng.json"
    path.write_text(json.dumps(state))
    proc = subprocess.run([sys.executable, "-c", RESTORE_IN_FRESH_PROCESS, str(path), str(len(cuda))],
                          capture_output=True, text=True, env=_env(), timeout=300)
    need(proc.returncode == 0, f"restore in a fresh process failed: {proc.stderr[-2000:]}")
    need(json.loads(proc.stdout.strip().splitlines()[-1]) == expected, "a fresh process restored different draws")
    return (f"{len(state.get('cuda', []))} CUDA generator(s) recorded; draws repeat after restore, in this "
            "process and in a fresh one")


# ---------------------------------------------------------------------------------------------- nccl


class CudaToyTrainer:
    def __init__(self, device: torch.device, rank: int):
        self.device, self.rank, self.calls = device, rank, {}

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


# ---------------------------------------------------------------------------------------------- demo


def _training_metrics(run_dir: Path) -> List[Dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "cache"} for r in rows]


def check_demo(work: Path, dry_run: bool, overrides: List[str]) -> str:
    cache = work / "demo-cache"
    env = _env(SKIP_HARNESS_DUMP_DIR=str(cache), OMP_NUM_THREADS="1")
    runs = []
    for name in ("first", "again"):
        run_dir = work / f"demo-{name}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "scripts" / "train.py"), "trainer.total_training_steps=2", f"hydra.run.dir={run_dir}",
               *TINY, *overrides]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        need(proc.returncode == 0, f"{name} run failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        runs.append((run_dir, [r["cache"] for r in rows]))
    need(runs[0][1] == ["miss", "miss"], f"first run: {runs[0][1]}")
    need(runs[1][1] == ["hit", "hit"], f"second run: {runs[1][1]}")
    need(_training_metrics(runs[0][0]) == _training_metrics(runs[1][0]), "training metrics differ between the runs")
    return "2 processes, 2 steps: misses then all hits, training metrics identical" + (
        f" (overrides: {' '.join(overrides)})" if overrides else "")


# ---------------------------------------------------------------------------------------------- trl


def check_trl(work: Path, dry_run: bool) -> str:
    try:
        import trl  # noqa: F401

        import skip_harness.integrations.trl  # noqa: F401
    except ImportError as exc:
        return f"{SKIPPED}: TRL integration not importable ({exc})"
    script = ROOT / "scripts" / "trl_demo.py"
    if not script.exists():
        return f"{SKIPPED}: {script} not found"
    cmd = [sys.executable, str(script), "--device", "cpu" if dry_run else "cuda", "--workdir", str(work / "trl")]
    proc = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=1200)
    report = None
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
    need(proc.returncode == 0 and report is not None and report.get("identical") is True,
         f"trl_demo exit {proc.returncode}, report {report}: {(proc.stdout + proc.stderr)[-3000:]}")
    return f"replayed log history identical ({report.get('log_entries')} entries)"


# ---------------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the results as one JSON document")
    p.add_argument("--only", default="payload,rng,nccl,demo,trl", help="comma-separated checks to run")
    p.add_argument("--demo-override", action="append", default=[], help="extra override for the demo runs")
    p.add_argument("--cpu-dry-run", action="store_true", help="run the checks on the CPU with gloo")
    p.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it")
    args = p.parse_args(argv)
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    known = {"payload", "rng", "nccl", "demo", "trl"}
    if set(wanted) - known:
        p.error(f"unknown checks {sorted(set(wanted) - known)}; known: {sorted(known)}")

    if not args.cpu_dry_run and not torch.cuda.is_available():
        why = (f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}, "
               f"torch.cuda.is_available() is False)")
        if args.json:
            print(json.dumps({"skipped": why, "checks": []}))
        else:
            print(f"gpu_check: skipped: {why}; nothing to check on this machine")
        return 0

    work = Path(tempfile.mkdtemp(prefix="skip_harness_gpu_check_")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    checks: Dict[str, Callable[[Path], str]] = {
        "payload": lambda w: check_payload(w, args.cpu_dry_run),
        "rng": lambda w: check_rng(w, args.cpu_dry_run),
        "nccl": lambda w: check_nccl(w, args.cpu_dry_run),
        "demo": lambda w: check_demo(w, args.cpu_dry_run, args.demo_override),
        "trl": lambda w: check_trl(w, args.cpu_dry_run),
    }
    results = []
    try:
        for name in wanted:
            sub = work / name
            sub.mkdir(exist_ok=True)
            t0 = time.monotonic()
            try:
                detail = checks[name](sub)
                status = SKIPPED if detail.startswith(SKIPPED + ":") else HELD
                if status == SKIPPED:
                    detail = detail[len(SKIPPED) + 1:].strip()
            except Exception as exc:  # CheckFailed, or anything the check ran into
                status, detail = FAILED, f"{type(exc).__name__}: {exc}"
            results.append({"check": name, "status": status, "detail": detail,
                            "seconds": round(time.monotonic() - t0, 1)})
            if not args.json:
                print(f"{status:8s} {name}: {detail}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    device = "cpu (dry run)" if args.cpu_dry_run else ", ".join(
        torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    counts = {s: sum(r["status"] == s for r in results) for s in (HELD, FAILED, SKIPPED)}
    if args.json:
        print(json.dumps({"device": device, "checks": results, **counts}, indent=1))
    else:
        print(f"gpu_check on {device}: {counts[HELD]} held, {counts[FAILED]} failed, {counts[SKIPPED]} skipped")
    return 1 if counts[FAILED] else 0


if __name__ == "__main__":
    sys.exit(main())
