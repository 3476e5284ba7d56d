"""store.payload_file: a loose payload file opened by the store (the codec opens nothing)."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from skip_harness import codec
from skip_harness.errors import CodecError
from skip_harness.store import payload_file


def _write(path, payload):
    with open(path, "wb") as f:
        codec.save_to(f, payload)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "tq_batch.pt"
    os.mkfifo(fifo)
    out = {}

    def run():
        try:
            payload_file.check(fifo)
        except CodecError as exc:
            out["err"] = str(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():   # unblock the open so the thread can end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO blocked")
    assert out["err"] == f"{fifo}: not a regular file"


def test_a_symlink_is_never_followed(tmp_path):
    real = tmp_path / "real.pt"
    _write(real, {"x": torch.arange(4)})
    link = tmp_path / "tq_batch.pt"
    link.symlink_to(real)
    for fn in (payload_file.load, payload_file.check, payload_file.stored_fields):
        with pytest.raises(CodecError, match=f"^{link}: cannot be opened"):
            fn(link)
    assert torch.equal(payload_file.load(real)["x"], torch.arange(4))


def test_load_check_and_fields_of_both_formats(tmp_path):
    ours, old = tmp_path / "ours.pt", tmp_path / "old.pt"
    _write(ours, {"x": torch.arange(6, dtype=torch.int64)})
    torch.save({"x": torch.arange(6)}, old)
    for p in (ours, old):
        payload_file.check(p)
        for mapped in (True, False):
            assert torch.equal(payload_file.load(p, mmap=mapped)["x"], torch.arange(6))
    assert [f.dtype for f in payload_file.stored_fields(ours)] == ["int64"]
    assert payload_file.stored_fields(old) == []
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CodecError, match=f"^{empty}: "):
        payload_file.load(empty)


def test_sibling_meta(tmp_path):
    pay = tmp_path / "tq_batch_rank1.pt"
    _write(pay, {"x": torch.arange(2)})
    assert payload_file.sibling_meta(pay) == {}
    (tmp_path / "meta_rank1.json").write_text(json.dumps({"step": 3}))
    assert payload_file.sibling_meta(pay) == {"step": 3}
    (tmp_path / "meta_rank1.json").write_text("[1, 2]")
    assert payload_file.sibling_meta(pay) == {}
    (tmp_path / "meta_rank1.json").unlink()
    (tmp_path / "meta_rank1.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"step": 4}))
    assert payload_file.sibling_meta(pay) == {}
