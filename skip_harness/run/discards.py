"""What a filter discarded from a step, reported by the trainer (`SkipHarness.discard`) and recorded with it.

A trainer that drops groups after generating them (verl's DAPO `filter_groups`: a group whose samples all
got the same reward carries no GRPO signal) says so with `harness.discard(step, groups, reason)`:
`groups` the dropped groups' ids, or a mapping {group id: its samples' rewards}; `reason` one line. For
a step this run generated (a miss), what it reports is kept until the step is committed, then written
beside it on the writer thread (`store.discards`: create-only the first time, merged with the run's later
reports of the step after), never on the trainer's path and never part of the step: a step whose commit
never lands takes its discards with it. On a step served from the cache (a hit, a repeat) nothing is
written: the recording's discards stand and the step is served exactly as recorded. Rank 0 records.

Bad input (no reason, a group id that is not a string or an integer, rewards that are not numbers) is a
HarnessUsageError naming the argument.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Dict, List, Mapping, Optional, Tuple

from skip_harness.errors import HarnessUsageError
from skip_harness.run.stats import MISS
from skip_harness.store.api import Discarded, as_number

log = logging.getLogger("skip_harness")

MAX_REASON = 500          # characters of a reason kept (one line)


def discarded_of(groups: Any, reason: Any) -> List[Discarded]:
    """`discard`'s arguments as records, or a HarnessUsageError naming what is wrong."""
    if not isinstance(reason, str) or not reason.strip():
        raise HarnessUsageError(f"discard: reason must be a non-empty string (why the groups were dropped), "
                                f"got {reason!r}")
    why = " ".join(reason.split())[:MAX_REASON]
    if isinstance(groups, (str, bytes)):
        raise HarnessUsageError(f"discard: groups must be a list of group ids or a mapping {{group id: rewards}}, "
                                f"got the string {groups!r}")
    items: List[Tuple[Any, Any]]
    if isinstance(groups, Mapping):
        items = list(groups.items())
    else:
        try:
            items = [(g, None) for g in groups]
        except TypeError:
            raise HarnessUsageError(f"discard: groups must be a list of group ids or a mapping {{group id: "
                                    f"rewards}}, got {type(groups).__name__}") from None
    out: List[Discarded] = []
    for group, rewards in items:
        if isinstance(group, bool) or not isinstance(group, (str, int)):
            raise HarnessUsageError(f"discard: a group id is a string or an integer, got {group!r}")
        out.append(Discarded(str(group), why, _rewards(group, rewards)))
    return out


def _rewards(group: Any, rewards: Any) -> Optional[Tuple[float, ...]]:
    if rewards is None:
        return None
    tolist = getattr(rewards, "tolist", None)        # a tensor or an array of the samples' rewards
    values = tolist() if callable(tolist) else rewards
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values]
    try:
        numbers = [as_number(v) for v in values]
    except TypeError:
        numbers = [None]
    if any(n is None for n in numbers):
        raise HarnessUsageError(f"discard: the rewards of group {group!r} must be numbers (one per sample), "
                                f"got {rewards!r}")
    return tuple(float(n) for n in numbers if n is not None)


class DiscardReporting:
    """`SkipHarness.discard`, kept here (the harness's module is full): the harness's own state is read
    through `report_discard`."""

    def discard(self, step: int, /, groups: Any, reason: str) -> None:
        """Report groups a filter dropped from `step` and why: `groups` their ids (strings or integers), or
        {id: its samples' rewards}; `reason` one line (`"filter_groups: every sample's reward was 0.0"`).
        On a step this run generated they are recorded with it once it is committed (on the writer thread,
        beside it: `skip-harness view` shows them on the step's discarded page); on a served step nothing
        is recorded (the recording's stand, and the step is served as recorded). May be called several
        times for one step. Does nothing before the harness started, after close, when caching is off,
        or for a step the harness did not decide. docs/api.md#discarded-groups."""
        report_discard(self, step, groups, reason)


def report_discard(harness: Any, step: int, groups: Any, reason: Any) -> None:
    values = harness._values          # the harness's ValuesTracker: None before start
    if values is None or harness._closed or not harness.enabled:
        return
    step = operator.index(step)
    values.discards.report(step, harness.outcome(step), groups, reason)


class Discards:
    """Keeps a miss step's discards until its commit, then records them (trainer's thread only; the writes
    go to the coordinator's writer thread)."""

    def __init__(self, coordinator: Any, records: bool):
        self.coordinator = coordinator
        self.records = records                           # rank 0 of a run that writes its misses
        self._pending: Dict[int, List[Discarded]] = {}   # reported before the step's commit
        self._committed: Dict[int, float] = {}           # a committed step: its record's creation time
        self._written: Dict[int, List[Discarded]] = {}   # what was written for it

    def report(self, step: int, outcome: str, groups: Any, reason: Any) -> None:
        found = discarded_of(groups, reason)              # checked on every rank, whatever the step
        if outcome != MISS:
            log.debug("step %d (%s): %d discarded groups reported; the recording's stand", step, outcome, len(found))
            return
        if not self.records or not found:
            return
        if step in self._committed:                       # reported after the commit: written now
            before = self._written.get(step)
            self._write(step, _merged(before or [], found), create_only=before is None)
        else:
            self._pending[step] = _merged(self._pending.get(step, []), found)

    def committed(self, step: int, created: Optional[float]) -> None:
        """A miss step's commit record landed (rank 0 knows `created`): record what was discarded from it."""
        if created is None or not self.records:
            return
        self._committed[step] = created
        pending = self._pending.pop(step, None)
        if pending:
            self._write(step, pending, create_only=True)

    def _write(self, step: int, discarded: List[Discarded], create_only: bool) -> None:
        self._written[step] = discarded
        self.coordinator.record_discards(step, tuple(discarded), self._committed[step], create_only)


def _merged(before: List[Discarded], new: List[Discarded]) -> List[Discarded]:
    seen = {(d.group, d.reason) for d in before}
    out = list(before)
    for d in new:
        if (d.group, d.reason) not in seen:
            seen.add((d.group, d.reason))
            out.append(d)
    return out


__all__ = ["DiscardReporting", "Discards", "discarded_of", "report_discard"]
