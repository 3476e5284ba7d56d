"""The demo RL trainer: GRPO on the sort task, in verl's three trainer modes.

Each step has two phases the harness can wrap: ``prepare_data(step)`` advances the data stream (draws
the step's prompts) and dispatches their generation, and ``sample(step)`` collects one finished
mini-batch. ``fit`` always calls both through attribute lookup on ``self``, so wrappers installed on
the instance take effect. Everything ``train_on`` needs travels in the dict ``sample`` returns, so a
mini-batch served from a cache trains exactly like a generated one.

Modes (as in verl):

- ``sync`` (K = 1): prepare_data(s) syncs the rollout weights and dispatches; sample(s) generates and
  returns the batch; one update.
- ``colocate_async`` (K = 1): right after sample(s), prepare_data(s + 1) dispatches the next step's
  generation to a background thread with the weights from before step s's update, then step s trains.
- ``separate_async`` (K >= 1): prepare_data(s) syncs the rollout weights once and dispatches K
  mini-batches to a background thread; each of the K sample(s) calls waits for its mini-batch and is
  followed by one update, so training on mini-batch i overlaps generating mini-batch i + 1.

The rollout engine is its own copy of the policy (verl's rollout vs actor), so background generation
never reads weights the optimizer is writing. Determinism: prompts depend only on (seed, step); each
generation draws from its own ``torch.Generator`` seeded by (seed, step, inner index, rank);
initialisation runs under a forked RNG; there is no dropout. Nothing touches a global random
generator, so skipping a generation (a cache hit) leaves every later step exactly as it would be.
"""
from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
import random
from typing import Any, Callable, Dict, List, Mapping, Optional

import accelerate
import torch

from skip_harness.config import TRAINER_MODES
from skip_harness.demo.policy import Policy, PolicyConfig, sequence_logprobs
from skip_harness.demo.task import SortTask, derive_seed
from skip_harness.run.tier import REFERENCE, REWARD, digest_text, source_digest, weights_digest

log = logging.getLogger("skip_harness.demo")


#: The keys of a training mini-batch as ``sample`` returns it (all CPU tensors).
BATCH_KEYS = ("prompts", "responses", "response_mask", "old_logprobs", "rewards", "uid", "step", "inner_index", "rank")

_GENERATION_DOMAIN = 0x6E6  # keeps generation seeds apart from the data stream's


@dataclass(frozen=True)
class DemoSettings:
    """Plain values; the config layer fills them from the Hydra keys."""

    seed: int
    mode: str  # "sync" | "colocate_async" | "separate_async"
    K: int  # sample calls per step (1 unless separate_async)
    train_batch_size: int  # prompts per step, global over ranks
    n: int  # samples per prompt (GRPO group size)
    max_prompt_length: int
    max_response_length: int
    temperature: float
    lr: float
    d_model: int
    n_layers: int
    n_heads: int
    clip_ratio: float = 0.2
    val_size: int = 32
    max_grad_norm: float = 1.0
    use_kl_loss: bool = False          # a KL term against the reference policy (verl's use_kl_loss, low_var_kl)
    kl_loss_coef: float = 0.001
    reward_cost_s: float = 0.0         # > 0 or reward_noise > 0: rewards come from the reward phase
    reward_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in TRAINER_MODES:
            raise ValueError(f"mode must be one of {TRAINER_MODES}, got {self.mode!r}")
        if self.K < 1:
            raise ValueError(f"K must be >= 1, got {self.K}")
        if self.mode != "separate_async" and self.K != 1:
            raise ValueError(f"K must be 1 in mode {self.mode!r}, got {self.K}")
        if self.train_batch_size < 1 or self.train_batch_size % self.K:
            raise ValueError(f"train_batch_size ({self.train_batch_size}) must be a positive multiple of K ({self.K})")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if self.val_size < 1:
            raise ValueError(f"val_size must be >= 1, got {self.val_size}")


def generation_seed(seed: int, step: int, inner_index: int, rank: int) -> int:
    """The seed of one generation: its own stream, so skipping one never shifts another."""
    return derive_seed(_GENERATION_DOMAIN, seed, step, inner_index, rank)


def group_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """GRPO: (reward - group mean) / (group std + 1e-6) over each prompt's n consecutive samples."""
    if n == 1:
        return torch.zeros_like(rewards)
    groups = rewards.view(-1, n)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-6)
    return adv.reshape(-1)


@dataclass
class _PreparedStep:
    """A step's prompts (this rank's shard of each inner mini-batch) and the dispatched generations."""

    shards: List[torch.Tensor]
    uids: List[torch.Tensor]
    jobs: List[Optional[Future]] = field(default_factory=list)
    served: int = 0


class DemoTrainer:
    """GRPO on the sort task with a small transformer; see the module docstring for the modes."""

    def __init__(self, settings: DemoSettings, accelerator: accelerate.Accelerator):
        self.settings = settings
        self.accelerator = accelerator
        self.rank = accelerator.process_index
        self.world_size = accelerator.num_processes
        per_call = settings.K * self.world_size
        if settings.train_batch_size % per_call:
            raise ValueError(
                f"train_batch_size ({settings.train_batch_size}) must be a multiple of K x W "
                f"({settings.K} x {self.world_size})"
            )
        self.prompts_per_sample = settings.train_batch_size // per_call
        self.task = SortTask(settings.max_prompt_length, settings.max_response_length)
        self.policy_config = PolicyConfig(
            max_len=settings.max_prompt_length + settings.max_response_length,
            d_model=settings.d_model,
            n_layers=settings.n_layers,
            n_heads=settings.n_heads,
        )
        actor = Policy(self.policy_config, seed=settings.seed)
        self.rollout = copy.deepcopy(actor).requires_grad_(False)  # the rollout engine's own weights
        # the reference policy of the KL term: the initial weights, frozen (verl's ref)
        self.ref = copy.deepcopy(actor).requires_grad_(False) if settings.use_kl_loss else None
        # how a phase computed from a step's rollouts runs: `run.train` routes it through the harness's
        # second tier (SkipHarness.phase), which may serve it from the cache instead
        self.phase: Callable[[str, int, Callable[[], Any], Mapping[str, str]], Any] = \
            lambda name, step, compute, key: compute()
        optimizer = torch.optim.Adam(actor.parameters(), lr=settings.lr)
        self.actor, self.optimizer = accelerator.prepare(actor, optimizer)
        self.val_prompts = self.task.validation_prompts(settings.seed, settings.val_size).tensor_split(
            self.world_size
        )[self.rank]
        self.generations = 0  # generations this process has started (a cache hit starts none)
        self._prepared: Dict[int, _PreparedStep] = {}
        self._val_prepared: Dict[int, torch.Tensor] = {}
        self._executor: Optional[ThreadPoolExecutor] = None
        if accelerator.is_main_process:
            log.info(
                "demo trainer: mode=%s K=%d W=%d, %d prompts x %d samples per sample call, "
                "policy d_model=%d layers=%d heads=%d (%d parameters)",
                settings.mode, settings.K, self.world_size, self.prompts_per_sample, settings.n,
                settings.d_model, settings.n_layers, settings.n_heads,
                sum(p.numel() for p in actor.parameters()),
            )

    # ------------------------------------------------------------------ the two wrapped phases

    def prepare_data(self, step: int, *, dispatch: bool = True, validate: bool = False) -> None:
        """Advance the data stream to ``step`` and, if ``dispatch``, start generating its K mini-batches.

        With ``dispatch=False`` (a cache hit) the prompts are drawn and recorded but no generation starts.
        With ``validate=True`` only the held-out prompts are staged; no training state changes.
        """
        if validate:
            self._val_prepared[step] = self.val_prompts
            return
        s = self.settings
        prompts = self.task.make_prompts(s.seed, step, s.train_batch_size)
        uids = torch.arange(s.train_batch_size)
        shards, shard_uids = [], []
        for inner_prompts, inner_uids in zip(prompts.chunk(s.K), uids.chunk(s.K)):
            shards.append(inner_prompts.chunk(self.world_size)[self.rank])
            shard_uids.append(inner_uids.chunk(self.world_size)[self.rank])
        self._drain()  # no generation may still be reading the rollout weights
        prepared = _PreparedStep(shards, shard_uids)
        self._prepared = {step: prepared}  # a step prepared but never sampled (a hit) is dropped here
        self._sync_rollout_weights()  # a copy, not a generation: the step's K mini-batches use these weights
        if not dispatch:
            return
        for inner_index in range(s.K):
            if s.mode == "sync":
                prepared.jobs.append(None)  # generated in the caller's thread when sampled
            else:
                self.generations += 1
                prepared.jobs.append(self._rollout_executor().submit(self._generate, step, inner_index, prepared))

    def sample(self, step: int, *, validate: bool = False) -> Dict[str, torch.Tensor]:
        """Collect the next finished mini-batch of ``step``: a flat dict of CPU tensors (``BATCH_KEYS``)."""
        if validate:
            prompts = self._val_prepared.pop(step, None)
            if prompts is None:
                raise RuntimeError(f"sample(step={step}, validate=True) before prepare_data(step={step}, validate=True)")
            responses, _, mask = self.accelerator.unwrap_model(self.actor).generate(
                prompts, self.settings.max_response_length, n=1, temperature=0.0
            )
            return {
                "prompts": prompts,
                "responses": responses,
                "response_mask": mask,
                "rewards": self.task.reward(prompts, responses),
            }
        prepared = self._prepared.get(step)
        if prepared is None:
            raise RuntimeError(f"sample(step={step}) before prepare_data(step={step})")
        inner_index = prepared.served
        if inner_index >= self.settings.K:
            raise RuntimeError(f"sample(step={step}) called more than K={self.settings.K} times")
        prepared.served += 1
        job = prepared.jobs[inner_index] if inner_index < len(prepared.jobs) else None
        if job is not None:
            return job.result()
        # sync mode, or prepared without dispatch yet asked to generate: generate here, now
        self.generations += 1
        return self._generate(step, inner_index, prepared)

    # ------------------------------------------------------------------ training

    def train_on(self, step: int, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """One PPO-clip update on one mini-batch; metrics are averaged over ranks."""
        s = self.settings
        prompts, responses = batch["prompts"], batch["responses"]
        mask = batch["response_mask"].to(torch.float32)
        old_logprobs, rewards = batch["old_logprobs"], batch["rewards"]
        if s.reward_cost_s > 0 or s.reward_noise > 0:
            rewards = self.phase(REWARD, step, lambda: self.judge(prompts, responses), self.reward_key())
        ref_logprobs = None
        if self.ref is not None:
            ref_logprobs = self.phase(REFERENCE, step, lambda: self.reference_logprobs(prompts, responses),
                                      self.reference_key())
        advantages = group_advantages(rewards, s.n).unsqueeze(1)

        self.actor.train()
        logprobs = sequence_logprobs(self.actor, prompts, responses, s.temperature)
        log_ratio = logprobs - old_logprobs
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1.0 - s.clip_ratio, 1.0 + s.clip_ratio)
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
        # Token means over the whole mini-batch, every rank's shard together: each rank's sum is scaled by
        # W / (the mini-batch's tokens), so the gradient the ranks average and the metrics they average
        # are the ones one process would compute on the whole mini-batch (a replay on another number of
        # ranks trains alike, to float rounding). With one process this is the plain token mean.
        all_tokens = self.accelerator.reduce(mask.sum().detach(), reduction="sum").clamp_min(1.0)
        tokens = all_tokens / self.world_size
        loss = (per_token * mask).sum() / tokens
        kl_loss = None
        if ref_logprobs is not None:     # verl's low_var_kl, clamped as verl clamps it
            d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
            kl = (d.exp() - d - 1.0).clamp(-10.0, 10.0)
            kl_loss = (kl * mask).sum() / tokens
            loss = loss + s.kl_loss_coef * kl_loss

        self.optimizer.zero_grad(set_to_none=True)
        self.accelerator.backward(loss)
        grad_norm = self.accelerator.clip_grad_norm_(self.actor.parameters(), s.max_grad_norm)
        self.optimizer.step()

        with torch.no_grad():
            clip_frac = (((ratio - 1.0).abs() > s.clip_ratio).float() * mask).sum() / tokens
            approx_kl = (0.5 * log_ratio.pow(2) * mask).sum() / tokens
            local = torch.stack([
                loss.detach(),
                rewards.mean(),
                mask.sum(dim=1).mean(),
                clip_frac,
                approx_kl,
                torch.as_tensor(grad_norm, dtype=torch.float32),
            ]).to(torch.float32)
            if kl_loss is not None:
                local = torch.cat([local, kl_loss.detach().reshape(1).to(torch.float32)])
        reduced = self.accelerator.reduce(local, reduction="mean")
        names = ("loss", "reward_mean", "response_len", "clip_frac", "approx_kl", "grad_norm", "kl_loss")
        return dict(zip(names, reduced.tolist()))

    # ------------------------------------------------------------------ the second tier's phases

    def judge(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """The reward phase: the task's reward, after `reward_cost_s` seconds of waiting (a remote judge,
        a sandbox), plus `reward_noise` x uniform noise from the OS (no seed reproduces it)."""
        s = self.settings
        rewards = self.task.reward(prompts, responses)
        if s.reward_cost_s > 0:
            time.sleep(s.reward_cost_s)
        if s.reward_noise > 0:
            noise = random.SystemRandom()
            rewards = rewards + s.reward_noise * torch.tensor([noise.random() for _ in range(len(rewards))])
        return rewards

    def reward_key(self) -> Dict[str, str]:
        """The reward phase's validity key: the reward's source and its noise setting."""
        if not hasattr(self, "_reward_key"):
            self._reward_key = {"reward function sort_reward": source_digest(SortTask.reward) + source_digest(SortTask.targets),
                                "reward config noise": repr(self.settings.reward_noise)}
        return self._reward_key

    def reference_logprobs(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """The reference phase: the frozen reference policy's per-token log-probs of the responses."""
        with torch.no_grad():
            return sequence_logprobs(self.ref, prompts, responses, self.settings.temperature)

    def reference_key(self) -> Dict[str, str]:
        """The reference phase's validity key: the reference's weights and the temperature it reads."""
        if not hasattr(self, "_reference_key"):
            self._reference_key = {"reference model weights": weights_digest(self.ref),
                                   "reference model code": digest_text(source_digest(sequence_logprobs)),
                                   "reference setting temperature": repr(self.settings.temperature)}
        return self._reference_key

    def validate(self, step: int) -> Dict[str, float]:
        """Greedy decoding on the held-out prompts with the current weights: ``{"val_reward": ...}``."""
        self.prepare_data(step, validate=True)
        batch = self.sample(step, validate=True)
        rewards = batch["rewards"].to(torch.float64)
        count = torch.tensor(float(rewards.numel()), dtype=torch.float64)
        totals = self.accelerator.reduce(torch.stack([rewards.sum(), count]), reduction="sum")
        return {"val_reward": (totals[0] / totals[1]).item()}

    def fit(
        self,
        total_steps: int,
        *,
        on_step_end: Callable[[int, Dict[str, float]], None],
        test_freq: int = 0,
    ) -> None:
        """Train steps 1..total_steps in the configured mode, reporting each step to ``on_step_end``.

        Metrics: the mean over the step's K updates of ``train_on``'s metrics, ``val_reward`` on
        validation steps (every ``test_freq`` and the last), and the timings ``gen_s`` (inside
        prepare_data and sample calls for this step), ``train_s``, ``val_s`` and ``step_s``.
        """
        mode, K = self.settings.mode, self.settings.K
        gen_s: Dict[int, float] = {}

        def prepare(step: int) -> None:
            t0 = time.perf_counter()
            self.prepare_data(step)  # looked up on self at call time: the harness may have wrapped it
            gen_s[step] = gen_s.get(step, 0.0) + time.perf_counter() - t0

        def sample(step: int) -> Dict[str, torch.Tensor]:
            t0 = time.perf_counter()
            batch = self.sample(step)
            gen_s[step] = gen_s.get(step, 0.0) + time.perf_counter() - t0
            return batch

        try:
            for step in range(1, total_steps + 1):
                t_step = time.perf_counter()
                train_s = 0.0
                updates: List[Dict[str, float]] = []

                def train(batch: Dict[str, torch.Tensor]) -> None:
                    nonlocal train_s
                    t0 = time.perf_counter()
                    updates.append(self.train_on(step, batch))  # noqa: B023 - called in this iteration
                    train_s += time.perf_counter() - t0

                if mode == "sync":
                    prepare(step)
                    train(sample(step))
                elif mode == "colocate_async":
                    if step == 1:
                        prepare(1)
                    batch = sample(step)
                    if step < total_steps:
                        prepare(step + 1)  # dispatched before this step's update: one step off-policy
                    train(batch)
                else:
                    prepare(step)
                    for _ in range(K):
                        train(sample(step))

                metrics = {key: sum(u[key] for u in updates) / len(updates) for key in updates[0]}
                if test_freq > 0 and (step % test_freq == 0 or step == total_steps):
                    t0 = time.perf_counter()
                    metrics.update(self.validate(step))
                    metrics["val_s"] = time.perf_counter() - t0
                metrics["gen_s"] = gen_s.pop(step, 0.0)
                metrics["train_s"] = train_s
                metrics["step_s"] = time.perf_counter() - t_step
                log.debug("step %d: %s", step, metrics)
                on_step_end(step, metrics)
        finally:
            self.close()

    def close(self) -> None:
        """Wait for background generation and stop the rollout thread (it restarts when needed)."""
        self._drain()
        self._prepared.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ internals

    def _rollout_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skip_harness-rollout")
        return self._executor

    def _drain(self) -> None:
        for prepared in self._prepared.values():
            for job in prepared.jobs:
                if job is not None:
                    try:
                        job.result()
                    except Exception:  # already reported to whoever sampled it, or never wanted
                        pass

    def _sync_rollout_weights(self) -> None:
        actor = self.accelerator.unwrap_model(self.actor)
        with torch.no_grad():
            self.rollout.load_state_dict(actor.state_dict())

    def _generate(self, step: int, inner_index: int, prepared: _PreparedStep) -> Dict[str, torch.Tensor]:
        s = self.settings
        prompts = prepared.shards[inner_index]
        generator = torch.Generator().manual_seed(generation_seed(s.seed, step, inner_index, self.rank))
        responses, logprobs, mask = self.rollout.generate(
            prompts, s.max_response_length, n=s.n, temperature=s.temperature, generator=generator
        )
        return {
            "prompts": prompts.repeat_interleave(s.n, dim=0),
            "responses": responses,
            "response_mask": mask,
            "old_logprobs": logprobs,
            "rewards": self.task.reward(prompts, responses),
            "uid": prepared.uids[inner_index].repeat_interleave(s.n),
            "step": torch.tensor(step),
            "inner_index": torch.tensor(inner_index),
            "rank": torch.tensor(self.rank),
        }
