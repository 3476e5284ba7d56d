"""Object-store rows of the benchmark, against a moto S3 server this script starts on 127.0.0.1.

    python scripts/bench_s3.py [--json] [--quick] [--rows N] [--repeats R] [--steps S] [--rounds R] [--no-steps]

`bench_s3(rows, repeats)` returns (JSON keys):
- `s3_save_ratio`: our save of the realistic mini-batch through the step store on the object
  backend (`StepWriter.write_inner` + `commit`: codec image staged in a pool buffer, xxh3-128, put,
  size check, meta.json, one listing, a create-only commit record) over a bare obstore put of the
  same bytes with the same put parameters;
- `s3_load_ratio`: our verified load as a hit does it (`StepReader.read_served`: the step's listing
  and commit record, meta.json, the payload streamed into a pool buffer with size and xxh3-128
  checked per chunk, decoded into tensors) over a bare obstore get of the same bytes;
the arms interleaved round by round (A B, B A, ...) because moto, pure Python, sets the speed and
that speed moves with the machine's load. Target: both <= 1.1.

`bench_s3_steps(rows, steps, rounds)` adds `s3_step_overhead_ratio`: the synthetic training step of
`scripts/bench.py` (computing about four bare puts long) with caching on into an s3:// dump_dir
(async writes: the puts stay off the critical path) over the same step with caching off, every arm
taking turns step by step as in bench.py; and `s3_hit_overhead_ratio`: a step served from the bucket
(prefetched) over the step with its batch already in memory. Beside them, the floor of any miss to this server
(`s3_step_floor_ratio`: each step's batch copied once and put whole on a background thread -- no
checksum, meta.json or commit record -- over caching off) and `s3_step_vs_floor_ratio`: the miss over
that floor. moto runs on this machine's cores, so receiving a put takes CPU from the step; the floor
shows how much of the miss's cost is that. The floor of a hit beside it: `s3_hit_floor_ratio`, the
same step reading the same bytes (the payload objects the hit serves) by a bare GET from the same
server, one step ahead on a background thread, decoded as the trainer needs them (no listing, commit
record, meta.json or checksum), over the batch in memory; and `s3_hit_vs_floor_ratio`, the hit over
that floor (target <= 1.02).

`scripts/bench.py` runs this script as a subprocess (`--json`) for its object-store rows; the two
share `_benchlib.py` and import nothing of each other. Exit 3 (and a line saying what is missing)
where obstore or moto is not installed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from _benchlib import MiB, make_payload  # shared with bench.py, beside this file


def _interleave(arms: Dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> Dict[str, List[float]]:
    names = list(arms)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        for name in (names if r % 2 == 0 else reversed(names)):
            t0 = time.perf_counter()
            arms[name]()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    return times


def _median(xs: List[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


@contextlib.contextmanager
def _server_bucket(work: Optional[Path], bucket: str) -> Iterator[str]:
    """A fresh moto server on 127.0.0.1 with one bucket, its AWS_* settings in this process's
    environment while the block runs; the environment restored and the server stopped after. Its
    log goes to `work`, by default a temporary directory removed after."""
    made = work is None
    work = Path(tempfile.mkdtemp(prefix="bench-s3-")) if work is None else work
    from moto_server import start_server   # moto's server mode, as the tests start it (beside this file)

    server = start_server(work, auth=False)
    saved_env = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server.create_bucket(bucket)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
        if made:
            shutil.rmtree(work, ignore_errors=True)


def bench_s3(rows: int = 1024, repeats: int = 7, work: Path | None = None) -> Dict[str, float]:
    """The object-store ratios (see the module doc) on a fresh moto server, stopped at the end."""
    import obstore as obs
    import xxhash
    from obstore.store import S3Store

    from skip_harness import codec
    from skip_harness.store.layout import Layout, UrlPath
    from skip_harness.store.open import open_store

    with _server_bucket(work, "bench-s3") as bucket:
        steps = open_store(Layout(UrlPath(f"s3://{bucket}/exp_proj/GBS{rows}_N1_in1024_out3072"), K=1, W=1))  # type: ignore[arg-type]  # Layout takes a UrlPath for an object store
        store = S3Store(bucket)        # a bare client of the same server, from the same AWS_* environment
        payload = make_payload(rows)
        image = _image(codec, payload)
        nbytes = len(image)
        counter = iter(range(10**9))

        def ours_save():
            step = next(counter) + 1
            steps.writer.commit(step, steps.writer.write_inner(step, 0, 0, payload, {"bench": "s3"}), None)

        def bare_put():    # one request, as the store puts anything below S3's 5 GiB single-PUT limit
            obs.put(store, f"bare/{next(counter)}", memoryview(image), use_multipart=False)

        def clear():  # keep moto's memory bounded: drop what the save arms wrote
            keys = [m["path"] for batch in obs.list(store) for m in batch]
            if keys:
                obs.delete(store, keys)

        save_times: Dict[str, List[float]] = {"ours": [], "bare": []}
        for r in range(repeats + 1):
            t = _interleave({"ours": ours_save, "bare": bare_put} if r % 2 == 0 else
                            {"bare": bare_put, "ours": ours_save}, 1, warmup=0)
            if r:
                for k in t:
                    save_times[k] += t[k]
            clear()

        obs.put(store, "bare/load", memoryview(image), use_multipart=False)
        steps.writer.commit(1, steps.writer.write_inner(1, 0, 0, payload, {"bench": "s3"}), None)
        [entry] = [f for f in steps.reader.read_commit(1).files if f.rel.endswith(".pt")]

        def ours_load():
            status, reason, batches, _ = steps.reader.read_served(1, 0)
            if reason is not None:
                raise RuntimeError(f"step 1 on {steps.layout.url}: {reason}")

        def bare_get():
            obs.get(store, "bare/load").bytes()

        load_times = _interleave({"ours": ours_load, "bare": bare_get}, repeats)
        res = {
            "s3_payload_mib": nbytes / MiB,
            "s3_save_s": _median(save_times["ours"]), "s3_bare_put_s": _median(save_times["bare"]),
            "s3_load_s": _median(load_times["ours"]), "s3_bare_get_s": _median(load_times["bare"]),
        }
        res["s3_save_ratio"] = res["s3_save_s"] / res["s3_bare_put_s"]
        res["s3_load_ratio"] = res["s3_load_s"] / res["s3_bare_get_s"]
        if xxhash.xxh3_128_hexdigest(bytes(obs.get(store, "bare/load").bytes())) != entry.checksum:
            raise RuntimeError("the bare object is not the bytes the store wrote: the ratios compare different work")
        return res


def _image(codec: Any, payload: Any) -> bytes:
    """The payload's file image as the store writes it (raw, at full width)."""
    buf = io.BytesIO()
    codec.save_to(buf, payload, None)
    return buf.getvalue()


def _payload_keys(store: Any, prefix: str, steps: int) -> Dict[int, str]:
    """The payload object of each step 1..steps under `prefix` (a namespace the harness wrote)."""
    import obstore as obs

    found: Dict[int, str] = {}
    for batch in obs.list(store, prefix=prefix):
        for m in batch:
            parts = m["path"].split("/")
            if parts[-1] == "tq_batch.pt" and parts[-2].isdigit():
                found[int(parts[-2])] = m["path"]
    missing = [s for s in range(1, steps + 1) if s not in found]
    if missing:
        raise RuntimeError(f"{prefix}: no payload object for steps {missing}")
    return found


def _arms(store: Any, payload: Any) -> Tuple[type, type]:
    """The two floors as training-step arms of scripts/_bench_steps.py (taking turns with the harness's
    arms step by step): (the miss's floor, the hit's floor) on this object store."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore as obs
    import torch
    from _bench_steps import AheadArm, StepArm
    from _benchlib import SyntheticTrainer, iter_tensors, tensor_bytes

    from skip_harness import codec

    class PutFloorArm(StepArm):
        """The floor of any miss to this object store: each step's batch copied once into a buffer (the
        copy any write needs before the trainer may change its batch), then put whole with the same
        library on a background thread -- no checksum, no meta.json, no commit record."""

        mode = "floor"

        def __init__(self, prefix: str):
            super().__init__()
            self.prefix, self.trainer = prefix, SyntheticTrainer(payload)
            self.buffers = [bytearray(tensor_bytes(payload)) for _ in range(2)]
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="bench-s3-floor")
            self.pending: Any = None

        def produce(self, step: int) -> Any:
            batch = self.trainer.sample(step)
            buf = self.buffers[step % 2]
            flat, off = torch.frombuffer(buf, dtype=torch.uint8), 0
            for t in iter_tensors(batch):
                n = t.numel() * t.element_size()
                flat[off:off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
                off += n
            self.pending = self.pool.submit(obs.put, store, f"{self.prefix}/floor/{step}", memoryview(buf),
                                            use_multipart=False)
            return batch

        def settle(self, step: int) -> None:
            self.pending.result()

        def close(self, steps: int) -> None:
            self.pool.shutdown(wait=True)

    class GetFloorArm(AheadArm):
        """The floor of any hit from this object store: each step's payload object (the one the hit arm
        serves) fetched by a bare GET into a reused buffer, one step ahead on a background thread, and
        decoded into tensors that view the buffer -- no listing, commit record, meta.json or checksum."""

        mode = "hit_floor"
        label = "object-store hit floor"

        def __init__(self, keys: Dict[int, str]):
            super().__init__(keys, "bench-s3-hit-floor")
            self.keys = keys
            size = max(len(_image(codec, payload)), 1)
            self.buffers = [bytearray(size) for _ in range(3)]

        def _load(self, step: int) -> Any:
            buf, off = self.buffers[step % 3], 0
            for chunk in obs.get(store, self.keys[step]).stream(min_chunk_size=8 << 20):
                n = len(memoryview(chunk))
                buf[off:off + n] = chunk
                off += n
            return codec.load_buffer(buf, off, self.keys[step])

    return PutFloorArm, GetFloorArm


def bench_s3_steps(rows: int = 1024, steps: int = 6, rounds: int = 2, work: Path | None = None) -> Dict[str, float]:
    """The step overheads with an s3:// dump_dir, and the floors of a miss and of a hit beside them
    (see the module doc), on a fresh moto server: every arm open at once, the arms taking turns step
    by step (A B C, C B A, ...) as scripts/bench.py's, 1 + steps x rounds steps each, the first a
    warm-up."""
    import obstore as obs
    from _bench_steps import TrainingArm
    from _benchlib import COMPUTE_FACTOR, Compute, make_payload, run_training_block
    from obstore.store import S3Store

    from skip_harness import codec

    with _server_bucket(work, "bench-s3-steps") as bucket:
        store = S3Store(bucket)
        payload = make_payload(rows)
        image = _image(codec, payload)
        puts = []
        for _ in range(3):
            t0 = time.perf_counter()
            obs.put(store, "bare/x", memoryview(image), use_multipart=False)
            puts.append(time.perf_counter() - t0)
        bare_put_s = _median(puts)
        compute = Compute()
        compute.calibrate(COMPUTE_FACTOR * bare_put_s)
        total = 1 + steps * rounds
        run = uuid.uuid4().hex[:6]
        hit_prefix = f"hit-{run}"        # the cache the hit and its floor read: written first, untimed
        run_training_block("async", payload, Compute(8), total, f"s3://{bucket}/{hit_prefix}", keep=True)
        PutFloorArm, GetFloorArm = _arms(store, payload)
        modes = ("off", "async", "floor", "hit", "hit_floor", "memory")
        arms = {"floor": PutFloorArm(f"floor-{run}"), "hit_floor": GetFloorArm(_payload_keys(store, hit_prefix, total))}
        for mode in ("off", "async", "memory"):
            arms[mode] = TrainingArm(mode, payload, f"s3://{bucket}/{mode}-{run}")  # type: ignore[arg-type]
        arms["hit"] = TrainingArm("hit", payload, f"s3://{bucket}/{hit_prefix}")  # type: ignore[arg-type]
        try:
            for step in range(1, total + 1):
                for mode in (modes if step % 2 else reversed(modes)):
                    arms[mode].step(step, compute)
        finally:
            for arm in arms.values():
                if isinstance(arm, TrainingArm):
                    arm.harness.close()
                else:
                    arm.close(total)
        for mode in ("off", "async", "hit", "memory"):
            arms[mode].close(total)          # every step was what the arm says (BenchError if not)
        commits = [m for batch in obs.list(store, prefix=f"async-{run}") for m in batch if m["path"].endswith("/commit.json")]
        if len(commits) != total:
            raise RuntimeError(f"async-{run}: {len(commits)} of {total} steps committed in the bucket "
                               "(does the harness open an s3:// dump_dir as an object store?)")
        res = {"s3_step_bare_put_s": bare_put_s}
        for mode in modes:
            res[f"s3_step_{mode}_s"] = _median(arms[mode].times[1:])
        res["s3_step_overhead_ratio"] = res["s3_step_async_s"] / res["s3_step_off_s"]
        res["s3_step_floor_ratio"] = res["s3_step_floor_s"] / res["s3_step_off_s"]
        res["s3_step_vs_floor_ratio"] = res["s3_step_async_s"] / res["s3_step_floor_s"]
        res["s3_hit_overhead_ratio"] = res["s3_step_hit_s"] / res["s3_step_memory_s"]
        res["s3_hit_floor_ratio"] = res["s3_step_hit_floor_s"] / res["s3_step_memory_s"]
        # step by step (the two arms ran next to each other), the median of the per-step ratios
        res["s3_hit_vs_floor_ratio"] = _median([h / f for h, f in zip(arms["hit"].times[1:], arms["hit_floor"].times[1:])])
        return res


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    ap.add_argument("--quick", action="store_true", help="64 trajectories, 3 repeats, 4 steps x 1 round")
    ap.add_argument("--rows", type=int, default=None, help="trajectories per mini-batch (default 1024)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats of save and load (default 7)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per block (default 6)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of steps (default 2): each arm runs 1 + steps x rounds steps")
    ap.add_argument("--no-steps", action="store_true", help="only the save / load ratios")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    quick = args.quick
    rows = args.rows or (64 if quick else 1024)
    repeats = args.repeats or (3 if quick else 7)
    steps, rounds = args.steps or (4 if quick else 6), args.rounds or (1 if quick else 2)
    for name, value in (("rows", rows), ("repeats", repeats), ("steps", steps), ("rounds", rounds)):
        if value < 1 or (name == "steps" and value < 2):
            ap.error(f"--{name} must be >= {2 if name == 'steps' else 1}, got {value}")
    try:
        import moto.server  # noqa: F401
        import obstore  # noqa: F401
    except ImportError as exc:
        sys.stderr.write(f"object-store rows need obstore and moto: {exc} (pip install -e '.[dev]')\n")
        return 3
    res = bench_s3(rows, repeats)
    if not args.no_steps:
        res.update(bench_s3_steps(rows, steps=steps, rounds=rounds))
    if args.json:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
    else:
        for k, v in res.items():
            sys.stdout.write(f"{k:>24} {v:10.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
