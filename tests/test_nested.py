"""codec: verl's real batches -- jagged and strided nested tensors inside TensorDicts beside
NonTensorStack fields (verl V1, built with verl's own `list_of_dict_to_tensordict`), and verl V0's
DataProto -- stored without pickle and served back equal: through a file, the store's hit path
(views of a pool buffer), `read_inner`, the merge of a step's mini-batches, `show` and `export`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from skip_harness.store.open import open_store
from skip_harness import codec
from skip_harness.cli import main
from skip_harness.errors import CodecError
from skip_harness.store import payload_file
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.stepstore import StepStore

tensordict = pytest.importorskip("tensordict")


def subprocess_env() -> dict:
    """This environment, with the checkout first on the path (as tests/conftest.py's helper; not
    imported from there: another conftest module of the suite may take the name)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])] + [p for p in [env.get("PYTHONPATH")] if p])
    return env

JAGGED = ("prompts", "responses", "input_ids", "response_mask")


def verl_rows(n: int, seed: int) -> list:
    """Trajectories as verl's agent loop hands them to `list_of_dict_to_tensordict`."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for j in range(n):
        p, r = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        prompt, response = torch.randint(0, 151_936, (p,), generator=g), torch.randint(0, 151_936, (r,), generator=g)
        rows.append({
            "prompts": prompt, "responses": response, "input_ids": torch.cat([prompt, response]),
            "response_mask": torch.randint(0, 2, (r,), generator=g),
            "rollout_log_probs": torch.randn(r, generator=g).to(torch.bfloat16),
            "rewards": torch.tensor(float(j)),                      # same shape in every row: stacked
            "messages": [{"role": "user", "content": f"q{seed}.{j}"}] + ([{"role": "assistant", "content": "a"}] if j % 2 else []),
            "uid": f"uid-{seed}-{j}",
        })
    return rows


def verl_batch(n: int = 5, seed: int = 0):
    verl_td = pytest.importorskip("verl.utils.tensordict_utils")
    td = verl_td.list_of_dict_to_tensordict(verl_rows(n, seed))
    verl_td.assign_non_tensor(td, temperature=1.0, sampling={"top_p": 0.9, "n": n})   # NonTensorData
    return td


def v1_payload(n: int = 5, seed: int = 0) -> dict:
    """What verl's V1 trainer torch.saves for a mini-batch."""
    return {"tensordict": verl_batch(n, seed), "tags": [{"status": "ready", "j": j} for j in range(n)],
            "keys": [f"k{seed}_{j}" for j in range(n)], "global_steps": seed}


def assert_nested_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert b.is_nested and a.layout == b.layout and a.dtype == b.dtype and a.device == b.device
    if a.layout == torch.jagged:
        assert b._ragged_idx == a._ragged_idx
        assert torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
        assert (a.lengths() is None) == (b.lengths() is None)
        if a.lengths() is not None:
            assert torch.equal(a.lengths(), b.lengths())
    ra, rb = a.unbind(0), b.unbind(0)
    assert len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb))


def assert_td_equal(a, b) -> None:
    assert type(b) is type(a) and b.batch_size == a.batch_size and set(b.keys()) == set(a.keys())
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        if isinstance(x, torch.Tensor) and x.is_nested:
            assert_nested_equal(x, y)
        elif isinstance(x, torch.Tensor):
            assert type(y) is torch.Tensor and x.dtype == y.dtype and torch.equal(x, y)
        elif type(x).__name__ == "NonTensorData":
            assert type(y) is type(x) and y.data == x.data
        else:
            assert type(y) is type(x) and y.tolist() == x.tolist()


def roundtrip(tmp_path, payload, mmap=True):
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, payload)
    return payload_file.load(path, mmap=mmap), path


# --------------------------------------------------------------------------------------------
# the codec


def test_verl_v1_batch_round_trips_without_pickle(tmp_path):
    payload = v1_payload()
    td = payload["tensordict"]
    assert all(td.get(k).layout == torch.jagged for k in JAGGED)          # verl made them jagged
    assert type(td.get("messages")).__name__ == "NonTensorStack"
    for mmap in (True, False):
        out, path = roundtrip(tmp_path, payload, mmap)
        assert_td_equal(td, out["tensordict"])
        assert out["tags"] == payload["tags"] and out["keys"] == payload["keys"] and out["global_steps"] == 0
    raw = path.read_bytes()
    assert raw.startswith(codec.MAGIC) and b"PK\x03\x04" not in raw[:8]  # our format, not torch.save
    payload_file.check(path)


def test_jagged_variants_and_strided_nested_tensors(tmp_path):
    verl_td = pytest.importorskip("verl.utils.tensordict_utils")
    rows2d = [torch.randn(n, 3) for n in (2, 5, 1)]
    base = torch.arange(24).view(3, 8)
    payload = {
        "ragged_last": torch.nested.as_nested_tensor([torch.randn(3, n) for n in (2, 4)], layout=torch.jagged),
        "ragged_1_of_2d": verl_td.nested_tensor_from_tensor_list(rows2d, ragged_idx=1),
        "with_lengths": torch.nested.narrow(base, 1, torch.tensor([0, 1, 0]), torch.tensor([2, 3, 1]),
                                            layout=torch.jagged),
        "bf16": torch.nested.as_nested_tensor([torch.randn(2), torch.randn(6)], layout=torch.jagged).to(torch.bfloat16),
        "strided": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
    }
    assert payload["with_lengths"].lengths() is not None
    out, _ = roundtrip(tmp_path, payload)
    for k, v in payload.items():
        assert_nested_equal(v, out[k])


def test_cuda_origin_is_recorded_and_restored_when_present(tmp_path):
    nt = torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    setattr(nt, codec.ORIGIN_ATTR, "cuda:0")        # what encoding records of a CUDA tensor
    enc = codec.encode({"x": nt})
    assert enc["x"][codec.TAG] == "jagged" and enc["x"]["device"] == "cuda:0"
    out, _ = roundtrip(tmp_path, {"x": nt})
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert out["x"].device.type == want and torch.equal(out["x"].values().cpu(), nt.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_comes_back_on_cuda(tmp_path):  # pragma: no cover - CPU machines
    td = verl_batch().to("cuda")
    out, _ = roundtrip(tmp_path, {"td": td})
    assert out["td"].get("prompts").device.type == "cuda"
    assert_td_equal(td.to("cpu"), out["td"].to("cpu"))


def test_malformed_jagged_record_is_a_codec_error(tmp_path):
    nt = torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    enc = codec.encode({"x": nt})
    for field, bad in (("ragged_idx", 7), ("offsets", torch.tensor([0, 9, 2])), ("values", "nope"),
                       ("offsets", torch.tensor([0.0, 1.0]))):
        broken = {"x": dict(enc["x"], **{field: bad})}
        with pytest.raises(CodecError, match=r"payload\['x'\]"):
            codec.decode(broken)


def test_merge_concatenates_jagged_tensordicts_row_by_row():
    a, b = verl_batch(3, 1), verl_batch(4, 2)
    merged = codec.merge([a, b])
    assert merged.batch_size == torch.Size([7])
    for k in JAGGED:
        rows = list(a.get(k).unbind(0)) + list(b.get(k).unbind(0))
        got = merged.get(k).unbind(0)
        assert merged.get(k).layout == torch.jagged and len(got) == 7
        assert all(torch.equal(x, y) for x, y in zip(rows, got))
    assert merged.get("uid").tolist() == a.get("uid").tolist() + b.get("uid").tolist()
    assert torch.equal(merged.get("rewards"), torch.cat([a.get("rewards"), b.get("rewards")]))
    top = codec.merge([a.get("prompts"), b.get("prompts")])
    assert_nested_equal(merged.get("prompts"), top)
    with pytest.raises(CodecError, match="nested"):
        codec.merge([a.get("prompts"), torch.zeros(2)])


def test_merge_of_a_one_row_mini_batch_keeps_the_first_ragged_dimension():
    a = torch.nested.as_nested_tensor([torch.randn(3, n) for n in (2, 4)], layout=torch.jagged)
    b = torch.nested.as_nested_tensor([torch.randn(3, 5)], layout=torch.jagged)     # torch makes dim 1 ragged
    assert (a._ragged_idx, b._ragged_idx) == (2, 1)
    merged = codec.merge([a, b])
    assert merged._ragged_idx == 2 and [r.shape for r in merged.unbind(0)] == [(3, 2), (3, 4), (3, 5)]
    with pytest.raises(CodecError, match="cannot concatenate nested tensors"):
        codec.merge([a, torch.nested.as_nested_tensor([torch.randn(4, 2)], layout=torch.jagged)])


# --------------------------------------------------------------------------------------------
# verl V0's DataProto


def dataproto(n: int = 4, seed: int = 0):
    protocol = pytest.importorskip("verl.protocol")
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(seed)
    prompts = np.empty(n, dtype=object)
    for j in range(n):
        prompts[j] = [{"role": "user", "content": f"q{seed}.{j}"}]
    return protocol.DataProto.from_dict(
        tensors={"input_ids": torch.randint(0, 151_936, (n, 6), generator=g), "attention_mask": torch.ones(n, 6, dtype=torch.bool)},
        non_tensors={"raw_prompt": prompts, "uid": np.array([f"u{j}" for j in range(n)], dtype=object),
                     "reward_extra": np.array([{"acc": float(j)} if j % 2 else None for j in range(n)], dtype=object),
                     "index": np.arange(n)},
        meta_info={"global_steps": seed, "temperature": 1.0, "do_sample": True},
    )


def test_dataproto_round_trips_without_pickle(tmp_path):
    dp = dataproto()
    out, path = roundtrip(tmp_path, dp)
    assert type(out) is type(dp) and out.meta_info == dp.meta_info
    assert_td_equal(dp.batch, out.batch)
    assert set(out.non_tensor_batch) == set(dp.non_tensor_batch)
    for k, v in dp.non_tensor_batch.items():
        assert out.non_tensor_batch[k].dtype == v.dtype and out.non_tensor_batch[k].tolist() == v.tolist()
    assert b"verl.protocol.DataProto" in path.read_bytes()[:4096]
    merged = codec.merge([dp, out])
    assert len(merged) == 8 and merged.non_tensor_batch["uid"].tolist() == dp.non_tensor_batch["uid"].tolist() * 2


def test_dataproto_element_the_codec_cannot_hold_is_refused_naming_the_key():
    np = pytest.importorskip("numpy")
    dp = dataproto()
    dp.non_tensor_batch["handle"] = np.array([object() for _ in range(4)], dtype=object)
    with pytest.raises(CodecError, match=r"non_tensor_batch\['handle'\]\[0\]: unsupported type"):
        codec.plan(dp)


@pytest.mark.verl  # imports verl (in a subprocess)
def test_verl_is_imported_only_for_a_dataproto(tmp_path):
    pytest.importorskip("verl")
    dp_path = tmp_path / "dp.pt"
    with open(dp_path, "wb") as f:
        codec.save_to(f, dataproto())
    script = textwrap.dedent(f"""
        import sys, torch
        from skip_harness import codec
        from skip_harness.store import payload_file
        with open({str(tmp_path / 'plain.pt')!r}, "wb") as f:
            codec.save_to(f, {{"x": torch.arange(3)}})
        payload_file.load({str(tmp_path / 'plain.pt')!r})
        payload_file.check({str(dp_path)!r})        # checking builds nothing: no import either
        assert "verl" not in sys.modules, "verl imported for a plain payload"
        out = payload_file.load({str(dp_path)!r})
        assert type(out).__module__ == "verl.protocol", type(out)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=subprocess_env())
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# the store (hit path), show and export


@pytest.fixture
def jagged_cache(tmp_path):
    pytest.importorskip("verl")
    store = open_store(NamespaceKey("verl", "proj", 9, 1, 2, 2, K=2).layout(tmp_path / "dump"))
    payloads = [v1_payload(3, 1), v1_payload(4, 2)]
    entries = []
    for inner, p in enumerate(payloads):
        entries += store.writer.write_inner(1, inner, 0, p, {"gen_s": 0.1})
    store.writer.commit(1, entries, None)
    return store, payloads


def test_hit_path_and_read_inner_serve_jagged_batches(jagged_cache):
    store, payloads = jagged_cache
    status, reason, batches, metas = store.reader.read_served(1, 0)
    assert status == "complete" and reason is None and len(batches) == 2
    for want, got in zip(payloads, batches):
        assert_td_equal(want["tensordict"], got["tensordict"])
        assert got["keys"] == want["keys"] and got["tags"] == want["tags"]
    served = batches[0]["tensordict"].get("prompts")
    del batches, metas                          # the pool buffer outlives the lease while views exist
    store.pool.acquire(1 << 20).release()
    assert_nested_equal(payloads[0]["tensordict"].get("prompts"), served)
    assert_td_equal(payloads[1]["tensordict"], store.reader.read_inner(1, 1, 0)["tensordict"])
    merged = codec.merge(store.reader.read_step(1, 0))
    assert merged["tensordict"].batch_size == torch.Size([7]) and merged["keys"] == payloads[0]["keys"] + payloads[1]["keys"]
    assert store.reader.verify(1)[1] is None


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_show_describes_jagged_fields(jagged_cache, capsys):
    store, payloads = jagged_cache
    code, out, err = run_cli(capsys, "show", str(store.layout.root), "1", "1", "--json", "--head", "2")
    assert code == 0, err
    doc = json.loads(out)
    rows = {r["key"]: r for r in doc["structure"]}
    td = payloads[1]["tensordict"]
    lens = [int(r.shape[0]) for r in td.get("responses").unbind(0)]
    assert rows["tensordict.responses"]["type"] == "NestedTensor(jagged)"
    assert rows["tensordict.responses"]["shape"] == f"(4, {min(lens)}..{max(lens)})"
    assert rows["tensordict.responses"]["dtype"] == "int64"
    assert rows["tensordict.responses"]["bytes"] == 8 * sum(lens) + 8 * 5
    assert rows["tensordict.uid"]["type"] == "NonTensorStack" and rows["tensordict.uid"]["shape"] == "(4,)"
    assert "uid-2-0" in rows["tensordict.uid"]["value"]
    head = {r["key"]: r["values"] for r in doc["head"]} if isinstance(doc.get("head"), list) else doc["head"]
    assert str(td.get("responses").unbind(0)[0].tolist()) in str(head["tensordict.responses"])


def test_export_writes_one_list_per_row_for_a_jagged_field(jagged_cache, tmp_path, capsys):
    store, payloads = jagged_cache
    out = tmp_path / "rows.jsonl"
    code, _o, err = run_cli(capsys, "export", str(store.layout.root), "-o", str(out))
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = [r.tolist() for p in payloads for r in p["tensordict"].get("responses").unbind(0)]
    assert [r["tensordict.responses"] for r in rows] == want
    assert [r["tensordict.uid"] for r in rows] == [u for p in payloads for u in p["tensordict"].get("uid").tolist()]
    assert [r["tensordict.messages"] for r in rows] == [m for p in payloads for m in p["tensordict"].get("messages").tolist()]
    pq = pytest.importorskip("pyarrow.parquet")
    pout = tmp_path / "rows.parquet"
    code, _o, err = run_cli(capsys, "export", str(store.layout.root), "-o", str(pout))
    assert code == 0, err
    assert pq.read_table(pout).column("tensordict.responses").to_pylist() == want


# --------------------------------------------------------------------------------------------
# issue 15 item 5: a file that is not a payload


@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"just some text\nnot a payload\n", b""],
                         ids=["random-bytes", "text", "empty"])
def test_show_on_a_file_that_is_not_a_payload(tmp_path, capsys, content):
    path = tmp_path / "junk.pt"
    path.write_bytes(content)
    code, out, err = run_cli(capsys, "show", str(path))
    assert code != 0
    assert "not a skip_harness or torch payload file" in err and "pickled code" not in err
    with pytest.raises(CodecError, match="not a skip_harness or torch payload file"):
        payload_file.load(path)
