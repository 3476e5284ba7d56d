"""Object-store rows of the benchmark, against a moto S3 server this script starts on 127.0.0.1.

    python scripts/bench_s3.py [--json] [--quick] [--rows N] [--repeats R]

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
(async writes: the puts stay off the critical path) over the same step with caching off, blocks
interleaved; and `s3_hit_overhead_ratio`: a step served from the bucket (prefetched) over the step
with its batch already in memory. Beside them, the floor of any miss to this server
(`s3_step_floor_ratio`: each step's batch copied once and put whole on a background thread -- no
checksum, meta.json or commit record -- over caching off) and `s3_step_vs_floor_ratio`: the miss over
that floor. moto runs on this machine's cores, so receiving a put takes CPU from the step; the floor
shows how much of the miss's cost is that. `scripts/bench.py` calls `bench_s3(...)` and
`bench_s3_steps(...)`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


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
def _server_bucket(work: Path, bucket: str) -> Iterator[str]:
    """A fresh moto server on 127.0.0.1 with one bucket, its AWS_* settings in this process's
    environment while the block runs; the environment restored and the server stopped after."""
    sys.path.insert(0, str(REPO / "tests"))
    from s3server import start_server

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


def bench_s3(rows: int = 1024, repeats: int = 7, work: Path | None = None) -> Dict[str, float]:
    """The object-store ratios (see the module doc) on a fresh moto server, stopped at the end."""
    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO / "tests"))
    import obstore as obs
    import xxhash
    from _benchlib import make_payload

    from skip_harness.store.bufferpool import BufferPool
    from skip_harness.store.layout import Layout
    from skip_harness.store.objstore import client as client_mod
    from skip_harness.store.objstore.backend import ObjectNamespace
    from skip_harness.store.objstore.payloads import encode
    from skip_harness.store.stepstore import StepStore

    work = Path(work or tempfile.mkdtemp(prefix="bench-s3-"))
    with _server_bucket(work, "bench-s3") as bucket:
        ns = ObjectNamespace(f"s3://{bucket}/exp_proj/GBS{rows}_N1_in1024_out3072")
        steps = StepStore(Layout(work / "names-only", K=1, W=1), backend=ns, pool=BufferPool())
        store = ns.client.store
        payload = make_payload(rows)
        image = encode(payload)
        nbytes = len(image)
        multipart = nbytes > client_mod.MULTIPART_FROM
        counter = iter(range(10**9))

        def ours_save():
            step = next(counter) + 1
            steps.writer.commit(step, steps.writer.write_inner(step, 0, 0, payload, {"bench": "s3"}), None)

        def bare_put():
            obs.put(store, f"bare/{next(counter)}", memoryview(image), use_multipart=multipart,
                    chunk_size=client_mod.PART_SIZE)

        def clear():  # keep moto's memory bounded: drop what the save arms wrote
            keys = [m["path"] for m in ns.client.list(None)]
            if keys:
                ns.client.delete(keys)

        save_times: Dict[str, List[float]] = {"ours": [], "bare": []}
        for r in range(repeats + 1):
            t = _interleave({"ours": ours_save, "bare": bare_put} if r % 2 == 0 else
                            {"bare": bare_put, "ours": ours_save}, 1, warmup=0)
            if r:
                for k in t:
                    save_times[k] += t[k]
            clear()

        obs.put(store, "bare/load", memoryview(image), use_multipart=multipart, chunk_size=client_mod.PART_SIZE)
        steps.writer.commit(1, steps.writer.write_inner(1, 0, 0, payload, {"bench": "s3"}), None)
        record = json.loads(ns.read_commit(1))
        [entry] = [f for f in record["files"] if f["rel"].endswith(".pt")]

        def ours_load():
            status, reason, batches, _ = steps.reader.read_served(1, 0)
            if reason is not None:
                raise RuntimeError(f"step 1 on {ns.url}: {reason}")

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
        assert xxhash.xxh3_128_hexdigest(bytes(obs.get(store, "bare/load").bytes())) == entry["checksum"]
        return res


def _floor_block(payload: Any, compute: Any, steps: int, client: Any) -> List[float]:
    """The floor of any miss to this object store, timed like a training block: each step's batch
    copied once into a buffer (the copy any write needs before the trainer may change its batch), then
    put whole with the same library on a background thread, one put in flight at a time -- no
    checksum, no meta.json, no commit record. Seconds of each step."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore as obs
    import torch
    from _benchlib import SyntheticTrainer, iter_tensors, tensor_bytes, touch

    trainer = SyntheticTrainer(payload)
    nbytes = tensor_bytes(payload)
    buffers = [bytearray(nbytes), bytearray(nbytes)]
    pending = None
    per_step: List[float] = []
    with ThreadPoolExecutor(1, thread_name_prefix="bench-s3-floor") as pool:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            trainer.prepare_data(step)
            batch = trainer.sample(step)
            if pending is not None:
                pending.result()              # one put in flight, as the writer's queue allows
            buf = buffers[step % 2]
            flat, off = torch.frombuffer(buf, dtype=torch.uint8), 0
            for t in iter_tensors(batch):
                n = t.numel() * t.element_size()
                flat[off:off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
                off += n
            pending = pool.submit(obs.put, client.store, f"floor/{step}", memoryview(buf), use_multipart=False)
            touch(batch)
            compute.run()
            per_step.append(time.perf_counter() - t0)
            del batch
        if pending is not None:
            pending.result()
    return per_step


def bench_s3_steps(rows: int = 1024, steps: int = 6, rounds: int = 2, work: Path | None = None) -> Dict[str, float]:
    """The step overheads with an s3:// dump_dir (see the module doc), on a fresh moto server."""
    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO / "tests"))
    import obstore as obs
    from _benchlib import COMPUTE_FACTOR, Compute, make_payload, run_training_block

    from skip_harness.store.objstore.client import ObjectClient
    from skip_harness.store.objstore.payloads import encode

    work = Path(work or tempfile.mkdtemp(prefix="bench-s3-steps-"))
    with _server_bucket(work, "bench-s3-steps") as bucket:
        payload = make_payload(rows)
        image = encode(payload)
        client = ObjectClient(f"s3://{bucket}/bare")
        puts = []
        for _ in range(3):
            t0 = time.perf_counter()
            obs.put(client.store, "x", memoryview(image), use_multipart=False)
            puts.append(time.perf_counter() - t0)
        bare_put_s = _median(puts)
        compute = Compute()
        compute.calibrate(COMPUTE_FACTOR * bare_put_s)
        per: Dict[str, List[float]] = {"off": [], "async": [], "floor": [], "hit": [], "memory": []}
        for r in range(rounds):
            url = f"s3://{bucket}/r{r}-{uuid.uuid4().hex[:6]}"
            # 'hit' needs the cache 'async' wrote in this round
            order = ["off", "async", "floor", "hit", "memory"] if r % 2 == 0 else ["memory", "floor", "off", "async", "hit"]
            for mode in order:
                if mode == "floor":
                    times = _floor_block(payload, compute, steps, ObjectClient(url))
                else:
                    times, _ = run_training_block(mode, payload, compute, steps, url, keep=True)  # type: ignore[arg-type]
                per[mode] += times[1:]    # the first step warms up
                if mode == "async":
                    commits = [m for m in ObjectClient(url).list() if m["path"].endswith("/commit.json")]
                    if len(commits) != steps:
                        raise RuntimeError(f"{url}: {len(commits)} of {steps} steps committed in the bucket "
                                           "(does the harness open an s3:// dump_dir as an object store?)")
        res = {"s3_step_bare_put_s": bare_put_s}
        for mode, times in per.items():
            res[f"s3_step_{mode}_s"] = _median(times)
        res["s3_step_overhead_ratio"] = res["s3_step_async_s"] / res["s3_step_off_s"]
        res["s3_step_floor_ratio"] = res["s3_step_floor_s"] / res["s3_step_off_s"]
        res["s3_step_vs_floor_ratio"] = res["s3_step_async_s"] / res["s3_step_floor_s"]
        res["s3_hit_overhead_ratio"] = res["s3_step_hit_s"] / res["s3_step_memory_s"]
        return res


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="64 trajectories, 3 repeats")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-steps", action="store_true", help="only the save / load ratios")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows, repeats = (64, 3) if args.quick else (args.rows, args.repeats)
    res = bench_s3(rows, repeats)
    if not args.no_steps:
        res.update(bench_s3_steps(rows, steps=4 if args.quick else 6, rounds=1 if args.quick else 2))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:>20} {v:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
