"""codec: exact round trips without pickled code; merge."""
from __future__ import annotations

import collections
import dataclasses
import io
import json
import struct
import math
import os
import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch

from skip_harness import codec
from skip_harness.errors import CodecError
from skip_harness.store import payload_file


def roundtrip(payload, tmp_path, mmap=True):
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, payload)
    return payload_file.load(path, mmap=mmap)


def assert_same(a, b, where="payload"):
    """Equal in values, dtypes, shapes, container types and key order."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        if a.is_floating_point() or a.is_complex():
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tolist() == b.tolist(), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_dtypes_round_trip_exactly(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, generator=g, dtype=torch.float64) * 50
    if dtype == torch.bool:
        t = base > 0
    elif dtype.is_complex:
        t = torch.complex(base, -base).to(dtype)
    else:
        t = base.to(dtype)
    out = roundtrip({"t": t, "zero_dim": t[0, 0].clone(), "empty": t[:0]}, tmp_path)
    assert_same({"t": t, "zero_dim": t[0, 0].clone(), "empty": t[:0]}, out)
    assert out["zero_dim"].dim() == 0 and out["empty"].shape == (0, 7)


def test_nested_structure_round_trips_exactly(tmp_path):
    payload = {
        "z": 1,                       # key order is kept, not sorted
        "a": [torch.arange(3), (torch.ones(2, dtype=torch.bfloat16), "s", None), []],
        7: {"nested": {"deep": (1, 2.5, True, False)}},
        "strings": ["", "ünï", "x" * 1000],
        "numbers": [0, -1, 2**62, 1.5, float("inf"), float("-inf"), float("nan"), 3 + 4j],
        "bytes": b"\x00\xff",
        "none": None,
        "empty_tuple": (),
        "empty_dict": {},
        "ordered": OrderedDict([("b", 1), ("a", torch.zeros(1))]),
    }
    out = roundtrip(payload, tmp_path)
    assert_same(payload, out)
    assert type(out["a"][1]) is tuple and type(out["a"]) is list and type(out["ordered"]) is OrderedDict


def test_non_contiguous_tensors_round_trip_and_write_only_their_elements(tmp_path):
    big = torch.arange(1_000_000, dtype=torch.float32).reshape(1000, 1000)
    c = torch.complex(torch.arange(4.0), torch.ones(4))
    views = {"t": big.t(), "step": big[::7, 3], "slice": big[10:12], "expanded": torch.ones(3, 1).expand(3, 4),
             "conj": c.conj(), "neg": c.conj().imag}
    out = roundtrip(views, tmp_path)
    assert_same(views, out)
    small = {"slice": big[10:12]}
    with open(tmp_path / "small.pt", "wb") as f:
        codec.save_to(f, small)
    assert os.path.getsize(tmp_path / "small.pt") < 64 * 1024  # not the 4 MB storage behind the view


def test_load_without_mmap_and_tensor_from_old_torch_format(tmp_path):
    payload = {"x": torch.randn(3), "y": [1, "a"]}
    assert_same(payload, roundtrip(payload, tmp_path, mmap=False))
    path = tmp_path / "old.pt"
    torch.save(payload, path, _use_new_zipfile_serialization=False)
    assert_same(payload, payload_file.load(path))


def test_dict_holding_the_tag_key_is_escaped(tmp_path):
    payload = {codec.TAG: "tensor", "device": "cuda:0", "data": torch.ones(2)}
    out = roundtrip(payload, tmp_path)
    assert_same(payload, out)
    nested = {"a": [{codec.TAG: "dict", "keys": 1}], 3: OrderedDict([(codec.TAG, None)])}
    out = roundtrip(nested, tmp_path)
    assert_same(nested, out)


def test_numpy_arrays_and_scalars(tmp_path):
    payload = {
        "f": np.arange(6, dtype=np.float32).reshape(2, 3),
        "i": np.array([1, -2], dtype=np.int64),
        "b": np.array([True, False]),
        "u": np.array(["ab", "c"]),
        "o": np.array([{"k": 1}, "s", None], dtype=object),
        "scalar": np.float64(2.5),
        "iscalar": np.int32(7),
    }
    out = roundtrip(payload, tmp_path)
    for k in ("f", "i", "b", "u", "o"):
        assert out[k].dtype == payload[k].dtype and out[k].tolist() == payload[k].tolist()
    assert type(out["scalar"]) is np.float64 and out["scalar"] == 2.5
    assert type(out["iscalar"]) is np.int32 and out["iscalar"] == 7


def test_tensordict_round_trips(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"a": torch.randn(4, 2), "n": {"b": torch.arange(4)}}, batch_size=[4])
    out = roundtrip({"batch": td}, tmp_path)["batch"]
    assert isinstance(out, tensordict.TensorDictBase)
    assert out.batch_size == td.batch_size
    assert torch.equal(out["a"], td["a"]) and torch.equal(out["n", "b"], td["n", "b"])


def test_tensordict_is_imported_only_when_a_file_to_decode_holds_one(tmp_path):
    """tensordict pulls in torch._dynamo (about 1.5 s of CPU per process): the harness and the CLI do not import
    it; a fresh process that reads a stored TensorDict imports it then and gets a TensorDict back."""
    import subprocess
    import sys

    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"a": torch.arange(6).reshape(3, 2)}, batch_size=[3])
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, {"batch": td, "x": torch.ones(2)})
    code = ("import sys; import skip_harness.run.harness, skip_harness.cli, skip_harness.codec; "
            "from skip_harness.store import payload_file; "
            "before = 'tensordict' in sys.modules or 'torch._dynamo' in sys.modules; "
            "out = payload_file.load(sys.argv[1]); import tensordict; "
            "print(before, isinstance(out['batch'], tensordict.TensorDictBase), out['batch']['a'].tolist())")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0] == "False True [[0, 1], [2, 3], [4, 5]]", proc.stdout


def test_tensordict_non_tensor_entries_round_trip(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"x": torch.arange(6.0).reshape(3, 2),
                                "text": tensordict.NonTensorStack(*["a", "b", "c"])}, batch_size=[3])
    td.set_non_tensor("tag", "hello")
    td.set("grid", tensordict.NonTensorStack.from_list([["p", "q"], ["r", "s"], ["t", "u"]]))
    td.set("pairs", tensordict.NonTensorStack(*[tensordict.NonTensorData([i, i + 1]) for i in range(3)]))
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, td)
    payload_file.check(path)
    out = payload_file.load(path)
    assert type(out) is tensordict.TensorDict and out.batch_size == td.batch_size
    assert list(out.keys()) == list(td.keys())
    assert torch.equal(out["x"], td["x"])
    for key in ("text", "grid", "pairs"):
        assert type(out.get(key)) is tensordict.NonTensorStack, key
        assert out.get(key).batch_size == td.get(key).batch_size, key
        assert out.get(key).tolist() == td.get(key).tolist(), key
    assert out.get("text").tolist() == ["a", "b", "c"]
    assert out.get("pairs").tolist() == [[0, 1], [1, 2], [2, 3]]  # a list per element, not a 2-d stack
    assert type(out.get("tag")) is tensordict.NonTensorData and out.get("tag").data == "hello"
    assert out.get("tag").batch_size == td.get("tag").batch_size


def test_non_tensor_data_round_trips_alone(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    payload = {"data": tensordict.NonTensorData({"k": 1.5}, batch_size=[2]),
               "meta": tensordict.MetaData("m"),
               "stack": tensordict.NonTensorStack("x", "y"),
               "empty": tensordict.NonTensorStack()}
    out = roundtrip(payload, tmp_path, mmap=False)
    assert type(out["data"]) is tensordict.NonTensorData and out["data"].data == {"k": 1.5}
    assert out["data"].batch_size == torch.Size([2])
    assert type(out["meta"]) is tensordict.MetaData and out["meta"].data == "m"
    assert type(out["stack"]) is tensordict.NonTensorStack and out["stack"].tolist() == ["x", "y"]
    assert out["empty"].batch_size == torch.Size([0]) and out["empty"].tolist() == []


def test_non_tensor_value_that_cannot_be_cached_is_refused_at_write_naming_its_key():
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    td.set("objs", tensordict.NonTensorStack(object(), object()))
    with pytest.raises(CodecError, match=r"\['objs'\]\[0\].*unsupported type"):
        codec.save_to(io.BytesIO(), td)


@pytest.mark.parametrize(
    "payload,where,typename",
    [
        ({"a": [1, 2, {3}]}, "payload['a'][2]", "set"),
        ({"a": (0, object())}, "payload['a'][1]", "object"),
        ([lambda: 1], "payload[0]", "function"),
        ({(1, 2): 3}, "payload", "tuple"),
        ({"m": torch.nn.Linear(1, 1)}, "payload['m']", "Linear"),
    ],
)
def test_unsupported_types_name_type_and_position(payload, where, typename):
    with pytest.raises(CodecError) as err:
        codec.encode(payload)
    assert where in str(err.value) and typename in str(err.value)


def test_reference_cycle_is_an_error():
    a = []
    a.append(a)
    with pytest.raises(CodecError, match="cycle"):
        codec.encode({"a": a})


def test_sparse_tensor_is_refused():
    with pytest.raises(CodecError, match=r"payload\['s'\]"):
        codec.encode({"s": torch.eye(3).to_sparse()})


def test_device_is_recorded_and_restored_when_available(monkeypatch):
    cpu_copy = torch.arange(4.0)
    setattr(cpu_copy, codec.ORIGIN_ATTR, "cuda:1")  # what encoding records of a CUDA tensor
    enc = codec.encode({"x": cpu_copy})
    assert enc["x"][codec.TAG] == "tensor" and enc["x"]["device"] == "cuda:1"
    assert type(enc["x"]["data"]) is torch.Tensor and not enc["x"]["data"].__dict__
    # no such device here: the tensor stays on the CPU
    out = codec.decode(enc)
    assert out["x"].device.type == "cpu" and torch.equal(out["x"], torch.arange(4.0))
    # a device that is available: the tensor goes back to it
    enc["x"]["device"] = "meta"
    out = codec.decode(enc)
    assert out["x"].device.type == "meta" and out["x"].shape == (4,)


def test_file_that_would_run_code_is_refused_and_never_executed(tmp_path):
    sentinel = tmp_path / "pwned"
    sentinel2 = tmp_path / "pwned2"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(sentinel),))

    class EvilShell:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel2}",))

    for evil, mark in ((Evil(), sentinel), (EvilShell(), sentinel2)):
        path = tmp_path / "evil.pt"
        torch.save({"x": torch.ones(1), "evil": evil}, path)
        with pytest.raises(CodecError) as err:
            payload_file.load(path)
        assert str(path) in str(err.value)
        assert not mark.exists()
        # the file really is dangerous: an unsafe load runs it
        torch.load(path, weights_only=False)
        assert mark.exists()


def test_pickled_class_instance_is_refused(tmp_path):
    path = tmp_path / "obj.pt"
    torch.save({"d": io.BytesIO(b"x")}, path)
    with pytest.raises(CodecError):
        payload_file.load(path)


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, None])
def test_unreadable_files_raise_codec_error(tmp_path, content):
    path = tmp_path / "bad.pt"
    if content is None:  # truncated real file
        with open(path, "wb") as f:
            codec.save_to(f, {"x": torch.randn(1000)})
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(content)
    with pytest.raises(CodecError):
        payload_file.load(path)


def test_malformed_tagged_record_raises_codec_error():
    with pytest.raises(CodecError):
        codec.decode({codec.TAG: "no-such-kind"})
    with pytest.raises(CodecError):
        codec.decode({codec.TAG: "tensor", "device": "cpu", "data": "not a tensor"})


def test_a_parameter_is_encoded_as_a_plain_tensor():
    enc = codec.encode({"p": torch.nn.Parameter(torch.ones(2))})
    assert type(enc["p"]) is torch.Tensor


def test_merge_concatenates_in_order():
    a = {"x": torch.arange(2), "s": torch.tensor(1.0), "l": [1], "t": (torch.ones(1), "m"), "k": 3, "name": "n",
         "lr": 0.1}
    b = {"x": torch.arange(2, 5), "s": torch.tensor(2.0), "l": [2, 3], "t": (torch.zeros(2), "m"), "k": 4,
         "name": "n", "lr": 0.1}
    m = codec.merge([a, b])
    assert torch.equal(m["x"], torch.arange(5))
    assert torch.equal(m["s"], torch.tensor([1.0, 2.0]))          # 0-dim: stacked
    assert m["l"] == [1, 2, 3]
    assert type(m["t"]) is tuple and torch.equal(m["t"][0], torch.tensor([1.0, 0.0, 0.0])) and m["t"][1] == "m"
    assert m["k"] == [3, 4]                                          # unequal scalars -> list
    assert m["name"] == "n" and m["lr"] == 0.1                       # equal ones kept
    assert list(m) == list(a)
    assert codec.merge([a]) is a


def test_merge_numpy_and_errors():
    m = codec.merge([{"n": np.arange(2)}, {"n": np.arange(2, 3)}])
    assert m["n"].tolist() == [0, 1, 2]
    with pytest.raises(CodecError, match="keys"):
        codec.merge([{"a": 1}, {"b": 1}])
    with pytest.raises(CodecError, match=r"payload\['a'\]"):
        codec.merge([{"a": torch.ones(1)}, {"a": 1}])
    with pytest.raises(CodecError):
        codec.merge([])
    with pytest.raises(CodecError, match="lengths"):
        codec.merge([(1,), (1, 2)])


def test_merge_tensordicts():
    tensordict = pytest.importorskip("tensordict")
    tds = [tensordict.TensorDict({"a": torch.full((2,), float(i))}, batch_size=[2]) for i in range(3)]
    m = codec.merge(tds)
    assert m.batch_size == torch.Size([6]) and m["a"].tolist() == [0, 0, 1, 1, 2, 2]


def test_encoded_structure_loads_with_weights_only():
    payload = {"a": (torch.ones(1), [None, "x", 1, 2.0, True]), codec.TAG: 1, "n": np.ones(2)}
    buf = io.BytesIO()
    torch.save(codec.encode(payload), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    out = codec.decode(loaded)
    assert out[codec.TAG] == 1 and out["n"].tolist() == [1.0, 1.0]
    assert pickle.loads(pickle.dumps(codec.encode({"a": 1}))) == {"a": 1}


# --------------------------------------------------------------------------------------------
# registered types, the file format and its version


@dataclasses.dataclass
class Rollout:
    ids: torch.Tensor
    rewards: list
    name: str = "r"
    extra: dict = dataclasses.field(default_factory=dict)
    derived: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    tag: str


Pair = collections.namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class NeverRegistered:
    x: int


@pytest.fixture
def registered():
    for cls in (Rollout, Frozen, Pair):
        codec.register_type(cls)
    yield
    for cls in (Rollout, Frozen, Pair):
        codec.unregister_type(cls)


def test_registered_dataclasses_and_namedtuples_round_trip_as_their_type(tmp_path, registered):
    r = Rollout(torch.arange(6).reshape(2, 3), [1.0, 2.0], extra={"p": Pair(torch.ones(2), "s")})
    r.derived = 7
    payload = {"r": r, "f": Frozen(torch.zeros(3), "t"), "pairs": [Pair(1, (2, 3))]}
    out = roundtrip(payload, tmp_path)
    assert type(out["r"]) is Rollout and type(out["f"]) is Frozen and type(out["pairs"][0]) is Pair
    assert torch.equal(out["r"].ids, r.ids) and out["r"].rewards == [1.0, 2.0] and out["r"].derived == 7
    assert type(out["r"].extra["p"]) is Pair and torch.equal(out["r"].extra["p"].left, torch.ones(2))
    assert out["pairs"][0] == Pair(1, (2, 3)) and out["f"].tag == "t"
    merged = codec.merge([{"p": Pair(torch.ones(1), "a")}, {"p": Pair(torch.zeros(2), "a")}])
    assert type(merged["p"]) is Pair and merged["p"].left.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("value,kind", [(NeverRegistered(1), "dataclass"), (Pair(1, 2), "namedtuple")])
def test_unregistered_type_is_refused_at_the_first_write_naming_it_and_the_fix(tmp_path, value, kind):
    for fn in (codec.encode, lambda p: codec.save_to(io.BytesIO(), p)):
        with pytest.raises(codec.UnregisteredTypeError) as err:
            fn({"batch": [value]})
        msg = str(err.value)
        assert f"{type(value).__qualname__}" in msg and kind in msg and "payload['batch'][0]" in msg
        assert f"skip_harness.codec.register_type({type(value).__qualname__})" in msg


def test_registered_type_is_rebuilt_from_the_registry_never_imported_from_the_file(tmp_path, registered):
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, {"p": Pair(1, 2)})
    data = path.read_bytes()
    name = codec.registered_name(Pair).encode()
    assert name in data
    # A file naming a type this process never registered -- even a real importable callable -- is
    # refused, and nothing is imported or called.
    sentinel = tmp_path / "pwned"
    evil_name = b"os.system".ljust(len(name), b" ")
    evil = tmp_path / "evil.pt"
    evil.write_bytes(data.replace(name, evil_name))
    codec.unregister_type(Pair)
    for p in (path, evil):
        with pytest.raises(codec.UnregisteredTypeError, match="register_type"):
            payload_file.load(p)
        payload_file.check(p)  # well formed: checking a file needs no registration
    assert not sentinel.exists()
    codec.register_type(Pair, name="my.Pair")
    with pytest.raises(codec.UnregisteredTypeError):  # registered under another name now
        payload_file.load(path)


def test_register_type_checks_its_argument_and_name_clashes():
    with pytest.raises(CodecError, match="not a dataclass or namedtuple"):
        codec.register_type(dict)
    codec.register_type(Frozen, name="clash")
    try:
        with pytest.raises(CodecError, match="already registered"):
            codec.register_type(Rollout, name="clash")
    finally:
        codec.unregister_type(Frozen)
    assert codec.register_type(name="deco")(NeverRegistered) is NeverRegistered
    assert codec.registered_name(NeverRegistered) == "deco"
    codec.unregister_type(NeverRegistered)
    assert codec.registered_name(NeverRegistered) is None


def test_every_file_records_the_format_version_and_a_newer_one_is_refused(tmp_path):
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, {"x": torch.ones(3)})
    data = path.read_bytes()
    assert data[:8] == codec.MAGIC and not data.startswith(b"PK")  # not torch.save's zip
    magic, version, _, hlen = struct.unpack_from("<8sIIQ", data)
    assert version == codec.FORMAT_VERSION
    assert json.loads(data[24:24 + hlen])["format"] == codec.FORMAT_VERSION
    newer = tmp_path / "newer.pt"
    newer.write_bytes(data[:8] + struct.pack("<I", codec.FORMAT_VERSION + 1) + data[12:])
    for fn in (payload_file.load, payload_file.check):
        with pytest.raises(CodecError, match=rf"format version {codec.FORMAT_VERSION + 1}.*newer"):
            fn(newer)


def test_files_of_the_previous_version_and_plain_torch_save_files_still_load(tmp_path):
    payload = {"x": torch.randn(4), "n": np.arange(3), codec.TAG: 1, "t": (1, "a")}
    previous = tmp_path / "v1.pt"
    with open(previous, "wb") as f:
        torch.save(codec.encode(payload), f)  # what save_to wrote before FORMAT_VERSION 2
    assert_same(payload, payload_file.load(previous))
    verl = tmp_path / "tq_batch.pt"
    plain = {"input_ids": torch.arange(8).reshape(2, 4), "uid": ["a", "b"]}
    torch.save(plain, verl)
    assert_same(plain, payload_file.load(verl))
    payload_file.check(previous)
    payload_file.check(verl)


def test_check_file_refuses_pickled_code_without_suggesting_an_unsafe_load(tmp_path):
    sentinel = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(sentinel),))

    path = tmp_path / "evil.pt"
    torch.save({"x": torch.ones(1), "evil": Evil()}, path)
    for fn in (payload_file.check, payload_file.load):
        with pytest.raises(CodecError) as err:
            fn(path)
        msg = str(err.value)
        assert msg.count(str(path)) == 1 and "pickled code" in msg
        assert "weights_only" not in msg and "False" not in msg
    assert not sentinel.exists()


def test_damaged_headers_raise_codec_error_only(tmp_path):
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        codec.save_to(f, {"x": torch.arange(10), "s": ["a", {"b": (1.5, b"z", 2j)}]})
    data = path.read_bytes()
    hlen = struct.unpack_from("<Q", data, 16)[0]
    g = np.random.default_rng(0)
    bad = tmp_path / "bad.pt"
    raised = {payload_file.load: 0, payload_file.check: 0}
    trials = 150
    for trial in range(trials):
        mutated = bytearray(data)
        pos = int(g.integers(8, 24 + hlen))
        mutated[pos] = int(g.integers(0, 256))
        bad.write_bytes(bytes(mutated))
        for fn in raised:
            try:
                fn(bad)
            except CodecError:       # anything else (a crash) fails the test
                raised[fn] += 1
    # Most single-byte changes break the preamble, the JSON or a record; the few that survive change
    # a string's letter or a digit (a different, well-formed header). Measured: 143 of 150 raise.
    assert all(n >= 0.9 * trials for n in raised.values()), raised

    def damaged(offset: int, value: bytes) -> None:
        mutated = bytearray(data)
        mutated[offset:offset + len(value)] = value
        bad.write_bytes(bytes(mutated))
        for fn in raised:
            with pytest.raises(CodecError, match=str(bad)):
                fn(bad)

    damaged(8, struct.pack("<I", 99))                                  # a newer format version
    damaged(16, struct.pack("<Q", len(data) + 1))                      # header longer than the file
    damaged(24, b"[")                                                  # not JSON
    damaged(24 + data[24:24 + hlen].index(b"[10],0,80") + 1, b"99")   # a tensor past the end of the file
    damaged(24 + data[24:24 + hlen].index(b'"T":0') + 4, b"7")         # a tensor index with no tensor
    damaged(24 + data[24:24 + hlen].index(b"int64"), b"qint8")         # a dtype never written


def test_tensor_bytes_are_stored_raw_and_mapped_on_load(tmp_path):
    t = torch.arange(1 << 16, dtype=torch.int32)
    path = tmp_path / "p.pt"
    with open(path, "wb") as f:
        n = codec.save_to(f, {"t": t})
    assert n == os.path.getsize(path)
    assert t.numpy().tobytes() in path.read_bytes()
    out = payload_file.load(path)["t"]
    out.add_(1)  # private mapping: the loaded tensor is writable and the file is unchanged
    assert torch.equal(payload_file.load(path)["t"], t)
    assert torch.equal(payload_file.load(path, mmap=False)["t"], t)
