"""The main job: a small GRPO-style RL training on CPU whose rollouts are cached by skip_harness.

    python scripts/train.py [overrides]            e.g. trainer_mode=separate_async trainer.total_training_steps=10
    python scripts/train.py -m trainer_mode=separate_async trainer.v1.separate_async.parameter_sync_step=1,2,4
    torchrun --standalone --nproc_per_node 2 scripts/train.py

Writes metrics.jsonl in the Hydra run directory; the cache goes to skip.rollout_tq.dump_dir.
"""
from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from skip_harness.config import k_of
from skip_harness.demo.config import DemoConfig, register_demo_configs
from skip_harness.demo.run import train
from skip_harness.errors import ConfigError, SkipHarnessError
from skip_harness.integrations.hydra import (
    config_composed, note_config_composed, record_job_failure, record_job_summary,
)
from skip_harness.integrations.hydra_run import refuse_unknown_overrides, run_id

log = logging.getLogger("skip_harness")

register_demo_configs()
# the run and sweep directories' name: `{start}_pid{pid}`, under torchrun `{launcher's start}_launch{its pid}`
OmegaConf.register_new_resolver("skip_harness_run_id", run_id, replace=True)
# a sweep job's `K{K}`: the one K rule on the two keys the demo's schema has (separate_async's parameter_sync_step)
OmegaConf.register_new_resolver("skip_harness_k", lambda mode, k: k_of(
    {"trainer": {"v1": {"trainer_mode": str(mode), "separate_async": {"parameter_sync_step": int(k)}}}})[1], replace=True)


def _shut_down_process_group() -> None:
    """Under torchrun / accelerate: every rank leaves the process group together before exiting, so no
    rank's exit races another's last collective (gloo aborts a process that exits mid-teardown)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    note_config_composed()
    try:
        result = train(cfg)
    except SkipHarnessError as exc:
        if record_job_failure(exc):  # in a sweep: the other jobs still run; the sweep exits 1 at the end
            return float("nan")
        log.error("%s", exc)
        sys.exit(2)
    if result.metrics and int(os.environ.get("RANK", "0")) == 0:   # a sweep's table: this job's line
        last = result.metrics[-1]
        record_job_summary(result.summary, {k: last[k] for k in ("loss", "reward_mean") if k in last}, result.run_id,
                           step=last.get("step"))
    _shut_down_process_group()
    return float(result.metrics[-1]["reward_mean"]) if result.metrics else float("nan")


def run() -> None:
    """`main` with one exit status for every config error: Hydra exits 1 for a command line or config
    it cannot compose (an unknown key, a bad override), before any job starts; our own config errors
    exit 2 (as a bad command line does), so Hydra's are made 2 as well. A job that fails keeps 1.
    A mistyped key without `+` gets the same message as with it (Hydra's own would advise the `+`)."""
    try:
        refuse_unknown_overrides(DemoConfig, sys.argv[1:])
    except ConfigError as exc:
        logging.basicConfig(format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        log.error("%s (nothing was created: no run directory, nothing in the cache)", exc)
        raise SystemExit(2) from None
    try:
        main()
    except SystemExit as exc:
        if exc.code == 1 and not config_composed():
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    run()
