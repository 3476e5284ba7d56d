"""The bench's concurrent-replay rows: four replays of one namespace at once against a lone replay
measured beside it, and the bytes the replays wrote (none).

- One namespace of `steps` steps of the bench's payload (one mini-batch a step) is recorded through a
  SkipHarness, then held by this process for the whole measure, as a running recording would hold it:
  every replay is a reader (docs/design.md, "Many runs on one namespace").
- A replay is a process of its own (`python _bench_replays.py DUMP_DIR STEPS NAMESPACE`): on each `go` line on
  its stdin a fresh SkipHarness with prefetch on serves every step; a step's time is prepare_data +
  sample + touching every byte of the batch, one torch thread. The four processes start (and import)
  once; a round sends `go` to one of them, or to all four at once.
- Rounds alternate: a lone replay, then PAIRS (4) times four replays at once and four bare verified reads
  at once, then a lone replay. A bare verified read (a `bare` line) is what any hit must do and nothing more: each
  step's payload read once through the store (`StepReader.read_served`: size and checksum checked against
  the commit record) and every byte touched, in the same four processes, with no harness.
- `concurrent_hit_s` is the slowest of the four replays' median step (over every round),
  `concurrent_floor_s` the slowest of the four bare readers', and `concurrent_hit_floor_ratio` the median
  over the PAIRS pairs of a round's slowest replay over the next round's slowest bare reader (target
  <= 1.1): what four replays at once cost beyond the reads they cannot avoid on this machine's cores,
  paired as the step arms are (one slow spell of the machine read 1.38 with the ratio of the two pooled
  figures over two rounds). `concurrent_hit_ratio` (the same slowest hit over a lone replay's median, both lone
  replays' medians pooled) stays as a figure: on a machine with fewer cores than replays the verified reads
  -- xxh3 of every byte -- share the cores, and it says so rather than what the harness adds.
- `replays_bytes_written`: bytes of every file of the namespace (steps, values, index) that a replay
  created or changed, from a listing before and after (size, mtime and ctime of each): 0. The replays
  report no values (a replay that does keeps them under its run id, `.values/runs/`: not rollouts).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPLAYS = 4
PAIRS = 4          # rounds of four replays, each followed by a round of four bare verified reads


def _files(root: Path) -> Dict[str, Tuple[int, int, int]]:
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and p.name not in (".lock", ".lock.holder.json"):
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


def _written(before: Dict[str, Tuple[int, int, int]], after: Dict[str, Tuple[int, int, int]]) -> int:
    return sum(meta[0] for key, meta in after.items() if before.get(key) != meta)


def _start(dump: Path, steps: int, namespace: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(dump), str(steps), str(namespace)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _round(procs: List[subprocess.Popen], steps: int, command: str = "go") -> List[List[float]]:
    """One replay (`go`) or one bare verified read of every step (`bare`) in each of `procs` at once: each
    one's step seconds."""
    for p in procs:
        p.stdin.write(f"{command}\n")
        p.stdin.flush()
    out = []
    for p in procs:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a replay failed ({p.poll()}): {p.stderr.read()[-2000:]}")
        doc = json.loads(line)
        if doc["hits"] != steps or doc["generated"]:
            raise RuntimeError(f"a replay did not serve every step from the cache: {doc}")
        out.append(doc["times"])
    return out


def _slowest(rounds: List[List[List[float]]]) -> float:
    """The slowest process's median step over every round (rounds x processes x steps)."""
    return max(statistics.median([t for r in rounds for t in r[i]]) for i in range(len(rounds[0])))


def bench_replays(payload: Any, work: Path, steps: int) -> Dict[str, Any]:
    from _benchlib import SyntheticTrainer, make_harness   # beside this file, as every script's

    from skip_harness.store.open import open_namespace

    dump = work / "replays"
    h = make_harness("async", dump)
    t = SyntheticTrainer(payload)
    h.wrap(t)
    for step in range(1, steps + 1):
        t.prepare_data(step)
        t.sample(step)
    h.close()
    layout = h.layout
    hold = open_namespace(layout).lock(0.0)          # a recording still running: every replay reads beside it
    procs = [_start(dump, steps, layout.root) for _ in range(REPLAYS)]    # started (torch imported) once, for every round
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a replay did not start: {p.stderr.read()[-2000:]}")
        before = _files(layout.root)
        lone_a = _round(procs[:1], steps)
        together, bare = [], []
        for _ in range(PAIRS):                                 # interleaved: the machine's load moves
            together.append(_round(procs, steps))
            bare.append(_round(procs, steps, "bare"))
        lone_b = _round(procs[:1], steps)
        after = _files(layout.root)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        hold.release()
    lone = statistics.median([statistics.median(t) for t in lone_a + lone_b])
    worst, floor = _slowest(together), _slowest(bare)
    # each round of four replays against the round of four bare reads right after it: a slow spell of the
    # machine moves both of a pair, and one such spell moves one of the PAIRS ratios, not the figure
    paired = statistics.median(_slowest([t]) / _slowest([b]) for t, b in zip(together, bare))
    return {"lone_hit_s": lone, "concurrent_hit_s": worst, "concurrent_hit_ratio": worst / lone,
            "concurrent_floor_s": floor, "concurrent_hit_floor_ratio": paired,
            "concurrent_replays": REPLAYS, "replays_bytes_written": _written(before, after),
            "concurrent_step_bytes": sum(e.stat().st_size for e in layout.step_dir(1).rglob("*") if e.is_file())}


def _bare_reads(namespace: str, steps: int) -> Dict[str, Any]:
    """Every step's payload read and verified through the store, every byte touched: no harness."""
    from _benchlib import touch

    from skip_harness.store.layout import Layout
    from skip_harness.store.open import open_store

    reader = open_store(Layout(Path(namespace), K=1, W=1)).reader
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        _status, reason, batches, _metas = reader.read_served(step, 0)
        if reason is not None:
            raise RuntimeError(f"step {step} does not verify: {reason}")
        touch(batches)
        times.append(time.perf_counter() - t0)
        del batches
    return {"times": times, "hits": steps, "generated": 0}


def _worker(dump: str, steps: int, namespace: str) -> int:
    """Replay the namespace once per `go` line on stdin (a fresh harness each time), or read it bare once
    per `bare` line; one JSON line each."""
    import torch

    from _benchlib import SyntheticTrainer, make_harness, touch   # run as a file: scripts/ is first on its path

    torch.set_num_threads(1)
    print("ready", flush=True)
    for command in sys.stdin:
        if command.strip() == "bare":
            print(json.dumps(_bare_reads(namespace, steps)), flush=True)
            continue
        if command.strip() != "go":
            break
        h = make_harness("async", Path(dump))
        t = SyntheticTrainer(None)
        h.wrap(t)
        h.start()
        times = []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            t.prepare_data(step)
            touch(t.sample(step))
            times.append(time.perf_counter() - t0)
        summary = h.close()
        print(json.dumps({"times": times, "hits": summary.hits, "generated": t.generated}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
