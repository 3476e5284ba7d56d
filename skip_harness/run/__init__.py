"""The harness at run time: wrapping, per-step decisions, the writer, prefetch, startup, stats."""
