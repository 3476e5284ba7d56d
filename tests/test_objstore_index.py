"""The namespace index on an object store (issue 16), against a real S3 server: the startup scan's one
LIST stamps each step by its objects' (rel, size, ETag); a step whose stamp matches its index entry is
taken from the entry with no GET of its commit record; a step rewritten after indexing is read again
and its new record wins; a removed step does not come back; a damaged or foreign index object is
ignored and rewritten; commits never touch the index object."""
from __future__ import annotations

import json

import pytest

from conftest import write_step
from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from skip_harness.store.open import open_namespace, open_store
from skip_harness.store import index
from skip_harness.store.index import INDEX_KEY
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.scan import scan_namespace
from skip_harness.store.stepstore import StepStore

FP = Fingerprint.from_values({"model": "m", "seed": 1})
FP2 = Fingerprint.from_values({"model": "m", "seed": 2})


@pytest.fixture
def store(s3_bucket):
    layout = NamespaceKey("exp", "proj", 8, 2, 4, 4, K=2, W=1).layout(f"s3://{s3_bucket}/dump")
    return open_store(layout)


def prefix(store) -> str:
    return str(store.layout.root).split("/", 3)[3] + "/"


class Gets:
    """Counts the GETs this process makes of the namespace's objects, by key (the backend's client)."""

    def __init__(self, store, monkeypatch):
        self.keys = []
        client = store.namespace.storage.client
        real = client.get
        monkeypatch.setattr(client, "get", lambda key: (self.keys.append(key), real(key))[1])

    def commits(self):
        return sorted(int(k.split("/")[0]) for k in self.keys if k.endswith("/commit.json"))

    def clear(self):
        self.keys.clear()


def test_second_scan_reads_no_commit_record_of_an_indexed_step(store, s3_server, s3_bucket, monkeypatch):
    for step in (1, 2, 10):
        write_step(store, step, fingerprint=FP)
    write_step(store, 3, commit=False)                  # payloads, no commit record: incomplete
    assert f"{prefix(store)}{INDEX_KEY}" not in s3_server.keys(s3_bucket)   # commits never write it
    gets = Gets(store, monkeypatch)
    first = scan_namespace(store.layout, store.namespace)
    assert not first.index_used and first.index_note.startswith("index missing")
    assert "rebuilt" in first.index_note
    assert gets.commits() == [1, 2, 10]
    assert f"{prefix(store)}{INDEX_KEY}" in s3_server.keys(s3_bucket)
    assert sorted(index.read(store.layout, store.namespace)) == [1, 2, 10]

    gets.clear()
    second = scan_namespace(store.layout, store.namespace)
    assert second.index_used and second.index_note is None
    assert gets.commits() == []                        # every committed step came from the index
    assert gets.keys == [INDEX_KEY, "3/0/meta.json"]   # the index, and the incomplete step's meta
    full = scan_namespace(store.layout, store.namespace, use_index=False)
    assert second.steps == full.steps
    assert [s.status for s in second.steps] == ["complete", "complete", "incomplete", "complete"]
    assert [s.fingerprint for s in second.by_status("complete")] == [FP] * 3
    assert second.get(10).created == full.get(10).created and second.get(10).bytes == full.get(10).bytes


def test_a_step_rewritten_after_indexing_is_read_again_and_its_new_record_wins(store, monkeypatch):
    write_step(store, 1, fingerprint=FP)
    write_step(store, 2, fingerprint=FP)
    scan_namespace(store.layout, store.namespace)                       # indexes 1 and 2
    old = scan_namespace(store.layout, store.namespace).get(2)
    # a rerun rewrites step 2: the commit record goes first, new files, a new commit record
    store.namespace.uncommit(2)
    write_step(store, 2, fingerprint=FP2)
    gets = Gets(store, monkeypatch)
    report = scan_namespace(store.layout, store.namespace)
    assert gets.commits() == [2]                       # step 1 from the index, step 2 read again
    assert report.index_used and "1 changed" in report.index_note and "rebuilt" in report.index_note
    new = report.get(2)
    assert new.status == "complete" and new.fingerprint == FP2 and new.created > old.created
    assert report.steps == scan_namespace(store.layout, store.namespace, use_index=False).steps
    gets.clear()
    again = scan_namespace(store.layout, store.namespace)               # the rebuilt index holds the new record
    assert gets.commits() == [] and again.index_note is None and again.get(2).fingerprint == FP2


def test_an_uncommitted_step_is_not_taken_from_its_entry(store):
    write_step(store, 1, fingerprint=FP)
    scan_namespace(store.layout, store.namespace)
    store.namespace.uncommit(1)            # a rewrite killed right after its first step
    report = scan_namespace(store.layout, store.namespace)
    assert report.get(1).status == "incomplete" and not report.index_used
    assert "1 changed" in report.index_note


def test_a_removed_step_does_not_come_back(store, monkeypatch):
    for step in (1, 2, 3):
        write_step(store, step, fingerprint=FP)
    scan_namespace(store.layout, store.namespace)
    assert store.namespace.remove_step(2) > 0
    report = scan_namespace(store.layout, store.namespace)
    assert [s.step for s in report.steps] == [1, 3] and report.index_used
    assert "1 removed" in report.index_note and "rebuilt" in report.index_note
    assert sorted(index.read(store.layout, store.namespace)) == [1, 3]
    gets = Gets(store, monkeypatch)
    again = scan_namespace(store.layout, store.namespace)
    assert [s.step for s in again.steps] == [1, 3] and again.index_note is None and gets.commits() == []


@pytest.mark.parametrize("damage", ["garbage", "cut", "posix", "other_k", "bad_fingerprint", "lies"])
def test_a_damaged_or_foreign_index_object_is_ignored_and_rewritten(store, damage, monkeypatch):
    for step in (1, 2):
        write_step(store, step, fingerprint=FP)
    namespace = store.namespace
    scan_namespace(store.layout, store.namespace)
    good = bytes(namespace.read_small(INDEX_KEY))
    header, body = good.split(b"\n", 1)
    if damage == "garbage":
        data = b"\x00\xffnot an index at all"
    elif damage == "cut":
        data = good[:-7]
    elif damage == "posix":                            # an index of the local kind (inode stamps)
        data = json.dumps({"skip_harness_index": 1, "K": 2, "W": 1}).replace(" ", "").encode() + b"\n" + body
    elif damage == "other_k":
        data = header.replace(b'"K":2', b'"K":4') + b"\n" + body
    elif damage == "bad_fingerprint":                 # parses, but the fingerprint is not one
        data = good.replace(json.dumps(FP.to_json(), separators=(",", ":")).encode(), b'{"values":[1,2]}')
        assert data != good
    else:                                              # right stamps, wrong facts: bytes differ
        lines = [json.loads(x) for x in body.splitlines()]
        for x in lines:
            if isinstance(x, list):
                x[1] += 1
        data = header + b"\n" + b"".join(json.dumps(x, separators=(",", ":")).encode() + b"\n" for x in lines)
    namespace.write_small(INDEX_KEY, data)
    gets = Gets(store, monkeypatch)
    report = scan_namespace(store.layout, store.namespace)
    assert gets.commits() == [1, 2]                    # nothing taken from the damaged index
    assert report.steps == scan_namespace(store.layout, store.namespace, use_index=False).steps
    assert [s.status for s in report.steps] == ["complete", "complete"]
    assert report.index_note is not None and "rebuilt" in report.index_note
    gets.clear()
    again = scan_namespace(store.layout, store.namespace)
    assert again.index_used and again.index_note is None and gets.commits() == []


def test_an_empty_namespace_gets_no_index_object(store, s3_server, s3_bucket):
    report = scan_namespace(store.layout, store.namespace)
    assert report.steps == () and report.index_note is None
    assert s3_server.keys(s3_bucket) == []


def test_a_read_only_credential_scans_and_writes_nothing(store, s3_server, s3_bucket, monkeypatch):
    for step in (1, 2):
        write_step(store, step, fingerprint=FP)
    before = s3_server.keys(s3_bucket)
    for k, v in s3_server.env("reader").items():
        monkeypatch.setenv(k, v)
    report = scan_namespace(store.layout, open_namespace(store.layout))   # a fresh client with the reader's key
    assert [s.status for s in report.steps] == ["complete", "complete"]
    assert "could not be rebuilt" in report.index_note
    assert s3_server.keys(s3_bucket) == before


class Puts:
    """Counts the PUTs of the index object this process makes."""

    def __init__(self, store, monkeypatch):
        self.n = 0
        client = store.namespace.storage.client
        real = client.put

        def put(key, data, **kw):
            self.n += key == INDEX_KEY
            return real(key, data, **kw)
        monkeypatch.setattr(client, "put", put)


def test_a_runs_commits_are_indexed_once_when_it_gives_the_namespace_back(store, monkeypatch):
    ns = store.namespace
    write_step(store, 1, fingerprint=FP)
    scan_namespace(store.layout, store.namespace)                       # the startup scan indexes step 1
    puts = Puts(store, monkeypatch)
    hold = ns.lock()
    for step in (2, 3, 4, 5):
        write_step(store, step, fingerprint=FP)
    store.namespace.remove_step(4)         # removed again during the run
    store.namespace.uncommit(5)            # being rewritten when the run ends
    assert puts.n == 0                                 # no commit touched the index object
    hold.release()
    assert puts.n == 1                                 # one PUT, when the run gave the namespace back
    assert sorted(index.read(store.layout, ns)) == [1, 2, 3]
    gets = Gets(store, monkeypatch)
    report = scan_namespace(store.layout, store.namespace)
    assert report.index_used and gets.commits() == [] and report.index_note is None
    assert report.steps == scan_namespace(store.layout, store.namespace, use_index=False).steps
    assert [s.status for s in report.steps] == ["complete", "complete", "complete", "incomplete"]


def test_a_step_changed_by_another_writer_after_our_commit_is_not_indexed_from_our_record(store, monkeypatch):
    ns = store.namespace
    hold = ns.lock()
    write_step(store, 1, fingerprint=FP)
    write_step(store, 2, fingerprint=FP)
    # another writer replaces step 2's commit record behind this run's back (a different record)
    record = json.loads(bytes(ns.read_small("2/commit.json")))
    record["fingerprint"] = FP2.to_json()
    ns.storage.client.put("2/commit.json", json.dumps(record).encode())
    hold.release()
    assert sorted(index.read(store.layout, ns)) == [1]
    report = scan_namespace(store.layout, store.namespace)
    assert report.get(2).fingerprint == FP2 and report.steps == scan_namespace(store.layout, store.namespace, use_index=False).steps
