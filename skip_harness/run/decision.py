"""Which steps hit, miss or repeat. Pure: no disk, no clocks, no distributed calls.

The harness asks :func:`decide` with what it knows (the settings, whether this is a validation call,
and the set of steps it believes it can serve); if the chosen step then fails verification, the
harness drops it from the set and asks again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Optional

from skip_harness.config import Action, RolloutTQConfig
from skip_harness.run.stats import HIT, MISS, OFF, REPEAT, Outcome


@dataclass(frozen=True)
class Decision:
    """What to do for one step.

    kind: ``off`` (run untouched, write nothing), ``hit`` (serve this step from the cache),
    ``repeat`` (serve ``source_step`` in place of ``step``) or ``miss`` (generate and write; with
    ``action=compare``, generate and compare with the recording, write nothing).
    """

    kind: Outcome
    step: int
    source_step: Optional[int] = None
    reason: str = ""

    @property
    def serves_cache(self) -> bool:
        return self.kind in (HIT, REPEAT)


def nearest_step(step: int, candidates: AbstractSet[int]) -> Optional[int]:
    """The largest candidate before `step`, else the smallest after it, else None."""
    earlier = [s for s in candidates if s < step]
    if earlier:
        return max(earlier)
    later = [s for s in candidates if s > step]
    return min(later) if later else None


def decide(
    step: int,
    settings: RolloutTQConfig,
    servable: AbstractSet[int],
    *,
    validate: bool = False,
) -> Decision:
    """Decide hit / miss / repeat / off for `step`.

    `servable` holds the steps whose cache is complete (or unverified legacy) and was made by this
    run's generator; membership is a belief the harness confirms by verifying before serving.
    """
    if validate:
        return Decision(OFF, step, reason="validation call")
    if not settings.enable:
        return Decision(OFF, step, reason="skip.rollout_tq.enable is false")
    if not settings.wants_step(step):
        return Decision(OFF, step, reason="step not in skip.rollout_tq.steps")
    if settings.action == Action.compare:      # generated whatever is cached, then compared (run.drift)
        return Decision(MISS, step, reason="generated and compared with the recording (action=compare)")
    if step in servable:
        return Decision(HIT, step, source_step=step)
    if settings.action == Action.repeat:
        source = nearest_step(step, servable)
        if source is not None:
            return Decision(REPEAT, step, source_step=source, reason=f"step {step} not cached; serving step {source}")
        return Decision(MISS, step, reason="no complete step to repeat; caching as `cache` would")
    return Decision(MISS, step, reason="not cached")
