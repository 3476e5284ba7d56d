"""index: the namespace index is a hint -- appended by every commit, used by the startup scan while it
matches the disk, rebuilt (with a note for the INFO line) when missing, corrupt or stale -- and an
index-backed scan reports exactly what a full scan does, whatever was changed behind its back."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest

from conftest import write_legacy, write_step
from skip_harness.store.open import open_namespace, open_store
from skip_harness.store import index
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.scan import scan_namespace
from skip_harness.store.stepstore import StepStore

FP = Fingerprint.from_values({"model": "m", "seed": 1})


def make(tmp_path, K=1, W=1) -> StepStore:
    return open_store(NamespaceKey("exp", "proj", 8, 2, 4, 4, K=K, W=W).layout(tmp_path / "cache"))


def index_lines(st):
    return (st.layout.root / index.INDEX_NAME).read_text().splitlines()


def age(st, seconds=30.0):
    """Pretend the whole namespace was written `seconds` ago (every directory and file), and make the
    scan rebuild its index now: the entries are then not 'racy', so the stamps alone must tell."""
    then = time.time() - seconds
    for d, dirs, files in os.walk(st.layout.root):
        for name in dirs + files:
            os.utime(os.path.join(d, name), (then, then), follow_symlinks=False)
    index.remove(st.namespace)
    scan_namespace(st.layout, st.namespace)
    assert all(not e.racy for e in index.read(st.layout, st.namespace).values())


def test_commit_appends_one_line_and_the_scan_uses_it(tmp_path):
    st = make(tmp_path, K=2)
    for step in (1, 2, 3):
        write_step(st, step, fingerprint=FP)
    lines = index_lines(st)
    assert json.loads(lines[0]) == {"skip_harness_index": index.INDEX_FORMAT, "K": 2, "W": 1}
    entries = [json.loads(x) for x in lines[1:]]
    assert [e["fp"] for e in entries if isinstance(e, dict)] == [FP.digest]   # one line per fingerprint
    assert [e[0] for e in entries if isinstance(e, list)] == [1, 2, 3]       # one line per commit
    age(st)
    report = scan_namespace(st.layout, st.namespace)
    assert report.index_used and report.index_note is None
    assert report.steps == scan_namespace(st.layout, open_namespace(st.layout), use_index=False).steps
    assert [s.fingerprint for s in report.steps] == [FP] * 3


def test_a_posix_stamp_is_the_hash_indexes_were_always_written_with(tmp_path):
    """xxh3_64 over the packed (inode, mtime) of the step's directory, (inode, size, mtime) of its commit
    record, then (inode, mtime) of each inner directory: an index written by any version since the
    stamps began must keep matching, or every upgrade would cost a full scan."""
    import struct

    import xxhash

    st = make(tmp_path, K=2)
    write_step(st, 4, fingerprint=FP)
    values, newest = [], 0
    for rel, is_file in (("4", False), ("4/commit.json", True), ("4/0", False), ("4/1", False)):
        s = os.stat(st.layout.root / rel, follow_symlinks=False)
        values += (s.st_ino, s.st_size, s.st_mtime_ns) if is_file else (s.st_ino, s.st_mtime_ns)
        newest = max(newest, s.st_mtime_ns)
    expected = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(values)}Q", *values))
    assert index.read_stamp(st.namespace, "4", 2) == (expected, newest)
    assert index.read_stamps(st.namespace, ["4", "5", "4"], 2) == [(expected, newest), None, (expected, newest)]
    assert index.read(st.layout, st.namespace)[4].stamp == expected


def test_trusted_steps_are_not_listed(tmp_path, monkeypatch):
    from skip_harness.store.posix.storage import PosixStorage

    st = make(tmp_path, K=4)
    for step in range(1, 6):
        write_step(st, step)
    age(st)
    listed = []
    real = PosixStorage.list
    monkeypatch.setattr(PosixStorage, "list", lambda self, p="": listed.append(p) or real(self, p))
    report = scan_namespace(st.layout, st.namespace)
    assert report.counts()["complete"] == 5 and listed == []   # stamps only: no step directory listed


@pytest.mark.parametrize("damage", ["missing", "garbage", "torn", "zeroed_tail", "other_K", "bad_field"])
def test_missing_or_corrupt_index_is_rebuilt_with_a_note(tmp_path, damage):
    st = make(tmp_path, K=2)
    for step in (1, 2):
        write_step(st, step)
    path = st.layout.root / index.INDEX_NAME
    full = scan_namespace(st.layout, open_namespace(st.layout), use_index=False)
    if damage == "missing":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage\n")
    elif damage == "torn":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "zeroed_tail":        # an append the crash kept the size of but not the bytes (not fsync'ed)
        data = path.read_bytes()
        last = data.rstrip(b"\n").rfind(b"\n") + 1
        path.write_bytes(data[:last] + bytes(len(data) - last))
    elif damage == "other_K":
        lines = index_lines(st)
        path.write_text("\n".join([lines[0].replace('"K":2', '"K":3')] + lines[1:]) + "\n")
    else:
        lines = index_lines(st)
        path.write_text("\n".join(lines[:1] + ['["1",2]'] + lines[2:]) + "\n")
    report = scan_namespace(st.layout, st.namespace)
    assert report.steps == full.steps
    word = "missing" if damage == "missing" else "corrupt"
    assert report.index_note.startswith(f"index {word}") and "rebuilt" in report.index_note
    assert sorted(index.read(st.layout, st.namespace)) == [1, 2]
    again = scan_namespace(st.layout, st.namespace)
    assert again.index_note is None and again.steps == full.steps


def test_stale_index_says_what_changed_and_is_rebuilt(tmp_path):
    st = make(tmp_path, K=1)
    for step in (1, 2, 3):
        write_step(st, step)
    age(st)
    shutil.rmtree(st.layout.step_dir(2))                          # removed by hand
    shutil.copytree(st.layout.step_dir(1), st.layout.step_dir(9))  # added by hand (a copied step)
    doc = json.loads(st.layout.commit_path(9).read_text())
    doc["step"] = 9
    st.layout.commit_path(9).write_text(json.dumps(doc))
    report = scan_namespace(st.layout, st.namespace)
    assert [(s.step, s.status) for s in report.steps] == [(1, "complete"), (3, "complete"), (9, "complete")]
    assert "1 removed" in report.index_note and "1 unindexed" in report.index_note
    assert "rebuilt" in report.index_note
    assert sorted(index.read(st.layout, st.namespace)) == [1, 3, 9]
    assert scan_namespace(st.layout, st.namespace).index_note is None


def test_an_unwritable_index_is_reported_and_the_scan_still_right(tmp_path, monkeypatch):
    st = make(tmp_path)
    write_step(st, 1)
    index.remove(st.namespace)
    monkeypatch.setattr(index, "rewrite", lambda layout, ns, entries: "Read-only file system")
    report = scan_namespace(st.layout, st.namespace)
    assert report.counts()["complete"] == 1
    assert "could not be rebuilt: Read-only file system" in report.index_note


def _every_status_behind_the_index(st, tmp_path):
    """A cache with every status, then changed by hand in every way the index must notice."""
    lay = st.layout
    for step in range(1, 13):
        write_step(st, step, fingerprint=FP)
    entries = st.writer.write_inner(20, 0, 0, {"x": 1}, {"gen_s": 1.0})
    entries += st.writer.write_inner(20, 1, 0, {"x": 2}, {"gen_s": 1.0})
    st.writer.commit(20, entries, FP, gen_s=2.0)
    write_legacy(lay, 13)                                      # unverified (no commit record)
    write_step(st, 14, inners=[0], commit=False)               # incomplete: interrupted run
    write_step(st, 15)
    lay.commit_path(15).write_text("garbage")                  # corrupt commit record
    return lay


def _hand_edits(st, tmp_path):
    lay = st.layout
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    shutil.rmtree(lay.step_dir(1))                                          # step removed
    (lay.payload_path(2, 1, 0)).unlink()                                    # file removed: corrupt
    lay.commit_path(3).unlink()                                             # commit removed: incomplete
    doc = json.loads(lay.commit_path(4).read_text())
    doc["files"][0]["bytes"] += 1
    lay.commit_path(4).write_text(json.dumps(doc))                          # commit edited: corrupt
    shutil.rmtree(lay.step_dir(5) / "1")                                    # inner dir removed
    os.symlink(outside, lay.step_dir(6) / "extra")                          # a link added: incomplete
    shutil.rmtree(lay.step_dir(7))
    os.symlink(outside, lay.step_dir(7))                                    # step replaced by a link
    write_step(st, 8, inners=[0], commit=False)                             # rewrite begun: incomplete
    (lay.inner_dir(9, 0) / ".tmp-tq_batch.pt.1.abcd").write_bytes(b"x")     # temp file in a step
    shutil.copytree(lay.step_dir(10), lay.step_dir(30))                     # copied in, wrong step no.
    write_legacy(lay, 31)                                                   # older cache added
    shutil.copytree(lay.step_dir(11), lay.step_dir(32))                     # copied and fixed up
    doc = json.loads((lay.step_dir(32) / "commit.json").read_text())
    doc["step"] = 32
    (lay.step_dir(32) / "commit.json").write_text(json.dumps(doc))
    (lay.step_dir(12) / "0").rename(lay.step_dir(12) / "0-old")             # inner dir renamed
    shutil.copytree(lay.step_dir(12) / "0-old", lay.step_dir(12) / "0")     # ... and put back


@pytest.mark.parametrize("aged", [False, True], ids=["just-written", "written-earlier"])
def test_index_backed_scan_agrees_with_the_full_scan_on_every_status(tmp_path, aged):
    st = make(tmp_path, K=2)
    _every_status_behind_the_index(st, tmp_path)
    if aged:
        age(st)
    before = scan_namespace(st.layout, st.namespace)
    assert before.steps == scan_namespace(st.layout, open_namespace(st.layout), use_index=False).steps
    _hand_edits(st, tmp_path)
    full = scan_namespace(st.layout, open_namespace(st.layout), use_index=False)
    statuses = {s.step: s.status for s in full.steps}
    assert set(statuses.values()) == {"complete", "unverified", "incomplete", "corrupt"}
    assert statuses[2] == statuses[4] == statuses[30] == "corrupt" and statuses[32] == "complete"
    assert 1 not in statuses and statuses[31] == "unverified"
    for attempt in range(2):            # the first reconciles (and rewrites) the index, the next reads it
        report = scan_namespace(st.layout, st.namespace)
        assert report.steps == full.steps, attempt
    assert report.index_note is None
    assert report.index_used or not aged   # just written, every entry may still be racy (rechecked in full)
    assert [s.gen_s for s in full.steps if s.step == 20] == [2.0]


def test_cli_ls_and_verify_agree_with_the_full_scan(tmp_path, capsys):
    from skip_harness.cli import main

    st = make(tmp_path, K=2)
    _every_status_behind_the_index(st, tmp_path)
    age(st)
    _hand_edits(st, tmp_path)
    full = {s.step: s.status for s in scan_namespace(st.layout, open_namespace(st.layout), use_index=False).steps}
    dump = tmp_path / "cache"
    for cmd in ("ls", "verify"):   # in this process (the console entry point runs in a subprocess in test_cli)
        capsys.readouterr()
        code = main([cmd, str(dump), "--json"])
        out, err = capsys.readouterr()
        assert code in (0, 1), err
        (ns,) = json.loads(out)["namespaces"]
        got = {s["step"]: s["status"] for s in ns["steps"]}
        assert got == full, cmd


def test_a_change_in_the_same_clock_tick_as_the_commit_is_still_seen(tmp_path):
    """Like git's racy-clean rule: an entry written right after its stamp is rechecked in full."""
    st = make(tmp_path, K=1)
    write_step(st, 1)
    step_dir = st.layout.step_dir(1)
    before = os.stat(step_dir)
    (step_dir / "meta.json").unlink()      # removed ...
    os.utime(step_dir, ns=(before.st_atime_ns, before.st_mtime_ns))   # ... within the same mtime tick
    assert index.read(st.layout, st.namespace)[1].racy
    report = scan_namespace(st.layout, st.namespace)
    assert report.get(1).status == "corrupt"
    assert report.steps == scan_namespace(st.layout, open_namespace(st.layout), use_index=False).steps


def test_cleanup_forgets_the_steps_it_removes(tmp_path):
    from skip_harness.store.cleanup import plan_cleanup

    st = make(tmp_path, K=1)
    for step in (1, 2, 3):
        write_step(st, step)
    p = st.layout.payload_path(2, 0, 0)
    p.write_bytes(p.read_bytes()[:-1] + b"\x00")
    report = scan_namespace(st.layout, st.namespace)
    plan_cleanup(report, "quarantine", extra=[(2, st.reader.verify(2)[1])]).execute(st.namespace)
    assert sorted(index.read(st.layout, st.namespace)) == [1, 3]
    after = scan_namespace(st.layout, st.namespace)
    assert after.index_note is None and [s.step for s in after.steps] == [1, 3]


def test_a_lost_append_leaves_its_step_to_the_full_scan(tmp_path):
    """The index's appends are not fsync'ed (a hint: an fsync on the writer thread slows the training
    step on every core): a crash may lose the last lines whole. The steps they described are classified
    in full, and the index is rewritten with them."""
    st = make(tmp_path, K=2)
    for step in (1, 2, 3):
        write_step(st, step)
    path = st.layout.root / index.INDEX_NAME
    full = scan_namespace(st.layout, open_namespace(st.layout), use_index=False)
    path.write_text("\n".join(index_lines(st)[:-2]) + "\n")           # steps 2 and 3 lost
    assert sorted(index.read(st.layout, st.namespace)) == [1]
    report = scan_namespace(st.layout, st.namespace)
    assert report.steps == full.steps
    assert sorted(index.read(st.layout, st.namespace)) == [1, 2, 3]


def test_a_commits_index_line_costs_no_fsync(tmp_path, monkeypatch):
    st = make(tmp_path)
    write_step(st, 1)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    before = len(index_lines(st))
    entries = st.writer.write_inner(2, 0, 0, {"x": __import__("torch").arange(10)}, {})
    synced.clear()
    real_committed = index.IndexWriter.committed
    during = []

    def committed(self, *a, **k):
        n = len(synced)
        real_committed(self, *a, **k)
        during.append(len(synced) - n)

    monkeypatch.setattr(index.IndexWriter, "committed", committed)
    st.writer.commit(2, entries, None)
    assert len(index_lines(st)) == before + 1 and during == [0]
    assert synced            # the commit record itself is durable
