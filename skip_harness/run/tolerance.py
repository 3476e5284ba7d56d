"""When does a replayed value reproduce the recorded one? The tolerance model (docs/replay_check.md).

One comparison, used by the replay check (`run.replay_check`) and by `skip-harness diff` (`cli.pairing`):

- **Per-key tolerances** (`skip.rollout_tq.replay_tolerances: {key pattern: {rtol, atol}}`, fnmatch,
  case-insensitive, the first pattern that matches wins): a key they name is compared within exactly
  those, on any replay. Every other key:
- **Same K and W** (the same computation, on the same rows, in the same order): within `replay_rtol`,
  `replay_atol` -- exact by default.
- **Another K or W** (`regrouped`: the same rows summed in another order, over another split of ranks):
  within at least the rounding noise of the precision the value was computed in,

      |now - recorded| <= atol + rtol * max(|recorded|, |now|),
      rtol = max(replay_rtol, NOISE_ULPS * eps),  atol = max(replay_atol, NOISE_ULPS * eps * scale),

  `eps` float32's machine epsilon (2^-23: the coarsest precision trainers reduce their metrics in -- a
  trainer computing in bf16 names its keys in replay_tolerances), `scale` the key's scale: the largest
  magnitude of its recorded values over the steps compared so far, at least 1 (the unit scale a
  normalized quantity -- a loss, a log-probability, a KL, a reward, a norm -- is computed from). The
  relative term is the noise of a reordered sum of same-signed terms; the absolute term is the noise
  around zero of a quantity whose true value is zero or cancels (a KL of a policy with itself, a
  loss of zero-mean advantages): both of its forms are rounding noise, and neither is a divergence.
  Learning rates (`REGROUPED_EXACT`) pass through no reduction and are compared exactly.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, Sequence, Tuple

from skip_harness.config import KeyTolerance

# How many units of the precision's epsilon rounding noise may reach on a regrouped replay. Measured on the
# demo (W 2 -> 1, 1 -> 2, K 4 -> 1, 2, 8): at most 1.2 eps of the key's scale; a 1% change of the learning
# rate moves the first diverging step's loss by about 1500 eps and its grad_norm by 10000 (docs/replay_check.md).
NOISE_ULPS = 32
EPS32 = 2.0 ** -23
# How a summary line says a regrouped replay's values were compared.
NOISE_WORDS = f"within rounding noise ({NOISE_ULPS} x float32 eps)"
# Keys no reduction computes (a schedule's learning rate): exact on any replay unless a per-key tolerance says.
REGROUPED_EXACT = ("*learning_rate*", "*lr", "lr/*", "*/lr/*")


@dataclass(frozen=True)
class Tolerance:
    """What one key is compared within: `rtol`, `atol`, and on a regrouped replay the noise model."""

    rtol: float = 0.0
    atol: float = 0.0
    noise: bool = False           # add the rounding noise of the value's precision (another K or W)
    pattern: str = ""             # the replay_tolerances pattern that set it ('' when none)

    def describe(self) -> str:
        if self.pattern:
            return f"replay_tolerances {self.pattern!r}: rtol {self.rtol:g}, atol {self.atol:g}"
        if self.noise:
            return NOISE_WORDS
        return "exact" if not self.rtol and not self.atol else f"replay_rtol {self.rtol:g}, replay_atol {self.atol:g}"


def learning_rate(key: str) -> bool:
    """Whether a value is a learning rate (`REGROUPED_EXACT`): set by a schedule, no reduction over rows or
    ranks computes it, so it is the same on any W (at another K a scheduler stepping once per update moves it)."""
    low = key.lower()
    return any(fnmatch.fnmatchcase(low, p) for p in REGROUPED_EXACT)


def agree(recorded: float, now: float, tol: Tolerance, scale: float = 1.0) -> bool:
    """Whether `now` reproduces `recorded` within `tol` (NaN matches NaN; an infinity only itself)."""
    if recorded == now:
        return True
    if math.isnan(recorded) or math.isnan(now):
        return math.isnan(recorded) and math.isnan(now)
    if math.isinf(recorded) or math.isinf(now):
        return False
    rtol, atol = tol.rtol, tol.atol
    if tol.noise:
        floor = NOISE_ULPS * EPS32
        rtol, atol = max(rtol, floor), max(atol, floor * max(1.0, scale))
    return abs(now - recorded) <= atol + rtol * max(abs(recorded), abs(now))


@dataclass
class ToleranceModel:
    """The tolerance of every key for one pair of sides (a replay and its recording, or `diff`'s A and B)."""

    rtol: float = 0.0
    atol: float = 0.0
    per_key: Sequence[Tuple[str, KeyTolerance]] = ()
    regrouped: bool = False
    _scale: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, settings: object, regrouped: bool = False) -> "ToleranceModel":
        """From `skip.rollout_tq` settings (a RolloutTQConfig, or None: exact, no per-key tolerances)."""
        if settings is None:
            return cls(regrouped=regrouped)
        per_key = getattr(settings, "replay_tolerances", None) or {}
        return cls(float(getattr(settings, "replay_rtol", 0.0)), float(getattr(settings, "replay_atol", 0.0)),
                   tuple((str(p).lower(), _key_tolerance(t)) for p, t in dict(per_key).items()), regrouped)

    def at(self, regrouped: bool) -> "ToleranceModel":
        return ToleranceModel(self.rtol, self.atol, self.per_key, regrouped)

    def of_key(self, key: str) -> Tolerance:
        low = key.lower()
        for pattern, t in self.per_key:
            if fnmatch.fnmatchcase(low, pattern):
                return Tolerance(float(t.rtol), float(t.atol), False, pattern)
        if self.regrouped and not learning_rate(key):
            return Tolerance(self.rtol, self.atol, True)
        return Tolerance(self.rtol, self.atol)

    def same(self, key: str, recorded: float, now: float) -> bool:
        """Whether `now` reproduces `recorded` for `key`; the key's scale grows with each recorded value."""
        if math.isfinite(recorded):
            self._scale[key] = max(self._scale.get(key, 0.0), abs(recorded))
        return agree(recorded, now, self.of_key(key), self._scale.get(key, 0.0))

    def describe(self) -> str:
        """`exact`, `within rounding noise (...)`, with the per-key tolerances after it."""
        base = Tolerance(self.rtol, self.atol, self.regrouped).describe()
        if self.per_key:
            base += "; " + ", ".join(f"{p}: rtol {t.rtol:g}, atol {t.atol:g}" for p, t in self.per_key)
        return base


def _key_tolerance(value: object) -> KeyTolerance:
    if isinstance(value, KeyTolerance):
        return value
    if isinstance(value, Mapping):
        return KeyTolerance(float(value.get("rtol", 0.0)), float(value.get("atol", 0.0)))
    return KeyTolerance(float(getattr(value, "rtol", 0.0)), float(getattr(value, "atol", 0.0)))


__all__ = ["EPS32", "KeyTolerance", "NOISE_ULPS", "NOISE_WORDS", "REGROUPED_EXACT", "Tolerance", "ToleranceModel", "learning_rate",
           "agree"]
