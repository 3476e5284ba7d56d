"""The run's accounting adds up: every decided step once, every miss committed or not with its reason,
bytes counted alike on write and read, gen_s only for generation — checked against the log lines."""
from __future__ import annotations

import dataclasses
import errno
import logging
import re
import sys

import pytest
import torch

from skip_harness import HarnessCallback, SkipHarness
from skip_harness.store.writer import StepWriter


class Records(HarnessCallback):
    def __init__(self):
        self.records = []

    def on_step_end(self, *, record, **kw):
        self.records.append(record)


class Unregistered:  # a payload type the codec refuses
    pass


class Loop:
    def __init__(self, refuse_step=None):
        self.refuse_step = refuse_step
        self.generated = 0

    def prepare_data(self, step, *, dispatch=True):
        pass

    def sample(self, step):
        self.generated += 1
        if step == self.refuse_step:
            return {"x": Unregistered()}
        return {"x": torch.arange(256, dtype=torch.float32) + step}


def run(tmp_path, plan, caplog, **settings):
    """plan: {step: number of sample calls}; returns (summary, per-step lines, summary line)."""
    t = Loop(refuse_step=settings.pop("refuse_step", None))
    rec = Records()
    h = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c"), **settings},
                           namespace={"experiment_name": "e", "project_name": "p", "K": 2}, callbacks=[rec])
    h.wrap(t)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        for step, calls in plan.items():
            t.prepare_data(step)
            for _ in range(calls):
                t.sample(step)
        summary = h.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "skip_harness"]
    steps = [l for l in lines if re.match(r"step \d+: ", l)]
    (line,) = [l for l in lines if l.startswith("rollout cache summary")]
    assert [r.step for r in rec.records] == [int(l.split(":")[0].split()[1]) for l in steps]
    run.records = rec.records
    return summary, steps, line


def test_summary_adds_up_with_a_failed_write_a_refused_payload_and_a_short_step(tmp_path, caplog, monkeypatch):
    real = StepWriter.stage_inner

    def stage_inner(self, step, inner, *a, **k):
        if step == 2 and inner == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, inner, *a, **k)

    monkeypatch.setattr(StepWriter, "stage_inner", stage_inner)
    plan = {1: 2, 2: 2, 3: 2, 4: 1, 5: 2}
    s, steps, line = run(tmp_path, plan, caplog, refuse_step=3)
    assert [int(l.split(":")[0].split()[1]) for l in steps] == [1, 2, 3, 4, 5]  # one line each, in order
    assert sum("committed" in l and "not committed" not in l for l in steps) == s.committed == 2
    assert "not committed (write failed: OSError" in steps[1]
    assert "not committed (payload refused:" in steps[2] and "Unregistered" in steps[2]
    assert "not committed (short step: 1 of K = 2 sample calls)" in steps[3]
    assert (s.misses, s.committed, s.uncommitted) == (5, 2, 3)
    assert s.uncommitted_reasons == {"payload refused": 1, "short step": 1, "write failed": 1}
    assert "5 misses (2 committed, 3 not: 1 payload refused, 1 short step, 1 write failed)" in line
    written = {r.step: r.bytes for r in run.records}
    assert s.bytes_written == sum(written.values()) and written[1] > 0 and written[2] > 0  # step 2's first write landed
    assert written[3] == 0  # nothing of a refused payload was written

    monkeypatch.setattr(StepWriter, "stage_inner", real)
    s2, steps2, line2 = run(tmp_path, plan, caplog, refuse_step=3)
    kinds = [l.split(":")[1].split(",")[0].strip() for l in steps2]
    assert kinds == ["hit", "miss", "miss", "miss", "hit"]
    assert (s2.hits, s2.misses) == (2, 3)
    assert s2.bytes_read == written[1] + written[5]  # read back exactly what the committed steps wrote


@pytest.mark.skipif(not 0 < getattr(sys, "get_int_max_str_digits", lambda: 0)() <= 5000,
                    reason="no int digit limit below 5,001 digits in this interpreter (PYTHONINTMAXSTRDIGITS)")
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_an_int_too_long_for_json_is_a_payload_refused_by_its_path_in_either_form(tmp_path, caplog, compression):
    """An int whose decimal text is over Python's limit (sys.get_int_max_str_digits) cannot go into the
    header: the step is refused naming where it is, as a payload of an unknown type is -- also when the
    header is laid out on the writer thread (zstd) -- and nothing of it is left on disk."""
    class Long(Loop):
        def sample(self, step):
            batch = super().sample(step)
            return {**batch, "tags": {"seed": 10 ** 5000 if step == 2 else 1}}

    t, h = Long(), SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c"), "compression": compression},
                                       namespace={"experiment_name": "e", "project_name": "p"})
    h.wrap(t)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        for step in (1, 2, 3):
            t.prepare_data(step)
            t.sample(step)
        s = h.close()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 2:")]
    assert "not committed (payload refused: payload['tags']['seed']: an int of more than" in line
    assert (s.committed, s.uncommitted_reasons) == (2, {"payload refused": 1})
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file() and "/2/" in str(p)]


@dataclasses.dataclass
class _Meta:  # a registered type holding a plain value (as verl's DataProto keeps its meta_info)
    info: dict


@pytest.mark.skipif(not 0 < getattr(sys, "get_int_max_str_digits", lambda: 0)() <= 5000,
                    reason="no int digit limit below 5,001 digits in this interpreter (PYTHONINTMAXSTRDIGITS)")
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_too_long_int_inside_a_tensordict_or_registered_object_is_named_by_the_users_path(
        tmp_path, caplog, compression):
    """Inside a TensorDict, a NonTensorStack or a registered object, the refused int is named as the user
    reaches it (`['td']['seed']`, `['td']['chat'][1]['n']`, `.info['k']`), not by the encoding's keys
    (`['values'][1]['value']`)."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    from skip_harness import register_type
    from skip_harness.codec import unregister_type

    big = 10 ** 5000
    payloads = {
        2: {"td": TensorDict({"x": torch.zeros(2), "seed": NonTensorData(big, batch_size=[2])}, batch_size=[2])},
        3: {"td": TensorDict({"x": torch.zeros(2), "chat": NonTensorStack({"n": 1}, {"n": big})}, batch_size=[2])},
        4: {"meta": _Meta({"k": [1, big]})},
        5: {"td": TensorDict({"x": torch.zeros(2)}, batch_size=[2]), "tags": {big: 1}},
    }

    class Long(Loop):
        def sample(self, step):
            return payloads.get(step) or super().sample(step)

    register_type(_Meta)
    try:
        t, h = Long(), SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c"), "compression": compression},
                                           namespace={"experiment_name": "e", "project_name": "p"})
        h.wrap(t)
        with caplog.at_level(logging.INFO, logger="skip_harness"):
            for step in (1, 2, 3, 4, 5):
                t.prepare_data(step)
                t.sample(step)
            s = h.close()
    finally:
        unregister_type(_Meta)
    lines = {step: [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"step {step}:")][0]
             for step in (2, 3, 4, 5)}
    for step, where in ((2, "payload['td']['seed']"), (3, "payload['td']['chat'][1]['n']"),
                        (4, "payload['meta'].info['k'][1]"), (5, "payload['tags'] (a key)")):
        assert f"not committed (payload refused: {where}: an int of more than" in lines[step], lines[step]
    assert (s.committed, s.uncommitted_reasons) == (1, {"payload refused": 4})


def test_bytes_are_counted_alike_on_write_and_read_and_a_hit_spends_no_generation(tmp_path, caplog):
    s1, _, _ = run(tmp_path, {1: 2, 2: 2}, caplog)
    s2, steps, line = run(tmp_path, {1: 2, 2: 2}, caplog)
    assert s1.bytes_written > 0 and s2.bytes_read == s1.bytes_written
    assert s2.hits == 2 and s2.gen_s_spent == 0.0 and s2.load_s > 0
    assert abs(s2.gen_s_saved - s1.gen_s_spent) < 1e-5  # recorded generation time, rounded to 1 us per batch
    assert all("loaded" in l for l in steps)


def test_a_steps_logged_bytes_are_the_size_ls_shows_for_it(tmp_path, caplog, capsys):
    """Per-step lines and the summary count a step as `skip-harness ls` does: its files on disk, payloads,
    meta.json files and the commit record (they used to count payloads only: 824.6 vs 825.7 KiB)."""
    import json

    from skip_harness.run.callbacks import describe_step
    from skip_harness.cli import main as cli

    run(tmp_path, {1: 2, 2: 2}, caplog)
    written = {r.step: r.bytes for r in run.records}
    first_lines = [describe_step(r) for r in run.records]
    assert all(r.committed for r in run.records)
    run(tmp_path, {1: 2, 2: 2}, caplog)
    read = {r.step: r.bytes for r in run.records}
    capsys.readouterr()
    assert cli(["ls", str(tmp_path / "c"), "--json"]) == 0
    (ns,) = json.loads(capsys.readouterr().out)["namespaces"]
    on_disk = {s["step"]: s["bytes"] for s in ns["steps"]}
    assert written == read == on_disk, (written, read, on_disk)
    from skip_harness.units import human_bytes

    assert all(f"generated {human_bytes(on_disk[r.step])} " in line for r, line in zip(run.records, first_lines))


def test_a_committed_steps_size_comes_from_its_commit_not_a_listing(tmp_path, caplog, monkeypatch, capsys):
    """The trainer's thread never lists a step it just committed to learn its size (a LIST and a GET per
    step on an object store): the commit, on the writer thread, knows every file it lists and its own
    bytes, and the size is the one `skip-harness ls` shows."""
    import json

    from skip_harness.cli import main as cli
    from skip_harness.run.steps import StepRunner
    from skip_harness.store.stepstore import StepStore

    def no_listing(self, step):
        raise AssertionError(f"step {step} listed on the trainer's thread")

    monkeypatch.setattr(StepRunner, "_step_bytes", no_listing)
    monkeypatch.setattr(StepStore, "status", no_listing)
    run(tmp_path, {1: 2, 2: 2, 3: 2}, caplog)
    written = {r.step: r.bytes for r in run.records}
    monkeypatch.undo()
    assert cli(["ls", str(tmp_path / "c"), "--json"]) == 0
    (ns,) = json.loads(capsys.readouterr().out)["namespaces"]
    assert written == {s["step"]: s["bytes"] for s in ns["steps"]}
