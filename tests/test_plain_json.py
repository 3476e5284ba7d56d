"""codec: plain values (chat messages, tags, uids) stored as `j` nodes -- one JSON text each, dumped by
the C encoder on the trainer's thread instead of walked node by node (issue 42's miss; format 5) -- load
back exactly, what is not plain JSON is walked as before, and format-4 files still load."""
from __future__ import annotations

import ctypes
import io
import json
import math
import struct

import pytest
import torch

from skip_harness import codec
from skip_harness.codec import fastwalk, structure

tensordict = pytest.importorskip("tensordict")


def image(payload) -> bytes:
    buf = io.BytesIO()
    codec.save_to(buf, payload)
    return buf.getvalue()


def header(data: bytes) -> str:
    hlen = struct.unpack_from("<Q", data, 16)[0]
    return data[24:24 + hlen].decode("ascii")


def load(data: bytes):
    return codec.load_buffer(bytearray(data), len(data), "p.pt")


def same(a, b) -> bool:
    """Equal, with the same types all the way down (1 is not 1.0 nor True; -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (a != a and b != b))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


PLAIN = {
    "chat": [{"role": "user", "content": "caf\u00e9 \u2603 \U0001f600"}, {"role": "system", "content": None}],
    "odd strings": ['{"j":0}', '{"j":1}', "\ud800", "\"quoted\"", "\\", ""],
    "numbers": [0, -1, 2 ** 80, 0.1, -0.0, 1e308, True, False],
    "user dicts like nodes": [{"j": 0}, {"j": [1, 2]}, {"T": 0}, {"d": []}],
    "deep": [[[[[[[["eight"]]]]]]]],
    "empty": [[], {}],
}


def test_plain_values_are_json_text_in_the_header_and_load_back_exactly():
    payload = {"x": torch.arange(6), "meta": PLAIN}
    data = image(payload)
    text = header(data)
    assert '{"j":' in text and '"d":[["role"' not in text           # stored as JSON text, not node by node
    assert json.loads(text)["format"] == codec.FORMAT_VERSION == 5
    out = load(data)
    assert same(out, payload)


def test_a_stacks_rows_are_one_j_node_and_come_back_as_separate_objects():
    chat = [{"role": "user", "content": "q"}]
    td = tensordict.TensorDict({"x": torch.arange(4), "messages": tensordict.NonTensorStack(*[chat] * 4),
                                "uid": tensordict.NonTensorStack(*"aabb")}, batch_size=[4])
    data = image(td)
    assert header(data).count('["items",{"j":') == 2
    out = load(data)
    rows = out.get("messages").tolist()
    assert rows == [chat] * 4 and out.get("uid").tolist() == list("aabb")
    rows[0][0]["content"] = "changed"
    assert out.get("messages").tolist()[1][0]["content"] == "q"


@pytest.mark.parametrize("value", [
    [1.0, float("nan")], [float("inf")], {"t": (1, 2)}, {1: "int key"}, {structure.TAG: "x"},
    [b"bytes"], [1 + 2j], [[[[[[[[[["ten deep"]]]]]]]]]], [torch.ones(2)],
])
def test_what_is_not_plain_json_is_walked_as_before_and_loads_back_exactly(value):
    payload = {"v": value}
    out = load(image(payload))
    assert same(out, payload), out


def test_not_finite_floats_fall_back_to_their_nodes():
    text = header(image({"v": [1.0, float("-inf")]}))
    assert '{"f":"-inf"}' in text and '{"j":' not in text


def test_is_plain_says_what_the_header_may_hold_as_it_is():
    assert fastwalk.is_plain([{"a": [1, "b", None, 2.5, True]}])
    for value in ({1: "a"}, {structure.TAG: 1}, [(1,)], [b"x"], [1j], [torch.zeros(1)], "a str", (1, 2)):
        assert not fastwalk.is_plain(value), value
    cyclic: list = []
    cyclic.append(cyclic)
    assert not fastwalk.is_plain(cyclic)
    shared = {"k": "v"}
    checked: set = set()
    assert fastwalk.is_plain([shared, shared], 0, checked) and id(shared) in checked


def test_encode_stays_free_of_references_to_the_payload():
    chat = [{"role": "user", "content": "q"}]
    encoded = structure.encode({"chat": chat})
    assert encoded["chat"] == chat and encoded["chat"] is not chat
    assert not any(isinstance(v, fastwalk.PlainJSON) for v in encoded.values())


def test_a_format_4_file_without_j_nodes_still_loads():
    """A format-4 writer stored plain values node by node: the same header with the `j` node written out
    (padded to the same length: JSON allows trailing spaces), and version 4, loads the same payload."""
    payload = {"x": torch.arange(3.0), "tags": ["a", "b"]}
    data = bytearray(image(payload))
    hlen = struct.unpack_from("<Q", data, 16)[0]
    text = header(bytes(data))
    old = text.replace('{"j":["a","b"]}', '["a","b"]').replace('"format":5', '"format":4')
    assert old != text
    data[24:24 + hlen] = old.ljust(hlen).encode("ascii")
    struct.pack_into("<I", data, 8, 4)
    assert same(load(bytes(data)), payload)


# ---- a compressed write's header, laid out on the writer thread (issue 42's miss)

def _stored_bytes(image, tensors, form):
    from skip_harness.codec import tensorfile
    stored = tensorfile.stored_image(image, tensors, form)
    out = ctypes.create_string_buffer(stored.nbytes)
    tensorfile.fill_stored(stored, out)
    return out.raw, stored.logical_nbytes


NOT_FINITE = {"rewards": [1.0, float("nan"), float("-inf")], "chat": [{"role": "user", "content": "q"}]}


@pytest.mark.parametrize("value", [PLAIN, NOT_FINITE], ids=["plain", "not finite"])
def test_a_staged_image_becomes_on_the_writer_thread_the_file_planned_whole(value):
    """plan(staged=True) -- the trainer's half of a compressed write -- lays out no header and dumps no
    JSON; laid out later (stored_image, on the writer thread) it is byte for byte the file `plan` makes
    of the whole, full-width size included, a value that needs its nodes (not finite) too."""
    from skip_harness.codec import tensorfile
    chat = [{"role": "user", "content": "q \u2603"}]
    td = tensordict.TensorDict({"ids": torch.arange(12).reshape(4, 3), "messages": tensordict.NonTensorStack(*[chat] * 4),
                                "uid": tensordict.NonTensorStack(*"aabb")}, batch_size=[4])
    payload = {"v": value, "td": td, "lp": torch.randn(7)}      # v first: a value unfolded shifts no other
    form = codec.stored_form("zstd")
    encoded, names = structure.encode_named(payload)
    whole = tensorfile.plan(encoded, names)
    expected, full = _stored_bytes(whole, [t.contiguous() for t in whole.tensors], form)
    assert full == whole.nbytes

    staged = tensorfile.plan(encoded, names, staged=True)
    assert staged.head == b"" and staged.offsets[0] == 0 and staged.nbytes < whole.nbytes
    buf = ctypes.create_string_buffer(staged.nbytes)
    tensorfile.pack_into(staged, buf, ctypes.memmove)
    shapes = tensorfile.shapes_only(staged)
    assert _stored_bytes(shapes, tensorfile.staged_tensors(shapes, buf), form) == (expected, whole.nbytes)
    out = load(expected)
    assert same(out["v"], value) and torch.equal(out["lp"], payload["lp"])
    assert out["td"].get("messages").tolist() == [chat] * 4 and torch.equal(out["td"]["ids"], td["ids"])


def test_the_trainers_half_of_a_compressed_write_dumps_no_json(monkeypatch):
    from skip_harness.codec import fileimage, tensorfile

    def no_json(value):
        raise AssertionError("JSON dumped on the trainer's thread")

    encoded, names = structure.encode_named({"x": torch.arange(3), "chat": [{"role": "user", "content": "q"}]})
    monkeypatch.setattr(fileimage, "_json_text", no_json)
    staged = tensorfile.plan(encoded, names, staged=True)
    assert isinstance(staged.raws[0], bytes)                       # a snapshot of the chat, not its text
    with pytest.raises(AssertionError, match="trainer's thread"):
        tensorfile.plan(encoded, names)
    with pytest.raises(AssertionError, match="trainer's thread"):
        tensorfile.laid_out(staged)                                 # the writer's half does


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_rows_changed_after_a_staged_write_are_stored_as_they_were(tmp_path, compression):
    """The trainer may change a plain value in place once sample returns: what is stored is the value as
    it was, for the form whose JSON is dumped on the writer thread (zstd) as for the one whose is not."""
    from skip_harness.store.layout import Layout
    from skip_harness.store.open import open_store

    store = open_store(Layout(tmp_path / "ns", K=1, W=1), form=codec.stored_form(compression))

    def batch(content: str, scores: list):
        chat = [{"role": "user", "content": content}]
        td = tensordict.TensorDict({"x": torch.arange(2), "messages": tensordict.NonTensorStack(chat, chat)}, batch_size=[2])
        return {"td": td, "tags": {"kind": "math", "scores": scores}}, chat

    payload, chat = batch("as sampled", [1, 2])
    staged = store.writer.stage_inner(1, 0, 0, payload, {})
    chat[0]["content"] = "changed by the trainer"
    payload["tags"]["scores"].append(3)
    store.writer.commit(1, staged.complete(), None)
    out = store.reader.read_inner(1, 0, 0)
    assert out["td"].get("messages").tolist() == [[{"role": "user", "content": "as sampled"}]] * 2
    assert out["tags"] == {"kind": "math", "scores": [1, 2]}
    meta = store.reader.read_meta(1, 0, 0)                         # the full-width file's size, as planned whole
    assert meta["logical_bytes"] == codec.plan(batch("as sampled", [1, 2])[0]).nbytes
