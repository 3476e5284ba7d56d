"""End-to-end: scripts/bench.py and scripts/plot.py run as a user runs them, in real subprocesses, on
real files (a real Hydra sweep of scripts/train.py for the plot)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skip_harness.scan import scan_namespace
from skip_harness.store import StepStore

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench.py"
PLOT = ROOT / "scripts" / "plot.py"
TRAIN = ROOT / "scripts" / "train.py"
SPEC_KEYS = ("save_ratio", "load_ratio", "step_overhead_ratio", "sync_overhead_ratio", "scan_10k_s",
             "load_peak_mem_ratio")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.slow


def load_script(name: str):
    """Import scripts/<name>.py as a module (registered, so its dataclasses resolve their module)."""
    mod_name = f"_skip_harness_script_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def env_for(tmp: Path) -> dict:
    env = dict(os.environ)
    env["SKIP_HARNESS_DUMP_DIR"] = str(tmp / "cache")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run(cmd, tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, cmd)], cwd=tmp, env=env_for(tmp), capture_output=True,
                          text=True, timeout=timeout)


def assert_png(path: Path, min_bytes: int = 20_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) >= min_bytes, f"{path} is only {len(data)} bytes"


# --------------------------------------------------------------------------------------------
# bench


def test_bench_quick_json_has_every_spec_key(tmp_path):
    work = tmp_path / "work"
    proc = run([BENCH, "--quick", "--json", "--work-dir", work], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document (progress goes to stderr)
    assert isinstance(doc, dict)
    for key in SPEC_KEYS + ("bare_load_peak_mem_ratio", "xxh3_gbps", "payload_bytes", "save_s", "bare_save_s",
                            "load_s", "bare_load_s", "step_s", "step_off_s", "step_sync_s"):
        value = doc.get(key)
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    assert doc["scan_steps"] == 1000 and doc["scan_10k_extrapolated"] is True
    # Only the scan namespace is kept in a user's work dir, for the next run to reuse.
    assert sorted(p.name for p in work.iterdir()) == ["scan_1000x4"]


def test_bench_rejects_a_bad_option_without_traceback(tmp_path):
    proc = run([BENCH, "--payload-mib", "0"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "--payload-mib" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_bench_scan_namespace_is_complete_and_verifies(tmp_path):
    bench = load_script("bench")
    layout = bench.build_scan_namespace(tmp_path / "ns", 25)
    report = scan_namespace(layout)
    assert report.counts() == {"complete": 25, "unverified": 0, "incomplete": 0, "corrupt": 0}
    store = StepStore(layout)
    for step in (1, 13, 25):
        assert store.verify(step) is None
    a, b = store.read_inner(1, 3, 0), store.read_inner(25, 3, 0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bench_payload_is_the_requested_size_and_touch_reads_everything():
    bench = load_script("bench")
    payload = bench.make_payload(4 << 20)
    nbytes = bench.tensor_bytes(payload)
    assert 0.9 * (4 << 20) <= nbytes <= 4 << 20
    assert payload["input_ids"].dtype == torch.int64 and payload["old_log_probs"].dtype == torch.float32
    assert payload["input_ids"].shape == (payload["prompts"].shape[0], bench.PROMPT_LEN + bench.RESPONSE_LEN)
    copy = bench.fresh_copy(payload)
    assert copy["input_ids"].data_ptr() != payload["input_ids"].data_ptr()
    assert bench.touch(copy) == bench.touch(payload)
