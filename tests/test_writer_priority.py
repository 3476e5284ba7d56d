"""The writer thread (run/coordinator.py `Writer`) runs below the trainer's scheduling priority, so that its
narrowing, dedupe and zstd fill the cores' idle moments instead of stalling the trainer's compute threads
(issue 42: the zstd miss's distance from its floor)."""
from __future__ import annotations

import os
import sys
import threading

import pytest

from skip_harness.run.coordinator import WRITER_NICE, Writer


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
def test_the_writer_thread_runs_below_the_callers_priority():
    mine = _nice()
    if mine >= 19:
        pytest.skip("the tests already run at the lowest priority (nice 19): nothing lower to see")
    writer = Writer(max_pending=2)
    try:
        theirs = writer.submit(_nice).result(timeout=30)
    finally:
        assert writer.close(30)
    assert theirs == min(19, mine + WRITER_NICE)
    assert _nice() == mine                     # the caller's own priority is left as it was


def test_an_inline_writer_leaves_the_callers_priority_alone():
    mine = _nice()
    writer = Writer(max_pending=2, background=False)
    assert writer.submit(_nice).result(timeout=30) == mine
    assert writer.close(30)
