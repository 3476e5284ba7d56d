"""Many runs on one namespace: replays side by side, each keeping its own values, and a sweep over the
training side on one recording (docs/design.md, "Many runs on one namespace"). Real processes, real
files, the real demo through scripts/train.py."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest

from conftest import subprocess_env
from s3server import s3_server  # noqa: F401  (fixture)
from sharing_rig import KEY, Loop, make, values_for
from skip_harness.store.open import open_namespace
from skip_harness.cli import main as cli_main
from skip_harness.demo import TINY_OVERRIDES
from skip_harness.store.open import open_store
from skip_harness.store.scan import scan_namespace
from test_train_e2e import recorded
from skip_harness.store.values import ValuesStore

ROOT = Path(__file__).resolve().parents[1]
RIG = ROOT / "tests" / "sharing_rig.py"
TRAIN = ROOT / "scripts" / "train.py"
TINY = [*TINY_OVERRIDES, "trainer.total_training_steps=4"]


def tree(root: Path) -> dict:
    """Every file under `root` with its bytes: what a run that only reads must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name not in (".lock", ".lock.holder.json")}


class Rig:
    """A sharing_rig.py process, read line by line."""

    def __init__(self, dump: Path, *args: str):
        self.proc = subprocess.Popen([sys.executable, str(RIG), str(dump), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     # one torch thread, as this test's process has (conftest): the values the
                                     # recorder and a reader here compute are one machine's (run.machine)
                                     env=dict(subprocess_env(), OMP_NUM_THREADS="1"))
        self.lines: List[str] = []

    def wait_for(self, prefix: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"rig ended before {prefix!r}: {self.lines}\n{self.proc.stderr.read()[-3000:]}")
            self.lines.append(line.strip())
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"no {prefix!r} in {timeout} s: {self.lines}")

    def finish(self, timeout: float = 120) -> str:
        """Release the rig (a line on stdin), read the rest of its stdout and stderr, wait for it. Its stdout is
        read through the same buffered reader `wait_for` used (not `communicate`, which reads the pipe under it
        and so loses what `readline` had already buffered: a `step 1` line printed right after `started`)."""
        errs: List[str] = []
        drain = threading.Thread(target=lambda: errs.append(self.proc.stderr.read()), daemon=True)
        drain.start()
        killer = threading.Timer(timeout, self.proc.kill)
        killer.start()
        try:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            self.lines += self.proc.stdout.read().splitlines()
            self.proc.wait()
            drain.join(timeout)
        finally:
            killer.cancel()
        err = "".join(errs)
        assert self.proc.returncode == 0, f"{self.lines}\n{err[-3000:]}"
        return err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def record(dump: Path, steps: int, *extra: str) -> None:
    rig = Rig(dump, "--steps", str(steps), *extra)
    rig.finish()


# --------------------------------------------------------------------------------------------
# item 1: replays side by side


@pytest.mark.slow   # a second process
def test_a_reader_serves_what_is_committed_and_trains_on_its_own_rollouts_for_the_rest(tmp_path, caplog):
    dump = tmp_path / "cache"
    recorder = Rig(dump, "--steps", "2", "--hold")
    try:
        assert recorder.wait_for("started") == "started recorder"
        recorder.wait_for("done")
        before = tree(dump)
        h = make(dump)
        t = Loop()
        h.wrap(t)
        with caplog.at_level(logging.INFO, logger="skip_harness"):
            for step in (1, 2, 3, 4):
                t.prepare_data(step)
                t.sample(step)
            summary = h.close()
        assert [h.outcome(s).value for s in (1, 2, 3, 4)] == ["hit", "hit", "miss", "miss"]
        assert t.generated == [3, 4]
        assert (summary.hits, summary.misses, summary.committed) == (2, 2, 0)
        assert f"read beside pid {recorder.proc.pid}" in caplog.text
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3:"))
        assert "not committed (own rollouts, not written" in line and f"pid {recorder.proc.pid}" in line, line
        assert "this run trains on its own rollouts" in line
        assert tree(dump) == before                      # not one byte written by the reader
        assert [s.step for s in scan_namespace(h.layout, open_namespace(h.layout)).steps] == [1, 2]
    finally:
        recorder.finish()


@pytest.mark.slow   # a second process
def test_a_reader_is_told_whether_the_holder_records_or_only_replays(tmp_path, caplog):
    """The startup line of a run reading beside another says what that run does: a replay (every step it
    ran was served) is not called the namespace's recorder; one that wrote a step is."""
    dump = tmp_path / "cache"
    record(dump, 2)
    for steps, role in (("2", "which replays it (it has recorded no step of it so far)"), ("3", "which records it")):
        holder = Rig(dump, "--steps", steps, "--hold")   # steps 1-2 served; with 3, step 3 generated and written
        try:
            holder.wait_for("done")
            caplog.clear()
            h = make(dump)
            with caplog.at_level(logging.INFO, logger="skip_harness"):
                h.start()
            h.close()
            line = next(r.getMessage() for r in caplog.records if "read beside" in r.getMessage())
            assert f"read beside pid {holder.proc.pid} on host " in line and f", {role}: " in line, line
        finally:
            holder.finish()


@pytest.mark.slow
def test_a_reader_follows_a_recording_that_is_still_running(tmp_path):
    dump = tmp_path / "cache"
    recorder = Rig(dump, "--steps", "8", "--pause", "0.4", "--hold")
    try:
        recorder.wait_for("started recorder")
        h = make(dump, follow=60)
        t = Loop()
        h.wrap(t)
        for step in range(1, 9):
            t.prepare_data(step)
            t.sample(step)
            if step == 1:
                assert h._startup is not None and h._startup.reader
        summary = h.close()
        assert t.generated == []                          # it waited for each step the recorder committed
        assert (summary.hits, summary.misses) == (8, 0)
    finally:
        recorder.finish()


@pytest.mark.slow
def test_a_reader_takes_the_hold_when_the_recording_ends_and_commits_its_misses(tmp_path, caplog):
    dump = tmp_path / "cache"
    recorder = Rig(dump, "--steps", "2", "--hold")
    recorder.wait_for("done")
    h = make(dump)
    t = Loop()
    h.wrap(t)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        h.start()
        assert h._startup.reader
        recorder.finish()                                 # the recording ends: its hold is free
        for step in (1, 2, 3, 4):
            t.prepare_data(step)
            t.sample(step)
        summary = h.close()
    assert t.generated == [3, 4] and (summary.hits, summary.committed) == (2, 2)
    assert "this run holds it now and records the steps it generates, from step 3" in caplog.text
    assert [(s.step, s.status) for s in scan_namespace(h.layout, open_namespace(h.layout)).steps] == [(i, "complete") for i in (1, 2, 3, 4)]


@pytest.mark.slow   # a second process
@pytest.mark.parametrize("lr", [0.1, 0.2])
def test_the_run_that_takes_the_hold_records_the_values_a_killed_recorder_left_out(tmp_path, caplog, lr):
    """Issue 40: the recorder is killed (SIGKILL) right after it committed step 3, before it reported step 3's
    values. The reader beside it serves steps 1-3, takes the hold at step 4 and records from there; step 3's
    values are its own, recorded (create-only) because its replay reproduced steps 1 and 2 -- and only then:
    a reader at another learning rate (which diverged at step 1) leaves step 3 without values."""
    dump = tmp_path / "cache"
    recorder = Rig(dump, "--steps", "5", "--observe", "--stop-at", "3")
    recorder.wait_for("committed 3")
    h = make(dump)
    h.set_training_config({"lr": lr})
    t = Loop()
    h.wrap(t)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        h.start()
        assert h._startup.reader
        recorder.proc.send_signal(signal.SIGKILL)
        recorder.kill()
        for step in (1, 2, 3, 4, 5):
            t.prepare_data(step)
            t.sample(step)
            h.observe(step, **values_for(step, lr))
        summary = h.close()
    assert t.generated == [4, 5] and (summary.hits, summary.committed) == (3, 2)
    values = ValuesStore(open_namespace(h.layout))
    reader = open_store(h.layout).reader
    if lr == 0.2:
        assert reader.read_values(3) is None and "recorded this run's" not in caplog.text
        return
    assert reader.read_values(3) == values_for(3, lr)            # bound to step 3's commit record
    assert values.read_step(3).config == values.read_step(4).config    # under this run's config
    assert "step 3: the recording has no values for it" in caplog.text
    replay = make(dump)
    replay.set_training_config({"lr": lr})
    t = Loop()
    replay.wrap(t)
    replay.start()
    for step in (1, 2, 3, 4, 5):
        t.prepare_data(step)
        t.sample(step)
        replay.observe(step, **values_for(step, lr))
    line = replay.close().replay.describe()
    assert line == "replay: 5 of 5 served steps reproduced (2 values each)", line


@pytest.mark.slow
def test_kill_9_of_one_of_several_runs_leaves_the_others_running_and_the_cache_whole(tmp_path, capsys):
    dump = tmp_path / "cache"
    recorder = Rig(dump, "--steps", "20", "--pause", "1.0", "--hold")
    try:
        recorder.wait_for("started recorder")
        reader = Rig(dump, "--steps", "20", "--follow", "30")
        doomed = Rig(dump, "--steps", "20", "--follow", "30")
        assert reader.wait_for("started") == "started reader"
        doomed.wait_for("started")
        doomed.proc.send_signal(signal.SIGKILL)        # a reader dies: nobody else notices
        doomed.kill()
        recorder.proc.send_signal(signal.SIGKILL)      # the recorder dies mid-recording
        recorder.kill()
        err = reader.finish(timeout=300)
        assert reader.lines[-1].startswith("summary "), reader.lines
        outcomes = [ln.split()[2] for ln in reader.lines if ln.startswith("step ")]
        assert len(outcomes) == 20 and set(outcomes) <= {"hit", "miss"}, reader.lines
        assert "Traceback" not in err
    finally:
        for r in [recorder, *[v for k, v in locals().items() if k in ("reader", "doomed")]]:
            r.kill()
    # the reader took the hold when the recorder died: the next startup finds every step whole
    capsys.readouterr()
    assert cli_main(["verify", str(dump), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [ns] = doc["namespaces"]
    assert [s["status"] for s in ns["steps"]] == ["complete"] * 20


# --------------------------------------------------------------------------------------------
# item 2: each replay keeps its own values


def test_each_replay_keeps_its_values_under_its_run_id_and_diff_addresses_them(tmp_path, capsys):
    dump = tmp_path / "cache"

    def run(lr: float) -> str:
        h = make(dump)
        h.set_training_config({"lr": lr})
        t = Loop()
        h.wrap(t)
        for step in (1, 2, 3):
            t.prepare_data(step)
            t.sample(step)
            h.observe(step, **values_for(step, lr))
        h.close()
        return h.run_id

    run(0.1)                                            # the recording
    values = dump / "exp_proj" / "GBS8_N2_in4_out4" / ".values"
    recorded = {p.name: p.read_bytes() for p in values.glob("*.json")}
    assert {"1.json", "2.json", "3.json"} <= set(recorded)
    same_lr = run(0.1)
    time.sleep(1.1)                                     # run ids start with the second they started
    other_lr = run(0.5)
    assert {p.name: p.read_bytes() for p in values.glob("*.json")} == recorded   # never overwritten
    store = ValuesStore(open_namespace(KEY.layout(dump)))
    assert store.list_runs() == [same_lr, other_lr]                 # oldest first
    assert store.read_run_step(other_lr, 2).values == values_for(2, 0.5)
    assert store.read_run_step(same_lr, 2).values == values_for(2, 0.1)
    ns = str(dump / "exp_proj" / "GBS8_N2_in4_out4")
    capsys.readouterr()
    assert cli_main(["diff", ns, f"{ns}@{same_lr}"]) == 0           # a replay beside its recording
    assert f"@{same_lr}" in capsys.readouterr().out.replace("\n", "")
    assert cli_main(["diff", f"{ns}@{same_lr}", f"{ns}@latest", "--json"]) == 1   # two replays side by side
    doc = json.loads(capsys.readouterr().out)
    [pair] = doc["namespaces"]
    assert pair["runs"] == [same_lr, other_lr]
    assert pair["values"]["first_divergence"]["key"] == "loss"
    assert pair["config"] == [] or pair["config"] == [{"key": "lr", "a": 0.1, "b": 0.5}]
    assert cli_main(["diff", ns, f"{ns}@nobody"]) == 2
    capsys.readouterr()
    assert cli_main(["ls", str(dump), "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)["namespaces"]
    assert listed["replays"] == 2 and listed["runs"] == sorted([same_lr, other_lr])


# --------------------------------------------------------------------------------------------
# the demo through scripts/train.py


def env_for(tmp_path: Path) -> dict:
    env = subprocess_env()
    env["SKIP_HARNESS_DUMP_DIR"] = str(tmp_path / "cache")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def train(tmp_path: Path, *overrides: str, run: str = "run") -> subprocess.Popen:
    cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY, *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


# the two tests below replay one recording of the demo's defaults (recorded(): made once per worker)
ONE_RECORDING = pytest.mark.xdist_group("replays_recording")


@pytest.mark.slow
@ONE_RECORDING
def test_two_replays_started_together_both_serve_every_step(tmp_path_factory, tmp_path):
    recorded(tmp_path_factory, tmp_path, run="recording")
    ns = next((tmp_path / "cache").glob("*/GBS*"))
    before = tree(ns)
    a, b = train(tmp_path, run="a"), train(tmp_path, run="b")
    logs = [finished(a), finished(b)]
    for run in ("a", "b"):
        log = (tmp_path / run / "train.log").read_text()
        assert "4 hits, 0 repeats, 0 misses" in log, log[-3000:]
        assert "replay: 4 of 4 served steps reproduced" in log
    assert not any("in use by" in out for out in logs)
    after = tree(ns)
    runs = sorted({k.split("/")[2] for k in after if k.startswith(".values/runs/")})
    assert len(runs) == 2                                # each replay kept its values under its run id
    # nothing else: the steps and the recording's values as they were (the index, the holder's startup
    # may refresh: it records when steps were last read)
    assert {k: v for k, v in after.items() if not k.startswith(".values/runs/") and k != ".index.jsonl"} == \
        {k: v for k, v in before.items() if k != ".index.jsonl"}


@pytest.mark.slow
@ONE_RECORDING
def test_a_sweep_over_the_learning_rate_on_one_recording_generates_nothing_and_ends_with_one_table(tmp_path_factory,
                                                                                                 tmp_path):
    recorded(tmp_path_factory, tmp_path, run="recording")
    cmd = [sys.executable, str(TRAIN), "-m", "hydra/launcher=joblib", *TINY,
           "actor_rollout_ref.actor.optim.lr=0.001,0.003,0.01", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    logs = sorted((tmp_path / "sweep").glob("*/train.log"))
    assert len(logs) == 3
    for log in logs:
        text = log.read_text()
        assert "4 hits, 0 repeats, 0 misses" in text and "generation 0.0s spent" in text, text[-2000:]
    table = (tmp_path / "sweep" / "sweep_summary.md").read_text().splitlines()
    assert table[0] == "| job | overrides | hits / misses | replay | loss (last step) | reward_mean (last step) |"
    rows = table[2:]
    assert len(rows) == 3 and all("| 4 / 0 |" in r for r in rows), table
    # the verdict in a few words (issue 40: a ~230-character sentence in every row); the sentence is in the JSON
    assert "actor_rollout_ref.actor.optim.lr=0.001" in rows[0] and re.search(r"\| diverged at \d: \w+ \|", rows[0]), rows[0]
    assert "| 4/4 reproduced |" in rows[1], rows[1]        # the recording's own lr (the demo's default)
    assert re.search(r"\| diverged at \d: \w+ \|", rows[2]), rows[2]
    assert all(len(r) < 130 and "served steps" not in r and "->" not in r for r in rows), table
    assert table[0] in out                                 # the table on the console too
    jobs = sorted(json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())["jobs"], key=lambda j: j["job"])
    assert [j["job"] for j in jobs] == [0, 1, 2] and all(j["run_id"] for j in jobs)
    assert "lr 0.003 -> 0.001" in jobs[0]["replay"] and "lr 0.003 -> 0.01" in jobs[2]["replay"], jobs
    assert jobs[1]["replay"].startswith("replay: 4 of 4 served steps reproduced (") and jobs[1]["replay_short"] == "4/4 reproduced"
    assert rows[0].split(" | ")[3] == jobs[0]["replay_short"] and all(j["values_step"] == 4 for j in jobs)
    assert "1 of the sweep's jobs failed" not in out
    assert os.path.isdir(tmp_path / "sweep")


# --------------------------------------------------------------------------------------------
# the same on an object store (a real S3-compatible server: tests/s3server.py)


@pytest.mark.slow
def test_two_replays_at_once_on_an_object_store_both_serve_every_step_and_write_no_rollouts(tmp_path, s3_server):  # noqa: F811
    from test_objstore_scenarios import NS, env_of

    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"

    def start(run: str) -> subprocess.Popen:
        cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / run}", *TINY, f"skip.rollout_tq.dump_dir={url}"]
        return subprocess.Popen(cmd, cwd=tmp_path, env=env_of(s3_server), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    finished(start("recording"))
    s3 = s3_server.boto3()

    def objects() -> dict:
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"x/{NS}/").get("Contents", [])
        return {o["Key"]: o["ETag"] for o in listed}

    before = objects()
    a, b = start("a"), start("b")
    outs = [finished(a), finished(b)]
    for run in ("a", "b"):
        log = (tmp_path / run / "train.log").read_text()
        assert "4 hits, 0 repeats, 0 misses" in log, log[-3000:]
    assert any("read beside" in (tmp_path / run / "train.log").read_text() for run in ("a", "b")), outs
    after = objects()
    rollouts = {k: v for k, v in after.items() if "/.values/" not in k and not k.endswith((".lock", ".index.jsonl"))}
    assert rollouts == {k: v for k, v in before.items() if k in rollouts} and set(rollouts) == \
        {k for k in before if "/.values/" not in k and not k.endswith((".lock", ".index.jsonl"))}
    runs = {k.split("/.values/runs/")[1].split("/")[0] for k in after if "/.values/runs/" in k}
    assert len(runs) == 2


def test_runs_of_one_process_in_one_second_are_listed_in_the_order_they_ran(tmp_path, monkeypatch):
    """A process's runs within one second are `ID`, `ID-2`, ... `ID-12`: listed oldest first, `-10` after
    `-9` (plain text order put it before `-2`, so a test process's tenth in-process replay in a second
    came first, and 'the oldest replay', a replay check's reference, was the wrong one)."""
    from skip_harness.store import values
    from skip_harness.store.values import ValuesStore

    frozen = time.gmtime()
    monkeypatch.setattr(values.time, "gmtime", lambda *a: frozen)
    monkeypatch.setattr(values, "_ISSUED", {})
    issued = [values.new_run_id() for _ in range(12)]
    assert issued[1].endswith("-2") and issued[11].endswith("-12")
    store = ValuesStore(open_namespace(KEY.layout(tmp_path / "dump")))
    for run_id in reversed(issued):
        store.write_run(run_id, {"K": 1})
    assert store.list_runs() == issued
