"""Reversible wrapping of a trainer's methods, in the manner of accelerate's hooks.

A :class:`MethodHooks` installs wrappers on an object's attributes and keeps the originals, so
:meth:`MethodHooks.remove` gives the object back exactly as it was (an instance attribute restored, a
class method un-shadowed). :class:`CallReader` turns a call's arguments into (step, is_validation).
Wrapping here knows nothing about caching: the wrapper it installs calls back into the harness.
"""
from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from skip_harness.errors import HarnessUsageError

MARK = "__skip_harness_hook__"


@dataclass(frozen=True)
class CallReader:
    """How to read the step and the validation flag from a call of a wrapped method.

    step: ``step_of()`` when given, else ``step=`` or the first positional argument; any integral
    type (Python, NumPy, 0-dim integer tensors), ``>= first_step``. Validation: ``is_validation(args,
    kwargs)`` when given, else the ``validate=`` keyword.
    """

    name: str
    step_of: Optional[Callable[[], Any]] = None
    first_step: int = 1
    is_validation: Optional[Callable[[tuple, dict], bool]] = None

    def validation(self, args: tuple, kwargs: dict) -> bool:
        if self.is_validation is not None:
            return bool(self.is_validation(args, kwargs))
        return bool(kwargs.get("validate", False))

    def step(self, args: tuple, kwargs: dict) -> int:
        if self.step_of is not None:
            raw = self.step_of()
        elif "step" in kwargs:
            raw = kwargs["step"]
        elif args:
            raw = args[0]
        else:
            raise HarnessUsageError(
                f"{self.name}() was called without a step: pass the global step as its first argument or "
                "step=, or give wrap(step_of=...)"
            )
        if isinstance(raw, bool):
            raise HarnessUsageError(f"{self.name}(): the step must be an integer, got {raw!r}")
        try:
            step = operator.index(raw)
        except TypeError:
            raise HarnessUsageError(f"{self.name}(): the step must be an integer, got {raw!r}") from None
        if step < self.first_step:
            raise HarnessUsageError(
                f"{self.name}(): the step must be >= {self.first_step}, got {step} "
                "(a trainer whose steps start at 0 says so with wrap(first_step=0))"
            )
        return step


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether `fn` can be called with the keyword argument `name`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume it does
        return True
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params) or any(
        p.kind == p.VAR_KEYWORD for p in params
    )


def hit_prepare(trainer: Any, name: str, dispatch_kwarg: Optional[str], alternative: Any) -> Optional[Callable]:
    """What a hit calls in place of `trainer.<name>`: `alternative`, the method with
    ``<dispatch_kwarg>=False`` (checked to accept it), or nothing (None)."""
    if alternative is not None:
        fn = getattr(trainer, alternative) if isinstance(alternative, str) else alternative
        return lambda orig, args, kwargs: fn(*args, **kwargs)
    if dispatch_kwarg is None:
        return None
    original = getattr(trainer, name, None)
    if original is not None and not accepts_keyword(original, dispatch_kwarg):
        raise HarnessUsageError(
            f"wrap(): {type(trainer).__name__}.{name}() has no {dispatch_kwarg!r} parameter, so a cache hit "
            f"cannot ask it to advance the data without dispatching generation; pass "
            f"wrap(on_hit_prepare=<a method that only advances the data>), or wrap(dispatch_kwarg=None) "
            f"to skip {name}() on a hit"
        )
    return lambda orig, args, kwargs: orig(*args, **{**kwargs, dispatch_kwarg: False})


class MethodHooks:
    """Installs wrappers on attributes of objects and removes them again."""

    def __init__(self) -> None:
        self._installed: List[Tuple[Any, str, Any, bool]] = []

    @property
    def installed(self) -> bool:
        return bool(self._installed)

    def install(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """Replace ``obj.<name>`` with ``make(original)``; refuses a method already wrapped."""
        original = getattr(obj, name, None)
        if original is None or not callable(original):
            raise HarnessUsageError(f"wrap(): {type(obj).__name__} has no method {name!r}")
        if getattr(original, MARK, False):
            raise HarnessUsageError(
                f"wrap(): {type(obj).__name__}.{name} is already wrapped by a skip_harness harness; "
                "call unwrap() (or close()) on that harness first"
            )
        had_own = name in getattr(obj, "__dict__", {})
        wrapper = functools.wraps(original)(make(original))
        setattr(wrapper, MARK, True)
        setattr(obj, name, wrapper)
        self._installed.append((obj, name, original, had_own))

    def remove(self) -> None:
        """Give every object its original methods back (idempotent)."""
        while self._installed:
            obj, name, original, had_own = self._installed.pop()
            if had_own:
                setattr(obj, name, original)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
