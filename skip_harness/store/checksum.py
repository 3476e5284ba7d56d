"""The cache's checksum: xxh3-128 over the bytes as stored, as 32 hex digits (a leaf: every backend and
the commit record use this one function)."""
from __future__ import annotations

from typing import Any

import xxhash


def checksum_bytes(data: Any) -> str:
    """xxh3-128 of a buffer (bytes, a memoryview, an mmap), hex. xxhash releases the GIL for large inputs."""
    return xxhash.xxh3_128_hexdigest(data)


def checksum_int(data: Any) -> int:
    """xxh3-64 of a buffer, as an int (stamps)."""
    return xxhash.xxh3_64_intdigest(data)


def hasher() -> Any:
    """An incremental xxh3-128 (`update(chunk)`, `hexdigest()`), for a stream hashed as it arrives."""
    return xxhash.xxh3_128()


__all__ = ["checksum_bytes", "checksum_int", "hasher"]
