"""Record a tiny TRL GRPOTrainer run with skip_harness, replay it in a fresh process, compare.

    python scripts/trl_demo.py [--steps 4] [--workdir DIR]   (without --workdir: a temporary one, removed at the end)

Everything is local: a 2-layer Llama (hidden 64) built from its config and a character tokenizer
made with `tokenizers` are saved into the work directory (no Hub access). The record run generates
and caches every generation; the replay run, a new Python process with the same arguments, is
served from the cache. The report on stdout says whether every non-timing value of
`trainer.state.log_history` is identical, how many generation calls actually ran in each run, and
both wall times.

`--role record|replay` runs one training in this process and writes its result as JSON
(`--result`); the tests use it to replay with other settings (learning rate, changed prompts).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger("trl_demo")

TIMING_SUFFIXES = ("_runtime", "_per_second", "step_time")


# --------------------------------------------------------------------------- local assets
def build_assets(model_dir: Path, seed: int = 0) -> Path:
    """Save a tiny Llama and a character tokenizer into `model_dir` (once)."""
    from skip_harness.demo.tiny_llama import save_tiny_llama

    return Path(save_tiny_llama(model_dir, seed=seed))


def prompts(n: int, changed: Optional[int] = None) -> List[str]:
    """`n` arithmetic prompts; `changed` replaces that one's text (a replay whose prompts differ)."""
    out = [f"{i % 10}+{(3 * i) % 10}=" for i in range(n)]
    if changed is not None:
        out[changed] = "what is this?"
    return out


REWARD_NOISE = 0.0      # --reward-noise: added uniform noise from the OS (a judge whose scores vary from run to run)


def digit_reward(completions: List[str], **_: Any) -> List[float]:
    """Fraction of a completion's characters that are digits: cheap, checkable, varies per sample."""
    noise = random.SystemRandom()       # never the seeded generators: a replay cannot reproduce it
    return [sum(c.isdigit() for c in text) / max(len(text), 1) + REWARD_NOISE * noise.random()
            for text in completions]


def digit_reward_edited(completions: List[str], **_: Any) -> List[float]:
    """`digit_reward` as edited between a recording and its replay (--reward-edited): digits count double."""
    return [2 * sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


digit_reward_edited.__name__ = "digit_reward"     # the same reward function, its source changed


# --------------------------------------------------------------------------- one training run
def train_once(opts: argparse.Namespace) -> Dict[str, Any]:
    """One GRPOTrainer run with the harness attached; returns what the report and tests need."""
    import warnings

    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL's own use of deprecated names
    transformers.utils.logging.disable_progress_bar()

    from skip_harness.integrations.trl import attach

    torch.set_num_threads(opts.threads)
    generations: Counter = Counter()
    phases: Counter = Counter()
    global REWARD_NOISE
    REWARD_NOISE = opts.reward_noise

    class CountingGRPOTrainer(GRPOTrainer):
        """Counts the generation calls, reward computations and reference forwards that really ran
        (a hit, and a phase served from the cache's second tier, never reach these methods)."""

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            generations["train" if self.model.training else "eval"] += 1
            return super()._generate_single_turn(*args, **kwargs)

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
            phases["reward"] += self.model.training
            return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
            if model is self.ref_model and self.model.training:
                phases["reference"] += 1
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    model_dir = build_assets(Path(opts.workdir) / "model")
    train = Dataset.from_dict({"prompt": prompts(opts.prompts, opts.changed_prompt)})
    evaluate = Dataset.from_dict({"prompt": prompts(2)}) if opts.eval_steps else None
    args = GRPOConfig(
        output_dir=opts.output_dir or str(Path(opts.workdir) / f"out_{opts.role}"),
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.grad_accum,
        steps_per_generation=opts.steps_per_generation,
        num_iterations=opts.num_iterations,
        num_generations=opts.num_generations,
        max_completion_length=opts.max_completion_length,
        learning_rate=opts.lr,
        weight_decay=opts.weight_decay,
        beta=opts.beta,
        temperature=opts.temperature,
        seed=opts.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=opts.device == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=0,
        eval_strategy="steps" if opts.eval_steps else "no",
        eval_steps=opts.eval_steps or None,
        per_device_eval_batch_size=2 * opts.num_generations,
    )
    trainer = CountingGRPOTrainer(
        model=str(model_dir), reward_funcs=digit_reward_edited if opts.reward_edited else digit_reward, args=args, train_dataset=train, eval_dataset=evaluate,
    )
    harness = None
    if not opts.no_cache:
        harness = attach(trainer, dump_dir=opts.dump_dir, experiment_name="trl_demo", tier=not opts.no_tier,
                         replay_weights=opts.replay_weights, action=opts.action)
    t0 = time.perf_counter()
    trainer.train()
    wall_s = time.perf_counter() - t0
    result: Dict[str, Any] = {
        "role": opts.role,
        "wall_s": wall_s,
        "log_history": trainer.state.log_history,
        "generation_calls": dict(generations),
        "phase_calls": dict(phases),
        # after train() the harness is closed and TRL's own generation method is back
        "trainer_untouched_after": "_generate_single_turn" not in trainer.__dict__,
    }
    if harness is not None:
        summary = harness.summary()
        result["summary"] = {k: getattr(summary, k) for k in ("hits", "misses", "repeats", "off", "uncommitted",
                                                              "gen_s_spent", "gen_s_saved")}
        result["summary"]["phases"] = {name: {"spent_s": t.spent_s, "saved_s": t.saved_s, "served": t.served,
                                              "computed": t.computed} for name, t in summary.phases.items()}
        result["outcomes"] = {s: harness.outcome(s) for s in range(opts.steps)}
        result["namespace"] = str(harness.layout.root)
        result["replay"] = summary.replay_line
        result["summary_line"] = str(summary)    # the line the harness logs at its end, namespace included
        result["compared"] = summary.compared    # action=compare: `rollouts compared: X of Y trajectories identical`
        result["run_id"] = harness.run_id
        result["K"] = harness.K
    return result


# --------------------------------------------------------------------------- comparison
def is_timing(key: str) -> bool:
    return key.endswith(TIMING_SUFFIXES)


def non_timing(history: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{k: v for k, v in entry.items() if not is_timing(k)} for entry in history]


def differing_keys(a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> List[str]:
    """The non-timing keys whose values differ in any log entry (or 'length' when the histories do)."""
    a, b = non_timing(a), non_timing(b)
    if len(a) != len(b):
        return ["length"]
    keys = set()
    for x, y in zip(a, b):
        keys |= {k for k in set(x) | set(y) if json.dumps(x.get(k)) != json.dumps(y.get(k))}
    return sorted(keys)


# --------------------------------------------------------------------------- driver
def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("demo", "record", "replay"), default="demo")
    p.add_argument("--workdir", help="model, outputs and cache (default: a new temporary directory, removed at the end)")
    p.add_argument("--dump-dir", help="cache root (default: WORKDIR/cache)")
    p.add_argument("--result", help="--role record|replay: write the run's result here as JSON")
    p.add_argument("--output-dir", help="the trainer's output_dir (default: WORKDIR/out_ROLE)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="training prompts (8: each used once in 4 steps)")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (completions)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps-per-generation", type=int, default=None)
    p.add_argument("--num-iterations", type=int, default=1, help="GRPO's mu: optimizer steps per generation")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's weight decay (a training-side change "
                   "the first step's loss does not show: its update does)")
    p.add_argument("--replay-weights", action="store_true", help="skip.rollout_tq.replay_weights=true: a digest of "
                   "each parameter after each update, in the replay check")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-steps", type=int, default=2, help="evaluate every N steps (0: never)")
    p.add_argument("--changed-prompt", type=int, default=None, help="replace training prompt i's text")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: let TRL use the GPU")
    p.add_argument("--no-cache", action="store_true", help="run TRL without the harness")
    p.add_argument("--action", choices=("cache", "repeat", "compare"), default="cache",
                   help="skip.rollout_tq.action (compare: generate anyway, measure the drift from the recording)")
    p.add_argument("--no-tier", action="store_true", help="skip.rollout_tq.tier=false: rewards and reference "
                   "log-probs are recomputed on a replay")
    p.add_argument("--reward-noise", type=float, default=0.0, help="add this much OS-random noise to each reward")
    p.add_argument("--reward-edited", action="store_true", help="use an edited digit_reward (its source differs)")
    opts = p.parse_args(argv)
    opts.own_workdir = opts.workdir is None   # made here: removed when the run ends
    if opts.workdir is None:
        opts.workdir = tempfile.mkdtemp(prefix="trl_demo_")
    if opts.dump_dir is None:
        opts.dump_dir = str(Path(opts.workdir) / "cache")
    return opts


def _without(argv: List[str], options: tuple) -> List[str]:
    """`argv` less the given options and their values (``--opt v`` or ``--opt=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(o + "=" for o in options)):
            out.append(arg)
    return out


def child(role: str, opts: argparse.Namespace, argv: List[str]) -> Dict[str, Any]:
    """Run one training as a fresh Python process and read back its result."""
    result = Path(opts.workdir) / f"{role}.json"
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--role", role, "--workdir", opts.workdir,
           "--dump-dir", opts.dump_dir, "--result", str(result)]
    # the child's own output (trainer logs, warnings) goes to stderr; stdout carries only the report
    proc = subprocess.run(cmd, stdout=sys.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"trl_demo: the {role} run failed (exit status {proc.returncode}); see its output above")
    return json.loads(result.read_text())


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(opts, argv)
    finally:
        if opts.own_workdir:   # the temporary directory this run made (model, outputs, cache): nothing left behind
            shutil.rmtree(opts.workdir, ignore_errors=True)


def run(opts: argparse.Namespace, argv: List[str]) -> int:
    if opts.role != "demo":
        result = train_once(opts)
        if opts.result:
            Path(opts.result).write_text(json.dumps(result))
        return 0
    if not any(a == "--dump-dir" or a.startswith("--dump-dir=") for a in argv):
        shutil.rmtree(opts.dump_dir, ignore_errors=True)  # the demo's own cache: record from scratch
    passthrough = _without(argv, ("--workdir", "--dump-dir", "--role", "--result", "--output-dir"))
    record = child("record", opts, passthrough)
    replay = child("replay", opts, passthrough)
    differing = differing_keys(record["log_history"], replay["log_history"])
    identical = not differing
    report = {
        "identical": identical,
        "differing_keys": differing,
        "log_entries": len(record["log_history"]),
        "record_wall_s": round(record["wall_s"], 3),
        "replay_wall_s": round(replay["wall_s"], 3),
        "record_generation_calls": record["generation_calls"],
        "replay_generation_calls": replay["generation_calls"],
        "record_phase_calls": record["phase_calls"],
        "replay_phase_calls": replay["phase_calls"],
        "untouched_after_train": record["trainer_untouched_after"] and replay["trainer_untouched_after"],
        "record_summary": record.get("summary"),
        "replay_summary": replay.get("summary"),
        "namespace": record.get("namespace"),
    }
    print(
        f"log history identical (every non-timing value of {report['log_entries']} entries): {identical}"
        + ("" if identical else f" — differing keys: {', '.join(differing)}")
    )
    for name, run in (("record", record), ("replay", replay)):
        summary = run.get("summary") or {}
        print(f"{name}: train() {run['wall_s']:.2f} s; generation calls that ran: {run['generation_calls']}; "
              f"cache: {_count(summary.get('hits', 0), 'hit')}, {_count(summary.get('misses', 0), 'miss', 'misses')}, "
              f"generation {summary.get('gen_s_spent', 0.0):.2f} s spent, {summary.get('gen_s_saved', 0.0):.2f} s saved")
    if report["namespace"]:
        kept = " (removed with the temporary work directory at exit; --workdir DIR keeps it)" if opts.own_workdir else ""
        print(f"cache: {report['namespace']}{kept}; steps numbered from 0 as TRL's global_step (docs/trl.md)")
    print("REPORT " + json.dumps(report))
    return 0 if identical else 1


def _count(n: int, word: str, plural: str = "") -> str:
    """`1 hit`, `2 hits`, `1 miss`, `0 misses`."""
    return f"{n} {word if n == 1 else (plural or word + 's')}"


if __name__ == "__main__":
    sys.exit(main())
