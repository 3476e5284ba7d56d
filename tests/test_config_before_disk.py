"""The whole config is checked before the disk: every bad value, with the Hydra startup callback on,
stops the run with one message naming the key and exit status 2 — and nothing is created or removed:
no run directory, nothing in the cache.

Every bad value is checked in-process (composed by Hydra's compose API, then the startup callback and
`train` as scripts/train.py runs them); one case per way a run stops — a value Hydra's schema refuses while
composing, a value our checks refuse in the job, an unknown key each way — also runs scripts/train.py in a
real subprocess for the exit status, the message and the untouched disk."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from skip_harness.demo.config import register_demo_configs
from skip_harness.demo.run import train
from skip_harness.demo.config import DemoConfig
from skip_harness.errors import ConfigError, SkipHarnessError
from skip_harness.integrations.hydra import HydraStartupCallback
from skip_harness.integrations.hydra_run import refuse_unknown_overrides

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
CONF = ROOT / "conf"

SEP4 = ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4"]
BAD = [  # (overrides, the key the message must name)
    (["data.train_batch_size=0"], "data.train_batch_size"),
    (SEP4[:1] + ["data.train_batch_size=6"], "data.train_batch_size"),
    (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n"),
    (["data.max_prompt_length=0"], "data.max_prompt_length"),
    (["data.max_response_length=0"], "data.max_response_length"),
    (["trainer.total_training_steps=0"], "trainer.total_training_steps"),
    (["trainer.torch_threads=0"], "trainer.torch_threads"),
    (["trainer.test_freq=-1"], "trainer.test_freq"),
    (["trainer.v1.trainer_mode=bogus"], "trainer.v1.trainer_mode"),
    (SEP4[:1] + ["trainer.v1.separate_async.parameter_sync_step=0"], "trainer.v1.separate_async.parameter_sync_step"),
    (["skip.rollout_tq.action=bogus"], "skip.rollout_tq.action"),
    (["skip.rollout_tq.cleanup=bogus"], "skip.rollout_tq.cleanup"),
    (["skip.rollout_tq.on_mismatch=bogus"], "skip.rollout_tq.on_mismatch"),
    (["skip.rollout_tq.lock_timeout=-1"], "skip.rollout_tq.lock_timeout"),
    (["skip.rollout_tq.steps=[1,x]"], "skip.rollout_tq.steps"),
    (["skip.rollout_tq.steps=[-2]"], "skip.rollout_tq.steps"),
    (["skip.rollout_tq.max_pending_writes=0"], "skip.rollout_tq.max_pending_writes"),
    # (these three were test_train_e2e's, a train.py subprocess each)
    (SEP4[:1] + ["trainer.v1.separate_async.parameter_sync_step=3"], "data.train_batch_size"),
    (["skip.rollout_tq.action=replay"], "skip.rollout_tq.action"),
    (["trainer.v1.trainer_mode=async"], "trainer.v1.trainer_mode"),
]


def tree(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def stale_cache(tmp_path: Path) -> Path:
    """A namespace the runs would use, holding an interrupted step that cleanup would remove."""
    cache = tmp_path / "cache"
    stale = cache / "sync_seed0_skip_harness_demo" / "GBS512_N8_in8_out10" / "3"
    stale.mkdir(parents=True)
    (stale / "tq_batch.pt").write_bytes(b"half a file")
    return cache


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def refusal(overrides, run_dir: Path):
    """What stops `scripts/train.py overrides`, in-process, as train.py's Hydra run goes: ("compose", message)
    when Hydra's schema refuses the value while composing; ("callback", message) when the startup callback's
    check before the run directory exits 2; ("job", message) when `train` raises our config error. None
    when nothing refused it. (train.py exits 2 for each.)"""
    register_demo_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        try:
            cfg = compose("config", ["trainer.progress=false", *overrides])
        except ConfigCompositionException as exc:
            return "compose", f"{exc} {exc.__cause__ or ''}"
    callback = HydraStartupCallback(validate="skip_harness.demo.run.validate")
    said = _Lines()
    logger = logging.getLogger("skip_harness")
    logger.addHandler(said)
    try:
        callback.on_run_start(config=cfg)
    except SystemExit as exc:
        assert exc.code == 2, exc.code
        return "callback", "\n".join(said.lines)
    finally:
        logger.removeHandler(said)
    callback.on_job_start(config=cfg, task_function=None)
    try:
        train(cfg, run_dir=run_dir)
    except SkipHarnessError as exc:
        return "job", str(exc)
    return None


def test_every_bad_value_stops_before_the_disk_in_process(tmp_path, monkeypatch):
    cache = stale_cache(tmp_path)
    before = tree(cache)
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", str(cache))
    paths = set()
    for n, (overrides, key) in enumerate(BAD):
        stopped = refusal(overrides, tmp_path / f"run{n}")
        assert stopped is not None, (overrides, "ran")
        where, text = stopped
        paths.add(where)
        assert key in text, (overrides, text)
        assert tree(cache) == before, (overrides, tree(cache))
        assert not (tmp_path / f"run{n}").exists(), (overrides, "a run directory was made")
    assert paths == {"compose", "callback"}  # both ways a run stops are among the cases (each runs end-to-end below)


END_TO_END = [  # one case per way a run stops, run as a user runs it
    (["skip.rollout_tq.action=bogus"], "skip.rollout_tq.action", "compose"),
    (["trainer.torch_threads=0"], "trainer.torch_threads", "callback"),
]


@pytest.mark.slow
def test_a_bad_value_stops_train_py_with_exit_2_before_the_disk(tmp_path):
    cache = stale_cache(tmp_path)
    before = tree(cache)
    env = {**os.environ, "SKIP_HARNESS_DUMP_DIR": str(cache)}
    env.pop("HYDRA_FULL_ERROR", None)

    def run(case):
        overrides, key, where = case
        out = tmp_path / f"run{END_TO_END.index(case)}"
        proc = subprocess.run([sys.executable, str(TRAIN), f"hydra.run.dir={out}", "trainer.progress=false", *overrides],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        return case, proc

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, END_TO_END))
    for n, ((overrides, key, where), proc) in enumerate(results):
        assert refusal(overrides, tmp_path / "in-process")[0] == where  # the path this case stands for
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0, (overrides, text)
        assert key in text, (overrides, text)
        assert "Traceback" not in text, (overrides, text)
        assert tree(cache) == before, (overrides, tree(cache))
        assert proc.returncode == 2, (overrides, text)
        assert not (tmp_path / f"run{n}").exists(), (overrides, "a run directory was made")


ACTOIN = "skip.rollout_tq.actoin: unknown key (not in `skip.rollout_tq`); did you mean `action`?"
UNKNOWN = [
    # a `+key=value` (Hydra's advice for an unknown key) must not run with the key ignored ...
    ("+skip.rollout_tq.actoin=cache", ACTOIN),
    # ... and without the `+`, the same message (not Hydra's advice to append the typo)
    ("skip.rollout_tq.actoin=cache", ACTOIN),
    ("+trainer.total_trainig_steps=3", "did you mean `total_training_steps`?"),
    ("trainer.total_trainig_steps=3", "trainer.total_trainig_steps: unknown key (not in `trainer`); did you mean "
                                      "`total_training_steps`?"),
    ("trainr.total_training_steps=3", "trainr: unknown key (not in the config); did you mean `trainer`?"),
]


def test_an_unknown_key_is_refused_naming_it_in_process(tmp_path, monkeypatch):
    """With `+`, Hydra adds the key and the startup callback refuses it; without, Hydra would refuse it while
    composing, with its advice to append it: scripts/train.py's `refuse_unknown_overrides` comes first."""
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", str(tmp_path / "cache"))
    for n, (override, says) in enumerate(UNKNOWN):
        if override.startswith("+"):
            where, text = refusal(["data.train_batch_size=8", override], tmp_path / f"run{n}")
            assert where == "callback", (override, where)
        else:
            with pytest.raises(ConfigError) as err:
                refuse_unknown_overrides(DemoConfig, ["-m", "data.train_batch_size=8", "trainer_mode=sync", override])
            text = str(err.value)
            assert refusal(["data.train_batch_size=8", override], tmp_path / f"run{n}")[0] == "compose"  # Hydra's
        assert says in text, (override, text)
        assert not (tmp_path / f"run{n}").exists()
    assert not (tmp_path / "cache").exists()


def test_known_keys_and_what_hydra_owns_are_left_to_hydra():
    refuse_unknown_overrides(DemoConfig, [
        "trainer_mode=sync", "hydra/launcher=joblib", "hydra.run.dir=x", "seed=3", "skip.rollout_tq.action=cache",
        "actor_rollout_ref.actor.optim.lr=0.1,0.2", "~skip.rollout_tq.steps", "++skip.rollout_tq.nope=1",
        "trainer_mde=sync", "data.train_batch_size=[", "--cfg", "job"])


@pytest.mark.slow
@pytest.mark.parametrize("override, says", UNKNOWN[:2])  # one case per path: the callback's (a `+` key), train.py's
def test_an_unknown_key_stops_with_exit_2_and_creates_nothing(tmp_path, override, says):
    env = {**os.environ, "SKIP_HARNESS_DUMP_DIR": str(tmp_path / "cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(TRAIN), "trainer.progress=false", "data.train_batch_size=8", override],
                          cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert says in text and "Traceback" not in text and "To append" not in text, text
    assert len(text.strip().splitlines()) == 1, text
    assert list(work.iterdir()) == [], "the run left files (an outputs/ folder?)"
    assert not (tmp_path / "cache").exists()


def replay_from_cases(tmp_path: Path):
    """(override, what the message must say) for the two ways `replay_from` is refused before the disk: a path
    that does not exist, and a recording (a real namespace directory) of another batch."""
    other = tmp_path / "recorded" / "rec_skip_harness_demo" / "GBS16_N2_in6_out6"
    other.mkdir(parents=True, exist_ok=True)
    missing = tmp_path / "missing" / "GBS8_N2_in6_out6"
    return [
        (f"skip.rollout_tq.replay_from={missing}",
         f"skip.rollout_tq.replay_from: {missing} does not exist"),
        (f"skip.rollout_tq.replay_from={other}",
         f"skip.rollout_tq.replay_from: {other} cannot serve this run: another batch (data.train_batch_size: "
         "the recording has 16, this run has 8)"),
    ]


SMALL = ["data.train_batch_size=8", "data.max_prompt_length=6", "data.max_response_length=6",
         "actor_rollout_ref.rollout.n=2"]


def test_replay_from_is_refused_before_the_disk_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", str(tmp_path / "cache"))
    for n, (override, says) in enumerate(replay_from_cases(tmp_path)):
        assert refusal([*SMALL, override], tmp_path / f"run{n}") == ("callback", says + refusal_tail(says)), override
        assert not (tmp_path / f"run{n}").exists() and not (tmp_path / "cache").exists(), override


def refusal_tail(says: str) -> str:
    """What follows the reason in the callback's line."""
    if "does not exist" in says:
        return (" (set a recording's namespace or pack file, {dump_dir}/{experiment}_{project}/GBS.._N.._in.._out..[_K.._W..], "
                "or `auto`) (nothing was created: no run directory, nothing in the cache)")
    return " (nothing was created: no run directory, nothing in the cache)"


def test_replay_from_is_refused_before_the_disk_without_hydra(tmp_path):
    """The same checks for a plain dict (`train`) and `SkipHarness.create`: nothing made in the dump_dir."""
    from skip_harness.demo.config import DemoConfig
    from skip_harness.errors import ConfigError
    from skip_harness.run.harness import SkipHarness
    from omegaconf import OmegaConf

    cache = tmp_path / "cache"
    base = OmegaConf.to_container(OmegaConf.structured(DemoConfig), resolve=True)
    for override, says in replay_from_cases(tmp_path):
        value = override.split("=", 1)[1]
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist([*SMALL, "trainer.progress=false", override,
                                                             "skip.rollout_tq.enable=true", f"skip.rollout_tq.dump_dir={cache}"]))
        with pytest.raises(ConfigError) as err:
            train(OmegaConf.to_container(cfg), run_dir=tmp_path / "run")
        assert str(err.value).startswith(says), err.value
        with pytest.raises(ConfigError) as err:
            SkipHarness.create({"enable": True, "dump_dir": str(cache), "replay_from": value},
                               namespace={"experiment_name": "e", "project_name": "p", "K": 1, "train_batch_size": 8,
                                          "n": 2, "max_prompt_length": 6, "max_response_length": 6})
        assert str(err.value).startswith(says), err.value
        assert not cache.exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_replay_from_stops_train_py_with_exit_2_before_the_disk(tmp_path):
    env = {**os.environ, "SKIP_HARNESS_DUMP_DIR": str(tmp_path / "cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    work = tmp_path / "work"
    work.mkdir()
    cases = replay_from_cases(tmp_path)

    def run(case):
        return subprocess.run([sys.executable, str(TRAIN), "trainer.progress=false", *SMALL, case[0]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(run, cases))
    for (_, says), proc in zip(cases, procs):
        text = proc.stdout + proc.stderr
        assert proc.returncode == 2, text
        assert says in text and len(text.strip().splitlines()) == 1 and "Traceback" not in text, text
        assert list(work.iterdir()) == [], "the run left files (an outputs/ folder?)"
        assert not (tmp_path / "cache").exists()
