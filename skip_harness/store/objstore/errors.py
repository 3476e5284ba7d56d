"""What can go wrong talking to an object store, in four kinds the callers act on.

obstore raises a builtin `FileNotFoundError` for a missing key, `AlreadyExistsError` /
`PreconditionError` for a conditional write that lost, `PermissionDeniedError` /
`UnauthenticatedError` for the credential, and `GenericError` for everything the transport gave up
on after its retries (refused, reset, timed out, 5xx). `classify` maps them onto:

- `ObjectMissing`: the key is not there (a step that is not committed, a lease nobody holds);
- `ObjectRaceLost`: a create-only or If-Match write found another writer first;
- `ObjectAccessDenied`: the credential may not do this (a read-only bucket serves, writes nothing);
- `ObjectStoreUnavailable`: transient: warn and go on (a write is not committed, a read is a miss).

Messages name the URL and key and never a secret (obstore keeps credentials out of its messages;
`scrub` removes any configured secret that would appear anyway).
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

from skip_harness.errors import ConfigError, CorruptStepError, SkipHarnessError, StoreError
from skip_harness.store.urls import DUMP_DIR_KEY   # the key every fatal message names


class ObjectStoreError(StoreError):
    """Base of the object-store errors, of the store's one (path, reason) family: `url` (= `path`) is
    the object's full URL."""

    def __init__(self, url: str, reason: str, *, key: Optional[str] = None):
        self.url = self.path = url
        self.reason = reason
        self.key = key            # the config key to name, where the failure is the dump_dir's as a whole
        SkipHarnessError.__init__(self, f"{key}: {url}: {reason}" if key else f"{url}: {reason}")


class ObjectMissing(ObjectStoreError):
    """The key does not exist."""


class ObjectRaceLost(ObjectStoreError):
    """A conditional write (create-only, If-Match) found the object already written or changed."""


class ObjectAccessDenied(ObjectStoreError):
    """The credential is not allowed to do this (or is not known to the server)."""


class ObjectStoreUnavailable(ObjectStoreError):
    """The server could not be reached or kept failing after the retries: transient."""


class ObjectStoreConfigError(ObjectStoreError, ConfigError):
    """The URL or the environment cannot make a client (no bucket, http without AWS_ALLOW_HTTP), or
    the store refuses it for good: a config error naming `key` (skip.rollout_tq.dump_dir unless an
    environment variable is to blame), never a read-only run or an outage."""

    def __init__(self, url: str, reason: str, *, key: str = DUMP_DIR_KEY):
        self.url, self.path, self.reason, self.key = url, url, reason, key
        Exception.__init__(self, f"{key}: {url}: {reason}")


class ObjectCredentialsRefused(ObjectStoreConfigError):
    """The server does not accept the credential itself (wrong secret, unknown key, expired token)."""


class ObjectBucketMissing(ObjectStoreConfigError):
    """The URL's bucket does not exist on the server."""


class ObjectStoreForkError(SkipHarnessError):
    """An object store was used in a forked child of a process that had used one: obstore's runtime
    does not survive fork (the call would hang), so it is refused instead."""


class ObjectCorrupt(ObjectStoreError, CorruptStepError):
    """An object's bytes disagree with the size or checksum its commit record gives: a corrupt step."""


_SECRETS: set = set()


def remember_secrets(values: Iterable[Optional[str]]) -> None:
    """Secrets handed to a client: `scrub` removes them from any message."""
    _SECRETS.update(v for v in values if v and len(v) >= 4)


def scrub(text: str) -> str:
    for s in _SECRETS:
        text = text.replace(s, "***")
    return text


_CREDENTIAL_CODES = {
    "SignatureDoesNotMatch": "the secret key does not match the access key (AWS_SECRET_ACCESS_KEY)",
    "InvalidAccessKeyId": "the server knows no such access key (AWS_ACCESS_KEY_ID)",
    "InvalidClientTokenId": "the server knows no such access key (AWS_ACCESS_KEY_ID)",
    "InvalidToken": "the session token is not valid (AWS_SESSION_TOKEN)",
    "ExpiredToken": "the session token has expired (AWS_SESSION_TOKEN)",
    "TokenRefreshRequired": "the session token has expired (AWS_SESSION_TOKEN)",
    "AuthorizationHeaderMalformed": "the request's signature names another region (AWS_REGION)",
}
_UNREACHABLE = ("error sending request", "connection refused", "tcp connect error", "dns error",
                "operation timed out", "timed out", "connection reset", "connection closed")


def _code(msg: str) -> str:
    return msg.split("<Code>", 1)[1].split("<", 1)[0] if "<Code>" in msg else ""


def _first_line(exc: BaseException) -> str:
    """obstore's message on one line, without its debug dump (`Debug source: ...`), secrets removed."""
    msg = " ".join(str(exc).split())
    msg = msg.split(" Debug source:", 1)[0]
    code = _code(msg)
    if "<Message>" in msg:
        msg = msg.split(" - Server returned", 1)[0] + ": " + msg.split("<Message>", 1)[1].split("<", 1)[0]
    msg = msg[:300] + ("..." if len(msg) > 300 else "")
    return scrub(f"[{code}] {msg}" if code else msg)


def _bucket(url: str) -> str:
    return url.partition("://")[2].partition("/")[0]


def classify(exc: BaseException, url: str) -> ObjectStoreError:
    """The object-store error `exc` (raised by obstore for `url`) as one of our kinds, its reason in
    words: credentials refused and a missing bucket are config errors (never a read-only run or an
    outage); a server that cannot be reached is an outage that says so."""
    from obstore import exceptions as oe

    text = " ".join(str(exc).split())
    code = _code(text)
    detail = _first_line(exc)
    if code in _CREDENTIAL_CODES or isinstance(exc, oe.UnauthenticatedError):
        why = _CREDENTIAL_CODES.get(code, "the server does not accept this credential")
        return ObjectCredentialsRefused(url, f"credentials refused: {why} ({code or type(exc).__name__}); "
                                             "no secret is shown")
    if code == "NoSuchBucket":
        return ObjectBucketMissing(url, f"the bucket {_bucket(url)!r} does not exist on this server "
                                        "(create it, or fix the URL or AWS_ENDPOINT_URL)")
    if isinstance(exc, FileNotFoundError):
        return ObjectMissing(url, "no such object")
    if isinstance(exc, (oe.AlreadyExistsError, oe.PreconditionError)):
        return ObjectRaceLost(url, f"another writer was first ({type(exc).__name__})")
    if isinstance(exc, oe.PermissionDeniedError):
        return ObjectAccessDenied(url, f"access denied: {detail}")
    if isinstance(exc, oe.GenericError) and "Access Denied" in text:
        # DeleteObjects answers 200 with per-key errors: a denied bulk delete comes back generic
        return ObjectAccessDenied(url, f"access denied: {detail}")
    if "builder error" in text or "URL scheme is not allowed" in text:
        return ObjectStoreConfigError(
            url, "the endpoint is plain http: set AWS_ALLOW_HTTP=true to allow it (" + detail + ")")
    if isinstance(exc, (oe.NotSupportedError, oe.InvalidPathError, oe.UnknownConfigurationKeyError)):
        return ObjectStoreConfigError(url, f"not supported here: {detail}")
    lowered = text.lower()
    if any(s in lowered for s in _UNREACHABLE):
        m = re.search(r"(https?://[^/\s?]+)", text)
        at = m.group(1) if m else "the endpoint"
        if "connectionrefused" in lowered.replace(" ", "") or "connection refused" in lowered:
            what = f"nothing answers at {at} (connection refused, after retries)"
        elif "timed out" in lowered or "timedout" in lowered.replace(" ", "") or "kind: timeout" in lowered:
            what = f"{at} did not answer in time (timed out, after retries)"
        else:
            what = f"no answer from {at} (the connection failed, after retries)"
        return ObjectStoreUnavailable(url, f"object store unavailable: {what}; check AWS_ENDPOINT_URL "
                                           "and that the server runs")
    return ObjectStoreUnavailable(url, f"object store unavailable: {detail}")
