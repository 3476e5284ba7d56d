"""scripts/crash_test.py: kill -9 a K = 4 demo run at random moments, restart, verify, compare metrics.

CI's crash test is the first test below: `.ci/run` sets $SKIP_HARNESS_CRASH_TRIALS (4; 2 when unset) and
$SKIP_HARNESS_CRASH_LOG (a file: the script's trial lines and summary, printed by `.ci/run` after the tests), so
the crash test runs on a pytest-xdist worker beside the other slow tests instead of in a stage of its own, where
it kept the machine's two cores 57% busy."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env
from crash_test import summary_line

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "crash_test.py"

pytestmark = pytest.mark.slow


def crash_test(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--json", "--keep", str(tmp_path / "work"), *args],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=900)


TRIALS = "SKIP_HARNESS_CRASH_TRIALS"
LOG = "SKIP_HARNESS_CRASH_LOG"


def _summary_line(stdout: str) -> str:
    try:
        return summary_line(json.loads(stdout)) + "\n"
    except ValueError:
        return f"crash test: no JSON summary on stdout: {stdout[-2000:]!r}\n"


def test_kills_never_corrupt_and_restarts_give_the_same_metrics(tmp_path):
    trials = int(os.environ.get(TRIALS) or 2)
    proc = crash_test(tmp_path, "--trials", str(trials), "--seed", "3")
    if os.environ.get(LOG):   # the trial lines, and the summary the script prints without --json
        Path(os.environ[LOG]).write_text(proc.stderr + _summary_line(proc.stdout))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["trials"] == trials and report["failures"] == 0 and report["failed_trials"] == []
    assert 0 <= report["kills_mid_write"] <= report["kills"] <= trials
    if trials >= 4:   # every other trial aims at a write (crash_test.py)
        assert report["kills_mid_write"] >= 1, proc.stderr[-3000:]
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
