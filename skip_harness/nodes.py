"""The one conversion of an OmegaConf value to plain Python (`plain`) and the one dotted-key read (`select`).

A leaf: it imports nothing of the package, so the store (which may not import :mod:`skip_harness.config`)
and config's readers share it. `skip_harness.config` re-exports `plain` beside `as_node`.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

MISSING: Any = object()   # `select`'s default when the caller must tell an absent key from a null one


def plain(value: Any, *, or_text: bool = False) -> Any:
    """An OmegaConf node's value as plain Python (dicts, lists), interpolations resolved; anything else as is.
    `or_text`: a node with an interpolation that cannot resolve here (a resolver only a Hydra run registers,
    an unset environment variable) comes back whole with its `${...}` text instead of raising."""
    if isinstance(value, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException:
            if not or_text:
                raise
            return OmegaConf.to_container(value, resolve=False)
    return value


def select(node: Any, key: str, default: Any = None) -> Any:
    """The plain value at dotted `key` of an OmegaConf node (`default` when it is absent)."""
    return plain(OmegaConf.select(node, key, default=default))
