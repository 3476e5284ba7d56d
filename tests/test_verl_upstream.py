"""verl's own skip tests (tests/verl_upstream/test_utils_skip.py, from verl's repository) pass with the
plug-in loaded the way a verl user loads it: VERL_USE_EXTERNAL_MODULES, in a fresh process."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("verl")

from conftest import REPO, subprocess_env  # noqa: E402

pytestmark = pytest.mark.verl


def test_verls_own_skip_tests_pass_with_the_plugin_loaded():
    env = subprocess_env()
    env["VERL_USE_EXTERNAL_MODULES"] = "skip_harness.integrations.verl"
    env["SKIP_HARNESS_VERL_UPSTREAM"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", str(REPO / "tests" / "verl_upstream")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rollout_tq=skip_harness.integrations.verl.HarnessRolloutTqSkip" in out, out[:2000]
    assert " passed" in out and "failed" not in out
