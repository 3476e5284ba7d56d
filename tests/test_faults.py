"""Faults proven in the suite: a real full disk (a small tmpfs where mount works, else RLIMIT_FSIZE in a
subprocess) and ENOSPC / EIO / EACCES injected at each write call of skip_harness.store.stepstore. Every time:
the run finishes, warns naming the path, commits nothing half-written, leaves no temporary file, the
summary counts the step as uncommitted, and a rerun regenerates exactly the uncommitted steps."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import subprocess_env
from skip_harness.store.open import open_namespace, open_store
from skip_harness import SkipHarness
from skip_harness.store.posix import fileops
from skip_harness.store import stepstore as store_mod
from skip_harness.store.layout import TMP_PREFIX
from skip_harness.store.scan import scan_namespace

K = 2
STEPS = 4
FAIL_STEP = 2


class ToyTrainer:
    """A trainer with the two phases; `size` floats per mini-batch (per step, when a callable)."""

    def __init__(self, size=256):
        self.size = size
        self.generated = []

    def prepare_data(self, step, dispatch=True):
        pass

    def sample(self, step):
        self.generated.append(step)
        n = self.size(step) if callable(self.size) else self.size
        g = torch.Generator().manual_seed(step * 100 + len(self.generated))
        return {"x": torch.randn(n, generator=g), "step": torch.tensor([step])}


def run(dump_dir: Path, trainer: ToyTrainer, steps: int = STEPS, experiment: str = "faults"):
    harness = SkipHarness.create(
        settings={"enable": True, "dump_dir": str(dump_dir)},
        namespace={"experiment_name": experiment, "project_name": "p", "K": K},
        fingerprint={"model": "toy"},
    )
    harness.wrap(trainer, sample="sample")
    outcomes = {}
    try:
        for step in range(1, steps + 1):
            trainer.prepare_data(step)
            for _ in range(K):
                trainer.sample(step)
            outcomes[step] = harness.outcome(step)
        layout = harness.layout
    finally:
        summary = harness.close()
    return summary, layout, outcomes


def temporary_files(root: Path):
    return sorted(str(Path(d, n)) for d, dirs, files in os.walk(root) for n in dirs + files if n.startswith(TMP_PREFIX))


def statuses(layout):
    return {s.step: s.status for s in scan_namespace(layout, open_namespace(layout)).steps}


def assert_nothing_half_written(dump_dir: Path, layout, committed_steps):
    assert temporary_files(dump_dir) == []
    st = statuses(layout)
    assert "corrupt" not in st.values(), st
    assert sorted(s for s, v in st.items() if v == "complete") == sorted(committed_steps)
    for step in committed_steps:
        assert open_store(layout).reader.verify(step)[1] is None


def fault_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("skip_harness")]


# ------------------------------------------------------------------------------ injected faults


def _fd_path(fd) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except (OSError, TypeError):
        return ""


class Injector:
    """Fails the first `call` that writes `target` (payload, meta or commit record) of step FAIL_STEP."""

    NAMES = {"payload": ("tq_batch",), "meta": ("meta",), "commit": ("commit",)}

    def __init__(self, step_dir: str, call: str, target: str, err: int):
        self.step_dir, self.call, self.target, self.err = step_dir, call, target, err
        self.fired = 0

    def matches(self, path: str) -> bool:
        if self.fired or not path:
            return False
        name = os.path.basename(path)
        if not name.startswith(TMP_PREFIX):
            return False
        final = name[len(TMP_PREFIX):]
        in_step = path.startswith(self.step_dir + os.sep)
        return in_step and final.startswith(self.NAMES[self.target])

    def error(self, path: str) -> OSError:
        self.fired += 1
        return OSError(self.err, os.strerror(self.err), path)

    def install(self, monkeypatch):
        real_open, real_fsync, real_replace, real_pwrite = os.open, os.fsync, os.replace, os.pwrite
        injector = self

        def joined(name, dir_fd):
            return os.path.join(_fd_path(dir_fd), name) if dir_fd is not None else os.path.abspath(name)

        def fake_open(path, flags, mode=0o777, *, dir_fd=None):
            full = joined(os.fspath(path), dir_fd)
            if injector.call == "open" and flags & os.O_CREAT and injector.matches(full):
                raise injector.error(full)
            return real_open(path, flags, mode, dir_fd=dir_fd)

        def fake_fsync(fd):
            fd_num = fd if isinstance(fd, int) else fd.fileno()
            path = _fd_path(fd_num)
            if injector.call == "fsync" and injector.matches(path):
                raise injector.error(path)
            return real_fsync(fd)

        def fake_replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            full = joined(os.fspath(src), src_dir_fd)
            if injector.call == "replace" and injector.matches(full):
                raise injector.error(full)
            return real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

        class FailingFile:
            def __init__(self, f, path):
                self._f, self._path = f, path

            def write(self, data):
                if injector.matches(self._path):
                    raise injector.error(self._path)
                return self._f.write(data)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self._f.__exit__(*exc)

        def fake_builtin_open(file, *args, **kwargs):
            f = open(file, *args, **kwargs)
            if injector.call == "write" and isinstance(file, int):
                return FailingFile(f, _fd_path(file))
            return f

        def fake_pwrite(fd, data, offset):   # payloads: written from a pool buffer (O_DIRECT)
            path = _fd_path(fd)
            if injector.call == "write" and injector.matches(path):
                raise injector.error(path)
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "pwrite", fake_pwrite)
        monkeypatch.setattr(os, "fsync", fake_fsync)
        monkeypatch.setattr(os, "replace", fake_replace)
        monkeypatch.setattr(fileops, "open", fake_builtin_open, raising=False)
        return self


CASES = [(call, "payload", err) for call in ("open", "write", "fsync", "replace")
         for err in (errno.ENOSPC, errno.EIO, errno.EACCES)]
CASES += [(call, target, errno.ENOSPC) for call in ("open", "write", "fsync", "replace") for target in ("meta", "commit")]


@pytest.mark.parametrize("call, target, err", CASES,
                         ids=[f"{c}-{t}-{errno.errorcode[e]}" for c, t, e in CASES])
def test_injected_write_fault(tmp_path, monkeypatch, caplog, call, target, err):
    dump = tmp_path / "cache"
    namespace_root = dump / "faults_p" / f"K{K}_W1"
    injector = Injector(str(namespace_root / str(FAIL_STEP)), call, target, err).install(monkeypatch)
    caplog.set_level(logging.WARNING, logger="skip_harness")

    trainer = ToyTrainer()
    summary, layout, outcomes = run(dump, trainer)           # the run finishes
    monkeypatch.undo()
    assert layout.root == namespace_root
    assert injector.fired == 1, "the fault was never injected: the store's write path changed?"
    assert list(outcomes.values()) == ["miss"] * STEPS
    assert summary.misses == STEPS
    assert summary.uncommitted >= 1 and summary.committed == STEPS - 1
    assert sum(summary.uncommitted_reasons.values()) == summary.uncommitted

    warned = [m for m in fault_warnings(caplog) if str(layout.step_dir(FAIL_STEP)) in m]
    assert warned, fault_warnings(caplog)                   # names the path
    assert any(os.strerror(err) in m for m in fault_warnings(caplog)), fault_warnings(caplog)

    committed = [s for s in range(1, STEPS + 1) if s != FAIL_STEP]
    assert_nothing_half_written(dump, layout, committed)

    # the rerun serves the committed steps and regenerates the one that was not
    again = ToyTrainer()
    summary2, _, outcomes2 = run(dump, again)
    assert outcomes2 == {s: ("miss" if s == FAIL_STEP else "hit") for s in range(1, STEPS + 1)}
    assert again.generated == [FAIL_STEP] * K
    assert summary2.uncommitted == 0
    assert_nothing_half_written(dump, layout, range(1, STEPS + 1))


# ------------------------------------------------------------------------------ a real full disk


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return proc.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    if not _mount_tmpfs(mnt, "512k"):
        pytest.skip("mount -t tmpfs needs root (test_file_size_limit covers a full disk without it)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk(small_disk, caplog):
    """A 512 KiB tmpfs: steps of ~2 x 96 KiB fill it within a few steps; the run goes on."""
    caplog.set_level(logging.WARNING, logger="skip_harness")
    trainer = ToyTrainer(size=24 * 1024)   # 96 KiB of float32 per mini-batch
    steps = 6
    summary, layout, outcomes = run(small_disk, trainer, steps=steps)
    assert list(outcomes.values()) == ["miss"] * steps
    assert summary.committed >= 1 and summary.uncommitted >= 1
    assert summary.committed + summary.uncommitted == steps
    assert sum(summary.uncommitted_reasons.values()) == summary.uncommitted
    warnings = fault_warnings(caplog)
    assert any(str(layout.root) in m and os.strerror(errno.ENOSPC) in m for m in warnings), warnings
    st = statuses(layout)
    committed = [s for s, v in st.items() if v == "complete"]
    assert len(committed) == summary.committed
    assert_nothing_half_written(small_disk, layout, committed)


FSIZE_CHILD = textwrap.dedent(
    """
    import json, logging, resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from test_faults import ToyTrainer, run, statuses, fault_warnings

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # else the kernel kills the process at the limit
    limit = 64 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage()) if r.levelno >= logging.WARNING else None
    logging.getLogger("skip_harness").addHandler(handler)
    # steps 1-2 fit under the per-file limit, steps 3-4 do not (EFBIG)
    trainer = ToyTrainer(size=lambda step: 1024 if step <= 2 else 32 * 1024)
    summary, layout, outcomes = run(Path(sys.argv[1]), trainer)
    print(json.dumps({"committed": summary.committed, "uncommitted": summary.uncommitted,
                      "reasons": summary.uncommitted_reasons, "outcomes": list(outcomes.values()),
                      "statuses": statuses(layout), "root": str(layout.root), "warnings": records}))
    """
)


@pytest.mark.slow  # a run in a subprocess under RLIMIT_FSIZE
def test_file_size_limit(tmp_path):
    """RLIMIT_FSIZE in a subprocess: writes past the limit fail with EFBIG, as on a full disk."""
    dump = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(dump), str(Path(__file__).parent)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["outcomes"] == ["miss"] * STEPS
    assert res["committed"] == 2 and res["uncommitted"] == 2
    assert sum(res["reasons"].values()) == 2
    st = {int(k): v for k, v in res["statuses"].items()}
    assert [s for s, v in sorted(st.items()) if v == "complete"] == [1, 2]
    assert "corrupt" not in st.values()
    assert temporary_files(dump) == []
    assert any(res["root"] in m and os.strerror(errno.EFBIG) in m for m in res["warnings"]), res["warnings"]
