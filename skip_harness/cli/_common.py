"""What every `skip-harness` command shares, by room: `_output` (exit codes, CliError, consoles, progress,
JSON, formatting), `_discovery` (namespaces under a path, where runs write), `_facts` (per-step facts,
the mode and seed from a fingerprint). Re-exported here for the commands."""
from __future__ import annotations

from skip_harness.cli._discovery import check_place, default_dump_dir, namespaces_under, require_dir, short_path, where_of  # noqa: F401
from skip_harness.cli._facts import (  # noqa: F401
    mode_and_seed, step_accessed, step_gen_s, step_metas, step_written,
)
from skip_harness.cli._output import (  # noqa: F401
    EXIT_CORRUPT, EXIT_LOCKED, EXIT_OK, EXIT_USAGE, SORT_KEYS, CliError, about, emit_json, fmt_ago,
    fmt_seconds, fmt_time, fmt_value, logger, progress, stdout_console,
)
from skip_harness.units import human_bytes  # noqa: F401

__all__ = ["CliError", "EXIT_OK", "EXIT_CORRUPT", "EXIT_USAGE", "EXIT_LOCKED", "human_bytes", "logger",
           "namespaces_under", "progress", "stdout_console"]
