"""A real S3 server: moto's server mode on a free 127.0.0.1 port, for the tests (tests/s3server.py's fixtures),
scripts/bench_s3.py and scripts/fresh_envs.py -- never a mocked client.

    python scripts/moto_server.py -H 127.0.0.1 -p PORT      # the patched server (moto's own options)

- `start_server(log_dir, auth=True)`: starts the server (with the one fix below) and, with `auth`, creates
  two IAM users while auth is still off -- `writer` (s3:*) and `reader` (s3:GetObject, s3:ListBucket) --
  then turns auth on (POST /moto-api/reset-auth, body 0, text/plain), so signatures and policies are
  checked from then on. `server.stop()` stops it (bounded waits).
- `server.pause()` / `server.resume()`: SIGSTOP / SIGCONT, an outage that keeps the server's state
  (moto keeps everything in memory: a kill would lose every bucket).

The fix: werkzeug>=3 `Request.url` percent-decodes the query (prefix=ns%2Fsteps%2F becomes
prefix=ns/steps/) and moto's SigV4 check canonicalises that decoded URL, so every signed listing
with a '/' in its prefix fails with SignatureDoesNotMatch once auth is on. Run as a script, this
file starts moto with a `Request.url` that keeps the raw query string the client signed.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

HOST = "127.0.0.1"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    proc: subprocess.Popen
    port: int
    log: Path
    users: Dict[str, tuple] = field(default_factory=dict)   # name -> (key id, secret)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self, user: str = "writer") -> Dict[str, str]:
        key, secret = self.users.get(user, ("testing", "testing"))
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_ALLOW_HTTP": "true"}

    def boto3(self, service: str = "s3", user: str = "writer"):
        import boto3
        key, secret = self.users.get(user, ("testing", "testing"))
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=key, aws_secret_access_key=secret)

    def create_bucket(self, name: Optional[str] = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.boto3().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list:
        s3 = self.boto3()
        out, token = [], None
        while True:
            kw = {"Bucket": bucket, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            res = s3.list_objects_v2(**kw)
            out += [o["Key"] for o in res.get("Contents", [])]
            token = res.get("NextContinuationToken")
            if not token:
                return sorted(out)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _post(url: str, body: bytes) -> str:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def start_server(log_dir: Path, *, auth: bool = True, timeout: float = 30.0) -> S3Server:
    """Start the patched moto server on a free 127.0.0.1 port and wait (bounded) until it answers."""
    port = _free_port()
    log = Path(log_dir) / f"moto-{port}.log"
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("AWS_"):
            del env[k]
    fh = open(log, "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "-H", HOST, "-p", str(port)],
                            stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    fh.close()
    server = S3Server(proc, port, log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.endpoint}/moto-api/", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"moto server did not answer on {server.endpoint} within {timeout:g} s")
        time.sleep(0.2)
    if auth:
        iam = server.boto3("iam")

        def user(name, actions):
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps({
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": actions, "Resource": ["arn:aws:s3:::*"]}]}))
            k = iam.create_access_key(UserName=name)["AccessKey"]
            return k["AccessKeyId"], k["SecretAccessKey"]

        server.users["writer"] = user("writer", ["s3:*", "iam:*"])
        server.users["reader"] = user("reader", ["s3:GetObject", "s3:ListBucket"])
        _post(f"{server.endpoint}/moto-api/reset-auth", b"0")   # enforce from the next request on
    return server


def _patch_and_run(argv) -> int:
    from werkzeug.sansio.request import Request as _SansIORequest
    from werkzeug.sansio.utils import get_current_url

    def _raw_url(self):
        url = get_current_url(self.scheme, self.host, self.root_path, self.path)
        if self.query_string:
            url += "?" + self.query_string.decode("latin-1")
        return url

    _SansIORequest.url = property(_raw_url)  # type: ignore[method-assign,assignment]
    from moto.server import main
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(_patch_and_run(sys.argv[1:]))
