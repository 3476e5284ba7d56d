"""``rollout.name=hf_cpu``: a rollout backend for verl's V1 trainer on CPU -- transformers' ``generate``
in a Ray actor, in place of vLLM / SGLang (neither runs on a CPU-only machine).

verl registers only vLLM, SGLang and TensorRT-LLM replicas for this trainer
(verl/workers/rollout/replica.py:388-390; ``hf_rollout.py`` / ``naive_rollout.py`` are V0 classes). Three
small classes plug in where vLLM's do:

- :class:`HFServer` (a Ray actor, like ``vLLMHttpServer``): holds a copy of the model and answers verl's
  agent loop, ``generate(request_id, prompt_ids, sampling_params) -> TokenOutput`` with log-probs;
- :class:`HFReplica` (``RolloutReplica``, registered with ``RolloutReplicaRegistry``): starts the server
  next to the hybrid worker, as ``vLLMReplica.launch_servers`` does;
- :class:`HFServerAdapter` (``BaseRollout``, in the FSDP worker): receives the actor's weights through
  verl's ``naive`` weight sync each step and loads them into the server.

Sampling is seeded from the OS on purpose: two runs generate different rollouts (as vLLM's do), so a
replay that matches the recording can only have read the cache. With ``custom.seed`` set, each call
samples from a generator seeded by (seed, prompt tokens, weights version, how many times this server saw
that prompt at that version): generation is then deterministic, whatever order the calls of different
prompts arrive in, so a run with the cache and one without can be compared. Every ``generate`` call appends a line to
the file named by ``actor_rollout_ref.rollout.custom.generate_log`` (when set): the tests count them;
``custom.generate_delay_s`` slows each call (a test's window to kill a run mid-step).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "hf_cpu"


def _server_name(replica_rank: int) -> str:
    return f"verl_cpu_hf_server_{replica_rank}"


def _custom(config: Any, key: str) -> Optional[str]:
    custom = getattr(config, "custom", None) or {}
    return custom.get(key) if hasattr(custom, "get") else None


class HFServer:
    """transformers' generate behind verl's token-in / token-out server interface."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config.path
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.pad_token_id = self.model.config.pad_token_id
        self.eos_token_id = self.model.config.eos_token_id
        self.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.lock = threading.Lock()
        self.generate_log = _custom(config, "generate_log")
        self.generate_delay_s = float(_custom(config, "generate_delay_s") or 0)   # widens a test's kill window
        self.global_steps: Optional[int] = None
        seed = _custom(config, "seed")
        self.seed = None if seed is None else int(seed)
        self.seen: Dict[Any, int] = {}

    def load_weights(self, state: Dict[str, torch.Tensor], global_steps: Optional[int] = None) -> int:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise RuntimeError(f"hf_cpu: weights the model does not have: {sorted(unexpected)[:5]}")
        self.global_steps = global_steps
        return len(state)

    def generate(self, request_id: str = "", prompt_ids: Any = None, sampling_params: Optional[dict] = None,
                 **kwargs: Any) -> TokenOutput:
        params = dict(sampling_params or {})
        prompt = [int(t) for t in prompt_ids]
        budget = self.config.prompt_length + self.config.response_length - len(prompt)
        max_tokens = int(params.get("max_tokens") or params.get("max_new_tokens") or self.config.response_length)
        max_tokens = max(1, min(max_tokens, self.config.response_length, budget))
        temperature = float(params.get("temperature", 1.0) or 0.0)
        top_k = int(params.get("top_k", -1) or -1)
        top_p = float(params.get("top_p", 1.0) or 1.0)
        with self.lock, torch.no_grad():
            generator = self.generator
            if self.seed is not None:
                import hashlib

                at = (tuple(prompt), self.global_steps)
                k = self.seen.get(at, 0)
                self.seen[at] = k + 1
                digest = hashlib.sha256(repr((self.seed, at, k)).encode()).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            ids = torch.tensor([prompt])
            out, logprobs = [], []
            past = None
            for _ in range(max_tokens):
                result = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                past = result.past_key_values
                logits = result.logits[0, -1].float()
                full = torch.log_softmax(logits, dim=-1)
                if temperature <= 0:
                    token = int(torch.argmax(logits))
                else:
                    scaled = logits / temperature
                    if top_k > 0:
                        kth = torch.topk(scaled, min(top_k, scaled.numel())).values[-1]
                        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                    if top_p < 1.0:
                        order = torch.argsort(scaled, descending=True)
                        cum = torch.cumsum(torch.softmax(scaled[order], -1), -1)
                        drop = order[(cum - torch.softmax(scaled[order], -1)) > top_p]
                        scaled[drop] = float("-inf")
                    token = int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator))
                out.append(token)
                logprobs.append(float(full[token]))
                if token == self.eos_token_id:
                    break
                ids = torch.tensor([[token]])
        if self.generate_delay_s:
            time.sleep(self.generate_delay_s)
        if self.generate_log:
            with open(self.generate_log, "a") as f:
                f.write(f"{request_id} {self.global_steps} {prompt} -> {out}\n")
        return TokenOutput(token_ids=out, log_probs=logprobs if params.get("logprobs") else None,
                           stop_reason="completed", extra_fields={"global_steps": self.global_steps})

    # what verl's replica and checkpoint manager call on a server: nothing to do for a CPU model
    def wake_up(self) -> None: ...
    def sleep(self) -> None: ...
    def abort_all_requests(self, reject_request: bool = False) -> None: ...
    def resume_generation(self) -> None: ...
    def clear_kv_cache(self) -> None: ...
    def release_kv_cache(self) -> None: ...
    def resume_kv_cache(self) -> None: ...
    def start_profile(self, **kwargs: Any) -> None: ...
    def stop_profile(self) -> None: ...


class HFReplica(RolloutReplica):
    """One server per replica, started by the trainer (hybrid: next to the FSDP worker)."""

    async def launch_servers(self) -> None:
        server = ray.remote(HFServer).options(name=_server_name(self.replica_rank), num_cpus=0,
                                              max_concurrency=16).remote(self.config, self.model_config,
                                                                         self.replica_rank)
        await server.__ray_ready__.remote()  # type: ignore[union-attr]
        self.servers = [server]  # type: ignore[list-item]
        self._server_handle = server  # type: ignore[assignment]
        self._server_address = f"hf_cpu://{self.replica_rank}"


class HFServerAdapter(BaseRollout):
    """In the FSDP worker: verl's naive weight sync hands it the actor's full weights each step."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        # as vLLM's adapter: each replica spans tp x dp x pp ranks, its first one loads the weights into its server
        rank = int(os.environ.get("RANK", 0))
        size = (getattr(config, "tensor_model_parallel_size", 1) or 1) * (getattr(config, "data_parallel_size", 1) or 1) \
            * (getattr(config, "pipeline_model_parallel_size", 1) or 1)
        self.replica_rank = replica_rank if replica_rank >= 0 else rank // size
        self.is_leader_rank = rank % size == 0
        self.sleep_level = 2

    async def resume(self, tags: list) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        state = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in weights}
        if not self.is_leader_rank:
            return
        server = ray.get_actor(_server_name(self.replica_rank))
        await server.load_weights.remote(state, kwargs.get("global_steps"))


def _register() -> None:
    import verl.workers.rollout.base as rollout_base

    RolloutReplicaRegistry.register(NAME, lambda: HFReplica)
    # verl's table of server adapters (verl/workers/rollout/base.py:89) has no register function
    rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFServerAdapter"


_register()
