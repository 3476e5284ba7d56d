"""Test-only: make a recorded step serve other rollouts than were recorded for it.

`serve_other_rollouts(layout, src=2, dst=3)` rewrites step `dst` of a recorded namespace so that a replay
is served step `src`'s mini-batches at step `dst` -- each payload of `src` written as `dst`'s, with `dst`'s
own meta (its RNG record, its call digest: the trainer's inputs still match), committed with `dst`'s
fingerprint -- and keeps `dst`'s recorded values, bound to the new commit. A replay then trains on other
rollouts than the recorded run did at `dst` while nothing in its config changed: the unexplained
divergence the replay check must report at `dst`. Works on any namespace (demo, TRL, verl, a plain loop),
in-process or between the runs of a subprocess test.
"""
from __future__ import annotations

import sys
from pathlib import Path

from skip_harness.store.open import open_store
from skip_harness.store.layout import Layout, parse_namespace_leaf
from skip_harness.store.stepstore import StepStore
from skip_harness.store.values import ValuesStore

_WRITER_KEYS = ("writer", "step", "inner_index", "rank", "K", "W", "payload", "format", "compression",
                "logical_bytes", "bytes", "checksum", "created")


def serve_other_rollouts(layout: Layout, src: int, dst: int) -> None:
    store = open_store(layout)
    values = ValuesStore(store.namespace)
    recorded = values.read_step(dst)
    record = store.reader.read_commit(dst)
    assert record is not None, f"step {dst} of {layout.root} is not committed"
    payloads = {(i, r): store.reader.read_inner(src, i, r) for i in range(layout.K) for r in range(layout.W)}
    metas = {(i, r): store.reader.read_meta(dst, i, r) for i in range(layout.K) for r in range(layout.W)}
    entries = []
    for (i, r), payload in payloads.items():
        meta = {k: v for k, v in metas[(i, r)].items() if k not in _WRITER_KEYS}
        entries += store.writer.write_inner(dst, i, r, payload, meta)
    new = store.writer.commit(dst, entries, record.fingerprint, gen_s=record.gen_s)
    if recorded is not None:
        values.write_step(dst, recorded.values, commit_created=new.created, config=recorded.config,
                          machine=recorded.machine)


def namespace_in(dump_dir: Path) -> Layout:
    """The one namespace under `dump_dir`."""
    leaves = [p for p in Path(dump_dir).glob("*/*") if p.is_dir() and parse_namespace_leaf(p.name)]
    assert len(leaves) == 1, leaves
    K, W = parse_namespace_leaf(leaves[0].name)
    return Layout(leaves[0], K=K, W=W)


if __name__ == "__main__":      # python tests/replay_rig.py DUMP_DIR SRC DST
    serve_other_rollouts(namespace_in(Path(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
