"""What the trainer integrations patch in third-party code, and the one way each patch is guarded.

Each trainer has a table of :class:`Patch` rows (:mod:`verl_patches`, :mod:`trl_patches`): the target,
the parameters the wrapper relies on, why it is replaced, and the feature that needs it. Before anything
is touched, the library's version is checked against the range the table was checked against
(:func:`check_version`) and each target's parameters against the table (:func:`check_params`): a version
outside the range, or a target that takes other parameters, is refused with an
:class:`~skip_harness.errors.UnsupportedVersionError` naming the library, its version and the target. A
target the table marks optional that is missing turns its feature off with a WARNING naming both
(:func:`feature_off`), never silently. docs/design.md, "Third-party code we patch", lists every row.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from skip_harness.errors import UnsupportedVersionError

log = logging.getLogger("skip_harness")


@dataclass(frozen=True)
class Patch:
    """One thing in a third-party library a trainer integration replaces (or calls and relies on).

    `target` is ``Class.method`` (or a module-level name); `params` the parameter names after ``self`` the
    target takes in the checked version (None: not a method, nothing to check); `why` what the wrapper
    does; `feature` what turns off when an optional target is missing ("" = required: refused instead);
    `how` "replaced", or "called" for a method only called whose shape the wrappers still rely on, or
    "appended to" for a list (``sys.meta_path``); `guard` what else
    guards it (for the table)."""

    target: str
    params: Optional[Tuple[str, ...]]
    why: str
    feature: str = ""
    how: str = "replaced"
    guard: str = ""

    @property
    def owner(self) -> str:
        return self.target.split(".")[0]

    @property
    def name(self) -> str:
        return self.target.split(".")[-1]


def params_of(func: Callable[..., Any]) -> Tuple[str, ...]:
    """The parameter names of `func` (unwrapped) after ``self``; ``*args`` / ``**kwargs`` as written."""
    names = []
    for p in inspect.signature(inspect.unwrap(func)).parameters.values():
        names.append("*" + p.name if p.kind is p.VAR_POSITIONAL else "**" + p.name if p.kind is p.VAR_KEYWORD
                     else p.name)
    return tuple(names[1:])


def passes_through(params: Tuple[str, ...], expected: Tuple[str, ...]) -> bool:
    """A subclass's override that hands every argument on (``(self, *args, **kwargs)``, or a leading part
    of the expected parameters then ``*args, **kwargs``): the shape that matters is the one it calls."""
    if len(params) < 2 or not params[-2].startswith("*") or not params[-1].startswith("**"):
        return False
    named = params[:-2]
    return all(not n.startswith("*") for n in named) and named == expected[:len(named)]


def check_version(library: str, version: str, supported: str, ok: Callable[[Any], bool], who: str,
                  advice: str) -> None:
    """Refuse a `library` `version` outside the `supported` range (``ok(Version)`` False), naming both."""
    from packaging.version import InvalidVersion, Version

    try:
        good = ok(Version(version))
    except InvalidVersion:
        good = False
    if not good:
        raise UnsupportedVersionError(f"{who} supports {library} {supported}; this is {library} {version}: "
                                      f"{advice}")


def check_params(patch: Patch, func: Any, library: str, version: str, who: str, supported: str) -> None:
    """Refuse `func` (the target of `patch`) when it is not callable or takes other parameters."""
    if func is None or not callable(func):
        raise UnsupportedVersionError(f"{who}: {library} {version} has no {patch.target} (checked against "
                                      f"{library} {supported}); it cannot {patch.why}")
    got = params_of(func)
    if patch.params is not None and got != patch.params:
        raise UnsupportedVersionError(f"{who}: {library} {version}'s {patch.target} takes {got}, {who} was "
                                      f"checked against {patch.params} ({library} {supported}); this "
                                      f"{library} changed, {who} cannot {patch.why}")


def feature_off(patch: Patch, cls_name: str, who: str) -> None:
    """Say that `patch.feature` is off because `cls_name` has no `patch.name` (a WARNING, never silent)."""
    log.warning("%s: %s is off: %s has no %s (%s)", who, patch.feature, cls_name, patch.name, patch.why)


def rows(patches: Tuple[Patch, ...]) -> str:
    """The table as Markdown rows (target | replaced or called | parameters checked | why | guard), as
    docs/design.md has it."""
    out = []
    for p in patches:
        params = "-" if p.params is None else "`(" + ", ".join(p.params) + ")`"
        guard = (f"changed: refused; missing: {p.feature} off, with a WARNING" if p.feature
                 else "missing or changed: refused")
        if p.params is None:
            guard = ""
        guard = "; ".join(g for g in (guard, p.guard) if g)
        out.append(f"| `{p.target}` | {p.how} | {params} | {p.why} | {guard} |")
    return "\n".join(out)


__all__ = ["Patch", "check_params", "check_version", "feature_off", "params_of", "passes_through", "rows"]
