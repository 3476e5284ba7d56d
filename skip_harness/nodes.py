"""The one conversion of an OmegaConf value to plain Python (`plain`).

A leaf: it imports nothing of the package, so the store (which may not import :mod:`skip_harness.config`)
and config's readers share it. `skip_harness.config` re-exports it beside `as_node`.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def plain(value: Any) -> Any:
    """An OmegaConf node's value as plain Python (dicts, lists), interpolations resolved; anything else as is."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value
