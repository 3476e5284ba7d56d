"""scripts/fresh_envs.py (CI's stage that installs each extra alone into a new virtualenv): the parts that run
without installing anything. The stage itself runs in .ci/run."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env
from skip_harness.demo import TINY_OVERRIDES

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fresh_envs.py"


def load():
    spec = importlib.util.spec_from_file_location("_fresh_envs_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_its_tiny_demo_is_the_tests_one_and_it_runs_the_readmes_examples_as_written():
    fe = load()
    assert fe.TINY == TINY_OVERRIDES
    text = fe.readme_example("plain-dict")
    assert text.startswith("# readme-example: plain-dict\n") and "SkipHarness.create(" in text
    assert "from trl import GRPOConfig, GRPOTrainer" in fe.readme_example("trl")
    assert set(fe.SMOKES) == set(fe.EXTRAS)


def test_an_unknown_extra_is_a_usage_error_naming_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--extras", "trl,nope", "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "--extras: unknown nope" in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()
