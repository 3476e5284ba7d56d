"""Moved to :mod:`skip_harness.integrations.hydra` (this name imports with a DeprecationWarning; conf/ and
the README name the new place)."""
from skip_harness._moved import moved

__getattr__, __dir__ = moved(__name__, "skip_harness.integrations.hydra")
