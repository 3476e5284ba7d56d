"""The policy's weights in the replay check (`skip.rollout_tq.replay_weights`): one digest per parameter.

After a step's update the trainer reports, beside its metrics, a digest of each of the policy's
parameters (`SkipHarness.observe_weights(step, model)`, or `harness.observe(step,
**harness.weight_values(model))` to report them later). They are values like any other, under
``weights/{name}.{parameter}``, recorded with a generated step and, on a served one, compared exactly
(never within a tolerance): the first parameter whose digest differs is the divergence's key.

A digest is xxh3-64 of the tensor's dtype, shape and bytes, masked to 52 bits: an integer below 2**53,
which a float (and so the values' JSON) holds exactly. Several ranks: each rank digests the tensor it
holds (a DTensor's local shard, a ZeRO-3 partition; a DDP-wrapped module's own parameters) and the
digests are all-gathered (a collective: every rank calls it). Where every rank holds the same bytes
(DDP, accelerate: replicas) the value is that digest; where they differ (sharded parameters: FSDP,
ZeRO-3) it is the digest of the ranks' digests in rank order. Either way a replay on the same number of ranks and the same K
reproduces it bit for bit when the update does; at another K or W the update is summed in another order
and the digests change legitimately, so the replay check leaves them out there (and says so).
"""
from __future__ import annotations

import struct
from typing import Any, Callable, Dict, List, Optional

import xxhash

from skip_harness.config import WEIGHTS_PREFIX
from skip_harness.errors import HarnessUsageError

#: a digest is below 2**DIGEST_BITS: exact as a float (53-bit mantissa) and as a JSON number
DIGEST_BITS = 52
_MASK = (1 << DIGEST_BITS) - 1


def tensor_digest(tensor: Any) -> int:
    """xxh3-64 of a tensor's dtype, shape and bytes (this rank's shard of a DTensor), below 2**52."""
    import torch

    t = getattr(tensor, "ds_tensor", tensor).detach()   # DeepSpeed ZeRO-3: this rank's partition, not the placeholder
    if hasattr(t, "to_local"):           # a DTensor (FSDP2, tensor parallel): the shard this rank holds
        t = t.to_local()
    t = t.cpu().contiguous()
    h = xxhash.xxh3_64()
    h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.intdigest() & _MASK


def _unwrapped(model: Any) -> Any:
    """The module under DDP's wrapper (`module`) or torch.compile's (`_orig_mod`): its parameter names."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _combined(digests: List[int]) -> int:
    """One value for a tensor from every rank's digest: the digest when all agree, else theirs in order."""
    if all(d == digests[0] for d in digests):
        return digests[0]
    return xxhash.xxh3_64(struct.pack(f"<{len(digests)}Q", *digests)).intdigest() & _MASK


def weight_digests(model: Any, *, name: str = "policy",
                   gather: Optional[Callable[[Any], List[Any]]] = None) -> Dict[str, int]:
    """{`weights/{name}.{parameter}`: digest} for each of `model`'s parameters, in `named_parameters`
    order. `gather(obj)` returns every rank's `obj` in rank order (`DistContext.gather`); None: one
    process."""
    module = _unwrapped(model)
    if not hasattr(module, "named_parameters"):
        raise HarnessUsageError(f"weight digests: expected a torch module, got {type(model).__name__}")
    named = list(module.named_parameters())
    keys = [f"{WEIGHTS_PREFIX}{name}.{n}" if name else f"{WEIGHTS_PREFIX}{n}" for n, _ in named]
    local = [tensor_digest(p) for _, p in named]
    if gather is None:
        return dict(zip(keys, local))
    ranks = gather(local)
    if any(len(r) != len(local) for r in ranks):
        counts = ", ".join(f"rank {i}: {len(r)}" for i, r in enumerate(ranks))
        raise HarnessUsageError(f"weight digests: the ranks hold different numbers of parameters ({counts})")
    return {key: _combined([r[i] for r in ranks]) for i, key in enumerate(keys)}


__all__ = ["DIGEST_BITS", "WEIGHTS_PREFIX", "tensor_digest", "weight_digests"]
