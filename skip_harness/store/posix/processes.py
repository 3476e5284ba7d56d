"""Whether a process of this host still runs, told apart from a later process that reused its pid (Linux
/proc: when it started). For a holder or a reader record read from a namespace: the record says when the
run started; a process that started later is not that run."""
from __future__ import annotations

import os
from typing import Optional

_START_SLACK_S = 2.0       # clock granularity between a process's start and what it recorded


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _started(pid: int) -> Optional[float]:
    """When process `pid` started (Linux /proc), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        boot = _boot_time()
        return None if boot is None else boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def process_runs_since(pid: int, since: Optional[float]) -> bool:
    """Process `pid` of this host runs, and is not a later process that reused the pid (it started no
    later than `since`, when both are known)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = _started(pid)
    return started is None or since is None or started <= since + _START_SLACK_S
