"""`train(cfg)`: the demo's whole run as a plain function (scripts/train.py is a thin Hydra shell).

Resolves the run's settings once (`validate`: the demo's adapter to `RunSettings`), builds the one harness
and the trainer from them, wraps the trainer, trains, and writes `metrics.jsonl` (rank 0, metrics over all
ranks) in the run directory.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from omegaconf import OmegaConf

from skip_harness.demo.config import demo_fingerprint_keys, to_demo_config
from skip_harness.run.dist import DistContext
from skip_harness.run.harness import SkipHarness
from skip_harness.run.settings import RunSettings, from_verl_keys, take

log = logging.getLogger("skip_harness.demo")


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    metrics: List[Dict[str, Any]]
    summary: Any
    run_id: Optional[str] = None     # the harness's run id (rank 0): a replay's values are kept under it


def _run_dir(explicit: Optional[Path]) -> Path:
    if explicit is not None:
        return Path(explicit)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # not under Hydra
        return Path.cwd()


def demo_settings(settings: RunSettings):
    """The demo trainer's values from the run's settings (`validate`'s): its DemoConfig and its K."""
    from skip_harness.demo.trainer import DemoSettings

    cfg = settings.config
    arr = cfg.actor_rollout_ref
    return DemoSettings(
        seed=cfg.seed,
        mode=cfg.trainer.v1.trainer_mode,
        K=settings.K,
        train_batch_size=cfg.data.train_batch_size,
        n=arr.rollout.n,
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
        temperature=arr.rollout.temperature,
        lr=arr.actor.optim.lr,
        d_model=arr.model.d_model,
        n_layers=arr.model.n_layers,
        n_heads=arr.model.n_heads,
        clip_ratio=arr.actor.clip_ratio,
        val_size=cfg.data.val_batch_size,
        use_kl_loss=arr.actor.use_kl_loss,
        kl_loss_coef=arr.actor.kl_loss_coef,
        reward_cost_s=cfg.reward_model.cost_s,
        reward_noise=cfg.reward_model.noise,
    )


def validate(cfg: Any) -> RunSettings:
    """The demo's adapter: its whole config checked, with nothing touched -- the schema, every cross-field
    check, K (once), the batch split for $WORLD_SIZE and the harness's own settings -- into the run's one
    `RunSettings` (its DemoConfig in `.config`). Raises ConfigError naming the key. The Hydra startup
    callback calls it too (conf/config.yaml) and takes the namespace from what it returns."""
    demo = to_demo_config(cfg)
    return from_verl_keys(OmegaConf.structured(demo), fingerprint_keys=demo_fingerprint_keys(demo.trainer.v1.trainer_mode),
                          config=demo, w_invariant=True)   # token means over the whole mini-batch (run.shape)


def train(cfg: Any, *, run_dir: Optional[Path] = None) -> TrainResult:
    """Run the demo. `cfg`: a composed DictConfig (or a dict) with the demo's keys.

    Raises ConfigError (naming the key), LockHeldError or FingerprintMismatchError before any work.
    """
    settings = take(cfg) or validate(cfg)   # resolved once: by the Hydra startup callback when it ran
    demo = settings.config
    from accelerate import Accelerator

    from skip_harness.demo.trainer import DemoTrainer

    accelerator = Accelerator(cpu=True)
    dist = DistContext.current()
    threads = demo.trainer.torch_threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    out_dir = _run_dir(run_dir)
    harness = SkipHarness(settings, dist=dist)   # the run's one harness
    harness.start()  # the batch split for this world size, lock, scan, cleanup, fingerprint check: before any work

    trainer = DemoTrainer(demo_settings(settings), accelerator)
    harness.wrap(trainer)
    trainer.phase = lambda name, step, compute, key: harness.phase(name, step, compute, key=key)  # the second tier
    total = demo.trainer.total_training_steps
    say = log.info if dist.is_main else log.debug
    say(
        "training %d step%s: mode=%s K=%d W=%d, %d torch threads, run dir %s, rollout cache %s",
        total, "" if total == 1 else "s", settings.mode, settings.K, dist.world_size, threads, out_dir,
        harness.layout.root if harness.enabled else "off",
    )

    rows: List[Dict[str, Any]] = []
    metrics_file = None
    bar = None
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = open(out_dir / "metrics.jsonl", "w")
        if demo.trainer.progress and sys.stderr.isatty():  # never `\r` frames into a log file or a pipe
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"{settings.mode} K={settings.K}", unit="step", dynamic_ncols=True)

    def on_step_end(step: int, metrics: Dict[str, Any]) -> None:
        row = {"step": step, "cache": harness.outcome(step), **metrics}
        rows.append(row)
        if metrics_file is not None:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
        if bar is not None:
            bar.set_postfix(cache=row["cache"], loss=f"{row['loss']:.4f}", reward=f"{row['reward_mean']:.3f}", refresh=False)
            bar.update(1)
        # recorded with a generated step; checked on a served one: the reward first, the loss it moves after
        harness.observe(step, **{"reward_mean": metrics["reward_mean"], **metrics})
        # skip.rollout_tq.replay_weights: each parameter's digest after the step's updates (every rank calls it)
        harness.observe_weights(step, trainer.accelerator.unwrap_model(trainer.actor))

    t0 = time.perf_counter()
    if bar is not None:
        from tqdm.contrib.logging import logging_redirect_tqdm

        console = logging_redirect_tqdm()  # log lines print above the bar instead of through it
    else:
        console = nullcontext()
    try:
        with console:
            try:
                trainer.fit(total, on_step_end=on_step_end, test_freq=demo.trainer.test_freq)
            finally:
                if bar is not None:
                    bar.close()
    finally:
        summary = harness.close()  # also gives the trainer its own methods back
        if metrics_file is not None:
            metrics_file.close()
    gen = sum(r.get("gen_s", 0.0) for r in rows)
    say(
        "done in %.1fs (generation %.1fs); last reward_mean %.4f; metrics in %s",
        time.perf_counter() - t0, gen, rows[-1]["reward_mean"] if rows else float("nan"), out_dir / "metrics.jsonl",
    )
    return TrainResult(out_dir, rows, summary, harness.run_id if harness.enabled else None)
