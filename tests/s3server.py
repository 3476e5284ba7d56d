"""The real S3 server's fixtures (the server itself: scripts/moto_server.py, moto's server mode on 127.0.0.1).

- `s3_server` (session fixture): the server with auth on and two IAM users, `writer` (s3:*) and `reader`
  (s3:GetObject, s3:ListBucket); stopped at the end (bounded waits).
- `s3_env` (function fixture): the writer's AWS_* environment set in os.environ for the test and
  returned as a dict for its subprocesses; `s3_bucket` a fresh bucket for the test.
- `server.pause()` / `server.resume()`: SIGSTOP / SIGCONT, an outage that keeps the server's state.

scripts/ is on the tests' path (pyproject.toml's [tool.pytest.ini_options] pythonpath), as it is on a
script's when Python runs one.
"""
from __future__ import annotations

import os

import pytest

from moto_server import S3Server, start_server  # noqa: F401  (S3Server, start_server: the tests import them here)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    env = s3_server.env("writer")
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SKIP_HARNESS_OBJSTORE_TIMEOUT_S", "10")
    return dict(os.environ)


@pytest.fixture
def s3_bucket(s3_server, s3_env):
    return s3_server.create_bucket()
