"""A mini-batch's trajectories, whatever the trainer named its fields: prompts, response tokens, log-probs.

Trainers name their fields differently -- the demo (`prompts`, `responses`, `response_mask`,
`old_logprobs`), verl (a TensorDict of jagged or padded tensors: `prompts`, `responses`,
`rollout_log_probs`), TRL's cached unit (`completion_ids` and `logprobs` flat, cut by `lengths`;
`prompt_ids` flat, cut by `prompt_lengths`) -- so a field is recognised by the last part of its name
among the role names below. They are shared with the command line (`skip-harness view`, `diff`), which
finds the same roles in a stored step; :func:`leaves` is the walk both use over a payload's containers.
:func:`rows_of` gives one mini-batch's trajectories as one tensor per trajectory (real tokens only:
padding after the response mask's last position is dropped), for `skip.rollout_tq.action=compare`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from skip_harness.codec.payload_kinds import is_non_tensor_data, is_non_tensor_stack, is_tensordict

PROMPT_IDS = ("prompts", "prompt_ids", "prompt_input_ids", "prompt_tokens", "query_ids")
RESPONSE_IDS = ("responses", "completion_ids", "response_ids", "response_tokens")
MASK = ("response_mask", "completion_mask", "loss_mask")
LOGPROBS = ("old_logprobs", "rollout_log_probs", "logprobs", "old_log_probs", "sampling_logprobs", "log_probs")


def last_part(name: str) -> str:
    """The role part of a field's name: its last dotted part (a derived field's after the arrow)."""
    return name.rsplit(".", 1)[-1].rsplit("→", 1)[-1]


def children(obj: Any) -> Optional[List[Tuple[str, Any]]]:
    """(key, value) pairs of a container that holds several fields; None for a leaf."""
    if is_non_tensor_stack(obj) or is_non_tensor_data(obj):
        return None
    if is_tensordict(obj):
        return [(str(k), obj.get(k)) for k in obj.keys()]
    if isinstance(obj, dict):
        return [(str(k), v) for k, v in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [(str(k), v) for k, v in obj._asdict().items()]  # type: ignore[attr-defined]  # a namedtuple
    if isinstance(obj, tuple):
        return [(str(i), v) for i, v in enumerate(obj)]
    return None


def leaves(obj: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """Every field of a payload as (dotted name, value), containers walked."""
    if is_non_tensor_stack(obj):       # one value per row (verl's chat messages, uids): a list column
        obj = obj.tolist()
    elif is_non_tensor_data(obj):      # one value for the whole batch
        obj = obj.data
    kids = children(obj)
    if kids is None:
        yield (prefix or "value"), obj
        return
    for k, v in kids:
        yield from leaves(v, f"{prefix}.{k}" if prefix else k)


@dataclass
class Rows:
    """One mini-batch's trajectories: real tokens per trajectory; None where the role was not found."""

    n: int
    responses: Optional[List[torch.Tensor]]
    prompts: Optional[List[torch.Tensor]] = None
    logprobs: Optional[List[torch.Tensor]] = None
    names: Dict[str, str] = dataclasses.field(default_factory=dict)    # role -> the field found for it


def _int_vector(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and not v.is_nested and v.dim() == 1 and not v.is_floating_point()


def _pieces(v: Any, lengths: Optional[torch.Tensor], ends: Optional[List[int]]) -> Optional[List[torch.Tensor]]:
    """A field as one tensor per trajectory: flat and cut by `lengths`, padded [n, L] (cut at `ends`), jagged,
    or a list of rows."""
    if isinstance(v, torch.Tensor):
        if v.is_nested:
            return [r for r in v.unbind()]
        if v.dim() == 1 and lengths is not None and int(lengths.sum()) == v.numel() and lengths.numel() != v.numel():
            return list(torch.split(v, [int(x) for x in lengths.tolist()]))
        if v.dim() == 2:
            rows = list(v.unbind(0))
            return rows if ends is None or len(ends) != len(rows) else [r[:e] for r, e in zip(rows, ends)]
        return None
    if isinstance(v, list) and all(isinstance(r, (list, torch.Tensor)) for r in v):
        return [r if isinstance(r, torch.Tensor) else torch.tensor(r) for r in v]
    return None


def _ends(mask: Any, width: int) -> Optional[List[int]]:
    """Each row's real length: one past the response mask's last set position."""
    if not isinstance(mask, torch.Tensor) or mask.is_nested or mask.dim() != 2 or int(mask.shape[1]) != width:
        return None
    m = mask != 0
    pos = torch.arange(1, width + 1).expand_as(m)
    return torch.where(m, pos, torch.zeros_like(pos)).amax(dim=1).tolist()


def rows_of(payload: Any) -> Rows:
    """One mini-batch's prompts, responses and log-probs, one tensor per trajectory (module doc)."""
    fields = list(leaves(payload))
    roles: Dict[str, Tuple[str, Any]] = {}
    for name, value in fields:
        roles.setdefault(last_part(name), (name, value))

    def find(names: Tuple[str, ...]) -> Optional[Tuple[str, Any]]:
        return next((roles[n] for n in names if n in roles), None)

    lengths = roles.get("lengths", (None, None))[1]
    lengths = lengths if _int_vector(lengths) else None
    prompt_lengths = roles.get("prompt_lengths", (None, None))[1]
    prompt_lengths = prompt_lengths if _int_vector(prompt_lengths) else None
    response = find(RESPONSE_IDS)
    if response is None:
        return Rows(0, None)
    value = response[1]
    width = int(value.shape[1]) if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() == 2 else 0
    mask = find(MASK)
    ends = _ends(mask[1], width) if mask is not None and width else None
    responses = _pieces(value, lengths, ends)
    if responses is None:
        return Rows(0, None)
    names = {"responses": response[0]}
    out = Rows(len(responses), responses, names=names)
    prompt = find(PROMPT_IDS)
    if prompt is not None:
        prompts = _pieces(prompt[1], prompt_lengths, None)
        if prompts is not None and len(prompts) == out.n:
            out.prompts, names["prompts"] = prompts, prompt[0]
    logp = find(LOGPROBS)
    if logp is not None and logp[1] is not None:
        lps = _pieces(logp[1], lengths, ends)
        if lps is not None and len(lps) == out.n and all(a.numel() == b.numel() for a, b in zip(lps, responses)):
            out.logprobs, names["logprobs"] = lps, logp[0]
    return out


__all__ = ["LOGPROBS", "MASK", "PROMPT_IDS", "RESPONSE_IDS", "Rows", "children", "last_part", "leaves", "rows_of"]
