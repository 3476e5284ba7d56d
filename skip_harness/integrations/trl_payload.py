"""What is stored for one TRL generation call: ``(completion_ids, logprobs)`` as a few flat tensors, and
back to the exact lists TRL's generator returned. :class:`Generation` stands in for the trainer's method.

The call's prompt token ids are stored beside them (``prompt_ids`` flat, ``prompt_lengths``), so a cache
shows what each completion answered (`skip-harness view`); serving ignores them (the lists handed back
are the generator's, exactly), and a cache written before they were stored still loads."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Sequence

import torch


class Generation:
    """Stands in for ``trainer._generate_single_turn`` so the harness caches compact tensors.

    `generate` is what the harness wraps: it calls TRL's method and returns its result as a dict of
    tensors; `decode` turns that (fresh or served from the cache) back into TRL's return value.
    """

    def __init__(self, original: Callable[..., Any]):
        self._original = original

    def generate(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        payload = encode_generation(self._original(*args, **kwargs))
        add_prompts(payload, kwargs["prompt_ids"] if "prompt_ids" in kwargs else args[0] if args else None)
        return payload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return decode_generation(self.generate(*args, **kwargs))


def _int_rows(rows: Any) -> bool:
    return isinstance(rows, list) and all(
        isinstance(r, list) and all(type(x) is int for x in r) for r in rows
    )


def _float_rows(rows: Any, lengths: Sequence[int]) -> bool:
    return isinstance(rows, list) and len(rows) == len(lengths) and all(
        isinstance(r, list) and len(r) == n and all(x is None or type(x) is float for x in r)
        for r, n in zip(rows, lengths)
    )


def encode_generation(out: Any) -> Dict[str, Any]:
    """TRL's ``(completion_ids, logprobs)`` as tensors; anything else is kept as it is (``raw``)."""
    if isinstance(out, tuple) and len(out) == 2 and _int_rows(out[0]):
        completion_ids, logprobs = out
        lengths = [len(r) for r in completion_ids]
        if logprobs is None or _float_rows(logprobs, lengths):
            flat = [x for r in completion_ids for x in r]
            payload: Dict[str, Any] = {
                "completion_ids": torch.tensor(flat, dtype=torch.int64),
                "lengths": torch.tensor(lengths, dtype=torch.int64),
                "logprobs": None,
                "logprob_is_none": None,
            }
            if logprobs is not None:
                values = [x for r in logprobs for x in r]
                payload["logprobs"] = torch.tensor(
                    [float("nan") if x is None else x for x in values], dtype=torch.float64
                )
                if any(x is None for x in values):
                    payload["logprob_is_none"] = torch.tensor([x is None for x in values], dtype=torch.bool)
            return payload
    return {"raw": out}


def add_prompts(payload: Dict[str, Any], prompt_ids: Any) -> None:
    """Store the call's prompt token ids (``_generate_single_turn(prompt_ids, ...)``: one list per
    completion) beside an encoded generation, flat with their lengths; anything else is left out."""
    if "raw" in payload or not _int_rows(prompt_ids) or len(prompt_ids) != int(payload["lengths"].numel()):
        return
    payload["prompt_ids"] = torch.tensor([x for r in prompt_ids for x in r], dtype=torch.int64)
    payload["prompt_lengths"] = torch.tensor([len(r) for r in prompt_ids], dtype=torch.int64)


def decode_generation(payload: Mapping[str, Any]) -> Any:
    """The inverse of :func:`encode_generation`: exactly the lists TRL's generator returned."""
    if "raw" in payload:
        return payload["raw"]
    lengths = [int(n) for n in payload["lengths"].tolist()]
    flat = payload["completion_ids"].tolist()
    completion_ids, offset = [], 0
    for n in lengths:
        completion_ids.append(flat[offset:offset + n])
        offset += n
    logprobs = None
    if payload.get("logprobs") is not None:
        values = payload["logprobs"].tolist()
        if payload.get("logprob_is_none") is not None:
            values = [None if none else v for v, none in zip(values, payload["logprob_is_none"].tolist())]
        logprobs, offset = [], 0
        for n in lengths:
            logprobs.append(values[offset:offset + n])
            offset += n
    return completion_ids, logprobs
