"""Shared helpers for the storage tests: real namespaces in tmp_path, real subprocesses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

# verl's own skip tests (tests/verl_upstream) run only in the subprocess tests/test_verl_upstream.py starts
# with the plug-in loaded. Ignoring the folder here keeps its conftest out of a plain run: otherwise it
# takes the module name `conftest`, and `from conftest import ...` inside a test then finds the wrong one.
if os.environ.get("SKIP_HARNESS_VERL_UPSTREAM") != "1":
    collect_ignore = ["verl_upstream"]

REPO = Path(__file__).resolve().parents[1]

# The CLI's tables are rich's: with no terminal to measure, rich wraps at 80 columns, and a pytest-xdist
# worker has none (its stdin is execnet's pipe), so `-n 2` split the tables' rows the tests read
# (tests/test_cli.py, test_cli_show_export.py, test_view_diff.py). One wide width for every run, as on a
# wide terminal; a width set outside is kept. Subprocesses inherit it.
os.environ.setdefault("COLUMNS", "200")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Each test starts on one torch thread (an in-process demo run sets its own count, as train.py does).
    The suite shares two cores with its subprocesses, and under pytest-xdist (.ci/run) with another
    worker: there OpenMP's spinning threads cost up to 20x (test_reward_rises took 2 s on one thread and
    40 s on two while another process kept a core busy). Subprocesses choose their own threads."""
    torch.set_num_threads(1)
    yield


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def batch(step: int, inner: int, rank: int = 0, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(1000 * step + 10 * inner + rank)
    return {"x": torch.randn(n, 3, generator=g), "ids": torch.arange(n) + step, "tag": f"s{step}i{inner}r{rank}"}


def write_step(store, step: int, fingerprint=None, commit: bool = True, inners=None, ranks=None):
    """Write (and by default commit) a step through StepStore; returns the entries."""
    lay = store.layout
    entries = []
    for i in range(lay.K) if inners is None else inners:
        for r in range(lay.W) if ranks is None else ranks:
            entries += store.writer.write_inner(step, i, r, batch(step, i, r), {"note": "test"})
    if commit:
        store.writer.commit(step, entries, fingerprint)
    return entries


def write_legacy(layout, step: int, form: str = "") -> dict:
    """An older cache's step: torch.save'd payload + a meta.json without our writer mark, no commit.
    form "" -> {step}/tq_batch.pt (K = 1) or {step}/{i}/..., "0/" -> {step}/0/tq_batch.pt (K = 1)."""
    payloads = {}
    for i, r, prel, mrel in layout.expected_rels():
        if form:
            prel, mrel = layout.legacy_k1_rel(r)
        p = layout.step_dir(step) / prel
        p.parent.mkdir(parents=True, exist_ok=True)
        payloads[(i, r)] = batch(step, i, r)
        torch.save(payloads[(i, r)], p)
        (layout.step_dir(step) / mrel).write_text(json.dumps({"global_steps": step}))
    return payloads


def assert_batch_equal(a, b):
    assert type(a) is type(b)
    assert list(a) == list(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
        else:
            assert a[k] == b[k]


class HolderProcess:
    """A real process that takes a namespace lock, says so, and sleeps until killed."""

    def __init__(self, layout):
        code = textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path
            from skip_harness.store.layout import Layout
            from skip_harness.store.posix.lock import NamespaceLock
            lock = NamespaceLock(Layout(Path({str(layout.root)!r}), K={layout.K}, W={layout.W}))
            lock.acquire()
            sys.stdout.write("ready\\n"); sys.stdout.flush()
            time.sleep(600)
            """
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                     env=subprocess_env())
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"lock holder did not start: {line!r}"
        self.pid = self.proc.pid

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture
def lock_holder():
    holders = []

    def start(layout) -> HolderProcess:
        h = HolderProcess(layout)
        holders.append(h)
        return h

    yield start
    for h in holders:
        h.kill()


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False



# Under CI (`.ci/run` installs every extra: verl, TransferQueue, tensordict, obstore, moto) an extra that
# does not import is a broken install, not an optional one: importorskip raises instead of skipping, so
# the run fails loudly (a collection error at module level, a failed test inside one).
if os.environ.get("CI"):
    _importorskip = pytest.importorskip

    def _import_or_fail(modname, *args, **kwargs):
        try:
            return _importorskip(modname, *args, **kwargs)
        except pytest.skip.Exception as exc:
            raise ImportError(f"{exc.msg} (CI installs every extra: a missing one fails the run)") from None

    pytest.importorskip = _import_or_fail
