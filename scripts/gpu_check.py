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
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

# the checks' parts beside this file: `python scripts/gpu_check.py` puts scripts/ first on sys.path
from _gpu_common import (  # noqa: E402
    FAILED, HELD, ROOT, SKIPPED, TINY, _devices, _env, _leaves, _same, need,
)
from _gpu_nccl import check_nccl  # noqa: E402

import torch  # noqa: E402

# ---------------------------------------------------------------------------------------------- payload


READ_WITHOUT_CUDA = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from skip_harness.store.layout import Layout
    from skip_harness.store.open import open_store
    [back] = open_store(Layout(Path(sys.argv[1]), K=1, W=1)).reader.read_step(1, 0)
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
    from skip_harness.store.open import open_store

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
    store = open_store(layout)
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
