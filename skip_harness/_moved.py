"""One policy for the package's moved modules: the old name still imports, with a DeprecationWarning
naming the new place, and every name is looked up in the new module (so the two never drift apart).

    skip_harness.harness         -> skip_harness.run.harness
    skip_harness.callbacks       -> skip_harness.run.callbacks
    skip_harness.hydra_callback  -> skip_harness.integrations.hydra
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, List, Tuple


def moved(old: str, new: str) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """Warn that `old` moved to `new` (at the importer's line) and return the old module's `__getattr__`
    and `__dir__`, both answered by `new`."""
    warnings.warn(f"{old} moved to {new}; import it from there (the old name will be removed)",
                  DeprecationWarning, stacklevel=3)
    target = importlib.import_module(new)

    def __getattr__(name: str) -> Any:
        return getattr(target, name)

    def __dir__() -> List[str]:
        return sorted(set(dir(target)))

    return __getattr__, __dir__
