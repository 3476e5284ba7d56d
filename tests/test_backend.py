"""The storage seam (store.backend) and its POSIX backend, on real files."""
from __future__ import annotations

import os
import sys

import pytest

from skip_harness.config import RolloutTQConfig
from skip_harness.errors import ConfigError, CorruptStepError, LockHeldError
from skip_harness.store.backend import LINK, NamespaceBackend, is_url, open_dump_dir
from skip_harness.store.bufferpool import BufferPool
from skip_harness.store.posix.backend import PosixDumpDir, PosixNamespace
from skip_harness.store.posix.fileops import checksum_bytes

LEAF = "exp_proj/GBS8_N1_in16_out16_K2_W1"


def _ns(tmp_path) -> PosixNamespace:
    ns = open_dump_dir(str(tmp_path)).namespace(LEAF)
    assert isinstance(ns, NamespaceBackend) and isinstance(ns, PosixNamespace)
    return ns


def _staged(pool: BufferPool, data: bytes):
    lease = pool.acquire(len(data))
    lease.view(len(data))[:] = data
    return lease


def _write_step(ns: PosixNamespace, pool: BufferPool, step: int, data: bytes = b"x" * 5000):
    lease = _staged(pool, data)
    try:
        size = ns.write_payload(step, "0/tq_batch.pt", lease, len(data))
    finally:
        lease.release()
    ns.write_small(f"{step}/0/meta.json", b"{}\n")
    return size, checksum_bytes(data)


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
    assert isinstance(dump, PosixDumpDir) and dump.list_namespaces() == []
    ns = _ns(tmp_path)
    _write_step(ns, BufferPool(), 1)
    (tmp_path / "exp_proj" / "not_a_namespace").mkdir()
    assert dump.list_namespaces() == [LEAF]


def test_write_commit_list_and_read_verified(tmp_path):
    ns, pool = _ns(tmp_path), BufferPool()
    size, digest = _write_step(ns, pool, 3)
    listing = ns.list_step(3)
    assert not listing.committed and set(listing.files) == {"0/tq_batch.pt", "0/meta.json"}
    assert listing.files["0/tq_batch.pt"].size == size == 5000
    stamp = listing.files["0/tq_batch.pt"].stamp
    ns.commit(3, b'{"commit": 1}\n')
    assert ns.list_step(3).committed and ns.read_small("3/commit.json") == b'{"commit": 1}\n'
    with pytest.raises(CorruptStepError, match="already"):
        ns.commit(3, b"{}")                       # create-only, as on an object store
    lease, got = ns.read_verified(3, "0/tq_batch.pt", size, digest, pool)
    assert got == 5000 and bytes(lease.view(got)) == b"x" * 5000
    lease.release()
    # a rewrite of the payload is a new stamp (the index tells it from the file it recorded)
    _write_step(ns, pool, 3, b"y" * 5000)
    assert ns.list_step(3).files["0/tq_batch.pt"].stamp != stamp
    assert [s.step for s in ns.list_steps().steps] == [3]


def test_read_verified_refuses_a_changed_or_short_file(tmp_path):
    ns, pool = _ns(tmp_path), BufferPool()
    size, digest = _write_step(ns, pool, 1)
    path = tmp_path / LEAF / "1" / "0" / "tq_batch.pt"
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"z")
    with pytest.raises(CorruptStepError, match="checksum"):
        ns.read_verified(1, "0/tq_batch.pt", size, digest, pool)
    os.truncate(path, 10)
    with pytest.raises(CorruptStepError, match="10 bytes"):
        ns.read_verified(1, "0/tq_batch.pt", size, digest, pool)
    with pytest.raises(CorruptStepError, match="missing"):
        ns.read_verified(1, "0/nothing.pt", size, digest, pool)


def test_listing_shows_temporaries_links_and_strays_never_following_a_link(tmp_path):
    ns, pool = _ns(tmp_path), BufferPool()
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
    assert by_step[1].odd == (("1", "a symlink (never followed)"),)
    assert "secret" not in str(by_step[1].files)
    assert by_step[7].entry == LINK and not by_step[7].files and not by_step[7].odd
    assert [name for name, _ in listing.leftovers] == [".trash-4-1-abc"]
    with pytest.raises(CorruptStepError, match="symlink"):
        ns.read_small("1/1")
    os.symlink(outside / "secret", step1 / "commit.json")
    with pytest.raises(CorruptStepError, match="symlink"):
        ns.read_small("1/commit.json")


def test_remove_step_takes_the_commit_record_first_and_set_aside_moves_it(tmp_path, monkeypatch):
    ns, pool = _ns(tmp_path), BufferPool()
    _write_step(ns, pool, 1)
    ns.commit(1, b"{}")
    _write_step(ns, pool, 2)
    ns.commit(2, b"{}")
    unlinked = []
    real_unlink = os.unlink

    def spy(name, *a, **kw):
        unlinked.append(str(name))
        return real_unlink(name, *a, **kw)

    monkeypatch.setattr(os, "unlink", spy)
    assert ns.remove_step(1) > 5000
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert unlinked[0] == "commit.json"
    assert ns.list_step(1) is None and ns.remove_step(1) == 0
    where = ns.set_aside(2, "corrupt")
    assert ".quarantine" in where and os.path.isdir(where) and ns.list_step(2) is None


def test_lock_markers_and_writable(tmp_path):
    ns = _ns(tmp_path)
    assert ns.writable() is None
    hold = ns.lock()
    assert not hold.read_only and not hold.lost
    with pytest.raises(LockHeldError):
        _ns(tmp_path).lock()
    hold.release()
    hold.release()
    _ns(tmp_path).lock().release()
    ns.put_run_marker("abc")
    assert _ns(tmp_path).sees_run_marker("abc") and not ns.sees_run_marker("other")
    ns.remove_run_marker("abc")
    assert not ns.sees_run_marker("abc")
    ns.write_index(b"index\n")
    assert ns.read_index() == b"index\n"


def test_uncommit_removes_only_the_commit_record(tmp_path):
    ns, pool = _ns(tmp_path), BufferPool()
    _write_step(ns, pool, 1)
    ns.commit(1, b"{}")
    ns.uncommit(1)
    listing = ns.list_step(1)
    assert not listing.committed and set(listing.files) == {"0/tq_batch.pt", "0/meta.json"}
    ns.uncommit(1)
    ns.uncommit(9)                      # no such step: nothing
    ns.commit(1, b"{}")                 # a rewritten step commits again


def test_verified_reads_never_follow_a_linked_inner_directory(tmp_path):
    """A committed step whose inner directory became a symlink (to an identical copy elsewhere) is not
    read through the link: reads go fd by fd from the namespace directory."""
    import shutil

    ns, pool = _ns(tmp_path), BufferPool()
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
