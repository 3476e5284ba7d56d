"""The cache's checksum: xxh3-128 over the bytes as stored, as 32 hex digits (a leaf: every backend and
the commit record use this one function)."""
from __future__ import annotations

from typing import Any

import xxhash

from skip_harness.errors import CorruptStepError


def checksum_bytes(data: Any) -> str:
    """xxh3-128 of a buffer (bytes, a memoryview, an mmap), hex. xxhash releases the GIL for large inputs."""
    return xxhash.xxh3_128_hexdigest(data)


def checksum_int(data: Any) -> int:
    """xxh3-64 of a buffer, as an int (stamps)."""
    return xxhash.xxh3_64_intdigest(data)


def hasher() -> Any:
    """An incremental xxh3-128 (`update(chunk)`, `hexdigest()`), for a stream hashed as it arrives."""
    return xxhash.xxh3_128()


def check_read(where: Any, lease: Any, got: int, size: int, checksum: str) -> Any:
    """The check every verified read into a pool buffer ends with: `got` bytes read are `size` and their
    xxh3-128 is `checksum`, else CorruptStepError naming `where` (the lease released). Returns `lease`."""
    try:
        if got != size:
            raise CorruptStepError(where, f"{got} bytes, the commit record says {size}")
        digest = checksum_bytes(lease.view(got))
        if digest != checksum:
            raise CorruptStepError(where, f"checksum {digest} does not match the commit record's {checksum}")
    except BaseException:
        lease.release()
        raise
    return lease


__all__ = ["check_read", "checksum_bytes", "checksum_int", "hasher"]
