"""The training side of a run's config: what a replay may change (learning rate, loss, clipping ...).

A whole config flattened, less what the fingerprint holds and the harness's own settings; recorded with
a run's values so that a replay's divergence names the keys that changed (run.replay_check).
"""
from __future__ import annotations

from typing import Any, Sequence

from skip_harness.store.api import flatten_config

_NOT_TRAINING_SIDE = ("skip", "skip_harness", "hydra")


def training_side(cfg: Any, fingerprint_keys: Sequence[str] = ()) -> dict:
    """A whole config flattened, less what the fingerprint holds (those keys and what is under them) and
    the harness's own settings: the training side a replay may change."""
    flat = flatten_config(cfg)
    fp = tuple(fingerprint_keys)

    def kept(key: str) -> bool:
        if key.split(".", 1)[0] in _NOT_TRAINING_SIDE:
            return False
        return not any(key == k or key.startswith(k + ".") for k in fp)

    return {k: v for k, v in flat.items() if kept(k)}
