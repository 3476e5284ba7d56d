"""codec: the trainer-thread encoding of a GRPO batch's non-tensor stacks and jagged fields (issue 42's
miss): read straight from the stack, each shared object encoded once, nested tensors detached only when
they need it -- and every batch still round-trips exactly."""
from __future__ import annotations

import pytest
import torch

from skip_harness import codec
from skip_harness.codec import fastwalk, structure
from skip_harness.store import payload_file

tensordict = pytest.importorskip("tensordict")


def roundtrip(payload, tmp_path):
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, payload)
    payload_file.check(path)
    return payload_file.load(path, mmap=False)


def _grpo_like(groups: int = 3, n: int = 4):
    """Rows as verl's list_of_dict_to_tensordict leaves them: a group's chat prompt is one object in n rows."""
    messages, uids = [], []
    for g in range(groups):
        chat = [{"role": "user", "content": f"question {g}"}, {"role": "system", "content": None}]
        messages += [chat] * n
        uids += [f"uid-{g}"] * n
    return tensordict.TensorDict({"x": torch.arange(groups * n),
                                  "messages": tensordict.NonTensorStack(*messages),
                                  "uid": tensordict.NonTensorStack(*uids)}, batch_size=[groups * n])


def test_a_one_dimensional_stack_is_read_as_tolist_reads_it():
    td = _grpo_like()
    for key in ("messages", "uid"):
        stack = td.get(key)
        assert fastwalk.stack_values(stack) == stack.tolist(), key
    pairs = tensordict.NonTensorStack(*[tensordict.NonTensorData([i, i + 1]) for i in range(3)])
    assert fastwalk.stack_values(pairs) == pairs.tolist() == [[0, 1], [1, 2], [2, 3]]
    grid = tensordict.NonTensorStack.from_list([["p", "q"], ["r", "s"]])
    assert fastwalk.stack_values(grid) is None            # two dimensions: tolist's to do


def test_rows_sharing_one_object_are_encoded_once_and_round_trip_exactly(tmp_path):
    td = _grpo_like()
    encoded = structure.encode(td)
    items = encoded["values"][encoded["keys"].index("messages")]["items"]
    assert items[0] is items[3] and items[0] is not items[4]      # one encoding a group
    assert items[0] is not td.get("messages").tolist()[0]         # never the trainer's own object
    out = roundtrip(td, tmp_path)
    assert out.get("messages").tolist() == td.get("messages").tolist()
    assert out.get("uid").tolist() == td.get("uid").tolist()
    rows = out.get("messages").tolist()
    rows[0][0]["content"] = "changed"                               # rows served are separate objects
    assert rows[1][0]["content"] == "question 0"


def test_a_shared_object_holding_a_tensor_is_encoded_in_each_row(tmp_path):
    shared = {"ids": torch.arange(3)}
    stack = tensordict.NonTensorStack(*[shared, shared])
    encoded, names = structure.encode_named({"s": stack})
    items = encoded["s"]["items"]
    assert items[0] is not items[1] and len(names) == 2           # each row's tensor named where it is
    out = roundtrip({"s": stack}, tmp_path)["s"].tolist()
    assert all(torch.equal(row["ids"], torch.arange(3)) for row in out)


def test_a_jagged_tensor_that_needs_grad_is_stored_detached_and_exact(tmp_path):
    rows = [torch.randn(n, requires_grad=True) for n in (2, 5, 3)]
    nt = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    assert nt.requires_grad
    encoded = structure.encode({"lp": nt})
    assert not encoded["lp"]["values"].requires_grad
    out = roundtrip({"lp": nt}, tmp_path)["lp"]
    assert not out.requires_grad
    assert torch.equal(out.values(), nt.values().detach()) and torch.equal(out.offsets(), nt.offsets())


def test_plain_values_are_copied_and_anything_else_is_left_to_the_general_walk():
    chat = {"role": "user", "content": "hi", "meta": [1, 2.5, None, True, {"k": b"x"}]}
    copied = fastwalk.plain(chat)
    assert copied == chat and copied is not chat and copied["meta"] is not chat["meta"]
    for value in ({1: "int key"}, {structure.TAG: "x"}, [(1, 2)], [torch.zeros(1)], [{3}]):
        assert fastwalk.plain(value) is fastwalk.NOT_PLAIN, value
    deep: list = []
    for _ in range(20):
        deep = [deep]
    assert fastwalk.plain(deep) is fastwalk.NOT_PLAIN and structure.encode(deep) == deep
    cyclic: list = [1]
    cyclic.append(cyclic)
    assert fastwalk.plain(cyclic) is fastwalk.NOT_PLAIN
    with pytest.raises(codec.CodecError, match="contains itself"):
        structure.encode({"c": cyclic})
    assert structure.encode({1: "a", structure.TAG: 2})[structure.TAG] == "dict"      # escaped as before


def test_a_staged_write_keeps_the_rows_as_sample_returned_them(tmp_path):
    from skip_harness.store.layout import Layout
    from skip_harness.store.open import open_store

    store = open_store(Layout(tmp_path / "ns", K=1, W=1))
    td = _grpo_like(groups=2, n=2)
    before = td.get("messages").tolist()
    expected = [[dict(m) for m in row] for row in before]
    staged = store.writer.stage_inner(1, 0, 0, td, {})
    before[0][0]["content"] = "changed by the trainer"              # the batch changed after sample
    store.writer.commit(1, staged.complete(), None)
    assert store.reader.read_inner(1, 0, 0).get("messages").tolist() == expected


def test_rows_decoded_are_the_objects_the_constructor_makes(tmp_path):
    td = _grpo_like(groups=2, n=3)
    td.set("mixed", tensordict.NonTensorStack(*["s", 1, None, (1, "t"), {"k": [2.5]}, b"raw"]))
    out = roundtrip(td, tmp_path)
    for key in ("messages", "uid", "mixed"):
        rows = out.get(key)
        assert rows.tolist() == td.get(key).tolist(), key
        for i, row in enumerate(rows.tensordicts):
            made = tensordict.NonTensorData(data=row.data, batch_size=[], device=None)
            assert type(row) is type(made) and row.__dict__.keys() == made.__dict__.keys(), (key, i)
            assert row.__dict__["_non_tensordict"] == made.__dict__["_non_tensordict"], (key, i)
            assert row.batch_size == made.batch_size and row.device == made.device, (key, i)
    rows = out.get("messages")
    rows[1] = tensordict.NonTensorData(data="replaced", batch_size=[])          # the trainer may edit them
    assert rows.tolist()[1] == "replaced" and rows.tolist()[2] == td.get("messages").tolist()[2]


def test_the_row_maker_builds_by_the_constructor_what_is_not_plain():
    maker = fastwalk.NonTensorMaker(tensordict.NonTensorData, None)
    first, second = maker(["a"]), maker({"b": 1})
    assert maker.fast and first.data == ["a"] and second.data == {"b": 1}
    t = torch.arange(3)
    held = maker(t)                                     # a tensor: the constructor's own handling
    made = tensordict.NonTensorData(data=t, batch_size=[], device=None)
    assert type(held.data) is type(made.data) and torch.equal(held.data, made.data)
    tensor_first = fastwalk.NonTensorMaker(tensordict.NonTensorData, None)
    tensor_first(torch.zeros(1))
    assert not tensor_first.fast and tensor_first("x").data == "x"
