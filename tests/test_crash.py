"""scripts/crash_test.py: kill -9 a K = 4 demo run at random moments, restart, verify, compare metrics."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "crash_test.py"

pytestmark = pytest.mark.slow


def crash_test(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--json", "--keep", str(tmp_path / "work"), *args],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=900)


def test_kills_never_corrupt_and_restarts_give_the_same_metrics(tmp_path):
    proc = crash_test(tmp_path, "--trials", "2", "--seed", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["trials"] == 2 and report["failures"] == 0 and report["failed_trials"] == []
    assert 0 <= report["kills_mid_write"] <= report["kills"] <= 2
    for trial in report["trial_details"]:
        # the restart served every step the kill had left complete
        assert trial["hits_on_restart"] >= len(trial["complete_after_kill"])
    assert "trial 1:" in proc.stderr


def test_the_checks_can_fail(tmp_path):
    """--self-check damages a committed payload after the restart: verify must catch it, the trial
    fails and the script exits 1."""
    proc = crash_test(tmp_path, "--trials", "1", "--self-check")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["failures"] == 1
    [failed] = report["failed_trials"]
    assert any("verify after the restart failed" in why for why in failed["why"])
