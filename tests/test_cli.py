"""cli: skip-harness ls / verify / clean on caches made with StepStore; output and exit codes."""
from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest
import torch

import os
import re

from conftest import subprocess_env, write_legacy, write_step
from skip_harness.store.open import open_namespace, open_store
from skip_harness.cli import main
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.scan import scan_namespace
from skip_harness.store.stepstore import StepStore
from skip_harness.units import human_bytes


@pytest.fixture
def cache(tmp_path):
    """Two namespaces: A (K=2) with one step of each status, B (K=1) with two complete steps."""
    dump = tmp_path / "dump"
    a = open_store(NamespaceKey("expA", "proj", 8, 2, 4, 4, K=2).layout(dump))
    write_step(a, 1)
    write_legacy(a.layout, 2)
    write_step(a, 3, inners=[0], commit=False)
    write_step(a, 4)
    a.layout.commit_path(4).write_text("garbage")
    b = open_store(NamespaceKey("expB", "proj", 8, 2, 4, 4).layout(dump))
    write_step(b, 1)
    write_step(b, 2)
    return dump, a, b


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(text):
    """The cells of every body row of the rich tables in `text` (lines drawn with '│')."""
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines()
            if line.strip().startswith("│")]


def test_ls_human(cache, capsys):
    dump, a, b = cache
    code, out, err = run(capsys, "ls", str(dump))
    assert code == 0
    rows = {r[0]: r for r in table_rows(out)}
    row_a, row_b = rows["expA_proj/GBS8_N2_in4_out4_K2_W1"], rows["expB_proj/GBS8_N2_in4_out4"]
    # namespace, K, W, mode, seed, complete, unverified, incomplete, corrupt, size, last written, gen stored
    assert row_a[1:3] == ["2", "1"] and row_a[5:9] == ["1", "1", "1", "1"]
    assert row_b[1:3] == ["1", "1"] and row_b[5:9] == ["2", "0", "0", "0"]
    assert "ago" in row_b[10] and row_b[11] == "-"      # no gen_s recorded by these writes
    code, out, err = run(capsys, "ls", str(dump), "--steps")
    steps = [(r[0], r[1]) for r in table_rows(out) if r[0].isdigit()]
    assert steps == [("1", "complete"), ("2", "unverified"), ("3", "incomplete"), ("4", "corrupt"),
                     ("1", "complete"), ("2", "complete")]


def test_ls_shows_mode_seed_and_generation_seconds(tmp_path, capsys):
    from skip_harness.store.fingerprint import Fingerprint

    store = open_store(NamespaceKey("e", "p", 8, 2, 4, 4).layout(tmp_path))
    fp = Fingerprint({"trainer.v1.trainer_mode": "colocate_async", "seed": 7})
    for step, gen_s in ((1, 1.25), (2, 2.5)):
        entries = store.writer.write_inner(step, 0, 0, {"x": torch.ones(2)}, {"gen_s": gen_s})
        store.writer.commit(step, entries, fp)
    code, out, _ = run(capsys, "ls", str(tmp_path))
    row = table_rows(out)[0]
    assert code == 0 and row[3:5] == ["colocate_async", "7"] and row[11] == "3.8s"
    doc = json.loads(run(capsys, "ls", str(tmp_path), "--json")[1])["namespaces"][0]
    assert doc["mode"] == "colocate_async" and doc["seed"] == 7 and doc["gen_s"] == 3.75
    assert [s["gen_s"] for s in doc["steps"]] == [1.25, 2.5]


def test_ls_reads_each_meta_file_of_a_step_once(cache, capsys, monkeypatch):
    """A step's full-width size and, where its commit record has none, its generation seconds both come
    from its meta files: `ls` reads each once (a 10,000-step K = 4 namespace: 40,000 reads, not 80,000)."""
    from skip_harness.store.reader import StepReader

    dump, a, b = cache
    read = []
    real = StepReader.read_meta
    monkeypatch.setattr(StepReader, "read_meta", lambda self, step, i, r: read.append((step, i, r)) or real(self, step, i, r))
    code, out, _ = run(capsys, "ls", str(dump), "--json")
    assert code == 0
    # A: steps 1 (complete) and 2 (unverified) are servable, K = 2; B: steps 1 and 2, K = 1
    assert sorted(read) == [(1, 0, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 0, 0), (2, 1, 0)]
    assert [s["gen_s"] for s in json.loads(out)["namespaces"][1]["steps"]] == [None, None]


def test_ls_json_is_one_document_matching_the_scan(cache, capsys):
    dump, a, b = cache
    code, out, _ = run(capsys, "ls", str(dump), "--json")
    assert code == 0
    doc = json.loads(out)
    assert [ns["path"] for ns in doc["namespaces"]] == [str(a.layout.root), str(b.layout.root)]
    ns = doc["namespaces"][0]
    assert (ns["K"], ns["W"]) == (2, 1)
    expected = [{"step": s.step, "status": s.status, "bytes": s.bytes} for s in scan_namespace(a.layout, open_namespace(a.layout)).steps]
    assert [{k: s[k] for k in ("step", "status", "bytes")} for s in ns["steps"]] == expected
    assert all(s["bytes"] > 0 for s in ns["steps"])


def test_ls_accepts_a_namespace_or_group_directory(cache, capsys):
    dump, a, b = cache
    for path in (a.layout.root, a.layout.root.parent):
        code, out, _ = run(capsys, "ls", str(path), "--json")
        assert code == 0 and [ns["path"] for ns in json.loads(out)["namespaces"]] == [str(a.layout.root)]


def test_verify_exit_codes(cache, capsys):
    dump, a, b = cache
    code, out, _ = run(capsys, "verify", str(dump / "expB_proj"), "--json")
    assert code == 0
    assert {s["status"] for s in json.loads(out)["namespaces"][0]["steps"]} == {"complete"}
    # incomplete and unverified steps are reported, not failures
    a.layout.commit_path(4).unlink()
    a.writer.clear_step(4)
    code, out, _ = run(capsys, "verify", str(dump))
    assert code == 0 and "incomplete" in out and "unverified" in out


def test_verify_finds_a_flipped_byte(cache, capsys):
    dump, a, b = cache
    path = b.layout.payload_path(2, 0, 0)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "ls", str(dump / "expB_proj"), "--json")
    assert code == 0 and json.loads(out)["namespaces"][0]["steps"][1]["status"] == "complete"
    code, out, _ = run(capsys, "verify", str(dump / "expB_proj"), "--json")
    assert code == 1
    steps = json.loads(out)["namespaces"][0]["steps"]
    assert [s["status"] for s in steps] == ["complete", "corrupt"]
    assert "checksum" in steps[1]["reason"] and str(path) in steps[1]["reason"]
    code, out, _ = run(capsys, "verify", str(dump))
    assert code == 1 and "corrupt" in out


def test_clean_dry_run_touches_nothing(cache, capsys):
    dump, a, b = cache
    before = sorted(str(p) for p in dump.rglob("*"))
    plan_bytes = sum(s.bytes for s in scan_namespace(a.layout, open_namespace(a.layout)).steps if s.status in ("incomplete", "corrupt"))
    code, out, _ = run(capsys, "clean", str(dump), "--dry-run")
    assert code == 0
    assert f"would remove 2 steps, {human_bytes(plan_bytes)}; frees {human_bytes(plan_bytes)}" in out
    assert "would remove 0 steps, 0 B" in out
    assert f"in all: would remove 2 steps in 2 namespaces, {human_bytes(plan_bytes)}" in out
    assert not re.search(r"\d bytes", out)   # sizes are human-readable; exact bytes only in --json
    assert sorted(str(p) for p in dump.rglob("*")) == before


def test_clean_removes_incomplete_and_corrupt_steps(cache, capsys):
    dump, a, b = cache
    plan_bytes = sum(s.bytes for s in scan_namespace(a.layout, open_namespace(a.layout)).steps if s.status in ("incomplete", "corrupt"))
    code, out, _ = run(capsys, "clean", str(dump))
    assert code == 0 and f"freed {human_bytes(plan_bytes)}" in out
    assert {s.step: s.status for s in scan_namespace(a.layout, open_namespace(a.layout)).steps} == {1: "complete", 2: "unverified"}
    assert len(scan_namespace(b.layout, open_namespace(b.layout)).steps) == 2
    assert not a.layout.lock_holder_path.exists()   # the lock was taken and given back


def test_clean_quarantine(cache, capsys):
    dump, a, b = cache
    code, out, _ = run(capsys, "clean", str(dump), "--quarantine")
    assert code == 0 and "quarantined 2 steps" in out
    assert sorted(p.name.split("-")[0] for p in a.layout.quarantine_dir.iterdir()) == ["3", "4"]
    assert [s.step for s in scan_namespace(a.layout, open_namespace(a.layout)).steps] == [1, 2]


def test_clean_refuses_a_locked_namespace_and_handles_the_others(cache, capsys, lock_holder):
    dump, a, b = cache
    write_step(b, 3, commit=False)                      # an interrupted step in B to clean too
    holder = lock_holder(a.layout)
    for extra in ([], ["--dry-run"]):
        code, out, err = run(capsys, "clean", str(dump), *extra)
        assert code == 3
        assert f"pid {holder.pid}" in err and str(a.layout.root) in err
    assert len(scan_namespace(a.layout, open_namespace(a.layout)).steps) == 4      # untouched
    assert [s.step for s in scan_namespace(b.layout, open_namespace(b.layout)).steps] == [1, 2]   # B was cleaned


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_bad_dump_dir_is_a_one_line_error(tmp_path, capsys, kind):
    path = tmp_path / "nope"
    if kind == "file":
        path.write_text("x")
    for cmd in ("ls", "verify", "clean"):
        code, out, err = run(capsys, cmd, str(path))
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and str(path) in err


LOOKALIKE = ("'s3:/x' looks like an object-store URL but is not one (s3: needs two slashes): write "
             "s3://BUCKET/PREFIX, or ./s3:/x for a local folder of that name")


@pytest.mark.parametrize("argv, arg", [
    (["ls", "s3:/x"], "DUMP_DIR"), (["verify", "s3:/x"], "DUMP_DIR"), (["clean", "s3:/x"], "DUMP_DIR"),
    (["export", "s3:/x", "-o", "out.jsonl"], "DUMP_DIR"), (["show", "s3:/x"], "PATH"),
    (["diff", "s3:/x", "."], "A"), (["diff", ".", "s3:/x"], "B"), (["import-verl", "s3:/x", ".", "--trust"], "VERL_DUMP_DIR"),
    (["import-verl", ".", "s3:/x", "--trust"], "DUMP_DIR"), (["view", "s3:/x"], "DUMP_DIR | NAMESPACE"),
])
def test_a_url_look_alike_is_the_runs_message_not_a_missing_folder(argv, arg, tmp_path, monkeypatch, capsys):
    """`s3:/x` is refused as the run refuses it (store.urls.dump_dir_problem), naming the argument, exit 2."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", (out, err)
    assert err.strip().splitlines() == [f"skip-harness: error: {arg}: {LOOKALIKE}"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []          # nothing made, nothing read as a folder


@pytest.mark.slow  # the installed command in subprocesses
def test_console_entry_point_in_a_subprocess(cache, tmp_path):
    dump, a, b = cache
    proc = subprocess.run([sys.executable, "-m", "skip_harness.cli", "ls", str(dump), "--json"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["namespaces"]) == 2
    proc = subprocess.run([sys.executable, "-m", "skip_harness.cli", "verify", str(tmp_path / "missing")],
                          capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(tmp_path / "missing") in proc.stderr


@pytest.mark.slow  # the installed command in a real shell pipeline
def test_ls_into_a_reader_that_stops_early_exits_0_without_an_error(cache, tmp_path):
    """`skip-harness ls | head -2`: the reader closing the pipe is not a failure (it was `error: [Errno 32]
    Broken pipe`, exit 2). `head -n 0` closes it before the listing is written, every time."""
    import shlex

    dump, a, b = cache
    cmd = f"{shlex.quote(sys.executable)} -m skip_harness.cli ls {shlex.quote(str(dump))} | head -n 0"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                          env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)


def test_empty_dump_dir(tmp_path, capsys):
    code, out, _ = run(capsys, "ls", str(tmp_path), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["namespaces"] == [] and doc["total_bytes"] == 0
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert code == 0 and "no skip_harness namespaces" in out


class Marker:
    """Unpickling this would create a file: proof that no code from a payload ever ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def recommit_with(store, step, payload_bytes_writer):
    """Replace the payload of (step, 0, 0) and write a commit record whose sizes and checksums match it,
    so only loading the payload can tell that it is bad."""
    from skip_harness.store.commit import FileEntry
    from skip_harness.store.posix.fileops import checksum_file

    lay = store.layout
    payload = lay.payload_path(step, 0, 0)
    payload_bytes_writer(payload)
    entries = []
    for _i, _r, prel, mrel in lay.expected_rels():
        for rel in (prel, mrel):
            size, digest = checksum_file(lay.step_dir(step) / rel)
            entries.append(FileEntry(rel, size, digest))
    store.writer.commit(step, entries, None)


def test_verify_reports_a_payload_safe_loading_refuses_and_clean_removes_it(cache, capsys, tmp_path):
    dump, a, b = cache
    marker = tmp_path / "code_ran"
    recommit_with(b, 2, lambda p: torch.save({"x": Marker(str(marker))}, p))
    code, out, _ = run(capsys, "ls", str(dump / "expB_proj"), "--json")
    assert json.loads(out)["namespaces"][0]["steps"][1]["status"] == "complete"   # sizes and checksums agree
    code, out, _ = run(capsys, "verify", str(dump / "expB_proj"), "--json")
    assert code == 1
    step2 = json.loads(out)["namespaces"][0]["steps"][1]
    assert step2["status"] == "corrupt" and str(b.layout.payload_path(2, 0, 0)) in step2["reason"]
    assert "weights_only=False" not in step2["reason"]
    assert not marker.exists()
    code, out, err = run(capsys, "clean", str(dump / "expB_proj"))
    assert code == 0 and "removed 1 step," in out and "corrupt step 2" in err
    assert [s.step for s in scan_namespace(b.layout, open_namespace(b.layout)).steps] == [1]
    assert run(capsys, "verify", str(dump / "expB_proj"))[0] == 0
    assert not marker.exists()


def test_clean_removes_a_checksum_corrupt_step_and_quarantine_keeps_it(cache, capsys):
    dump, a, b = cache
    for step in (1, 2):
        path = b.layout.payload_path(step, 0, 0)
        data = bytearray(path.read_bytes())
        data[-20] ^= 0x40
        path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "clean", str(dump / "expB_proj"), "--dry-run", "--json")
    doc = json.loads(out)["namespaces"][0]
    assert code == 0 and [(s["step"], s["status"]) for s in doc["steps"]] == [(1, "corrupt"), (2, "corrupt")]
    assert "checksum" in doc["steps"][0]["reason"]
    assert len(scan_namespace(b.layout, open_namespace(b.layout)).steps) == 2                         # a dry run changes nothing
    code, out, _ = run(capsys, "clean", str(dump / "expB_proj"), "--quarantine")
    assert code == 0 and "quarantined 2 steps" in out
    assert scan_namespace(b.layout, open_namespace(b.layout)).steps == ()
    assert sorted(p.name.split("-")[0] for p in b.layout.quarantine_dir.iterdir()) == ["1", "2"]


def test_verify_and_clean_log_plain_progress_lines_when_stderr_is_not_a_terminal(cache, capsys):
    dump, a, b = cache
    code, out, err = run(capsys, "verify", str(dump))
    assert f"verifying {a.layout.root}: 4 steps" in err and f"verifying {b.layout.root}: 2 steps" in err
    assert "\x1b[" not in err and "\x1b[" not in out          # no terminal control codes in a pipe
    code, out, err = run(capsys, "clean", str(dump), "--dry-run")
    assert f"verifying {a.layout.root}: 4 steps" in err


def test_progress_is_a_rich_bar_on_a_terminal(monkeypatch):
    import sys as _sys

    from skip_harness.cli import _common

    monkeypatch.setattr(_sys.stderr, "isatty", lambda: True, raising=False)
    with _common.progress() as bar:
        assert bar._progress is not None
    monkeypatch.setattr(_sys.stderr, "isatty", lambda: False, raising=False)
    with _common.progress() as bar:
        assert bar._progress is None


def test_clean_of_a_namespace_that_cannot_be_written_is_a_one_line_error(cache, capsys, monkeypatch):
    from skip_harness.store.posix import lock
    from skip_harness.store.posix.lock import ReadOnlyCache

    dump, a, b = cache

    def refuse(self, *args, **kwargs):
        raise ReadOnlyCache(self.layout.root, "Read-only file system")

    monkeypatch.setattr(lock.NamespaceLock, "acquire", refuse)
    code, out, err = run(capsys, "clean", str(dump / "expA_proj"))
    assert code == 1 and "Read-only file system" in err and "Traceback" not in err
    assert len(scan_namespace(a.layout, open_namespace(a.layout)).steps) == 4


def test_ls_on_a_narrow_console_prints_a_block_per_namespace(cache, capsys, monkeypatch):
    dump, a, b = cache
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "ls", str(dump))
    assert code == 0 and "┃" not in out                      # no table folding every column to shreds
    assert "namespace     expA_proj/GBS8_N2_in4_out4_K2_W1" in out
    assert "steps         1 complete, 1 unverified, 1 incomplete, 1 corrupt" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    monkeypatch.setenv("COLUMNS", "200")
    assert "┃" in run(capsys, "ls", str(dump))[1]


# ---------------------------------------------------------------- issue 15: items 4 and 8
def test_ls_without_a_dump_dir_lists_where_runs_write_and_says_so(cache, capsys, monkeypatch, tmp_path):
    dump, a, b = cache
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", str(dump))
    code, out, err = run(capsys, "ls")
    assert code == 0 and f"skip_harness cache {dump} ($SKIP_HARNESS_DUMP_DIR)" in out, err
    assert {r[0] for r in table_rows(out)} >= {"expA_proj/GBS8_N2_in4_out4_K2_W1", "expB_proj/GBS8_N2_in4_out4"}
    assert run(capsys, "verify")[0] == 1 and run(capsys, "clean", "--dry-run")[0] == 0  # A has a corrupt step
    # nothing set: the per-user default (as a run would use); not there yet is not an error
    monkeypatch.delenv("SKIP_HARNESS_DUMP_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from skip_harness.config import RolloutTQConfig

    default = RolloutTQConfig().resolved_dump_dir()
    assert str(default).startswith(str(tmp_path / "xdg"))
    code, out, err = run(capsys, "ls")
    assert code == 0 and f"no skip_harness cache at {default} yet" in out and "per-user default" in out
    assert json.loads(run(capsys, "ls", "--json")[1]) == {"dump_dir": str(default), "namespaces": []}


def test_ls_gives_a_grand_total_a_last_read_column_and_sorts(cache, capsys):
    dump, a, b = cache
    total = sum(s.bytes for lay in (a.layout, b.layout) for s in scan_namespace(lay, open_namespace(lay)).steps)
    code, out, _ = run(capsys, "ls", str(dump))
    assert code == 0 and f"2 namespaces, 6 steps, {human_bytes(total)} in all" in out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["expA_proj/GBS8_N2_in4_out4_K2_W1", "expB_proj/GBS8_N2_in4_out4"]
    assert rows[0][12] == "-" and rows[1][12] == "-"   # never read since written
    # step 2 of B read later than it was written (what a hit does to its payload's access time)
    payload = b.layout.payload_path(2, 0, 0)
    st = os.stat(payload)
    os.utime(payload, (st.st_mtime + 60, st.st_mtime))
    doc = json.loads(run(capsys, "ls", str(dump), "--json", "--sort", "accessed")[1])
    assert [ns["path"] for ns in doc["namespaces"]] == [str(b.layout.root), str(a.layout.root)]
    # (set as a float and read back through nanoseconds: the last bits may differ -- CI saw 1796356733.0800908
    # against 1796356673.080091 + 60)
    assert doc["namespaces"][0]["accessed"] == pytest.approx(st.st_mtime + 60, abs=1e-3)
    assert doc["namespaces"][1]["accessed"] is None
    assert doc["total_bytes"] == total
    out = run(capsys, "ls", str(dump), "--sort", "accessed")[1]
    assert [r[0] for r in table_rows(out)][0] == "expB_proj/GBS8_N2_in4_out4" and "ago" in table_rows(out)[0][12]
    sizes = {ns["path"]: ns["total_bytes"] for ns in doc["namespaces"]}
    doc = json.loads(run(capsys, "ls", str(dump), "--json", "--sort", "size")[1])
    assert [ns["total_bytes"] for ns in doc["namespaces"]] == sorted(sizes.values(), reverse=True)
    with pytest.raises(SystemExit) as exc:
        main(["ls", str(dump), "--sort", "bogus"])
    assert exc.value.code == 2


def test_a_namespace_name_under_an_object_store_root_is_its_url_in_every_command(monkeypatch, tmp_path):
    """Where runs write is an object store: a namespace named as `ls` names it is its URL there, for every
    command alike (`diff` had a rule of its own that did this and nothing else did); a name that is not a
    namespace's stays the local path it names."""
    from skip_harness.cli._discovery import where_of
    from skip_harness.store.api import UrlPath

    from skip_harness.cli import _discovery

    monkeypatch.setattr(_discovery, "_SAID", set())        # said once a process: not for the other tests
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", "s3://bucket/runs/")
    monkeypatch.chdir(tmp_path)
    got = where_of("expC_proj/GBS8_N2_in4_out4", "NAMESPACE")
    assert isinstance(got, UrlPath) and str(got) == "s3://bucket/runs/expC_proj/GBS8_N2_in4_out4"
    assert where_of("some/folder", "PATH") == Path("some/folder")


def test_a_namespace_named_as_ls_names_it_works_in_every_command(cache, capsys, monkeypatch, tmp_path):
    """`skip-harness ls` (no DUMP_DIR: where runs write) names each namespace relative to that place; that
    name, given to verify, show, diff or pack from any directory, is the namespace there."""
    dump, _, b = cache
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", str(dump))
    monkeypatch.chdir(tmp_path)                 # not where the cache is
    code, out, _ = run(capsys, "ls")
    name = "expB_proj/" + b.layout.root.name
    assert code == 0 and name in out, out
    code, out, err = run(capsys, "verify", name)
    assert code == 0 and "2 complete" in out, out
    assert f"{name} is not here: {b.layout.root}, under where runs write" in err, err
    code, out, _ = run(capsys, "show", name, "1")
    assert code == 0 and str(b.layout.step_dir(1)) in out, out
    code, out, _ = run(capsys, "diff", name, name)
    assert code == 0, out
    code, out, _ = run(capsys, "pack", name, "-o", str(tmp_path / "b.pack"))
    assert code == 0 and (tmp_path / "b.pack").is_file(), out
    code, _, err = run(capsys, "verify", "expB_proj/no_such_namespace")      # not here, not there either
    assert code != 0 and "expB_proj/no_such_namespace does not exist" in err, err
