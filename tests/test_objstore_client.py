"""The object-store client against a real S3 server (moto, tests/s3server.py): URLs and the AWS
environment and files, the four error kinds, the fork guard, secrets kept out of messages."""
from __future__ import annotations

import logging
import os
import time

import pytest

from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from skip_harness.store.objstore import client as client_mod
from skip_harness.store.objstore.client import ObjectClient, aws_config, is_object_url
from skip_harness.store.objstore.errors import (
    ObjectAccessDenied,
    ObjectMissing,
    ObjectRaceLost,
    ObjectStoreConfigError,
    ObjectStoreForkError,
    ObjectStoreUnavailable,
)


def test_object_urls():
    assert is_object_url("s3://b/p") and is_object_url("memory://x") and is_object_url("gs://b")
    assert not is_object_url("/tmp/cache") and not is_object_url("relative/dir")
    with pytest.raises(ObjectStoreConfigError, match="not an object-store URL"):
        ObjectClient("/tmp/cache")


def test_put_get_list_and_error_kinds(s3_bucket):
    c = ObjectClient(f"s3://{s3_bucket}/ns")
    etag = c.put("1/a.bin", b"hello")
    data, meta = c.get("1/a.bin")
    assert bytes(data) == b"hello" and meta["e_tag"] == etag and c.head("1/a.bin")["size"] == 5
    for step in (10, 2):
        c.put(f"{step}/a.bin", b"x")
    assert sorted(c.list_dirs()) == ["1", "10", "2"]
    assert [m["path"] for m in c.list("1")] == ["1/a.bin"]      # whole segments: not 10/
    with pytest.raises(ObjectMissing, match=f"s3://{s3_bucket}/ns/nope"):
        c.get("nope")
    with pytest.raises(ObjectRaceLost):
        c.put("1/a.bin", b"again", mode="create")
    with pytest.raises(ObjectRaceLost):
        c.put("1/a.bin", b"again", mode={"e_tag": '"not-the-etag"'})
    assert bytes(c.get("1/a.bin")[0]) == b"hello"
    c.delete(["1/a.bin", "2/a.bin"])
    assert sorted(c.list_dirs()) == ["10"]


def test_reader_credential_reads_and_is_denied_writes(s3_server, s3_bucket, monkeypatch):
    ObjectClient(f"s3://{s3_bucket}/ns").put("1/a.bin", b"hello")
    for k, v in s3_server.env("reader").items():
        monkeypatch.setenv(k, v)
    r = ObjectClient(f"s3://{s3_bucket}/ns")
    assert bytes(r.get("1/a.bin")[0]) == b"hello"
    assert [m["path"] for m in r.list("1")] == ["1/a.bin"]     # signed listing with a '/' prefix
    with pytest.raises(ObjectAccessDenied):
        r.put("1/b.bin", b"x")
    with pytest.raises(ObjectAccessDenied):
        r.put(".lock", b"x", mode="create")
    with pytest.raises(ObjectAccessDenied):
        r.delete(["1/a.bin"])                  # a denied bulk delete comes back generic from obstore
    assert s3_server.keys(s3_bucket) == ["ns/1/a.bin"]


def test_wrong_secret_is_refused_and_never_shown(s3_server, s3_bucket, monkeypatch, caplog):
    from skip_harness.store.objstore import ObjectCredentialsRefused
    secret = "wrong-secret-" + "S3CR3T" * 4
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG)
    c = ObjectClient(f"s3://{s3_bucket}/ns")
    with pytest.raises(ObjectCredentialsRefused, match="credentials refused") as info:   # not a read-only credential
        c.get("1/a.bin")
    assert secret not in str(info.value) and secret not in repr(c) and secret not in caplog.text
    assert secret not in repr(aws_config())


def test_plain_http_needs_aws_allow_http(s3_bucket, monkeypatch):
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    with pytest.raises(ObjectStoreConfigError, match="AWS_ALLOW_HTTP=true"):
        ObjectClient(f"s3://{s3_bucket}/ns")


def test_credentials_and_endpoint_from_aws_files(s3_server, s3_bucket, tmp_path, monkeypatch):
    """obstore reads no AWS file: our reader gives it the profile's keys, region and endpoint."""
    key, secret = s3_server.users["writer"]
    (tmp_path / "credentials").write_text(
        f"[default]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n\n"
        f"[lab]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    (tmp_path / "config").write_text(f"[default]\nendpoint_url = {s3_server.endpoint}\n[profile lab]\nregion = us-east-1\nendpoint_url = {s3_server.endpoint}\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "lab")
    got = aws_config()
    assert (got.access_key_id, got.endpoint, got.region, got.source) == (key, s3_server.endpoint, "us-east-1", "profile lab")
    c = ObjectClient(f"s3://{s3_bucket}/files")
    c.put("x", b"1")
    assert [m["path"] for m in c.list()] == ["x"]
    monkeypatch.setenv("AWS_PROFILE", "default")      # the default profile's unknown key: refused
    from skip_harness.store.objstore import ObjectCredentialsRefused
    with pytest.raises(ObjectCredentialsRefused, match="no such access key"):
        ObjectClient(f"s3://{s3_bucket}/files").get("x")


def test_memory_url_is_shared_within_the_process():
    a, b = ObjectClient("memory://t1"), ObjectClient("memory://t1")
    a.put("k", b"v")
    assert bytes(b.get("k")[0]) == b"v"
    with pytest.raises(ObjectMissing):
        ObjectClient("memory://t2").get("k")


def test_forked_child_is_refused_not_hung(s3_bucket):
    """obstore hangs in a forked child once the parent used it: the guard raises instead."""
    c = ObjectClient(f"s3://{s3_bucket}/ns")
    c.put("k", b"v")
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what happened, never return into pytest
        try:
            try:
                c.get("k")
                msg = b"served"
            except ObjectStoreForkError:
                try:
                    ObjectClient(f"s3://{s3_bucket}/ns")
                    msg = b"new client allowed"
                except ObjectStoreForkError:
                    msg = b"refused"
            os.write(wfd, msg)
        finally:
            os._exit(0)
    os.close(wfd)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        time.sleep(0.1)
    else:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    out = os.read(rfd, 100)
    os.close(rfd)
    assert out == b"refused", f"forked child: {out!r} (empty: it hung and was killed)"


@pytest.mark.slow
def test_server_stopped_is_transient_and_bounded(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv(client_mod.TIMEOUT_ENV, "2")
    c = ObjectClient(f"s3://{s3_bucket}/ns")
    c.put("k", b"v")
    s3_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreUnavailable, match="unavailable"):
            c.put("k2", b"v" * 1000)
        assert time.monotonic() - t0 < 30
    finally:
        s3_server.resume()
    assert bytes(c.get("k")[0]) == b"v"           # state survived the outage
