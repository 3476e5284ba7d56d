"""Each thing stored once (codec/dedupe.py): repeated rows and derivable fields are stored as a rule, found
by comparing the bytes, and served back bit for bit -- dense tensors, jagged nested tensors and TensorDicts;
one bit off and the rule is not taken. Older files still load; a damaged rule is a CodecError."""
from __future__ import annotations

import io
import json
import os
import resource
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from skip_harness import codec
from skip_harness.codec import dedupe, tensorfile
from skip_harness.errors import CodecError
from skip_harness.store.layout import Layout
from skip_harness.store.open import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import _bench_grpo  # noqa: E402

ZSTD = codec.stored_form("zstd", 1)
NO_RULES = codec.StoredForm(narrow=True, zstd_level=1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.is_floating_point or t.dtype == torch.bool else t


def assert_identical(a, b, where="payload"):
    """Equal to the last bit: values as bytes, dtypes, shapes, layouts, structure."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.is_nested == b.is_nested and a.layout == b.layout, where
        if a.is_nested:
            assert torch.equal(a.offsets(), b.offsets()), where
            a, b = a.values(), b.values()
        assert a.shape == b.shape and torch.equal(_bits(a.contiguous()), _bits(b.contiguous())), where
        return
    if hasattr(a, "keys") and hasattr(a, "batch_size"):                       # a TensorDict
        assert type(a) is type(b) and a.batch_size == b.batch_size and set(a.keys()) == set(b.keys()), where
        for k in a.keys():
            assert_identical(a.get(k), b.get(k), f"{where}[{k!r}]")
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
        return
    if hasattr(a, "tolist") and not isinstance(a, (str, bytes)):             # NonTensorStack and friends
        assert a.tolist() == b.tolist(), where
        return
    assert a == b, where


def round_trip(payload, form=ZSTD):
    buf = io.BytesIO()
    n = codec.save_to(buf, payload, form)
    data = bytearray(buf.getvalue())
    codec.check_buffer(data, n, "mem")
    return codec.load_buffer(data, n, "mem"), {f.name: f for f in codec.stored_fields(data, n, "mem")}, n


def dense_batch(rows=8, n=4, P=128, R=96, seed=0):
    """A dense GRPO-like batch: prompts repeated over each group of n, input_ids = prompt + response."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 50_000, (rows // n, P), generator=g).repeat_interleave(n, 0)
    responses = torch.randint(0, 50_000, (rows, R), generator=g)
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.ones(rows, P + R, dtype=torch.int64),
            "position_ids": torch.arange(P + R).repeat(rows, 1),
            "old_log_probs": -torch.rand(rows, R, generator=g) * 6}


def rules_of(fields):
    return {name: f.compression for name, f in fields.items()}


def test_a_dense_batch_stores_each_thing_once_and_comes_back_bit_for_bit():
    batch = dense_batch()
    out, fields, n = round_trip(batch)
    assert_identical(batch, out)
    rules = rules_of(fields)
    assert rules["payload['prompts']"] == "rows" and rules["payload['input_ids']"] == "cat"
    assert rules["payload['attention_mask']"] == "fill" and rules["payload['position_ids']"] == "ramp"
    assert fields["payload['input_ids']"].stored_bytes == 0
    _, _, without = round_trip(batch, NO_RULES)
    assert n < 0.8 * without


def test_a_cat_of_rows_of_several_elements_each_is_found_and_one_element_off_is_not():
    """`cat` over units of more than one element (a [rows, tokens, 3] field as its two parts along dim 1),
    dense and jagged; one element of one unit off and it is stored as it is."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 1000, (8, 40, 3), generator=g), torch.randint(0, 1000, (8, 70, 3), generator=g)
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)                   # noqa: E731
    ja = nested([a[i, :20 + 2 * i] for i in range(8)])
    jb = nested([b[i, :20 + 5 * i] for i in range(8)])
    jc = nested([torch.cat([a[i, :20 + 2 * i], b[i, :20 + 5 * i]]) for i in range(8)])
    for batch, key in (({"a": a, "b": b, "ab": torch.cat([a, b], 1)}, "payload['ab']"),
                       ({"a": ja, "b": jb, "ab": jc}, "payload['ab'].values()")):
        out, fields, _ = round_trip(batch)
        assert_identical(batch, out)
        assert fields[key].compression == "cat", key
        spoilt = (batch["ab"].values() if batch["ab"].is_nested else batch["ab"].view(-1, 3))
        spoilt[45, 1] += 1
        out, fields, _ = round_trip(batch)
        assert_identical(batch, out)
        assert fields[key].compression != "cat", key


def test_a_jagged_tensordict_grpo_batch_stores_each_thing_once_and_comes_back_bit_for_bit():
    batch = _bench_grpo.make_grpo_payload(3, n=4, seed=2)
    out, fields, n = round_trip(batch)
    assert_identical(batch, out)
    td = "payload['tensordict']"
    rules = rules_of(fields)
    assert rules[f"{td}['prompts'].values()"] == "rows" and rules[f"{td}['input_ids'].values()"] == "cat"
    assert rules[f"{td}['attention_mask'].values()"] == "fill" and rules[f"{td}['response_mask'].values()"] == "fill"
    assert rules[f"{td}['position_ids'].values()"] == "ramp"
    assert fields[f"{td}['rollout_log_probs'].values()"].compression == "zstd"       # floats: kept, shuffled
    _, _, without = round_trip(batch, NO_RULES)
    assert n < 0.8 * without


def test_through_the_store_a_served_batch_is_the_written_one(tmp_path):
    store = open_store(Layout(tmp_path / "ns", K=1, W=1), form=ZSTD)
    batch = _bench_grpo.make_grpo_payload(2, n=4, seed=3)
    store.writer.commit(1, store.writer.write_inner(1, 0, 0, batch, {"t": 1}), None)
    status, reason, batches, _metas = open_store(Layout(tmp_path / "ns", K=1, W=1)).reader.read_served(1, 0)
    assert reason is None
    assert_identical(batch, batches[0])


ONE_BIT = {
    # field: how to spoil its rule by one bit in one element, and the rule it must not get
    "prompts": (lambda b: b["prompts"][5, 7].__ixor__(1), "row 5 a repeat"),
    "input_ids": (lambda b: b["input_ids"][3, 70].__ixor__(4), "cat"),       # no longer prompt + response
    "attention_mask": (lambda b: b["attention_mask"][2, 0].__ixor__(2), "fill"),   # not all one value
    "position_ids": (lambda b: b["position_ids"][6, 100].__ixor__(1), "ramp"),     # not 0..len-1
}


def header_entry(payload, field):
    buf = io.BytesIO()
    codec.save_to(buf, payload, ZSTD)
    data = buf.getvalue()
    hlen = struct.unpack_from("<Q", data, 16)[0]
    return _entry(json.loads(data[24:24 + hlen])["tensors"], field)


@pytest.mark.parametrize("field", sorted(ONE_BIT))
def test_one_bit_off_and_the_rule_is_not_taken(field):
    batch = dense_batch()
    assert header_entry(batch, "prompts")[4]["rows"][2][5] == 4                 # unspoilt: row 5 repeats row 4
    spoil, rule = ONE_BIT[field]
    spoil(batch)
    out, fields, _ = round_trip(batch)
    assert_identical(batch, out)
    how = header_entry(batch, field)[4]
    if rule == "row 5 a repeat":
        assert how["rows"][2][5] == 5
    else:
        assert rule not in how


def test_floats_are_compared_and_kept_as_bits():
    """-0.0 is not 0.0 and a NaN payload is kept: rules compare bytes, never values; shuffled floats of every
    width come back as written."""
    z = torch.zeros(16, 512)
    z[3, 9] = -0.0
    nan = torch.full((16, 512), float("nan"))
    nan.view(torch.int32)[1, 1] ^= 1                                   # another NaN's bits
    rows = torch.randn(4, 512).repeat_interleave(4, 0)
    rows[9, 0] = -rows[9, 0] if rows[9, 0] == 0 else rows[9, 0]
    payload = {"z": z, "nan": nan, "rows": rows, "h": torch.randn(64, 128).half(), "bf": torch.randn(64, 128).bfloat16(),
               "d": torch.randn(64, 128, dtype=torch.float64)}
    out, fields, _ = round_trip(payload)
    assert_identical(payload, out)
    assert fields["payload['z']"].compression != "fill" and fields["payload['nan']"].compression != "fill"
    assert fields["payload['rows']"].compression == "rows"


def test_a_format_3_file_still_loads():
    """Files written before the rules (format 3, zstd) load as they did."""
    batch = dense_batch()
    buf = io.BytesIO()
    n = codec.save_to(buf, batch, NO_RULES)
    data = bytearray(buf.getvalue())
    hlen = struct.unpack_from("<Q", data, 16)[0]
    header = bytes(data[24:24 + hlen])
    assert f'"format":{codec.FORMAT_VERSION}'.encode() in header and b'"shuffle"' not in header
    struct.pack_into("<I", data, 8, 3)
    data[24:24 + hlen] = header.replace(f'"format":{codec.FORMAT_VERSION}'.encode(), b'"format":3')
    assert_identical(batch, codec.load_buffer(data, n, "v3"))


def _damaged(edit, payload=None):
    """The file image of `payload` (the dense batch) with `edit` applied to its header's tensor entries."""
    buf = io.BytesIO()
    n = codec.save_to(buf, dense_batch() if payload is None else payload, ZSTD)
    data = bytearray(buf.getvalue())
    hlen = struct.unpack_from("<Q", data, 16)[0]
    doc = json.loads(bytes(data[24:24 + hlen]))
    edit(doc["tensors"])
    header = json.dumps(doc, separators=(",", ":")).encode()
    data_start = -(-(24 + hlen) // 64) * 64
    assert 24 + len(header) <= data_start                             # the data stays where it was
    data[24:data_start] = header + bytes(data_start - 24 - len(header))
    struct.pack_into("<Q", data, 16, len(header))
    return data, n


def _entry(tensors, field):
    return next(e for e in tensors if len(e) > 4 and e[4].get("name") == f"payload[{field!r}]")


DAMAGE = {
    "a rule's source out of range": lambda ts: _entry(ts, "input_ids")[4].__setitem__("cat", [99, -1, 1, -1, -1]),
    "a cat made of itself": lambda ts: _entry(ts, "input_ids")[4].__setitem__("cat", [2, -1, 1, -1, -1]),
    "a repeat ahead of its source": lambda ts: _entry(ts, "prompts")[4]["rows"][2].__setitem__(0, 1),
    "a fill of many values": lambda ts: _entry(ts, "attention_mask")[4].__setitem__("fill", 1),
    "a rule with bytes of its own": lambda ts: _entry(ts, "attention_mask").__setitem__(3, 64),
    "a rule on a 16-byte dtype": lambda ts: _entry(ts, "prompts").__setitem__(0, "complex128"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_rule_is_a_codec_error(damage):
    data, n = _damaged(DAMAGE[damage])
    with pytest.raises(CodecError):
        codec.check_buffer(data, n, "bad")
    with pytest.raises(CodecError):
        codec.load_buffer(data, n, "bad")


def test_unique_rows_that_do_not_hold_the_rows_are_a_codec_error():
    """What only the data can tell (a repeat's length against its source's) fails while rebuilding, naming
    the field."""
    data, n = _damaged(lambda ts: _entry(ts, "prompts")[4]["rows"][2].__setitem__(1, 1))   # 1 is its own source
    with pytest.raises(CodecError):
        codec.load_buffer(data, n, "bad")


def test_a_float_field_close_to_another_is_stored_as_their_xor_and_comes_back_bit_for_bit():
    """The trainer's log-probs beside the generator's: the same values up to float noise, stored as the
    bits they differ in (shuffled, as every float field that compresses better so); specials kept."""
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(16, 512, generator=g) * 6
    old = rollout + torch.randn(16, 512, generator=g) * 1e-3
    old[0, 0], old[0, 1], old[0, 2] = float("nan"), -0.0, float("-inf")
    far = torch.randn(16, 512, generator=g)                                # unrelated: no xor
    payload = {"rollout": rollout, "old": old, "far": far, "zeros": torch.zeros(16, 512).index_fill_(1, torch.tensor([3]), 1.0)}
    out, fields, _ = round_trip(payload)
    assert_identical(payload, out)
    assert fields["payload['old']"].compression == "xor" and fields["payload['far']"].compression == "zstd"
    assert "xor" not in header_entry(payload, "far")[4]
    assert header_entry(payload, "rollout")[4].get("shuffle") is True           # noise-like mantissas: grouped
    assert "shuffle" not in header_entry(payload, "zeros")[4]                   # compresses to nothing anyway
    _, _, without = round_trip(payload, NO_RULES)
    _, _, rules_only = round_trip(payload, codec.StoredForm(narrow=True, zstd_level=1, dedupe=True))
    assert rules_only < 0.95 * without


def test_a_damaged_shuffle_or_xor_is_a_codec_error():
    g = torch.Generator().manual_seed(1)
    a = -torch.rand(16, 512, generator=g) * 6
    payload = {"a": a, "b": a + 1e-4, "i": torch.arange(8192).reshape(16, 512) * 7}
    for edit in (lambda ts: _entry(ts, "b")[4].__setitem__("xor", [_entry(ts, "b")[4]["xor"][0], 2]),   # an int
                 lambda ts: _entry(ts, "i")[4].__setitem__("shuffle", True)):                          # an int
        data, n = _damaged(edit, payload)
        with pytest.raises(CodecError):
            codec.load_buffer(data, n, "bad")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_the_writer_threads_codec_work_stays_on_its_thread():
    """Dedupe, narrowing and zstd run on the writer thread alone: torch's intra-op threads are the trainer's
    (issue 42: the plan's torch passes fanned out over them, costing the trainer twice the writer's seconds)."""
    structure, names = codec.encode_named(_bench_grpo.make_grpo_payload(8, seed=3))
    image = tensorfile.plan(structure, names)
    tensors = [t.contiguous() for t in image.tensors]
    seconds = {}

    def work():
        tensorfile.stored_image(image, tensors, ZSTD)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        for _ in range(3):
            tensorfile.stored_image(image, tensors, ZSTD)
        t1, r1 = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
        seconds["thread"] = t1 - t0
        seconds["process"] = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    tries = []
    try:
        for _ in range(3):          # the process's CPU counts any other thread too: the best of three tries
            writer = threading.Thread(target=work)
            writer.start()
            writer.join()
            tries.append(dict(seconds))
            if seconds["process"] <= 1.3 * seconds["thread"] + 0.01:
                break
    finally:
        torch.set_num_threads(previous)
    assert seconds["process"] <= 1.3 * seconds["thread"] + 0.01, tries


def test_row_sums_are_exact_across_its_chunks(monkeypatch):
    """`_row_sums` sums four- and eight-byte units row by row in their own width, and widens narrower ones a
    chunk at a time (a carry between chunks): every row's sum as one pass over the whole tensor would give
    it, for every width -- rows across chunk ends, empty rows and units after the last row included."""
    import numpy as np

    monkeypatch.setattr(dedupe, "_SUM_CHUNK", 1000)
    rng = np.random.default_rng(0)
    for dtype in (np.uint8, np.int16, np.int32, np.int64):
        for tail in (0, 1, 40):                   # units no row covers: 0 when the rows tile the tensor
            bits = rng.integers(0, 120, size=(5003, 3)).astype(dtype)
            lengths = rng.integers(0, 40, size=300)
            lengths[lengths.cumsum() > 5003 - tail] = 0
            lengths[-1] += 5003 - tail - lengths.sum()
            starts = np.concatenate([[0], lengths.cumsum()[:-1]])
            flat = bits.astype(np.int64)
            got = dedupe._row_sums(bits, starts, lengths)
            assert [int(g) for g, n in zip(got, lengths) if n] == \
                [int(flat[s:s + n].sum()) for s, n in zip(starts, lengths) if n], (dtype, tail)   # an empty row's: unchecked


def test_the_first_look_at_a_row_reads_a_few_elements_first_and_last_among_them():
    """`_agree_at_samples`, the cheap look before the rows' sums: equal rows agree; a row that differs at its
    first element, its last, or one of the 32 in between is told apart by the look alone; one that differs
    only between two of them is left for the sums and the whole comparison."""
    import numpy as np

    row = np.random.default_rng(2).integers(0, 9, size=(310, 3))
    lengths, starts = np.array([310, 310, 310]), np.array([0, 310, 620])   # three rows of 310 units of 3
    look = lambda bits: dedupe._agree_at_samples(bits, starts, lengths, np.array([1, 2])).tolist()  # noqa: E731
    bits = np.concatenate([row, row, row])
    assert look(bits) == [True, True]
    elements = 310 * 3
    sampled = {(elements - 1) * k // 31 for k in range(32)}
    assert {0, elements - 1} <= sampled and len(sampled) == 32
    for e in sorted(sampled) + [1, elements - 2]:
        spoilt = bits.copy()
        spoilt.reshape(-1)[elements + e] += 1     # an element of row 1
        assert look(spoilt) == ([False, False] if e in sampled else [True, True]), e


@pytest.mark.parametrize("layout", ["dense", "jagged"])
def test_rows_that_differ_in_any_one_element_are_not_repeats(layout):
    """A repeat is looked for first at a few elements spread over each row, then by the rows' sums, then
    compared whole: rows equal but for one element -- wherever it sits, at a place the first look reads or
    between two of them -- are never taken as repeats; rows equal to the bit always are."""
    g = torch.Generator().manual_seed(5)
    L = 300                                       # units a row (two elements each); rows 0=1, 2=3, 4=5
    if layout == "dense":
        rows = torch.randint(0, 9, (3, L, 2), generator=g).repeat_interleave(2, 0)
        offsets = None
    else:                                         # rows of L, L, 0, 0, 260 and 260 units
        rows = torch.cat([torch.randint(0, 9, (L, 2), generator=g).repeat(2, 1),
                          torch.randint(0, 9, (260, 2), generator=g).repeat(2, 1)])
        offsets = torch.tensor([0, L, 2 * L, 2 * L, 2 * L, 2 * L + 260, 2 * L + 520])
    assert dedupe._repeats(dedupe._rows_of(rows, offsets, -1)) == [0, 0, 2, 2, 4, 4]
    flat = rows.reshape(-1, 2)
    for j in range(L):                            # every element of row 1: one bit off, or -1 and +1 beside it
        for k in range(2):                        # (the row's sum unchanged)
            for spoil in ((lambda t: t[L + j, k].__ixor__(1)),
                          (lambda t: (t[L + j, k].__isub__(1), t[L + (j + 1) % L, 1 - k].__iadd__(1)))):
                spoilt = flat.clone()
                spoil(spoilt)
                src = dedupe._repeats(dedupe._rows_of(spoilt.reshape(rows.shape), offsets, -1))
                assert src is not None and src[:2] == [0, 1] and src[5] == 4, (j, k, src)


@pytest.mark.parametrize("dtype", ["int16", "int32"])
def test_the_writer_threads_row_sums_let_the_trainer_run(monkeypatch, dtype):
    """The rows rule sums each row of a tensor in one pass (int32 units by a reduction in their own width,
    int16 ones through a cumsum of a widened copy). Asked to cast as it went (int32 units summed as int64),
    NumPy ran that pass holding the GIL, several times slower: the trainer's thread could not dispatch an
    op for its whole length (issue 42: a dense zstd miss 5 % over its floor; found with `py-spy record
    --gil`). The trainer's thread here never waits for more than a quarter of it."""
    import numpy as np

    monkeypatch.setattr(dedupe, "_SUM_CHUNK", 1 << 23)   # one chunk: a pass that held the GIL would show whole
    bits = np.random.default_rng(1).integers(0, 1 << 20, size=(1 << 23, 1)).astype(dtype)
    starts = np.arange(0, bits.shape[0], 4096)
    lengths = np.full(starts.shape, 4096)
    tries = []
    for _ in range(3):            # another process can take this thread's core too: the best of three
        done = threading.Event()
        took = {}

        def work():
            t0 = time.perf_counter()
            dedupe._row_sums(bits, starts, lengths)
            took["s"] = time.perf_counter() - t0
            done.set()

        writer = threading.Thread(target=work)
        worst, last = 0.0, time.perf_counter()
        writer.start()
        while not done.is_set():
            sum(range(20))
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        writer.join()
        tries.append((round(worst, 4), round(took["s"], 4)))
        if worst <= 0.25 * took["s"]:
            break
    assert min(w / s for w, s in tries) <= 0.25, tries
