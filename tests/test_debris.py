"""Issue 40: what readers killed mid-write leave beside the steps -- '.tmp-' files under `.values/runs/` (a
replay's values) and `.tier/` (second-tier entries) -- is removed by the next holder's startup and said in
its startup line; a file that may still be written (young, or its writer alive on this host) is kept.

Real files and real processes: each temporary file is made by a process that opened it under the name the
store gives (`tmp_name`: it carries the writer's pid), wrote part of it and was killed (SIGKILL) -- or,
for the live reader, is still there, stopped in the middle of its write.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import write_step
from skip_harness.config import RolloutTQConfig
from skip_harness.run.startup import prepare_namespace
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.open import open_store

_WRITER = """
import os, sys, time
from skip_harness.store.posix.fileops import tmp_name
d, final = sys.argv[1], sys.argv[2]
os.makedirs(d, exist_ok=True)
name = tmp_name(final)
with open(os.path.join(d, name), "wb") as f:
    f.write(b'{"format": 1, "val')       # half a record
    f.flush()
    print(name, flush=True)
    time.sleep(600)
"""


def _writer(directory, final):
    """A process in the middle of writing `final` in `directory`: (process, its temporary file)."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), final], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name.startswith(".tmp-"), name
    return proc, directory / name


def _killed(directory, final, age_s):
    proc, path = _writer(directory, final)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_holders_startup_removes_what_killed_readers_left_and_never_a_live_readers_file(tmp_path):
    st = open_store(NamespaceKey("exp", "proj", 8, 2, 4, 4).layout(tmp_path / "cache"))
    layout = st.layout
    write_step(st, 1)
    root = layout.root
    runs = root / ".values" / "runs" / "20261204T190000Z-vm-4242"
    tier = root / ".tier" / "1" / "reward" / "0123abcd"
    old = 2 * 3600                                             # past the age test's 10 minutes
    dead_values = _killed(runs, "2.json", old)                 # a replay killed while it wrote its values
    dead_tier = _killed(tier, "0-r0.tensors", old)              # ... while it stored a step's rewards
    young = _killed(runs, "3.json", 5)                          # too young to tell from a write in flight
    live, in_flight = _writer(tier, "0-r0.json")                # a live reader, stopped in its write
    try:
        live.send_signal(signal.SIGSTOP)
        os.utime(in_flight, (time.time() - old, time.time() - old))
        (runs / "1.json").write_text("{}")                      # what the replays did write stays
        startup = prepare_namespace(layout, RolloutTQConfig(enable=True))
        try:
            line = startup.describe()
        finally:
            startup.release()
        assert not dead_values.exists() and not dead_tier.exists()
        assert young.exists() and in_flight.exists() and (runs / "1.json").exists()
        assert set(startup.cleanup.leftovers) == {dead_values, dead_tier}
        assert line.endswith("; removed 2 leftovers of interrupted writes (36 B)"), line
        assert "1 complete" in line
    finally:
        live.send_signal(signal.SIGCONT)
        live.kill()
        live.wait()
