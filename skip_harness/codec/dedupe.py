"""Each thing stored once: a file image's tensors that repeat or follow from others are stored as a rule
instead of their bytes -- found on the writer thread by comparing the bytes, never assumed from a field's
name -- and rebuilt bit for bit on a load.

A tensor *with rows* is a dense tensor of two or more dimensions (row i is `t[i]`, a sequence of
`shape[1]` units of `shape[2:]`), or the values of a jagged nested tensor (row i is
`values[offsets[i]:offsets[i + 1]]`, units of `values.shape[1:]`) whose rows tile its values. Such a
tensor may be stored as one of these rules, in its header entry's `how` (the entry then stores 0 bytes):

    fill  k                     every element is the one element of tensor k
    ramp  s                     every row is 0, 1, ..., its length - 1 (integers, one element a unit)
    rows  [k, s, src]           row i is row src[i] (src[i] <= i; adjacent repeats, as the samples of a GRPO
                                group share their prompt); the rows with src[i] == i are tensor k, in order
    cat   [a, sa, b, sb, s]     row i is row i of tensor a, then row i of tensor b (a batch's `input_ids`
                                as its prompt and its response)

and a float tensor of the same shape and dtype as an earlier one whose values mostly agree with it in
their sign, exponent and first mantissa bits (the trainer's log-probs beside the generator's) as

    xor   [k, a]                its bits are tensor k's XOR tensor a's (k: mostly zero high bytes)

`s`, `sa`, `sb`: the index of the tensor holding the rows' offsets (the jagged tensor's own), -1 for a
dense tensor. Tensors k are extra entries after those the tree names, stored like any tensor (narrowed,
compressed); a `cat`'s sources are never `cat`s. Every comparison is of the bytes (integer views), so
-0.0, NaN payloads and the like come back as they were written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from skip_harness.codec.payload_kinds import np
from skip_harness.errors import CodecError

RULES = ("fill", "ramp", "rows", "cat", "xor")
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_XOR_SHARE = 0.5                  # xor when at least this share of elements agree in their top 12 bits
MIN_BYTES = 4096                  # smaller tensors are stored as they are (a rule's header costs more)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_RAMP_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_JAGGED = "jagged"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its width: equal exactly when the bytes are."""
    return t if t.dtype in _RAMP_DTYPES and t.dtype != torch.uint8 else t.view(_INT_OF_SIZE[t.element_size()])


def _eligible(t: torch.Tensor) -> bool:
    return (t.element_size() in _INT_OF_SIZE and not t.is_complex() and t.numel() > 0
            and t.numel() * t.element_size() >= MIN_BYTES)


@dataclass
class _Rows:
    """A tensor cut into rows, all NumPy: `flat` [units, inner] (the tensor's bits, a view of its memory)
    and each row's first unit and length. NumPy, as every pass here: a torch call lets go of the GIL and
    takes it back, and each time the trainer's thread holds it then, the writer waits for it -- a plan of
    torch calls on a handful of small tensors handed the GIL back and forth about 230 times a GRPO step
    (issue 42); NumPy keeps it for small arrays and lets go only for a long pass."""

    flat: Any                     # NumPy [units, inner], the bits' integer dtype
    starts: Any                   # NumPy int64 [n]
    lengths: Any                  # NumPy int64 [n]
    by: int                       # the offsets tensor's index, -1 when dense

    @property
    def n(self) -> int:
        return int(self.lengths.size)


def _tiled(starts: Any, lengths: Any, units: int) -> bool:
    if starts.size == 0 or bool((lengths < 0).any()):
        return False
    ends = starts + lengths
    return int(starts[0]) == 0 and bool(np.array_equal(starts[1:], ends[:-1])) and int(ends[-1]) == units


def _rows_of(t: torch.Tensor, offsets: Optional[torch.Tensor], by: int) -> Optional[_Rows]:
    shape = tuple(t.shape)
    if offsets is None:                           # dense: rows along dim 0
        if len(shape) < 2 or shape[0] < 2:
            return None
        n, length = shape[0], shape[1]
        starts = np.arange(n, dtype=np.int64) * length
        return _Rows(_np(t).reshape(n * length, math.prod(shape[2:])), starts, np.full(n, length, dtype=np.int64), -1)
    if offsets.dim() != 1 or offsets.shape[0] < 3 or len(shape) < 1 or offsets.dtype not in _RAMP_DTYPES:
        return None
    off = _np(offsets).astype(np.int64, copy=False)
    starts, lengths = off[:-1], off[1:] - off[:-1]
    if not _tiled(starts, lengths, shape[0]):
        return None
    return _Rows(_np(t).reshape(shape[0], math.prod(shape[1:])), starts, lengths, by)


def _positions(starts: Any, lengths: Any, skip: Any = None) -> Any:
    """The units of every row in order (NumPy int64), each row's taken from `starts` (+ `skip` units into it)."""
    first = starts if skip is None else starts + skip
    row_start_in_out = np.cumsum(lengths) - lengths
    return np.repeat(first - row_start_in_out, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def jagged_values(tree: Any) -> Dict[int, int]:
    """values tensor index -> its offsets tensor index, for every jagged nested tensor in a packed tree
    whose rows are plain (no lengths, ragged along dim 1)."""
    out: Dict[int, int] = {}

    def visit(node: Any) -> None:
        if type(node) is list:
            for v in node:
                visit(v)
        elif type(node) is dict and len(node) == 1:
            ((kind, v),) = node.items()
            if kind in ("d", "o") and type(v) is list:
                pairs = {p[0]: p[1] for p in v if type(p) is list and len(p) == 2}
                if pairs.get("__skip_harness__") == _JAGGED:
                    values, offsets = pairs.get("values"), pairs.get("offsets")
                    if (pairs.get("lengths") is None and pairs.get("ragged_idx") == 1 and type(values) is dict
                            and type(offsets) is dict and "T" in values and "T" in offsets):
                        out[values["T"]] = offsets["T"]
                    return
                for p in v:
                    if type(p) is list and len(p) == 2:
                        visit(p[1])
            elif kind in ("t", "c") and type(v) is list:
                visit(v)

    visit(tree)
    return out


@dataclass(frozen=True)
class Plan:
    """The rules for a file image's tensors: `how[i]` is tensor i's rule (merged into its header entry's
    `how`; it stores no bytes), `extras` the tensors the rules store, appended after the image's own."""

    how: Dict[int, Dict[str, Any]]
    extras: List[torch.Tensor]
    extra_names: List[Optional[str]]


def plan(tree: Any, tensors: Sequence[torch.Tensor], names: Sequence[Optional[str]]) -> Plan:
    """Which of `tensors` (the staged, contiguous tensors of an image whose packed tree is `tree`) are
    stored as a rule. Every rule is checked on the bytes before it is chosen."""
    jagged = jagged_values(tree)
    count = len(tensors)
    rows: Dict[int, _Rows] = {}
    for i, t in enumerate(tensors):
        if not _eligible(t):
            continue
        by = jagged.get(i)
        r = _rows_of(t, tensors[by] if by is not None and by < count else None, -1 if by is None else by)
        if r is not None:
            rows[i] = r
    how: Dict[int, Dict[str, Any]] = {}
    extras: List[torch.Tensor] = []
    extra_names: List[Optional[str]] = []

    def extra(t: torch.Tensor, name: Optional[str], what: str) -> int:
        extras.append(t)
        extra_names.append(None if name is None else f"{name} ({what})")
        return count + len(extras) - 1

    for i, r in rows.items():                      # fill and ramp: nothing but a value or the lengths
        t, flat = tensors[i], r.flat.reshape(-1)
        if bool((_sampled(flat) == flat[0]).all()) and bool((flat == flat[0]).all()):
            how[i] = {"fill": extra(t.reshape(-1)[:1].clone(), names[i], "value")}
        elif r.flat.shape[1] == 1 and t.dtype in _RAMP_DTYPES and _is_ramp(flat, r):
            how[i] = {"ramp": r.by}
    sources: set = set()                           # a cat's sources are never cats
    for i, r in rows.items():                      # cat: a row of i is a row of a then a row of b
        if i in how or i in sources:
            continue
        found = _find_cat(i, r, rows, tensors, how)
        if found is not None:
            how[i] = {"cat": found}
            sources.update((found[0], found[2]))
    for i, r in rows.items():                      # rows: adjacent repeats stored once
        if i in how:
            continue
        src = _repeats(r)
        if src is not None:
            keep = np.array([s == j for j, s in enumerate(src)])
            unique = r.flat[_positions(r.starts[keep], r.lengths[keep])]
            unique_t = torch.from_numpy(unique).view(tensors[i].dtype)
            how[i] = {"rows": [extra(unique_t.reshape(-1, *tensors[i].shape[2 if r.by < 0 else 1:]), names[i],
                                     "unique rows"), r.by, src]}
    floats = [i for i, t in enumerate(tensors) if t.dtype in _FLOATS and _eligible(t)]
    for pos, i in enumerate(floats):               # xor: close to an earlier float tensor of its shape
        if i in how:
            continue
        for a in floats[:pos]:
            t, ta = tensors[i], tensors[a]
            if a in how or ta.dtype != t.dtype or ta.shape != t.shape:
                continue
            high = 8 * t.element_size() - 12
            look = np.bitwise_xor(_sampled(_np(t).reshape(-1), 4096), _sampled(_np(ta).reshape(-1), 4096))
            if float(np.mean(look >> high == 0)) >= _XOR_SHARE:              # decided on a sample
                delta = torch.from_numpy(np.bitwise_xor(_np(t), _np(ta))).view(t.dtype)
                how[i] = {"xor": [extra(delta, names[i], f"xor {names[a] or a}"), a]}
                break
    return Plan(how, extras, extra_names)


def _sampled(flat: Any, count: int = 1024) -> Any:
    """About `count` elements spread over `flat`: a cheap look before a full pass."""
    return flat[::max(1, flat.size // count)]


def _is_ramp(flat: Any, r: _Rows) -> bool:
    starts, lengths = r.starts, r.lengths
    nonempty = lengths > 0
    firsts, lasts = flat[starts[nonempty]], flat[(starts + lengths - 1)[nonempty]]
    if bool((firsts != 0).any()) or not np.array_equal(lasts.astype(np.int64), (lengths - 1)[nonempty]):
        return False                              # each row's ends say no: no full pass
    # then every step within a row is +1 (wrapping; the rows' last values above rule a wrap out): one
    # NumPy pass, no per-element index of the whole tensor
    steps = np.subtract(flat[1:], flat[:-1]) == 1
    steps[starts[(starts > 0) & (starts < flat.size)] - 1] = True   # a row's first value (0) was checked
    return bool(steps.all())


def _find_cat(i: int, r: _Rows, rows: Dict[int, _Rows], tensors: Sequence[torch.Tensor],
              how: Dict[int, Dict[str, Any]]) -> Optional[List[int]]:
    t = tensors[i]
    for a, ra in rows.items():
        if a == i or ra.n != r.n or tensors[a].dtype != t.dtype or ra.flat.shape[1] != r.flat.shape[1] \
                or "cat" in how.get(a, {}) or int(ra.lengths.sum()) == 0:
            continue
        rest = r.lengths - ra.lengths
        if bool((rest <= 0).any()):
            continue
        for b, rb in rows.items():
            if b in (a, i) or rb.n != r.n or tensors[b].dtype != t.dtype or rb.flat.shape[1] != r.flat.shape[1] \
                    or "cat" in how.get(b, {}) or not np.array_equal(rb.lengths, rest):
                continue
            if _is_cat(r.flat, ra.flat, rb.flat, ra.lengths, rb.lengths):
                return [a, ra.by, b, rb.by, r.by]
    return None


def _is_cat(bits: Any, abits: Any, bbits: Any, la: Any, lb: Any) -> bool:
    """Whether the rows of `bits` (which tile it, row i of la[i] + lb[i] units) are each a row of `abits`
    then a row of `bbits` (which tile theirs, in order): the units of each part picked by one mask a byte
    a unit (an index of every unit, eight bytes each, cost twice the time; issue 42)."""
    if bits.shape[0] != abits.shape[0] + bbits.shape[0]:
        return False
    first = np.repeat(np.tile(np.array([True, False]), la.size), np.column_stack([la, lb]).reshape(-1))
    if bits.shape[1] != 1:                        # a mask of elements (NumPy's 2-D boolean pick is slow)
        first = np.repeat(first, bits.shape[1])
    flat = bits.reshape(-1)
    return bool(np.array_equal(flat[first], abits.reshape(-1)) and np.array_equal(flat[~first], bbits.reshape(-1)))


_SUM_CHUNK = 1 << 20        # units widened at a time by _row_sums


def _row_sums(bits: Any, starts: Any, lengths: Any) -> Any:
    """Each row's sum of its elements as integers (wrapping: only ever compared for equality). Four- and
    eight-byte units are summed row by row in their own width (`add.reduceat`: one read of the tensor, no
    array of its size written); narrower ones, whose wrapping sums would say little, are widened by a cast
    of their own a chunk at a time and summed cumulatively. Every pass lets go of the GIL: a reduction or
    cumsum that casts as it goes (`dtype=` of another width), or a cumsum in place, holds it for its whole
    pass, several times slower, and the trainer's thread waits on it: 5 ms of a dense step's writer job,
    measured with `py-spy --gil` (issue 42)."""
    flat = bits.reshape(-1)
    inner = bits.shape[1]
    if flat.dtype.itemsize >= 4:
        sums = np.zeros(len(lengths), dtype=flat.dtype)
        full = lengths > 0                          # each non-empty row ends where the next non-empty one begins
        if full.any():
            at = starts[full] * inner
            end = int((starts[full][-1] + lengths[full][-1]) * inner)
            cut = np.append(at, end) if end < flat.size else at       # the last one's end, unless the tensor's
            sums[full] = np.add.reduceat(flat, cut, dtype=flat.dtype)[:len(at)]
        return sums
    cs = np.empty(flat.size, dtype=np.int64)
    wide = np.empty(min(flat.size, _SUM_CHUNK), dtype=np.int64)
    for a in range(0, flat.size, _SUM_CHUNK):      # (an in-place cumsum holds the GIL too)
        part = cs[a:a + _SUM_CHUNK]
        np.copyto(wide[:part.size], flat[a:a + part.size], casting="unsafe")
        if a:
            np.add(wide[:1], cs[a - 1:a], out=wide[:1])       # the sum so far, carried in (wrapping)
        np.cumsum(wide[:part.size], out=part)
    ends = (starts + lengths) * inner - 1
    before = starts * inner - 1
    total = np.where(lengths > 0, cs[ends.clip(min=0)], 0)
    return total - np.where(before >= 0, cs[before.clip(min=0)], 0)


_ROW_SAMPLES = 32            # elements of a row _agree_at_samples compares with its predecessor's


def _agree_at_samples(bits: Any, starts: Any, lengths: Any, rows: Any) -> Any:
    """For each of `rows` (whose predecessor has its length and ends where it starts), whether the two
    agree at _ROW_SAMPLES elements spread evenly over the row, its first and last included. Equal rows
    always do; the look reads a few elements of each row, not the rows (a dense batch's rows, none of them
    repeated, once cost a full row-sum pass: 17 of the 23 ms its plan took, issue 42)."""
    inner = bits.shape[1]
    flat = bits.reshape(-1)
    n = lengths[rows] * inner                       # each row's elements
    k = np.arange(_ROW_SAMPLES, dtype=np.int64)
    at = starts[rows][:, None] * inner + (np.maximum(n, 1)[:, None] - 1) * k // (_ROW_SAMPLES - 1)
    before = at - n[:, None]                        # the same elements of the predecessor
    empty = n == 0                                  # nothing to look at: element 0 against itself
    at[empty], before[empty] = 0, 0
    return (flat[at] == flat[before]).all(axis=1)


def _repeats(r: _Rows) -> Optional[List[int]]:
    """src[i] for a tensor whose rows repeat their predecessor's, None when none does (or too little)."""
    bits, starts_a, lengths_a = r.flat, r.starts, r.lengths
    # a row can only repeat its predecessor when their lengths and first units agree (one vectorised pass)
    head = bits[starts_a.clip(max=max(0, bits.shape[0] - 1))]
    maybe = (lengths_a[1:] == lengths_a[:-1]) & ((head[1:] == head[:-1]).all(axis=1) | (lengths_a[1:] == 0))
    if not maybe.any():
        return None
    # ... and a few elements spread over the row, first and last among them: rows that start alike (a
    # left-padded prompt's padding) mostly differ there, and this look costs no pass over the tensor
    maybe[maybe] = _agree_at_samples(bits, starts_a, lengths_a, np.flatnonzero(maybe) + 1)
    if not maybe.any():
        return None
    # ... and their sums (one vectorised pass): rows that start alike (a mask's zeros) rarely add up alike
    sums = _row_sums(bits, starts_a, lengths_a)
    maybe &= sums[1:] == sums[:-1]
    if not maybe.any():
        return None
    # ... and their bytes: every unit of a candidate row against its predecessor's (the rows tile, so the
    # predecessor of equal length ends where it starts), all candidates in one NumPy pass
    same = np.zeros(r.n, dtype=bool)
    same[1:] = maybe
    cand = np.flatnonzero(same & (lengths_a > 0))
    if cand.size:
        here = _positions(starts_a[cand], lengths_a[cand])
        differs = (bits[here] != bits[here - np.repeat(lengths_a[cand], lengths_a[cand])]).any(axis=1)
        firsts = np.cumsum(lengths_a[cand]) - lengths_a[cand]
        same[cand] = ~np.logical_or.reduceat(differs, firsts)
    src = np.maximum.accumulate(np.where(same, 0, np.arange(r.n))).tolist()
    saved = int(lengths_a[same].sum())
    saved_bytes = saved * r.flat.shape[1] * r.flat.itemsize
    return src if saved_bytes >= MIN_BYTES and saved_bytes > 8 * r.n else None


# --------------------------------------------------------------------------------------------
# reading: the header's rules checked, then the tensors rebuilt


def rule_of(how: Any) -> Optional[str]:
    if type(how) is not dict:
        return None
    found = [k for k in RULES if k in how]
    return found[0] if len(found) == 1 else (None if not found else "many")


def check_header(entries: List[list]) -> None:
    """CodecError unless every rule in a parsed header's tensor entries is well formed (indices, kinds,
    dtypes and shapes; what depends on tensor data is checked while rebuilding)."""
    rules = [rule_of(e[4] if len(e) > 4 else None) for e in entries]
    n = len(entries)

    def plain(k: Any) -> bool:
        return type(k) is int and 0 <= k < n and rules[k] is None

    def offsets_ok(s: Any, entry: list) -> bool:
        if s == -1:
            return len(entry[1]) >= 2
        return plain(s) and len(entries[s][1]) == 1 and entries[s][1][0] >= 1 and len(entry[1]) >= 1

    for i, (entry, rule) in enumerate(zip(entries, rules)):
        if rule is None:
            continue
        how = entry[4]
        bad = rule == "many" or entry[3] != 0 or "as" in how or "zstd" in how
        if not bad and rule == "fill":
            k = how["fill"]
            bad = not plain(k) or entries[k][0] != entry[0] or math.prod(entries[k][1]) != 1
        elif not bad and rule == "ramp":
            bad = entry[0] not in ("uint8", "int8", "int16", "int32", "int64") or not offsets_ok(how["ramp"], entry) \
                or len(entry[1]) != (2 if how["ramp"] == -1 else 1)
        elif not bad and rule == "rows":
            v = how["rows"]
            bad = type(v) is not list or len(v) != 3 or not plain(v[0]) or entries[v[0]][0] != entry[0] \
                or not offsets_ok(v[1], entry) or not _src_ok(v[2], _row_count(entries, entry, v[1])) \
                or entries[v[0]][1][1:] != entry[1][2 if v[1] == -1 else 1:]
        elif not bad and rule == "xor":
            v = how["xor"]
            bad = type(v) is not list or len(v) != 2 or not plain(v[0]) or not plain(v[1]) or v[0] == v[1] \
                or any(entries[k][0] != entry[0] or entries[k][1] != entry[1] for k in v) \
                or entry[0] not in ("float16", "bfloat16", "float32", "float64")
        elif not bad and rule == "cat":
            v = how["cat"]
            bad = type(v) is not list or len(v) != 5 or not offsets_ok(v[4], entry) or any(
                type(src) is not int or not 0 <= src < n or src == i or rules[src] == "cat"
                or entries[src][0] != entry[0] or not offsets_ok(by, entries[src])
                for src, by in ((v[0], v[1]), (v[2], v[3])))
        if bad:
            raise CodecError(f"malformed tensor entry {str(entry)[:120]}")


def _row_count(entries: List[list], entry: list, by: Any) -> int:
    return entry[1][0] if by == -1 else entries[by][1][0] - 1


def _src_ok(src: Any, n: int) -> bool:
    if type(src) is not list or len(src) != n or n < 1:
        return False
    for j, s in enumerate(src):
        if type(s) is not int or not 0 <= s <= j or src[s] != s:
            return False
    return True


def rebuild(deferred: List[Tuple[int, Dict[str, Any], torch.Tensor]], tensors: List[torch.Tensor],
            names: Sequence[str]) -> None:
    """Fill each deferred (index, how, full-width target) tensor from the decoded `tensors` (which hold the
    targets at their indices): every other rule first, then `cat`s (whose sources may be rules)."""
    ordered = sorted(deferred, key=lambda d: rule_of(d[1]) == "cat")
    for i, how, target in ordered:
        try:
            _rebuild_one(i, how, target, tensors)
        except (RuntimeError, IndexError, KeyError, ValueError, TypeError) as exc:
            raise CodecError(f"{names[i]}: cannot be rebuilt from its rule ({str(exc)[:160]})") from None


def _stored_rows(t: torch.Tensor, by: int, tensors: List[torch.Tensor], name: str) -> _Rows:
    r = _rows_of(t, None if by == -1 else tensors[by], by)
    if r is None:
        raise CodecError(f"{name}: its offsets do not cut it into rows")
    return r


def _np(t: torch.Tensor) -> Any:
    """`t`'s bits as a NumPy array (a view): NumPy's passes run on this thread alone, where torch's would fan
    out over the intra-op threads the trainer's own computation uses (the writer thread plans)."""
    return _bits(t.detach()).numpy()


def _rebuild_one(i: int, how: Dict[str, Any], target: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    """Rows are copied slice by slice through NumPy (a memcpy each, on this thread): for the few hundred to
    few thousand rows of a mini-batch that beats building index tensors of every element."""
    name = how.get("name") or f"tensor {i}"
    if "xor" in how:
        k, a = how["xor"]
        np.bitwise_xor(_np(tensors[k]), _np(tensors[a]), out=_np(target))
        return
    if "fill" in how:
        _bits(target).fill_(int(_bits(tensors[how["fill"]]).reshape(-1)[0]))
        return
    if "ramp" in how:
        r = _stored_rows(target, how["ramp"], tensors, name)
        out = _np(target).reshape(-1)
        ramp = np.arange(int(r.lengths.max()), dtype=out.dtype)
        for s, n in zip(r.starts.tolist(), r.lengths.tolist()):
            out[s:s + n] = ramp[:n]
        return
    r = _stored_rows(target, how["rows"][1] if "rows" in how else how["cat"][4], tensors, name)
    out = r.flat
    starts, lengths = r.starts.tolist(), r.lengths.tolist()
    if "rows" in how:
        k, _by, src = how["rows"]
        unique = _np(tensors[k]).reshape(-1, out.shape[1])
        placed: List[int] = []                     # where each row's units start in `unique`
        pos = 0
        for j, s in enumerate(src):
            if s == j:
                placed.append(pos)
                pos += lengths[j]
            else:
                if lengths[j] != lengths[s]:
                    raise CodecError(f"{name}: a repeated row's length differs from its source's")
                placed.append(placed[s])
        if pos != unique.shape[0]:
            raise CodecError(f"{name}: its unique rows do not hold its rows")
        for s, n, p in zip(starts, lengths, placed):
            out[s:s + n] = unique[p:p + n]
        return
    a, by_a, b, by_b, _by = how["cat"]
    ra = _stored_rows(tensors[a], by_a, tensors, name)
    rb = _stored_rows(tensors[b], by_b, tensors, name)
    if ra.n != r.n or rb.n != r.n or not np.array_equal(ra.lengths + rb.lengths, r.lengths) \
            or ra.flat.shape[1] != out.shape[1] or rb.flat.shape[1] != out.shape[1]:
        raise CodecError(f"{name}: its two parts' rows do not make its rows")
    fa, fb = ra.flat, rb.flat
    if by_a == -1 and by_b == -1 and _by == -1:                  # dense: two slices along dim 1
        la = int(ra.lengths[0])
        view = out.reshape(r.n, -1, out.shape[1])
        view[:, :la] = fa.reshape(r.n, la, -1)
        view[:, la:] = fb.reshape(r.n, -1, out.shape[1])
        return
    for s, sa, na, sb, nb in zip(starts, ra.starts.tolist(), ra.lengths.tolist(), rb.starts.tolist(),
                                 rb.lengths.tolist()):
        out[s:s + na] = fa[sa:sa + na]
        out[s + na:s + na + nb] = fb[sb:sb + nb]
