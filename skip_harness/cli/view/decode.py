"""A trajectory as something to read: its prompt and response as text and as tokens, and the values
recorded per response token (log-probs, masks, per-token rewards), coloured by the page.

Text comes, in order of preference, from the tokenizer given with `--tokenizer` (a local directory or
tokenizer.json, or a name already in the local Hugging Face cache: never downloaded), from the batch's
own text fields (verl's `raw_prompt`), from the demo's digit task (its namespaces decode their own
digits and separators without a tokenizer), else the token ids are shown as numbers.

Padding is never shown, counted or coloured: a response ends at its last unmasked token (the response
mask, else its stored length), a prompt starts at its first attended token (the attention mask's
prompt part) -- so `… 1,902 more tokens` counts real tokens only.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from skip_harness.cli.view.samples import (ATTENTION_MASK, MASK, PROMPT_IDS, PROMPT_TEXT, RESPONSE_IDS, RESPONSE_TEXT,
                                            Batch, Trajectory, _last)
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
            return list(map(str, ids))
        return [self._tok.decode([i], skip_special_tokens=False) for i in ids]

    def for_namespace(self, group: str, fingerprint: Optional[Dict[str, Any]]) -> "Decoder":
        """The decoder for one namespace: the tokenizer when one was given, else the demo's own vocabulary
        for the demo's namespaces, else none (ids shown)."""
        if self.active or not is_demo(group, fingerprint):
            return self
        return DemoDecoder()


# The demo's digit task (skip_harness.demo.task, which the CLI may not import: a sibling layer): digits 0-9,
# then BOS, SEP, EOS (EOS also pads). tests/test_view_long.py checks these against the task's own constants.
DEMO_VOCAB = tuple(str(d) for d in range(10)) + ("⟨bos⟩", "⟨sep⟩", "⟨eos⟩")
DEMO_PROJECT = "skip_harness_demo"
DEMO_KEY = "actor_rollout_ref.model.d_model"      # the demo's tiny model: a fingerprint key verl never has


def is_demo(group: str, fingerprint: Optional[Dict[str, Any]]) -> bool:
    return group.endswith("_" + DEMO_PROJECT) or bool(fingerprint and DEMO_KEY in fingerprint)


class DemoDecoder(Decoder):
    """The demo's task decodes its own tokens: digits and its separators, no tokenizer needed."""

    def __init__(self) -> None:
        super().__init__(None)
        self.name = "the demo's digit vocabulary"

    @property
    def active(self) -> bool:
        return True

    def _one(self, i: int) -> str:
        return DEMO_VOCAB[i] if 0 <= i < len(DEMO_VOCAB) else f"[{i}]"

    def text(self, ids: Sequence[int]) -> Optional[str]:
        return " ".join(self._one(i) for i in ids)

    def tokens(self, ids: Sequence[int]) -> List[str]:
        return [self._one(i) for i in ids]


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

ROLLOUT_LOGPROBS = ("rollout_log_probs", "rollout_logprobs", "logprobs", "sampling_logprobs")
TRAINER_LOGPROBS = ("old_log_probs", "old_logprobs", "old_per_token_logps")


@dataclass
class TokenRow:
    """The values of one per-token field along a response: numbers, and their range over the real,
    unmasked tokens (for the colours and the legend)."""

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
    truncated: int                     # real response tokens left out of `response_tokens` (folded)
    fields: Dict[str, str]             # other per-trajectory fields, as short text
    masked: List[bool] = field(default_factory=list)   # per shown response token: the response mask is 0
    response_real: Optional[int] = None     # real response tokens (padding dropped)
    response_padding: int = 0
    prompt_padding: int = 0
    rest: Optional[str] = None         # the folded real tokens, as one text (ids, or decoded)
    prompt_folded: int = 0             # real prompt tokens left out of `prompt_tokens` (folded)
    prompt_rest: Optional[str] = None
    response_ids: Optional[List[int]] = None   # the shown response tokens' ids (search finds them too)
    rest_part: Any = field(default=None, repr=False)   # the folded tokens as stored, until `fill_rests` makes `rest`


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


def _mask_row(b: Batch, j: int, n_resp: Optional[int]) -> Optional[torch.Tensor]:
    """The trajectory's response mask (1: a real, trained-on token), when stored per token."""
    name = b.find(MASK)
    if name is None or n_resp is None:
        return None
    m = b.row(name, j)
    if isinstance(m, torch.Tensor) and m.dim() == 1 and int(m.shape[0]) == n_resp:
        return m
    return None


def first_true(flags: "np.ndarray", none: int) -> "np.ndarray":
    """Per row of a bool [n, w] array: the position of its first True, `none` where it has none (numpy's
    argmax over bools stops at the first True; torch has no such path: a where and a min over the whole
    array cost several times as much)."""
    n, width = flags.shape
    if width == 0:
        return np.full(n, none, dtype=np.int64)
    at = flags.argmax(1).astype(np.int64)
    at[~flags[np.arange(n), at]] = none
    return at


def nonzero(x: torch.Tensor) -> "np.ndarray":
    """`x != 0` as a numpy bool array (numpy's comparison where it holds the dtype: a third faster than torch's)."""
    try:
        return np.not_equal(x.numpy(), 0)
    except TypeError:                   # bfloat16, float8: no numpy dtype
        return (x != 0).numpy()


def mask_ends(b: Batch) -> Optional[List[int]]:
    """Per trajectory of a padded [n, R] response mask: one past its last unmasked position (computed
    once for the whole mini-batch)."""
    if "ends" not in b.derived:
        name = b.find(MASK)
        m = b.columns.get(name) if name is not None else None
        ends = None
        if isinstance(m, torch.Tensor) and not m.is_nested and m.dim() == 2 and m.shape[1] > 0:
            width = int(m.shape[1])          # the first unmasked position counted from the end
            ends = (width - first_true(nonzero(m)[:, ::-1], width)).tolist()
        b.derived["ends"] = ends
    return b.derived["ends"]


def response_span(b: Batch, j: int, n_resp: Optional[int], length: Optional[int]) -> Tuple[int, Optional[torch.Tensor]]:
    """(real response tokens: up to the last unmasked one, else the stored length, the response mask)."""
    if n_resp is None:
        return 0, None
    m = _mask_row(b, j, n_resp)
    if m is not None:
        ends = b.derived.get("ends")           # computed for the whole mini-batch when all rows are needed
        if ends is not None:
            return int(ends[j]), m
        nz = torch.nonzero(m).flatten()
        return (int(nz[-1]) + 1 if nz.numel() else 0), m
    if length is not None and 0 <= length <= n_resp:
        return length, None
    return n_resp, None


def prompt_start(b: Batch, j: int, n_prompt: Optional[int], n_resp: Optional[int]) -> int:
    """Left padding of the prompt: its first attended position (the attention mask covers prompt and
    response, [P + R]), 0 when no attention mask says."""
    name = b.find(ATTENTION_MASK)
    if name is None or n_prompt is None:
        return 0
    a = b.row(name, j)
    if not isinstance(a, torch.Tensor) or a.dim() != 1:
        return 0
    width = int(a.shape[0])
    if width == n_prompt + (n_resp or 0):
        a = a[:n_prompt]
    elif width != n_prompt:
        return 0
    nz = torch.nonzero(a).flatten()
    return int(nz[0]) if nz.numel() else n_prompt


def _derived_rows(b: Batch, j: int, real: int) -> List[Tuple[str, torch.Tensor]]:
    """Rollout minus trainer log-prob, per token, when both are stored."""
    roll, train = b.find(ROLLOUT_LOGPROBS), b.find(TRAINER_LOGPROBS)
    if roll is None or train is None or roll == train:
        return []
    x, y = b.row(roll, j), b.row(train, j)
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dim() != 1 or x.shape != y.shape:
        return []
    return [(f"{_last(roll)} − {_last(train)}", (x[:real].double() - y[:real].double()))]


def show(t: Trajectory, decoder: Decoder, limit: Optional[int] = None, fold: bool = True,
         prompt: bool = True, rows: bool = True, rest_text: bool = True) -> Shown:
    """Prompt, response, per-token rows and other fields of trajectory `t`, padding dropped; with `limit`,
    the first `limit` real response tokens as tokens and the rest folded as one text (`rest`; not made
    when `fold` is False: a brief, as compare's); `prompt=False`: no prompt is made (a group's later
    samples, whose prompt the page does not repeat; a brief); `rows=False`: no per-token rows and no
    other fields (a brief: its tokens only); `rest_text=False`: the folded tokens are kept as they are
    stored (`rest_part`) for `fill_rests` to make every shown row's text at once."""
    b: Batch = t.batch
    j = t.index
    prompt_name, response_name = b.find(PROMPT_IDS), b.find(RESPONSE_IDS)
    prompt_row = b.row(prompt_name, j) if prompt_name and prompt else None
    response_row = b.row(response_name, j) if response_name else None
    n_prompt, n_resp = _length(prompt_row), _length(response_row)
    real, mask = response_span(b, j, n_resp, t.length)
    start = prompt_start(b, j, n_prompt, n_resp)
    if prompt_row is not None and start:
        prompt_row = prompt_row[start:]
    prompt_rest_ids = None
    if prompt_row is not None and limit is not None and n_prompt is not None and n_prompt - start > limit:
        prompt_rest_ids = _ids(prompt_row[limit:]) if fold else None
        prompt_row = prompt_row[:limit]
    shown_n = real if limit is None else min(real, limit)
    rest_ids = rest_part = None
    if response_row is not None:
        if shown_n < real and fold and not rest_text:
            rest_part = response_row[shown_n:real]
        elif shown_n < real and fold:
            rest_ids = _ids(response_row[shown_n:real])
        response_row = response_row[:shown_n]           # sliced before a list is made
    prompt_ids = _ids(prompt_row) if prompt_row is not None else None
    response_ids = _ids(response_row) if response_row is not None else None
    prompt_text_field, response_text_field = b.find(PROMPT_TEXT), b.find(RESPONSE_TEXT)
    prompt_text = decoder.text(prompt_ids) if prompt_ids is not None and decoder.active else None
    if prompt_text is None and prompt_text_field is not None and prompt:
        prompt_text = _as_text(b.row(prompt_text_field, j))
    response_text = None
    if response_ids is not None and decoder.active and limit is None:
        response_text = decoder.text(response_ids)
    if response_text is None and response_text_field is not None:
        response_text = _as_text(b.row(response_text_field, j))
    token_rows: List[TokenRow] = []
    used = {prompt_name, response_name, prompt_text_field, response_text_field}
    used |= {k for k in b.columns if "→" in k} | {k.split("→")[0] for k in b.columns if "→" in k}
    fields: Dict[str, str] = {}
    masked = [] if mask is None else (mask[:shown_n] == 0).tolist()
    live = None if mask is None else (mask[:shown_n] != 0)
    per_token: List[Tuple[str, torch.Tensor]] = []
    for name in b.columns if rows else ():
        if name in used:
            continue
        value = b.row(name, j)
        if (n_resp is not None and isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == n_resp
                and (value.is_floating_point() or _last(name) in MASK or value.dtype == torch.bool)):
            per_token.append((name, value[:shown_n]))
        elif limit is None:              # a step page (a preview) shows no other fields
            fields[name] = _short(value)
    per_token += [(k, v[:shown_n]) for k, v in (_derived_rows(b, j, real) if rows else [])]
    for name, value in per_token:
        vals = _row_values(value)
        if vals is None:
            continue
        if _last(name) in MASK or live is None:
            finite = [v for v in vals if v is not None]
        else:                            # the scale spans the real, unmasked tokens only
            finite = [v for v, keep in zip(vals, live.tolist()) if v is not None and keep]
        token_rows.append(TokenRow(name, vals, min(finite) if finite else 0.0, max(finite) if finite else 0.0))
    rest = None if rest_ids is None else _joined(rest_ids, decoder)
    prompt_rest = None if prompt_rest_ids is None else _joined(prompt_rest_ids, decoder)
    return Shown(prompt_text, decoder.tokens(prompt_ids) if prompt_ids is not None else None, response_text,
                 decoder.tokens(response_ids) if response_ids is not None else None, token_rows, real - shown_n, fields,
                 masked=masked, response_real=real if n_resp is not None else None,
                 response_padding=(n_resp or 0) - real, prompt_padding=start, rest=rest,
                 prompt_folded=len(prompt_rest_ids) if prompt_rest_ids is not None else 0, prompt_rest=prompt_rest,
                 response_ids=response_ids, rest_part=rest_part)


def fill_rests(shown: Sequence[Shown], decoder: Decoder) -> None:
    """Every shown row's folded tokens (`rest_part`, left by `show(rest_text=False)`) as its `rest` text, made
    at once: without a decoder, the integer ids of all rows in one pass (`ids_texts`), else row by row."""
    waiting = [s for s in shown if s.rest_part is not None]
    fast = not decoder.active and all(isinstance(s.rest_part, torch.Tensor) and s.rest_part.dim() == 1
                                      and not s.rest_part.is_floating_point() and s.rest_part.dtype != torch.bool
                                      and not s.rest_part.is_complex() for s in waiting)
    if fast:
        for s, text in zip(waiting, ids_texts([s.rest_part for s in waiting])):
            s.rest = text
    else:
        for s in waiting:
            ids = _ids(s.rest_part)
            s.rest = None if ids is None else _joined(ids, decoder)
    for s in waiting:
        s.rest_part = None


_DIGITS = ((np.arange(10_000)[:, None] // np.array([1000, 100, 10, 1])) % 10 + ord("0")).astype(np.uint8)
_TENS = 10 ** np.arange(1, 8, dtype=np.int64)      # an id below 10 ** 8 has 1 + (how many of these it reaches) digits
_KEEP = np.array([[c >= 8 - d for c in range(8)] + [True] for d in range(9)])   # digits -> which of 8 chars, a space


def ids_texts(rows: Sequence[torch.Tensor]) -> List[str]:
    """Rows of integer ids, each as one text `1 22 333` (the list's own repr, brackets and commas dropped),
    made in one pass over all of them: each id as two four-digit chunks from a table, its leading zeros
    dropped by a mask (ids below 0 or from 10 ** 8 up: the list's repr)."""
    sizes = [int(r.numel()) for r in rows]
    if sum(sizes) == 0:
        return ["" for _ in rows]
    a = torch.cat([r.reshape(-1).to(torch.int64) for r in rows]).numpy()
    if int(a.min()) < 0 or int(a.max()) >= 10 ** 8:
        return [str(r.tolist())[1:-1].replace(",", "") for r in rows]
    high, low = np.divmod(a, 10_000)
    chars = np.empty((a.size, 9), dtype=np.uint8)
    chars[:, :4] = _DIGITS[high]
    chars[:, 4:8] = _DIGITS[low]
    chars[:, 8] = ord(" ")
    digits = 1 + np.searchsorted(_TENS, a, side="right")
    text = chars[_KEEP[digits]].tobytes().decode("ascii")          # every id followed by a space
    ends = np.cumsum(digits + 1)
    out, at, pos = [], 0, 0
    for n in sizes:
        if n == 0:
            out.append("")
            continue
        at += n
        end = int(ends[at - 1])
        out.append(text[pos:end - 1])
        pos = end
    return out


def _joined(ids: List[int], decoder: Decoder) -> str:
    """Folded tokens as one text: decoded when a decoder is active, else the ids."""
    text = decoder.text(ids) if decoder.active else None
    return text if text is not None else str(ids)[1:-1].replace(",", "")     # ints: the list's own repr, in C
