"""What scripts/plot.py labels a run by besides its mode, K and seed: the keys swept between the runs.

Each run's `.hydra/overrides.yaml` lists what its command line set (`actor_rollout_ref.actor.optim.lr=0.001`).
A key whose value differs between the runs found names them apart (`lr=0.001`); values are compared as the
run's composed `.hydra/config.yaml` holds them (a run that did not set the key has one there too). Keys are shown by the shortest end of their dotted
name that no other swept key shares (`lr`, or `actor.optim.lr` beside `critic.optim.lr`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

log = logging.getLogger("skip_harness.plot")

Pairs = Tuple[Tuple[str, str], ...]

# keys plot.py's label shows already (mode, K, seed)
SHOWN_KEYS = ("trainer_mode", "trainer.v1.trainer_mode", "trainer.v1.separate_async.parameter_sync_step", "seed")


def read_overrides(run_dir: Path) -> Pairs:
    """The run's command-line overrides from run_dir/.hydra/overrides.yaml as (key, value) pairs (`+key`
    and `++key` as key; deletions `~key`, Hydra's own keys and those the label shows already left out);
    () when there are none or they cannot be read."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ()
    from omegaconf import OmegaConf

    try:
        items = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # noqa: BLE001 - it only costs the label
        log.warning("%s: cannot be read (%s); the run's label leaves its overrides out", path, exc)
        return ()
    pairs = [str(o).lstrip("+").split("=", 1) for o in (items if isinstance(items, list) else [])]
    return tuple((k, v) for k, v in (p for p in pairs if len(p) == 2)
                 if not k.startswith(("~", "hydra.", "hydra/")) and k not in SHOWN_KEYS)


def _config_values(run_dir: Path, keys: Sequence[str]) -> Dict[str, str]:
    """The value each of `keys` has in the run's composed .hydra/config.yaml, where it is a plain value
    (not a config group's node); keys it does not hold are left out."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    except Exception:  # noqa: BLE001 - no readable config: the overrides' text says what it can
        return {}
    out = {}
    for key in keys:
        try:
            value = OmegaConf.select(cfg, key.replace("/", "."))
        except Exception:  # noqa: BLE001 - an interpolation that does not resolve here
            value = None
        if value is not None and not OmegaConf.is_config(value):
            out[key] = str(value)
    return out


def short_names(keys: Sequence[str]) -> Dict[str, str]:
    """Each dotted key by the shortest end of it that no other key in `keys` ends with."""
    dotted = {k: k.replace("/", ".") for k in keys}
    out = {}
    for key, name in dotted.items():
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            end = ".".join(parts[-n:])
            if n == len(parts) or not any(o != key and (d == end or d.endswith("." + end)) for o, d in dotted.items()):
                out[key] = end
                break
    return out


def swept_values(runs: Sequence[Tuple[Path, Pairs]]) -> List[Pairs]:
    """For each (run directory, its overrides): the (short name, value) of every overridden key whose
    value differs between the runs, in the order the keys first appear. A value is the run's composed
    config's (so `false` and `False`, or a key one run set to its default, compare alike); a key the
    config does not hold as a plain value (a config group) by the override's text."""
    keys = list(dict.fromkeys(k for _, overrides in runs for k, _ in overrides))
    values = []
    for run_dir, overrides in runs:    # the value the run had (`false` and `False` alike), else as given
        had = {**dict(overrides), **_config_values(run_dir, keys)} if keys else {}
        values.append({k: had.get(k, "-") for k in keys})
    varying = [k for k in keys if len({v[k] for v in values}) > 1]
    short = short_names(varying)
    return [tuple((short[k], v[k]) for k in varying) for v in values]


def sortable(value: str) -> Tuple[int, float, str]:
    """Numbers in numeric order, before other strings."""
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)
