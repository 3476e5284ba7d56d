"""Retention: which whole servable steps `skip-harness clean` removes to keep a cache small.

Pure policy over what a scan found: no I/O. Rules (any combination; a step goes when one rule says so):

- keep_last N    keep the N most recently written servable steps of each namespace (not the N highest
                 step numbers: a rerun's steps are the newest), remove the others;
- older_than S   remove servable steps written more than S seconds before `now`;
- max_size B     remove the oldest servable steps (across every namespace given) until the bytes of
                 all the steps left are at most B.

"Oldest" is by the time a step was written (its commit record's time, else its files' mtime), then by
step number. A pinned step is never removed, and counts towards `max_size` like any step that stays.
Incomplete and corrupt steps are removed by cleanup anyway; they are not this module's business
except that they free their bytes first.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_age(text: str) -> float:
    """'7d' -> 604800.0; units s, m, h, d, w. ValueError with the accepted forms otherwise."""
    m = _AGE_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not an age; use a number and a unit: 90s, 30m, 12h, 7d, 2w")
    return float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]


def parse_size(text: str) -> int:
    """'20GiB' -> 21474836480; units B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size; use a number and a unit: 500MiB, 20GiB, 1TB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class RetentionRules:
    keep_last: Optional[int] = None
    older_than_s: Optional[float] = None
    max_size_bytes: Optional[int] = None
    pins: FrozenSet[int] = frozenset()

    @property
    def active(self) -> bool:
        return self.keep_last is not None or self.older_than_s is not None or self.max_size_bytes is not None


@dataclass(frozen=True)
class StepAge:
    """What retention needs to know of one step: where it is, how big, when written, servable or not."""

    namespace: str       # any key naming the namespace (its path)
    step: int
    bytes: int
    written: float       # seconds since the epoch
    servable: bool       # complete or unverified (the only steps retention removes)


def plan_retention(steps: Sequence[StepAge], rules: RetentionRules, now: float) -> Dict[str, List[Tuple[int, str]]]:
    """{namespace: [(step, reason), ...]}: the servable steps the rules remove, oldest first.
    Steps that are not servable are taken as removed anyway (cleanup handles them) for max_size."""
    chosen: Dict[Tuple[str, int], str] = {}
    servable = [s for s in steps if s.servable and s.step not in rules.pins]

    def key(s: StepAge) -> Tuple[float, int]:
        return (s.written, s.step)

    if rules.keep_last is not None:
        by_ns: Dict[str, List[StepAge]] = {}
        for s in steps:
            if s.servable:
                by_ns.setdefault(s.namespace, []).append(s)
        for ns, items in by_ns.items():
            items.sort(key=key)
            keep = items[len(items) - rules.keep_last:] if rules.keep_last > 0 else []
            kept = {s.step for s in keep}
            for s in items:
                if s.step not in kept and s.step not in rules.pins:
                    chosen.setdefault((ns, s.step), f"not one of the {rules.keep_last} most recently written steps (--keep-last)")
    if rules.older_than_s is not None:
        limit = now - rules.older_than_s
        for s in servable:
            if s.written < limit:
                chosen.setdefault((s.namespace, s.step),
                                  f"written {_age(now - s.written)} ago (--older-than {_age(rules.older_than_s)})")
    if rules.max_size_bytes is not None:
        total = sum(s.bytes for s in steps if s.servable and (s.namespace, s.step) not in chosen)
        for s in sorted(servable, key=key):
            if total <= rules.max_size_bytes:
                break
            if (s.namespace, s.step) in chosen:
                continue
            chosen[(s.namespace, s.step)] = f"oldest while the cache is over {rules.max_size_bytes} bytes (--max-size)"
            total -= s.bytes
    out: Dict[str, List[Tuple[int, str]]] = {}
    order = {(s.namespace, s.step): key(s) for s in steps}
    for (ns, step), reason in sorted(chosen.items(), key=lambda kv: order[kv[0]]):
        out.setdefault(ns, []).append((step, reason))
    return out


def bytes_left(steps: Iterable[StepAge], removed: Dict[str, List[Tuple[int, str]]]) -> int:
    """Bytes of the servable steps that stay after `removed`."""
    gone = {(ns, step) for ns, items in removed.items() for step, _ in items}
    return sum(s.bytes for s in steps if s.servable and (s.namespace, s.step) not in gone)


def _age(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:.0f}{unit}" if value >= 10 or value == int(value) else f"{value:.1f}{unit}"
    return f"{seconds:.0f}s"
