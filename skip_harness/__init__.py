"""skip_harness: cache RL rollout mini-batches on disk by (step, inner index, rank) and serve them on reruns.

The public API (imported lazily, so `import skip_harness` stays cheap)::

    from skip_harness import SkipHarness, NamespaceKey, HarnessCallback, RunSummary, StepRecord, register_type,
        ReplayDivergedError
"""
from __future__ import annotations

from typing import Any

__version__ = "0.2.0"

_PUBLIC = {
    "SkipHarness": "skip_harness.run.harness",
    "NamespaceKey": "skip_harness.store.layout",
    "HarnessCallback": "skip_harness.run.callbacks",
    "RunSummary": "skip_harness.run.stats",
    "StepRecord": "skip_harness.run.stats",
    "RolloutTQConfig": "skip_harness.config",
    "register_type": "skip_harness.codec",
    "ReplayDivergedError": "skip_harness.errors",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'skip_harness' has no attribute {name!r}")
