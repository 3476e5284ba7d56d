"""import-verl: caches built with torch and tensordict exactly as verl's rollout_tq skip writes them
(`torch.save({"tensordict", "tags", "keys", "global_steps"})` + meta.json), in both of verl's layouts,
converted into committed skip_harness steps; refused without --trust; incomplete verl steps reported."""
from __future__ import annotations

import json
import uuid

import pytest
import torch

from skip_harness.store.open import open_namespace, open_store
from skip_harness.cli import main
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.scan import scan_namespace
from skip_harness.store.stepstore import StepStore

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def verl_batch(step: int, inner: int, prompts: int = 2, n: int = 2):
    """What verl's RolloutTqSkip.prepare_data saves: the TensorDict tq.kv_batch_get returns for the
    sampled keys, their tags, the keys ({uid}_{session}_{index}) and global_steps."""
    g = torch.Generator().manual_seed(10 * step + inner)
    rows = prompts * n
    td = TensorDict({
        "input_ids": torch.randint(0, 100, (rows, 7), generator=g),
        "attention_mask": torch.ones(rows, 7, dtype=torch.int64),
        "responses": torch.randint(0, 100, (rows, 4), generator=g),
        "rm_scores": torch.rand(rows, 4, generator=g),
        "old_log_probs": torch.randn(rows, 4, generator=g).to(torch.bfloat16),
    }, batch_size=[rows])
    td["raw_prompt"] = tensordict.NonTensorStack(*[f"prompt {step}.{inner}.{j}" for j in range(rows)])
    keys = [f"{uuid.UUID(int=1000 * step + 10 * inner + p).hex}_{s}_0" for p in range(prompts) for s in range(n)]
    tags = [{"status": "finished", "global_steps": step, "min_global_steps": step, "max_global_steps": step}
            for _ in keys]
    return {"tensordict": td, "tags": tags, "keys": keys, "global_steps": step}


def write_verl_step(step_dir, payload):
    """verl: step_dir.mkdir; torch.save(save_payload, step_dir / 'tq_batch.pt'); meta.json."""
    step_dir.mkdir(parents=True, exist_ok=True)
    torch.save(payload, step_dir / "tq_batch.pt")
    (step_dir / "meta.json").write_text(json.dumps({"global_steps": payload["global_steps"],
                                                    "num_trajectories": len(payload["keys"])}))


@pytest.fixture
def verl_cache(tmp_path):
    """exp_proj/GBS4_N2_in7_out4 holding flat steps 1, 2 (before verl #7032), an incomplete flat step 3
    (no meta.json), and exp2_proj/... holding K = 2 steps 1, 2 ({step}/{i}/) plus step 3 with inner 0 only."""
    root = tmp_path / "verl"
    ns1 = root / "exp_proj" / "GBS4_N2_in7_out4"
    payloads = {}
    for step in (1, 2):
        payloads[("flat", step, 0)] = verl_batch(step, 0)
        write_verl_step(ns1 / str(step), payloads[("flat", step, 0)])
    (ns1 / "3").mkdir()
    torch.save(verl_batch(3, 0), ns1 / "3" / "tq_batch.pt")
    ns2 = root / "my_exp_proj" / "GBS8_N2_in7_out4"
    for step in (1, 2, 3):
        for inner in ((0, 1) if step < 3 else (0,)):
            payloads[("k2", step, inner)] = verl_batch(step, inner)
            write_verl_step(ns2 / str(step) / str(inner), payloads[("k2", step, inner)])
    return root, payloads


def assert_same(loaded, saved):
    assert loaded["keys"] == saved["keys"] and loaded["tags"] == saved["tags"]
    assert loaded["global_steps"] == saved["global_steps"]
    td, want = loaded["tensordict"], saved["tensordict"]
    assert isinstance(td, TensorDict) and td.batch_size == want.batch_size
    tensors = [k for k in want.keys() if k != "raw_prompt"]
    assert sorted(td.keys()) == sorted(want.keys())
    for k in tensors:
        assert td[k].dtype == want[k].dtype and torch.equal(td[k], want[k]), k
    # the non-tensor entry stays in the TensorDict, as verl stored it (no pickle)
    assert isinstance(td.get("raw_prompt"), tensordict.NonTensorStack)
    assert td.get("raw_prompt").tolist() == want.get("raw_prompt").tolist()
    assert "non_tensor" not in loaded


def test_without_trust_it_refuses_and_says_why(verl_cache, tmp_path, capsys):
    root, _ = verl_cache
    dump = tmp_path / "dump"
    code, out, err = run(capsys, "import-verl", str(root), str(dump))
    assert code == 2 and out == ""
    assert "--trust" in err and "pickle" in err and "run code" in err and len(err.strip().splitlines()) == 1
    assert not dump.exists()


def test_dry_run_lists_without_loading(verl_cache, tmp_path, capsys, monkeypatch):
    from skip_harness.cli import import_verl as verl_import

    root, _ = verl_cache
    monkeypatch.setattr(verl_import, "load_trusted", lambda path: pytest.fail(f"loaded {path} in a dry run"))
    code, out, err = run(capsys, "import-verl", str(root), str(tmp_path / "dump"), "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["dry_run"] is True          # two verl steps would fail: incomplete
    assert sorted(d["step"] for d in doc["failed"]) == [3, 3]
    assert sorted((d["namespace"].split("/")[-1], d["step"]) for d in doc["converted"]) == [
        ("GBS4_N2_in7_out4", 1), ("GBS4_N2_in7_out4", 2), ("GBS8_N2_in7_out4_K2_W1", 1), ("GBS8_N2_in7_out4_K2_W1", 2)]
    assert not (tmp_path / "dump").exists()


def test_converts_both_layouts_into_committed_steps(verl_cache, tmp_path, capsys):
    root, payloads = verl_cache
    dump = tmp_path / "dump"
    code, out, err = run(capsys, "import-verl", str(root), str(dump), "--trust")
    assert code == 1, err                                           # two verl steps could not be converted
    assert "weights_only=False" in err and "--trust" in err          # it says what trusting means
    assert "converted 4 steps, kept 0, failed 2" in out
    failed = [r for r in err.splitlines() if "was not converted" in r and "incomplete verl step" in r]
    assert len(failed) == 2 and all("error: step 3 (" in line for line in failed), err
    flat = open_store(NamespaceKey("exp", "proj", 4, 2, 7, 4).layout(dump))
    k2 = open_store(NamespaceKey("my_exp", "proj", 8, 2, 7, 4, K=2).layout(dump))
    assert k2.layout.root.name == "GBS8_N2_in7_out4_K2_W1" and k2.layout.root.parent.name == "my_exp_proj"
    assert {s.step: s.status for s in scan_namespace(flat.layout, open_namespace(flat.layout)).steps} == {1: "complete", 2: "complete"}
    assert {s.step: s.status for s in scan_namespace(k2.layout, open_namespace(k2.layout)).steps} == {1: "complete", 2: "complete"}
    for step in (1, 2):
        assert_same(flat.reader.read_inner(step, 0, 0), payloads[("flat", step, 0)])
        for inner in (0, 1):
            assert_same(k2.reader.read_inner(step, inner, 0), payloads[("k2", step, inner)])
        meta = k2.reader.read_meta(step, 1, 0)
        assert meta["source"] == "verl" and meta["verl_meta"]["num_trajectories"] == 4
    # the result verifies (sizes, checksums, safe load) and a second import changes nothing
    assert run(capsys, "verify", str(dump))[0] == 0
    code, out, _ = run(capsys, "import-verl", str(root), str(dump), "--trust", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["converted"] == [] and sum("already in" in s["reason"] for s in doc["kept"]) == 4
    assert len(doc["failed"]) == 2


def test_the_original_verl_files_are_refused_by_safe_loading(verl_cache, capsys):
    """Why import-verl exists: skip_harness reads the verl cache as unverified steps and refuses to
    unpickle them; verify says so and points at import-verl."""
    root, _ = verl_cache
    code, out, _ = run(capsys, "verify", str(root / "exp_proj"), "--json")
    steps = json.loads(out)["namespaces"][0]["steps"]
    assert code == 1 and [s["status"] for s in steps[:2]] == ["corrupt", "corrupt"]
    assert "import-verl" in steps[0]["reason"] and "weights_only=False" not in steps[0]["reason"]


def test_a_payload_that_disagrees_with_its_meta_is_skipped_and_nothing_half_written(verl_cache, tmp_path, capsys):
    root, _ = verl_cache
    meta = root / "exp_proj" / "GBS4_N2_in7_out4" / "2" / "meta.json"
    meta.write_text(json.dumps({"global_steps": 2, "num_trajectories": 99}))
    dump = tmp_path / "dump"
    code, out, _ = run(capsys, "import-verl", str(root / "exp_proj"), str(dump), "--trust", "--json")
    doc = json.loads(out)
    assert code == 1 and [d["step"] for d in doc["converted"]] == [1]
    assert any("says 99" in s["reason"] and s["step"] == 2 for s in doc["failed"])
    flat = NamespaceKey("exp", "proj", 4, 2, 7, 4).layout(dump)
    assert [s.step for s in scan_namespace(flat, open_namespace(flat)).steps] == [1]


def test_into_its_own_directory_is_refused(verl_cache, capsys):
    root, _ = verl_cache
    code, out, err = run(capsys, "import-verl", str(root), str(root), "--trust")
    assert code == 2 and "another DUMP_DIR" in err


def test_a_locked_target_namespace_is_refused(verl_cache, tmp_path, capsys, lock_holder):
    root, _ = verl_cache
    dump = tmp_path / "dump"
    target = NamespaceKey("exp", "proj", 4, 2, 7, 4).layout(dump)
    target.root.mkdir(parents=True)
    holder = lock_holder(target)
    code, out, err = run(capsys, "import-verl", str(root), str(dump), "--trust")
    assert code == 3 and f"pid {holder.pid}" in err
    assert scan_namespace(target, open_namespace(target)).steps == ()
    k2 = NamespaceKey("my_exp", "proj", 8, 2, 7, 4, K=2).layout(dump)
    assert len(scan_namespace(k2, open_namespace(k2)).steps) == 2                  # the other namespace was converted


def test_no_verl_cache_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, "import-verl", str(tmp_path / "empty"), str(tmp_path / "dump"), "--trust")
    assert code == 2 and "no verl cache" in err and len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, "import-verl", str(tmp_path / "missing"), str(tmp_path / "dump"), "--trust")
    assert code == 2 and str(tmp_path / "missing") in err


def test_the_current_layout_with_one_inner_directory_is_k1(tmp_path, capsys):
    ns = tmp_path / "verl" / "one_proj" / "GBS2_N2_in7_out4"
    saved = verl_batch(5, 0, prompts=1)
    write_verl_step(ns / "5" / "0", saved)
    dump = tmp_path / "dump"
    code, out, err = run(capsys, "import-verl", str(tmp_path / "verl"), str(dump), "--trust")
    assert code == 0, err
    store = open_store(NamespaceKey("one", "proj", 2, 2, 7, 4).layout(dump))
    assert store.layout.root.name == "GBS2_N2_in7_out4"
    assert {s.step: s.status for s in scan_namespace(store.layout, open_namespace(store.layout)).steps} == {5: "complete"}
    assert store.layout.payload_path(5, 0, 0) == store.layout.step_dir(5) / "tq_batch.pt"
    assert_same(store.reader.read_inner(5, 0, 0), saved)
