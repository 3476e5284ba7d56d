"""The second tier's bench (issue 32): a replay step's time over the recording's, with the tier and without.

    python scripts/bench_tier.py [--json] [--quick] [--steps N] [--batch B] [--work-dir DIR]

The demo trainer (scripts/train.py's, in this process) with a reference KL term
(`actor_rollout_ref.actor.use_kl_loss=true`) and a reward phase costing as much as its generation
(`reward_model.cost_s` set to the median generation time per step measured first, caching off). Then,
in one run of this script, on one cache:

- record        caching on, the tier on: every step generates, rewards and computes the reference;
- replay        the same config again, the tier on: generation, the reward and the reference served;
- replay_no_tier  the same with `skip.rollout_tq.tier=false`: generation served, reward and reference
                run again.

replay_step_ratio_tier = median step time of `replay` / median step time of `record` (target <= 0.2);
replay_step_ratio_no_tier the same for `replay_no_tier`. Both replays also say whether every value they
reported reproduced the recording's (the tier's: yes; without it the reward phase's noise-free values
are recomputed and agree too -- the noisy case is tests/test_tier.py's and tests/test_trl.py's).

Progress goes to stderr through logging; the result (a table, or one JSON document with --json) to stdout.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

log = logging.getLogger("bench_tier")

TARGET = 0.2


def demo_config(dump_dir: Path, steps: int, batch: int, threads: int, cost_s: float, *, enable: bool,
                tier: bool) -> Dict[str, Any]:
    return {
        "seed": 0,
        "trainer": {"total_training_steps": steps, "test_freq": 0, "progress": False, "torch_threads": threads,
                    "experiment_name": "bench_tier", "project_name": "bench"},
        "data": {"train_batch_size": batch},
        "actor_rollout_ref": {"actor": {"use_kl_loss": True}},
        "reward_model": {"cost_s": cost_s},
        "skip": {"rollout_tq": {"enable": enable, "dump_dir": str(dump_dir), "tier": tier}},
    }


def _median(rows: List[Dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def run(opts: argparse.Namespace) -> Dict[str, Any]:
    from skip_harness.demo.run import train

    base = Path(opts.work_dir) if opts.work_dir else None
    work = Path(tempfile.mkdtemp(prefix="bench_tier-", dir=base))
    try:
        dump = work / "cache"

        def once(name: str, cost_s: float, *, enable: bool = True, tier: bool = True) -> List[Dict[str, Any]]:
            log.info("%s: %d steps, batch %d, reward phase %.3f s a call", name, opts.steps, opts.batch, cost_s)
            cfg = demo_config(dump, opts.steps, opts.batch, opts.threads, cost_s, enable=enable, tier=tier)
            return train(cfg, run_dir=work / name).metrics

        calibrate = once("calibrate", 0.0, enable=False)
        gen_s = _median(calibrate, "gen_s")
        record = once("record", gen_s)
        replay = once("replay", gen_s)
        replay_no_tier = once("replay_no_tier", gen_s, tier=False)
        record_s = _median(record, "step_s")
        return {
            "steps": opts.steps, "batch": opts.batch, "quick": bool(opts.quick),
            "tier_generation_s": gen_s, "tier_reward_cost_s": gen_s,
            "tier_record_step_s": record_s,
            "tier_replay_step_s": _median(replay, "step_s"),
            "tier_replay_no_tier_step_s": _median(replay_no_tier, "step_s"),
            "replay_step_ratio_tier": _median(replay, "step_s") / record_s,
            "replay_step_ratio_no_tier": _median(replay_no_tier, "step_s") / record_s,
            "tier_replay_reproduced": all(a["loss"] == b["loss"] and a["kl_loss"] == b["kl_loss"]
                                          for a, b in zip(record, replay)),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def render(r: Dict[str, Any]) -> str:
    return "\n".join([
        f"{'second tier (demo, KL on, reward costing its generation)':<60} {'step s':>8} {'ratio':>7} {'target':>7}",
        f"{'record':<60} {r['tier_record_step_s']:>8.3f}",
        f"{'replay, tier on (generation, reward, reference served)':<60} {r['tier_replay_step_s']:>8.3f} "
        f"{r['replay_step_ratio_tier']:>7.3f} {'<= ' + str(TARGET):>7}",
        f"{'replay, tier off (reward and reference run again)':<60} {r['tier_replay_no_tier_step_s']:>8.3f} "
        f"{r['replay_step_ratio_no_tier']:>7.3f}",
    ])


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--quick", action="store_true", help="CI size: 3 steps of 16 prompts")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 6; --quick 3)")
    p.add_argument("--batch", type=int, default=None, help="data.train_batch_size (default 64; --quick 16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (trainer.torch_threads)")
    p.add_argument("--work-dir", default=None, help="where the cache and run dirs go (removed after)")
    opts = p.parse_args(argv)
    opts.steps = opts.steps or (3 if opts.quick else 6)
    opts.batch = opts.batch or (16 if opts.quick else 64)
    if opts.steps < 1 or opts.batch < 1 or opts.threads < 1:
        p.error("--steps, --batch and --threads must be >= 1")
    return opts


def main(argv: Optional[List[str]] = None) -> int:
    opts = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    result = run(opts)
    print(json.dumps(result, indent=1) if opts.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
