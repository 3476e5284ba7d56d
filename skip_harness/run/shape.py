"""At what K and W a replay's values meet the recording's (`run.replay_check`; `cli.pairing` for `diff`).

K is how many sample calls a step makes, W how many ranks share a mini-batch: the process group's, except
for verl, whose plug-in's harness runs in verl's one driver process (its W is 1) while verl's workers,
`trainer.nnodes` x `trainer.n_gpus_per_node`, split each mini-batch. There W is read from the training-side
configs: the recording's (recorded with its values) and the replay's (`RunSettings.workers_from_config`).

A trainer declares whether its training values are invariant under W (`RunSettings.w_invariant`). The
demo's are: its token means are over the whole mini-batch across ranks, so one process trains on it as two
did, to float rounding. TRL's and verl's are not (a loss that is a mean of per-rank means; AdamW's first
steps turn gradient entries that are rounding noise into updates of the learning rate's size): at another
W their training values are other values by design, as at another K, and are compared with a baseline
replay at this K and W instead (`run.baseline`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from skip_harness.config import SHARD_KEYS, WORKER_KEYS


@dataclass(frozen=True)
class Regroup:
    """The recording's K and W (`K0`, `W0`) and the replay's (`K1`, `W1`); `workers`: the worker-count keys
    that differ when W is verl's worker count (empty: W is the process group's); `machine`: how the machine
    that computes this run's values differs from the recording's ('' when it is the same)."""

    K0: int
    K1: int
    W0: int
    W1: int
    w_invariant: bool = True
    workers: Tuple[str, ...] = ()
    machine: str = ""        # what differs in the machine that computed the values (run.machine); '' the same

    @property
    def rechunked(self) -> bool:
        return self.K0 != self.K1

    @property
    def resharded(self) -> bool:
        return self.W0 != self.W1

    @property
    def regrouped(self) -> bool:
        """Whether the values are other sums of the same terms: at another K or W, or on another machine
        (another torch, CPU code path, thread count or accelerator): compared within rounding noise."""
        return self.rechunked or self.resharded or bool(self.machine)

    @property
    def depends_on(self) -> str:
        """What the training values depend on here ('K', 'W'): '' when they are compared with the recording's."""
        if self.rechunked:
            return "K"
        return "W" if self.resharded and not self.w_invariant else ""

    def at(self) -> str:
        """This run's shape, as a line names it: `K=1, W=1`, or `K=1, 1 workers` (verl)."""
        return f"K={self.K1}, {self.W1} workers" if self.workers else f"K={self.K1}, W={self.W1}"

    def resharded_words(self) -> str:
        """`re-sharded from W=2 to W=1`, or `re-sharded from 2 to 1 workers (trainer.n_gpus_per_node)`."""
        if self.workers:
            return f"re-sharded from {self.W0} to {self.W1} workers ({', '.join(self.workers)})"
        return f"re-sharded from W={self.W0} to W={self.W1}"


def _worker_value(config: Mapping[str, Any], key: str) -> Any:
    """A worker key's value in a flattened training-side config (trainer.nnodes is 1 when absent)."""
    return config.get(key, 1 if key == WORKER_KEYS[0] else None)


def workers_of(config: Optional[Mapping[str, Any]]) -> Optional[int]:
    """verl's worker count in a flattened training-side config: trainer.nnodes x trainer.n_gpus_per_node
    (nnodes 1 when absent); None when the config does not say."""
    if not config:
        return None
    nodes, gpus = (_worker_value(config, k) for k in WORKER_KEYS)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (nodes, gpus)):
        return None
    return int(nodes) * int(gpus)


def worker_change(then: Optional[Mapping[str, Any]], now: Optional[Mapping[str, Any]]) -> Optional[Tuple[int, int, Tuple[str, ...]]]:
    """(the recording's worker count, this run's, the worker keys that differ) when both configs say; else None."""
    a, b = workers_of(then), workers_of(now)
    if a is None or b is None or then is None or now is None:
        return None
    return a, b, tuple(k for k in WORKER_KEYS if _worker_value(then, k) != _worker_value(now, k))


def shard_key(key: str) -> bool:
    """Whether a training-side key changes with W by design (`config.SHARD_KEYS`, by its last part): at another
    W its change explains nothing."""
    return key.rsplit(".", 1)[-1] in _SHARD_LAST


_SHARD_LAST = frozenset(k.rsplit(".", 1)[-1] for k in SHARD_KEYS)


__all__ = ["Regroup", "shard_key", "worker_change", "workers_of"]
