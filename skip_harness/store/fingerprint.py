"""The generation fingerprint: the config values that shape rollouts apart from the learned weights.

Stored in every commit record so a rerun can tell that committed steps were made by another
generator (another mode, seed, model, data or sampling setting). Pure: no I/O.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional

from omegaconf import DictConfig

from skip_harness.errors import ConfigError
from skip_harness.nodes import MISSING, plain, select


@dataclass(frozen=True)
class Fingerprint:
    """A mapping of dotted config key -> JSON-able value, with a stable digest."""

    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, keys: Iterable[str]) -> "Fingerprint":
        """The values of `keys` in `cfg`; a key that is not in the config is a ConfigError naming it
        (a mistyped key would otherwise be stored as None and protect nothing). `cfg` is an OmegaConf node:
        a run's settings convert its config once (`config.as_node`, in `run.settings.from_verl_keys`)."""
        if not isinstance(cfg, DictConfig):
            raise TypeError(f"Fingerprint.from_config takes an OmegaConf node, got {type(cfg).__name__}")
        out: Dict[str, Any] = {}
        for key in keys:
            value = select(cfg, key, default=MISSING)
            if value is MISSING:
                raise ConfigError(key, "fingerprint key not found in the config (mistyped?)")
            out[key] = value
        return cls(dict(sorted(out.items())))

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "Fingerprint":
        """A fingerprint of values a trainer computed itself (JSON-able: str, numbers, bools, lists, dicts)."""
        converted = {str(k): plain(v) for k, v in dict(values).items()}
        try:
            json.dumps(converted, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError("fingerprint", f"values must be JSON-able: {exc}") from None
        return cls(dict(sorted(converted.items())))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Fingerprint":
        return cls(dict(sorted(dict(data.get("values", {})).items())))

    def to_json(self) -> Dict[str, Any]:
        return {"digest": self.digest, "values": dict(self.values)}

    @property
    def digest(self) -> str:
        blob = json.dumps(dict(self.values), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def differing_keys(self, other: "Fingerprint") -> List[str]:
        """This fingerprint's keys whose value `other` (a cache's) does not have. A key only `other`
        holds is not compared: this run's generator says it does not shape its rollouts (a cache
        written when the demo's sync mode still recorded parameter_sync_step stays valid); a key only
        this one holds is (the cache cannot show it had the same value)."""
        return sorted(k for k in self.values if self.values.get(k, MISSING) != other.values.get(k, MISSING))

    def describe_difference(self, other: "Fingerprint") -> str:
        parts = []
        for k in self.differing_keys(other):
            cached = repr(other.values[k]) if k in other.values else "no value for it"
            parts.append(f"{k}: cache has {cached}, this run has {self.values.get(k)!r}")
        return "; ".join(parts)

    def matches(self, other: Optional["Fingerprint"]) -> bool:
        """Whether a cache's fingerprint `other` (None: recorded none) agrees on every key of this one."""
        return other is None or not self.differing_keys(other)
