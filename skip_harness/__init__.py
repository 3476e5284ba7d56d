"""skip_harness: cache RL rollout mini-batches on disk by (step, inner index, rank) and serve them on reruns.

The public API (imported lazily, so `import skip_harness` stays cheap; type checkers and editors see the
real types through the TYPE_CHECKING imports below)::

    from skip_harness import SkipHarness, NamespaceKey, HarnessCallback, RunSummary, StepRecord, Outcome, register_type,
        ReplayDivergedError
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skip_harness.codec import register_type
    from skip_harness.config import RolloutTQConfig
    from skip_harness.errors import ReplayDivergedError
    from skip_harness.run.callbacks import HarnessCallback
    from skip_harness.run.harness import SkipHarness
    from skip_harness.run.stats import Outcome, RunSummary, StepRecord
    from skip_harness.store.layout import NamespaceKey

try:
    __version__ = version("skip_harness")  # the installed metadata: pyproject.toml's [project] version
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

_PUBLIC = {
    "SkipHarness": "skip_harness.run.harness",
    "NamespaceKey": "skip_harness.store.layout",
    "HarnessCallback": "skip_harness.run.callbacks",
    "RunSummary": "skip_harness.run.stats",
    "StepRecord": "skip_harness.run.stats",
    "Outcome": "skip_harness.run.stats",
    "RolloutTQConfig": "skip_harness.config",
    "register_type": "skip_harness.codec",
    "ReplayDivergedError": "skip_harness.errors",
}
__all__ = ["HarnessCallback", "NamespaceKey", "Outcome", "ReplayDivergedError", "RolloutTQConfig", "RunSummary",
           "SkipHarness", "StepRecord", "__version__", "register_type"]  # = sorted(_PUBLIC) + __version__ (tests/test_public_face.py)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'skip_harness' has no attribute {name!r}")
