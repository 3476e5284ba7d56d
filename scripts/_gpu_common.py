"""What scripts/gpu_check.py's checks share: their outcome words, the failure they raise, a clean
environment for the processes they start, the devices they use, and the comparison of a payload
with what came back."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from skip_harness.demo import TINY_OVERRIDES  # noqa: E402

HELD, FAILED, SKIPPED = "held", "FAILED", "skipped"
TINY = list(TINY_OVERRIDES)


class CheckFailed(AssertionError):
    pass


def need(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "HYDRA_FULL_ERROR"):
        env.pop(name, None)
    env.update(extra)
    return env


def _devices(dry_run: bool) -> List[torch.device]:
    if dry_run:
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]


def _leaves(obj: Any, prefix: str = "") -> List[Tuple[str, Any]]:
    if isinstance(obj, dict):
        return [x for k in obj for x in _leaves(obj[k], f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _leaves(v, f"{prefix}[{i}]")]
    return [(prefix, obj)]


def _same(a: Any, b: Any, *, devices_too: bool = True) -> Optional[str]:
    """None when `b` equals `a` in structure, types, dtypes, shapes, values (and devices); else why not."""
    if type(a) is not type(b):
        return f"type {type(a).__name__} came back as {type(b).__name__}"
    la, lb = _leaves(a), _leaves(b)
    if [k for k, _ in la] != [k for k, _ in lb]:
        return f"structure {[k for k, _ in la]} came back as {[k for k, _ in lb]}"
    for (key, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor):
                return f"{key}: a tensor came back as {type(y).__name__}"
            if devices_too and x.device != y.device:
                return f"{key}: saved on {x.device}, loaded on {y.device}"
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
                return f"{key}: dtype/shape/values differ ({x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)})"
        elif x != y or type(x) is not type(y):
            return f"{key}: {x!r} came back as {y!r}"
    return None
