"""The verl plug-in's live instances: the one piece of state :mod:`skip_harness.integrations.verl` (which
adds and removes them) and :mod:`skip_harness.integrations.verl_values` (which hands verl's logged metrics
to each) share. A module of its own, so neither imports the other (an import-linter contract in
pyproject.toml keeps it so).

The references are strong: a harness verl replaced (``SkipManager.init`` again) must still be closed, never
collected with its lock held and its writes pending.
"""
from __future__ import annotations

import threading
from typing import Any, List

_live: List[Any] = []
_lock = threading.Lock()


def add(instance: Any) -> None:
    with _lock:
        _live.append(instance)


def remove(instance: Any) -> None:
    with _lock:
        if instance in _live:
            _live.remove(instance)


def instances() -> List[Any]:
    """The live instances now (a copy: closing one while iterating is safe)."""
    with _lock:
        return list(_live)


__all__ = ["add", "instances", "remove"]
