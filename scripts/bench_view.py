"""The viewer's speed, as ratios (issue 24): `python scripts/bench_view.py [--quick] [--json] [--work DIR]`

- view_step_ratio      time to the first byte of a step page (`GET /ns/{key}/step/1` from a running
                       `skip-harness view`) over a bare verified read of that step (`StepReader.read_served`),
                       for the benchmark's batch (1024 trajectories x 4096 tokens, about 112 MiB; target <= 1.5).
- view_trajectory_ratio  the same for the page of the step's longest trajectory (`GET .../t/{ref}`: every
                       token coloured, the per-token table) over the same verified read (target <= 1.5).
- view_compare_ratio   the same for the compare page of two real-size runs at one step (`GET /compare?...`:
                       both steps read, every trajectory paired by identity, the first page of pairs) over
                       two verified reads (target <= 1.5). The page keeps the last pair of steps it paired, so
                       the timed requests alternate between two steps: each is computed, none served from it.
- view_discarded_ratio the page of a step's discarded groups (`GET .../step/{n}/discarded`, 40 groups) over its
                       floor: the namespace's scan and the verified read of that small record
                       (`StepReader.read_discarded`) plus the viewer's own HTTP round trip (`GET /favicon.ico`,
                       no read), side by side (target <= 1.5).
                       The step page above also reads the step's discarded groups (it links them).
- view_overview_ratio  time to the first byte of the overview (`GET /`) of a cache holding the 10,000-step
                       x K = 4 namespace over its indexed scan (`scan_namespace` with the index; target <= 1.5).

The viewer keeps the last step it read (a step page's links to its trajectories read it once) and the last
pair of steps it compared, so every timed request alternates between two steps (1 and 2, the same bytes) and
the verified reads alternate likewise: each page is computed from a fresh read, none served from what it kept.
Both sides are warm (page cache, index present) and interleaved; each figure is a median. The viewer is
the real command in its own process, reached over HTTP on 127.0.0.1. `--quick` (CI): 64 trajectories and
1,000 steps, a smoke run (the step page's fixed cost of a few ms is not small beside a 7 MiB read: the
1.5 targets are for the full batch). The batch and the scan namespace are built as scripts/bench.py builds them,
by the helpers both import from scripts/_benchlib.py (neither script imports the other).
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence


REPO = Path(__file__).resolve().parents[1]
# _benchlib (beside this file: `python scripts/bench_view.py` puts scripts/ first on sys.path): the batch and the
# scan namespace, shared with bench.py

from _benchlib import SCAN_K, MiB, build_scan_namespace, make_payload  # noqa: E402

from skip_harness.store.open import open_namespace, open_store  # noqa: E402
from skip_harness.store.layout import Layout  # noqa: E402
from skip_harness.store.scan import scan_namespace  # noqa: E402

log = logging.getLogger("skip_harness.bench_view")


# --------------------------------------------------------------------------------------------
# timing


class Viewer:
    """`skip-harness view ROOT --port 0` in its own process."""

    def __init__(self, root: Path, work: Path):
        self.err = work / f"view-{time.monotonic_ns()}.err"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "skip_harness.cli", "view", str(root), "--port", "0"],
                                         stdout=subprocess.DEVNULL, stderr=err, env=env)
        deadline = time.monotonic() + 120
        while True:
            m = re.search(r"at http://127\.0\.0\.1:(\d+)/ \(read-only", self.err.read_text())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"skip-harness view did not start: {self.err.read_text()}")
            time.sleep(0.1)

    def ttfb(self, path: str) -> float:
        """Seconds from sending the request to its first byte (the status line); the body is then read."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            t0 = time.perf_counter()
            conn.request("GET", path)
            resp = conn.getresponse()
            dt = time.perf_counter() - t0
            body = resp.read()
            if resp.status != 200:
                raise SystemExit(f"GET {path}: {resp.status} {body[:400]!r}")
            return dt
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def interleave(arms: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, List[float]]:
    for fn in arms.values():      # warm-up
        fn()
    out: Dict[str, List[float]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(arms[name]())
    return out


def timed(fn: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def other_run(payload: Dict[str, Any]) -> Dict[str, Any]:
    """A second run of the same step: the same prompts, every other trajectory's response another (its
    tokens shifted by one) with another reward."""
    out = dict(payload)
    ids = payload["input_ids"].clone()
    P = ids.shape[1] - payload["response_mask"].shape[1]
    ids[::2, P:] = (ids[::2, P:] + 1) * payload["response_mask"][::2]
    scores = payload["scores"].clone()
    scores[::2] = 1.0 - scores[::2]
    out.update(input_ids=ids, scores=scores)
    return out


def bench(work: Path, rows: int, steps: int, repeats: int) -> Dict[str, Any]:
    cache = work / "cache"
    step_ns = Layout(cache / "bench_view" / "GBS1024_N8_in1024_out3072", K=1, W=1)
    other_ns = Layout(cache / "bench_view_b" / "GBS1024_N8_in1024_out3072", K=1, W=1)
    store, other = open_store(step_ns), open_store(other_ns)
    payload = make_payload(rows)
    longest = int(payload["response_length"].argmax())
    longest_tokens = int(payload["response_length"][longest])
    nbytes = 0
    for step in (1, 2):                           # two steps a side: the compare arm alternates between them
        entries = store.writer.write_inner(step, 0, 0, payload, {"bench": "view"})
        store.writer.commit(step, entries, None)
        nbytes = sum(e.bytes for e in entries)
    from skip_harness.store.discards import Discarded, DiscardStore

    for step in (1, 2):                           # what a DAPO filter dropped: 40 of the step's 128 groups
        dropped = [Discarded(f"group-{step}-{g}", "filter_groups: every sample's reward was 1 (no spread, no GRPO "
                             "signal)", (1.0,) * 8) for g in range(40)]
        DiscardStore(store.namespace).write_step(step, dropped, commit_created=store.reader.read_commit(step).created)
    payload = other_run(payload)
    for step in (1, 2):
        other.writer.commit(step, other.writer.write_inner(step, 0, 0, payload, {"bench": "view"}), None)
    del payload
    log.info("step of %.1f MiB written; building %d steps x K=%d", nbytes / MiB, steps, SCAN_K)
    big = build_scan_namespace(work / "scan" / "bench_scan" / f"GBS8_N1_in16_out16_K{SCAN_K}_W1", steps)
    scan_namespace(big, open_namespace(big))                           # builds the index, as the first run after a training would
    reader = open_store(step_ns).reader

    turn = [0]

    def bare_read() -> None:
        turn[0] += 1
        status, reason, batches, _ = reader.read_served(1 + turn[0] % 2, 0)
        if reason is not None:
            raise SystemExit(f"the bench step does not verify: {reason}")

    def indexed_scan() -> None:
        report = scan_namespace(big, open_namespace(big))
        if report.counts()["complete"] != steps or not report.index_used:
            raise SystemExit(f"the indexed scan found {report.counts()} (index used: {report.index_used})")

    other_reader = open_store(other_ns).reader

    def two_reads() -> None:
        turn[0] += 1
        for r in (reader, other_reader):
            status, reason, batches, _ = r.read_served(1 + turn[0] % 2, 0)
            if reason is not None:
                raise SystemExit(f"the bench step does not verify: {reason}")

    out: Dict[str, Any] = {"payload_mib": round(nbytes / MiB, 1), "rows": rows, "steps": steps}
    viewer = Viewer(cache, work)
    ns = "/ns/0/bench_view/GBS1024_N8_in1024_out3072"
    page_turn = [0]

    def alternating(path: Callable[[int], str]) -> Callable[[], float]:   # steps 1 and 2 in turn: each read anew
        def run() -> float:
            page_turn[0] += 1
            return viewer.ttfb(path(1 + page_turn[0] % 2))
        return run

    compare_page = alternating(lambda step: f"/compare?a=0/bench_view/GBS1024_N8_in1024_out3072&b=0/bench_view_b/"
                                            f"GBS1024_N8_in1024_out3072&step={step}")
    try:
        t = interleave({"page": alternating(lambda step: f"{ns}/step/{step}"), "bare": timed(bare_read)}, repeats)
        out.update(view_step_ttfb_s=median(t["page"]), bare_read_s=median(t["bare"]))
        t = interleave({"page": alternating(lambda step: f"{ns}/step/{step}/t/0.0.{longest}"), "bare": timed(bare_read)},
                       repeats)
        out.update(view_trajectory_ttfb_s=median(t["page"]), trajectory_bare_read_s=median(t["bare"]),
                   trajectory_tokens=longest_tokens)
        t = interleave({"page": compare_page, "bare": timed(two_reads)}, repeats)
        out.update(view_compare_ttfb_s=median(t["page"]), two_reads_s=median(t["bare"]))

        def discards_read() -> None:
            turn[0] += 1
            scan_namespace(step_ns, reader.namespace, rewrite_index=False)     # is the step there, its neighbours
            if reader.read_discarded(1 + turn[0] % 2) is None:
                raise SystemExit("the bench step's discarded groups do not read")

        # the discarded page needs the namespace's scan (the step, its neighbours) and one small record: its
        # floor is those reads plus the viewer's own round trip (the favicon: no read at all), side by side
        t = interleave({"page": alternating(lambda step: f"{ns}/step/{step}/discarded"), "bare": timed(discards_read),
                        "http": lambda: viewer.ttfb("/favicon.ico")}, repeats)
        out.update(view_discarded_ttfb_s=median(t["page"]), discarded_read_s=median(t["bare"]),
                   view_http_floor_s=median(t["http"]))
    finally:
        viewer.stop()
    viewer = Viewer(work / "scan", work)
    try:
        t = interleave({"page": lambda: viewer.ttfb("/"), "scan": timed(indexed_scan)}, repeats)
        out.update(view_overview_ttfb_s=median(t["page"]), indexed_scan_s=median(t["scan"]))
    finally:
        viewer.stop()
    out["view_step_ratio"] = out["view_step_ttfb_s"] / out["bare_read_s"]
    out["view_trajectory_ratio"] = out["view_trajectory_ttfb_s"] / out["trajectory_bare_read_s"]
    out["view_compare_ratio"] = out["view_compare_ttfb_s"] / out["two_reads_s"]
    out["view_overview_ratio"] = out["view_overview_ttfb_s"] / out["indexed_scan_s"]
    out["view_discarded_ratio"] = out["view_discarded_ttfb_s"] / (out["discarded_read_s"] + out["view_http_floor_s"])
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI: 64 trajectories, 1,000 steps, 3 repeats")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--work", type=Path, help="where to build the caches (default: a temporary directory)")
    p.add_argument("--repeats", type=int, help="timed runs per side (default 7, --quick 3)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="bench_view: %(message)s", stream=sys.stderr)
    rows, steps = (64, 1000) if args.quick else (1024, 10_000)
    repeats = args.repeats or (3 if args.quick else 7)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_view-"))
    try:
        result = bench(work, rows, steps, repeats)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["quick"] = bool(args.quick)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        if args.quick:
            sys.stdout.write("quick: a smoke run (a 7 MiB step, whose read is too short for the page's fixed cost of a "
                             "few ms to vanish); the targets are for the full batch\n")
        sys.stdout.write(
            f"view_step_ratio      {result['view_step_ratio']:.2f}  (target <= 1.5)  step page first byte "
            f"{result['view_step_ttfb_s'] * 1000:.0f} ms vs verified read {result['bare_read_s'] * 1000:.0f} ms "
            f"of {result['payload_mib']} MiB ({rows} trajectories)\n"
            f"view_trajectory_ratio {result['view_trajectory_ratio']:.2f}  (target <= 1.5)  trajectory page first byte "
            f"{result['view_trajectory_ttfb_s'] * 1000:.0f} ms ({result['trajectory_tokens']} tokens) vs verified read "
            f"{result['trajectory_bare_read_s'] * 1000:.0f} ms\n"
            f"view_compare_ratio   {result['view_compare_ratio']:.2f}  (target <= 1.5)  compare page first byte "
            f"{result['view_compare_ttfb_s'] * 1000:.0f} ms vs two verified reads {result['two_reads_s'] * 1000:.0f} ms\n"
            f"view_overview_ratio  {result['view_overview_ratio']:.2f}  (target <= 1.5)  overview first byte "
            f"{result['view_overview_ttfb_s'] * 1000:.0f} ms vs indexed scan {result['indexed_scan_s'] * 1000:.0f} ms "
            f"({steps} steps x K={SCAN_K})\n"
            f"view_discarded_ratio {result['view_discarded_ratio']:.2f}  (target <= 1.5)  discarded page first byte "
            f"{result['view_discarded_ttfb_s'] * 1000:.1f} ms vs scan + its record's read {result['discarded_read_s'] * 1000:.1f} ms"
            f" + the viewer's round trip {result['view_http_floor_s'] * 1000:.1f} ms\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
