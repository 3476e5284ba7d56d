"""verl's real trainer with skip_harness on a laptop without a GPU: record, then replay, then compare.

    pip install -e '.[verl]'            # verl 0.9.x; no TRL >= 1.13 in this environment
    python scripts/verl_cpu_demo.py [--workdir DIR] [--steps 3] [--mode sync|colocate_async]

It runs ``python -m verl.trainer.main_ppo`` twice (GRPO, FSDP2 on gloo, TransferQueue, verl's agent loop,
reward loop and weight sync), each with ``VERL_USE_EXTERNAL_MODULES=skip_harness.integrations.verl,verl_cpu``:
the first generates and caches every step, the second is served from the cache. It reports how many
``generate`` calls each run made and whether verl's logged metrics (its ``file`` logger) are identical,
timing keys aside. Exit 0 when the replay generated nothing and every metric matched.

What makes verl run on a CPU (a ``cpu`` platform, verl's FSDP engines registered for it, a transformers
``generate`` rollout backend in place of vLLM) lives in ``scripts/verl_cpu``, beside this script (the tests
use it too): it is scaffolding that goes through verl's registries, not part of skip_harness -- on a GPU
machine you run ``main_ppo`` with vLLM and only ``skip_harness.integrations.verl``. The model is a 2-layer
Llama with random weights built from its config and a character tokenizer (no download); each run takes
a minute or two, mostly Ray and worker start-up.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("verl_cpu_demo")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where the model, data, cache and logs go")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", choices=["sync", "colocate_async"], default="sync")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from verl_cpu import driver, recipe

    work = args.workdir or Path(tempfile.mkdtemp(prefix="verl_cpu_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    paths = recipe.prepare(work)
    cache = work / "cache"
    runs = []
    for name in ("record", "replay"):
        log.info("%s: python -m verl.trainer.main_ppo ... (log: %s)", name, work / f"{name}.log")
        run = driver.main_ppo(work, name, paths, dump_dir=cache, steps=args.steps, mode=args.mode,
                              experiment=f"demo_{args.mode}")
        if run.returncode != 0:
            log.error("%s: main_ppo exited %s; the end of its log:\n%s", name, run.returncode, run.output[-4000:])
            return 1
        log.info("%s: %d generate calls, %d steps logged, %.0f s", name, run.generate_calls, len(run.metrics),
                 run.wall_s)
        for line in run.lines("rollout cache summary"):
            log.info("  %s", line[line.index("rollout cache summary"):])
        runs.append(run)
    record, replay = runs
    diff = driver.differences(record.metrics, replay.metrics, range(1, args.steps + 1))
    keys = len(driver.comparable(replay.metrics).get(1, {}))
    if diff:
        log.info("verl's metrics differ (%d values), first: %s", len(diff), diff[0])
    else:
        log.info("verl's metrics identical: %d steps x %d keys (timing keys aside)", args.steps, keys)
    ok = replay.generate_calls == 0 and not diff
    log.info("%s (cache in %s)", "replay reproduced the recording" if ok else "replay did NOT reproduce", cache)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
