"""The few collective operations the harness needs, over torch.distributed when it is initialized.

With one process every operation is local, so the harness has a single code path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> "DistContext":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff `flag` is True on every rank."""
        if self.world_size == 1:
            return bool(flag)
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def sum_floats(self, values: List[float]) -> List[float]:
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (a small picklable value built by this package)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
