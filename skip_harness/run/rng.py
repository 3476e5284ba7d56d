"""Global random-generator states as JSON-able data (no pickled code), for trainers whose generation
draws from the global generators: record after generating, restore on a hit.

The record holds torch's CPU generator, every CUDA device's default generator (when CUDA is
initialised in this process: if it is not, nothing has drawn from them yet, and touching them would
create a context on every device), numpy's legacy global generator and python's `random`.
"""
from __future__ import annotations

import base64
import logging
import random
from typing import Any, Dict, List

import torch

logger = logging.getLogger("skip_harness.run.rng")


def _bytes_to_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _text_to_bytes(text: str) -> torch.Tensor:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture() -> Dict[str, Any]:
    """The global generators' states: a dict of strings, ints, floats and lists (JSON-able)."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "torch": _bytes_to_text(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
    }
    if _cuda_in_use():
        state["cuda"] = [_bytes_to_text(torch.cuda.get_rng_state(i)) for i in range(torch.cuda.device_count())]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return state


def restore(state: Dict[str, Any]) -> None:
    """Put the global generators back as `capture()` found them.

    CUDA states are restored on the devices this process has (device i gets the i-th recorded
    state); a record made without CUDA leaves the CUDA generators alone."""
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)))
    cuda: List[str] = state.get("cuda") or []
    if cuda:
        if torch.cuda.is_available():
            for i, text in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(_text_to_bytes(text), i)
            if len(cuda) != torch.cuda.device_count():
                logger.debug("rng record has %d CUDA generators, this process sees %d devices",
                             len(cuda), torch.cuda.device_count())
        else:
            logger.debug("rng record has CUDA generator states but CUDA is not available: not restored")
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
