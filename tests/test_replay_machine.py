"""A recording replayed on another machine (run/machine.py): its values differ there by rounding noise.

The committed demo pack, recorded on an Intel Xeon VM, read `approx_kl` 7.0e-16 where an AMD EPYC VM computes
8.1e-15 at the same K and W, and the replay check called that a divergence. Each step's values now say what
computed them (torch, the CPU model and capability, the thread count, the CUDA device in use); a replay on
another machine -- or of values that do not say -- is compared within rounding noise and says so, and a real
change is still caught."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from replay_rig import namespace_in
from skip_harness.run.machine import describe, difference, this_machine
from skip_harness.store.layout import VALUES_DIR
from test_replay import plain_run

XEON = {"torch": "2.13.0+cpu", "cpu": "Intel(R) Xeon(R) Platinum 8370C CPU @ 2.80GHz", "cpu_capability": "AVX512",
        "threads": "2", "accelerator": "none"}


def _rewrite_values(root: Path, machine, nudge: float = 0.0) -> None:
    """Each recorded step's values as another machine would have left them: its `machine` (None: the key
    removed, as values recorded before machines were kept), its loss moved by `nudge` relative (an ulp of
    float32 is 1.19e-7)."""
    for path in sorted((root / VALUES_DIR).glob("[0-9]*.json")):
        doc = json.loads(path.read_text())
        if machine is None:
            doc.pop("machine", None)
        else:
            doc["machine"] = machine
        doc["values"]["loss"] *= 1 + nudge
        path.write_text(json.dumps(doc))


def test_each_steps_values_say_what_computed_them(tmp_path):
    plain_run(tmp_path)
    root = namespace_in(tmp_path).root
    doc = json.loads((root / VALUES_DIR / "3.json").read_text())
    assert doc["machine"] == this_machine()
    assert set(doc["machine"]) == {"torch", "cpu", "cpu_capability", "threads", "accelerator"}
    if not torch.cuda.is_initialized():                     # no CUDA context: the accelerator is not asked
        assert doc["machine"]["accelerator"] == "none"
    replay, _ = plain_run(tmp_path)
    run_doc = json.loads((root / VALUES_DIR / "runs" / replay.run_id / "run.json").read_text())
    run_step = json.loads((root / VALUES_DIR / "runs" / replay.run_id / "3.json").read_text())
    assert run_doc["machine"] == run_step["machine"] == this_machine()


def test_rounding_noise_from_another_machine_reproduces_and_a_real_change_does_not(tmp_path):
    plain_run(tmp_path)
    root = namespace_in(tmp_path).root
    # the same machine: one float32 ulp of difference is a divergence (exact, as before)
    _rewrite_values(root, this_machine(), nudge=4e-7)
    _, same = plain_run(tmp_path)
    assert same.replay_line.startswith("replay diverged at step 1 (loss"), same.replay_line

    # recorded on a Xeon: the same difference is rounding noise, and the summary says why it was let through
    _rewrite_values(root, XEON)
    _, other = plain_run(tmp_path)
    here = this_machine()
    assert other.replay_line.startswith("replay: 5 of 5 served steps reproduced (3 values each); computed on another "
                                        f"machine (recorded on {describe(XEON)}: cpu {XEON['cpu']} -> {here['cpu']}"), \
        other.replay_line
    assert other.replay_line.endswith("compared within rounding noise (32 x float32 eps)"), other.replay_line

    # a real change (the learning rate 1% off) is still caught on another machine
    _, changed = plain_run(tmp_path, lr=0.505)
    assert changed.replay_line.startswith("replay diverged at step 2 ("), changed.replay_line


def test_values_that_do_not_say_are_compared_within_rounding_noise_and_the_summary_says_so(tmp_path):
    plain_run(tmp_path)
    _rewrite_values(namespace_in(tmp_path).root, None, nudge=4e-7)      # recorded before machines were kept
    _, summary = plain_run(tmp_path)
    assert summary.replay_line == ("replay: 5 of 5 served steps reproduced (3 values each); the recording does not say "
                                   "which machine computed its values; compared within rounding noise (32 x float32 eps)")


def test_diff_compares_values_from_other_machines_within_rounding_noise(tmp_path, capsys):
    from skip_harness.cli import main

    plain_run(tmp_path)
    replay, _ = plain_run(tmp_path)
    root = namespace_in(tmp_path).root
    _rewrite_values(root, XEON, nudge=4e-7)
    ns = str(root)
    assert main(["diff", ns, f"{ns}@{replay.run_id}"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert f"computed on other machines: cpu {XEON['cpu']} -> {this_machine()['cpu']}" in out, out
    assert "values first differ" not in out
    _rewrite_values(root, this_machine())                                 # one machine: exact again
    assert main(["diff", ns, f"{ns}@{replay.run_id}"]) == 1
    assert "values first differ at step 1: loss" in capsys.readouterr().out


def test_what_differs_between_two_machines_in_words():
    assert difference(XEON, XEON) == ""
    amd = {**XEON, "cpu": "AMD EPYC 7763", "cpu_capability": "AVX2"}
    assert difference(XEON, amd) == f"cpu {XEON['cpu']} -> AMD EPYC 7763, cpu_capability AVX512 -> AVX2"
    assert difference(None, amd) == "the recording does not say which machine computed its values"
    assert describe(amd) == "AMD EPYC 7763 (AVX2), torch 2.13.0+cpu, 2 threads"
    assert describe({**amd, "accelerator": "NVIDIA H100 (CUDA 12.8)"}).endswith(", NVIDIA H100 (CUDA 12.8)")


def test_diff_reads_a_recording_of_several_machines_within_rounding_noise(tmp_path, capsys):
    """A recording resumed on another host: its step 2 computed on a Xeon. `diff` against a replay here compares
    within rounding noise, as the replay check does for that step, rather than by step 1's machine alone."""
    from skip_harness.cli import main

    plain_run(tmp_path)
    replay, _ = plain_run(tmp_path)
    root = namespace_in(tmp_path).root
    path = root / VALUES_DIR / "2.json"
    doc = json.loads(path.read_text())
    doc["machine"], doc["values"]["loss"] = XEON, doc["values"]["loss"] * (1 + 4e-7)
    path.write_text(json.dumps(doc))
    ns = str(root)
    assert main(["diff", ns, f"{ns}@{replay.run_id}"]) == 0
    out = capsys.readouterr().out
    assert "computed on other machines: A's values came from 2 machines" in out, out
