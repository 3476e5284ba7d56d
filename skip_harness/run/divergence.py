"""The first value of a replay that differed from its reference (`run.replay_check`), and how it is said."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from skip_harness.config import WEIGHTS_PREFIX


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "none"
    return f"{x:.6g}"


def _pair(a: float, b: float) -> Tuple[str, str]:
    """Both numbers short, but never printed alike when they differ."""
    sa, sb = _fmt(a), _fmt(b)
    if sa == sb and a != b:
        return repr(a), repr(b)
    return sa, sb


def cfg_value(v: Any) -> str:
    return "(absent)" if v is None else str(v)


@dataclass(frozen=True)
class Divergence:
    """The first value of a replay that differed from the recorded one."""

    step: int
    key: str
    recorded: float
    now: float
    config_changes: Tuple[Tuple[str, Any, Any], ...] = ()
    config_known: bool = True           # whether the recorded run's config was recorded too
    tolerance: str = "exact"            # what the key was compared within (run.tolerance)
    reference: str = ""                 # '' (the recording's values), else the earlier replay's they were

    @property
    def explained(self) -> bool:
        """Whether the training-side config differs from the recorded run's (a change that may explain it)."""
        return bool(self.config_changes)

    def short(self) -> str:
        if self.key.startswith(WEIGHTS_PREFIX):      # a parameter's digest (run.weights): an integer, in hex
            return f"{self.key} digest {int(self.recorded):013x} recorded, {int(self.now):013x} now"
        a, b = _pair(self.recorded, self.now)
        return f"{self.key} {a} recorded, {b} now"

    def describe(self) -> str:
        line = f"replay diverged at step {self.step}: {self.short()} ({self.tolerance}{self.reference})"
        if self.config_changes:
            shown = "; ".join(f"{k}: {cfg_value(a)} -> {cfg_value(b)}" for k, a, b in self.config_changes[:8])
            more = f" and {len(self.config_changes) - 8} more" if len(self.config_changes) > 8 else ""
            return (f"{line}; the training-side config differs from the recorded run's: {shown}{more} "
                    "(an intended change explains a divergence)")
        if not self.config_known:
            return (f"{line}; no training-side config was recorded with these values, so nothing says whether "
                    "a config change explains it")
        return (f"{line}; the training-side config is the recorded run's: nothing in it explains this (other "
                "rollouts than recorded, a nondeterministic kernel, another library version?)")


__all__ = ["Divergence", "cfg_value"]
