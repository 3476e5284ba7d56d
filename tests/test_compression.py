"""Smaller caches, losslessly (issue 14): integer tensors narrowed to the narrowest dtype their values
allow and zstd per chunk (`skip.rollout_tq.compression=zstd`), loaded back as exactly the tensors given;
checksums over the stored bytes, so `verify` finds a flipped byte without decompressing; a damaged
chunk is a corrupt step naming its field, never a crash; files of format 2 still load."""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from skip_harness.store.open import open_store
from skip_harness import SkipHarness, codec
from skip_harness.codec import compression, tensorfile
from skip_harness.errors import CodecError
from skip_harness.store import payload_file
from skip_harness.store.layout import Layout, NamespaceKey
from skip_harness.store.posix.fileops import checksum_file
from skip_harness.store.stepstore import StepStore

ROOT = Path(__file__).resolve().parents[1]
ZSTD = codec.stored_form("zstd", 3)
NARROW = codec.StoredForm(narrow=True)
def subprocess_env() -> dict:
    """This environment, with the checkout first on the path (as tests/conftest.py's helper; not
    imported from there: another conftest module of the suite may take the name)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
              torch.uint64, torch.bool]


def load_bench():
    name = "_skip_harness_script_bench"
    if name not in sys.modules:
        if str(ROOT / "scripts") not in sys.path:   # as `python scripts/bench.py` has it: its parts beside it
            sys.path.insert(0, str(ROOT / "scripts"))
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def edge_cases(dtype: torch.dtype) -> dict:
    """Edge values of `dtype`: its min and max, negatives, a narrowable range, empty, non-contiguous, 0-dim."""
    if dtype == torch.bool:
        base = torch.tensor([True, False, True, True, False, False])
        return {"values": base, "empty": torch.empty(0, 3, dtype=dtype), "noncontig": base.view(2, 3).t(),
                "zerodim": torch.tensor(True)}
    npd = {torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}.get(dtype)
    info = np.iinfo(npd) if npd is not None else torch.iinfo(dtype)

    def t(values):
        return torch.from_numpy(np.array(values, dtype=npd)) if npd is not None else torch.tensor(values, dtype=dtype)

    signed = info.min < 0
    cases = {
        "min_max": t([int(info.min), int(info.max), 0]),
        "small": t([0, 1, 7, 100, 3] * 4),                                 # fits uint8
        "empty": torch.empty(0, 4, dtype=dtype),
        "noncontig": t(list(range(24))).view(4, 6).t()[::2],
        "zerodim": t(5).reshape(()),
    }
    if dtype.itemsize > 1:
        cases["one_past_uint8"] = t([0, 256])                             # int16
    if signed:
        cases["negative"] = t([-1, -128, 127, 0])                          # fits int8
    if signed and dtype.itemsize > 2:
        cases["just_below_int16"] = t([-32769, 5])                         # int32
    return cases


def saved_and_loaded(tmp_path: Path, payload: dict, form) -> tuple:
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, payload, form)
    return payload_file.load(path), {f.name: f for f in payload_file.stored_fields(path)}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(a.contiguous().numpy(), b.contiguous().numpy()))


@pytest.mark.parametrize("form", [NARROW, ZSTD], ids=["narrow", "narrow+zstd"])
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_integer_dtype_round_trips_exactly(tmp_path, dtype, form):
    cases = edge_cases(dtype)
    out, stored = saved_and_loaded(tmp_path, cases, form)
    for name, want in cases.items():
        got = out[name]
        assert type(got) is torch.Tensor and same(want, got), (name, want, got)
    # ... and narrowed where the values allow: the stored dtype is the narrowest that holds them
    as_stored = {n: stored[f"payload[{n!r}]"].stored_dtype for n in cases}
    own = str(dtype).replace("torch.", "")
    if dtype.itemsize > 1:
        assert as_stored["small"] == as_stored["noncontig"] == as_stored["zerodim"] == "uint8"
        assert as_stored["one_past_uint8"] == ("int16" if dtype.itemsize > 2 else own)
        if "negative" in cases:
            assert as_stored["negative"] == "int8"
        if "just_below_int16" in cases:
            assert as_stored["just_below_int16"] == ("int32" if dtype.itemsize > 4 else own)
    if "min_max" in cases:
        assert as_stored["min_max"] == own                                   # the full range: not narrowed
    assert as_stored["empty"] == own


def test_narrowing_is_decided_per_tensor_from_min_and_max():
    assert tensorfile.narrowest_dtype(torch.tensor([0, 255])) == torch.uint8
    assert tensorfile.narrowest_dtype(torch.tensor([-1, 127])) == torch.int8
    assert tensorfile.narrowest_dtype(torch.tensor([-1, 128])) == torch.int16
    assert tensorfile.narrowest_dtype(torch.tensor([0, 65535])) == torch.int32          # uint16 is not a target
    assert tensorfile.narrowest_dtype(torch.tensor([0, 151_935])) == torch.int32        # token ids
    assert tensorfile.narrowest_dtype(torch.tensor([-(2 ** 31) - 1, 0])) == torch.int64
    assert tensorfile.narrowest_dtype(torch.tensor([1.5, 2.0])) == torch.float32
    assert tensorfile.narrowest_dtype(torch.tensor([3], dtype=torch.int16)) == torch.uint8


def test_the_numpy_view_the_writer_slices_in_is_the_tensors_memory_or_none():
    """`numpy_view` (the compressor's and dedupe's way to slice without a torch call) shares the tensor's
    memory, and says None where NumPy cannot view it, so those tensors take torch's path and still narrow."""
    from skip_harness.codec.fileimage import numpy_view

    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    v = numpy_view(t)
    v[5] = 99
    assert int(t[1, 1]) == 99 and v.shape == (12,)
    assert numpy_view(t.t()) is None                                          # not contiguous
    assert numpy_view(torch.ones(4, dtype=torch.bfloat16)) is None            # no NumPy twin
    assert numpy_view(torch.ones(4, requires_grad=True)) is None
    assert tensorfile.narrowest_dtype(t.t()) == torch.uint8
    assert tensorfile.narrowest_dtype(torch.tensor([0.0, 300.0], requires_grad=True)) == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_a_tensor_of_several_chunks_round_trips_bit_for_bit_with_or_without_numpy(tmp_path, dtype):
    """Chunks sliced in NumPy (every dtype NumPy has) and in torch (bfloat16) come back bit for bit,
    shuffled floats and narrowed integers alike, chunk edges included."""
    import dataclasses

    g = torch.Generator().manual_seed(3)
    if dtype.is_floating_point:
        t = (-torch.rand(150_001, generator=g) * 6).to(dtype)
    else:
        t = torch.randint(0, 40_000, (150_001,), generator=g, dtype=dtype)
    form = dataclasses.replace(ZSTD, chunk_bytes=1 << 16)
    out, stored = saved_and_loaded(tmp_path, {"x": t}, form)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert out["x"].dtype == dtype and torch.equal(out["x"].view(bits), t.view(bits))
    assert stored["payload['x']"].compression == "zstd"


def test_floats_and_nested_and_non_tensor_fields_keep_their_values(tmp_path):
    g = torch.Generator().manual_seed(0)
    nt = torch.nested.as_nested_tensor([torch.arange(5), torch.arange(300, 302)], layout=torch.jagged)
    payload = {"lp": torch.randn(64, 32, generator=g), "bf": torch.randn(16, generator=g).to(torch.bfloat16),
               "nt": nt, "ids": torch.randint(0, 151_936, (8, 64), generator=g), "text": ["a", "b"],
               "big": torch.zeros(3 << 20, dtype=torch.int64)}                 # several chunks
    out, stored = saved_and_loaded(tmp_path, payload, ZSTD)
    assert same(payload["lp"], out["lp"]) and torch.equal(payload["bf"], out["bf"]) and out["bf"].dtype == torch.bfloat16
    assert torch.equal(out["nt"].values(), nt.values()) and torch.equal(out["nt"].offsets(), nt.offsets())
    assert out["nt"].values().dtype == torch.int64 and same(payload["ids"], out["ids"]) and out["text"] == ["a", "b"]
    assert same(payload["big"], out["big"])
    assert stored["payload['ids']"].stored_dtype == "int32" and stored["payload['nt'].values()"].stored_dtype == "int16"
    assert stored["payload['big']"].compression == "zstd" and stored["payload['big']"].stored_bytes < 4096


def test_store_files_are_smaller_by_the_ratio_the_bench_reports(tmp_path):
    bench = load_bench()
    payload = bench.make_payload(32, seed=2)
    ratios = bench.disk_ratios(payload, tmp_path / "bench")
    sizes = {}
    for name in ("none", "zstd"):
        store = open_store(Layout(tmp_path / name, K=1, W=1), form=codec.stored_form(name, bench.ZSTD_LEVEL))
        entries = store.writer.write_inner(1, 0, 0, payload, {})
        store.writer.commit(1, entries, None)
        sizes[name] = entries[0].bytes
        [back] = store.reader.read_step(1, 0)
        assert all(same(payload[k], back[k]) for k in payload if isinstance(payload[k], torch.Tensor))
        meta = store.reader.read_meta(1, 0, 0)
        assert meta["compression"] == name and meta["logical_bytes"] == sizes["none"]
    # the store writes what the bench measures (same data, same form) ...
    assert sizes["zstd"] / ratios["verl_bytes"] == pytest.approx(ratios["zstd"], rel=0.02)
    # ... which is a fraction of the file at full width
    assert sizes["zstd"] / sizes["none"] == pytest.approx(ratios["zstd"] * ratios["verl_bytes"] / sizes["none"], rel=0.02)
    assert sizes["zstd"] < 0.35 * sizes["none"]


# --------------------------------------------------------------------------------------------
# damage


def _zstd_store(tmp_path: Path, steps=(1,)) -> StepStore:
    bench = load_bench()
    store = open_store(NamespaceKey("zstd", "proj", 8, 1, 2, 2).layout(tmp_path / "dump"), form=ZSTD)
    for step in steps:
        store.writer.commit(step, store.writer.write_inner(step, 0, 0, bench.make_payload(8, seed=step), {}), None)
    return store


def _chunk_offset(path: Path, field: str) -> int:
    """The file offset of the middle of `field`'s first compressed chunk."""
    data = path.read_bytes()
    hlen = struct.unpack_from("<Q", data, 16)[0]
    doc = json.loads(data[24:24 + hlen])
    start = -(-(24 + hlen) // 64) * 64
    for entry in doc["tensors"]:
        if len(entry) > 4 and entry[4].get("name") == field:
            assert "zstd" in entry[4], entry
            return start + entry[2] + entry[4]["zstd"][0][0] // 2
    raise AssertionError(f"{field} not in {path}")


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_chunk_is_found_by_verify_without_decompressing(tmp_path, monkeypatch):
    store = _zstd_store(tmp_path)
    path = store.layout.payload_path(1, 0, 0)
    flip(path, _chunk_offset(path, "payload['input_ids']"))
    calls = []
    monkeypatch.setattr(compression, "_decompress_one", lambda view, task: calls.append(task))
    reason = store.reader.verify(1)[1]
    assert reason is not None and str(path) in reason and "checksum" in reason
    assert calls == []                                   # the checksum alone found it
    monkeypatch.undo()
    proc = subprocess.run([sys.executable, "-m", "skip_harness.cli", "verify", str(store.layout.root)],
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode != 0 and "checksum" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_damaged_chunk_is_a_corrupt_step_naming_its_field(tmp_path):
    store = _zstd_store(tmp_path)
    path = store.layout.payload_path(1, 0, 0)
    flip(path, _chunk_offset(path, "payload['input_ids']"))
    with pytest.raises(CodecError, match=r"payload\['input_ids'\]: zstd chunk 1 of 1"):
        payload_file.load(path)
    # the same damage behind a matching checksum (a bit flipped before it was hashed): never a crash
    commit = store.layout.commit_path(1)
    doc = json.loads(commit.read_text())
    size, digest = checksum_file(path)
    for entry in doc["files"]:
        if entry["rel"] == store.layout.payload_rel(0, 0):
            entry["checksum"] = digest
    commit.write_text(json.dumps(doc))
    status, reason, batches, _ = store.reader.read_served(1, 0)
    assert status == "corrupt" and batches == [] and "payload['input_ids']: zstd chunk" in reason and str(path) in reason


class Trainer:
    def __init__(self):
        self.generated = []

    def prepare_data(self, step, dispatch=True):
        pass

    def sample(self, step):
        self.generated.append(step)
        return load_bench().make_payload(4, seed=step)


def run_harness(dump: Path, steps: int = 3):
    harness = SkipHarness.create(settings={"enable": True, "dump_dir": str(dump), "compression": "zstd"},
                                 namespace={"experiment_name": "zstd", "project_name": "p"})
    trainer = Trainer()
    harness.wrap(trainer, sample="sample")
    served = {}
    try:
        for step in range(1, steps + 1):
            trainer.prepare_data(step)
            served[step] = trainer.sample(step)
        layout = harness.layout
    finally:
        harness.close()
    return trainer, layout, served


def test_a_run_finds_a_flipped_byte_cleans_the_step_and_regenerates_it(tmp_path):
    first, layout, batches = run_harness(tmp_path / "dump")
    assert first.generated == [1, 2, 3]
    payload = layout.payload_path(2, 0, 0)
    assert payload_file.stored_fields(payload)[0].compression == "zstd"
    flip(payload, _chunk_offset(payload, "payload['input_ids']"))
    again, _, served = run_harness(tmp_path / "dump")
    assert again.generated == [2]                        # 1 and 3 served; 2 cleaned and generated again
    for step in (1, 3):
        assert all(same(batches[step][k], served[step][k]) for k in batches[step] if isinstance(batches[step][k], torch.Tensor))
    assert open_store(layout).reader.verify(2)[1] is None           # rewritten whole


def test_format_2_files_still_load(tmp_path):
    payload = {"x": torch.arange(10), "s": ["a", {"b": (1.5, b"z")}], "f": torch.randn(3)}
    path = tmp_path / "v2.pt"
    with open(path, "wb") as f:
        tensorfile.write(f, codec.encode(payload))          # no names, no forms: a format-2 layout ...
    data = bytearray(path.read_bytes())
    hlen = struct.unpack_from("<Q", data, 16)[0]
    header = bytes(data[24:24 + hlen])
    now = f'"format":{codec.FORMAT_VERSION}'.encode()
    assert now in header and len(json.loads(header)["tensors"][0]) == 4
    struct.pack_into("<I", data, 8, 2)                      # ... marked as format 2
    data[24:24 + hlen] = header.replace(now, b'"format":2')
    path.write_bytes(bytes(data))
    out = payload_file.load(path)
    assert torch.equal(out["x"], payload["x"]) and out["s"] == payload["s"] and torch.equal(out["f"], payload["f"])
    payload_file.check(path)
    # a format-2 header cannot carry a stored form
    assert payload_file.stored_fields(path)[0].compression == "none"


@pytest.mark.slow
def test_demo_with_compression_zstd_reruns_from_the_cache_identically(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train_e2e import metrics, train, training_metrics

    train(tmp_path, "skip.rollout_tq.compression=zstd", run="first")
    train(tmp_path, "skip.rollout_tq.compression=zstd", run="again")
    first, again = metrics(tmp_path / "first"), metrics(tmp_path / "again")
    assert [r["cache"] for r in first] == ["miss"] * 4 and [r["cache"] for r in again] == ["hit"] * 4
    assert training_metrics(first) == training_metrics(again)
    payloads = sorted((tmp_path / "cache").rglob("tq_batch.pt"))
    assert payloads and all(any(f.compression == "zstd" for f in payload_file.stored_fields(p)) for p in payloads)
    # the same cache read by a run with compression off: files of any form are served
    train(tmp_path, run="plain")
    assert [r["cache"] for r in metrics(tmp_path / "plain")] == ["hit"] * 4


def test_a_forked_child_decompresses_in_parallel_too(tmp_path):

    payload = {"ids": torch.arange(3 << 20) % 1000, "f": torch.zeros(3 << 20)}
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        codec.save_to(f, payload, ZSTD)
    calls = []
    real = compression._decompress_pool
    compression._decompress_pool = lambda: calls.append(1) or real()
    try:
        assert same(payload_file.load(path)["ids"], payload["ids"])    # the parent's pool started
    finally:
        compression._decompress_pool = real
    assert calls, "not decompressed in parallel"
    pid = os.fork()
    if pid == 0:                                                       # pragma: no cover - the child
        ok = False
        try:
            ok = same(payload_file.load(path)["ids"], payload["ids"])
        finally:
            os._exit(0 if ok else 1)
    import signal
    import time
    deadline = time.monotonic() + 20
    while True:                                   # a child whose pool has no threads would hang: bounded
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung decompressing (its copy of the pool has no threads)")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_show_gives_each_fields_stored_dtype_and_ratio(tmp_path, capsys):
    from skip_harness.cli import main
    store = _zstd_store(tmp_path)
    code = main(["show", str(store.layout.root), "1", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    stored = {f["name"]: f for f in json.loads(out)["stored"]}
    ids = stored["payload['input_ids']"]
    assert ids["dtype"] == "int64" and ids["stored_dtype"] == "int32" and ids["compression"] == "zstd"
    assert ids["logical_bytes"] == 8 * 8 * 4096 and 0 < ids["ratio"] < 0.5
    assert stored["payload['attention_mask']"]["stored_dtype"] == "uint8"
    assert sum(f["stored_bytes"] for f in stored.values()) < sum(f["logical_bytes"] for f in stored.values())
    code = main(["show", str(store.layout.root), "1"])
    out, err = capsys.readouterr()
    assert code == 0 and "stored as" in out and "int32" in out and "zstd" in out


def test_a_header_asking_for_more_memory_than_there_is_is_a_codec_error(tmp_path):
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, {"z": torch.zeros(1 << 20, dtype=torch.int64)}, ZSTD)
    data = path.read_bytes()
    hlen = struct.unpack_from("<Q", data, 16)[0]
    doc = json.loads(data[24:24 + hlen])
    entry = doc["tensors"][0]
    # one chunk claiming 2**50 elements (a damaged or hostile header; the sizes agree with each other)
    entry[1] = [1 << 50]
    entry[4]["zstd"] = [[entry[3], (1 << 50) * 1]]
    for bad_doc in (doc,):
        header = json.dumps(bad_doc, separators=(",", ":")).encode()
        bad = tmp_path / "bad.pt"
        bad.write_bytes(data[:16] + struct.pack("<Q", len(header)) + header + bytes(-(24 + len(header)) % 64)
                        + data[-(-(24 + hlen) // 64) * 64:])
        for fn in (payload_file.load, payload_file.check):   # refused from the header, before any allocation
            with pytest.raises(CodecError, match=f"{bad}: malformed tensor entry"):
                fn(bad)


def test_ls_shows_stored_and_full_width_bytes(tmp_path, capsys):
    from skip_harness.cli import main
    store = _zstd_store(tmp_path, steps=(1, 2))
    plain = open_store(NamespaceKey("plain", "proj", 8, 1, 2, 2).layout(tmp_path / "dump"))
    plain.writer.commit(1, plain.writer.write_inner(1, 0, 0, load_bench().make_payload(8, seed=1), {}), None)
    code = main(["ls", str(tmp_path / "dump"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    by_path = {ns["path"]: ns for ns in json.loads(out)["namespaces"]}
    zstd, raw = by_path[str(store.layout.root)], by_path[str(plain.layout.root)]
    full = [store.reader.read_meta(s, 0, 0)["logical_bytes"] for s in (1, 2)]
    for step, logical in zip(zstd["steps"], full):
        assert step["logical_bytes"] - step["bytes"] == logical - store.reader.read_meta(step["step"], 0, 0)["bytes"]
    assert zstd["total_logical_bytes"] > 3 * zstd["total_bytes"]
    assert raw["total_logical_bytes"] == raw["total_bytes"]            # stored raw: the same figure
    code = main(["ls", str(tmp_path / "dump")])
    out, _ = capsys.readouterr()
    assert code == 0 and " of " in out                                  # '11.6 MiB of 112.0 MiB'
