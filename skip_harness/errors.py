"""The package's exception and warning classes.

Every error a user can cause carries a message that names the config key or the path involved;
`scripts/train.py` and the CLI print that message and exit non-zero without a traceback.
"""
from __future__ import annotations


class SkipHarnessError(Exception):
    """Base class of every error raised on purpose by skip_harness."""


class ConfigError(SkipHarnessError):
    """A config value is invalid; the message names the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class FingerprintMismatchError(SkipHarnessError):
    """Committed steps of a namespace were made by a generator configured differently."""


class LockHeldError(SkipHarnessError):
    """Another process holds the namespace lock."""


class CodecError(SkipHarnessError):
    """A payload cannot be encoded, or a stored file cannot be decoded safely."""


class StoreError(SkipHarnessError):
    """The one (path, reason) family of the store, on every backend: `path` names the file, directory or
    URL (a Path, a UrlPath or text), `reason` says what is wrong with it; the message is "{path}: {reason}"
    (an object store's may lead with the config key to name)."""

    def __init__(self, path, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class CorruptStepError(StoreError):
    """A stored step disagrees with its commit record (or cannot be read safely)."""


class HarnessUsageError(SkipHarnessError):
    """The trainer used the harness in a way the contract forbids (e.g. more than K samples in a step)."""


class CacheWritesStopped(SkipHarnessError):
    """This run may no longer write the cache (another run took its namespace lock over while it was
    stalled): it says so once and trains on without caching."""


class ReplayDivergedError(SkipHarnessError):
    """A replay's values differed from the recorded ones (with `skip.rollout_tq.replay_check=error`)."""

    def __init__(self, message: str, divergence=None):
        self.divergence = divergence
        super().__init__(message)


class UnsupportedVersionError(SkipHarnessError, ImportError):
    """The installed trainer library (verl, TRL) is a version, or has a method skip_harness patches in a
    shape, that skip_harness was not checked against; the message names the library, its version and the
    method (skip_harness.integrations.patches). An ImportError too: the verl plug-in raises it on import."""
