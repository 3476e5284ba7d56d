"""Shortcuts of `structure.encode` for what a GRPO mini-batch holds many of, on the trainer's thread
(issue 42): a NonTensorStack's values read straight from its elements, and plain values (chat messages,
tags: lists and str-keyed dicts of scalars) copied without the general walk's bookkeeping. Each returns a
marker (None, NOT_PLAIN) where it does not apply, and the general walk encodes the value as before."""
from __future__ import annotations

from typing import Any

from skip_harness.codec.payload_kinds import SCALARS, TAG, is_non_tensor_stack

NOT_PLAIN = object()
_PLAIN_DEPTH = 8
_JSON_SCALARS = (str, int, float, bool, type(None))


class PlainJSON:
    """A value of plain JSON (lists, str-keyed dicts without the TAG key, str, int, float, bool, None),
    kept by reference in an encoded structure that is written at once (`images.plan`, `images.save_to`):
    the file image stores it as one JSON text, dumped by the C encoder, instead of walking it node by
    node (a GRPO batch's chat messages and uids: thousands of nodes on the trainer's thread). Never in
    `structure.encode`'s output, which must stay picklable and independent of the payload."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def is_plain(obj: Any, depth: int = 0, checked: Any = None) -> bool:
    """Whether `obj` (a list or dict) is plain JSON as PlainJSON says, at most _PLAIN_DEPTH deep (a cycle
    included). `checked`: ids of containers already found plain (a group's chat prompt, repeated over
    its n samples, is checked once)."""
    if checked is not None and id(obj) in checked:
        return True
    t = type(obj)
    if t is list:
        for v in obj:
            if type(v) not in _JSON_SCALARS and (depth >= _PLAIN_DEPTH or not is_plain(v, depth + 1, checked)):
                return False
    elif t is dict and TAG not in obj:
        for k, v in obj.items():
            if type(k) is not str or (type(v) not in _JSON_SCALARS
                                      and (depth >= _PLAIN_DEPTH or not is_plain(v, depth + 1, checked))):
                return False
    else:
        return False
    if checked is not None:
        checked.add(id(obj))
    return True


def plain(obj: Any, depth: int = 0) -> Any:
    """The encoding of a list or dict holding only scalars, str-keyed dicts and lists (a chat message, a
    tag): new containers, built without the general walk's position strings and cycle bookkeeping (a
    GRPO batch holds thousands, encoded on the trainer's thread); NOT_PLAIN for anything else, deeper
    than _PLAIN_DEPTH (a cycle included), or a dict with the TAG key, for the general walk to encode."""
    t = type(obj)
    if t is list:
        out: Any = []
        for v in obj:
            if type(v) not in SCALARS:
                v = plain(v, depth + 1) if depth < _PLAIN_DEPTH else NOT_PLAIN
                if v is NOT_PLAIN:
                    return v
            out.append(v)
        return out
    if t is dict and TAG not in obj:
        out = {}
        for k, v in obj.items():
            if type(k) is not str:
                return NOT_PLAIN
            if type(v) not in SCALARS:
                v = plain(v, depth + 1) if depth < _PLAIN_DEPTH else NOT_PLAIN
                if v is NOT_PLAIN:
                    return v
            out[k] = v
        return out
    return NOT_PLAIN


def stack_values(obj: Any) -> Any:
    """`obj.tolist()` of a one-dimensional NonTensorStack of NonTensorData, read straight from each
    element's non-tensor fields (tensordict's `tolist` goes through its attribute machinery per element:
    about 1 ms for a 256-row GRPO batch's `uid` or `messages`); None when the stack is of another shape
    or an element keeps its value elsewhere, for `tolist` to do."""
    if len(obj.batch_size) != 1 or getattr(obj, "stack_dim", None) != 0:
        return None
    elements = getattr(obj, "tensordicts", None)
    if type(elements) is not list or len(elements) != obj.batch_size[0]:
        return None
    out = []
    element_types: set = set()   # types already found not to be stacks (the check is per type)
    for td in elements:
        fields = getattr(td, "__dict__", {}).get("_non_tensordict")
        if type(fields) is not dict or "data" not in fields:
            return None
        if type(td) not in element_types:
            if is_non_tensor_stack(td):
                return None
            element_types.add(type(td))
        out.append(fields["data"])
    return out


_PLAIN_DATA = (*SCALARS, list, dict, tuple)     # values NonTensorData keeps as they are (no tensor to move)


class NonTensorMaker:
    """`cls(data=value, batch_size=[], device=device)` for each row of a NonTensorStack being decoded:
    the first row by that constructor, the others as tensordict builds its own results (`_from_tensordict`
    on an empty TensorDict like the first row's, about a third of the constructor's time) -- for plain
    values only, and only while a row so built has the first row's state (else every row by the
    constructor)."""

    def __init__(self, cls: Any, device: Any):
        self.cls, self.device = cls, device
        self.proto: Any = None
        self.fast = False

    def __call__(self, value: Any) -> Any:
        if self.proto is None or not self.fast or type(value) not in _PLAIN_DATA:
            made = self.cls(data=value, batch_size=[], device=self.device)
            if self.proto is None:
                self.proto = made
                self.fast = type(value) in _PLAIN_DATA and self._same(self._fast(value), made)
            return made
        return self._fast(value)

    def _fast(self, value: Any) -> Any:
        state = self.proto.__dict__
        made = self.cls._from_tensordict(state["_tensordict"].empty(), non_tensordict=dict(state["_non_tensordict"], data=value),
                                         safe=False)
        made.__dict__.update((k, v) for k, v in state.items() if k not in ("_tensordict", "_non_tensordict"))
        return made

    @staticmethod
    def _same(a: Any, b: Any) -> bool:
        try:
            da, db = a.__dict__, b.__dict__
            return (type(a) is type(b) and da.keys() == db.keys() and da["_non_tensordict"] == db["_non_tensordict"]
                    and da["_tensordict"].batch_size == db["_tensordict"].batch_size
                    and da["_tensordict"].device == db["_tensordict"].device and not list(da["_tensordict"].keys())
                    and not list(db["_tensordict"].keys()))
        except Exception:  # a tensordict whose objects are made otherwise: the constructor it is
            return False
