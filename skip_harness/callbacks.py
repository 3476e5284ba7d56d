"""Moved to :mod:`skip_harness.run.callbacks` (this name imports with a DeprecationWarning)."""
from skip_harness._moved import moved

__getattr__, __dir__ = moved(__name__, "skip_harness.run.callbacks")
