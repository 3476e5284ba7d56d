"""scripts/bench.py run as a user runs it, in a real subprocess, on real files. Behaviour only: every key
of SPEC "Benchmark" is there and sane, the scan namespaces it builds are real committed caches, the
payload has the shape rollouts have, the floors read what the harness reads; never how fast anything
was. The bench's parts (scripts/_bench*.py) are imported in-process; the options are checked in-process
too (one subprocess case runs a bad option as a user does)."""
from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
from types import SimpleNamespace
import sys
from pathlib import Path

import pytest
import torch

from skip_harness.store.open import open_namespace, open_store
from skip_harness.store import index
from skip_harness.store.scan import scan_namespace
from skip_harness.store.stepstore import StepStore

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BENCH = SCRIPTS / "bench.py"
sys.path.insert(0, str(SCRIPTS))
import _bench_scan  # noqa: E402
import _bench_steps  # noqa: E402
import _benchlib as lib  # noqa: E402
SPEC_KEYS = ("save_ratio", "load_ratio", "step_overhead_ratio", "sync_overhead_ratio", "scan_10k_s",
             "load_peak_mem_ratio", "hit_overhead_ratio", "disk_ratio", "disk_ratio_narrow",
             "step_overhead_ratio_zstd", "hit_overhead_ratio_zstd", "s3_save_ratio", "s3_load_ratio",
             "s3_step_overhead_ratio", "s3_hit_overhead_ratio", "disk_ratio_grpo", "disk_floor_ratio_grpo",
             "concurrent_hit_floor_ratio")
ZSTD_KEYS = ("disk_ratio_jagged", "disk_ratio_jagged_narrow", "disk_ratio_moe", "disk_ratio_moe_narrow", "verl_bytes",
             "verl_bytes_jagged", "verl_bytes_moe", "save_zstd_mib_s", "load_zstd_mib_s", "zstd_stored_bytes",
             "zstd_compress_cpu_s", "zstd_decompress_s", "step_overhead_ratio_zstd_floor",
             "hit_overhead_ratio_zstd_floor", "step_cpu_overhead_ratio_zstd", "hit_cpu_overhead_ratio_zstd",
             "step_zstd_vs_floor_ratio", "hit_zstd_vs_floor_ratio")
SE_KEYS = ("step_vs_floor_ratio", "hit_vs_floor_ratio", "step_zstd_vs_floor_ratio", "hit_zstd_vs_floor_ratio",
           "step_vs_floor_ratio_grpo", "hit_vs_floor_ratio_grpo", "step_zstd_vs_floor_ratio_grpo",
           "hit_zstd_vs_floor_ratio_grpo", "step_vs_protocol_floor_ratio_grpo", "protocol_floor_vs_floor_ratio_grpo")
MORE_KEYS = ("bare_load_peak_mem_ratio", "xxh3_gbps", "payload_bytes", "save_s", "bare_save_s", "load_s",
             "bare_load_s", "step_s", "step_off_s", "step_sync_s", "step_hit_s", "step_memory_s",
             "step_overhead_ratio_1thread", "sync_overhead_ratio_1thread", "verl_sync_overhead_ratio", "scan_1k_s", "scan_full_1k_s",
             "scan_full_10k_s", "save_mib_s", "save_small_mib_s", "load_mib_s", "load_small_mib_s",
             "floor_write_fsync_s", "floor_memcpy_s", "save_cpu_s", "bare_save_cpu_s", "step_cpu_overhead_ratio",
             "sync_cpu_overhead_ratio", "hit_cpu_overhead_ratio", "floor_cpu_overhead_ratio", "step_floor_ratio", "step_floor_s",
             "step_vs_floor_ratio", "scan_index_ratio", "step_hit_floor_s", "hit_floor_ratio", "hit_vs_floor_ratio",
             "hit_floor_cpu_overhead_ratio", "s3_hit_floor_ratio", "s3_hit_vs_floor_ratio", "s3_step_vs_floor_ratio",
             "concurrent_hit_ratio", "lone_hit_s", "concurrent_hit_s", "concurrent_floor_s", "verl_bytes_grpo",
             "stored_bytes_grpo", "floor_bytes_grpo", "step_overhead_ratio_grpo", "step_floor_ratio_grpo",
             "step_vs_floor_ratio_grpo", "hit_overhead_ratio_grpo", "hit_floor_ratio_grpo", "hit_vs_floor_ratio_grpo",
             "step_overhead_ratio_zstd_grpo", "hit_overhead_ratio_zstd_grpo", "step_overhead_ratio_zstd_floor_grpo",
             "hit_overhead_ratio_zstd_floor_grpo", "step_zstd_vs_floor_ratio_grpo", "hit_zstd_vs_floor_ratio_grpo",
             "step_vs_protocol_floor_ratio_grpo", "protocol_floor_vs_floor_ratio_grpo")


def load_script(path: Path = BENCH):
    name = f"_skip_harness_script_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run(args, tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, SKIP_HARNESS_DUMP_DIR=str(tmp / "cache"))
    return subprocess.run([sys.executable, str(BENCH), *map(str, args)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=timeout)


# `.ci/run` runs the quick bench once, beside the fast tests and before the slow tests (`--work-dir DIR/work
# --json-out DIR/quick.json`, its table in CI's log), and names DIR here: the tests below read that run instead of
# paying another minute for one
QUICK_RUN = "SKIP_HARNESS_BENCH_QUICK_RUN"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """`python scripts/bench.py --quick --json` run once, as a user runs it; the tests below read its output
    (or CI's own quick run, named by $SKIP_HARNESS_BENCH_QUICK_RUN)."""
    if os.environ.get(QUICK_RUN):
        ran = Path(os.environ[QUICK_RUN])
        doc = ran / "quick.json"
        assert doc.is_file(), f"${QUICK_RUN}={ran}: no quick.json there"
        proc = SimpleNamespace(returncode=0, stdout=doc.read_text(), stderr="")
        return SimpleNamespace(proc=proc, work=ran / "work")
    tmp = tmp_path_factory.mktemp("bench_quick")
    work = tmp / "work"
    out = tmp / "quick.json"
    proc = run(["--quick", "--json", "--json-out", out, "--work-dir", work, "--compute-threads", "2", "--no-tier"], tmp,
               timeout=400)
    if proc.returncode == 0:   # --json-out writes the document --json prints
        assert json.loads(out.read_text()) == json.loads(proc.stdout)
    return SimpleNamespace(proc=proc, work=work)


@pytest.mark.slow
def test_bench_quick_json_has_every_spec_key(quick):
    proc, work = quick.proc, quick.work
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document (progress goes to stderr)
    for key in SPEC_KEYS + MORE_KEYS + ZSTD_KEYS:
        value = doc.get(key)
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    assert doc["quick"] is True and doc["scan_10k_extrapolated"] is True
    # four replays of one namespace at once: readers beside its recording, not one byte written by them
    assert doc["concurrent_replays"] == 4 and doc["replays_bytes_written"] == 0
    # narrowing + zstd stores less than narrowing alone, which stores less than torch.save, for each variant
    for tag in ("", "_jagged", "_moe"):
        assert 0 < doc[f"disk_ratio{tag}"] < doc[f"disk_ratio{tag}_narrow"] < 1, tag
    # the GRPO batch: stored below verl's bytes, and never below the zstd size of its unique content
    assert 0 < doc["disk_ratio_grpo"] < 1 and doc["disk_floor_ratio_grpo"] > 0.95
    assert doc["floor_bytes_grpo"] < doc["stored_bytes_grpo"] < doc["verl_bytes_grpo"]
    assert doc["payload_tokens"] == 4096 and doc["small_payload_bytes"] < doc["payload_bytes"]
    # a step-by-step figure comes with its standard error where it has 4 pairs or more: the quick run's GRPO
    # arms (3 steps x 2 rounds), not its dense ones (3 steps)
    for key in SE_KEYS:
        value = doc.get(f"{key}_se")
        if key.endswith("_grpo"):
            assert isinstance(value, float) and math.isfinite(value) and value >= 0, (key, value)
        else:
            assert value is None, (key, value)
    # Only the scan namespace is kept in a user's work dir, for the next run to reuse -- with its index.
    assert sorted(p.name for p in work.iterdir()) == ["scan_1000x4"]
    (ns,) = (work / "scan_1000x4" / "bench_skip_harness").iterdir()
    assert (ns / index.INDEX_NAME).is_file()


@pytest.mark.slow
def test_bench_table_names_every_figure(quick):
    """The table `python scripts/bench.py` prints (without --json) is render_table of the same document: every
    figure is named in it, the one-thread figures too (asked for two threads)."""
    import _bench_table

    assert quick.proc.returncode == 0, quick.proc.stderr
    quick_doc = json.loads(quick.proc.stdout)
    table = _bench_table.render_table(quick_doc)
    for words in ("save (durable)", "load (+ verify", "training step, miss, async", "async_write=false", "torch.save (verl)",
                  "hit (prefetch) vs in memory", "peak memory", "startup scan", "floor of a save", "throughput",
                  "miss, async, zstd", "hit, zstd", "narrow + zstd / verl torch.save", "jagged (verl V1)",
                  "MoE routed experts", "zstd: miss vs its floor beside it", "hit floor (page cache)",
                  "hit vs the page-cache floor", "one-thread", "disk, GRPO (verl V1, n = 8)",
                  "its unique content's zstd", "replays at once vs 4 bare reads at once",
                  "SPEC's commit, bare, vs the floor", "miss vs SPEC's commit, bare"):
        assert words in table, words
    assert table.count("(s.e. ") == sum(f"{key}_se" in quick_doc for key in SE_KEYS) == 6


@pytest.mark.parametrize("arm", ["floor_protocol", "async", "floor"])
def test_the_protocol_floor_asks_of_the_disk_what_the_miss_does(tmp_path, monkeypatch, arm):
    """`protocol_floor_vs_floor_ratio_grpo` is what SPEC's commit costs only if its arm
    (scripts/_bench_protocol.py) does to the disk what the harness's miss does: a step, the same fsyncs and
    the same files in the step's directory; the durable-copy floor, one fsync and one file."""
    import threading

    from _bench_grpo import make_grpo_payload

    payload = make_grpo_payload(2, 8, seed=1)
    make = {"floor": _bench_steps.FloorArm, "async": lambda p, d: _bench_steps.TrainingArm("async", p, d)}
    if arm == "floor_protocol":
        from _bench_protocol import ProtocolFloorArm
        make[arm] = ProtocolFloorArm
    a = make[arm](payload, tmp_path / arm)
    fsyncs, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(threading.current_thread().name), real(fd))[1])
    compute = lib.Compute(16)
    a.step(1, compute)                      # the first step of a namespace makes its folders: not counted
    fsyncs.clear()
    a.step(2, compute)
    if isinstance(a, _bench_steps.TrainingArm):
        a.harness.close()
    a.close(2)
    written = sorted(p.name for p in (tmp_path / arm).rglob("*") if p.parent.name == "2" or p.name.startswith("2."))
    if arm == "floor":
        assert len(fsyncs) == 1 and written == ["2.bin"]
    else:
        assert len(fsyncs) == 6 and written == ["commit.json", "meta.json", "tq_batch.pt"], (fsyncs, written)
    assert all("writer" in name for name in fsyncs)          # on the writer thread, none on the trainer's


def test_a_paired_figures_standard_error_is_the_medians():
    """median_se: 1.2533 sigma / sqrt(n), sigma read from the interquartile range -- for a normal sample
    close to its sigma's, unmoved by a few wild steps, and none where there are too few steps to say."""
    import random

    import _bench_steps

    rng = random.Random(0)
    sample = [rng.gauss(1.0, 0.04) for _ in range(10_000)]
    assert _bench_steps.median_se(sample) == pytest.approx(1.2533 * 0.04 / 100, rel=0.05)
    wild = sample[:-50] + [5.0] * 50                     # 0.5 % of the steps ten times slower
    assert _bench_steps.median_se(wild) == pytest.approx(_bench_steps.median_se(sample), rel=0.02)
    assert _bench_steps.median_se([1.0, 1.1, 0.9]) is None                # too few steps to say
    assert _bench_steps.median_se([1.0] * 8) == 0.0


def test_the_grpo_batch_is_what_grpo_writes():
    """The GRPO batch's groups share their prompt, input_ids is prompt + response, the masks and position ids
    follow from the lengths, and the floor's content holds each prompt once."""
    import _bench_grpo

    ts = _bench_grpo.grpo_trajectories(3, n=4, seed=1, prompt_len=64, response_len=96)
    assert len(ts) == 12
    for i, t in enumerate(ts):
        head = ts[i - i % 4]
        assert torch.equal(t["prompts"], head["prompts"]) and t["uid"] == head["uid"]
        assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]]))
        total = len(t["prompts"]) + len(t["responses"])
        assert torch.equal(t["position_ids"], torch.arange(total)) and int(t["attention_mask"].sum()) == total
        assert t["response_mask"].shape == t["responses"].shape == t["rollout_log_probs"].shape
        assert not torch.equal(t["old_log_probs"], t["rollout_log_probs"])
    assert not torch.equal(ts[0]["responses"][:10], ts[1]["responses"][:10])       # samples differ
    unique = _bench_grpo.unique_content(3, n=4, seed=1)
    assert unique["prompts"].size(0) == 3 and unique["responses"].size(0) == 12 and len(unique["uid"]) == 3
    batch = _bench_grpo.make_grpo_payload(3, n=4, seed=1)
    assert batch["tensordict"].batch_size[0] == 12


BAD_OPTIONS = ((["--rows", "0"], "--rows"), (["--scan-steps", "0"], "--scan-steps"),
               (["--json-out", "/nonexistent-skip-harness/quick.json"], "--json-out"))


def test_bench_rejects_a_bad_option_in_process(capsys):
    """The argument checks, in-process (argparse's exit 2 and its message); the subprocess case below
    runs one of them as a user does."""
    bench = load_script()
    for bad, name in BAD_OPTIONS:
        with pytest.raises(SystemExit) as exc:
            bench.main(bad)
        out, err = capsys.readouterr()
        assert exc.value.code == 2 and name in err and "Traceback" not in err, (bad, err)
        assert out == ""


@pytest.mark.slow
def test_bench_rejects_a_bad_option_without_traceback(tmp_path):
    for bad, name in BAD_OPTIONS[:1]:
        proc = run(bad, tmp_path, timeout=120)
        assert proc.returncode == 2 and name in proc.stderr and "Traceback" not in proc.stderr
        assert proc.stdout == ""


def test_bench_scan_namespace_is_complete_and_verifies(tmp_path):
    layout = lib.build_scan_namespace(tmp_path / "ns", 25)
    report = scan_namespace(layout, open_namespace(layout))
    assert report.counts() == {"complete": 25, "unverified": 0, "incomplete": 0, "corrupt": 0}
    assert report.steps == scan_namespace(layout, open_namespace(layout), use_index=False).steps
    store = open_store(layout)
    for step in (1, 13, 25):
        assert store.reader.verify(step)[1] is None
    a, b = store.reader.read_inner(1, 3, 0), store.reader.read_inner(25, 3, 0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timing = _bench_scan.bench_scan(layout, 25, warm_runs=1)
    assert set(timing) >= {"first_s", "s", "full_s"}


def test_bench_payload_has_the_shape_of_a_rollout_batch():
    bench = lib
    p = bench.make_payload(16)
    tokens = bench.PROMPT_LEN + bench.RESPONSE_LEN
    assert p["input_ids"].shape == p["attention_mask"].shape == (16, tokens)
    assert p["input_ids"].dtype == torch.int64 and p["old_log_probs"].dtype == torch.float32
    assert p["response_mask"].shape == p["old_log_probs"].shape == p["token_level_rewards"].shape == (16, bench.RESPONSE_LEN)
    assert p["scores"].shape == p["response_length"].shape == (16,)
    assert len(p["uid"]) == len(p["data_source"]) == 16 and all(isinstance(s, str) for s in p["uid"])
    # the response mask covers exactly each trajectory's response, and the reward sits on its last token
    assert torch.equal(p["response_mask"].sum(1), p["response_length"])
    last = p["response_length"] - 1
    assert torch.equal(p["token_level_rewards"][torch.arange(16), last], p["scores"])
    # the default is a realistic mini-batch: 1024 trajectories x 4096 tokens, over 100 MiB
    assert bench.tensor_bytes(bench.make_payload(1024)) > 100 * 2**20
    copy = bench.fresh_copy(p)
    assert copy["input_ids"].data_ptr() != p["input_ids"].data_ptr()
    assert bench.touch(copy) == bench.touch(p)


def test_bench_variants_are_verl_like_and_their_ratios_are_what_the_codec_stores(tmp_path):
    bench = lib
    p = bench.make_payload(8)
    ids = p["input_ids"][p["attention_mask"].bool()]
    # Zipf-like token ids: a few ids are most of the tokens (uniform ids would put ~1/151936 on each)
    counts = torch.bincount(ids, minlength=bench.VOCAB).sort(descending=True).values
    assert counts[:100].sum() > 0.3 * ids.numel() and ids.max() < bench.VOCAB
    jag = bench.make_jagged_payload(8)
    assert set(jag) == {"tensordict", "tags", "keys", "global_steps"}
    td = jag["tensordict"]
    assert all(td.get(k).layout == torch.jagged for k in ("prompts", "responses", "input_ids", "response_mask"))
    assert type(td.get("messages")).__name__ == "NonTensorStack"
    assert [r.numel() for r in td.get("responses").unbind(0)] == p["response_length"].tolist()
    moe = bench.make_moe_payload(1)
    re = moe["routed_experts"]
    assert re.dtype == torch.int16 and re.shape == (1, 4096, 48, 8) and int(re.max()) < 128
    live = re[0][moe["attention_mask"][0].bool()]
    assert all(len(set(row.tolist())) == 8 for row in live[:50].reshape(-1, 8))     # 8 distinct experts a token
    r = bench.disk_ratios(p, tmp_path)
    assert 0 < r["zstd"] < r["narrow"] < 1


def test_bench_training_blocks_hit_from_the_cache_they_wrote(tmp_path):
    bench = lib
    payload = bench.make_payload(4)
    compute = bench.Compute(8)
    written = bench.run_training_block("async", payload, compute, 3, tmp_path / "c", keep=True)
    block = bench.run_training_block("hit", payload, compute, 3, tmp_path / "c", keep=True)
    assert len(block.times) == 3 and block.layout == written.layout and written.layout.payload_path(3, 0, 0).is_file()
    with pytest.raises(bench.BenchError, match="expected every one to be a miss"):
        bench.run_training_block("async", payload, compute, 3, tmp_path / "c", keep=True)  # they hit now


def test_the_hit_floor_reads_the_bytes_the_hit_serves(tmp_path):
    """The floor arm maps the very files the hit arm serves and hands the trainer the same batch."""
    payload = lib.make_payload(4)
    layout = lib.run_training_block("async", payload, lib.Compute(8), 3, tmp_path / "c", keep=True).layout
    arm = _bench_steps.HitFloorArm(payload, layout, 3)
    try:
        for step in (1, 2, 3):
            batch = arm.produce(step)
            assert batch.keys() == payload.keys()
            for k, v in payload.items():
                assert torch.equal(batch[k], v) if isinstance(v, torch.Tensor) else batch[k] == v, k
            del batch
    finally:
        arm.close(3)
    with pytest.raises(lib.BenchError, match="2 of 3 steps were read"):
        short = _bench_steps.HitFloorArm(payload, layout, 3)
        short.produce(1), short.produce(2)
        short.close(3)


def test_the_zstd_floor_compresses_the_batchs_own_bytes(tmp_path):
    """The compressed miss's floor arm does the work it stands for: each step's file is zstd frames that
    decompress to every tensor of the batch, narrowed losslessly, in order -- smaller than the batch."""
    import zstandard

    from skip_harness.codec.compression import narrowest_dtype

    payload = lib.make_payload(4)
    arm = _bench_steps.FloorArm(payload, tmp_path / "f", lib.ZSTD_LEVEL)
    try:
        for step in (1, 2):
            arm.produce(step)
            arm.settle(step)
    finally:
        arm.close(2)
    expected = b"".join(t.to(narrowest_dtype(t)).contiguous().view(torch.uint8).numpy().tobytes()
                        for t in lib.iter_tensors(payload) if t.numel())
    for step in (1, 2):
        data = (tmp_path / "f" / f"{step}.bin").read_bytes()
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
        assert reader.read(len(expected)) == expected          # (the file ends in the direct write's zero padding)
        assert len(data) < lib.tensor_bytes(payload) / 2


def _imports(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_bench_scripts_are_independent_and_small():
    """bench.py and bench_s3.py import nothing of each other (bench.py runs bench_s3.py as a subprocess;
    both use the shared parts _benchlib.py and _bench_steps.py's step arms);
    bench_view.py builds its batch and namespace with _benchlib's helpers, not copies; no part of the
    bench is over 400 lines."""
    assert not {"bench_s3"} & _imports(BENCH) and not {"bench", "_bench_io", "_bench_table"} & _imports(SCRIPTS / "bench_s3.py")
    view = (SCRIPTS / "bench_view.py").read_text()
    assert "from _benchlib import" in view and "def make_payload" not in view and "def build_scan_namespace" not in view
    for path in [BENCH, SCRIPTS / "bench_s3.py", SCRIPTS / "bench_view.py", *SCRIPTS.glob("_bench*.py")]:
        assert len(path.read_text().splitlines()) <= 400, path.name


def test_the_bench_scripts_help_in_process(capsys):
    for path in (BENCH, SCRIPTS / "bench_s3.py", SCRIPTS / "bench_view.py"):
        with pytest.raises(SystemExit) as exc:
            load_script(path).main(["--help"])
        out = capsys.readouterr().out
        assert exc.value.code == 0 and "--quick" in out and "--json" in out, path.name
