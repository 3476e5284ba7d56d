"""End-to-end: `scripts/train.py` run as a user runs it, in real subprocesses, with tiny overrides."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skip_harness.cli import main as cli_main
from skip_harness.demo import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
TINY = [*TINY_OVERRIDES, "trainer.total_training_steps=4"]
MODES = {
    "sync": ["trainer_mode=sync"],
    "colocate_async": ["trainer_mode=colocate_async"],
    "separate_async": ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2"],
}

pytestmark = pytest.mark.slow


def env_for(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env["SKIP_HARNESS_DUMP_DIR"] = str(tmp_path / "cache")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def train(tmp_path: Path, *overrides: str, run: str = "run", check: bool = True, timeout: float = 600,
          launcher: tuple = (sys.executable,)):
    cmd = [*launcher, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY, *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


_RECORDINGS: dict = {}


def recorded(tmp_path_factory, tmp_path: Path, *overrides: str, run: str = "first",
             launcher: tuple = (sys.executable,)) -> None:
    """The run `train(tmp_path, *overrides, run=run)` would make, made once per pytest worker and copied into
    tmp_path (its cache and its run directory): tests that start from the same recording share one run of
    train.py instead of each paying its start-up again (the tests using one carry one xdist_group)."""
    key = (*launcher, *overrides, run)
    if key not in _RECORDINGS:
        src = tmp_path_factory.mktemp("recording")
        train(src, *overrides, run=run, launcher=launcher)
        _RECORDINGS[key] = src
    src = _RECORDINGS[key]
    shutil.copytree(src / "cache", tmp_path / "cache", symlinks=True)
    shutil.copytree(src / run, tmp_path / run, symlinks=True)


def metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training_metrics(rows: list) -> list:
    """Everything but timings (`*_s`) and what was served (`cache`)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "cache"} for r in rows]


def namespaces(tmp_path: Path) -> list:
    return sorted(str(p.relative_to(tmp_path / "cache")) for p in (tmp_path / "cache").glob("*/GBS*"))


SHARED = pytest.mark.xdist_group("train_e2e_recordings")   # the tests starting from one recorded() run


@SHARED
@pytest.mark.parametrize("mode", list(MODES))
def test_first_run_misses_rerun_hits_identically(tmp_path_factory, tmp_path, mode, capsys):
    recorded(tmp_path_factory, tmp_path, *MODES[mode])
    # Outside separate_async the rerun changes parameter_sync_step (4 by default): it does not matter there
    # (it was a fingerprint mismatch naming the key), so the rerun still hits, identically.
    irrelevant = [] if mode == "separate_async" else ["trainer.v1.separate_async.parameter_sync_step=2"]
    train(tmp_path, *MODES[mode], *irrelevant, run="again")
    first, again = metrics(tmp_path / "first"), metrics(tmp_path / "again")
    assert [r["cache"] for r in first] == ["miss"] * 4
    assert [r["cache"] for r in again] == ["hit"] * 4
    assert training_metrics(first) == training_metrics(again)
    log = (tmp_path / "again" / "train.log").read_text()
    # nothing was generated on the rerun (timings are for the benchmark, not for tests)
    assert "4 hits, 0 repeats, 0 misses" in log and "generation 0.0s spent" in log
    # the CLI in-process (its console entry point runs in a subprocess in test_cli.py)
    assert cli_main(["verify", str(tmp_path / "cache"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [ns] = doc["namespaces"]
    assert [s["status"] for s in ns["steps"]] == ["complete"] * 4
    assert ns["K"] == (2 if mode == "separate_async" else 1)


def test_mix_of_hits_and_misses_is_identical_to_an_uncached_run(tmp_path):
    mode = MODES["separate_async"]
    train(tmp_path, *mode, "skip.rollout_tq.enable=false", run="uncached")
    train(tmp_path, *mode, "skip.rollout_tq.steps=[1,3]", run="cache13")
    train(tmp_path, *mode, "skip.rollout_tq.steps=[1,3]", run="hit13")
    train(tmp_path, *mode, run="all")
    base = training_metrics(metrics(tmp_path / "uncached"))
    assert [r["cache"] for r in metrics(tmp_path / "uncached")] == ["off"] * 4
    assert [r["cache"] for r in metrics(tmp_path / "cache13")] == ["miss", "off", "miss", "off"]
    assert [r["cache"] for r in metrics(tmp_path / "hit13")] == ["hit", "off", "hit", "off"]
    assert [r["cache"] for r in metrics(tmp_path / "all")] == ["hit", "miss", "hit", "miss"]
    for run in ("cache13", "hit13", "all"):
        assert training_metrics(metrics(tmp_path / run)) == base, run


@SHARED
def test_stale_partial_step_is_cleaned_and_never_served(tmp_path_factory, tmp_path):
    """An older run left step 2 with inner 0 only, holding other data: cleaned, regenerated, identical."""
    mode = MODES["separate_async"]
    recorded(tmp_path_factory, tmp_path, *mode)
    [ns] = (tmp_path / "cache").glob("*/GBS*")
    step2 = ns / "2"
    (step2 / "commit.json").unlink()
    for name in ("tq_batch.pt", "meta.json"):  # inner 0 of step 2 now holds step 1's inner 1
        (step2 / "0" / name).write_bytes((ns / "1" / "1" / name).read_bytes())
    import shutil

    shutil.rmtree(step2 / "1")
    train(tmp_path, *mode, run="again")
    rows = metrics(tmp_path / "again")
    assert [r["cache"] for r in rows] == ["hit", "miss", "hit", "hit"]
    assert training_metrics(rows) == training_metrics(metrics(tmp_path / "first"))
    log = (tmp_path / "again" / "train.log").read_text()
    assert "1 incomplete [2]" in log and "deleted 1" in log


@SHARED
def test_a_corrupt_step_is_warned_of_once(tmp_path_factory, tmp_path):
    """The Hydra callback's startup warned of a corrupt step, then the harness taking its startup over warned again."""
    recorded(tmp_path_factory, tmp_path, "trainer.total_training_steps=2")
    [ns] = (tmp_path / "cache").glob("*/GBS*")
    (ns / "2" / "commit.json").write_text("garbage")
    train(tmp_path, "trainer.total_training_steps=2", run="again")
    log = (tmp_path / "again" / "train.log").read_text()
    assert "1 corrupt [2]" in log and log.count("corrupt step: commit record does not parse") == 1, log


def test_run_completed_after_a_killed_run_is_identical(tmp_path):
    mode = MODES["separate_async"] + ["trainer.total_training_steps=40"]
    train(tmp_path, *mode, "skip.rollout_tq.enable=false", run="uncached")
    cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / 'killed'}", *TINY, *mode]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:
        while time.time() < deadline and not list((tmp_path / "cache").glob("*/GBS*/3/commit.json")):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = metrics(tmp_path / "killed")
    assert 3 <= len(killed) < 40
    train(tmp_path, *mode, run="resumed")
    rows = metrics(tmp_path / "resumed")
    assert rows[0]["cache"] == "hit" and rows[-1]["cache"] == "miss"
    assert training_metrics(rows) == training_metrics(metrics(tmp_path / "uncached"))


@SHARED
def test_repeat_serves_nearest_complete_step(tmp_path_factory, tmp_path):
    recorded(tmp_path_factory, tmp_path, "trainer.total_training_steps=2")
    train(tmp_path, "skip.rollout_tq.action=repeat", run="rep")
    rows = metrics(tmp_path / "rep")
    assert [r["cache"] for r in rows] == ["hit", "hit", "repeat", "repeat"]
    log = (tmp_path / "rep" / "train.log").read_text()
    assert "step 3: repeat (served step 2)" in log and "step 4: repeat (served step 2)" in log


def test_validation_calls_bypass_the_cache(tmp_path):
    train(tmp_path, "trainer.test_freq=2", run="first")
    again_proc = train(tmp_path, "trainer.test_freq=2", run="again")
    # the replay verdict the README quotes is the one the demo prints (val_reward only on validation steps)
    import re

    quoted = re.search(r"replay: 20 of 20 served\s+steps reproduced \(([^)]*)\)", (ROOT / "README.md").read_text())
    assert quoted and f"replay: 4 of 4 served steps reproduced ({quoted.group(1)})" in again_proc.stderr + again_proc.stdout, (
        quoted, again_proc.stderr[-2000:])
    first, again = metrics(tmp_path / "first"), metrics(tmp_path / "again")
    assert "val_reward" in first[1] and "val_reward" in first[3]
    assert training_metrics(first) == training_metrics(again)
    [ns] = (tmp_path / "cache").glob("*/GBS*")
    assert sorted(p.name for p in ns.iterdir() if not p.name.startswith(".")) == ["1", "2", "3", "4"]


# A bad value stopping the run before the disk: every value in-process, one train.py per way a run stops
# (tests/test_config_before_disk.py).


def test_mode_by_group_or_by_key_gives_the_same_k(tmp_path):
    from hydra import compose, initialize_config_dir

    from skip_harness.config import namespace_key_from_config
    from skip_harness.demo.config import register_demo_configs
    from skip_harness.demo.run import validate

    register_demo_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        a = validate(compose("config", ["trainer_mode=separate_async"]))      # the run's settings: K once
        b = validate(compose("config", ["trainer.v1.trainer_mode=separate_async"]))
        c = validate(compose("config", ["trainer_mode=colocate_async"]))
    assert a.K == b.K == 4 and c.K == 1
    assert namespace_key_from_config(a.config) == namespace_key_from_config(b.config) == a.namespace
    assert a.namespace.leaf_name.endswith("_K4_W1")
    assert a.config.trainer.experiment_name == "separate_async_seed0"


@pytest.mark.parametrize(
    "first, second, differing",
    [
        (["seed=0"], ["seed=1"], "seed"),
        (["trainer_mode=sync"], ["trainer_mode=colocate_async"], "trainer.v1.trainer_mode"),
    ],
)
@SHARED
def test_fingerprint_mismatch_names_the_keys(tmp_path_factory, tmp_path, first, second, differing):
    # both firsts are the defaults (seed=0, trainer_mode=sync): one recording, each run named in `first`
    assert first in (["seed=0"], ["trainer_mode=sync"])
    recorded(tmp_path_factory, tmp_path, "trainer.experiment_name=shared", "trainer.total_training_steps=1", run="a")
    proc = train(tmp_path, "trainer.experiment_name=shared", *second, run="b", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert differing in out and "on_mismatch=regenerate" in out and "trainer.experiment_name" in out
    assert "Traceback" not in out
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    train(tmp_path, "trainer.experiment_name=shared", *second, "skip.rollout_tq.on_mismatch=regenerate", run="c")
    assert [r["cache"] for r in metrics(tmp_path / "c")] == ["miss"] * 4


@SHARED
def test_default_experiment_names_separate_modes_and_seeds(tmp_path_factory, tmp_path):
    recorded(tmp_path_factory, tmp_path, "trainer.total_training_steps=2")   # seed 0, sync: the defaults
    train(tmp_path, "trainer.total_training_steps=1", "seed=1", run="b")
    train(tmp_path, "trainer.total_training_steps=1", "trainer_mode=colocate_async", run="c")
    assert namespaces(tmp_path) == [
        "colocate_async_seed0_skip_harness_demo/GBS8_N2_in6_out6",
        "sync_seed0_skip_harness_demo/GBS8_N2_in6_out6",
        "sync_seed1_skip_harness_demo/GBS8_N2_in6_out6",
    ]


def test_a_namespace_held_by_another_run_is_read_beside_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from skip_harness.config import RolloutTQConfig\n"
         "from skip_harness.run.startup import prepare_namespace\n"
         "from skip_harness.store.layout import NamespaceKey\n"
         f"lay = NamespaceKey('sync_seed0', 'skip_harness_demo', 8, 2, 6, 6).layout({str(tmp_path / 'cache')!r})\n"
         "r = prepare_namespace(lay, RolloutTQConfig(enable=True))\n"
         "print('held', flush=True); time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        proc = train(tmp_path, "skip.rollout_tq.lock_timeout=1", "trainer.total_training_steps=2", check=False)
        waited = time.monotonic() - t0
        out = proc.stdout + proc.stderr + (tmp_path / "run" / "train.log").read_text()
        # another live run holds it: after lock_timeout, this one reads beside it instead of stopping
        assert proc.returncode == 0, out
        assert f"read beside pid {holder.pid}" in out
        assert "2 misses (0 committed, 2 not: 2 own rollouts, not written)" in out
        assert "Traceback" not in out
        assert waited >= 1.0
        assert namespaces(tmp_path) == ["sync_seed0_skip_harness_demo/GBS8_N2_in6_out6"]
        assert not list((tmp_path / "cache").glob("*/GBS*/1"))          # nothing written
    finally:
        holder.kill()
        holder.wait()
    train(tmp_path, "trainer.total_training_steps=1", run="after")  # the OS released the dead holder's lock


def test_unusable_dump_dir_names_the_key_and_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = train(tmp_path, f"skip.rollout_tq.dump_dir={blocker}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "skip.rollout_tq.dump_dir" in out and str(blocker) in out and "Not a directory" in out
    assert "Traceback" not in out
    assert blocker.read_text() == "not a directory"


def test_the_progress_bar_is_drawn_on_a_terminal_only(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    tiny = [o for o in TINY if not o.startswith("trainer.progress")]
    cmd = [sys.executable, str(TRAIN), *tiny, "trainer.progress=true", "trainer.total_training_steps=2"]
    piped = subprocess.run([*cmd, f"hydra.run.dir={tmp_path / 'piped'}"], cwd=tmp_path, env=env_for(tmp_path),
                           capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0, piped.stderr
    out = piped.stdout + piped.stderr
    assert "\r" not in out and "step/s" not in out and "s/step" not in out, out
    assert "step 2: miss" in out  # the log lines are there, whole

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    proc = subprocess.Popen([*cmd, f"hydra.run.dir={tmp_path / 'tty'}"], cwd=tmp_path, env=env_for(tmp_path),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=600) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "\r" in text and "sync K=1" in text, text  # tqdm's frames, on a terminal


# parameter_sync_step not mattering outside separate_async: test_first_run_misses_rerun_hits_identically's reruns.
