"""A verl V1 training loop made of verl's own code, on CPU, for the plug-in's tests.

Real: verl's ``ppo_trainer.yaml`` composed with Hydra, Ray on 127.0.0.1, TransferQueue with one storage
unit, verl's ``SkipManager``, its decorated ``PPOTrainer._add_batch_to_generate`` (and the
``_next_train_batch`` / ``_submit_batch_to_rollout`` it calls), ``ReplayBuffer.sample`` and
``ReplayBufferAsync.sample``. Stood in: the rollout (no vLLM / SGLang on CPU) -- :class:`StandInRollout`
writes jagged trajectories into TransferQueue the way verl's ``AgentLoopWorkerTQ`` does (fields built with
verl's ``list_of_dict_to_tensordict``, the same keys and tags, the prompt's status ``running`` then
``finished``) -- and the dataloader (a fixed list of prompts in verl's collate format).

Run as a script it is the run that gets killed: ``python tests/verl_rig.py kill DUMP_DIR MARKER SALT`` records
step 1 of a K = 2 config until inner 0 is durable, writes MARKER and waits to be killed.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

EXPERIMENT = "rig"
PROJECT = "verl"
PROMPTS = 16   # distinct prompts in the stand-in dataloader


def verl_config_dir() -> str:
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def compose(dump_dir: str, *, K: int = 1, action: str = "cache", steps: Sequence[int] = (1, 2),
            train_batch_size: int = 4, n: int = 2, extra: Sequence[str] = (), mode: str = "",
            enable: bool = True) -> Any:
    """verl's own ppo_trainer.yaml, composed with Hydra's compose API, on CPU."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    mode = mode or ("separate_async" if K > 1 else "sync")
    overrides = [
        "trainer.device=cpu",
        "transfer_queue.enable=true",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"trainer.experiment_name={EXPERIMENT}",
        f"trainer.project_name={PROJECT}",
        f"trainer.v1.trainer_mode={mode}",
        f"data.train_batch_size={train_batch_size}",
        "data.max_prompt_length=8",
        "data.max_response_length=6",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.model.path=stand-in/tiny",
        f"skip.rollout_tq.enable={str(enable).lower()}",
        f"skip.rollout_tq.dump_dir={dump_dir}",
        f"skip.rollout_tq.steps=[{','.join(str(s) for s in steps)}]",
        f"skip.rollout_tq.action={action}",
        "+skip_harness.cleanup=quarantine",
    ]
    if K > 1:
        overrides.append(f"trainer.v1.separate_async.parameter_sync_step={K}")
    overrides.extend(extra)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


RAY_ADDRESS_ENV = "SKIP_HARNESS_TEST_RAY_ADDRESS"


def start(cfg: Any) -> str:
    """Ray on 127.0.0.1 and TransferQueue with one storage unit (once per process); with
    $SKIP_HARNESS_TEST_RAY_ADDRESS, attach to that cluster and its TransferQueue instead. Returns the
    cluster's address."""
    import ray
    import transfer_queue as tq

    if not ray.is_initialized():
        address = os.environ.get(RAY_ADDRESS_ENV)
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    tq.init(cfg.transfer_queue)
    return ray.get_runtime_context().gcs_address


def clear_queue() -> None:
    """Remove every key of every partition (between scenarios sharing one TransferQueue)."""
    import transfer_queue as tq

    for partition, items in (tq.kv_list() or {}).items():
        if items:
            tq.kv_clear(keys=list(items), partition_id=partition)


# ------------------------------------------------------------------------------- stand-ins
def dataloader(batch_size: int) -> List[Dict[str, Any]]:
    """verl's collate format: tensors for numbers, 1-D NumPy object arrays for everything else."""
    batches = []
    for start_idx in range(0, PROMPTS, batch_size):
        idx = list(range(start_idx, start_idx + batch_size))
        batches.append({
            "index": torch.tensor(idx, dtype=torch.int64),
            "raw_prompt": np.fromiter(([{"role": "user", "content": f"what is {i} + {i}?"}] for i in idx),
                                      dtype=object, count=len(idx)),
            "data_source": np.fromiter((f"arith/{i % 3}" for i in idx), dtype=object, count=len(idx)),
            "reward_model": np.fromiter(({"ground_truth": str(2 * i), "style": "rule"} for i in idx),
                                        dtype=object, count=len(idx)),
        })
    return batches


class StandInRollout:
    """In place of verl's AgentLoopManagerTQ: writes every session of every prompt into TransferQueue at
    once, as ``AgentLoopWorkerTQ._run_prompt`` / ``_agent_loop_postprocess`` do. `salt` makes each run's
    generations differ, so a replay that returns the first run's batches can only have read them from the cache."""

    def __init__(self, cfg: Any, salt: int, tie_every: int = 0):
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        self.salt = salt
        self.tie_every = tie_every   # prompts whose index is a multiple of it: every session scores alike
        self.calls: List[Dict[str, Any]] = []

    def generate_sequences(self, batch: Any) -> None:
        import transfer_queue as tq
        from tensordict import NonTensorData, NonTensorStack
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        validate = bool(batch["validate"]) if "validate" in batch.keys() else False
        partition = "val" if validate else "train"
        self.calls.append({"partition": partition, "prompts": len(batch)})
        for i in range(len(batch)):
            prompt: Dict[str, Any] = {}
            for k, v in batch.items():
                if k == "validate":
                    continue
                if isinstance(v, torch.Tensor):
                    prompt[k] = v[i]
                elif isinstance(v, NonTensorStack):
                    prompt[k] = v[i].data
                elif isinstance(v, NonTensorData):
                    prompt[k] = v.data
            uid = prompt["uid"]
            tq.kv_put(key=uid, partition_id=partition, tag={"status": "running"})
            keys, fields, tags = [], [], []
            for session in range(self.n):
                f, tag = self._trajectory(prompt, session, validate)
                keys.append(f"{uid}_{session}_0")
                fields.append(f)
                tags.append(tag)
            tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id=partition)
            tq.kv_put(key=uid, partition_id=partition, tag={"status": "finished"})

    def _trajectory(self, prompt: Dict[str, Any], session: int, validate: bool):
        index = int(prompt["index"])
        g = torch.Generator().manual_seed(self.salt * 1_000_003 + index * 101 + session * 7 + (50_000 if validate else 0))
        prompts = torch.arange(3 + index % 4, dtype=torch.int64) + 10 * index
        length = int(torch.randint(1, 7, (1,), generator=g))
        responses = torch.randint(0, 1000, (length,), generator=g, dtype=torch.int64)
        input_ids = torch.cat([prompts, responses])
        reward = float(torch.rand((), generator=g))
        if self.tie_every and index % self.tie_every == 0:
            reward = 0.5   # a tied group: DAPO's filter (algorithm.filter_groups) evicts it
        scores = torch.zeros(length, dtype=torch.float32)
        scores[-1] = reward
        gs = int(prompt["global_steps"])
        f = {
            "prompts": prompts,
            "responses": responses,
            "response_mask": torch.ones(length, dtype=torch.int64),
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(input_ids.numel(), dtype=torch.int64),
            "rollout_log_probs": -torch.rand(length, generator=g, dtype=torch.float32),
            "rm_scores": scores,
            "num_turns": 2,
            "extra_fields": {"min_global_steps": gs, "max_global_steps": gs, "reward_extra_info": {"acc": reward}},
            "session_id": session,
        }
        f.update(prompt)
        f["loss_mask"] = f["response_mask"]
        tag = {"status": "success", "prompt_len": prompts.numel(), "response_len": length,
               "seq_len": prompts.numel() + length, "global_steps": gs, "min_global_steps": gs, "max_global_steps": gs}
        return f, tag


class StandInReference:
    """In place of verl's reference worker group (``ref_policy_wg``): ``compute_ref_log_prob`` writes a
    ``log_probs`` value for every token of each trajectory into TransferQueue, as verl's FSDP worker does,
    with noise drawn per call (a forward that is not bit-reproducible), and counts its calls."""

    def __init__(self, salt: int):
        self.calls = 0
        self.generator = torch.Generator().manual_seed(salt)

    def compute_ref_log_prob(self, batch: Any) -> Any:
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        self.calls += 1
        ids = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        lengths = ids["input_ids"].offsets().diff().tolist()
        log_probs = torch.nested.as_nested_tensor([-torch.rand(int(n), generator=self.generator) for n in lengths],
                                                  layout=torch.jagged)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=tu.get_tensordict({"log_probs": log_probs}))
        return batch


class StandInRewardModel:
    """In place of verl's ``RewardLoopManager`` with a colocated reward model (no reward workers of its own):
    ``compute_rm_score`` scores each response's last token, with noise (a judge that is not deterministic),
    returns an extra info ``acc`` as verl's reward managers do, and counts its calls."""

    reward_loop_worker_handles = None

    def __init__(self, salt: int):
        self.calls = 0
        self.generator = torch.Generator().manual_seed(salt + 10_000)

    def compute_rm_score(self, data: Any) -> Any:
        from tensordict import TensorDict
        from verl.protocol import DataProto

        self.calls += 1
        responses = data.batch["responses"]
        width = responses.shape[1]
        mask = data.batch["attention_mask"][:, -width:]
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        acc = []
        for i in range(responses.shape[0]):
            value = float(torch.rand((), generator=self.generator))
            scores[i, int(mask[i].sum()) - 1] = value
            acc.append(value > 0.5)
        return DataProto(batch=TensorDict({"rm_scores": scores}, batch_size=responses.shape[0]),
                         non_tensor_batch={"acc": np.array(acc, dtype=object)},
                         meta_info={"reward_extra_keys": ["acc"]})


def make_trainer(cfg: Any, rollout: StandInRollout) -> Any:
    """verl's PPOTrainer with only what _add_batch_to_generate needs set (its __init__ builds worker groups)."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cls = PPOTrainerSeparateAsync if cfg.trainer.v1.trainer_mode == "separate_async" else PPOTrainerSync
    trainer = cls.__new__(cls)  # its _add_batch_to_generate is PPOTrainer's, decorated by verl
    trainer.config = cfg
    trainer.global_steps = 0
    trainer.trainer_mode = cfg.trainer.v1.trainer_mode
    trainer.train_dataloader = CountingLoader(dataloader(int(cfg.data.get("gen_batch_size") or
                                                         cfg.data.train_batch_size)))
    trainer.train_dataloader_it = None
    trainer.agent_loop_manager = rollout
    trainer._restored_tq_prompt_count = 0
    trainer.ref_in_actor = False
    trainer.tokenizer = SimpleNamespace(pad_token_id=0)
    return trainer


class CountingLoader:
    """The stand-in dataloader, counting the batches drawn from it (where a run left verl's data stream)."""

    def __init__(self, batches: List[Dict[str, Any]]):
        self.batches = batches
        self.drawn = 0

    def __iter__(self):
        for batch in self.batches:
            self.drawn += 1
            yield batch


def make_buffer(kind: str, cfg: Any, trainer: Any = None) -> Any:
    """verl's sampler; with algorithm.filter_groups.enable, DAPO's (refilling through `trainer`, as verl's
    PPOTrainer._build_replay_buffer wires it)."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    cls = {"sync": ReplayBuffer, "async": ReplayBufferAsync}[kind]
    sampler = cfg.trainer.v1.sampler
    kwargs: Dict[str, Any] = {}
    if bool(cfg.algorithm.filter_groups.enable):
        kwargs = dict(refill_fn=trainer._add_prompts_to_generate, filter_groups_metric="reward")
        if kind == "sync":
            kwargs.update(train_batch_size=int(cfg.data.train_batch_size), gen_batch_size=1)
    return cls(trainer_mode=str(cfg.trainer.v1.trainer_mode), trainer_config=cfg.trainer,
               max_off_policy_threshold=sampler.max_off_policy_threshold,
               max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
               poll_interval=0.05, **kwargs)


# ------------------------------------------------------------------------------- one run
@dataclass
class Sampled:
    step: int
    inner: int
    keys: List[str]
    tags: List[Dict[str, Any]]
    data: Any            # the TensorDict verl's trainer reads for these keys
    metrics: Dict[str, Any] = field(default_factory=dict)   # what sample returned beside the batch


@dataclass
class RunResult:
    sampled: List[Sampled] = field(default_factory=list)
    validation: List[Sampled] = field(default_factory=list)
    rollout_calls: List[Dict[str, Any]] = field(default_factory=list)
    summary: Any = None
    outcomes: Dict[int, str] = field(default_factory=dict)
    drawn: int = 0       # dataloader batches drawn
    reference_calls: int = 0    # with `phases`: the stand-in reference's forward passes
    reward_calls: int = 0       # ... and the stand-in reward model's calls
    phase_fields: List[Any] = field(default_factory=list)   # what verl's two methods left in TransferQueue

    @property
    def train_generations(self) -> int:
        return sum(1 for c in self.rollout_calls if c["partition"] == "train")


def run_steps(cfg: Any, *, buffer: str, salt: int, steps: Sequence[int], validate_at: Sequence[int] = (),
              after_sample=None, after_step=None, warmup: int = 0, tie_every: int = 0,
              phases: bool = False) -> RunResult:
    """verl's step loop for `steps` (fit's order: set_step, [the async warm-up,] submit, K samples,
    validation, kv_clear); `after_step(step, sampled)` where fit logs the step's metrics (its Sampled
    mini-batches). `warmup`: verl's ``_add_async_warmup_batches(warmup)`` before the first step, as
    ``on_train_begin`` calls it in the async trainers. `phases`: after each sample, verl's own
    ``_compute_reward_colocate`` and ``_compute_ref_log_prob`` (``_step_once``'s order) on the mini-batch,
    with a stand-in reward model and reference worker group; what they left in TransferQueue is kept."""
    import transfer_queue as tq
    from verl.utils.skip import SkipManager

    SkipManager.init(cfg)
    skip = SkipManager.skip_instances["rollout_tq"]
    rollout = StandInRollout(cfg, salt, tie_every)
    trainer = make_trainer(cfg, rollout)
    replay = make_buffer(buffer, cfg, trainer)
    reference, reward = StandInReference(salt), StandInRewardModel(salt)
    trainer.ref_policy_wg, trainer.reward_loop_manager = reference, reward
    K = int(cfg.trainer.v1.get(cfg.trainer.v1.trainer_mode, {}).get("parameter_sync_step", 1))
    per_sample = int(cfg.data.train_batch_size) // K
    result = RunResult()
    try:
        for step in steps:
            trainer.global_steps = step
            SkipManager.set_step(step)
            if warmup and step == steps[0]:
                trainer._add_async_warmup_batches(warmup)
            trainer._add_batch_to_generate()
            for inner in range(K):
                batch, metrics = replay.sample(global_steps=step, partition_id="train", batch_size=per_sample)
                data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id)
                result.sampled.append(Sampled(step, inner, list(batch.keys), [dict(t) for t in batch.tags], data,
                                              dict(metrics)))
                if after_sample is not None:
                    after_sample(skip, step, inner)
                if phases:
                    batch = trainer._compute_reward_colocate(batch, metrics={})
                    batch = trainer._compute_ref_log_prob(batch, {})
                    fields = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                             select_fields=["rm_scores", "acc", "ref_log_prob"])
                    result.phase_fields.append({k: plain(fields.get(k)) for k in ("rm_scores", "acc", "ref_log_prob")})
                tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
            if step in validate_at:
                result.validation.append(validate(trainer, replay, rollout, step))
            if after_step is not None:
                after_step(step, [s for s in result.sampled if s.step == step])
    finally:
        result.rollout_calls = rollout.calls
        result.drawn = trainer.train_dataloader.drawn
        result.reference_calls, result.reward_calls = reference.calls, reward.calls
        harness = getattr(skip, "harness", None)   # None: verl's own class, or caching off
        if harness is not None:
            result.outcomes = {s: harness.outcome(s) for s in steps}
            result.summary = skip.close()
        clear_queue()
    return result


def validate(trainer: Any, replay: Any, rollout: StandInRollout, step: int) -> Sampled:
    """verl's PPOTrainer._validate up to its sample call (partition "val")."""
    import uuid

    import transfer_queue as tq
    from verl.utils import tensordict_utils as tu

    batch_dict = dataloader(2)[0]
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(2)], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    tu.assign_non_tensor_data(batch, "validate", True)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in range(len(batch))]
    tq.kv_batch_put(keys=list(batch["uid"]), partition_id="val", tags=tags)
    rollout.generate_sequences(batch)
    sampled, _ = replay.sample(global_steps=step, partition_id="val", batch_size=len(batch))
    data = tq.kv_batch_get(keys=sampled.keys, partition_id="val")
    tq.kv_clear(keys=sampled.keys, partition_id="val")
    return Sampled(step, 0, list(sampled.keys), [dict(t) for t in sampled.tags], data)


# ------------------------------------------------------------------------------- comparing
def plain(value: Any) -> Any:
    """A sampled field as comparable plain data: jagged tensors as (values, offsets), stacks as lists."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return ("jagged", value.values().tolist(), value.offsets().tolist(), str(value.dtype))
        return ("tensor", value.tolist(), str(value.dtype))
    if hasattr(value, "tolist"):
        return ("list", [plain(v) for v in value.tolist()])
    if isinstance(value, (list, tuple)):
        return ("list", [plain(v) for v in value])
    if isinstance(value, dict):
        return ("dict", {k: plain(v) for k, v in sorted(value.items())})
    if isinstance(value, np.ndarray):
        return ("list", [plain(v) for v in value.tolist()])
    return value


def comparable(s: Sampled) -> Dict[str, Any]:
    """Everything verl's trainer gets from one sample call, with this run's prompt uids taken out
    (verl draws a fresh uuid4 per prompt each run): key suffixes, tags, every field but `uid`."""
    fields = {k: plain(s.data.get(k)) for k in sorted(s.data.keys()) if k != "uid"}
    return {"step": s.step, "inner": s.inner, "keys": [k.split("_", 1)[1] for k in s.keys], "tags": s.tags,
            "fields": fields, "groups": _groups(s.keys)}


def _groups(keys: Sequence[str]) -> List[int]:
    """Which trajectories share a prompt, as first-appearance indices (independent of the uid's value)."""
    order: Dict[str, int] = {}
    return [order.setdefault(k.split("_", 1)[0], len(order)) for k in keys]


def uid_field_matches_keys(s: Sampled) -> bool:
    return [str(u) for u in s.data.get("uid").tolist()] == [k.split("_", 1)[0] for k in s.keys]


# ------------------------------------------------------------------------------- the killed run
def _killed_run(dump_dir: str, marker: str, salt: int) -> None:
    """Record step 1 of a K = 2 config; after inner 0 is durable, write `marker` and wait to be killed."""
    cfg = compose(dump_dir, K=2, steps=(1,))
    start(cfg)

    def after(skip: Any, step: int, inner: int) -> None:
        if inner == 0:
            skip.harness.flush()
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)

    run_steps(cfg, buffer="async", salt=salt, steps=(1,), after_sample=after)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "kill":
        _killed_run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit("usage: python tests/verl_rig.py kill DUMP_DIR MARKER SALT")
