"""The config's choices as enums (`skip.rollout_tq.action`, `cleanup`, `on_mismatch`, `compression`,
`replay_check`).

A leaf: it imports nothing of the package, so the store can name a choice without importing
:mod:`skip_harness.config` (which sits above the store). `skip_harness.config` re-exports them.
"""
from __future__ import annotations

from enum import Enum


class Action(str, Enum):
    cache = "cache"
    repeat = "repeat"
    compare = "compare"   # generate anyway, measure the drift from the recording, write nothing


class Cleanup(str, Enum):
    delete = "delete"
    quarantine = "quarantine"
    off = "off"


class OnMismatch(str, Enum):
    error = "error"
    regenerate = "regenerate"


class ReplayCheck(str, Enum):
    off = "off"
    warn = "warn"
    error = "error"


class Compression(str, Enum):
    none = "none"
    zstd = "zstd"
