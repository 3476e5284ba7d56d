"""`skip-harness replay PACK -- COMMAND` and the pytest fixture `skip_harness_replay`, as a user runs them:
real subprocesses of scripts/train.py with the tiny overrides, a recorded namespace directory as PACK."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import subprocess_env
from skip_harness.demo import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
TINY = [*TINY_OVERRIDES, "trainer.total_training_steps=3", "trainer.torch_threads=1"]
LR2 = "actor_rollout_ref.actor.optim.lr=0.006"    # the demo's default is 0.003

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("replay_command")]

_RECORDED: dict = {}


def recording(tmp_path_factory, tmp_path: Path) -> Path:
    """A 3-step recording of the tiny demo (made once per worker), copied into tmp_path: its namespace."""
    if "src" not in _RECORDED:
        src = tmp_path_factory.mktemp("replay_recording")
        env = {**subprocess_env(), "SKIP_HARNESS_DUMP_DIR": str(src / "cache")}
        proc = subprocess.run([sys.executable, str(TRAIN), f"hydra.run.dir={src / 'run'}", *TINY], cwd=src, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _RECORDED["src"] = src
    shutil.copytree(_RECORDED["src"] / "cache", tmp_path / "cache", symlinks=True)
    (ns,) = (tmp_path / "cache").glob("*/GBS*")
    return ns


def trainer(tmp_path: Path, *overrides: str) -> list:
    return [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / 'replay_run'}", *TINY, *overrides]


def replay(tmp_path: Path, pack: Path, *overrides: str, flags: tuple = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "skip_harness.cli", "replay", str(pack), *flags, "--", *trainer(tmp_path, *overrides)]
    return subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)


def verdict(proc: subprocess.CompletedProcess) -> str:
    """The verdict line the command prints (stdout; the trainer's own log lines are Hydra's, on stdout too)."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("skip-harness replay ")]
    assert lines, f"no verdict printed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return lines[0]


def test_replay_passes_catches_a_changed_lr_and_bless_accepts_it(tmp_path_factory, tmp_path):
    pack = recording(tmp_path_factory, tmp_path)
    same = replay(tmp_path, pack)
    assert same.returncode == 0, same.stdout + same.stderr
    assert verdict(same).endswith("replay: 3 of 3 served steps reproduced (6 values each)")

    changed = replay(tmp_path, pack, LR2)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    line = verdict(changed)
    # the first diverging step and key, both values, and the training-side change that explains it
    assert re.search(r"replay diverged at step \d+: \w+ [-\d.e]+ recorded, [-\d.e]+ now", line), line
    assert "actor_rollout_ref.actor.optim.lr: 0.003 -> 0.006" in line
    assert "--bless" in changed.stdout

    blessed = replay(tmp_path, pack, LR2, flags=("--bless",))
    assert blessed.returncode == 0, blessed.stdout + blessed.stderr
    assert "blessed:" in verdict(blessed) and "actor_rollout_ref.actor.optim.lr 0.003 -> 0.006" in verdict(blessed)
    (entry,) = json.loads((pack / ".values" / "blessed.json").read_text())["blessings"]
    assert entry["steps"] == [1, 2, 3] and "0.003 -> 0.006" in entry["reason"]

    again = replay(tmp_path, pack, LR2)
    assert again.returncode == 0, again.stdout + again.stderr
    back = replay(tmp_path, pack)      # the recording now expects lr 0.006's values
    assert back.returncode == 1 and "actor_rollout_ref.actor.optim.lr: 0.006 -> 0.003" in verdict(back)


def test_a_step_the_recording_lacks_is_generated_and_fails_with_exit_2_naming_it(tmp_path_factory, tmp_path):
    pack = recording(tmp_path_factory, tmp_path)
    proc = replay(tmp_path, pack, "trainer.total_training_steps=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "step 4 was generated, not served from" in verdict(proc), verdict(proc)
    assert "miss: not in the recording" in verdict(proc)


def test_a_replay_check_the_config_turns_off_is_no_pass(tmp_path_factory, tmp_path):
    pack = recording(tmp_path_factory, tmp_path)
    proc = replay(tmp_path, pack, LR2, "skip.rollout_tq.replay_check=off")   # a set key wins over the env
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "skip.rollout_tq.replay_check is off" in verdict(proc)


def test_bad_input_is_exit_2_with_one_line(tmp_path):
    env = subprocess_env()

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "skip_harness.cli", "replay", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    missing = cli(str(tmp_path / "nowhere"), "--", sys.executable, "-c", "pass")
    assert missing.returncode == 2 and f"PACK: {tmp_path / 'nowhere'} does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    (tmp_path / "cache" / "e_p" / "GBS8_N2_in6_out6").mkdir(parents=True)
    pack = tmp_path / "cache"
    nothing = cli(str(pack))
    assert nothing.returncode == 2 and "no COMMAND to run" in nothing.stderr
    plain = cli(str(pack), "--", sys.executable, "-c", "pass")      # not a trainer built on skip_harness
    assert plain.returncode == 2 and "no skip_harness run reported a replay" in plain.stdout, plain.stdout + plain.stderr
    failing = cli(str(pack), "--", sys.executable, "-c", "raise SystemExit(3)")
    assert failing.returncode == 2 and "exited 3 before any skip_harness run reported" in failing.stdout
    absent = cli(str(pack), "--", str(tmp_path / "no-such-program"))
    assert absent.returncode == 2 and "could not run" in absent.stdout


def test_the_pytest_fixture_fails_with_the_verdict_and_passes_after_bless(tmp_path_factory, tmp_path):
    """The fixture through the plugin module (`-p`: the entry point registers only with `pip install`;
    `-p no:skip_harness` keeps an installed one from loading it twice)."""
    pack = recording(tmp_path_factory, tmp_path)
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_keep.py").write_text(textwrap.dedent(f"""
        def test_training_side_unchanged(skip_harness_replay):
            skip_harness_replay({str(pack)!r}, {trainer(tmp_path, LR2)!r})
    """))

    def pytest_run(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:skip_harness",
               "-p", "skip_harness.testing.pytest_plugin", "--rootdir", str(inner), str(inner / "test_keep.py"), *flags]
        return subprocess.run(cmd, cwd=inner, env=subprocess_env(), capture_output=True, text=True, timeout=600)

    failed = pytest_run()
    assert failed.returncode == 1, failed.stdout + failed.stderr
    message = next(line for line in failed.stdout.splitlines() if "skip_harness_replay " in line)
    assert re.search(r"replay diverged at step \d+: \w+ [-\d.e]+ recorded, [-\d.e]+ now", message), message
    assert "actor_rollout_ref.actor.optim.lr: 0.003 -> 0.006" in message
    assert "pytest --skip-harness-bless" in failed.stdout
    blessed = pytest_run("--skip-harness-bless")
    assert blessed.returncode == 0, blessed.stdout + blessed.stderr
    passed = pytest_run()
    assert passed.returncode == 0, passed.stdout + passed.stderr
