"""The few collective operations the harness needs, over torch.distributed when it is initialized.

With one process every operation is local, so the harness has a single code path.

The harness's agreements are tiny CPU values (a flag, a few floats, a small object). They run on a
group whose backend accepts CPU tensors: the trainer's default group when it already has a CPU
backend (gloo, or `cpu:gloo,cuda:nccl`), else a gloo group made once for the harness over the same
ranks (never CPU tensors through NCCL). Without gloo, they run on the default group with tensors on
this rank's current CUDA device.
"""
from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from skip_harness.errors import (ConfigError, FingerprintMismatchError, HarnessUsageError, LockHeldError,
                                 SkipHarnessError)

# The gloo group made for the harness: [(default group it was made under, gloo group)]. Made once per
# default group, because `new_group` is a collective every rank must call the same number of times.
_HARNESS_GROUP: List[Tuple[Any, Any]] = []
_GROUP_GUARD = threading.Lock()


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def _cpu_backend(backend_config: str) -> Optional[str]:
    """The backend a default group uses for CPU tensors, from `get_backend_config()`
    ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...); None when it has none for CPU."""
    parts = [p.strip() for p in backend_config.lower().split(",") if p.strip()]
    for part in parts:
        if ":" in part:
            device, backend = part.split(":", 1)
            if device == "cpu":
                return backend
        elif part in ("gloo", "mpi"):  # single-backend groups that take CPU tensors
            return part
    return None


def _collective_group(dist) -> Tuple[Any, torch.device]:
    """(group, device) for the harness's collectives under the current default group."""
    world = dist.group.WORLD
    if _cpu_backend(str(dist.get_backend_config())) is not None:
        return None, torch.device("cpu")
    if dist.is_gloo_available():
        with _GROUP_GUARD:
            if not _HARNESS_GROUP or _HARNESS_GROUP[0][0] is not world:
                _HARNESS_GROUP[:] = [(world, dist.new_group(backend="gloo"))]
            return _HARNESS_GROUP[0][1], torch.device("cpu")
    if torch.cuda.is_available():  # NCCL only: use the device it accepts
        return None, torch.device("cuda", torch.cuda.current_device())
    raise HarnessUsageError(
        f"torch.distributed's default group ({dist.get_backend_config()}) takes no CPU tensors and "
        "torch has no gloo backend: the harness cannot agree between ranks"
    )


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run, and the harness's collectives.

    Build it with :meth:`current` (a collective when W > 1: every rank calls it together); the
    plain constructor gives a single-process context (or one for tests)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group: Any = field(default=None, repr=False, compare=False)
    device: torch.device = field(default=torch.device("cpu"), repr=False, compare=False)

    @classmethod
    def current(cls) -> "DistContext":
        """The context of the initialized torch.distributed run, or a single process.

        Raises HarnessUsageError when the environment says the run has several processes
        (WORLD_SIZE > 1) but torch.distributed has no process group yet: the harness never quietly
        runs as W = 1 on every rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            env_world = _env_int("WORLD_SIZE")
            if env_world is not None and env_world > 1:
                raise HarnessUsageError(
                    f"WORLD_SIZE={env_world} in the environment but torch.distributed has no process "
                    "group yet: call torch.distributed.init_process_group() (or create accelerate's "
                    "Accelerator) before the harness starts, so that every rank agrees on one cache "
                    "(it never runs as W = 1 on each rank)"
                )
            return cls()
        rank, world = dist.get_rank(), dist.get_world_size()
        group, device = _collective_group(dist)
        ctx = cls(rank, world, 0, 1, group, device)
        local_rank, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
        if local_rank is None or local_world is None:
            local_rank, local_world = ctx._local_from_hosts()
        return cls(rank, world, local_rank, local_world, group, device)

    # ------------------------------------------------------------------ properties

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    # ------------------------------------------------------------------ collectives

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff `flag` is True on every rank."""
        if self.world_size == 1:
            return bool(flag)
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def sum_floats(self, values: List[float]) -> List[float]:
        """Element-wise sums over the ranks (every rank passes the same number of values)."""
        if self.world_size == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.cpu().tolist()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (a small picklable value built by this package)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group, device=self._object_device)
        return box[0]

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def from_main(self, work: Callable[[], Any], doing: str) -> Any:
        """Every rank calls it together (one broadcast): rank 0 runs `work()` and every rank returns what it
        returned (a small picklable value), or raises rank 0's error -- rank 0 the exception itself, the
        others the same class with its key and message (a bug on rank 0: `rank 0 failed {doing}: ...`)."""
        outcome: Any = None
        error: Optional[BaseException] = None
        if self.is_main:
            try:
                outcome = ("ok", work())
            except SkipHarnessError as exc:
                error, outcome = exc, error_outcome(exc)
            except BaseException as exc:  # a bug: the other ranks stop too
                error, outcome = exc, ("error", "SkipHarnessError", None, f"rank 0 failed {doing}: {exc!r}")
        outcome = self.broadcast(outcome)
        if error is not None:
            raise error
        if outcome[0] == "error":
            raise error_from_main(outcome)
        return outcome[1]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            if self.device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    # ------------------------------------------------------------------ helpers

    @property
    def _object_device(self) -> Optional[torch.device]:
        return self.device if self.device.type != "cpu" else None

    def _local_from_hosts(self) -> Tuple[int, int]:
        """(local rank, local world size) from every rank's host name, when the launcher set none."""
        hosts = self.gather(socket.gethostname())
        mine = hosts[self.rank]
        same = [r for r, h in enumerate(hosts) if h == mine]
        return same.index(self.rank), len(same)


_ERRORS = {"LockHeldError": LockHeldError, "FingerprintMismatchError": FingerprintMismatchError,
           "HarnessUsageError": HarnessUsageError}


def error_outcome(exc: SkipHarnessError) -> Tuple[str, str, Optional[str], str]:
    """Rank 0's error as the ranks are told it: ("error", its class's name, its key, its message)."""
    return ("error", type(exc).__name__, getattr(exc, "key", None), str(exc))


def error_from_main(outcome: Tuple[str, str, Optional[str], str]) -> SkipHarnessError:
    """Rank 0's error (`error_outcome`), raised on every other rank as the same class."""
    _, kind, key, message = outcome
    if kind == "ConfigError" and key:
        return ConfigError(key, message[len(key) + 2:] if message.startswith(f"{key}: ") else message)
    return _ERRORS.get(kind, SkipHarnessError)(message)
