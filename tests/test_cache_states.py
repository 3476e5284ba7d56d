"""Caches in unusual states at run time: read-only mounts, steps that fail their checksum."""
from __future__ import annotations

import logging
import subprocess

import pytest
import torch

from skip_harness import SkipHarness


class Loop:
    def __init__(self):
        self.generated = 0

    def prepare_data(self, step, *, dispatch=True):
        pass

    def sample(self, step):
        self.generated += 1
        return {"x": torch.arange(64, dtype=torch.float32) * step}


def run(dump_dir, steps, **settings):
    t = Loop()
    h = SkipHarness.create({"enable": True, "dump_dir": str(dump_dir), **settings},
                           namespace={"experiment_name": "e", "project_name": "p", "n": 2})
    h.wrap(t)
    for s in steps:
        t.prepare_data(s)
        t.sample(s)
    return h, t, h.close()


@pytest.fixture
def read_only_view(tmp_path):
    """A bind mount of tmp_path/rw at tmp_path/ro, read-only (as a finished cache on a shared mount)."""
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(rw), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts are not available here")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("read-only remounts are not available here")
        yield rw, ro
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_a_read_only_cache_serves_its_complete_steps_and_writes_nothing(read_only_view, caplog):
    rw, ro = read_only_view
    run(rw, [1, 2])
    stale = rw / "e_p" / "N2" / "7"
    stale.mkdir()
    (stale / "tq_batch.pt").write_bytes(b"half")  # cleanup would remove this on a writable cache
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        h, t, s = run(ro, [1, 2, 3])
    assert [h.outcome(i) for i in (1, 2, 3)] == ["hit", "hit", "miss"] and t.generated == 1
    assert (s.hits, s.misses, s.committed, s.uncommitted_reasons) == (2, 1, 0, {"read-only cache": 1})
    assert stale.exists() and not (rw / "e_p" / "N2" / "3").exists() and not (rw / "e_p" / "N2" / ".lock.holder.json").exists()
    assert caplog.text.count("read-only") >= 1 and "nothing is locked, cleaned or written" in caplog.text


@pytest.mark.parametrize("cleanup", ["delete", "quarantine"])
def test_a_step_failing_its_checksum_is_handled_as_cleanup_says(tmp_path, caplog, cleanup):
    run(tmp_path, [1, 2])
    payload = tmp_path / "e_p" / "N2" / "2" / "tq_batch.pt"
    data = bytearray(payload.read_bytes())
    data[-200] ^= 0x01  # same size: only the checksum can tell
    payload.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        h, t, s = run(tmp_path, [1, 2], cleanup=cleanup)
    assert [h.outcome(1), h.outcome(2)] == ["hit", "miss"] and s.committed == 1
    assert "checksum" in caplog.text and str(payload) in caplog.text
    quarantined = list((tmp_path / "e_p" / "N2" / ".quarantine").glob("2-*")) if cleanup == "quarantine" else []
    assert len(quarantined) == (1 if cleanup == "quarantine" else 0)
    if quarantined:
        assert (quarantined[0] / "tq_batch.pt").read_bytes() == bytes(data)  # kept as it was found


def test_an_empty_read_only_cache_warns_once_and_counts_what_was_generated(read_only_view, caplog):
    _rw, ro = read_only_view
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        h, t, s = run(ro, [1, 2, 3])
    assert [h.outcome(i) for i in (1, 2, 3)] == ["miss"] * 3 and s.uncommitted_reasons == {"read-only cache": 3}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "read-only" in warnings[0] and "nothing will be cached" in warnings[0], warnings
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(steps) == 3 and not any("generated 0 B" in line for line in steps), steps
    assert s.bytes_written == 0   # nothing was written (the summary said "wrote 3.1 KiB" before)
    assert s.bytes_not_written >= 3 * 64 * 4  # at least the tensors' bytes of the three steps generated
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout cache summary")]
    assert "wrote 0 B (" in summary and "generated into a read-only cache, not written)" in summary, summary


def test_a_miss_clears_only_a_step_that_may_have_an_entry(tmp_path, monkeypatch):
    """A run that holds the namespace since its scan knows which steps have an entry: a miss of any other
    step writes it without listing it first (issue 42: a listing on the trainer's thread per miss). A step
    found at startup (here left incomplete, with cleanup off), or named by records beside the steps (its
    discards, left by a removal cut short), is still cleared before it is written: nothing of the old write
    is left beside the new one."""
    from skip_harness.store.writer import StepWriter

    cleared = []
    real = StepWriter.clear_step
    monkeypatch.setattr(StepWriter, "clear_step", lambda self, step: cleared.append(step) or real(self, step))
    run(tmp_path, [1, 2])
    assert cleared == []                       # a fresh namespace: nothing to clear
    stale = tmp_path / "e_p" / "N2" / "3"
    stale.mkdir()
    (stale / "0").mkdir()
    (stale / "0" / "tq_batch.pt").write_bytes(b"an older K=2 write")   # no commit record: incomplete
    orphan = tmp_path / "e_p" / "N2" / ".values" / "discarded-4.json"  # a removal of step 4 cut short
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_text('{"discarded": []}\n')
    h, t, s = run(tmp_path, [1, 2, 3, 4, 5], cleanup="off")
    assert [h.outcome(i) for i in (1, 2, 3, 4, 5)] == ["hit", "hit", "miss", "miss", "miss"] and s.committed == 3
    assert cleared == [3, 4]                   # the step found at startup, the one its records name; never 5
    assert not (stale / "0").exists() and (stale / "commit.json").exists() and not orphan.exists()
