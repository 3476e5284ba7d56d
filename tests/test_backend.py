"""The storage seam: one `Namespace` (the commit protocol) over every storage -- POSIX files, memory, obstore's
memory://, a real S3 server (moto), and read-only a pack file -- each a subclass of the protocol's tests that
ship in the package (`skip_harness.testing.store_tests`, which a third-party backend inherits too:
tests/test_backend_registry.py); then what only a directory has (links, temporaries)."""
from __future__ import annotations

import os
import sys
import uuid

import pytest

from s3server import s3_server  # noqa: F401  (fixture)
from skip_harness.config import RolloutTQConfig
from skip_harness.errors import ConfigError, CorruptStepError
from skip_harness.store.bufferpool import BufferPool
from skip_harness.store.checksum import checksum_bytes
from skip_harness.store.namespace import LINK_WHAT, Namespace
from skip_harness.store.open import (PACK_FORMAT, PACK_VERSION, DumpDir, PackMember, const_bytes, memory_namespace,
                                     open_dump_dir, open_namespace, pack_layout, write_pack_file)
from skip_harness.store.urls import is_url
from skip_harness.testing.store_tests import LEAF, ReadOnlyStoreTests, StoreTests, write_step


# ------------------------------------------------------------------------------ every backend: the protocol's tests


class TestPosix(StoreTests):
    @pytest.fixture
    def dump_dir_url(self, tmp_path):
        return str(tmp_path)


class TestMemory(StoreTests):
    """The reference storage (`store.memory`), which has no URL: opened by `memory_namespace`."""

    @pytest.fixture
    def dump_dir_url(self):
        pytest.skip("memory_namespace opens one namespace, under no dump_dir")

    @pytest.fixture
    def make_namespace(self, request):
        ns = memory_namespace(request.node.name)
        return lambda: ns


class TestObjectStoreInMemory(StoreTests):
    """The object-store backend on obstore's in-process store (`memory://`): its code, no server."""

    @pytest.fixture
    def dump_dir_url(self, request):
        return f"memory://{request.node.name}-{uuid.uuid4().hex}/prefix"

    def test_a_dump_dir_lists_the_namespaces_written_under_it(self, dump_dir_url):
        pytest.skip("obstore's memory:// keeps one store per whole URL (store.objstore.client), so a dump_dir's "
                    "URL never lists the namespaces under it; S3 (TestS3) does")


@pytest.mark.slow
class TestS3(StoreTests):
    """The object-store backend on a real S3 server (moto, the one the suite starts)."""

    @pytest.fixture
    def dump_dir_url(self, s3_server, monkeypatch):  # noqa: F811  (the fixture)
        for k, v in s3_server.env().items():
            monkeypatch.setenv(k, v)
        return f"s3://{s3_server.create_bucket()}/prefix"


class TestPack(ReadOnlyStoreTests):
    """A pack file (`store.packfile`): read in place, every member checked, never written."""

    @pytest.fixture
    def make_filled(self, tmp_path):
        def filled(files):
            out = tmp_path / "held.skpack"
            manifest = {"format": PACK_FORMAT, "version": PACK_VERSION, "namespace": LEAF}
            write_pack_file(out, manifest, [PackMember(k, len(v), checksum_bytes(v), const_bytes(v))
                                            for k, v in files.items()])
            layout = pack_layout(out)
            assert layout is not None and layout.packed
            return open_namespace(layout)
        return filled


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
    write_step(ns, BufferPool(), 1)
    (tmp_path / "exp_proj" / "not_a_namespace").mkdir()
    os.symlink(tmp_path / "exp_proj", tmp_path / "linked")
    assert dump.list_namespaces() == [LEAF]


# ------------------------------------------------------------------------------ what only a directory has


def _posix(tmp_path) -> Namespace:
    return open_dump_dir(str(tmp_path)).namespace(LEAF)


def test_listing_shows_temporaries_links_and_strays_never_following_a_link(tmp_path):
    ns, pool = _posix(tmp_path), BufferPool()
    write_step(ns, pool, 1)
    write_step(ns, pool, 2)
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
    size, digest = write_step(ns, pool, 1)
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
    write_step(ns, pool, 1)
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
    store = StepStore(layout, namespace=ns)
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
