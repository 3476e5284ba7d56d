"""What the replay check found (`run.replay_check`): the summary's replay line and a table cell's verdict."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from skip_harness.config import ReplayCheck
from skip_harness.run.divergence import Divergence, cfg_value


@dataclass(frozen=True)
class ReplayReport:
    """What the replay check found: served (hit) steps whose values were reported, how many of them had
    recorded values to compare and reproduced, and the first divergence."""

    check: str = ReplayCheck.warn.value
    served: int = 0
    checked: int = 0
    reproduced: int = 0
    values_each: Tuple[int, int] = (0, 0)          # fewest, most values compared in a step
    divergence: Optional[Divergence] = None
    reproduced_before: int = 0
    regrouped: str = ""      # at another K or W (replay_from; verl's worker count): what was compared how

    @property
    def unchecked(self) -> int:
        return self.served - self.checked

    def short(self) -> str:
        """The verdict in a few words, for a table's cell: `4/4 reproduced`, `diverged at 2: loss`,
        `3/5 reproduced, 2 unchecked`, `5 unchecked`, `not checked`; '' when nothing was served.
        :meth:`describe` says the same in full."""
        if self.served == 0:
            return ""
        if self.check == ReplayCheck.off.value:
            return "not checked"
        if self.divergence is not None:
            return f"diverged at {self.divergence.step}: {self.divergence.key}"
        if self.checked == 0:
            return f"{self.served} unchecked"
        line = f"{self.reproduced}/{self.served} reproduced"
        return f"{line}, {self.unchecked} unchecked" if self.unchecked else line

    def describe(self) -> str:
        """`replay: 20 of 20 served steps reproduced (9 values each)`, `replay diverged at step 7 (loss
        0.1234 recorded, 0.124 now); 6 steps reproduced before it`, or '' when nothing was served."""
        if self.served == 0:
            return ""
        if self.check == ReplayCheck.off.value:
            return f"replay: {self.served} served {_steps(self.served)}, not checked (skip.rollout_tq.replay_check=off)"
        d = self.divergence
        if d is not None:
            line = (f"replay diverged at step {d.step} ({d.short()}); {self.reproduced_before} "
                    f"{_steps(self.reproduced_before)} reproduced before it")
            if d.config_changes:      # the training-side change the replay made (a sweep's line names it)
                shown = ", ".join(f"{k} {cfg_value(a)} -> {cfg_value(b)}" for k, a, b in d.config_changes[:3])
                more = f" and {len(d.config_changes) - 3} more" if len(d.config_changes) > 3 else ""
                line += f"; training side changed: {shown}{more}"
            return f"{line}; {self.regrouped}" if self.regrouped else line
        if self.checked == 0:
            line = f"replay: {self.served} served {_steps(self.served)} unchecked (no recorded values)"
            return f"{line}; {self.regrouped}" if self.regrouped else line
        lo, hi = self.values_each
        each = f"{lo} value{'' if lo == 1 else 's'} each" if lo == hi else f"{lo} to {hi} values each"
        line = f"replay: {self.reproduced} of {self.served} served {_steps(self.served)} reproduced"
        if self.checked:
            line += f" ({each})"
        if self.unchecked:
            line += f"; {self.unchecked} unchecked (no recorded values)"
        if self.regrouped:
            line += f"; {self.regrouped}"
        return line


def _steps(n: int) -> str:
    return "step" if n == 1 else "steps"


__all__ = ["ReplayReport"]
