"""The README's promises: its examples run as written, and .ci/run runs its test command."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def example(tag: str) -> str:
    for block in re.findall(r"```python\n(.*?)```", README, flags=re.S):
        if f"# readme-example: {tag}" in block:
            return block
    raise AssertionError(f"no README example tagged {tag}")


def test_plain_dict_example_runs_as_written_and_hits_on_the_second_run(tmp_path):
    code = example("plain-dict").replace("/tmp/skip_harness_example", str(tmp_path / "cache"))
    script = tmp_path / "example.py"
    script.write_text(code)
    first = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    again = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    assert [l.split()[1] for l in first.stdout.splitlines()[:3]] == ["miss"] * 3
    assert [l.split()[1] for l in again.stdout.splitlines()[:3]] == ["hit"] * 3
    assert "hits=3" in again.stdout


def test_ci_runs_the_readmes_test_command():
    commands = re.findall(r"```bash\n(pip install [^\n]*)\n```", README)
    assert len(commands) == 2, commands  # one runs the main job, one passes the tests
    run_cmd, test_cmd = commands
    assert run_cmd.endswith("python scripts/train.py")
    test_part = test_cmd.split("&&")[-1].strip()
    assert test_part in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_trl_example_runs_as_written_and_replays(tmp_path):
    demo = subprocess.run([sys.executable, str(ROOT / "scripts" / "trl_demo.py"), "--workdir", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    code = (example("trl").replace("/tmp/trl_demo/model", str(tmp_path / "demo" / "model"))
            .replace("/tmp/rollouts", str(tmp_path / "rollouts")).replace("/tmp/grpo_out", str(tmp_path / "out")))
    script = tmp_path / "grpo_cached.py"
    script.write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    first = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    again = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert first.returncode == 0 and again.returncode == 0, first.stderr[-3000:] + again.stderr[-3000:]
    assert "misses=4" in first.stdout and "hits=4" in again.stdout, first.stdout + again.stdout
