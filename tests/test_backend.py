"""The storage seam: one `Namespace` (the commit protocol) over every storage -- POSIX files, memory and a real
S3 server (moto) -- passing the same tests; then what only a directory has (links, temporaries)."""
from __future__ import annotations

import os
import sys

import pytest

from s3server import s3_server  # noqa: F401  (fixture)
from skip_harness.config import RolloutTQConfig
from skip_harness.errors import ConfigError, CorruptStepError, LockHeldError
from skip_harness.store.bufferpool import BufferPool
from skip_harness.store.checksum import checksum_bytes
from skip_harness.store.namespace import LINK_WHAT, Namespace
from skip_harness.store.open import DumpDir, memory_namespace, open_dump_dir
from skip_harness.store.storage import DIR, FILE
from skip_harness.store.urls import is_url

LEAF = "exp_proj/GBS8_N1_in16_out16_K2_W1"
BACKENDS = ["posix", "memory", pytest.param("s3", marks=pytest.mark.slow)]


@pytest.fixture(params=BACKENDS)
def make_ns(request, tmp_path):
    """A factory of namespaces on one storage (each call a fresh object on the same place)."""
    kind = request.param
    if kind == "posix":
        yield lambda: open_dump_dir(str(tmp_path)).namespace(LEAF)
    elif kind == "memory":
        ns = memory_namespace(request.node.name)
        yield lambda: ns
    else:
        server = request.getfixturevalue("s3_server")
        env = server.env()
        mp = request.getfixturevalue("monkeypatch")
        for k, v in env.items():
            mp.setenv(k, v)
        url = f"s3://{server.create_bucket()}/prefix"
        yield lambda: open_dump_dir(url).namespace(LEAF)


def _staged(pool: BufferPool, data: bytes):
    lease = pool.acquire(len(data))
    lease.view(len(data))[:] = data
    return lease


def _write_step(ns: Namespace, pool: BufferPool, step: int, data: bytes = b"x" * 5000):
    lease = _staged(pool, data)
    try:
        size = ns.write_payload(step, "0/tq_batch.pt", lease, len(data))
    finally:
        lease.release()
    ns.write_small(f"{step}/0/meta.json", b"{}\n")
    return size, checksum_bytes(data)


# ------------------------------------------------------------------------------ every backend


def test_write_commit_list_and_read_verified(make_ns):
    ns, pool = make_ns(), BufferPool()
    size, digest = _write_step(ns, pool, 3)
    listing = ns.list_step(3)
    assert not listing.committed and set(listing.files) == {"0/tq_batch.pt", "0/meta.json"}
    assert listing.files["0/tq_batch.pt"].size == size == 5000
    stamp = listing.files["0/tq_batch.pt"].stamp
    assert ns.commit(3, b'{"commit": 1}\n')
    assert ns.list_step(3).committed and ns.read_small("3/commit.json") == b'{"commit": 1}\n'
    data, tag = ns.read_small_tagged("3/commit.json")
    assert data == b'{"commit": 1}\n' and (tag is None or tag == ns.list_step(3).files["commit.json"].stamp)
    with pytest.raises(CorruptStepError, match="already"):
        ns.commit(3, b"{}")                       # create-only, on every backend
    lease, got = ns.read_verified(3, "0/tq_batch.pt", size, digest, pool)
    assert got == 5000 and bytes(lease.view(got)) == b"x" * 5000
    lease.release()
    # a rewrite of the payload is a new stamp (the index tells it from the file it recorded)
    ns.uncommit(3)
    _write_step(ns, pool, 3, b"y" * 5000)
    assert ns.list_step(3).files["0/tq_batch.pt"].stamp != stamp
    assert [s.step for s in ns.list_steps().steps] == [3]
    assert ns.list_step(4) is None and ns.read_small("4/commit.json") is None


def test_read_verified_refuses_a_changed_short_or_missing_file(make_ns):
    ns, pool = make_ns(), BufferPool()
    size, digest = _write_step(ns, pool, 1)
    ns.storage.put("1/0/tq_batch.pt", b"x" * 100 + b"z" + b"x" * 4899)      # same size, other bytes
    with pytest.raises(CorruptStepError, match="checksum"):
        ns.read_verified(1, "0/tq_batch.pt", size, digest, pool)
    ns.storage.put("1/0/tq_batch.pt", b"x" * 10)
    with pytest.raises(CorruptStepError, match="10 bytes"):
        ns.read_verified(1, "0/tq_batch.pt", size, digest, pool)
    with pytest.raises(CorruptStepError, match="missing"):
        ns.read_verified(1, "0/nothing.pt", size, digest, pool)


def test_map_verified_where_the_storage_maps(make_ns):
    ns, pool = make_ns(), BufferPool()
    size, digest = _write_step(ns, pool, 1)
    mapped = ns.map_verified(1, "0/tq_batch.pt", size, digest)
    if not ns.caps.mmap:
        assert mapped is None                     # the reader falls back to read_verified
        return
    assert bytes(mapped[:size]) == b"x" * 5000
    mapped.close()
    with pytest.raises(CorruptStepError, match="checksum"):
        ns.map_verified(1, "0/tq_batch.pt", size, "0" * 32)


def test_remove_step_takes_the_commit_record_first_and_set_aside_moves_it(make_ns, monkeypatch):
    ns, pool = make_ns(), BufferPool()
    _write_step(ns, pool, 1)
    ns.commit(1, b"{}")
    _write_step(ns, pool, 2)
    ns.commit(2, b"{}")
    removed = []
    storage = ns.storage
    real_delete, real_prefix = type(storage).delete, type(storage).delete_prefix
    monkeypatch.setattr(type(storage), "delete", lambda self, key: removed.append(key) or real_delete(self, key))
    monkeypatch.setattr(type(storage), "delete_prefix", lambda self, p: removed.append(p) or real_prefix(self, p))
    assert ns.remove_step(1) >= 5000 + 3 + 2
    monkeypatch.undo()
    assert removed[0] == "1/commit.json"
    assert ns.list_step(1) is None and ns.remove_step(1) == 0
    where = ns.set_aside(2, "corrupt")
    assert ".quarantine" in where and ns.list_step(2) is None
    kept = [e.key for e in ns.storage.list(".quarantine/")]
    assert sorted(k.split("/", 2)[2] for k in kept) == ["0/meta.json", "0/tq_batch.pt", "commit.json"]


def test_a_removed_or_set_aside_step_takes_its_recorded_values_with_it(make_ns):
    """`clean`, retention and the startup cleanup remove steps through `remove_step` / `set_aside`: the
    values recorded for the step (`.values/{step}.json`, outside the step) go too, never left orphaned."""
    from skip_harness.store.values import ValuesStore, values_key

    ns, pool = make_ns(), BufferPool()
    values = ValuesStore(ns)
    for step in (1, 2, 3):
        _write_step(ns, pool, step)
        ns.commit(step, b"{}")
        values.write_step(step, {"loss": 0.5}, commit_created=1.0)
    assert ns.remove_step(1) >= 5000
    ns.set_aside(2, "corrupt")
    assert ns.read_small(values_key(1)) is None and ns.read_small(values_key(2)) is None
    assert values.read_step(3) is not None and ns.remove_step(9) == 0     # no step, no values: nothing


def test_uncommit_removes_only_the_commit_record(make_ns):
    ns, pool = make_ns(), BufferPool()
    _write_step(ns, pool, 1)
    ns.commit(1, b"{}")
    ns.uncommit(1)
    listing = ns.list_step(1)
    assert not listing.committed and set(listing.files) == {"0/tq_batch.pt", "0/meta.json"}
    ns.uncommit(1)
    ns.uncommit(9)                      # no such step: nothing
    ns.commit(1, b"{}")                 # a rewritten step commits again


def test_lock_markers_writable_and_release_hooks(make_ns):
    ns = make_ns()
    assert ns.writable() is None and ns.holder() is None
    hold = ns.lock()
    assert not hold.read_only and not hold.lost and ns.holder() is not None
    ran = []
    ns.on_release("test", lambda: ran.append(1))
    with pytest.raises(LockHeldError):
        make_ns().lock()
    hold.release()
    hold.release()
    assert ran == [1]
    make_ns().lock().release()
    ns.put_run_marker("abc")
    assert make_ns().sees_run_marker("abc") and not ns.sees_run_marker("other")
    ns.remove_run_marker("abc")
    assert not ns.sees_run_marker("abc")
    with pytest.raises(ValueError):
        ns.put_run_marker("../x")


def test_storage_primitives(make_ns):
    ns = make_ns()
    st = ns.storage
    assert st.get("a/b.json") is None and st.stat("a/b.json") is None
    assert st.put("a/b.json", b"12345") == 5
    found = st.stat("a/b.json")
    assert found.kind == FILE and found.size == 5 and found.stamp
    assert st.put_if_absent("a/b.json", b"x") is None and st.get("a/b.json") == b"12345"
    assert st.put_if_absent("a/c.json", b"xy") and st.get("a/c.json") == b"xy"
    assert sorted(e.key for e in st.list("a/")) == ["a/b.json", "a/c.json"]
    top = {e.key: e.kind for e in st.list_dir("")}
    assert top == {"a": DIR}
    if st.caps.append:
        assert st.append("a/log", b"1\n") == 0 and st.append("a/log", b"2\n") == 2 and st.get("a/log") == b"1\n2\n"
    st.copy("a/b.json", "c/b.json")
    assert st.get("c/b.json") == b"12345"
    assert st.delete("a/b.json") == 5 and st.delete("a/b.json") == 0
    assert st.delete_prefix("a/") >= 2 and list(st.list("a/")) == []
    assert ns.tree_bytes("c/") == 5
    assert ns.modified("") is not None or not ns.caps.directories


# ------------------------------------------------------------------------------ opening one


def test_a_url_dump_dir_stays_a_url_and_a_path_is_a_path(tmp_path, monkeypatch):
    monkeypatch.delenv("SKIP_HARNESS_DUMP_DIR", raising=False)
    assert RolloutTQConfig(dump_dir="s3://bucket/prefix").resolved_dump_dir() == "s3://bucket/prefix"
    assert RolloutTQConfig(dump_dir=str(tmp_path)).resolved_dump_dir() == tmp_path
    assert RolloutTQConfig(dump_dir=f"file://{tmp_path}").resolved_dump_dir() == tmp_path
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", "gs://b/p")
    assert RolloutTQConfig().resolved_dump_dir() == "gs://b/p"
    assert is_url("memory://x") and not is_url(str(tmp_path)) and not is_url(tmp_path)


def test_a_url_without_the_object_store_backend_names_the_key_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "skip_harness.store.objstore", None)   # as if not installed
    with pytest.raises(ConfigError) as exc:
        open_dump_dir("s3://bucket/prefix")
    msg = str(exc.value)
    assert "skip.rollout_tq.dump_dir" in msg and "pip install 'skip_harness[s3]'" in msg and "s3://bucket/prefix" in msg


def test_a_local_dump_dir_opens_the_posix_backend_and_lists_its_namespaces(tmp_path):
    dump = open_dump_dir(str(tmp_path))
    assert isinstance(dump, DumpDir) and dump.list_namespaces() == []
    ns = dump.namespace(LEAF)
    assert isinstance(ns, Namespace) and ns.caps.directories
    _write_step(ns, BufferPool(), 1)
    (tmp_path / "exp_proj" / "not_a_namespace").mkdir()
    os.symlink(tmp_path / "exp_proj", tmp_path / "linked")
    assert dump.list_namespaces() == [LEAF]


# ------------------------------------------------------------------------------ what only a directory has


def _posix(tmp_path) -> Namespace:
    return open_dump_dir(str(tmp_path)).namespace(LEAF)


def test_listing_shows_temporaries_links_and_strays_never_following_a_link(tmp_path):
    ns, pool = _posix(tmp_path), BufferPool()
    _write_step(ns, pool, 1)
    _write_step(ns, pool, 2)
    step1 = tmp_path / LEAF / "1"
    (step1 / "0" / ".tmp-tq_batch.pt.1.ab").write_bytes(b"half")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    os.symlink(outside, step1 / "1")
    os.symlink(outside, tmp_path / LEAF / "7")
    (tmp_path / LEAF / ".trash-4-1-abc").mkdir()
    listing = ns.list_steps()
    by_step = {s.step: s for s in listing.steps}
    assert sorted(by_step) == [1, 2, 7]
    assert by_step[1].temporaries == ("0/.tmp-tq_batch.pt.1.ab",)
    assert by_step[1].odd == (("1", LINK_WHAT),)
    assert "secret" not in str(by_step[1].files)
    assert by_step[7].entry == LINK_WHAT and not by_step[7].files and not by_step[7].odd
    assert [name for name, _ in listing.leftovers] == [".trash-4-1-abc"]
    with pytest.raises(CorruptStepError, match="symlink"):
        ns.read_small("1/1")
    os.symlink(outside / "secret", step1 / "commit.json")
    with pytest.raises(CorruptStepError, match="symlink"):
        ns.read_small("1/commit.json")
    assert ns.remove_step(7) > 0 and os.path.isdir(outside)      # the link removed, never its target


def test_verified_reads_never_follow_a_linked_inner_directory(tmp_path):
    """A committed step whose inner directory became a symlink (to an identical copy elsewhere) is not
    read through the link: reads go fd by fd from the namespace directory."""
    import shutil

    ns, pool = _posix(tmp_path), BufferPool()
    size, digest = _write_step(ns, pool, 1)
    inner = tmp_path / LEAF / "1" / "0"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(inner, elsewhere)
    shutil.rmtree(inner)
    os.symlink(elsewhere, inner)
    with pytest.raises(CorruptStepError, match="symlink"):
        ns.read_verified(1, "0/tq_batch.pt", size, digest, pool)
    with pytest.raises(CorruptStepError, match="symlink"):
        ns.map_verified(1, "0/tq_batch.pt", size, digest)
    with pytest.raises(CorruptStepError, match="symlink"):
        ns.read_small("1/0/meta.json")


def test_a_posix_commit_survives_as_a_file_and_the_quarantine_refuses_a_link(tmp_path):
    ns, pool = _posix(tmp_path), BufferPool()
    _write_step(ns, pool, 1)
    ns.commit(1, b"{}")
    assert (tmp_path / LEAF / "1" / "commit.json").read_bytes() == b"{}"
    os.symlink(tmp_path, tmp_path / LEAF / ".quarantine")
    with pytest.raises(OSError, match="refusing to move"):
        ns.set_aside(1, "x")
    assert ns.list_step(1).committed


# ------------------------------------------------------------------------------ the whole store on memory


def test_the_step_store_scan_index_and_cleanup_run_on_the_memory_backend(tmp_path):
    """Nothing above the namespace knows which storage it is on: StepStore's writes and verified reads, the
    startup scan (listing stamps, the index appended), a corrupt step found and cleaned -- all in memory,
    nothing on disk."""
    from conftest import assert_batch_equal, batch, write_step
    from skip_harness.store.cleanup import plan_cleanup
    from skip_harness.store.layout import NamespaceKey
    from skip_harness.store.scan import scan_namespace
    from skip_harness.store.stepstore import StepStore

    ns = memory_namespace("whole")
    layout = NamespaceKey("exp", "proj", 8, 2, 4, 4, K=2).layout(tmp_path / "never")
    store = StepStore(layout, backend=ns)
    for step in (1, 2, 3):
        write_step(store, step)
    write_step(store, 4, commit=False)                       # interrupted before its commit
    assert_batch_equal(store.reader.read_step(2, 0)[1], batch(2, 1, 0))
    first = scan_namespace(layout, namespace=ns)
    assert first.counts() == {"complete": 3, "unverified": 0, "incomplete": 1, "corrupt": 0}
    assert first.index_used and first.index_note is None    # every commit appended its line
    ns.storage.put("3/1/tq_batch.pt", b"short")             # a damaged file: another size than its record's
    again = scan_namespace(layout, namespace=ns)
    assert again.counts()["corrupt"] == 1 and "index stale" in again.index_note
    result = plan_cleanup(again, "delete").execute(namespace=ns)
    assert sorted(i.step for i in result.items) == [3, 4] and not result.errors
    assert [s.step for s in scan_namespace(layout, namespace=ns).steps] == [1, 2]
    assert not (tmp_path / "never").exists()
