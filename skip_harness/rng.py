"""Global random-generator states as JSON-able data (no pickled code), for trainers whose generation
draws from the global generators: record after generating, restore on a hit."""
from __future__ import annotations

import base64
import random
from typing import Any, Dict

import torch


def capture() -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    return state


def restore(state: Dict[str, Any]) -> None:
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
