"""One object-store client per URL, built from the URL and the standard environment.

`dump_dir: s3://bucket/prefix` (and `gs://`, `az://`, `memory://`, which obstore gives too). For S3
the endpoint and credentials come from what every AWS tool reads, so a user sets nothing of ours:

- `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
  `AWS_REGION` (or `AWS_DEFAULT_REGION`), `AWS_ALLOW_HTTP=true` for a plain-http endpoint;
- when the key is not in the environment: `AWS_SHARED_CREDENTIALS_FILE` (else ~/.aws/credentials)
  and `AWS_CONFIG_FILE` (else ~/.aws/config), profile `AWS_PROFILE` (else `default`): keys,
  `region`, `endpoint_url`. obstore reads none of these files, so `aws_config` does.

Timeouts and retries are tuned (obstore's defaults retry for 3 minutes): a request times out after
`SKIP_HARNESS_OBJSTORE_TIMEOUT_S` (default 60 s), connecting after 5 s, and a failing request is
retried with exponential backoff (100 ms doubling to 5 s) up to 5 times within the same 60 s. A write
given a `fence` (every write of a namespace: its lease's, `locker.LeaseLocker`) is retried here instead,
by the same rule, and asks the fence before every retry: a request that failed while its run stalled
is never sent again by a run that lost its lease in the meantime (obstore would resend it as it was).
Transfers release the GIL, so the writer thread and the prefetch thread call them as they call
`os.pread`.

obstore's runtime does not survive `fork` (a forked child's first call HANGS, with the same client
or a new one). Every call checks the process and raises `ObjectStoreForkError` instead.
"""
from __future__ import annotations

import configparser
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

from skip_harness.store.urls import URL_SCHEMES, is_url, join_url
from skip_harness.store.objstore.errors import (
    ObjectStoreConfigError,
    ObjectStoreError,
    ObjectStoreForkError,
    ObjectStoreUnavailable,
    classify,
    remember_secrets,
)

logger = logging.getLogger("skip_harness.store.objstore")

SCHEMES = URL_SCHEMES
TIMEOUT_ENV = "SKIP_HARNESS_OBJSTORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0
MAX_RETRIES = 5
MULTIPART_FROM = 5 << 30    # S3's largest single PUT: below it one request, which a killed run
                            # leaves no trace of (multipart would leave an incomplete upload behind)
PART_SIZE = 16 << 20


is_object_url = is_url     # the one URL test (store.urls)


# ------------------------------------------------------------------------------------ fork guard

_state = threading.Lock()
_used_in_pid: Optional[int] = None   # the process that has started obstore's runtime


def _note_use() -> None:
    global _used_in_pid
    pid = os.getpid()
    if _used_in_pid is None:
        with _state:
            if _used_in_pid is None:
                _used_in_pid = pid
    elif _used_in_pid != pid:
        raise ObjectStoreForkError(
            f"object store used in a forked child (pid {pid}) of process {_used_in_pid}, which had "
            "used one: obstore cannot run after fork (the call would hang). Only the trainer process "
            "reads and writes the cache; a DataLoader worker or other forked helper must not "
            "(use multiprocessing's 'spawn' or 'forkserver' start method if it has to).")


# ------------------------------------------------------------------------------------ AWS config


@dataclass(frozen=True)
class AwsSettings:
    """What the environment and the AWS files give for S3. `repr` never shows a secret."""
    endpoint: Optional[str] = None
    region: Optional[str] = None
    access_key_id: Optional[str] = None
    secret_access_key: Optional[str] = field(default=None, repr=False)
    session_token: Optional[str] = field(default=None, repr=False)
    allow_http: bool = False
    source: str = "environment"

    def store_kwargs(self) -> Dict[str, Any]:
        kw: Dict[str, Any] = {}
        if self.endpoint:
            kw["endpoint"] = self.endpoint
        if self.region:
            kw["region"] = self.region
        if self.access_key_id:
            kw["access_key_id"] = self.access_key_id
        if self.secret_access_key:
            kw["secret_access_key"] = self.secret_access_key
        if self.session_token:
            kw["session_token"] = self.session_token
        return kw


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _read_ini(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(path, encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError) as exc:
        logger.warning("%s: not read (%s)", path, type(exc).__name__)
    return cp


def _section(cp: configparser.ConfigParser, names: List[str]) -> Dict[str, str]:
    for name in names:
        if cp.has_section(name):
            return {k.lower(): v.strip() for k, v in cp.items(name)}
    return {}


def aws_config(env: Optional[Mapping[str, str]] = None) -> AwsSettings:
    """S3 settings from the environment, falling back to the AWS credentials and config files."""
    env = os.environ if env is None else env
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME") or Path.home())
    cred_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")
    conf_file = Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config")
    conf = _section(_read_ini(conf_file), [f"profile {profile}", profile] if profile != "default"
                    else ["default", "profile default"]) if conf_file.is_file() else {}
    key, secret, token = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY"), env.get("AWS_SESSION_TOKEN")
    source = "environment"
    if not key:
        creds = _section(_read_ini(cred_file), [profile]) if cred_file.is_file() else {}
        key = creds.get("aws_access_key_id") or conf.get("aws_access_key_id")
        secret = creds.get("aws_secret_access_key") or conf.get("aws_secret_access_key")
        token = creds.get("aws_session_token") or conf.get("aws_session_token")
        if key:
            source = f"profile {profile}"
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or conf.get("endpoint_url")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or conf.get("region")
    allow_http = _truthy(env.get("AWS_ALLOW_HTTP"))
    remember_secrets([secret, token])
    return AwsSettings(endpoint or None, region or None, key or None, secret or None, token or None,
                       allow_http, source)


# ------------------------------------------------------------------------------------ client

_memory_stores: Dict[str, Any] = {}


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
        if value <= 0:
            raise ValueError
        return value
    except ValueError:
        raise ObjectStoreConfigError(repr(raw), "must be a positive number of seconds", key=TIMEOUT_ENV) from None


def _build_store(url: str, timeout_s: float, retries: int = MAX_RETRIES) -> Any:
    from obstore.store import MemoryStore, S3Store, from_url

    scheme = url.partition("://")[0].lower()
    if scheme == "memory":
        # one store per URL in a process, so that two clients of one memory:// URL see each other
        with _state:
            return _memory_stores.setdefault(url, MemoryStore())
    client_options: Any = {"connect_timeout": f"{CONNECT_TIMEOUT_S:g}s", "timeout": f"{timeout_s:g}s"}
    retry: Any = {"max_retries": retries, "retry_timeout": timedelta(seconds=timeout_s),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                         "base": 2}}
    if scheme in ("s3", "s3a"):
        aws = aws_config()
        # passing client_options REPLACES the env's AWS_ALLOW_HTTP: carry it over ourselves
        client_options["allow_http"] = aws.allow_http
        if aws.endpoint and aws.endpoint.lower().startswith("http://") and not aws.allow_http:
            raise ObjectStoreConfigError(
                url, f"the endpoint {aws.endpoint} is plain http: set AWS_ALLOW_HTTP=true to allow it")
        bucket_and_prefix = url.partition("://")[2]
        return S3Store.from_url("s3://" + bucket_and_prefix, client_options=client_options,
                                retry_config=retry, **aws.store_kwargs())
    return from_url(url, client_options=client_options, retry_config=retry)


class ObjectClient:
    """The obstore calls the cache makes, on one URL (`scheme://bucket/prefix`), with keys relative
    to it. Every failure comes out as an `ObjectStoreError` kind (see errors.py); every call refuses
    a forked child."""

    def __init__(self, url: str, *, timeout_s: Optional[float] = None):
        if not is_object_url(url):
            raise ObjectStoreConfigError(str(url), f"not an object-store URL (schemes: {', '.join(SCHEMES)})")
        scheme, _, rest = str(url).partition("://")
        if scheme.lower() != "memory" and not rest.partition("/")[0]:
            raise ObjectStoreConfigError(str(url), f"no bucket name: an object-store URL is {scheme}://BUCKET/PREFIX")
        self.url = url.rstrip("/")
        self.timeout_s = _timeout_s() if timeout_s is None else float(timeout_s)
        try:
            import obstore  # noqa: F401
        except ImportError as exc:
            raise ObjectStoreConfigError(
                self.url, f"object storage needs the [s3] extra (pip install 'skip_harness[s3]'): {exc}") from None
        _note_use()
        try:
            self.store = _build_store(self.url, self.timeout_s)
            # the same store without obstore's retries (the same settings, read now): fenced writes retry here
            self._once = self.store if scheme.lower() == "memory" else _build_store(self.url, self.timeout_s, retries=0)
        except ObjectStoreError:
            raise
        except Exception as exc:  # obstore's builder: bad URL, unknown option
            raise classify(exc, self.url) from None

    def __repr__(self) -> str:
        return f"ObjectClient({self.url!r})"

    def key_url(self, key: str) -> str:
        return join_url(self.url, key)

    def _call(self, key: str, fn, *args, **kwargs):
        _note_use()
        try:
            return fn(*args, **kwargs)
        except ObjectStoreError:
            raise
        except Exception as exc:
            from obstore.exceptions import BaseError
            if isinstance(exc, (BaseError, FileNotFoundError, OSError)):
                raise classify(exc, self.key_url(key)) from None
            raise

    def _fenced(self, key: str, fence: Optional[Callable[[str], None]], fn: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        """`fn(store, *args, **kwargs)` on obstore's retrying store; with a `fence`, on the store that
        sends each request once, retried here (MAX_RETRIES times within timeout_s, the same backoff)
        with `fence(key)` asked before every retry: it raises once this process may not write."""
        if fence is None or self._once is self.store:
            return self._call(key, fn, self.store, *args, **kwargs)
        deadline = time.monotonic() + self.timeout_s
        delay = 0.1
        for attempt in range(MAX_RETRIES + 1):
            try:
                return self._call(key, fn, self._once, *args, **kwargs)
            except ObjectStoreUnavailable:
                fence(key)           # it may have failed because this run stalled: is the namespace still ours?
                if attempt == MAX_RETRIES or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            fence(key)
        raise AssertionError("unreachable")

    # -- objects
    def put(self, key: str, data: Any, *, mode: Any = None, fence: Optional[Callable[[str], None]] = None) -> str:
        """Write `data` (bytes or a buffer) at `key`; returns the new ETag. `mode="create"` fails with
        ObjectRaceLost when the key exists; `mode={"e_tag": etag}` when it changed. `fence`: a write of
        a namespace, whose retries must pass its fence (`_fenced`)."""
        import obstore as obs
        n = memoryview(data).nbytes
        multipart = n > MULTIPART_FROM
        res = self._fenced(key, fence, obs.put, key, data, mode=mode, use_multipart=multipart,
                           chunk_size=PART_SIZE)
        return res.get("e_tag") or ""

    def get(self, key: str) -> "tuple[Any, Dict[str, Any]]":
        """(obstore.Bytes, meta) of `key`; the Bytes has the buffer protocol."""
        import obstore as obs

        def fetch():
            res = obs.get(self.store, key)
            return res.bytes(), res.meta
        return self._call(key, fetch)

    def stream(self, key: str, chunk_bytes: int = 8 << 20) -> "tuple[Dict[str, Any], Iterator[Any]]":
        """(meta, the object's bytes in chunks of about `chunk_bytes`): the caller works on each
        chunk while the next one arrives."""
        import obstore as obs
        res = self._call(key, obs.get, self.store, key)
        chunks = res.stream(min_chunk_size=chunk_bytes)

        def each() -> Iterator[Any]:
            while True:
                try:
                    yield self._call(key, next, chunks)
                except StopIteration:
                    return
        return res.meta, each()

    def head(self, key: str) -> Dict[str, Any]:
        import obstore as obs
        return self._call(key, obs.head, self.store, key)

    def list(self, prefix: Optional[str] = None) -> Iterator[Dict[str, Any]]:
        """Every object under `prefix` (whole path segments), recursively, in pages of 1000."""
        import obstore as obs
        stream = self._call(prefix or "", obs.list, self.store, prefix, chunk_size=1000)
        while True:
            try:
                chunk = self._call(prefix or "", next, stream)
            except StopIteration:
                return
            yield from chunk

    def list_dir(self, prefix: Optional[str] = None) -> "tuple[List[str], List[Dict[str, Any]]]":
        """(the 'directories' directly under `prefix`, as full keys without the '/'; the objects there)."""
        import obstore as obs
        res = self._call(prefix or "", obs.list_with_delimiter, self.store, prefix)
        return [p.rstrip("/") for p in res["common_prefixes"]], list(res["objects"])

    def list_dirs(self, prefix: Optional[str] = None) -> List[str]:
        """The names of the 'directories' directly under `prefix`."""
        import obstore as obs
        res = self._call(prefix or "", obs.list_with_delimiter, self.store, prefix)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]

    def delete(self, keys: List[str], *, fence: Optional[Callable[[str], None]] = None) -> None:
        import obstore as obs
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            self._fenced(batch[0], fence, obs.delete, batch)

    def copy(self, src: str, dst: str, *, fence: Optional[Callable[[str], None]] = None) -> None:
        import obstore as obs
        self._fenced(dst, fence, obs.copy, src, dst)
