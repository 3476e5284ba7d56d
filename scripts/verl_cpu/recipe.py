"""What a CPU run of ``python -m verl.trainer.main_ppo`` needs: a tiny random-weight Llama with a chat
template, a parquet dataset of arithmetic prompts, a reward function, and the overrides.

``python -m verl_cpu.recipe WORKDIR`` (scripts/ on PYTHONPATH) prints the command."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, List, Sequence

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE.parent      # verl_cpu's parent: on the PYTHONPATH of every process main_ppo starts
REPO = SCRIPTS.parent
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}={% endif %}")
MODULES = "skip_harness.integrations.verl,verl_cpu"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1 for the right answer, else the share of digits in the response (some signal for GRPO)."""
    text = (solution_str or "").strip()
    if text.startswith(str(ground_truth)):
        return 1.0
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def tied_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """A coarse reward (the response's digit count, in thirds) so that some GRPO groups tie: their samples
    all score alike and DAPO's filter (``algorithm.filter_groups``) evicts them."""
    text = (solution_str or "").strip()
    return float(sum(c.isdigit() for c in text) % 3) / 2


def save_model(model_dir: Path) -> str:
    from skip_harness.demo.tiny_llama import save_tiny_llama

    path = save_tiny_llama(model_dir, seed=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template != CHAT_TEMPLATE:
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
    return path


def save_data(data_dir: Path, rows: int = 16) -> Dict[str, str]:
    import pandas as pd

    data_dir.mkdir(parents=True, exist_ok=True)
    records = [{
        "data_source": "arith",
        "prompt": [{"role": "user", "content": f"{i}+{i + 1}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
        "extra_info": {"index": i, "split": "train"},
    } for i in range(rows)]
    paths = {}
    for split in ("train", "val"):
        path = data_dir / f"{split}.parquet"
        if not path.exists():
            pd.DataFrame(records).to_parquet(path)
        paths[split] = str(path)
    return paths


def prepare(workdir: Path) -> Dict[str, str]:
    workdir = Path(workdir)
    paths = save_data(workdir / "data")
    paths["model"] = save_model(workdir / "model")
    return paths


def overrides(paths: Dict[str, str], *, steps: int = 3, batch: int = 4, n: int = 2, response_length: int = 16,
              mode: str = "sync", K: int = 2, experiment: str = "cpu", warmup: int = 0, dapo: bool = False,
              seed: int | None = None, extra: Sequence[str] = ()) -> List[str]:
    """``main_ppo`` overrides for a CPU run: GRPO, FSDP2 on gloo, TransferQueue, the hf_cpu rollout."""
    args = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
        f"data.train_batch_size={batch}", "data.max_prompt_length=16", f"data.max_response_length={response_length}",
        "data.dataloader_num_workers=0", "data.shuffle=false",
        f"actor_rollout_ref.model.path={paths['model']}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.rollout.name=hf_cpu", f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "algorithm.use_kl_in_reward=false", "reward.num_workers=1",
        f"reward.custom_reward_function.path={HERE / 'recipe.py'}", "reward.custom_reward_function.name=compute_score",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=100",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[console,file]", "trainer.project_name=verl_cpu", f"trainer.experiment_name={experiment}",
        f"trainer.v1.trainer_mode={mode}",
        "transfer_queue.enable=true", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=false",
    ]
    if mode == "separate_async":
        # standalone rollout replicas on their own "GPU" bundle, the weights through Ray's object store
        args = [a for a in args if not a.startswith(("actor_rollout_ref.rollout.checkpoint_engine.backend=",
                                                     "+ray_kwargs.ray_init.num_gpus=",
                                                     "actor_rollout_ref.actor.ppo_mini_batch_size=")) and
                "micro_batch_size_per_gpu=" not in a]
        micro = n * batch // K   # one sample call's trajectories: verl needs micro batches that divide it
        args += [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                 f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
                 f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}"]
        args += [f"trainer.v1.separate_async.parameter_sync_step={K}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // K}",
                 "actor_rollout_ref.hybrid_engine=false",
                 "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                 "actor_rollout_ref.rollout.checkpoint_engine.backend=ray_store",
                 "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_cpu.weights",
                 "+ray_kwargs.ray_init.num_gpus=2"]
    if mode in ("colocate_async", "separate_async"):
        args.append(f"trainer.v1.{mode}.num_warmup_batches={warmup}")
    if dapo:
        # DAPO: groups whose samples all score alike are evicted and refilled (a reward that ties some)
        args = [a for a in args if not a.startswith("reward.custom_reward_function.name=")]
        args += ["reward.custom_reward_function.name=tied_score", "algorithm.filter_groups.enable=true",
                 "algorithm.filter_groups.metric=reward"]
    if seed is not None:
        args.append(f"+actor_rollout_ref.rollout.custom.seed={seed}")
    return args + list(extra)


def environment(extra_pythonpath: Sequence[str] = ()) -> Dict[str, str]:
    """The environment ``main_ppo`` runs in: verl loads the plug-in and this rig in every process."""
    env = dict(os.environ)
    env["VERL_USE_EXTERNAL_MODULES"] = MODULES
    env["VERL_PLATFORM"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(SCRIPTS), *extra_pythonpath, env.get("PYTHONPATH", "")])
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


if __name__ == "__main__":
    paths = prepare(Path(sys.argv[1]))
    print(" ".join([f"VERL_USE_EXTERNAL_MODULES={MODULES}", "VERL_PLATFORM=cpu", sys.executable, "-m",
                    "verl.trainer.main_ppo", *overrides(paths)]))
