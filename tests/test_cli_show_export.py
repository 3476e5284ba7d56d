"""cli: `skip-harness show` (structure, meta, fingerprint, --head; never runs code from a file) and
`skip-harness export` (Parquet / JSON lines read back by pandas, pyarrow and datasets in a process
that cannot import skip_harness), on caches written with StepStore."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import write_legacy
from skip_harness.store.open import open_store
from skip_harness.cli import main
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.stepstore import StepStore

tensordict = pytest.importorskip("tensordict")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def rollout(step: int, inner: int, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(100 * step + inner)
    return {
        "responses": torch.randint(0, 50, (n, 5), generator=g),
        "old_logprobs": torch.randn(n, 5, generator=g),
        "rewards": torch.rand(n, generator=g),
        "mask": torch.rand(n, 5, generator=g) > 0.5,
        "extra": {"scores": torch.randn(n, 2, 3, generator=g)},
        "texts": [f"s{step}i{inner}t{j}" for j in range(n)],
        "step": torch.tensor(step),
        "note": "demo",
        "temperature": 0.7,
    }


@pytest.fixture
def cache(tmp_path):
    dump = tmp_path / "dump"
    store = open_store(NamespaceKey("exp", "proj", 12, 2, 4, 5, K=2).layout(dump))
    fp = Fingerprint({"trainer.v1.trainer_mode": "separate_async", "seed": 3})
    payloads = {}
    for step in (1, 2, 3):
        entries = []
        for inner in (0, 1):
            payloads[(step, inner)] = rollout(step, inner)
            entries += store.writer.write_inner(step, inner, 0, payloads[(step, inner)], {"gen_s": 0.5 + step})
        store.writer.commit(step, entries, fp)
    td_store = open_store(NamespaceKey("tdexp", "proj", 4, 1, 3, 3).layout(dump))
    td = tensordict.TensorDict({"ids": torch.arange(12).reshape(4, 3), "r": torch.ones(4)}, batch_size=[4])
    td_store.writer.commit(1, td_store.writer.write_inner(1, 0, 0, td, {}), None)
    return dump, store, payloads, td_store, td


def rows_of(text):
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines()
            if line.strip().startswith("│")]


# --------------------------------------------------------------------------------------------
# show


def test_show_structure_meta_fingerprint_and_head(cache, capsys):
    dump, store, payloads, *_ = cache
    code, out, err = run(capsys, "show", str(store.layout.root), "2", "1", "--head", "2")
    assert code == 0, err
    rows = {}
    for r in rows_of(out):
        rows.setdefault(r[0], r)          # the structure table comes first, the --head table after it
    assert rows["responses"][1:4] == ["Tensor", "(6, 5)", "int64"] and rows["responses"][4] == "240 B"
    assert rows["mask"][3] == "bool" and rows["extra.scores"][2] == "(6, 2, 3)"
    assert rows["extra"][1:3] == ["dict", "1 keys"] and rows["extra"][4] == "144 B"   # a container: its items' bytes
    assert rows["texts"][1] == "list[str]" and rows["step"][5] == "2" and rows["note"][5] == "'demo'"
    assert str(store.layout.payload_path(2, 1, 0)) in out
    assert "2   inner index 1   rank 0" in out and "complete" in out
    assert "2.500s" in out                                   # generation time from the meta
    assert "separate_async" in out and "seed=3" in out       # fingerprint
    assert '"gen_s": 2.5' in out                             # the meta itself
    head = {r[0]: r[1] for r in rows_of(out) if r[0] in ("rewards", "texts") and len(r) == 2}
    expected = payloads[(2, 1)]["rewards"][:2].tolist()
    assert json.loads(head["rewards"]) == pytest.approx(expected)
    assert head["texts"] == "['s2i1t0', 's2i1t1']"


def test_show_defaults_to_the_newest_complete_step_and_takes_a_file(cache, capsys):
    dump, store, payloads, td_store, td = cache
    code, out, _ = run(capsys, "show", str(store.layout.root), "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["step"], doc["inner_index"]) == (3, 0)
    assert doc["fingerprint"]["values"]["seed"] == 3
    code, out, _ = run(capsys, "show", str(td_store.layout.payload_path(1, 0, 0)), "--json", "--head", "1")
    doc = json.loads(out)
    assert code == 0 and doc["step"] == 1 and doc["namespace"] == str(td_store.layout.root)
    kinds = {r["key"]: (r["type"], r["shape"]) for r in doc["structure"]}
    assert kinds["(payload)"] == ("TensorDict", "(4,)") and kinds["ids"] == ("Tensor", "(4, 3)")
    assert doc["head"]["ids"] == "[[0, 1, 2]]"
    # a step directory works too
    code, out, _ = run(capsys, "show", str(store.layout.step_dir(1)), "--json")
    assert code == 0 and json.loads(out)["step"] == 1


def test_show_never_runs_code_from_the_file(tmp_path, capsys):
    marker = tmp_path / "code_ran"

    class Evil:
        def __reduce__(self):
            import pathlib

            return (pathlib.Path.touch, (marker,))

    lay = NamespaceKey("e", "p", 4, 1, 3, 3).layout(tmp_path / "dump")
    write_legacy(lay, 1)
    torch.save({"x": Evil()}, lay.payload_path(1, 0, 0))   # an older cache's pickle that runs code
    (lay.meta_path(1, 0, 0)).write_text(json.dumps({"global_steps": 1, "num_trajectories": 4}))
    for target in (lay.root, lay.payload_path(1, 0, 0)):
        code, out, err = run(capsys, "show", str(target))
        assert code == 1 and out == ""
        assert len(err.strip().splitlines()) == 1 and str(lay.payload_path(1, 0, 0)) in err
        assert "weights_only=False" not in err and "import-verl" in err
    assert not marker.exists()


@pytest.mark.parametrize("argv,needle", [
    (["nowhere"], "nowhere"),
    (["{ns}", "9"], "no step 9"),
    (["{ns}", "1", "5"], "INNER 5"),
    (["{ns}", "--rank", "3"], "--rank 3"),
    (["{dump}"], "holds 2 namespaces"),
])
def test_show_bad_arguments_are_one_line_errors(cache, capsys, tmp_path, argv, needle):
    dump, store, *_ = cache
    argv = [a.format(ns=store.layout.root, dump=dump) if a != "nowhere" else str(tmp_path / a) for a in argv]
    code, out, err = run(capsys, "show", *argv)
    assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# export

READER = textwrap.dedent(
    """
    import json, sys
    sys.modules["skip_harness"] = None          # this reader must not need skip_harness at all
    import pandas as pd, pyarrow.parquet as pq, datasets
    path, fmt = sys.argv[1], sys.argv[2]
    if fmt == "parquet":
        t = pq.read_table(path)
        df = pd.read_parquet(path)
        ds = datasets.load_dataset("parquet", data_files=path, split="train")
        assert t.num_rows == len(df) == len(ds), (t.num_rows, len(df), len(ds))
        assert t.column_names == list(df.columns) == ds.column_names
        rows = ds.to_list()
        assert rows == t.to_pylist(), "datasets and pyarrow disagree"
        first = df.iloc[0].to_dict()
        assert list(first["responses"]) == rows[0]["responses"], "pandas and datasets disagree"
    else:
        df = pd.read_json(path, lines=True)
        ds = datasets.load_dataset("json", data_files=path, split="train")
        rows = [json.loads(line) for line in open(path)]
        assert len(df) == len(rows) == len(ds)
        assert list(df.columns) == list(rows[0])
    print(json.dumps({"columns": list(rows[0]), "rows": rows}))
    """
)


def read_back(path, fmt):
    proc = subprocess.run([sys.executable, "-c", READER, str(path), fmt], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def expected_rows(payloads, steps=(1, 2, 3), namespace="exp_proj/GBS12_N2_in4_out5_K2_W1"):
    out = []
    for step in steps:
        for inner in (0, 1):
            p = payloads[(step, inner)]
            for j in range(6):
                out.append({
                    "step": step, "inner_index": inner, "rank": 0, "trajectory_index": j,
                    "responses": p["responses"][j].tolist(), "old_logprobs": p["old_logprobs"][j].tolist(),
                    "rewards": p["rewards"][j].item(), "mask": p["mask"][j].tolist(),
                    "extra.scores": p["extra"]["scores"][j].tolist(), "texts": p["texts"][j],
                    "batch.step": step, "note": "demo", "temperature": 0.7, "namespace": namespace,
                })
    return out


def assert_rows_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w), (sorted(g), sorted(w))
        for k in w:
            if isinstance(w[k], float) or (isinstance(w[k], list) and w[k] and isinstance(_flat(w[k])[0], float)):
                assert _flat(g[k]) == pytest.approx(_flat(w[k]), rel=1e-6), k
            else:
                assert g[k] == w[k], k


def _flat(x):
    if isinstance(x, list):
        return [v for item in x for v in _flat(item)]
    return [x]


@pytest.mark.parametrize("fmt,name", [("parquet", "out.parquet"), ("jsonl", "out.jsonl")])
def test_export_reads_back_without_skip_harness(cache, capsys, tmp_path, fmt, name):
    dump, store, payloads, *_ = cache
    out_path = tmp_path / "x" / name
    code, out, err = run(capsys, "export", str(dump), "-o", str(out_path), "--namespace", "exp_proj/*")
    assert code == 0, err
    assert f"wrote {out_path} ({fmt}" in out and "36 rows from 3 steps (6 mini-batches)" in out
    doc = read_back(out_path, fmt)
    assert doc["columns"][:4] == ["step", "inner_index", "rank", "trajectory_index"]
    assert_rows_equal(doc["rows"], expected_rows(payloads))


def test_export_parquet_is_written_one_row_group_per_mini_batch(cache, capsys, tmp_path):
    import pyarrow.parquet as pq

    dump, store, payloads, td_store, td = cache
    out_path = tmp_path / "all.parquet"
    code, out, err = run(capsys, "export", str(dump), "-o", str(out_path), "--steps", "1-2", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["rows"] == 24 + 4 and summary["mini_batches"] == 5
    f = pq.ParquetFile(out_path)
    assert f.num_row_groups == 5
    assert [f.metadata.row_group(i).num_rows for i in range(5)] == [6, 6, 6, 6, 4]
    t = f.read()
    tdrows = [r for r in t.to_pylist() if r["namespace"].startswith("tdexp")]
    assert [r["ids"] for r in tdrows] == td["ids"].tolist() and {r["r"] for r in tdrows} == {1.0}
    assert sorted({r["step"] for r in t.to_pylist()}) == [1, 2]
    assert not list(tmp_path.glob(".all.parquet.tmp-*"))


def test_export_skips_a_corrupt_step_with_a_warning(cache, capsys, tmp_path):
    dump, store, payloads, *_ = cache
    path = store.layout.payload_path(2, 1, 0)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x11
    path.write_bytes(bytes(data))
    out_path = tmp_path / "x.jsonl"
    code, out, err = run(capsys, "export", str(store.layout.root), "-o", str(out_path))
    assert code == 0 and "step 2 not exported" in err and str(path) in err
    assert "rows from 2 steps (" in out and "; 1 step skipped (see the warnings)" in out, out   # not "1 steps"
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 3]


@pytest.mark.parametrize("argv,needle", [(["--steps", "3-1"], "--steps"), (["--namespace", "zzz"], "zzz"),
                                         (["--steps", "x"], "--steps")])
def test_export_bad_flags_are_one_line_errors(cache, capsys, tmp_path, argv, needle):
    dump, *_ = cache
    code, out, err = run(capsys, "export", str(dump), "-o", str(tmp_path / "o.parquet"), *argv)
    assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_export_of_a_step_range_the_cache_does_not_hold_is_a_usage_error_and_writes_nothing(cache, capsys, tmp_path, fmt):
    """`export --steps 50-60` on a cache of steps 1-3 wrote an empty file and exited 0 without a word: a user
    who mistyped the range learns it only from the empty file. Now: exit 2, one line naming the range and the
    steps there are; no file, and a file already at -o is left as it was."""
    dump, *_ = cache
    out_path = tmp_path / f"o.{fmt}"
    code, out, err = run(capsys, "export", str(dump), "-o", str(out_path), "--steps", "50-60")
    assert code == 2 and out == "" and err.count("error:") == 1 and "Traceback" not in err, (code, out, err)
    err = err.strip().splitlines()[-1]   # after the progress lines
    assert "--steps 50-60: no step of the" in err and "steps held: 1-3" in err and "nothing written" in err, err
    assert not out_path.exists() and not list(tmp_path.glob(f".o.{fmt}.tmp-*"))
    out_path.write_text("the user's old export")
    code, out, err = run(capsys, "export", str(dump), "-o", str(out_path), "--steps", "50-60", "--json")
    assert code == 2 and out == "" and out_path.read_text() == "the user's old export", (code, out, err)
    code, out, err = run(capsys, "export", str(dump), "-o", str(out_path), "--steps", "3-60")   # a range that overlaps
    assert code == 0 and "from 1 step (" in out, (code, out, err)


def test_export_names_the_rank_of_every_shard(tmp_path, capsys):
    store = open_store(NamespaceKey("w2", "proj", 4, 1, 3, 3, K=1, W=2).layout(tmp_path / "dump"))
    entries = []
    for rank in (0, 1):
        entries += store.writer.write_inner(1, 0, rank, {"r": torch.full((3,), float(rank)), "who": f"rank{rank}"}, {})
    store.writer.commit(1, entries, None)
    out_path = tmp_path / "w2.jsonl"
    code, out, err = run(capsys, "export", str(tmp_path / "dump"), "-o", str(out_path))
    assert code == 0, err
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [(r["rank"], r["trajectory_index"], r["r"], r["who"]) for r in rows] == [
        (0, 0, 0.0, "rank0"), (0, 1, 0.0, "rank0"), (0, 2, 0.0, "rank0"),
        (1, 0, 1.0, "rank1"), (1, 1, 1.0, "rank1"), (1, 2, 1.0, "rank1")]


def test_show_counts_each_byte_once_in_nested_containers(tmp_path, capsys):
    store = open_store(NamespaceKey("nest", "proj", 4, 1, 3, 3).layout(tmp_path / "dump"))
    td = tensordict.TensorDict({"ids": torch.zeros(4, 3, dtype=torch.int64)}, batch_size=[4])   # 96 B
    payload = {"batch": td, "more": {"deeper": {"r": torch.zeros(4)}},                         # 16 B
               "tags": [{"a": 1}, {"a": 2}, {"a": 3}]}                                           # 3 x 8 B
    store.writer.commit(1, store.writer.write_inner(1, 0, 0, payload, {}), None)
    code, out, _ = run(capsys, "show", str(store.layout.root), "--json")
    sizes = {r["key"]: r["bytes"] for r in json.loads(out)["structure"]}
    assert code == 0
    assert (sizes["batch"], sizes["more"], sizes["more.deeper"], sizes["tags"]) == (96, 16, 16, 24)
    assert sizes["(payload)"] == 96 + 16 + 24


def test_export_jsonl_writes_nan_as_null(tmp_path, capsys):
    store = open_store(NamespaceKey("nan", "proj", 2, 1, 3, 3).layout(tmp_path / "dump"))
    store.writer.commit(1, store.writer.write_inner(1, 0, 0, {"r": torch.tensor([1.5, float("nan")])}, {}), None)
    out_path = tmp_path / "n.jsonl"
    assert run(capsys, "export", str(tmp_path / "dump"), "-o", str(out_path))[0] == 0
    assert [json.loads(line)["r"] for line in out_path.read_text().splitlines()] == [1.5, None]
    assert "NaN" not in out_path.read_text()
