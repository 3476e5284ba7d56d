"""The trajectories of two steps, paired row by row for `skip-harness diff` -- or the reason they cannot be.

A step's rows come from its mini-batches in recorded order (`compare._in_order`), one value per trajectory
per field (`export_rows.columns_of`). A trainer that stores a field flattened across its trajectories (TRL's
`completion_ids` and `prompt_ids`, with `lengths` and `prompt_lengths`) has it cut back into one piece per
trajectory here, so its tokens are compared too. Two rows are a pair only when they are the same
trajectory's: the two steps hold as many trajectories, share a per-trajectory field, and hold the same
prompts in the same order; otherwise nothing is counted (`unpaired`), never "N of M differ" of rows that
were never the same trajectory's.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

PROMPT_NAMES = ("prompts", "prompt_ids", "prompt", "input_ids", "raw_prompt_ids")
_LENGTHS = "lengths"


def _lengths_for(name: str, payload: Dict[str, Any], total: int) -> Optional[torch.Tensor]:
    """The per-trajectory lengths a flattened field `name` is cut by: `{stem}_lengths` (prompt_ids:
    prompt_lengths), else `lengths`; only when they add up to the field's length."""
    stem = name[:-4] if name.endswith("_ids") else name
    for key in (f"{stem}_lengths", _LENGTHS):
        lengths = payload.get(key)
        if isinstance(lengths, torch.Tensor) and lengths.dim() == 1 and not lengths.is_floating_point() \
                and int(lengths.sum()) == total:
            return lengths
    return None


def split_ragged(payload: Any) -> Any:
    """A dict payload with its flattened per-trajectory fields cut into one tensor per trajectory (a list)."""
    if not isinstance(payload, dict):
        return payload
    out = dict(payload)
    for name, value in payload.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and name != _LENGTHS and not name.endswith("_lengths"):
            lengths = _lengths_for(name, payload, int(value.shape[0]))
            if lengths is not None and lengths.numel() != value.numel():
                out[name] = list(torch.split(value, [int(x) for x in lengths]))
    return out


class _LeftOut(logging.Filter):
    """Export's `left out of the export` warnings, kept as field names instead (said once by diff)."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: Set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if "left out of the export" in record.getMessage() and len(record.args or ()) >= 2:
            self.fields.add(str(record.args[1]))  # type: ignore[index]  # (where, name, ...)
            return False
        return True


def rows_of(payloads: Sequence[Any]) -> Tuple[int, Dict[str, List[Any]], List[str]]:
    """(trajectories, {field: per-row values}, fields that are not one value per trajectory) of a step."""
    from skip_harness.cli.export_rows import columns_of

    caught = _LeftOut()
    logger = logging.getLogger("skip_harness.cli.export")
    logger.addFilter(caught)
    try:
        total = 0
        fields: Dict[str, List[Any]] = {}
        for i, payload in enumerate(payloads):
            n, cols = columns_of(split_ragged(payload), f"mini-batch {i}")
            for name, col in cols.items():
                if col.per_row:
                    fields.setdefault(name, [None] * total)
                    fields[name].extend(col.value[j] for j in range(n))
            total += n
            for rows in fields.values():
                rows.extend([None] * (total - len(rows)))
    finally:
        logger.removeFilter(caught)
    return total, fields, sorted(caught.fields)


def unpaired(na: int, fa: Dict[str, List[Any]], nb: int, fb: Dict[str, List[Any]], same: Any) -> str:
    """Why the rows of the two steps are not pairs of one trajectory ('' when they are)."""
    common = [k for k in fa if k in fb]
    if not common:
        return "no per-trajectory field in common"
    if na != nb:
        return f"{na} trajectories in A, {nb} in B"
    prompt = next((k for k in common if k.rsplit(".", 1)[-1].lower() in PROMPT_NAMES), None)
    if prompt is not None:
        other = sum(1 for i in range(na) if not same(fa[prompt][i], fb[prompt][i]))
        if other:
            return f"other prompts ({prompt} differs in {other} of {na} trajectories)"
    return ""


__all__ = ["PROMPT_NAMES", "rows_of", "split_ragged", "unpaired"]
