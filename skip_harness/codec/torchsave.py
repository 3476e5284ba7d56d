"""The previous payload format: `torch.save` of the encoded structure (and older caches' `torch.save`
files), read with `torch.load(weights_only=True)` from memory; never written."""
from __future__ import annotations

import io
import re
from typing import Any

import torch

from skip_harness.errors import CodecError

def sanitized(exc: BaseException) -> str:
    """A short reason for a failed torch.load, without torch's advice to retry unsafely."""
    text = str(exc)
    if "Weights only load failed" in text or "weights_only" in text:
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f" ({found.group(1)})" if found else ""
        return f"it needs pickled code to load{what}, which skip_harness never runs"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


NOT_A_PAYLOAD = "not a skip_harness or torch payload file"
_TORCH_MAGICS = (b"PK\x03\x04", b"\x80")   # torch.save's zip archive; its legacy format (a pickle)


def looks_like_torch_image(view: memoryview) -> bool:
    """Whether the bytes start as a torch.save file does (a zip archive, or the legacy pickle format)."""
    start = bytes(view[:4])
    return any(start.startswith(m) for m in _TORCH_MAGICS)


def torch_load(view: memoryview) -> Any:
    """torch.load(weights_only=True) of a file image in the previous format (read from memory: the
    codec never opens a file); CodecError (no path) on failure, NOT_A_PAYLOAD for bytes that are
    neither format (random bytes, a text file)."""
    if not looks_like_torch_image(view):
        raise CodecError(NOT_A_PAYLOAD)
    try:
        return torch.load(io.BytesIO(view), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CodecError(f"cannot be loaded safely: {sanitized(exc)}") from None
