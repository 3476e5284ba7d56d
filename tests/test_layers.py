"""The package's layering (pyproject.toml's [tool.importlinter] contracts) and its public import names."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint(cwd: Path, env=None) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    proc = _lint(ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_a_bad_import_breaks_a_contract(tmp_path):
    """The contracts can fail: the store importing the run is reported, with the offending line."""
    shutil.copytree(ROOT / "skip_harness", tmp_path / "skip_harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    layout = tmp_path / "skip_harness" / "store" / "layout.py"
    layout.write_text(layout.read_text() + "\nfrom skip_harness.run import stats  # noqa: E402\n")
    proc = _lint(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "skip_harness.store.layout -> skip_harness.run.stats" in proc.stdout


def test_the_public_import_names_still_work():
    code = (
        "from skip_harness import SkipHarness, HarnessCallback, register_type, NamespaceKey, RunSummary, StepRecord\n"
        "from skip_harness.config import RolloutTQConfig, register_configs, settings_from, rollout_tq_from\n"
        "from skip_harness.hydra_callback import HydraStartupCallback, SweepReport, record_job_failure\n"
        "from skip_harness.integrations.trl import attach\n"
        "from skip_harness.demo.run import validate\n"
        "from skip_harness.cli import main\n"
        "import skip_harness.integrations.verl\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
