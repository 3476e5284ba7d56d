"""codec.rechunk: a step's mini-batches cut and joined along the batch dimension, on every payload kind."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from skip_harness import codec
from skip_harness.errors import CodecError


def demo_piece(i: int, rows: int = 4) -> dict:
    """A demo-like mini-batch: batched tensors and per-call 0-dim ones."""
    base = i * rows
    return {
        "prompts": torch.arange(base, base + rows).unsqueeze(1).repeat(1, 3),
        "rewards": torch.arange(base, base + rows, dtype=torch.float32) / 10,
        "uid": torch.arange(base, base + rows),
        "step": torch.tensor(7),
        "inner_index": torch.tensor(i),
    }


def test_regroup_demo_pieces_both_directions():
    four = [demo_piece(i) for i in range(4)]
    two = codec.regroup(four, 2)
    assert [p["uid"].tolist() for p in two] == [list(range(0, 8)), list(range(8, 16))]
    assert two[1]["prompts"].shape == (8, 3) and torch.equal(two[1]["rewards"], torch.arange(8, 16) / 10)
    assert two[1]["step"].item() == 7 and two[1]["inner_index"].item() == 2  # per call: the first piece's
    back = codec.regroup(two, 4)
    for a, b in zip(back, four):
        assert torch.equal(a["prompts"], b["prompts"]) and torch.equal(a["uid"], b["uid"])
    eight = codec.regroup(four, 8)
    assert [p["uid"].tolist() for p in eight] == [[2 * j, 2 * j + 1] for j in range(8)]
    one = codec.regroup(four, 1)[0]
    assert one["uid"].tolist() == list(range(16))


def test_take_joins_only_the_overlapping_pieces():
    pieces = [demo_piece(i) for i in range(4)]
    got = codec.take(pieces, [4, 4, 4, 4], 6, 10)
    assert got["uid"].tolist() == [6, 7, 8, 9] and got["inner_index"].item() == 1
    assert codec.take(pieces, [4] * 4, 4, 8) is pieces[1]  # a whole piece is served as it is
    with pytest.raises(CodecError, match="beyond"):
        codec.take(pieces, [4] * 4, 16, 20)


def test_uneven_split_and_no_batch_dimension_are_refused():
    with pytest.raises(CodecError, match="do not split"):
        codec.regroup([demo_piece(0, rows=3)], 2)
    with pytest.raises(CodecError, match="no batch dimension"):
        codec.regroup([{"a": 1}], 1)


def test_tuples_lists_numpy_and_scalars():
    pieces = [(torch.arange(2) + 2 * i, [f"s{2 * i}", f"s{2 * i + 1}"], np.arange(2) + 2 * i, "tag", 3)
              for i in range(2)]
    [whole] = codec.regroup(pieces, 1)
    assert whole[0].tolist() == [0, 1, 2, 3] and whole[1] == ["s0", "s1", "s2", "s3"]
    assert whole[2].tolist() == [0, 1, 2, 3] and whole[3:] == ("tag", 3)
    quarters = codec.regroup(pieces, 4)
    assert [q[1] for q in quarters] == [["s0"], ["s1"], ["s2"], ["s3"]]
    assert [q[2].tolist() for q in quarters] == [[0], [1], [2], [3]]


@dataclass
class Rollout:
    tokens: torch.Tensor
    note: str


def test_registered_dataclass():
    codec.register_type(Rollout, "test_rechunk.Rollout")
    try:
        pieces = [Rollout(torch.arange(4) + 4 * i, "x") for i in range(2)]
        halves = codec.regroup(pieces, 4)
        assert [h.tokens.tolist() for h in halves] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert all(isinstance(h, Rollout) and h.note == "x" for h in halves)
    finally:
        codec.unregister_type(Rollout)


def test_jagged_nested_tensors():
    rows = [torch.arange(n, dtype=torch.float32) for n in (1, 3, 2, 4)]
    pieces = [torch.nested.nested_tensor(rows[:2], layout=torch.jagged),
              torch.nested.nested_tensor(rows[2:], layout=torch.jagged)]
    out = codec.regroup(pieces, 4)
    assert [o.unbind(0)[0].tolist() for o in out] == [r.tolist() for r in rows]
    [whole] = codec.regroup(pieces, 1)
    assert [r.tolist() for r in whole.unbind(0)] == [r.tolist() for r in rows]


def test_tensordict_with_jagged_and_non_tensor_fields():
    tensordict = pytest.importorskip("tensordict")

    def piece(i: int):
        lengths = (1 + i, 2 + i)
        return tensordict.TensorDict({
            "x": torch.arange(4.0).reshape(2, 2) + 4 * i,
            "resp": torch.nested.nested_tensor([torch.ones(n) * n for n in lengths], layout=torch.jagged),
            "text": tensordict.NonTensorStack(f"t{2 * i}", f"t{2 * i + 1}"),
        }, batch_size=[2])

    pieces = [piece(0), piece(1)]
    quarters = codec.regroup(pieces, 4)
    assert [q["x"].tolist() for q in quarters] == [[[0.0, 1.0]], [[2.0, 3.0]], [[4.0, 5.0]], [[6.0, 7.0]]]
    assert [q["resp"].unbind(0)[0].tolist() for q in quarters] == [[1.0], [2.0, 2.0], [2.0, 2.0], [3.0, 3.0, 3.0]]
    assert [list(q["text"]) for q in quarters] == [["t0"], ["t1"], ["t2"], ["t3"]]
    [whole] = codec.regroup(quarters, 1)
    assert whole.batch_size == torch.Size([4]) and list(whole["text"]) == ["t0", "t1", "t2", "t3"]


def test_trl_flat_fields_are_cut_by_their_lengths():
    """TRL's unit keeps completions flat beside their lengths: re-chunked, every row keeps its own tokens
    and log-probs (without the rule, `rows` took the flat field's size and a K-changed TRL replay died in
    TRL with an IndexError)."""
    from skip_harness.integrations.trl_payload import add_prompts, decode_generation, encode_generation

    out = ([[1, 2, 3], [4], [], [5, 6]], [[0.1, 0.2, 0.3], [None], [], [0.5, 0.6]])
    piece = encode_generation(out)
    add_prompts(piece, [[9], [9, 8], [7], [7, 7, 7]])
    assert codec.rechunk.rows(piece) == 4
    halves = codec.rechunk.regroup([piece], 2)
    assert [decode_generation(h) for h in halves] == [([[1, 2, 3], [4]], [[0.1, 0.2, 0.3], [None]]),
                                                       ([[], [5, 6]], [[], [0.5, 0.6]])]
    assert halves[1]["prompt_ids"].tolist() == [7, 7, 7, 7]
    whole = codec.rechunk.join(halves)
    assert decode_generation(whole) == out
    assert torch.equal(whole["prompt_ids"], piece["prompt_ids"])
    # one piece had no None log-prob (no mask), the other one: the joined mask is the recorded one
    mixed = codec.rechunk.join([encode_generation(([[1]], [[0.5]])), encode_generation(([[2]], [[None]]))])
    assert decode_generation(mixed) == ([[1], [2]], [[0.5], [None]])
