"""The second tier at run time: serve a phase's stored values on a replay, or run it and store them.

A phase is a computation on a step's rollouts by a part training does not change: the rewards, the
reference model's log-probs (`REWARD`, `REFERENCE`), or any other a trainer names. The trainer calls
it through :meth:`SkipHarness.phase` (the integrations do, around TRL's and the demo's own code) with
the phase's validity key, {component: digest}. Then, for the step the call belongs to:

- a step served from the cache (a hit whose rollouts are the recorded ones): the values stored under
  the same key are verified and returned, and the phase does not run (its recorded seconds count as
  saved). With no entry under that key, the phase runs, the log says why once per phase and reason
  (`rewards recomputed: reward function digit_reward changed`, or none stored with the step), and its
  values are written now (create-only: a recording without the tier, or under another reward, gets
  the tier from the first replay that computes it);
- a step generated (a miss): the phase runs and its values are stored with the step once the step is
  committed (never before: a step's tier belongs to its commit record);
- anything else (a repeat, an uncached step, the tier off, caching off): the phase runs, nothing is
  stored.

The hit/miss decision is the step's (`run.steps`); this module only keeps the per-phase bookkeeping
(which calls of a step, what was spent and saved) and asks the store (`store.tier`) for the bytes.
Trainer's thread only.
"""
from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import xxhash

from skip_harness.errors import StoreError
from skip_harness.run.stats import HIT, MISS, PhaseTime
from skip_harness.store.api import TierRecord, TierStore, key_digest

log = logging.getLogger("skip_harness")

REWARD = "reward"
REFERENCE = "reference"
_LABELS = {REWARD: "rewards", REFERENCE: "reference log-probs"}


def phase_label(phase: str) -> str:
    """What a phase's values are called in a log line: `rewards`, `reference log-probs`, or its name."""
    return _LABELS.get(phase, phase)


def key_changes(recorded: Mapping[str, str], now: Mapping[str, str]) -> List[str]:
    """Which components of a validity key differ: `reward function digit_reward changed`, `... added`,
    `... removed` (sorted by component)."""
    out = []
    for comp in sorted(set(recorded) | set(now)):
        if comp not in recorded:
            out.append(f"{comp} added")
        elif comp not in now:
            out.append(f"{comp} removed")
        elif recorded[comp] != now[comp]:
            out.append(f"{comp} changed")
    return out


def digest_text(text: str) -> str:
    """A short digest of a text (a key component's value)."""
    return xxhash.xxh3_64_hexdigest(text.encode())


def source_digest(fn: Any) -> str:
    """A digest of a function's source (a callable object: its class's), else of its qualified name: the
    key component that changes when a reward function is edited."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        return digest_text(inspect.getsource(target))
    except (OSError, TypeError):
        return digest_text(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}")


def weights_digest(module: Any) -> str:
    """A digest of a torch module's weights (names, dtypes, shapes and bytes of its state dict)."""
    import torch

    h = xxhash.xxh3_64()
    for name, t in module.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TierPhases:
    """One run's phases: serve, compute, store; what each phase spent and saved."""

    def __init__(self, enabled: bool, tier: TierStore, reader: Any, rank: int, outcome_of: Callable[[int], str],
                 callbacks: Any, fault: Callable[[str, str], None], writable: bool):
        self.enabled = enabled
        self.tier = tier
        self.reader = reader
        self.rank = rank
        self.outcome_of = outcome_of
        self.callbacks = callbacks
        self.fault = fault
        self.writable = writable
        self.times: Dict[str, PhaseTime] = {}
        self._calls: Dict[Tuple[int, str], int] = {}
        self._created: Dict[int, Optional[float]] = {}      # a step's commit record time (read once)
        self._committed: Dict[int, Optional[float]] = {}    # a generated step, once committed
        self._pending: Dict[int, List[Tuple[str, int, Dict[str, str], Any, float]]] = {}
        self._said: Set[Tuple[str, str]] = set()

    # ---- the trainer's call
    def run(self, phase: str, step: int, compute: Callable[[], Any], key: Mapping[str, Any],
            index: Optional[int] = None) -> Any:
        key = {str(k): str(v) for k, v in key.items()}
        inner = index if index is not None else self._calls.get((step, phase), 0)
        self._calls[(step, phase)] = max(self._calls.get((step, phase), 0), inner + 1)
        outcome = self.outcome_of(step) if self.enabled else None
        if outcome == HIT:
            created = self._commit_created(step)
            entry = self._stored(step, phase, key, inner, created)
            if entry is not None:
                self._count(phase, step, inner, spent=0.0, saved=entry.record.seconds, served=True)
                return entry.values
            reason = self._why(step, phase, key, created)
            self._say(phase, reason)
            values, seconds = self._timed(compute)
            self._count(phase, step, inner, spent=seconds, saved=0.0, served=False, reason=reason)
            if self.writable and created is not None:
                self._write(step, phase, inner, key, values, seconds, created)
            return values
        values, seconds = self._timed(compute)
        self._count(phase, step, inner, spent=seconds, saved=0.0, served=False)
        if outcome == MISS and self.writable:
            if step in self._committed:
                self._write(step, phase, inner, key, values, seconds, self._committed[step])
            else:       # stored once the step is committed: encoded now, the trainer may change its tensors
                data = self._encoded(values, step, phase)
                if data is not None:
                    self._pending.setdefault(step, []).append((phase, inner, key, data, seconds))
        return values

    # ---- the step's commit
    def committed(self, step: int, created: Optional[float]) -> None:
        """A generated step was committed: store the phases computed for it."""
        if created is None:
            created = self._commit_created(step)
        self._committed[step] = created
        for phase, inner, key, data, seconds in self._pending.pop(step, []):
            self._write(step, phase, inner, key, data, seconds, created)

    def close(self) -> None:
        """Steps never committed take their phases' values with them."""
        self._pending.clear()

    # ---- parts
    @staticmethod
    def _timed(compute: Callable[[], Any]) -> Tuple[Any, float]:
        t0 = time.perf_counter()
        values = compute()
        return values, time.perf_counter() - t0

    def _commit_created(self, step: int) -> Optional[float]:
        if step not in self._created:
            try:
                record = self.reader.read_commit(step)
            except StoreError:
                record = None
            self._created[step] = None if record is None else record.created
        return self._created[step]

    def _stored(self, step: int, phase: str, key: Dict[str, str], inner: int, created: Optional[float]) -> Any:
        if created is None:
            return None
        try:
            return self.tier.read(step, phase, key, inner, self.rank, commit_created=created)
        except StoreError as exc:
            self.fault(exc.path if hasattr(exc, "path") else str(step), f"{exc}; {phase_label(phase)} recomputed")
            return None

    def _why(self, step: int, phase: str, key: Dict[str, str], created: Optional[float]) -> str:
        if created is None:
            return "the step has no commit record to bind them to (an older cache)"
        records: List[TierRecord] = self.tier.keys(step, phase, commit_created=created)
        others = [r for r in records if r.digest != key_digest(key)]
        if others:
            changes = key_changes(others[0].key, key)
            return ", ".join(changes) if changes else "its key changed"
        return "none stored with the step (stored now)"

    def _say(self, phase: str, reason: str) -> None:
        if (phase, reason) in self._said:
            return
        self._said.add((phase, reason))
        if self.rank == 0:
            log.info("%s recomputed: %s", phase_label(phase), reason)

    def _encoded(self, values: Any, step: int, phase: str) -> Optional[bytes]:
        try:
            return self.tier.encode(values)
        except Exception as exc:  # noqa: BLE001 - values the codec refuses: the phase is simply not stored
            self.fault(f"step {step}", f"{phase_label(phase)} not stored: {exc}")
            return None

    def _write(self, step: int, phase: str, inner: int, key: Dict[str, str], values: Any, seconds: float,
               created: Optional[float]) -> None:
        if created is None:
            return
        data = values if isinstance(values, bytes) else self._encoded(values, step, phase)
        if data is None:
            return
        try:
            self.tier.write(step, phase, inner, self.rank, key, data, commit_created=created, seconds=seconds)
        except (StoreError, OSError) as exc:
            self.fault(str(getattr(exc, "path", f"step {step}")), f"{phase_label(phase)} not stored: {exc}")

    def _count(self, phase: str, step: int, inner: int, *, spent: float, saved: float, served: bool,
               reason: str = "") -> None:
        t = self.times.setdefault(phase, PhaseTime())
        t.spent_s += spent
        t.saved_s += saved
        if served:
            t.served += 1
        else:
            t.computed += 1
        self.callbacks.on_phase(step=step, phase=phase, inner_index=inner, served=served, seconds=spent,
                                saved=saved, reason=reason)

    def summary(self) -> Dict[str, PhaseTime]:
        """Each phase's time: the reward, then the reference, then the others in the order they first ran."""
        order = sorted(self.times, key=lambda name: {REWARD: 0, REFERENCE: 1}.get(name, 2))
        return {name: PhaseTime(self.times[name].spent_s, self.times[name].saved_s, self.times[name].served,
                                self.times[name].computed) for name in order}


__all__ = ["REFERENCE", "REWARD", "TierPhases", "digest_text", "key_changes", "phase_label", "source_digest",
           "weights_digest"]
