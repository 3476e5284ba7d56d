"""scan: every status rule; namespaces; cleanup plans (delete, quarantine, off) that never leave the namespace."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import write_legacy, write_step
from skip_harness.store.open import open_namespace, open_store
from skip_harness.errors import ConfigError
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import Layout, NamespaceKey
from skip_harness.store.cleanup import CleanupPlan, plan_cleanup
from skip_harness.store.namespaces import find_namespaces
from skip_harness.store.scan import (
    classify_step,
    scan_namespace,
)
from skip_harness.store.stepstore import StepStore


def make(tmp_path, K=1, W=1) -> StepStore:
    return open_store(NamespaceKey("exp", "proj", 8, 2, 4, 4, K=K, W=W).layout(tmp_path / "cache"))


def status(st, step):
    return classify_step(st.layout, step, namespace=st.namespace)


def du(path) -> int:
    total = 0
    for d, dirs, files in os.walk(path):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            total += os.lstat(os.path.join(d, name)).st_size
    return total


# ---------------------------------------------------------------------------------------------
# complete / corrupt


@pytest.mark.parametrize("K,W", [(1, 1), (4, 1), (2, 3)])
def test_committed_step_is_complete(tmp_path, K, W):
    st = make(tmp_path, K, W)
    fp = Fingerprint({"seed": 1})
    write_step(st, 1, fingerprint=fp)
    r = status(st, 1)
    assert (r.status, r.has_commit, r.fingerprint, r.reason) == ("complete", True, fp, "")
    assert r.bytes == du(st.layout.step_dir(1))


def _corrupt_commit(st, step, mutate):
    path = st.layout.commit_path(step)
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda p, d: p.write_text("{\"format\": 1, "), "does not parse"),
        (lambda p, d: p.write_text("[]"), "not a JSON object"),
        (lambda p, d: _set(p, d, K=4), "K=4"),
        (lambda p, d: _set(p, d, W=2), "W=2"),
        (lambda p, d: _set(p, d, step=2), "step 2"),
        (lambda p, d: _set(p, d, files=d["files"][1:]), "does not list"),
        (lambda p, d: _set(p, d, files=d["files"] + [{"rel": "/etc/passwd", "bytes": 1, "checksum": "x"}]), "unsafe"),
        (lambda p, d: _set(p, d, files=d["files"] + [{"rel": "extra.bin", "bytes": 1, "checksum": "x"}]), "extra.bin"),
    ],
)
def test_bad_commit_record_makes_the_step_corrupt(tmp_path, mutate, reason):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    path = st.layout.commit_path(1)
    mutate(path, json.loads(path.read_text()))
    r = status(st, 1)
    assert r.status == "corrupt" and reason in r.reason and r.has_commit


def _set(path, doc, **kw):
    doc.update(kw)
    path.write_text(json.dumps(doc))


def test_listed_file_missing_or_resized_is_corrupt(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    write_step(st, 2)
    st.layout.payload_path(1, 1, 0).unlink()
    with open(st.layout.meta_path(2, 0, 0), "ab") as f:
        f.write(b" ")
    r1, r2 = status(st, 1), status(st, 2)
    assert r1.status == "corrupt" and "1/tq_batch.pt" in r1.reason and "missing" in r1.reason
    assert r2.status == "corrupt" and "0/meta.json" in r2.reason


def test_scan_does_not_read_checksums(tmp_path):
    st = make(tmp_path)
    write_step(st, 1)
    path = st.layout.payload_path(1, 0, 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert status(st, 1).status == "complete"      # same size; verify is what reads checksums
    assert st.reader.verify(1)[1] is not None


# ---------------------------------------------------------------------------------------------
# unverified


@pytest.mark.parametrize("K,W,form", [(1, 1, ""), (1, 1, "0/"), (3, 1, ""), (2, 2, ""), (1, 2, "0/")])
def test_older_cache_without_commit_is_unverified(tmp_path, K, W, form):
    st = make(tmp_path, K, W)
    write_legacy(st.layout, 5, form)
    r = status(st, 5)
    assert r.status == "unverified" and not r.has_commit and r.fingerprint is None
    assert r.bytes == du(st.layout.step_dir(5))


# ---------------------------------------------------------------------------------------------
# incomplete


def test_missing_inner_index_rank_or_meta_is_incomplete(tmp_path):
    st = make(tmp_path, K=3, W=2)
    write_legacy(st.layout, 1)
    write_legacy(st.layout, 2)
    write_legacy(st.layout, 3)
    shutil.rmtree(st.layout.inner_dir(1, 2))
    st.layout.payload_path(2, 1, 1).unlink()
    st.layout.meta_path(3, 0, 0).unlink()
    for step, needle in ((1, "2/"), (2, "1/tq_batch_rank1.pt"), (3, "0/meta_rank0.json")):
        r = status(st, step)
        assert r.status == "incomplete" and needle in r.reason, r


def test_k1_legacy_form_needs_its_meta_too(tmp_path):
    st = make(tmp_path, K=1)
    write_legacy(st.layout, 1, "0/")
    (st.layout.step_dir(1) / "0" / "meta.json").unlink()
    assert status(st, 1).status == "incomplete"


def test_temporary_file_makes_an_uncommitted_step_incomplete(tmp_path):
    st = make(tmp_path, K=2)
    write_legacy(st.layout, 1)
    (st.layout.inner_dir(1, 1) / ".tmp-tq_batch.pt.123.abcd").write_bytes(b"partial")
    r = status(st, 1)
    assert r.status == "incomplete" and ".tmp-" in r.reason
    assert r.bytes == du(st.layout.step_dir(1))


def test_uncommitted_write_by_skip_harness_is_incomplete_not_unverified(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1, commit=False)           # every file there, the commit record never written
    r = status(st, 1)
    assert r.status == "incomplete" and "interrupted" in r.reason


def test_empty_payload_is_incomplete(tmp_path):
    st = make(tmp_path)
    write_legacy(st.layout, 1)
    st.layout.payload_path(1, 0, 0).write_bytes(b"")
    assert status(st, 1).status == "incomplete"


def test_step_entry_that_is_a_file_is_incomplete(tmp_path):
    st = make(tmp_path)
    st.layout.root.mkdir(parents=True)
    st.layout.step_dir(1).write_text("not a dir")
    r = status(st, 1)
    assert r.status == "incomplete" and r.bytes == 9


@pytest.fixture
def outside(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    (d / "sentinel").write_text("keep me")
    torch.save({"x": torch.ones(1)}, d / "tq_batch.pt")
    (d / "meta.json").write_text("{}")
    return d


def test_symlinks_make_a_step_incomplete_and_are_never_followed(tmp_path, outside):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    write_step(st, 2)
    os.symlink(outside, st.layout.step_dir(3))                   # step dir is a link
    os.rename(st.layout.inner_dir(1, 1), tmp_path / "moved")       # inner dir is a link
    os.symlink(tmp_path / "moved", st.layout.inner_dir(1, 1))
    pay = st.layout.payload_path(2, 0, 0)                           # a file is a link
    os.rename(pay, tmp_path / "moved.pt")
    os.symlink(tmp_path / "moved.pt", pay)
    for step in (1, 2, 3):
        r = status(st, step)
        assert r.status == "incomplete" and "symlink" in r.reason, r
    assert status(st, 3).bytes == os.lstat(st.layout.step_dir(3)).st_size   # the link's own size


def test_missing_step(tmp_path):
    st = make(tmp_path)
    r = status(st, 9)
    assert r.status == "incomplete" and not r.exists and r.bytes == 0


# ---------------------------------------------------------------------------------------------
# namespaces


def test_scan_namespace_sorts_steps_and_ignores_other_entries(tmp_path):
    st = make(tmp_path, K=1)
    for step in (10, 2, 1):
        write_step(st, step)
    root = st.layout.root
    for name in ("00", "01", "-1", "abc", ".quarantine", ".lock.holder.json"):
        (root / name).mkdir() if name != ".lock.holder.json" else (root / name).write_text("{}")
    (root / ".lock").write_text("")
    (root / ".trash-4-1-abc").mkdir()
    (root / ".trash-4-1-abc" / "junk").write_bytes(b"12345")
    report = scan_namespace(st.layout, st.namespace)
    assert [s.step for s in report.steps] == [1, 2, 10]
    assert report.complete_steps == frozenset({1, 2, 10})
    assert report.bytes == sum(s.bytes for s in report.steps)
    assert [(x.path.name, x.bytes) for x in report.leftovers] == [(".trash-4-1-abc", 5)]
    nope = Layout(tmp_path / "nope")
    assert scan_namespace(nope, open_namespace(nope)).steps == ()


def test_scan_namespace_reports_every_status(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    write_legacy(st.layout, 2)
    write_step(st, 3, inners=[0], commit=False)
    write_step(st, 4)
    st.layout.commit_path(4).write_text("garbage")
    report = scan_namespace(st.layout, st.namespace)
    assert {s.step: s.status for s in report.steps} == {1: "complete", 2: "unverified", 3: "incomplete",
                                                         4: "corrupt"}
    assert report.complete_steps == frozenset({1, 2})
    assert [s.step for s in report.by_status("corrupt")] == [4]
    assert report.counts() == {"complete": 1, "unverified": 1, "incomplete": 1, "corrupt": 1}


def test_large_namespace_is_scanned_in_parallel_with_the_same_result(tmp_path, monkeypatch):
    from skip_harness.store import scan as scan_mod

    st = make(tmp_path, K=1)
    write_step(st, 1)
    for step in range(2, 300):
        if step % 7 == 0:
            os.symlink(st.layout.step_dir(1), st.layout.step_dir(step))
        else:
            write_legacy(st.layout, step)
    monkeypatch.setattr(scan_mod, "_CHUNK", 16)        # 19 chunks: the first serial, the second on threads, ...
    parallel = scan_namespace(st.layout, open_namespace(st.layout), use_index=False)
    monkeypatch.setattr(scan_mod, "_PARALLEL_FROM", 10**9)
    assert scan_namespace(st.layout, open_namespace(st.layout), use_index=False) == parallel
    assert len(parallel.steps) == 299
    assert parallel.by_status("incomplete") == tuple(s for s in parallel.steps if s.step % 7 == 0)


def test_a_full_scan_takes_the_faster_way_a_chunk_and_times_the_slower_again():
    """Serially on a warm cache (threads only contend for the GIL), on threads on a cold one (they overlap
    the disk's waits): each way timed on a chunk first, the slower again on every `_RETRY_EVERY`th chunk,
    so a cache that warms up mid-scan moves the scan back to serial."""
    from skip_harness.store.scan import _RETRY_EVERY, _Pace

    pace = _Pace()
    ways = []
    for chunk in range(1, 3 * _RETRY_EVERY + 1):
        threaded = pace.threaded()
        ways.append(threaded)
        serial_cost = 2.0 if chunk < 2 * _RETRY_EVERY else 0.5          # the cache warms: serial gets faster
        pace.took(threaded, 1.0 if threaded else serial_cost)
    retried = [chunk for chunk in range(1, len(ways) + 1) if chunk % _RETRY_EVERY == 0]
    assert ways[:2] == [False, True]
    assert [ways[c - 1] for c in retried] == [False, False, True]
    assert all(ways[c - 1] for c in range(3, 2 * _RETRY_EVERY) if c not in retried)
    assert not any(ways[c - 1] for c in range(2 * _RETRY_EVERY + 1, 3 * _RETRY_EVERY))


def test_find_namespaces(tmp_path):
    dump = tmp_path / "dump"
    a = NamespaceKey("e1", "p", 8, 2, 4, 4).layout(dump)
    b = NamespaceKey("e1", "p", 8, 2, 4, 4, K=4).layout(dump)
    c = NamespaceKey("e0", "p", 16, 2, 4, 4, W=2).layout(dump)
    for lay in (a, b, c):
        lay.root.mkdir(parents=True)
    (dump / "e1_p" / "not_a_namespace").mkdir()
    (dump / "e1_p" / "GBS1_N1_in1_out1").write_text("a file")
    outside = tmp_path / "elsewhere" / "g"
    (outside / "GBS2_N2_in2_out2").mkdir(parents=True)
    os.symlink(outside, dump / "linked_group")
    os.symlink(outside / "GBS2_N2_in2_out2", dump / "e1_p" / "GBS3_N3_in3_out3")
    found = find_namespaces(dump)
    assert [(x.root, x.K, x.W) for x in found] == [(c.root, 1, 2), (a.root, 1, 1), (b.root, 4, 1)]
    assert find_namespaces(tmp_path / "missing") == []


# ---------------------------------------------------------------------------------------------
# cleanup


def _mixed_namespace(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1)                                   # complete
    write_legacy(st.layout, 2)                          # unverified
    write_step(st, 3, inners=[0], commit=False)         # incomplete
    write_step(st, 4)
    st.layout.commit_path(4).write_text("garbage")      # corrupt
    return st


def test_plan_does_nothing_until_executed(tmp_path):
    st = _mixed_namespace(tmp_path)
    before = sorted(p for p in st.layout.root.rglob("*"))
    plan = plan_cleanup(scan_namespace(st.layout, st.namespace), "delete")
    assert isinstance(plan, CleanupPlan)
    assert [(i.step, i.status, i.action) for i in plan.items] == [(3, "incomplete", "delete"), (4, "corrupt", "delete")]
    expected = du(st.layout.step_dir(3)) + du(st.layout.step_dir(4))
    assert plan.expected_freed_bytes == expected == plan.bytes
    assert sorted(p for p in st.layout.root.rglob("*")) == before


def test_delete_removes_incomplete_and_corrupt_steps_only(tmp_path, caplog):
    st = _mixed_namespace(tmp_path)
    plan = plan_cleanup(scan_namespace(st.layout, st.namespace), "delete")
    with caplog.at_level("INFO", logger="skip_harness"):
        result = plan.execute(st.namespace)
    assert result.errors == () and result.freed_bytes == plan.expected_freed_bytes
    assert [(i.step, i.status) for i in result.items] == [(3, "incomplete"), (4, "corrupt")]
    assert {s.step: s.status for s in scan_namespace(st.layout, st.namespace).steps} == {1: "complete", 2: "unverified"}
    assert caplog.text == ""  # scan and cleanup never log: the caller reports the result
    assert not [p for p in st.layout.root.iterdir() if p.name.startswith(".trash-")]


def test_quarantine_moves_steps_under_the_namespace(tmp_path):
    st = _mixed_namespace(tmp_path)
    plan = plan_cleanup(scan_namespace(st.layout, st.namespace), "quarantine")
    assert plan.expected_freed_bytes == 0 and plan.bytes > 0
    result = plan.execute(st.namespace)
    assert result.errors == () and result.freed_bytes == 0 and result.moved_bytes == plan.bytes
    moved = sorted(p.name for p in st.layout.quarantine_dir.iterdir())
    assert len(moved) == 2 and moved[0].startswith("3-") and moved[1].startswith("4-")
    assert all(p.parent == st.layout.quarantine_dir for p in result.quarantined)
    assert (st.layout.quarantine_dir / moved[1] / "commit.json").read_text() == "garbage"
    assert {s.step for s in scan_namespace(st.layout, st.namespace).steps} == {1, 2}


def test_off_plans_nothing(tmp_path):
    st = _mixed_namespace(tmp_path)
    plan = plan_cleanup(scan_namespace(st.layout, st.namespace), "off")
    assert plan.items == () and plan.expected_freed_bytes == 0
    assert plan.execute(st.namespace).freed_bytes == 0
    assert len(scan_namespace(st.layout, st.namespace).steps) == 4


def test_unknown_action_names_the_config_key(tmp_path):
    with pytest.raises(ConfigError, match="skip.rollout_tq.cleanup"):
        layout = make(tmp_path).layout
        plan_cleanup(scan_namespace(layout, open_namespace(layout)), "shred")


def test_leftover_trash_is_removed_by_cleanup(tmp_path):
    st = make(tmp_path)
    write_step(st, 1, commit=False)
    trash = st.layout.root / ".trash-7-1-abcdef"
    (trash / "0").mkdir(parents=True)
    (trash / "0" / "tq_batch.pt").write_bytes(b"x" * 100)
    plan = plan_cleanup(scan_namespace(st.layout, st.namespace), "delete")
    assert plan.expected_freed_bytes == plan.bytes + 100
    result = plan.execute(st.namespace)
    assert not trash.exists() and result.freed_bytes == plan.expected_freed_bytes


@pytest.mark.parametrize("action", ["delete", "quarantine"])
def test_a_values_write_killed_midway_leaves_no_temporary_after_cleanup(tmp_path, action):
    """A run killed while it wrote a step's recorded values left '.values/.tmp-...' (seen in the crash
    test): startup's cleanup removes it; the values files themselves stay."""
    st = make(tmp_path)
    write_step(st, 1)
    values = st.layout.root / ".values"
    values.mkdir()
    (values / "1.json").write_text("{}")
    tmp = values / ".tmp-2.json.14803.c2858d4f"
    tmp.write_bytes(b"x" * 7)
    report = scan_namespace(st.layout, st.namespace)
    assert [(x.path, x.bytes) for x in report.leftovers] == [(tmp, 7)]
    result = plan_cleanup(report, action).execute(st.namespace)
    assert not tmp.exists() and (values / "1.json").exists() and result.errors == ()


@pytest.mark.parametrize("action", ["delete", "quarantine"])
def test_cleanup_of_symlinked_steps_never_leaves_the_namespace(tmp_path, outside, action):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    os.symlink(outside, st.layout.step_dir(2))                 # step dir -> outside
    write_step(st, 3)
    shutil.rmtree(st.layout.inner_dir(3, 1))
    os.symlink(outside, st.layout.inner_dir(3, 1))             # inner dir -> outside
    before = sorted(os.listdir(outside))
    plan = plan_cleanup(scan_namespace(st.layout, st.namespace), action)
    assert [i.step for i in plan.items] == [2, 3]
    result = plan.execute(st.namespace)
    assert result.errors == ()
    assert sorted(os.listdir(outside)) == before and (outside / "sentinel").read_text() == "keep me"
    assert not os.path.lexists(st.layout.step_dir(2)) and not os.path.lexists(st.layout.step_dir(3))
    if action == "quarantine":
        moved = {p.name.split("-")[0]: p for p in st.layout.quarantine_dir.iterdir()}
        assert moved["2"].is_symlink()                         # the link itself was moved
    assert [s.step for s in scan_namespace(st.layout, st.namespace).steps] == [1]


def test_quarantine_refuses_a_symlinked_quarantine_dir(tmp_path, outside):
    st = _mixed_namespace(tmp_path)
    os.symlink(outside, st.layout.quarantine_dir)
    result = plan_cleanup(scan_namespace(st.layout, st.namespace), "quarantine").execute(st.namespace)
    assert len(result.errors) == 2 and result.items == ()
    assert sorted(os.listdir(outside)) == ["meta.json", "sentinel", "tq_batch.pt"]


@pytest.mark.parametrize("action", ["delete", "quarantine"])
def test_extra_steps_found_corrupt_by_verify_are_handled_like_corrupt_ones(tmp_path, action):
    from skip_harness.store import scan as scan_mod
    from skip_harness.config import Cleanup

    st = make(tmp_path, K=2)
    for step in (1, 2):
        write_step(st, step)
    p = st.layout.payload_path(2, 1, 0)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    report = scan_namespace(st.layout, st.namespace)
    assert report.counts()["complete"] == 2          # sizes match: only the checksum tells
    reason = st.reader.verify(2)[1]
    plan = plan_cleanup(report, Cleanup(action), extra=[(2, reason), (99, "not a step here")])
    assert [(i.step, i.status, i.reason, i.action) for i in plan.items] == [(2, "corrupt", reason, action)]
    result = plan.execute(st.namespace)
    assert result.errors == () and [i.step for i in result.items] == [2]
    assert {s.step for s in scan_namespace(st.layout, st.namespace).steps} == {1}
    if action == "quarantine":
        (moved,) = result.quarantined
        assert moved.parent == st.layout.quarantine_dir and (moved / "1" / "tq_batch.pt").exists()
    assert plan_cleanup(report, Cleanup.off, extra=[(2, reason)]).items == ()
    assert not hasattr(scan_mod, "CLEANUP_ACTIONS")  # config.Cleanup is the one list of actions


def test_scan_pauses_the_cyclic_gc_and_restores_it(tmp_path, monkeypatch):
    import gc

    from skip_harness.store import status as status_mod

    st = make(tmp_path, K=1)
    write_step(st, 1)
    seen = []
    real = status_mod.classify_step
    monkeypatch.setattr("skip_harness.store.scan.classify_step", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    assert gc.isenabled()
    scan_namespace(st.layout, open_namespace(st.layout), use_index=False)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        scan_namespace(st.layout, open_namespace(st.layout), use_index=False)
        assert not gc.isenabled()      # left as the caller had it
    finally:
        gc.enable()


def test_a_stale_index_note_counts_one_step_in_the_singular():
    """Issue 29's small ones: `index stale (1 changed steps)`."""
    from skip_harness.store.scan import _stale_note

    assert _stale_note([3], [], []) == "index stale (1 changed step)"
    assert _stale_note([3], [4], []) == "index stale (1 changed, 1 removed steps)"
    assert _stale_note([], [], []) is None
