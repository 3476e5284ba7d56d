"""A namespace's objects on a real S3 server: payloads size-checked, the commit record last and
create-only, one listing grouped by step in numeric order, verified reads, removal commit-first,
set-aside under .quarantine/, a read-only credential that serves and writes nothing."""
from __future__ import annotations

import json

import pytest
import xxhash

from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from skip_harness.errors import CorruptStepError, LockHeldError
from skip_harness.store.layout import COMMIT_NAME
from skip_harness.store.namespace import Namespace
from skip_harness.store.open import DumpDir, open_dump_dir
from skip_harness.store.bufferpool import BufferPool
from objstore_namespace import ObjectNamespace, list_namespaces
from skip_harness.store.objstore.errors import ObjectAccessDenied, ObjectCorrupt


def put_step(ns, step, commit=True, n=2):
    files = []
    for i in range(n):
        data = bytes([step % 256, i]) * 5000
        rel = f"{i}/tq_batch.pt"
        assert ns.write(step, rel, memoryview(data)) == len(data)
        files.append({"rel": rel, "bytes": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)})
    if commit:
        ns.commit(step, json.dumps({"files": files}).encode())
    return files


@pytest.fixture(params=["s3", "memory"])
def ns(request, s3_bucket):
    if request.param == "s3":
        return ObjectNamespace(f"s3://{s3_bucket}/cache/exp_proj/GBS8_N2_in16_out32_K2")
    return ObjectNamespace(f"memory://t-{s3_bucket}/cache/exp_proj/GBS8_N2_in16_out32_K2")


def test_write_commit_list_read(ns):
    for step in (10, 2, 1):
        put_step(ns, step, commit=step != 2)
    steps = ns.list_steps().steps
    assert [s.step for s in steps] == [1, 2, 10]                       # numeric, not byte order
    assert [s.committed for s in steps] == [True, False, True]         # 2: payloads, no record
    assert set(steps[0].files) == {"0/tq_batch.pt", "1/tq_batch.pt", COMMIT_NAME}
    assert all(f.stamp for f in steps[0].files.values())                # ETags as change stamps
    assert ns.step_numbers() == [1, 2, 10]
    with pytest.raises(CorruptStepError, match="already"):
        ns.commit(1, b"{}")                                             # committed steps are immutable
    rec = json.loads(ns.read_commit(10))["files"][1]
    out = bytearray(rec["bytes"] + 7)
    ns.read_checked(10, rec["rel"], rec["bytes"], rec["xxh3_128"], out)
    assert bytes(out[:rec["bytes"]]) == bytes([10, 1]) * 5000
    assert bytes(ns.read_checked(10, rec["rel"], rec["bytes"], rec["xxh3_128"])) == bytes([10, 1]) * 5000
    assert ns.read_commit(2) is None


def test_damaged_payload_fails_verified_read(ns):
    rec = put_step(ns, 3)[0]
    ns.client.put(f"3/{rec['rel']}", b"\x00" * rec["bytes"])            # same size, other bytes
    with pytest.raises(ObjectCorrupt, match="checksum"):
        ns.read_checked(3, rec["rel"], rec["bytes"], rec["xxh3_128"])
    pool = BufferPool()
    with pytest.raises(CorruptStepError, match="checksum"):
        ns.read_verified(3, rec["rel"], rec["bytes"], rec["xxh3_128"], pool)
    ns.client.put(f"3/{rec['rel']}", b"\x00" * 10)
    with pytest.raises(ObjectCorrupt, match="commit record says"):
        ns.read_checked(3, rec["rel"], rec["bytes"], rec["xxh3_128"])
    with pytest.raises(CorruptStepError, match="commit record says"):
        ns.read_verified(3, rec["rel"], rec["bytes"], rec["xxh3_128"], pool)
    ns.client.delete([f"3/{rec['rel']}"])
    with pytest.raises(CorruptStepError, match="missing"):
        ns.read_verified(3, rec["rel"], rec["bytes"], rec["xxh3_128"], pool)


def test_remove_deletes_the_commit_record_first(ns):
    put_step(ns, 4)
    order = []
    real = ns.client.delete
    ns.client.delete = lambda keys, **kw: (order.append(list(keys)), real(keys, **kw))[1]
    removed = ns.remove_step(4)
    assert order[0] == ["4/commit.json"] and "4/commit.json" not in order[1]
    assert removed > 20000 and ns.list_steps().steps == ()


def test_set_aside_copies_under_quarantine_then_removes(ns):
    put_step(ns, 5, commit=False)
    put_step(ns, 6)
    where = ns.set_aside(5, "incomplete")
    assert where.startswith(ns.url + "/.quarantine/5-incomplete-")
    keys = [m["path"] for m in ns.objects()]
    assert [s.step for s in ns.list_steps().steps] == [6]
    rest = where[len(ns.url) + 1:]
    assert sorted(k for k in keys if k.startswith(".quarantine/")) == [f"{rest}/0/tq_batch.pt", f"{rest}/1/tq_batch.pt"]


def test_list_namespaces(s3_bucket):
    for leaf in ("exp_proj/GBS8_N2_in16_out32", "exp_proj/GBS8_N2_in16_out32_K4", "other_p/GBS1_N1_in1_out1"):
        put_step(ObjectNamespace(f"s3://{s3_bucket}/root/{leaf}"), 1)
    assert list_namespaces(f"s3://{s3_bucket}/root") == [
        f"s3://{s3_bucket}/root/exp_proj/GBS8_N2_in16_out32", f"s3://{s3_bucket}/root/exp_proj/GBS8_N2_in16_out32_K4",
        f"s3://{s3_bucket}/root/other_p/GBS1_N1_in1_out1"]


def test_read_only_credential_serves_and_writes_nothing(s3_server, s3_bucket, monkeypatch):
    url = f"s3://{s3_bucket}/cache/exp_proj/GBS8_N2_in16_out32_K2"
    rec = put_step(ObjectNamespace(url), 7)[0]
    before = s3_server.keys(s3_bucket)
    for k, v in s3_server.env("reader").items():
        monkeypatch.setenv(k, v)
    ro = ObjectNamespace(url)
    assert ro.acquire() is None and ro.read_only
    assert [s.step for s in ro.list_steps().steps] == [7]
    assert bytes(ro.read_checked(7, rec["rel"], rec["bytes"], rec["xxh3_128"])) == bytes([7, 0]) * 5000
    assert ro.writable() is not None and "may only read" in ro.writable()
    for attempt in (lambda: ro.write(8, "0/tq_batch.pt", b"x"), lambda: ro.commit(8, b"{}"),
                    lambda: ro.remove_step(7), lambda: ro.set_aside(7, "corrupt")):
        with pytest.raises(ObjectAccessDenied, match="read-only"):
            attempt()
    assert s3_server.keys(s3_bucket) == before


LEAF = "exp_proj/GBS8_N1_in16_out16_K2_W1"


def test_the_backend_interface_on_a_bucket(s3_server, s3_bucket):
    """The namespace over the object storage, as the POSIX test drives it, on an s3:// dump_dir."""
    dump = open_dump_dir(f"s3://{s3_bucket}/dump")
    assert isinstance(dump, DumpDir)
    ns = dump.namespace(LEAF)
    assert isinstance(ns, Namespace) and ns.url == f"s3://{s3_bucket}/dump/{LEAF}"
    with pytest.raises(ValueError, match="not a namespace name"):
        dump.namespace("exp_proj/notaleaf")
    hold = ns.lock()
    assert not hold.read_only and not hold.lost and ns.writable() is None
    with pytest.raises(LockHeldError, match="namespace is locked by"):
        dump.namespace(LEAF).lock(timeout=0)
    pool = BufferPool()
    data = b"y" * 7000
    lease = pool.acquire(len(data))
    lease.view(len(data))[:] = data
    try:
        assert ns.write_payload(3, "0/tq_batch.pt", lease, len(data)) == len(data)
    finally:
        lease.release()
    ns.write_small("3/0/meta.json", b"{}\n")
    ns.write_small("3/0/meta.json", b"{ }\n")                       # replaced
    assert ns.read_small("3/0/meta.json") == b"{ }\n" and ns.read_small("3/nope") is None
    [step] = ns.list_steps().steps
    assert not step.committed and set(step.files) == {"0/tq_batch.pt", "0/meta.json"}
    ns.commit(3, b'{"step": 3}')
    assert ns.list_step(3).committed and ns.list_step(4) is None
    assert ns.list_step(3).total == len(data) + 4 + 11 == ns.list_steps().steps[0].total
    import time as _time
    assert abs(ns.modified("3") - _time.time()) < 60 and ns.modified("") >= ns.modified("3")
    assert ns.modified("4") is None and ns.map_verified(3, "0/tq_batch.pt", len(data), "x") is None
    from skip_harness.store.checksum import checksum_bytes
    got, size = ns.read_verified(3, "0/tq_batch.pt", len(data), checksum_bytes(data), pool)
    assert size == len(data) and bytes(got.view(size)) == data
    got.release()
    ns.uncommit(3)
    assert not ns.list_step(3).committed and set(ns.list_step(3).files) == {"0/tq_batch.pt", "0/meta.json"}
    ns.uncommit(3)                                                   # none: nothing
    ns.write_small(".index.jsonl", b"index")
    assert ns.read_small(".index.jsonl") == b"index" and [s.step for s in ns.list_steps().steps] == [3]
    ns.put_run_marker("tok1")
    assert dump.namespace(LEAF).sees_run_marker("tok1") and not ns.sees_run_marker("tok2", wait=0.3)
    ns.remove_run_marker("tok1")
    assert not ns.sees_run_marker("tok1")
    assert dump.list_namespaces() == [LEAF]
    hold.release()
    hold.release()
    dump.namespace(LEAF).lock().release()                           # free again


def test_a_reader_gets_a_read_only_hold(s3_server, s3_bucket, monkeypatch):
    for k, v in s3_server.env("reader").items():
        monkeypatch.setenv(k, v)
    ns = open_dump_dir(f"s3://{s3_bucket}/dump").namespace(LEAF)
    hold = ns.lock()
    assert hold.read_only and not hold.lost and ns.writable() is not None
    hold.release()
    assert s3_server.keys(s3_bucket) == []


def test_a_url_without_obstore_names_the_extra(monkeypatch):
    import sys
    from skip_harness.errors import ConfigError
    monkeypatch.setitem(sys.modules, "obstore", None)              # as if the [s3] extra were missing
    with pytest.raises(ConfigError, match=r"skip.rollout_tq.dump_dir.*pip install 'skip_harness\[s3\]'"):
        open_dump_dir("s3://bucket/prefix")


def test_every_command_finds_where_runs_write_on_an_object_store(s3_bucket, monkeypatch, capsys, tmp_path):
    """$SKIP_HARNESS_DUMP_DIR is a bucket: `ls` with no DUMP_DIR lists it (it raised AttributeError: the URL
    was a str where a path was expected), and a namespace named as `ls` names it is found there by
    verify, show and diff alike."""
    import torch

    from skip_harness import SkipHarness
    from skip_harness.cli import main

    class Loop:
        def prepare_data(self, step, *, dispatch=True):
            pass

        def sample(self, step):
            return {"ids": torch.arange(8) + step}

    from skip_harness.cli import _discovery

    monkeypatch.setattr(_discovery, "_SAID", set())        # "is not here" is said once a process
    root = f"s3://{s3_bucket}/runs"
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", root)
    monkeypatch.chdir(tmp_path)
    assert main(["ls"]) == 0
    assert f"no skip_harness namespaces under {root}" in capsys.readouterr().out
    t, h = Loop(), SkipHarness.create({"enable": True}, namespace={"experiment_name": "e", "project_name": "p"})
    h.wrap(t)
    for step in (1, 2):
        t.prepare_data(step)
        t.sample(step)
    assert h.close().committed == 2
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    (name,) = [w for line in out.splitlines() for w in line.split() if w.startswith("e_p/")]
    assert main(["verify", name]) == 0
    out = capsys.readouterr().out
    assert f"verified {root}/{name}" in out and "every complete step verifies" in out, out
    assert main(["show", name, "1"]) == 0 and '"step": 1' in capsys.readouterr().out
    assert main(["diff", name, name]) == 0
    assert "rollouts: 2 steps the same" in capsys.readouterr().out
    # a name with nothing under it is no namespace (it read as an empty one, every step missing)
    for argv in (["verify", "e_p/GBS8_N2_in4_out4"], ["diff", "e_p/GBS8_N2_in4_out4", name]):
        assert main(argv) == 2
        assert f"{root}/e_p/GBS8_N2_in4_out4 does not exist (nothing under that prefix)" in capsys.readouterr().err
    from skip_harness.store.pack import write_pack
    from skip_harness.store.packfile import PackError

    with pytest.raises(PackError, match="does not exist: no namespace to pack"):      # the API's error, as promised
        write_pack(f"{root}/e_p/GBS8_N2_in4_out4", tmp_path / "x.pack")
    # the check of every argument before a command runs resolves nothing: no "is not here" for a PACK
    assert main(["replay", "e_p/GBS4_N1_in4_out4", "--", "true"]) == 2
    assert "is not here" not in capsys.readouterr().err


def test_a_pack_unpacks_into_an_object_store(s3_bucket, monkeypatch, capsys, tmp_path):
    """`skip-harness unpack FILE s3://...` restores the namespace in the bucket (it made a local folder
    `s3:/bucket/...` of the URL), where verify finds every step."""
    import torch

    from skip_harness import SkipHarness
    from skip_harness.cli import main

    class Loop:
        def prepare_data(self, step, *, dispatch=True):
            pass

        def sample(self, step):
            return {"ids": torch.arange(8) + step}

    monkeypatch.chdir(tmp_path)
    t, h = Loop(), SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "local")},
                                       namespace={"experiment_name": "e", "project_name": "p"})
    h.wrap(t)
    for step in (1, 2):
        t.prepare_data(step)
        t.sample(step)
    assert h.close().committed == 2
    (ns,) = (tmp_path / "local" / "e_p").iterdir()
    assert main(["pack", str(ns), "-o", str(tmp_path / "r.pack")]) == 0
    target = f"s3://{s3_bucket}/restored"
    assert main(["unpack", str(tmp_path / "r.pack"), target]) == 0
    assert f"at {target}/e_p/{ns.name}" in capsys.readouterr().out.replace("\n", "")
    assert not (tmp_path / "s3:").exists()
    assert main(["verify", f"{target}/e_p/{ns.name}"]) == 0
    assert "every complete step verifies" in capsys.readouterr().out
