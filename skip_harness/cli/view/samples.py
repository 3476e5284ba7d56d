"""A step's mini-batches as trajectories: which field is the prompt, the response, the reward, the group.

Trainers name their fields differently -- the demo (`prompts`, `responses`, `rewards`, `uid`,
`old_logprobs`, `response_mask`), verl (a TensorDict of jagged tensors under `tensordict`: `prompts`,
`responses`, `rollout_log_probs`, `rm_scores`, a `uid` stack, trajectory `keys` `{uid}_{session}_{i}`),
TRL (`completion_ids` and `logprobs` flat, split by `lengths`) -- so a field is recognised by the last
part of its name, among the names below. Everything per trajectory (reward, advantage, length, group)
is computed for the whole step with tensor operations; tokens are turned into Python lists only for
the trajectories a page shows.

A mini-batch without a reward field of its own (TRL's generations store token ids only) takes its
rewards from the step's second tier where it holds them (`StoredRewards`: TRL's rewards per reward
function, gathered over the processes): each trajectory's reward is their sum, NaN-skipping as TRL's
(`nansum`; TRL's `reward_weights` are not recorded, so the sum is unweighted), and each function's
value is kept beside it.

A step without stored advantages gets GRPO's: each reward minus its group's mean, over the group's
standard deviation (+1e-6), marked `computed`; its dead groups and what is zero within rounding are
grpo.py's. A group the rollouts do not name is labelled `p{k}@{inner}.{rank}` (`group_label`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness.cli.export_rows import _batch_length, _leaves
from skip_harness.run.trajectories import MASK, PROMPT_IDS, RESPONSE_IDS, last_part  # noqa: F401 - shared with action=compare
from skip_harness.cli.view.grpo import EPS64, by_group, dead_groups, eps_of, grpo_advantages, mark_rounded_advantages

PROMPT_TEXT = ("raw_prompt", "prompt", "prompt_text", "prompts_text", "question", "query")
RESPONSE_TEXT = ("response_text", "completion", "completions", "completion_text", "response", "text")
REWARD = ("rewards", "reward", "scores", "score", "token_level_rewards", "token_level_scores", "rm_scores")
ADVANTAGE = ("advantages", "advantage")
ATTENTION_MASK = ("attention_mask",)
GROUP = ("uid", "prompt_uid", "group", "group_id", "prompt_id")
LENGTHS = ("lengths", "response_length", "response_lengths")
KEYS = ("keys",)           # verl's trajectory keys {uid}_{session}_{index}
GROUP_SIZE_KEYS = ("num_generations", "actor_rollout_ref.rollout.n", "rollout.n", "n")


_last = last_part


@dataclass(frozen=True)
class StoredRewards:
    """One mini-batch's rewards from the second tier: `values` [N] or [N, F] (F reward functions, named
    by `names`), N the mini-batch's trajectories or, gathered over W processes, W times that."""

    names: List[str]
    values: torch.Tensor

    def for_batch(self, n: int, rank: int) -> Optional[torch.Tensor]:
        """[n, F] float64 for a mini-batch of `n` trajectories of process `rank`; None when the sizes disagree."""
        v = self.values.detach().to("cpu", torch.float64)
        v = v.reshape(v.shape[0], -1)
        if v.shape[0] == n:
            return v
        if n > 0 and v.shape[0] % n == 0 and rank < v.shape[0] // n:      # gathered over the processes
            return v[rank * n:(rank + 1) * n]
        return None

    def column_names(self, f: int) -> List[str]:
        return self.names if len(self.names) == f else [f"reward #{i}" for i in range(f)]


@dataclass
class Batch:
    """One mini-batch's per-trajectory columns: {field name: tensor / nested tensor / list} of length n."""

    inner: int
    rank: int
    n: int
    columns: Dict[str, Any]
    scalars: Dict[str, Any]            # fields with one value for the mini-batch

    found: Dict[Tuple[str, ...], Optional[str]] = field(default_factory=dict, repr=False)
    derived: Dict[str, Any] = field(default_factory=dict, repr=False)    # computed once per mini-batch

    def find(self, names: Sequence[str]) -> Optional[str]:
        """The field playing the role `names` lists (the first name that one of the fields ends in)."""
        key = tuple(names)
        if key not in self.found:
            roles: Dict[str, str] = {}
            for name in self.columns:
                roles.setdefault(_last(name), name)
            self.found[key] = next((roles[w] for w in names if w in roles), None)
        return self.found[key]

    def row(self, name: str, j: int) -> Any:
        value = self.columns[name]
        if isinstance(value, torch.Tensor):
            return value[j]
        return value[j]


def _lengths_of(leaves: List[Tuple[str, Any]], name: str) -> Optional[torch.Tensor]:
    return next((v for k, v in leaves if _last(k) == name and isinstance(v, torch.Tensor) and v.dim() == 1
                 and not v.is_floating_point()), None)


def _split_flat(leaves: List[Tuple[str, Any]]) -> Tuple[Optional[int], List[Tuple[str, Any]]]:
    """TRL's generation payload: flat token fields and `lengths` (and, stored since issue 31, flat
    `prompt_ids` with `prompt_lengths`); split them into one row per trajectory."""
    lengths = _lengths_of(leaves, "lengths")
    if lengths is None or lengths.numel() == 0:
        return None, leaves
    total, sizes = int(lengths.sum()), [int(x) for x in lengths.tolist()]
    prompt_lengths = _lengths_of(leaves, "prompt_lengths")
    p_sizes = None if prompt_lengths is None or prompt_lengths.numel() != len(sizes) else \
        [int(x) for x in prompt_lengths.tolist()]
    out = []
    for k, v in leaves:
        if p_sizes is not None and _last(k) == "prompt_ids" and isinstance(v, torch.Tensor) and v.dim() == 1 \
                and v.numel() == sum(p_sizes):
            v = list(torch.split(v, p_sizes))
        elif isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == total and total != len(sizes) \
                and _last(k) != "prompt_ids":
            v = list(torch.split(v, sizes))
        out.append((k, v))
    return len(sizes), out


def batch_of(payload: Any, inner: int, rank: int) -> Batch:
    leaves = list(_leaves(payload))
    n, leaves = _split_flat(leaves)
    if n is None:
        n = _batch_length(payload, leaves)
    columns: Dict[str, Any] = {}
    scalars: Dict[str, Any] = {}
    for name, value in leaves:
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and int(value.shape[0]) == n:
            columns[name] = value
        elif isinstance(value, list) and len(value) == n:
            columns[name] = value
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            scalars[name] = value.item()
        elif value is None or isinstance(value, (int, float, str, bool)):
            scalars[name] = value
        else:
            scalars[name] = f"{type(value).__name__}"
    _split_input_ids(columns)
    return Batch(inner, rank, n, columns, scalars)


def _split_input_ids(columns: Dict[str, Any]) -> None:
    """verl's DataProto keeps prompt and response in one `input_ids` row ([left-padded prompt, response]):
    without a response field of its own, its last R positions (R: the response mask's width) are the
    response, the rest the prompt (views, nothing copied)."""
    names = {_last(k): k for k in columns}
    ids, mask = names.get("input_ids"), next((names[m] for m in MASK if m in names), None)
    if ids is None or mask is None or any(r in names for r in RESPONSE_IDS):
        return
    full, m = columns[ids], columns[mask]
    if not (isinstance(full, torch.Tensor) and isinstance(m, torch.Tensor)) or full.is_nested or m.is_nested \
            or full.dim() != 2 or m.dim() != 2 or not 0 < m.shape[1] < full.shape[1]:
        return
    R = int(m.shape[1])
    columns[f"{ids}→prompts"] = full[:, :-R]
    columns[f"{ids}→responses"] = full[:, -R:]


# --------------------------------------------------------------------------------------------
# per-trajectory values, vectorised


def _per_row_number(batch: Batch, name: Optional[str]) -> Optional[torch.Tensor]:
    """A float per trajectory: the field itself, or its sum over tokens (a per-token reward)."""
    if name is None:
        return None
    v = batch.columns[name]
    if isinstance(v, list):
        if all(isinstance(x, torch.Tensor) for x in v):
            return torch.stack([x.double().sum() for x in v]) if v else torch.zeros(0, dtype=torch.float64)
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            return torch.tensor(v, dtype=torch.float64)
        return None
    if v.is_nested:
        return torch.stack([r.sum(dtype=torch.float64) for r in v.unbind(0)]) if batch.n else torch.zeros(0, dtype=torch.float64)
    if v.dim() == 1:
        return v.double()
    if not v.is_floating_point():                   # a mask, counts: summed as it is stored
        return v.reshape(v.shape[0], -1).sum(dim=1).double()
    return v.reshape(v.shape[0], -1).sum(dim=1, dtype=torch.float64)     # no float64 copy of the whole field


def _row_lengths(batch: Batch, name: Optional[str]) -> Optional[torch.Tensor]:
    if name is None:
        return None
    v = batch.columns[name]
    if isinstance(v, list):
        return torch.tensor([len(x) for x in v], dtype=torch.int64)
    if v.is_nested:
        return torch.tensor([int(r.shape[0]) for r in v.unbind(0)], dtype=torch.int64)
    return torch.full((batch.n,), int(v.shape[1]) if v.dim() > 1 else 1, dtype=torch.int64)


def _lengths(batch: Batch) -> Optional[torch.Tensor]:
    """Response lengths: a field that stores them, else the response mask's count, else the rows' lengths."""
    stored = batch.find(LENGTHS)
    if stored is not None and isinstance(batch.columns[stored], torch.Tensor) and batch.columns[stored].dim() == 1 \
            and not batch.columns[stored].is_floating_point():
        return batch.columns[stored].long()
    mask = batch.find(MASK)
    if mask is not None:
        m = _per_row_number(batch, mask)
        if m is not None:
            return m.round().long()
    return _row_lengths(batch, batch.find(RESPONSE_IDS))


def _groups(batch: Batch, group_size: Optional[int]) -> List[str]:
    name = batch.find(GROUP)
    if name is not None:
        v = batch.columns[name]
        if isinstance(v, torch.Tensor) and not v.is_nested and v.dim() == 1:
            return [str(x) for x in v.tolist()]
        if isinstance(v, list) and all(isinstance(x, (str, int)) for x in v):
            return [str(x) for x in v]
    keys = batch.find(KEYS)
    if keys is not None and all(isinstance(k, str) for k in batch.columns[keys]):
        return [k.split("_", 1)[0] for k in batch.columns[keys]]
    if group_size and group_size > 0:
        return [group_label(j // group_size, batch.inner, batch.rank) for j in range(batch.n)]
    return [group_label(j, batch.inner, batch.rank) for j in range(batch.n)]


def group_label(k: int, inner: int, rank: int) -> str:
    """A group the rollouts do not name (no uid): `p{k}@{inner}.{rank}`, the k-th prompt of mini-batch
    `inner` of rank `rank` -- never in the `inner.rank.index` form of a trajectory's id."""
    return f"p{k}@{inner}.{rank}"


@dataclass
class Trajectory:
    """One row of the step: where it is, its group, and its per-trajectory numbers."""

    inner: int
    rank: int
    index: int                 # in its mini-batch
    group: str
    reward: Optional[float]
    advantage: Optional[float]
    length: Optional[int]
    batch: Batch = field(repr=False)
    rewards_by: Optional[Dict[str, float]] = None     # per reward function (the second tier's), when stored
    reward_eps: float = EPS64       # the machine epsilon of the reward's stored dtype (grpo: "within rounding")
    advantage_zero: bool = False    # a stored advantage within rounding of zero: shown as 0, not coloured

    @property
    def ref(self) -> str:
        return f"{self.inner}.{self.rank}.{self.index}"


@dataclass
class StepTable:
    trajectories: List[Trajectory]
    advantage_computed: bool
    fields: List[str]              # every per-trajectory field name, in order of first appearance
    scalars: Dict[str, Any]
    reward_functions: List[str] = field(default_factory=list)   # the second tier's, when rewards came from it
    dead: List[str] = field(default_factory=list)     # the dead groups' ids (grpo.dead_groups)

    def groups(self, rows: Sequence[Trajectory]) -> List[Tuple[str, List[Trajectory]]]:
        """`rows` by group, groups in order of first appearance."""
        out: Dict[str, List[Trajectory]] = {}
        for t in rows:
            out.setdefault(t.group, []).append(t)
        return list(out.items())

    def find(self, ref: str) -> Optional[Trajectory]:
        for t in self.trajectories:
            if t.ref == ref:
                return t
        return None

    def summary(self) -> Dict[str, Optional[float]]:
        rewards = [t.reward for t in self.trajectories if t.reward is not None and math.isfinite(t.reward)]
        lengths = [t.length for t in self.trajectories if t.length is not None]
        judged = [g for g, members in by_group(self.trajectories).items()
                  if len(members) >= 2 and all(t.reward is not None for t in members)]
        return {"trajectories": len(self.trajectories), "groups": len({t.group for t in self.trajectories}),
                "dead_group_count": len(self.dead),
                "dead_group_share": len(self.dead) / len(judged) if judged else None,
                "reward_mean": _mean(rewards), "reward_std": _std(rewards),
                "reward_min": min(rewards) if rewards else None, "reward_max": max(rewards) if rewards else None,
                "length_mean": _mean(lengths), "length_min": min(lengths) if lengths else None,
                "length_max": max(lengths) if lengths else None}


def _mean(xs: Sequence[float]) -> Optional[float]:
    return float(sum(xs) / len(xs)) if xs else None


def _std(xs: Sequence[float]) -> Optional[float]:
    if len(xs) < 2:
        return 0.0 if xs else None
    m = sum(xs) / len(xs)
    return float(math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)))


def _listed(t: Optional[torch.Tensor]) -> List[Any]:
    return [] if t is None else t.tolist()


def step_table(batches: Sequence[Tuple[int, int, Any]], group_size: Optional[int] = None,
               stored_rewards: Optional[Dict[Tuple[int, int], StoredRewards]] = None) -> StepTable:
    """Every trajectory of a step's mini-batches ((inner, rank, payload)), in stored order; a mini-batch
    without a reward field takes its rewards from `stored_rewards` (the second tier's) where it has them."""
    rows: List[Trajectory] = []
    fields: Dict[str, None] = {}
    scalars: Dict[str, Any] = {}
    functions: Dict[str, None] = {}
    stored_advantage = True
    advantage_eps = 0.0
    for inner, rank, payload in batches:
        b = batch_of(payload, inner, rank)
        fields.update(dict.fromkeys(b.columns))
        scalars.update({f"{inner}.{rank}:{k}": v for k, v in b.scalars.items()})
        reward_field = b.find(REWARD)
        rewards = _listed(_per_row_number(b, reward_field))
        reward_eps = eps_of(b.columns[reward_field]) if rewards and reward_field is not None else EPS64
        parts: List[Optional[Dict[str, float]]] = [None] * b.n
        tier = (stored_rewards or {}).get((inner, rank)) if not rewards else None
        per_function = tier.for_batch(b.n, rank) if tier is not None else None
        if tier is not None and per_function is not None:
            names = tier.column_names(int(per_function.shape[1]))
            functions.update(dict.fromkeys(names))
            rewards = torch.nansum(per_function, dim=1).tolist()
            reward_eps = eps_of(tier.values)
            parts = [dict(zip(names, row)) for row in per_function.tolist()]
        advantage_field = b.find(ADVANTAGE)
        advantages = _per_row_number(b, advantage_field)
        stored_advantage = stored_advantage and advantages is not None
        if advantages is not None and advantage_field is not None:
            advantage_eps = max(advantage_eps, eps_of(b.columns[advantage_field]))
        adv = _listed(advantages)
        lengths = _listed(_lengths(b))
        groups = _groups(b, group_size)
        for j in range(b.n):
            rows.append(Trajectory(inner, rank, j, groups[j], rewards[j] if rewards else None,
                                   adv[j] if adv else None, int(lengths[j]) if lengths else None, b, parts[j],
                                   reward_eps))
    computed = False
    if not stored_advantage and any(t.reward is not None for t in rows):
        grpo_advantages(rows)
        computed = True
    elif stored_advantage:
        mark_rounded_advantages(rows, advantage_eps)
    return StepTable(rows, computed, list(fields), scalars, list(functions), dead_groups(rows))


def group_size_of(fingerprint_values: Optional[Dict[str, Any]]) -> Optional[int]:
    """Samples per prompt, from the fingerprint (TRL's `num_generations`, verl's `rollout.n`)."""
    if not fingerprint_values:
        return None
    for wanted in GROUP_SIZE_KEYS:
        for key, value in fingerprint_values.items():
            if (key == wanted or key.endswith("." + wanted)) and isinstance(value, int) and value > 0:
                return value
    return None
