"""scripts/verl_cpu/driver.py's kill (tests/test_verl_real.py's killed recording): the whole run is killed and
gone before the caller looks at what it left -- every process of its session, not only the driver's process
group, since Ray gives each worker (the TaskRunner holding the cache among them) a process group of its own."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_cpu import driver

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

# a driver whose worker, as Ray starts one, is in the driver's session but a process group of its own, and
# writes a file a second after it is ready
RUN = """
import subprocess, sys, time
late = sys.argv[1]
worker = ("import sys, time; open(sys.argv[1] + '.ready', 'w').close(); time.sleep(1.0); "
          "open(sys.argv[1], 'w').write('written after the kill')")
subprocess.Popen([sys.executable, "-c", worker, late], process_group=0)
time.sleep(60)
"""


def test_a_killed_run_is_gone_with_its_workers_in_their_own_process_groups(tmp_path):
    late = tmp_path / "late"
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(late)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{late}.ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never started"
            time.sleep(0.01)
        assert len(driver._alive_in_session(proc.pid)) == 2   # the driver and its worker

        driver._kill_session(proc)

        assert proc.returncode == -9
        assert driver._alive_in_session(proc.pid) == []
        time.sleep(1.5)
        assert not late.exists(), "the worker outlived the kill and wrote"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
