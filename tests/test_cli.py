"""cli: skip-harness ls / verify / clean on caches made with StepStore; output and exit codes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import subprocess_env, write_legacy, write_step
from skip_harness.cli import main
from skip_harness.layout import NamespaceKey
from skip_harness.scan import scan_namespace
from skip_harness.store import StepStore


@pytest.fixture
def cache(tmp_path):
    """Two namespaces: A (K=2) with one step of each status, B (K=1) with two complete steps."""
    dump = tmp_path / "dump"
    a = StepStore(NamespaceKey("expA", "proj", 8, 2, 4, 4, K=2).layout(dump))
    write_step(a, 1)
    write_legacy(a.layout, 2)
    write_step(a, 3, inners=[0], commit=False)
    write_step(a, 4)
    a.layout.commit_path(4).write_text("garbage")
    b = StepStore(NamespaceKey("expB", "proj", 8, 2, 4, 4).layout(dump))
    write_step(b, 1)
    write_step(b, 2)
    return dump, a, b


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_human(cache, capsys):
    dump, a, b = cache
    code, out, err = run(capsys, "ls", str(dump))
    assert code == 0
    lines = out.splitlines()
    header_a = next(l for l in lines if str(a.layout.root) in l)
    assert "K=2 W=1" in header_a and "complete=1 unverified=1 incomplete=1 corrupt=1" in header_a
    header_b = next(l for l in lines if str(b.layout.root) in l)
    assert "complete=2" in header_b
    step_lines = [l.split() for l in lines if l.startswith("  ")]
    assert [(x[0], x[1]) for x in step_lines] == [("1", "complete"), ("2", "unverified"), ("3", "incomplete"),
                                                  ("4", "corrupt"), ("1", "complete"), ("2", "complete")]


def test_ls_json_is_one_document_matching_the_scan(cache, capsys):
    dump, a, b = cache
    code, out, _ = run(capsys, "ls", str(dump), "--json")
    assert code == 0
    doc = json.loads(out)
    assert [ns["path"] for ns in doc["namespaces"]] == [str(a.layout.root), str(b.layout.root)]
    ns = doc["namespaces"][0]
    assert (ns["K"], ns["W"]) == (2, 1)
    expected = [{"step": s.step, "status": s.status, "bytes": s.bytes} for s in scan_namespace(a.layout).steps]
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
    a.clear_step(4)
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
    plan_bytes = sum(s.bytes for s in scan_namespace(a.layout).steps if s.status in ("incomplete", "corrupt"))
    code, out, _ = run(capsys, "clean", str(dump), "--dry-run")
    assert code == 0
    assert f"would remove 2 steps, {plan_bytes} bytes" in out
    assert "would remove 0 steps, 0 bytes" in out
    assert sorted(str(p) for p in dump.rglob("*")) == before


def test_clean_removes_incomplete_and_corrupt_steps(cache, capsys):
    dump, a, b = cache
    plan_bytes = sum(s.bytes for s in scan_namespace(a.layout).steps if s.status in ("incomplete", "corrupt"))
    code, out, _ = run(capsys, "clean", str(dump))
    assert code == 0 and f"freed {plan_bytes} bytes" in out
    assert {s.step: s.status for s in scan_namespace(a.layout).steps} == {1: "complete", 2: "unverified"}
    assert len(scan_namespace(b.layout).steps) == 2
    assert not a.layout.lock_holder_path.exists()   # the lock was taken and given back


def test_clean_quarantine(cache, capsys):
    dump, a, b = cache
    code, out, _ = run(capsys, "clean", str(dump), "--quarantine")
    assert code == 0 and "quarantined 2 steps" in out
    assert sorted(p.name.split("-")[0] for p in a.layout.quarantine_dir.iterdir()) == ["3", "4"]
    assert [s.step for s in scan_namespace(a.layout).steps] == [1, 2]


def test_clean_refuses_a_locked_namespace_and_handles_the_others(cache, capsys, lock_holder):
    dump, a, b = cache
    write_step(b, 3, commit=False)                      # an interrupted step in B to clean too
    holder = lock_holder(a.layout)
    for extra in ([], ["--dry-run"]):
        code, out, err = run(capsys, "clean", str(dump), *extra)
        assert code == 3
        assert f"pid {holder.pid}" in err and str(a.layout.root) in err
    assert len(scan_namespace(a.layout).steps) == 4      # untouched
    assert [s.step for s in scan_namespace(b.layout).steps] == [1, 2]   # B was cleaned


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_bad_dump_dir_is_a_one_line_error(tmp_path, capsys, kind):
    path = tmp_path / "nope"
    if kind == "file":
        path.write_text("x")
    for cmd in ("ls", "verify", "clean"):
        code, out, err = run(capsys, cmd, str(path))
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and str(path) in err


def test_console_entry_point_in_a_subprocess(cache, tmp_path):
    dump, a, b = cache
    proc = subprocess.run([sys.executable, "-m", "skip_harness.cli", "ls", str(dump), "--json"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["namespaces"]) == 2
    proc = subprocess.run([sys.executable, "-m", "skip_harness.cli", "verify", str(tmp_path / "missing")],
                          capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(tmp_path / "missing") in proc.stderr


def test_empty_dump_dir(tmp_path, capsys):
    code, out, _ = run(capsys, "ls", str(tmp_path), "--json")
    assert code == 0 and json.loads(out) == {"namespaces": []}
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert code == 0 and "no skip_harness namespaces" in out
