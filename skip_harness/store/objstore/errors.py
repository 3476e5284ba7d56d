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

from typing import Iterable, Optional

from skip_harness.errors import SkipHarnessError


class ObjectStoreError(SkipHarnessError):
    """Base of the object-store errors; `url` is the object's full URL."""

    def __init__(self, url: str, reason: str):
        self.url = url
        self.reason = reason
        super().__init__(f"{url}: {reason}")


class ObjectMissing(ObjectStoreError):
    """The key does not exist."""


class ObjectRaceLost(ObjectStoreError):
    """A conditional write (create-only, If-Match) found the object already written or changed."""


class ObjectAccessDenied(ObjectStoreError):
    """The credential is not allowed to do this (or is not known to the server)."""


class ObjectStoreUnavailable(ObjectStoreError):
    """The server could not be reached or kept failing after the retries: transient."""


class ObjectStoreConfigError(ObjectStoreError):
    """The URL or the environment cannot make a client (unknown scheme, http without AWS_ALLOW_HTTP)."""


class ObjectStoreForkError(SkipHarnessError):
    """An object store was used in a forked child of a process that had used one: obstore's runtime
    does not survive fork (the call would hang), so it is refused instead."""


class ObjectCorrupt(ObjectStoreError):
    """An object's bytes disagree with the size or checksum its commit record gives."""


_SECRETS: set = set()


def remember_secrets(values: Iterable[Optional[str]]) -> None:
    """Secrets handed to a client: `scrub` removes them from any message."""
    _SECRETS.update(v for v in values if v and len(v) >= 4)


def scrub(text: str) -> str:
    for s in _SECRETS:
        text = text.replace(s, "***")
    return text


def _first_line(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    code = ""
    if "<Code>" in msg:
        code = msg.split("<Code>", 1)[1].split("<", 1)[0]
    msg = msg[:300] + ("..." if len(msg) > 300 else "")
    return scrub(f"[{code}] {msg}" if code else msg)


def classify(exc: BaseException, url: str) -> ObjectStoreError:
    """The object-store error `exc` (raised by obstore for `url`) as one of our four kinds."""
    from obstore import exceptions as oe

    detail = _first_line(exc)
    if isinstance(exc, FileNotFoundError):
        return ObjectMissing(url, "no such object")
    if isinstance(exc, (oe.AlreadyExistsError, oe.PreconditionError)):
        return ObjectRaceLost(url, f"another writer was first ({type(exc).__name__})")
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
        return ObjectAccessDenied(url, f"access denied: {detail}")
    if isinstance(exc, oe.GenericError) and "Access Denied" in str(exc):
        # DeleteObjects answers 200 with per-key errors: a denied bulk delete comes back generic
        return ObjectAccessDenied(url, f"access denied: {detail}")
    if "builder error" in str(exc) or "URL scheme is not allowed" in str(exc):
        return ObjectStoreConfigError(
            url, "the endpoint is plain http: set AWS_ALLOW_HTTP=true to allow it (" + detail + ")")
    if isinstance(exc, (oe.NotSupportedError, oe.InvalidPathError, oe.UnknownConfigurationKeyError)):
        return ObjectStoreConfigError(url, f"not supported here: {detail}")
    return ObjectStoreUnavailable(url, f"object store unavailable: {detail}")
