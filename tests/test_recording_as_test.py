"""A recording kept as a test (issue 39), end to end with a pack file:

- tests/data/demo_tiny.pack is a pack of the demo (3 steps of the tests' tiny config), made with
  `skip-harness pack` and committed: the demo's training side is guarded by replaying it through the pytest
  fixture `skip_harness_replay` (the plugin the package installs, entry point `pytest11`), in whatever clone
  the suite runs -- the pack is portable or this fails. Its values say what machine computed them
  (run/machine.py): compared exactly where the replay runs on that machine (same K and W), within rounding
  noise on another -- a pack recorded on one CPU once diverged on another at step 1 (approx_kl 7.0e-16
  against 8.1e-15), which is noise, not a changed training side;
- `skip-harness replay` on a copy of that pack: reproduced (exit 0), the learning rate x 1.01 caught at its
  first diverging step naming the key and the change (exit 1), `--bless` (exit 0, the pack says when and why
  it was blessed, and its values the machine that computed them), then the changed run passes and the
  unchanged one is the divergence.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from skip_harness.demo import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
PACK = ROOT / "tests" / "data" / "demo_tiny.pack"
STEPS = 3


def demo(tmp_path: Path, *extra: str) -> list:
    """The demo as recorded into the pack, its run directory in tmp_path (never under the clone)."""
    return [sys.executable, str(ROOT / "scripts" / "train.py"), *TINY_OVERRIDES, f"trainer.total_training_steps={STEPS}",
            f"hydra.run.dir={tmp_path / 'run'}", *extra]


@pytest.mark.slow
def test_the_committed_pack_guards_the_demos_training_side(skip_harness_replay, tmp_path):
    verdict = skip_harness_replay(PACK, demo(tmp_path), cwd=tmp_path)
    assert verdict.code == 0 and f"{STEPS} of {STEPS} served steps reproduced" in verdict.line, verdict.line


def _pack_machine(pack: Path) -> Optional[Dict[str, str]]:
    """The machine a pack's step 2 values were computed on (run/machine.py)."""
    from skip_harness.store.api import ValuesStore, namespaces_at, open_namespace

    values = ValuesStore(open_namespace(namespaces_at(pack)[0])).read_step(2)
    return None if values is None else values.machine


def skip_harness(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skip_harness.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_replay_a_pack_pass_fail_bless_pass(tmp_path):
    pack = tmp_path / "mine.pack"
    shutil.copyfile(PACK, pack)
    ok = skip_harness(tmp_path, "replay", str(pack), "--json", "--", *demo(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc = json.loads(ok.stdout)
    assert f"replay: {STEPS} of {STEPS} served steps reproduced" in doc["verdict"], doc["verdict"]
    here = doc["runs"][0]["machine"]               # the machine the demo's process computes on (its threads)

    lr = "actor_rollout_ref.actor.optim.lr=0.00303"          # the recorded 0.003, x 1.01
    caught = skip_harness(tmp_path, "replay", str(pack), "--", *demo(tmp_path, lr))
    assert caught.returncode == 1, caught.stdout + caught.stderr
    how = "exact" if _pack_machine(pack) == here else "within rounding noise (32 x float32 eps)"
    assert f"replay diverged at step 2: loss 0.0358026 recorded, 0.0357533 now ({how})" in caught.stdout, caught.stdout
    assert "training side changed: actor_rollout_ref.actor.optim.lr 0.003 -> 0.00303" in caught.stdout

    blessed = skip_harness(tmp_path, "replay", str(pack), "--bless", "--", *demo(tmp_path, lr))
    assert blessed.returncode == 0, blessed.stdout + blessed.stderr
    assert "blessed:" in blessed.stdout and "actor_rollout_ref.actor.optim.lr 0.003 -> 0.00303" in blessed.stdout
    assert _pack_machine(pack) == here       # the blessed values' machine: the replay's
    listed = skip_harness(tmp_path, "ls", str(pack))
    assert listed.returncode == 0 and "blessed" in listed.stdout and "never blessed" not in listed.stdout, listed.stdout

    now_ok = skip_harness(tmp_path, "replay", str(pack), "--", *demo(tmp_path, lr))
    assert now_ok.returncode == 0, now_ok.stdout + now_ok.stderr
    old = skip_harness(tmp_path, "replay", str(pack), "--", *demo(tmp_path))
    assert old.returncode == 1 and "actor_rollout_ref.actor.optim.lr 0.00303 -> 0.003" in old.stdout, old.stdout
    assert PACK.read_bytes() != pack.read_bytes()                # the copy was blessed, never the committed pack


TRAINER_THAT_DIES = '''
import os, sys, torch
from skip_harness import SkipHarness
from skip_harness.errors import ReplayDivergedError

class Loop:
    def generate(self, step):
        g = torch.Generator().manual_seed(step)
        return {"ids": torch.randint(0, 100, (4, 8), generator=g)}

loop = Loop()
h = SkipHarness.create({"enable": True}, namespace={"experiment_name": "dies", "project_name": "t", "K": 1, "n": 4})
h.wrap(loop, sample="generate", prepare_data=None)
lr = float(sys.argv[1])
try:
    for step in (1, 2):
        batch = loop.generate(step)
        h.observe(step, loss=float(batch["ids"].float().mean()) * lr)
except ReplayDivergedError:
    os._exit(1)        # as Ray ends verl's TaskRunner: no close(), no exit handler
h.close()
'''


@pytest.mark.slow
def test_a_trainer_that_dies_of_the_divergence_is_still_judged_diverged(tmp_path):
    """verl's TaskRunner dies of the replay check's error inside Ray, before the harness closes: the report
    is written when the check stops the run, so `skip-harness replay` says diverged (1), not 'reported
    nothing' (2)."""
    script = tmp_path / "dies.py"
    script.write_text(TRAINER_THAT_DIES)
    env_dump = {**os.environ, "SKIP_HARNESS_DUMP_DIR": str(tmp_path / "cache")}
    rec = subprocess.run([sys.executable, str(script), "1.0"], cwd=tmp_path, env=env_dump, capture_output=True,
                         text=True, timeout=300)
    assert rec.returncode == 0, rec.stderr
    (ns,) = (tmp_path / "cache" / "dies_t").iterdir()
    same = skip_harness(tmp_path, "replay", str(ns), "--", sys.executable, str(script), "1.0")
    assert same.returncode == 0, same.stdout + same.stderr
    other = skip_harness(tmp_path, "replay", str(ns), "--", sys.executable, str(script), "1.01")
    assert other.returncode == 1, other.stdout + other.stderr
    assert "replay diverged at step 1: loss" in other.stdout, other.stdout


@pytest.mark.slow
def test_replay_json_is_one_document_on_stdout(tmp_path):
    """`--json` prints the verdict alone on stdout: the trainer's own output goes to stderr."""
    import json

    done = skip_harness(tmp_path, "replay", str(PACK), "--json", "--", *demo(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["exit"] == 0 and f"{STEPS} of {STEPS} served steps reproduced" in doc["verdict"]
