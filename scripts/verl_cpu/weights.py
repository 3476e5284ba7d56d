"""``rollout.checkpoint_engine.backend=ray_store``: the actor's weights to standalone rollout replicas
through Ray's object store, for separate_async on CPU.

separate_async refuses the in-process ``naive`` sync (verl/trainer/ppo/v1/trainer_separate_async.py:59)
and every engine verl ships between processes (``nccl``, ``nixl``, ``hccl``, ``kimi``, ``delta_sharded``)
needs accelerators. This one, registered with verl's ``CheckpointEngineRegistry``, hands the full state
dict from the actor's rank 0 to a named mailbox actor; each rollout worker waits for a version newer than
the last one it loaded.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Generator, Tuple

import ray
import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

log = logging.getLogger("verl_cpu")
NAME = "ray_store"
MAILBOX = "verl_cpu_weight_mailbox"


class _Mailbox:
    def __init__(self) -> None:
        self.version = 0
        self.state: Dict[str, torch.Tensor] = {}

    def put(self, state: Dict[str, torch.Tensor]) -> int:
        self.state = state
        self.version += 1
        return self.version

    async def newer_than(self, version: int) -> Tuple[int, Dict[str, torch.Tensor]]:
        while self.version <= version:
            await asyncio.sleep(0.05)
        return self.version, self.state


_handle = None


def _mailbox() -> Any:
    # the handle is kept: a (non-detached) named actor dies when its creator drops its last handle, and
    # the next sync would then find a new, empty mailbox
    global _handle
    if _handle is None:
        _handle = ray.remote(_Mailbox).options(name=MAILBOX, get_if_exists=True, num_cpus=0,
                                               max_concurrency=64).remote()
    return _handle


@CheckpointEngineRegistry.register(NAME)
class RayStoreCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int = 0, is_master: bool = False, **kwargs: Any) -> None:
        self.is_master = is_master
        self.seen = 0

    def prepare(self) -> dict:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        return ({"rank": list(range(actor_wg_world_size))},
                {"rank": list(range(actor_wg_world_size, actor_wg_world_size + rollout_world_size))})

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Generator, global_steps: int | None = None):
        state = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in weights}
        if self.is_master:
            version = await _mailbox().put.remote(state)
            log.info("ray_store: sent weights version %s (%d tensors, step %s)", version, len(state), global_steps)
        return {}

    def receive_weights(self, global_steps: int | None = None) -> Generator:  # type: ignore[override]
        log.debug("ray_store: waiting for weights newer than version %s (step %s)", self.seen, global_steps)
        self.seen, state = ray.get(_mailbox().newer_than.remote(self.seen))
        log.debug("ray_store: received weights version %s", self.seen)
        yield from state.items()
