"""The step store (store.stepstore) over the object backend, on a real S3 server: the same writes,
commit, status and verified reads a run makes, with every byte in the bucket."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_batch_equal, batch, write_step
from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from skip_harness.store.open import open_dump_dir
from skip_harness.store.layout import Layout
from skip_harness.store.stepstore import StepStore

LEAF = "exp_proj/GBS8_N2_in16_out32_K2_W1"


@pytest.fixture
def store(s3_bucket, tmp_path):
    ns = open_dump_dir(f"s3://{s3_bucket}/dump").namespace(LEAF)
    # the Layout only names paths in messages here: nothing may appear under it
    return StepStore(Layout(tmp_path / "never-written", K=2, W=1), namespace=ns)


def test_written_committed_and_served_from_the_bucket(store, s3_server, s3_bucket, tmp_path):
    write_step(store, 1)
    write_step(store, 2, commit=False)                          # a run killed before the commit
    keys = s3_server.keys(s3_bucket, f"dump/{LEAF}/")
    assert f"dump/{LEAF}/1/commit.json" in keys and f"dump/{LEAF}/1/1/tq_batch.pt" in keys
    assert f"dump/{LEAF}/2/0/tq_batch.pt" in keys and f"dump/{LEAF}/2/commit.json" not in keys
    assert store.status(1).status == "complete" and store.status(2).status == "incomplete"
    assert store.status(3).status == "incomplete" and not store.status(3).exists
    status, reason, batches, metas = store.reader.read_served(1, 0)
    assert (status, reason) == ("complete", None)
    for i in range(2):
        assert_batch_equal(batches[i], batch(1, i))
        assert_batch_equal(store.reader.read_inner(1, i, 0), batch(1, i))
    assert store.reader.verify(1) == ("complete", None)   # the load check on a bucket: the verified read and a decode
    assert not (tmp_path / "never-written").exists()


def test_a_changed_byte_in_the_bucket_is_refused(store, s3_server, s3_bucket):
    write_step(store, 4)
    s3 = s3_server.boto3()
    key = f"dump/{LEAF}/4/1/tq_batch.pt"
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[-1] ^= 0x01
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    status, reason, batches, _ = store.reader.read_served(4, 0)
    assert status == "corrupt" and "checksum" in reason and key.split("/", 1)[1] in reason and batches == []
    assert "checksum" in store.reader.verify(4)[1]


def test_a_rewrite_uncommits_first_and_clear_removes_the_record_first(store, s3_server, s3_bucket):
    write_step(store, 5)
    store.writer.write_inner(5, 0, 0, batch(50, 0), {"note": "rewrite"})   # the step is being rewritten
    assert f"dump/{LEAF}/5/commit.json" not in s3_server.keys(s3_bucket)
    assert store.status(5).status == "incomplete"
    entries = store.writer.write_inner(5, 1, 0, batch(50, 1), {"note": "rewrite"})
    store.writer.commit(5, list(store.writer.write_inner(5, 0, 0, batch(50, 0), {})) + list(entries), None)
    assert store.status(5).status == "complete"
    assert_batch_equal(store.reader.read_served(5, 0)[2][1], batch(50, 1))
    assert store.writer.clear_step(5) > 0 and s3_server.keys(s3_bucket, f"dump/{LEAF}/5/") == []
    record = json.loads(store.namespace.read_small("5/commit.json") or b"null")
    assert record is None


def test_a_committed_payload_in_the_previous_format_is_served_from_the_verified_bytes(store, s3_server, s3_bucket):
    """A payload stored as the previous version's torch.save image, listed in a valid commit record:
    decoded from the bytes the verified read brought (there is no local file to open again)."""
    import io

    import torch
    import xxhash

    write_step(store, 6)
    old = io.BytesIO()
    torch.save({"x": torch.arange(5)}, old)
    data = old.getvalue()
    s3 = s3_server.boto3()
    s3.put_object(Bucket=s3_bucket, Key=f"dump/{LEAF}/6/1/tq_batch.pt", Body=data)
    ckey = f"dump/{LEAF}/6/commit.json"
    doc = json.loads(s3.get_object(Bucket=s3_bucket, Key=ckey)["Body"].read())
    for f in doc["files"]:
        if f["rel"] == "1/tq_batch.pt":
            f["bytes"], f["checksum"] = len(data), xxhash.xxh3_128_hexdigest(data)
    s3.put_object(Bucket=s3_bucket, Key=ckey, Body=json.dumps(doc).encode())
    status, reason, batches, _ = store.reader.read_served(6, 0)
    assert (status, reason) == ("complete", None)
    assert batches[1]["x"].tolist() == [0, 1, 2, 3, 4]
    assert store.reader.read_inner(6, 1, 0)["x"].tolist() == [0, 1, 2, 3, 4]
