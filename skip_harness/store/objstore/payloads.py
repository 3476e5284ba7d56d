"""A mini-batch to an object and back: the codec's file image put as one object, read back verified.

The codec lays the payload out as the same file image the POSIX store writes (header, then each
tensor's bytes): here it is packed into one buffer (the one copy of the payload a write needs,
after which the trainer may change it), hashed (xxh3-128 over the stored bytes), put, and its size
checked. A verified read gets the object, checks size and hash against the commit record, copies it
once into a writable buffer and decodes the tensors as views of that buffer (never running code).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional

import xxhash

from skip_harness.store.objstore.backend import ObjectNamespace


@dataclass(frozen=True)
class StoredObject:
    rel: str
    nbytes: int
    xxh3_128: str


_pool: Optional[Any] = None


def _memmove(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def pool() -> Any:
    """The process's staging buffers (reused: a fresh 100 MiB buffer costs more to fault in than
    the copy into it)."""
    global _pool
    if _pool is None:
        from skip_harness.store.bufferpool import BufferPool
        _pool = BufferPool()
    return _pool


def stage(payload: Any) -> "tuple[Any, memoryview, str]":
    """(buffer lease, the payload's file image in it, its xxh3-128): the one copy a write needs.
    Release the lease once the image is written."""
    from skip_harness import codec
    from skip_harness.codec import tensorfile

    image = codec.plan(payload)
    lease = pool().acquire(image.nbytes)
    try:
        tensorfile.pack_into(image, lease.array, _memmove)
        view = lease.view(image.nbytes)
        return lease, view, xxhash.xxh3_128_hexdigest(view)
    except BaseException:
        lease.release()
        raise


def encode(payload: Any) -> bytearray:
    """The payload's file image in a new buffer (full width, uncompressed)."""
    lease, view, _ = stage(payload)
    try:
        return bytearray(view)
    finally:
        lease.release()


def write_payload(ns: ObjectNamespace, step: int, rel: str, payload: Any) -> StoredObject:
    lease, view, digest = stage(payload)
    try:
        size = ns.write(step, rel, view)
    finally:
        lease.release()
    return StoredObject(rel, size, digest)


def read_payload(ns: ObjectNamespace, step: int, obj: StoredObject, out: Optional[bytearray] = None) -> Any:
    """The payload of `obj` after a verified read; its tensors are views of `out` (a new buffer when
    None: reusing one overwrites what an earlier read returned)."""
    from skip_harness import codec

    out = bytearray(obj.nbytes) if out is None or len(out) < obj.nbytes else out
    ns.read_checked(step, obj.rel, obj.nbytes, obj.xxh3_128, out)
    return codec.load_buffer(out, obj.nbytes, ns.key_url(ObjectNamespace.step_key(step, obj.rel)))
