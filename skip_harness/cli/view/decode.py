"""A trajectory as something to read: its prompt and response as text and as tokens, and the values
recorded per response token (log-probs, masks, per-token rewards), coloured by the page.

Text comes, in order of preference, from the tokenizer given with `--tokenizer` (a local directory or
tokenizer.json, or a name already in the local Hugging Face cache: never downloaded), from the batch's
own text fields (verl's `raw_prompt`), else the token ids are shown as numbers.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from skip_harness.cli.view.samples import MASK, PROMPT_IDS, PROMPT_TEXT, RESPONSE_IDS, RESPONSE_TEXT, Batch, Trajectory, _last
from skip_harness.errors import SkipHarnessError


class TokenizerError(SkipHarnessError):
    """--tokenizer names nothing that loads locally."""


class Decoder:
    """Token ids -> text: a Hugging Face tokenizer loaded from local files only, or none (ids shown)."""

    def __init__(self, name_or_path: Optional[str] = None):
        self.name = name_or_path
        self._tok = None if name_or_path is None else _load_tokenizer(name_or_path)

    @property
    def active(self) -> bool:
        return self._tok is not None

    def text(self, ids: Sequence[int]) -> Optional[str]:
        if self._tok is None:
            return None
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def tokens(self, ids: Sequence[int]) -> List[str]:
        if self._tok is None:
            return [str(i) for i in ids]
        return [self._tok.decode([i], skip_special_tokens=False) for i in ids]


def _load_tokenizer(name_or_path: str) -> Any:
    path = Path(name_or_path).expanduser()
    if not path.exists() and (name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1):
        raise TokenizerError(f"--tokenizer {name_or_path}: no such file or directory (give a tokenizer directory, "
                             f"a tokenizer.json, or a name in the local Hugging Face cache; the viewer never downloads)")
    try:
        if path.is_file():                     # a tokenizer.json
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except ImportError as exc:
        raise TokenizerError(f"--tokenizer {name_or_path}: needs transformers and tokenizers "
                             f"(pip install -e '.[trl]'): {exc}") from None
    except Exception as exc:  # OSError, ValueError...: what transformers says about a missing model
        raise TokenizerError(f"--tokenizer {name_or_path}: no tokenizer there or in the local Hugging Face cache "
                             f"(the viewer never downloads): {str(exc).splitlines()[0] if str(exc) else exc}") from None


# --------------------------------------------------------------------------------------------
# one trajectory, for a page


@dataclass
class TokenRow:
    """The values of one per-token field along a response: numbers, and their range (for the colours)."""

    name: str
    values: List[Optional[float]]
    low: float
    high: float


@dataclass
class Shown:
    prompt_text: Optional[str]
    prompt_tokens: Optional[List[str]]
    response_text: Optional[str]
    response_tokens: Optional[List[str]]
    token_rows: List[TokenRow]
    truncated: int                     # response tokens left out (a step page shows the first `limit`)
    fields: Dict[str, str]             # other per-trajectory fields, as short text


def _ids(value: Any) -> Optional[List[int]]:
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() == 1:
        return value.tolist()
    if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return value
    return None


def _length(row: Any) -> Optional[int]:
    if isinstance(row, torch.Tensor):
        return int(row.shape[0]) if row.dim() == 1 else None
    return len(row) if isinstance(row, list) else None


def _as_text(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in value)   # chat messages
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)[:4000]
    return None


def _short(value: Any, limit: int = 120) -> str:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return f"nested {tuple(value.shape[:1])}"
        value = value.tolist() if value.numel() <= 16 else f"tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    text = value if isinstance(value, str) else json.dumps(value, default=str) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _row_values(value: Any) -> Optional[List[Optional[float]]]:
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        return None
    out = value.double().tolist()
    return [x if math.isfinite(x) else None for x in out]


def show(t: Trajectory, decoder: Decoder, limit: Optional[int] = None) -> Shown:
    """Prompt, response, per-token rows and other fields of trajectory `t` (the first `limit` response
    tokens when given)."""
    b: Batch = t.batch
    j = t.index
    prompt_name, response_name = b.find(PROMPT_IDS), b.find(RESPONSE_IDS)
    prompt_row = b.row(prompt_name, j) if prompt_name else None
    response_row = b.row(response_name, j) if response_name else None
    n_prompt, n_resp = _length(prompt_row), _length(response_row)
    prompt_cut = truncated = 0
    if limit is not None and n_prompt is not None and n_prompt > limit:   # its end: next to the response
        prompt_cut, prompt_row = n_prompt - limit, prompt_row[-limit:]
    if limit is not None and n_resp is not None and n_resp > limit:       # sliced before a list is made
        truncated, response_row = n_resp - limit, response_row[:limit]
    prompt_ids = _ids(prompt_row) if prompt_row is not None else None
    response_ids = _ids(response_row) if response_row is not None else None
    prompt_text_field, response_text_field = b.find(PROMPT_TEXT), b.find(RESPONSE_TEXT)
    prompt_text = decoder.text(prompt_ids) if prompt_ids is not None and decoder.active else None
    if prompt_text is None and prompt_text_field is not None:
        prompt_text = _as_text(b.row(prompt_text_field, j))
    response_text = decoder.text(response_ids) if response_ids is not None and decoder.active else None
    if response_text is None and response_text_field is not None:
        response_text = _as_text(b.row(response_text_field, j))
    token_rows: List[TokenRow] = []
    used = {prompt_name, response_name, prompt_text_field, response_text_field}
    used |= {k for k in b.columns if "→" in k} | {k.split("→")[0] for k in b.columns if "→" in k}
    fields: Dict[str, str] = {}
    for name in b.columns:
        if name in used:
            continue
        value = b.row(name, j)
        if (n_resp is not None and isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == n_resp
                and (value.is_floating_point() or _last(name) in MASK or value.dtype == torch.bool)):
            vals = _row_values(value[: len(response_ids)] if response_ids is not None else value)
            finite = [v for v in vals if v is not None]
            token_rows.append(TokenRow(name, vals, min(finite) if finite else 0.0, max(finite) if finite else 0.0))
        elif limit is None:              # a step page (a preview) shows no other fields
            fields[name] = _short(value)
    prompt_tokens = decoder.tokens(prompt_ids) if prompt_ids is not None else None
    if prompt_tokens is not None and prompt_cut:
        prompt_tokens = [f"… {prompt_cut} tokens before"] + prompt_tokens
    return Shown(prompt_text, prompt_tokens, response_text,
                 decoder.tokens(response_ids) if response_ids is not None else None, token_rows, truncated, fields)
