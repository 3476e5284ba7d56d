"""store: atomic, durable writes; commit records; verified reads; never through a symlink."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import xxhash

from conftest import assert_batch_equal, batch, subprocess_env, write_legacy, write_step
from skip_harness.store.open import open_namespace, open_store
from skip_harness import codec
from skip_harness.store import payload_file
from skip_harness.store import stepstore as store_mod
from skip_harness.store.posix import storage as posix_backend
from skip_harness.store.posix.fileops import HashingWriter
from skip_harness.errors import CorruptStepError, HarnessUsageError
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import Layout, NamespaceKey
from skip_harness.store.scan import classify_step, scan_namespace
from skip_harness.store.commit import FileEntry, parse_commit
from skip_harness.store.stepstore import StepStore


def make(tmp_path, K=1, W=1) -> StepStore:
    return open_store(NamespaceKey("exp", "proj", 8, 2, 4, 4, K=K, W=W).layout(tmp_path / "cache"))


def temp_files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith(".tmp-")]


@pytest.mark.parametrize("K,W", [(1, 1), (3, 1), (1, 2), (2, 2)])
def test_write_commit_verify_read(tmp_path, K, W):
    st = make(tmp_path, K, W)
    fp = Fingerprint({"seed": 3, "mode": "sync"})
    entries = write_step(st, 4, fingerprint=fp)
    assert len(entries) == 2 * K * W
    for e in entries:
        path = st.layout.step_dir(4) / e.rel
        data = path.read_bytes()
        assert e.bytes == len(data) and e.checksum == xxhash.xxh3_128_hexdigest(data)
    report = st.status(4)
    assert report.status == "complete" and report.fingerprint == fp and report.has_commit
    assert st.reader.verify(4)[1] is None
    for i in range(K):
        for r in range(W):
            assert_batch_equal(st.reader.read_inner(4, i, r), batch(4, i, r))
            meta = st.reader.read_meta(4, i, r)
            assert meta["note"] == "test" and meta["writer"] == "skip_harness"
            assert (meta["step"], meta["inner_index"], meta["rank"], meta["K"], meta["W"]) == (4, i, r, K, W)
            pay = st.layout.payload_path(4, i, r)
            assert meta["bytes"] == pay.stat().st_size
            assert meta["checksum"] == xxhash.xxh3_128_hexdigest(pay.read_bytes())
            assert isinstance(meta["created"], float)
    record = st.reader.read_commit(4)
    assert (record.step, record.K, record.W, record.fingerprint) == (4, K, W, fp)
    assert sorted(record.files, key=lambda e: e.rel) == sorted(entries, key=lambda e: e.rel)
    doc = json.loads(st.layout.commit_path(4).read_text())
    assert doc["format"] == 1 and doc["fingerprint"] == fp.to_json()
    assert {f["rel"] for f in doc["files"]} == {e.rel for e in entries}
    assert temp_files(st.layout.root) == []


def test_file_names_follow_the_layout(tmp_path):
    st = make(tmp_path, K=1, W=1)
    write_step(st, 1)
    assert sorted(os.listdir(st.layout.step_dir(1))) == ["commit.json", "meta.json", "tq_batch.pt"]
    st2 = make(tmp_path, K=2, W=2)
    write_step(st2, 1)
    assert sorted(os.listdir(st2.layout.step_dir(1) / "1")) == [
        "meta_rank0.json", "meta_rank1.json", "tq_batch_rank0.pt", "tq_batch_rank1.pt"]


def test_positions_are_checked(tmp_path):
    st = make(tmp_path, K=2, W=1)
    for args in ((-1, 0, 0), (True, 0, 0), (1.0, 0, 0), (1, 2, 0), (1, 0, 1), (1, -1, 0)):
        with pytest.raises(HarnessUsageError):
            st.writer.write_inner(*args, payload={}, meta={})
    # step 0 is a step (0-based trainers)
    write_step(st, 0)
    assert st.reader.verify(0)[1] is None and st.reader.read_step(0, 0)[1]["tag"] == "s0i1r0"


def test_commit_refuses_missing_entries_and_wrong_sizes(tmp_path):
    st = make(tmp_path, K=2)
    entries = write_step(st, 1, commit=False)
    with pytest.raises(HarnessUsageError, match="1/tq_batch.pt"):
        st.writer.commit(1, [e for e in entries if e.rel != "1/tq_batch.pt"], None)
    bad = [FileEntry(e.rel, e.bytes + 1, e.checksum) if e.rel == "0/meta.json" else e for e in entries]
    with pytest.raises(CorruptStepError, match="0/meta.json"):
        st.writer.commit(1, bad, None)
    with pytest.raises(HarnessUsageError, match="unsafe"):
        st.writer.commit(1, entries + [FileEntry("../../x", 1, "ab")], None)
    assert not st.layout.commit_path(1).exists()
    st.writer.commit(1, entries, None)
    assert st.status(1).status == "complete"


def test_a_commit_lists_again_only_the_files_this_writer_did_not_store(tmp_path, monkeypatch):
    """The files a writer stored for a step were size-checked as they were stored: its commit does not list
    the step again for them (W = 1: no listing at all; one LIST request less a step on an object store).
    Another rank's files, and any entry that is not exactly what was stored, are listed and checked."""
    from skip_harness.store.namespace import Namespace

    listed = []
    real = Namespace.list_step
    monkeypatch.setattr(Namespace, "list_step", lambda self, step: (listed.append(step), real(self, step))[1])
    st = make(tmp_path, K=2)
    st.writer.commit(1, write_step(st, 1, commit=False), None)
    assert listed == [] and st.status(1).status == "complete"

    listed.clear()
    entries = write_step(st, 2, commit=False)
    (st.layout.step_dir(2) / entries[0].rel).unlink()               # an entry altered after it was stored
    with pytest.raises(CorruptStepError, match="missing"):
        st.writer.commit(2, [FileEntry(entries[0].rel, entries[0].bytes, "0" * 32), *entries[1:]], None)
    assert listed == [2]

    w2 = make(tmp_path / "w2", K=1, W=2)
    other = open_store(w2.layout)                                   # rank 1's writer, in another process
    mine = write_step(w2, 3, commit=False, ranks=[0])
    theirs = write_step(other, 3, commit=False, ranks=[1])
    (w2.layout.step_dir(3) / theirs[0].rel).unlink()
    listed.clear()
    with pytest.raises(CorruptStepError, match="missing"):
        w2.writer.commit(3, mine + theirs, None)
    assert listed == [3]

    stored = write_step(st, 4, commit=False)
    st.writer.clear_step(4)                                         # what was stored is gone: not trusted
    listed.clear()
    with pytest.raises(CorruptStepError, match="does not exist"):
        st.writer.commit(4, stored, None)
    assert listed == [4]


def test_rewriting_a_committed_step_removes_its_commit_record_first(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    st.writer.write_inner(1, 0, 0, {"new": torch.ones(1)}, {})
    assert not st.layout.commit_path(1).exists()
    assert st.status(1).status == "incomplete"


def test_verify_detects_a_flipped_byte(tmp_path):
    st = make(tmp_path, K=2, W=2)
    write_step(st, 1)
    path = st.layout.payload_path(1, 1, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert st.status(1).status == "complete"            # same size: the scan cannot tell
    status, reason = st.reader.verify(1, load=False)
    assert status == "corrupt" and reason is not None and str(path) in reason and "checksum" in reason
    assert st.reader.verify(1) == (status, reason)                 # the load check comes after the checksums
    assert st.reader.verify(1, ranks=[0]) == ("complete", None)   # rank 0's files are intact
    assert st.reader.verify(1, ranks=[1])[1] is not None


def test_verify_detects_a_flipped_byte_in_a_meta_file(tmp_path):
    st = make(tmp_path, K=1)
    write_step(st, 2)
    path = st.layout.meta_path(2, 0, 0)
    text = path.read_text()
    path.write_text(text.replace('"test"', '"tesT"'))
    status, reason = st.reader.verify(2)
    assert status == "corrupt" and "meta.json" in reason


def test_verify_reports_incomplete_and_corrupt(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1, inners=[0], commit=False)
    status, reason = st.reader.verify(1)
    assert status == "incomplete" and reason.startswith("incomplete")
    write_step(st, 2)
    with open(st.layout.payload_path(2, 0, 0), "ab") as f:
        f.write(b"x")
    status, reason = st.reader.verify(2, load=False)
    assert status == "corrupt" and reason.startswith("corrupt")


def test_read_inner_of_a_damaged_payload_raises_corrupt_step_error(tmp_path):
    st = make(tmp_path)
    write_step(st, 1)
    path = st.layout.payload_path(1, 0, 0)
    path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.raises(CorruptStepError) as err:
        st.reader.read_inner(1, 0, 0)
    assert err.value.path == path
    with pytest.raises(CorruptStepError, match="missing"):
        st.reader.read_inner(2, 0, 0)


@pytest.mark.parametrize("form", ["", "0/"])
def test_legacy_k1_step_is_unverified_and_loads(tmp_path, form):
    st = make(tmp_path, K=1)
    payloads = write_legacy(st.layout, 3, form)
    assert st.status(3).status == "unverified"
    assert st.reader.read_commit(3) is None
    assert st.reader.verify(3) == ("unverified", None) == st.reader.verify(3, load=False)
    assert_batch_equal(st.reader.read_inner(3, 0, 0), payloads[(0, 0)])
    assert st.reader.read_meta(3, 0, 0) == {"global_steps": 3}


def test_read_commit_validates(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    assert st.reader.read_commit(2) is None
    path = st.layout.commit_path(1)
    doc = json.loads(path.read_text())
    for mutate, reason in [
        (lambda d: d.update(K=3), "K=3"),
        (lambda d: d.update(step=9), "step 9"),
        (lambda d: d.update(format=99), "format"),
        (lambda d: d["files"].pop(), "does not list"),
        (lambda d: d["files"].append({"rel": "../x", "bytes": 1, "checksum": "a"}), "unsafe"),
    ]:
        d = json.loads(json.dumps(doc))
        mutate(d)
        path.write_text(json.dumps(d))
        with pytest.raises(CorruptStepError, match=reason):
            st.reader.read_commit(1)
    path.write_text("{not json")
    with pytest.raises(CorruptStepError, match="does not parse"):
        st.reader.read_commit(1)


def test_clear_step_unlinks_the_commit_record_first(tmp_path, monkeypatch):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    write_step(st, 2)
    size = sum(p.stat().st_size for p in st.layout.step_dir(1).rglob("*") if p.is_file())

    def interrupted(*a, **k):
        raise OSError("interrupted")

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    assert st.writer.clear_step(1) == size
    assert not st.layout.step_dir(1).exists()            # renamed away before removal
    (trash,) = [p for p in st.layout.root.iterdir() if p.name.startswith(".trash-")]
    assert not (trash / "commit.json").exists()          # the commit record went first
    assert (trash / "0" / "tq_batch.pt").exists()        # the rest was still there when removal stopped
    monkeypatch.undo()
    assert st.writer.clear_step(2) > 0 and not st.layout.step_dir(2).exists()
    assert st.writer.clear_step(2) == 0 and st.writer.clear_step(99) == 0
    report = scan_namespace(st.layout, st.namespace)
    assert report.steps == () and len(report.leftovers) == 1   # the interrupted removal's trash


def test_symlinked_step_dir_is_never_followed(tmp_path):
    st = make(tmp_path, K=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    st.layout.root.mkdir(parents=True)
    link = st.layout.step_dir(1)
    os.symlink(outside, link)
    torch.save(batch(1, 0), outside / "tq_batch.pt")
    (outside / "meta.json").write_text("{}")
    assert st.status(1).status == "incomplete"
    with pytest.raises(CorruptStepError, match="symlink"):
        st.reader.read_inner(1, 0, 0)
    with pytest.raises(CorruptStepError, match="symlink"):
        st.reader.read_commit(1)
    assert st.reader.verify(1)[1] is not None
    # writing replaces the link by a real directory; nothing is written outside
    write_step(st, 1)
    assert not link.is_symlink() and link.is_dir()
    assert sorted(os.listdir(outside)) == ["meta.json", "sentinel", "tq_batch.pt"]
    assert (outside / "sentinel").read_text() == "keep me"
    assert st.status(1).status == "complete"
    # clearing a linked step removes the link only
    os.symlink(outside, st.layout.step_dir(2))
    assert st.writer.clear_step(2) > 0
    assert not os.path.lexists(st.layout.step_dir(2)) and (outside / "sentinel").exists()


def test_symlinked_inner_dir_is_never_followed(tmp_path):
    st = make(tmp_path, K=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    step_dir = st.layout.step_dir(1)
    step_dir.mkdir(parents=True)
    os.symlink(outside, step_dir / "1")
    assert st.status(1).status == "incomplete"
    write_step(st, 1)
    assert os.listdir(outside) == ["sentinel"]
    assert not (step_dir / "1").is_symlink()
    assert st.status(1).status == "complete" and st.reader.verify(1)[1] is None


def test_payload_file_that_is_a_symlink_is_not_read(tmp_path):
    st = make(tmp_path)
    write_step(st, 1)
    target = tmp_path / "elsewhere.pt"
    torch.save(batch(1, 0), target)
    pay = st.layout.payload_path(1, 0, 0)
    pay.unlink()
    os.symlink(target, pay)
    with pytest.raises(CorruptStepError, match="symlink"):
        st.reader.read_inner(1, 0, 0)
    assert st.status(1).status == "incomplete"


# ---------------------------------------------------------------------------------------------
# interrupted writes: fail at every point of the protocol in turn


class Boom(Exception):
    pass


def test_a_mini_batch_is_made_durable_with_one_directory_fsync(tmp_path, monkeypatch):
    """The payload and its meta.json are each fsynced, renamed, then their directory fsynced once for
    both (issue 42: each fsync a miss's writer thread makes costs the training step CPU)."""
    st = make(tmp_path)
    st.writer.write_inner(1, 0, 0, batch(1, 0), {})            # the step's directory exists from now on
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    payload, meta = st.writer.write_inner(1, 0, 0, batch(1, 1), {})
    step_dir = str(st.layout.step_dir(1))
    assert ["dir" if p == step_dir else os.path.basename(p).rsplit(".", 2)[0] for p in synced] == \
        [".tmp-tq_batch.pt", ".tmp-meta.json", "dir"]
    assert_batch_equal(payload_file.load(st.layout.payload_path(1, 0, 0)), batch(1, 1))


def _instrument(monkeypatch, fail_at):
    """Count every protocol operation; raise Boom at operation number `fail_at` (None: never)."""
    counter = {"n": 0, "ops": []}
    targets = [
        (os, "fsync"), (os, "replace"), (os, "rename"), (os, "mkdir"), (os, "unlink"),
        (codec, "plan"), (os, "pwrite"), (json, "dumps"), (posix_backend, "write_file_at"),
    ]
    for mod, name in targets:
        orig = getattr(mod, name)

        def wrapped(*a, __orig=orig, __name=name, **k):
            n = counter["n"]
            counter["n"] += 1
            counter["ops"].append(__name)
            if fail_at is not None and n == fail_at:
                raise Boom(f"{__name} #{n}")
            return __orig(*a, **k)

        monkeypatch.setattr(mod, name, wrapped)
    return counter


def _protocol(st, step):
    entries = []
    for i in range(st.layout.K):
        entries += st.writer.write_inner(step, i, 0, batch(step, i), {"note": "x"})
    st.writer.commit(step, entries, Fingerprint({"seed": 1}))


def _check_no_partial_final_files(st, step):
    lay = st.layout
    for i in range(lay.K):
        pay, meta = lay.payload_path(step, i, 0), lay.meta_path(step, i, 0)
        if pay.exists():
            assert_batch_equal(payload_file.load(pay), batch(step, i))
        if meta.exists():
            assert json.loads(meta.read_text())["bytes"] == pay.stat().st_size
    if lay.commit_path(step).exists():
        parse_commit(lay.commit_path(step).read_bytes(), lay, step, lay.commit_path(step))


@pytest.mark.parametrize("K", [1, 2])
def test_write_interrupted_at_every_point(tmp_path, monkeypatch, K):
    probe = make(tmp_path / "probe", K=K)
    with monkeypatch.context() as m:
        total = _instrument(m, None)
        _protocol(probe, 1)
    n_ops = total["n"]
    assert n_ops >= 8 * K
    for fail_at in range(n_ops):
        st = make(tmp_path / f"run{fail_at}", K=K)
        with monkeypatch.context() as m:
            counter = _instrument(m, fail_at)
            with pytest.raises(Boom):
                _protocol(st, 1)
            failed_op = counter["ops"][-1]
        report = classify_step(st.layout, 1, namespace=st.namespace)
        committed = st.layout.commit_path(1).exists()
        assert report.status in ("complete", "incomplete"), (fail_at, failed_op, report)
        assert (report.status == "complete") == committed, (fail_at, failed_op, report)
        if committed:  # only the very last directory fsync can fail after the commit record is in place
            assert st.reader.verify(1)[1] is None
        _check_no_partial_final_files(st, 1)
        assert temp_files(st.layout.root) == [], (fail_at, failed_op)
        # the step can be written again from inner index 0
        st.writer.clear_step(1)
        _protocol(st, 1)
        assert st.status(1).status == "complete" and st.reader.verify(1)[1] is None


KILL_WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from skip_harness.store.layout import Layout
    from skip_harness.store.open import open_store
    st = open_store(Layout(Path(sys.argv[1]), K=2, W=1))
    g = torch.Generator().manual_seed(0)
    step = 1
    while True:
        entries = []
        for i in range(2):
            # many small tensors: most of the time goes into writing, so kills land mid-file
            payload = {"many": [torch.randn(64, generator=g) for _ in range(3000)], "step": step}
            entries += st.writer.write_inner(step, i, 0, payload, {"step": step})
        st.writer.commit(step, entries, None)
        sys.stdout.write(f"{step}\\n"); sys.stdout.flush()
        step += 1
    """
)


@pytest.mark.slow  # a subprocess (imports torch): seconds, more on a busy machine
def test_killed_writer_leaves_only_complete_or_incomplete_steps(tmp_path):
    root = tmp_path / "ns"
    for delay in (0.1, 0.35):
        proc = subprocess.Popen([sys.executable, "-c", KILL_WRITER, str(root)], stdout=subprocess.PIPE,
                                text=True, env=subprocess_env())
        try:
            assert proc.stdout.readline().strip() == "1", "the writer did not start"
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        lay = Layout(root, K=2, W=1)
        report = scan_namespace(lay, open_namespace(lay))
        statuses = {s.status for s in report.steps}
        assert statuses <= {"complete", "incomplete"}, report
        assert report.by_status("complete")
        st = open_store(lay)
        for s in report.by_status("complete"):
            assert st.reader.verify(s.step)[1] is None
        # even in the step that was being written, no file under its final name is partial
        for s in report.steps[-2:]:
            for i in range(2):
                if lay.payload_path(s.step, i, 0).exists():
                    assert payload_file.load(lay.payload_path(s.step, i, 0))["step"] == s.step
                if lay.meta_path(s.step, i, 0).exists():
                    assert json.loads(lay.meta_path(s.step, i, 0).read_text())["step"] == s.step
        shutil.rmtree(root)


@pytest.mark.parametrize("die_in", ["payload", "meta"])
def test_process_dying_inside_a_write_leaves_no_partial_final_file(tmp_path, die_in):
    """Deterministic version of the kill test: a forked writer calls os._exit halfway through a file."""
    import multiprocessing

    st = make(tmp_path, K=1)
    payload = {"x": torch.randn(1 << 16), "step": 1}

    def child():
        orig, orig_pwrite = HashingWriter.write, os.pwrite

        def write(self, data):  # meta.json (and commit.json) go through HashingWriter
            view = memoryview(data).cast("B")
            if die_in == "meta" and len(view) > 8:
                orig(self, view[: len(view) // 2])
                self.flush()
                os._exit(17)  # dies with the file half written: no cleanup code runs
            return orig(self, data)

        def pwrite(fd, data, offset):  # payloads are written from a pool buffer
            view = memoryview(data).cast("B")
            orig_pwrite(fd, view[: len(view) // 2 // 4096 * 4096], offset)
            os._exit(17)

        HashingWriter.write = write
        if die_in == "payload":
            os.pwrite = pwrite
        st.writer.write_inner(1, 0, 0, payload, {"note": "x"})
        os._exit(0)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 17
    lay = st.layout
    assert len(temp_files(lay.root)) == 1                     # the half-written file kept its temp name
    assert lay.payload_path(1, 0, 0).exists() == (die_in == "meta")
    if die_in == "meta":
        assert torch.equal(payload_file.load(lay.payload_path(1, 0, 0))["x"], payload["x"])
    assert not lay.meta_path(1, 0, 0).exists()
    r = st.status(1)
    assert r.status == "incomplete" and ".tmp-" in r.reason
    st.writer.clear_step(1)
    write_step(st, 1)
    assert st.reader.verify(1)[1] is None


# --------------------------------------------------------------------------------------------
# verify: checksums and a safe load; module hygiene


class _Evil:
    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (os.mkdir, (self.mark,))


def _replace_payload_keeping_the_commit_valid(st, step, rel, content: bytes):
    """Overwrite a committed payload and rewrite the commit record with its new size and checksum, as an
    attacker (or a bug) could: every size and checksum then matches."""
    path = st.layout.step_dir(step) / rel
    path.write_bytes(content)
    commit = st.layout.commit_path(step)
    doc = json.loads(commit.read_text())
    for f in doc["files"]:
        if f["rel"] == rel:
            f["bytes"], f["checksum"] = len(content), xxhash.xxh3_128_hexdigest(content)
    commit.write_text(json.dumps(doc))
    return path


def test_verify_refuses_a_payload_that_needs_pickled_code_even_when_checksums_match(tmp_path):
    st = make(tmp_path, K=2, W=2)
    write_step(st, 1)
    mark = tmp_path / "pwned"
    buf = tmp_path / "evil.pt"
    torch.save({"x": torch.ones(1), "e": _Evil(str(mark))}, buf)
    path = _replace_payload_keeping_the_commit_valid(st, 1, "1/tq_batch_rank1.pt", buf.read_bytes())
    assert st.reader.verify(1, load=False) == ("complete", None)   # sizes and checksums alone cannot tell
    status, reason = st.reader.verify(1)
    assert status == "corrupt" and reason is not None and reason.count(str(path)) == 1 and "pickled code" in reason
    assert "weights_only" not in reason and "False" not in reason
    assert st.reader.verify(1, ranks=[0]) == ("complete", None)   # only rank 1's shard is bad
    assert st.reader.verify(1, ranks=[1]) == ("corrupt", reason)
    with pytest.raises(CorruptStepError) as err:
        st.reader.read_inner(1, 1, 1)
    assert str(err.value).count(str(path)) == 1 and "weights_only" not in str(err.value)
    assert not mark.exists()


def test_verify_checks_sizes_checksums_and_status(tmp_path):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    write_step(st, 2)
    write_step(st, 3, commit=False)
    assert st.reader.verify(1) == ("complete", None)
    p = st.layout.payload_path(2, 1, 0)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    status, reason = st.reader.verify(2)
    assert status == "corrupt" and "checksum" in reason and str(p) in reason
    assert st.reader.verify(3)[0] == "incomplete" and st.reader.verify(3)[1].startswith("incomplete")
    # an older cache (no checksums): only the load check applies
    legacy = make(tmp_path / "old", K=1)
    write_legacy(legacy.layout, 4)
    assert st.reader.verify(1)[1] is None and legacy.reader.verify(4) == ("unverified", None)
    torch.save({"e": _Evil(str(tmp_path / "pwned"))}, legacy.layout.payload_path(4, 0, 0))
    status, reason = legacy.reader.verify(4)
    assert status == "corrupt" and "pickled code" in reason
    assert legacy.reader.verify(4, load=False) == ("unverified", None)   # no checksums: nothing to tell without loading
    assert not (tmp_path / "pwned").exists()


def test_verify_needs_no_registered_type_and_read_says_what_to_register(tmp_path):
    import collections

    Row = collections.namedtuple("Row", ["ids"])
    codec.register_type(Row)
    st = make(tmp_path)
    entries = st.writer.write_inner(1, 0, 0, {"row": Row(torch.arange(3))}, {})
    st.writer.commit(1, entries, None)
    codec.unregister_type(Row)
    assert st.reader.verify(1)[1] is None       # e.g. `skip-harness verify`, which registers nothing
    with pytest.raises(codec.UnregisteredTypeError, match=r"register_type\(Row\)"):
        st.reader.read_inner(1, 0, 0)             # not a corrupt step: the reader must register the type


def test_step_store_is_split_by_job(tmp_path):
    """StepStore is the opened namespace: writing is its writer's job, reading and verifying its
    reader's; none of the old methods is left on it to forward."""
    from skip_harness.store.reader import StepReader
    from skip_harness.store.writer import StepWriter

    st = make(tmp_path)
    assert isinstance(st.writer, StepWriter) and isinstance(st.reader, StepReader)
    assert st.writer.namespace is st.namespace is st.reader.namespace and st.writer.pool is st.pool is st.reader.pool
    for name in ("write_inner", "stage_inner", "commit", "clear_step", "read_commit", "read_served", "read_inner",
                 "read_step", "read_meta", "logical_bytes", "verify", "verify_status", "verify_checksums",
                 "verify_step"):
        assert not hasattr(st, name), name
    assert [n for n in ("verify_status", "verify_checksums", "verify_step") if hasattr(st.reader, n)] == []


def test_read_meta_reads_through_the_backend_on_posix_too(tmp_path, monkeypatch):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    keys = []
    real = type(st.namespace).read_small

    def read_small(self, key):
        keys.append(key)
        return real(self, key)

    monkeypatch.setattr(type(st.namespace), "read_small", read_small)
    assert st.reader.read_meta(1, 1, 0)["note"] == "test"
    assert keys == ["1/1/meta.json"]
    path = st.layout.meta_path(1, 0, 0)
    path.unlink()
    path.symlink_to(st.layout.meta_path(1, 1, 0))          # never followed
    with pytest.raises(CorruptStepError) as err:
        st.reader.read_meta(1, 0, 0)
    assert err.value.path == path and "symlink" in str(err.value)
    st.layout.meta_path(1, 1, 0).write_text("[1]")
    with pytest.raises(CorruptStepError, match="not a JSON object") as err:
        st.reader.read_meta(1, 1, 0)
    assert err.value.path == st.layout.meta_path(1, 1, 0)


def test_store_does_no_logging(tmp_path, caplog):
    st = make(tmp_path, K=2)
    write_step(st, 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, st.layout.step_dir(2))
    (st.layout.step_dir(1) / "0").rename(st.layout.step_dir(1) / "0-moved")
    os.symlink(outside, st.layout.step_dir(1) / "0")
    with caplog.at_level("DEBUG"):
        write_step(st, 1)                  # rewrites a committed step, replaces a linked inner dir
        write_step(st, 2)                  # replaces a linked step dir
        st.writer.clear_step(1)
    assert caplog.records == []
    assert os.listdir(outside) == []
    assert not hasattr(store_mod, "logger") and not hasattr(store_mod, "new_hasher")
    from skip_harness.store.posix import fileops
    from skip_harness.store import status as stepstatus

    for module in (store_mod, fileops, stepstatus):
        assert "import logging" not in open(module.__file__).read(), module.__name__


@pytest.mark.slow  # a subprocess (imports torch): seconds, more on a busy machine
def test_commit_records_generation_seconds_and_time_for_the_scan(tmp_path):
    st = make(tmp_path)
    entries = st.writer.write_inner(1, 0, 0, batch(1, 0), {})
    t0 = time.time()
    record = st.writer.commit(1, entries, None, gen_s=1.25)
    assert record.gen_s == 1.25 and st.reader.read_commit(1).gen_s == 1.25
    rep = classify_step(st.layout, 1, namespace=st.namespace)
    assert rep.gen_s == 1.25 and abs(rep.created - t0) < 60
    meta = st.reader.read_meta(1, 0, 0)
    assert meta["format"] == codec.FORMAT_VERSION


def test_stage_inner_copies_the_payload_once_and_completes_on_another_thread(tmp_path):
    import threading

    st = make(tmp_path, K=2)
    x = torch.arange(10.0)
    staged = [st.writer.stage_inner(1, i, 0, {"x": x, "i": i}, {"gen_s": 0.5}) for i in range(2)]
    x.fill_(-1)                                  # the trainer changes its batch right after sample
    assert not temp_files(st.layout.root) and not st.layout.payload_path(1, 0, 0).exists()  # nothing written yet
    results = []
    t = threading.Thread(target=lambda: results.extend(s.complete() for s in staged))
    t.start()
    t.join()
    entries = [e for pair in results for e in pair]
    st.writer.commit(1, entries, None)
    assert st.reader.verify(1)[1] is None and not temp_files(st.layout.root)
    assert torch.equal(st.reader.read_inner(1, 1, 0)["x"], torch.arange(10.0))
    assert st.reader.read_meta(1, 0, 0)["gen_s"] == 0.5
    with pytest.raises(HarnessUsageError, match="already"):
        staged[0].complete()
    with pytest.raises(codec.UnregisteredTypeError):   # an unregistered dataclass: refused, nothing left
        st.writer.stage_inner(3, 0, 0, {"a": Fingerprint()}, {})
    assert not temp_files(st.layout.root)


def _spy_opens(monkeypatch):
    opened = []
    real = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        fd = real(path, flags, mode, dir_fd=dir_fd)
        opened.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), flags))
        return fd

    monkeypatch.setattr(os, "open", spy)
    return opened


def _kind(name):
    return name.split(".tmp-")[-1].split(".")[0]


def test_payloads_are_written_and_read_past_the_page_cache(tmp_path, monkeypatch):
    st = make(tmp_path, K=2)
    opened = _spy_opens(monkeypatch)
    write_step(st, 1)
    direct = sorted(_kind(n) for n, flags in opened if flags & os.O_DIRECT)
    assert direct == ["tq_batch", "tq_batch"]                       # payloads only; meta and commit buffered
    opened.clear()
    status, reason, batches, metas = st.reader.read_served(1, 0)
    assert (status, reason, len(batches), len(metas)) == ("complete", None, 2, 2)
    assert sorted(_kind(n) for n, flags in opened if flags & os.O_DIRECT) == ["tq_batch", "tq_batch"]
    assert torch.equal(batches[1]["x"], st.reader.read_inner(1, 1, 0)["x"])


@pytest.mark.parametrize("refused_at", ["open", "io"])
def test_without_o_direct_payloads_go_through_the_page_cache_and_leave_it(tmp_path, monkeypatch, refused_at):
    """A file system that refuses O_DIRECT (EINVAL at open, like tmpfs on older kernels, or at the first
    read or write): the same files, written and read through the page cache; written pages dropped."""
    import errno as _errno
    import fcntl

    st = make(tmp_path, K=2)
    real_open, real_pwrite, real_preadv = os.open, os.pwrite, os.preadv
    refused = []

    def no_direct_open(path, flags, mode=0o777, *, dir_fd=None):
        if refused_at == "open" and flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(_errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def checked(real):
        def io(fd, *args):
            if refused_at == "io" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                refused.append(fd)
                raise OSError(_errno.EINVAL, "Invalid argument")
            return real(fd, *args)
        return io

    advised = []
    real_advise = os.posix_fadvise

    def spy(fd, offset, length, advice):
        advised.append((_kind(os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))), advice))
        return real_advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "open", no_direct_open)
    monkeypatch.setattr(os, "pwrite", checked(real_pwrite))
    monkeypatch.setattr(os, "preadv", checked(real_preadv))
    monkeypatch.setattr(os, "posix_fadvise", spy)
    # payloads of more than one block: a direct write is tried for whole blocks only
    entries = [e for i in range(2) for e in st.writer.write_inner(1, i, 0, {"x": torch.arange(3000.0) + i}, {})]
    st.writer.commit(1, entries, None)
    assert len(refused) == 2
    assert advised == [("tq_batch", os.POSIX_FADV_DONTNEED)] * 2
    status, reason, batches, _ = st.reader.read_served(1, 0)
    assert (status, reason) == ("complete", None) and len(refused) == 4
    assert torch.equal(batches[0]["x"], torch.arange(3000.0)) and torch.equal(batches[1]["x"], torch.arange(3000.0) + 1)
    advised.clear()
    from skip_harness.store.namespace import Namespace
    from skip_harness.store.posix.lock import FlockLocker
    from skip_harness.store.posix.storage import PosixStorage

    kept = Namespace(PosixStorage(st.layout.root, drop_written_pages=False), FlockLocker(st.layout))  # the POSIX option
    write_step(StepStore(st.layout, kept), 2)
    assert advised == []


def test_a_hit_reads_and_parses_the_commit_record_once(tmp_path, monkeypatch):
    """One verified read path: the record the status was classified with is the one served from (it was
    read and parsed twice: classify_step, then read_commit)."""
    from skip_harness.store import reader as reader_mod
    from skip_harness.store import status as status_mod

    st = make(tmp_path, K=2)
    write_step(st, 1)
    parsed = []
    for mod in (status_mod, reader_mod):
        real = mod.parse_commit

        def counting(*a, _real=real, **kw):
            parsed.append(a[3])
            return _real(*a, **kw)

        monkeypatch.setattr(mod, "parse_commit", counting)
    status, reason, batches, metas = st.reader.read_served(1, 0)
    assert (status, reason, len(batches), len(metas)) == ("complete", None, 2, 2)
    assert len(parsed) == 1, parsed


def test_merged_export_show_and_verify_read_a_committed_payload_verified(tmp_path):
    """read_inner / read_step (merged, export, show, verify's load) take the hit's verified read: a byte
    changed in a committed payload, size kept, is refused naming the file (it loaded unverified)."""
    st = make(tmp_path, K=2)
    write_step(st, 1)
    path = st.layout.step_dir(1) / st.layout.payload_rel(1, 0)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF                                   # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStepError, match="checksum") as exc:
        st.reader.read_inner(1, 1, 0)
    assert str(path) in str(exc.value)
    with pytest.raises(CorruptStepError, match="checksum"):
        st.reader.read_step(1, 0)
    assert_batch_equal(st.reader.read_inner(1, 0, 0), batch(1, 0, 0))
