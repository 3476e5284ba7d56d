"""The recorded values (the trainer's metrics per step) as the charts offer them: every key, in a sensible
order -- loss, reward, KL, grad norm, lengths first, timings last -- searchable and grouped by prefix.
Nothing is capped: every key is listed and any of them can be charted."""
from __future__ import annotations

import fnmatch
from typing import Dict, List, Sequence, Tuple

from skip_harness.config import DEFAULT_REPLAY_IGNORE, WEIGHTS_PREFIX

#: What a reader looks at first, in this order: a key goes with the first group one of whose words its
#: last part (lower case) contains.
FIRST = (("loss",), ("reward", "score"), ("kl",), ("grad_norm", "grad-norm", "gradnorm"),
         ("length", "len"), ("entropy",), ("clip",), ("lr", "learning_rate"))
DEFAULT_CHARTS = 8       # keys charted when none are picked: the first of the default order (all are listed)


def is_timing(key: str) -> bool:
    """Timings, throughput, memory: the keys the replay check leaves out by default (charted last)."""
    low = key.lower()
    return any(fnmatch.fnmatchcase(low, p) for p in DEFAULT_REPLAY_IGNORE)


def _rank(key: str) -> Tuple[int, int, int, str]:
    if key.startswith(WEIGHTS_PREFIX):           # replay_weights' digests: a chart of hashes says nothing
        return (3, 0, 0, key)
    if is_timing(key):
        return (2, 0, 0, key)
    low = key.lower()
    last = low.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
    for n, words in enumerate(FIRST):
        if any(w in last for w in words):        # the key named just so (`reward`) before its kin (`frac_reward_...`)
            return (0, n, 0 if last in words else 1 if last.startswith(words) else 2, key)
    for n, words in enumerate(FIRST):
        if any(w in low for w in words):
            return (0, len(FIRST) + n, 0, key)
    return (1, 0, 0, key)


def default_order(keys: Sequence[str]) -> List[str]:
    """Every key: loss, reward, KL, grad norm, lengths (...) first, then the rest by name, timings, and the
    parameters' digests (`weights/...`) last."""
    return sorted(dict.fromkeys(keys), key=_rank)


def by_prefix(keys: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """Keys grouped by their prefix (the part before the first `/` or `.`; `(none)` when there is none),
    groups in order of first appearance."""
    out: Dict[str, List[str]] = {}
    for k in keys:
        cut = min((i for i in (k.find("/"), k.find(".")) if i > 0), default=-1)
        out.setdefault(k[:cut] if cut > 0 else "(none)", []).append(k)
    return list(out.items())


def pick(keys: Sequence[str], wanted: Sequence[str], q: str) -> List[str]:
    """The keys to chart: those picked (`wanted`, in the default order) when any, else those matching the
    search `q` when given, else the first DEFAULT_CHARTS of the default order."""
    ordered = default_order(keys)
    if wanted:
        chosen = set(wanted)
        return [k for k in ordered if k in chosen]
    if q:
        needle = q.lower()
        return [k for k in ordered if needle in k.lower()]
    return ordered[:DEFAULT_CHARTS]
