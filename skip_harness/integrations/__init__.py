"""Thin adapters that attach a :class:`skip_harness.SkipHarness` to other trainers.

Each lives in its own module and imports its trainer library only when imported itself:
``from skip_harness.integrations.trl import attach`` (extra ``[trl]``).
"""
