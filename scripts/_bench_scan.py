"""The benchmark's startup-scan rows (scripts/bench.py): `scan_namespace` over a namespace of many
committed steps (built once by `_benchlib.build_scan_namespace`, kept in a user's --work-dir for the
next run), with the namespace index and without it."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List

from _benchlib import SCAN_BUILD_FORMAT, SCAN_K, BenchError, build_scan_namespace, log, median

from skip_harness.store.open import open_namespace
from skip_harness.store import index
from skip_harness.store.layout import Layout
from skip_harness.store.scan import scan_namespace


def scan_namespace_for(work: Path, steps: int, reuse: bool) -> Layout:
    """The scan namespace under `work`, built once; with `reuse` an earlier build is kept."""
    base = work / f"scan_{steps}x{SCAN_K}"
    marker = base / "built.json"
    root = base / "bench_skip_harness" / f"GBS8_N1_in16_out16_K{SCAN_K}_W1"
    want = {"format": SCAN_BUILD_FORMAT, "steps": steps, "K": SCAN_K}
    if reuse and marker.is_file():
        try:
            if json.loads(marker.read_text()) == want:
                log.info("reusing the scan namespace in %s (without its index: the first scan builds it)", root)
                layout = Layout(root, K=SCAN_K, W=1)
                index.remove(open_namespace(layout))
                return layout
        except ValueError:
            pass
    shutil.rmtree(base, ignore_errors=True)
    t0 = time.perf_counter()
    layout = build_scan_namespace(root, steps)
    marker.write_text(json.dumps(want))
    log.info("built %d steps x K=%d in %.1f s", steps, SCAN_K, time.perf_counter() - t0)
    return layout


def bench_scan(layout: Layout, steps: int, warm_runs: int = 3) -> Dict[str, Any]:
    """Time scan_namespace: the first scan (which finds no index and builds it, unless a reused build
    has one), then `warm_runs` with the index (their median is the figure) and `warm_runs` full scans
    without it (use_index=False), interleaved."""
    def timed(use_index: bool) -> float:
        t0 = time.perf_counter()
        report = scan_namespace(layout, open_namespace(layout), use_index=use_index)
        dt = time.perf_counter() - t0
        if report.counts()["complete"] != steps or len(report.steps) != steps:
            raise BenchError(f"scan of {layout.root} found {report.counts()}, expected {steps} complete steps")
        return dt

    first = timed(True)
    indexed: List[float] = []
    full: List[float] = []
    for r in range(warm_runs):
        for use_index in ((True, False) if r % 2 == 0 else (False, True)):
            (indexed if use_index else full).append(timed(use_index))
    return {"first_s": first, "s": median(indexed), "full_s": median(full), "runs_s": indexed}

