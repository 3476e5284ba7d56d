"""verl 0.9.1's real trainer (``python -m verl.trainer.main_ppo``) on a CPU-only machine -- test code.

Loaded by verl itself as a second external module, in every process verl starts::

    VERL_USE_EXTERNAL_MODULES=skip_harness.integrations.verl,verl_cpu   (scripts/ on PYTHONPATH)

Everything goes through verl's registries and extension points; nothing in verl's files is edited:

- a ``cpu`` platform (``verl.plugin.platform.PlatformRegistry``): verl falls back to ``nvidia`` when no
  accelerator is found (verl/plugin/platform/platform_manager.py:115);
- verl's FSDP / FSDP2 engines registered for device ``cpu`` (``EngineRegistry.register``): verl registers
  them for ``cuda`` / ``npu`` only (verl/workers/engine/fsdp/transformer_impl.py:1143, 1594);
- a rollout backend ``hf_cpu`` (:mod:`verl_cpu.rollout`): transformers' ``generate`` in a Ray actor,
  registered with ``RolloutReplicaRegistry`` and verl's server-adapter table, receiving the actor's
  weights every step through verl's ``naive`` weight sync (sync, colocate_async);
- a checkpoint engine ``ray_store`` (:mod:`verl_cpu.weights`, ``CheckpointEngineRegistry``, loaded by verl
  through ``rollout.checkpoint_engine.custom_backend_module``): the weights to standalone replicas through
  Ray's object store (separate_async; verl's engines need accelerators);

with ``$VERL_CPU_SEED`` (a test comparing two runs), two more for determinism (seeded prompt uids, the
sampler polling a settled queue: :func:`_seed_prompt_uids`, :func:`_settle_before_sampling`); and TWO
monkeypatches: for a verl bug, ``initialize_global_process_group_ray`` builds the backend
``cpu:gloo,{device}:{backend}`` (verl/utils/distributed.py:89), which on CPU is ``cpu:gloo,cpu:gloo`` and
torch refuses ("Duplicate device type cpu"); and for the reference model (``use_kl_loss``), whose FSDP2
CPU offload verl pins (pinning needs an accelerator): :func:`_unpinned_reference_offload`.
"""
from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Dict, Optional

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

log = logging.getLogger("verl_cpu")


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _mem_get_info(*args: Any, **kwargs: Any):
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * size
    return pages * size, total


class _CpuDeviceModule(ModuleType):
    """What verl calls ``get_torch_device()`` (``torch.cuda`` on GPUs): torch.cpu plus the memory and
    device calls verl makes, as no-ops or zeros on a CPU."""

    def __init__(self) -> None:
        super().__init__("verl_cpu.device")
        for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats", "ipc_collect",
                     "set_per_process_memory_fraction"):
            setattr(self, name, _noop)
        for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
            setattr(self, name, _zero)
        self.mem_get_info = _mem_get_info
        self.current_device = lambda: "cpu"
        self.is_available = lambda: True
        self.device_count = lambda: 1
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.memory_stats: Callable[..., Dict[str, Any]] = lambda *a, **k: {}
        self.get_device_name = lambda *a, **k: "cpu"

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


DEVICE_MODULE = _CpuDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on a machine without an accelerator (torch tensors on ``cpu``, gloo)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # probed after nvidia / npu / rocm (registration order): chosen when none of them is there
        return not torch.cuda.is_available()

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes it where torch takes a device (``model.to(device=get_device_id())``,
        # verl/utils/fsdp_utils.py:507): index 0 would name an accelerator
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl asks Ray for "GPU" bundles; the recipe declares one (+ray_kwargs.ray_init.num_gpus=1)
        return "GPU"

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _register_engines() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)


def _patch_process_group_backend() -> None:
    """verl/utils/distributed.py:89 builds ``cpu:gloo,cpu:gloo`` on CPU; torch refuses a device twice.
    Callers import the function by name (verl/workers/engine_workers.py:38), so this runs before they do
    (verl imports external modules at the end of ``verl/__init__.py``)."""
    import verl.utils.distributed as dist

    original = dist.initialize_global_process_group_ray
    if getattr(original, "_verl_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize_global_process_group_ray._verl_cpu = True  # type: ignore[attr-defined]
    dist.initialize_global_process_group_ray = initialize_global_process_group_ray


def _unpinned_reference_offload() -> None:
    """verl builds a reference model (``actor_rollout_ref.actor.use_kl_loss``) forward-only with FSDP2 and
    ``CPUOffloadPolicy(pin_memory=True)`` (verl/workers/engine/fsdp/transformer_impl.py:462); pinning host
    memory needs an accelerator (torch: "Cannot access accelerator device when none is available"). On a CPU
    the parameters live in host memory anyway: the same policy, unpinned."""
    from verl.workers.engine.fsdp import transformer_impl

    original = transformer_impl.CPUOffloadPolicy
    if original is None or getattr(original, "_verl_cpu", False):
        return

    def CPUOffloadPolicy(pin_memory: bool = True) -> Any:  # noqa: N802 - verl's name, called by it
        return original(pin_memory=False)

    CPUOffloadPolicy._verl_cpu = True  # type: ignore[attr-defined]
    transformer_impl.CPUOffloadPolicy = CPUOffloadPolicy  # type: ignore[misc,assignment]


def _seed_prompt_uids() -> None:
    """With $VERL_CPU_SEED: verl's prompt uids (``uuid.uuid4()`` in trainer_base.py) drawn from a seeded
    generator in this module only. verl's sampler breaks ties between prompts of the same step by the order
    of a set of those uids (``sorted(sampleable_keys, key=global_steps)``): with fresh uuid4s (and Python's
    per-process string hashing, $PYTHONHASHSEED) two runs of an async mode with a warm-up pick different
    groups first, and only a seeded run is comparable to another."""
    seed = os.environ.get("VERL_CPU_SEED")
    if not seed:
        return
    import random
    import uuid

    import verl.trainer.ppo.v1.trainer_base as trainer_base

    rng = random.Random(int(seed))
    trainer_base.uuid = SimpleNamespace(uuid4=lambda: uuid.UUID(int=rng.getrandbits(128), version=4))  # type: ignore[assignment]


def _settle_before_sampling() -> None:
    """With $VERL_CPU_SEED: each poll of verl's sampler first waits until no training prompt is pending or
    running. verl's async sampler selects from whatever groups have finished at its poll (every 2 s), so
    how far a CPU's rollout got by then decides which groups a step trains on; settled, a run is
    comparable to another (a served step has nothing in flight, so a replay never waits)."""
    if not os.environ.get("VERL_CPU_SEED"):
        return
    import time

    from verl.trainer.ppo.v1 import replay_buffer

    original = replay_buffer.ReplayBuffer._sync_metadata_from_transfer_queue
    if getattr(original, "_verl_cpu", False):
        return

    def _sync_metadata_from_transfer_queue(self: Any) -> Any:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            items = (replay_buffer.tq.kv_list() or {}).get("train", {})
            if not any(tag.get("is_prompt") and tag.get("status") in ("pending", "running") for tag in items.values()):
                break
            time.sleep(0.05)
        return original(self)

    _sync_metadata_from_transfer_queue._verl_cpu = True  # type: ignore[attr-defined]
    replay_buffer.ReplayBuffer._sync_metadata_from_transfer_queue = _sync_metadata_from_transfer_queue  # type: ignore[method-assign]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs hooks right after a module's body has run (before its importer sees it): verl loads this rig in
    every process it starts, and most of them (the driver, the reward loop, the router, the weight mailbox,
    verl's one-off tasks) never import verl's FSDP engines or rollout package -- seconds of CPU each on
    this 2-core machine, 10 processes a run -- so each patch waits for the module it patches."""

    def __init__(self) -> None:
        self.hooks: dict = {}

    def add(self, name: str, hook: Any) -> None:
        if name in sys.modules:
            hook()
            return
        self.hooks.setdefault(name, []).append(hook)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        hooks = self.hooks.pop(fullname, None)
        if hooks is None:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            self.hooks[fullname] = hooks
            return None
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            for hook in hooks:
                hook()

        spec.loader.exec_module = exec_module
        return spec


_after = _AfterImport()
_after.add("verl.utils.distributed", _patch_process_group_backend)
_after.add("verl.workers.engine", _register_engines)              # the package: its engines are imported
_after.add("verl.workers.engine", _unpinned_reference_offload)
_after.add("verl.trainer.ppo.v1.trainer_base", _seed_prompt_uids)
_after.add("verl.trainer.ppo.v1.replay_buffer", _settle_before_sampling)
# the package (base and replica imported): registers the hf_cpu backend
_after.add("verl.workers.rollout", lambda: importlib.import_module("verl_cpu.rollout"))
