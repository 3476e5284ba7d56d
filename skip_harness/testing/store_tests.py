"""The storage protocol's tests, for any backend to inherit (as zarr's `zarr.testing.store.StoreTests`).

A backend (`skip_harness.store.registry.Backend`: a `Storage` and a `Locker`) passes them when the commit
protocol written once above it (`store.namespace.Namespace`) works on it: a step's files written, listed
with their sizes and stamps, committed once (create-only), read back verified against size and checksum,
uncommitted, removed commit record first, set aside; its recorded values and second-tier entries removed
with it; the lock held by one opener at a time, released once, with its run markers; and the storage's own
primitives.

Subclass in a test module and give one fixture -- a fresh place each test::

    from skip_harness.testing.store_tests import StoreTests

    class TestMyBackend(StoreTests):
        @pytest.fixture
        def dump_dir_url(self, tmp_path):
            return f"mydb://{tmp_path.name}/cache"     # a dump_dir your registered backend serves

Every test then opens the namespace `LEAF` under that dump_dir through `store.open.open_dump_dir`, as a
run does (so the registration is tested too). A storage that has no URL overrides `make_namespace`
instead: a callable that opens the same namespace again on each call (a fresh object where the backend
makes one: a second opener must find the lock held). `ReadOnlyStoreTests` is the read-only storage's
(a pack file's): reads verified, every write refused.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import pytest

from skip_harness.errors import CorruptStepError, LockHeldError, SkipHarnessError
from skip_harness.store.bufferpool import BufferPool
from skip_harness.store.checksum import checksum_bytes
from skip_harness.store.namespace import Namespace
from skip_harness.store.open import open_dump_dir
from skip_harness.store.status import StepStatus
from skip_harness.store.storage import DIR, FILE
from skip_harness.store.tier import TierStore, key_digest
from skip_harness.store.values import ValuesStore, values_key

LEAF = "exp_proj/GBS8_N1_in16_out16_K2_W1"      # the namespace every test opens under the dump_dir


def staged(pool: BufferPool, data: bytes) -> Any:
    """`data` in a buffer leased from `pool` (what a writer hands the storage)."""
    lease = pool.acquire(len(data))
    lease.view(len(data))[:] = data
    return lease


def write_step(ns: Namespace, pool: BufferPool, step: int, data: bytes = b"x" * 5000) -> Tuple[int, str]:
    """A step's payload and meta file, uncommitted: (the payload's stored size, its checksum)."""
    lease = staged(pool, data)
    try:
        size = ns.write_payload(step, "0/tq_batch.pt", lease, len(data))
    finally:
        lease.release()
    ns.write_small(f"{step}/0/meta.json", b"{}\n")
    return size, checksum_bytes(data)


class StoreTests:
    """The protocol's tests; a subclass gives `dump_dir_url` (or overrides `make_namespace`)."""

    @pytest.fixture
    def dump_dir_url(self) -> str:
        raise NotImplementedError("a StoreTests subclass gives the fixture `dump_dir_url` (a fresh dump_dir its "
                                  "backend serves) or overrides `make_namespace`")

    @pytest.fixture
    def make_namespace(self, dump_dir_url: str) -> Callable[[], Namespace]:
        """Opens the namespace `LEAF` under the dump_dir, afresh on each call."""
        return lambda: open_dump_dir(dump_dir_url).namespace(LEAF)

    # ---- the commit protocol, on this storage

    def test_write_commit_list_and_read_verified(self, make_namespace):
        ns, pool = make_namespace(), BufferPool()
        size, digest = write_step(ns, pool, 3)
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
        ns.uncommit(3)                                # a rewrite of the payload is a new stamp
        write_step(ns, pool, 3, b"y" * 5000)
        assert ns.list_step(3).files["0/tq_batch.pt"].stamp != stamp
        assert [s.step for s in ns.list_steps().steps] == [3]
        assert ns.list_step(4) is None and ns.read_small("4/commit.json") is None

    def test_read_verified_refuses_a_changed_short_or_missing_file(self, make_namespace):
        ns, pool = make_namespace(), BufferPool()
        size, digest = write_step(ns, pool, 1)
        ns.storage.put("1/0/tq_batch.pt", b"x" * 100 + b"z" + b"x" * 4899)      # same size, other bytes
        with pytest.raises(CorruptStepError, match="checksum"):
            ns.read_verified(1, "0/tq_batch.pt", size, digest, pool)
        ns.storage.put("1/0/tq_batch.pt", b"x" * 10)
        with pytest.raises(CorruptStepError, match="10 bytes"):
            ns.read_verified(1, "0/tq_batch.pt", size, digest, pool)
        with pytest.raises(CorruptStepError, match="missing"):
            ns.read_verified(1, "0/nothing.pt", size, digest, pool)

    def test_map_verified_where_the_storage_maps(self, make_namespace):
        ns, pool = make_namespace(), BufferPool()
        size, digest = write_step(ns, pool, 1)
        mapped = ns.map_verified(1, "0/tq_batch.pt", size, digest)
        if not ns.caps.mmap:
            assert mapped is None                     # the reader falls back to read_verified
            return
        assert bytes(mapped[:size]) == b"x" * 5000
        mapped.close()
        with pytest.raises(CorruptStepError, match="checksum"):
            ns.map_verified(1, "0/tq_batch.pt", size, "0" * 32)

    def test_remove_step_takes_the_commit_record_first_and_set_aside_moves_it(self, make_namespace, monkeypatch):
        ns, pool = make_namespace(), BufferPool()
        write_step(ns, pool, 1)
        ns.commit(1, b"{}")
        write_step(ns, pool, 2)
        ns.commit(2, b"{}")
        removed = []
        storage = ns.storage
        real_delete, real_prefix = type(storage).delete, type(storage).delete_prefix

        def delete(self, key):
            removed.append(key)
            return real_delete(self, key)

        def delete_prefix(self, prefix):
            removed.append(prefix)
            return real_prefix(self, prefix)

        monkeypatch.setattr(type(storage), "delete", delete)
        monkeypatch.setattr(type(storage), "delete_prefix", delete_prefix)
        assert ns.remove_step(1) >= 5000 + 3 + 2
        monkeypatch.undo()
        assert removed[0] == "1/commit.json"
        assert ns.list_step(1) is None and ns.remove_step(1) == 0
        where = ns.set_aside(2, StepStatus.CORRUPT)
        assert ".quarantine" in where and ns.list_step(2) is None
        kept = [e.key for e in ns.storage.list(".quarantine/")]
        assert sorted(k.split("/", 2)[2] for k in kept) == ["0/meta.json", "0/tq_batch.pt", "commit.json"]

    def test_a_removed_or_set_aside_step_takes_its_recorded_values_with_it(self, make_namespace):
        """`clean`, retention and the startup cleanup remove steps through `remove_step` / `set_aside`: the
        values recorded for the step (`.values/{step}.json`, outside the step) go too, never left orphaned."""
        ns, pool = make_namespace(), BufferPool()
        values = ValuesStore(ns)
        for step in (1, 2, 3):
            write_step(ns, pool, step)
            ns.commit(step, b"{}")
            values.write_step(step, {"loss": 0.5}, commit_created=1.0)
        assert ns.remove_step(1) >= 5000
        ns.set_aside(2, StepStatus.CORRUPT)
        assert ns.read_small(values_key(1)) is None and ns.read_small(values_key(2)) is None
        assert values.read_step(3) is not None and ns.remove_step(9) == 0     # no step, no values: nothing

    def test_uncommit_removes_only_the_commit_record(self, make_namespace):
        ns, pool = make_namespace(), BufferPool()
        write_step(ns, pool, 1)
        ns.commit(1, b"{}")
        ns.uncommit(1)
        listing = ns.list_step(1)
        assert not listing.committed and set(listing.files) == {"0/tq_batch.pt", "0/meta.json"}
        ns.uncommit(1)
        ns.uncommit(9)                      # no such step: nothing
        ns.commit(1, b"{}")                 # a rewritten step commits again

    def test_lock_markers_writable_and_release_hooks(self, make_namespace):
        ns = make_namespace()
        assert ns.writable() is None and ns.holder() is None
        hold = ns.lock()
        assert not hold.read_only and not hold.lost and ns.holder() is not None
        ran = []
        ns.on_release("test", lambda: ran.append(1))
        with pytest.raises(LockHeldError):
            make_namespace().lock()
        hold.release()
        hold.release()
        assert ran == [1]
        make_namespace().lock().release()
        ns.put_run_marker("abc")
        assert make_namespace().sees_run_marker("abc") and not ns.sees_run_marker("other")
        ns.remove_run_marker("abc")
        assert not ns.sees_run_marker("abc")
        with pytest.raises(ValueError):
            ns.put_run_marker("../x")

    def test_second_tier_entries_are_create_only_bound_to_the_commit_and_removed_with_their_step(self, make_namespace):
        """The second tier's entries (`store.tier`, `.tier/{step}/...`): create-only, checksummed, bound to the
        commit record, listed per key, removed with their step."""
        import torch

        ns = make_namespace()
        store, key, other = TierStore(ns), {"reward function r": "v1"}, {"reward function r": "v2"}
        data = store.encode({"r": torch.arange(4.0), "names": ["a", "b"]})
        assert store.write(3, "reward", 0, 0, key, data, commit_created=1.5, seconds=0.2)
        assert not store.write(3, "reward", 0, 0, key, store.encode(torch.zeros(1)), commit_created=1.5, seconds=0.1)
        assert store.write(3, "reward", 0, 0, other, data, commit_created=1.5, seconds=0.3)
        got = store.read(3, "reward", key, 0, 0, commit_created=1.5)
        assert torch.equal(got.values["r"], torch.arange(4.0)) and got.values["names"] == ["a", "b"]
        assert got.record.seconds == 0.2 and got.record.key == key
        assert store.read(3, "reward", key, 0, 0, commit_created=2.0) is None      # another write of the step
        assert {r.digest for r in store.keys(3, "reward")} == {key_digest(key), key_digest(other)}
        assert ns.remove_step(3) > 0
        assert store.read(3, "reward", key, 0, 0, commit_created=1.5) is None and not store.step_records(3)

    # ---- the storage's own operations

    def test_storage_primitives(self, make_namespace):
        ns = make_namespace()
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
        if st.caps.atomic_rename:
            st.put("m/x.json", b"1")
            st.move("m", "n")
            assert st.get("n/x.json") == b"1" and st.get("m/x.json") is None
            st.delete_prefix("n/")
        st.copy("a/b.json", "c/b.json")
        assert st.get("c/b.json") == b"12345"
        assert st.delete("a/b.json") == 5 and st.delete("a/b.json") == 0
        assert st.delete_prefix("a/") >= 2 and list(st.list("a/")) == []
        assert ns.tree_bytes("c/") == 5
        assert ns.modified("") is not None or not ns.caps.directories

    def test_stamps_of_many_groups_tell_a_change_and_a_missing_entry(self, make_namespace):
        """`Storage.stamps_many`, what the index checks every committed step by at startup: for each name,
        one stamp over its group's entries; None where one is missing or of another kind; a new stamp
        when one of them is rewritten; and what `stamps` gives the same keys."""
        st = make_namespace().storage
        for name in ("1", "2", "3"):
            st.put(f"{name}/a.json", b"a" * int(name))
            st.put(f"{name}/b.json", b"b")
        st.delete("2/b.json")
        suffixes, kinds = ("/a.json", "/b.json"), (FILE, FILE)
        names = ["1", "2", "3", "4"]
        many = st.stamps_many(names, suffixes, kinds)
        assert many == [st.stamps([n + s for s in suffixes], kinds) for n in names]
        assert [m is None for m in many] == [False, True, False, True]
        assert many[0][0] != many[2][0]
        st.put("1/a.json", b"rewritten")
        assert st.stamps_many(["1", "3"], suffixes, kinds) == [st.stamps(["1/a.json", "1/b.json"], kinds), many[2]]
        assert st.stamps_many(["1"], suffixes, kinds)[0] != many[0]
        if st.caps.directories:
            assert st.stamps_many(["1"], ("", "/a.json"), (DIR, FILE))[0] is not None
            assert st.stamps_many(["1", "3"], ("", "/a.json"), (FILE, FILE)) == [None, None]

    def test_put_all_and_write_step_files_store_each_file(self, make_namespace):
        """Several files in one call (a mini-batch's payload from a pool buffer and its meta.json), in one
        directory or several: each stored whole, replacing what was there, sizes in order."""
        ns = make_namespace()
        st = ns.storage
        st.put("d/b.json", b"old")
        assert st.put_all([("d/a.bin", b"1" * 70, None), ("e/c", b"xyz", 2), ("d/b.json", b"new!", None)]) == [70, 2, 4]
        assert (st.get("d/a.bin"), st.get("d/b.json"), st.get("e/c")) == (b"1" * 70, b"new!", b"xy")
        pool = BufferPool()
        lease = staged(pool, b"p" * 5000)
        try:
            assert ns.write_step_files(4, [("0/tq_batch.pt", lease, 5000), ("0/meta.json", b"{}\n", 3)]) == [5000, 3]
        finally:
            lease.release()
        assert st.get("4/0/tq_batch.pt") == b"p" * 5000 and st.get("4/0/meta.json") == b"{}\n"

    def test_a_dump_dir_lists_the_namespaces_written_under_it(self, dump_dir_url):
        """What a run's startup and `skip-harness ls` see: the namespace written is listed by its dump_dir."""
        dump = open_dump_dir(dump_dir_url)
        assert dump.list_namespaces() == []
        write_step(dump.namespace(LEAF), BufferPool(), 1)
        assert open_dump_dir(dump_dir_url).list_namespaces() == [LEAF]


class ReadOnlyStoreTests:
    """The tests of a storage that is read, never written (a pack file): a subclass gives the fixture
    `make_filled`, a callable that returns a namespace holding exactly the files it is given
    ({key: bytes}; JSON files, as a step's meta and commit records are)."""

    FILES: Dict[str, bytes] = {"1/commit.json": b'{"step": 1}', "1/0/meta.json": b"{}", ".values/1.json": b'{"a": 1}'}

    @pytest.fixture
    def make_filled(self) -> Callable[[Dict[str, bytes]], Namespace]:
        raise NotImplementedError("a ReadOnlyStoreTests subclass gives the fixture `make_filled`")

    def test_reads_list_and_stat_what_it_holds(self, make_filled):
        ns = make_filled(self.FILES)
        st = ns.storage
        for key, data in self.FILES.items():
            assert st.get(key) == data and st.stat(key).size == len(data) and st.stat(key).kind == FILE
        assert st.get("2/commit.json") is None and st.stat("2/commit.json") is None
        assert sorted(e.key for e in st.list("")) == sorted(self.FILES)
        assert {e.key: e.kind for e in st.list_dir("")} == {"1": DIR, ".values": DIR}
        assert [s.step for s in ns.list_steps().steps] == [1] and ns.list_step(1).committed

    def test_a_verified_read_checks_size_and_checksum(self, make_filled):
        ns, pool = make_filled(self.FILES), BufferPool()
        data = self.FILES["1/0/meta.json"]
        lease, got = ns.read_verified(1, "0/meta.json", len(data), checksum_bytes(data), pool)
        assert bytes(lease.view(got)) == data
        lease.release()
        with pytest.raises(CorruptStepError):
            ns.read_verified(1, "0/meta.json", len(data), "0" * 32, pool)
        with pytest.raises(CorruptStepError):
            ns.read_verified(1, "0/nothing.json", 2, checksum_bytes(b"{}"), pool)

    def test_every_write_is_refused_and_every_hold_is_read_only(self, make_filled):
        ns = make_filled(self.FILES)
        st = ns.storage
        for write in (lambda: st.put("x.json", b"{}"), lambda: st.put_if_absent("x.json", b"{}"),
                      lambda: st.delete("1/commit.json"), lambda: st.delete_prefix("1/"),
                      lambda: st.copy("1/commit.json", "2/commit.json"), lambda: ns.commit(2, b"{}")):
            with pytest.raises((SkipHarnessError, OSError)):
                write()
        assert st.get("1/commit.json") == self.FILES["1/commit.json"]
        hold = ns.lock()
        assert hold.read_only and ns.writable() is not None
        hold.release()


__all__ = ["LEAF", "ReadOnlyStoreTests", "StoreTests", "staged", "write_step"]
