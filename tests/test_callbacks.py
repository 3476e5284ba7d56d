"""The hook dispatcher and the Hydra callback that runs the startup before the task function."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from hydra import compose, initialize_config_dir

from skip_harness.run.callbacks import CallbackDispatcher, HarnessCallback
from skip_harness.config import namespace_key_from_config
from skip_harness.demo.config import register_demo_configs, to_demo_config
from skip_harness.integrations.hydra import HydraStartupCallback
from skip_harness.run.harness import SkipHarness
from skip_harness.store.posix.lock import probe

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_dispatcher_orders_hooks_and_survives_a_broken_callback(caplog):
    seen = []

    class Named(HarnessCallback):
        def __init__(self, name):
            self.name = name

        def on_step_start(self, **kw):
            seen.append(("start", self.name))

        def on_end(self, **kw):
            seen.append(("end", self.name))

    class Broken(HarnessCallback):
        def on_step_start(self, **kw):
            raise RuntimeError("observer bug")

    d = CallbackDispatcher([Named("a"), Broken(), Named("b")])
    with caplog.at_level(logging.ERROR, logger="skip_harness"):
        d.on_step_start(step=1, decision=None, future_argument=True)
        d.on_end(summary=None)
    assert seen == [("start", "a"), ("start", "b"), ("end", "b"), ("end", "a")]
    assert "observer bug" in caplog.text


def compose_demo(tmp_path, *overrides):
    register_demo_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", [f"skip.rollout_tq.dump_dir={tmp_path}", *overrides])


def test_hydra_callback_hands_its_startup_to_the_jobs_harness(tmp_path, caplog):
    cfg = compose_demo(tmp_path, "data.train_batch_size=8")
    demo = to_demo_config(cfg)
    layout = namespace_key_from_config(demo).layout(tmp_path)
    stale = layout.step_dir(3)
    stale.mkdir(parents=True)
    (stale / "tq_batch.pt").write_bytes(b"half a file")
    cb = HydraStartupCallback(validate="skip_harness.demo.run.validate")
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        cb.on_job_start(config=cfg, task_function=None)
        assert not stale.exists()  # cleaned before the task function
        assert f"pid {os.getpid()}" in probe(layout)
        harness = SkipHarness.from_config(demo)
        harness.start()  # takes the callback's startup over: no second lock, no second startup line
        other = SkipHarness.from_config(demo)
        try:
            other.start()
            raise AssertionError("a second harness of this process on a held namespace must be refused")
        except Exception as exc:  # a usage error here (another process would read beside it)
            assert type(exc).__name__ == "HeldByThisProcess" and "already in use by this process" in str(exc), exc
        harness.close()
    assert caplog.text.count("1 incomplete [3]") == 1
    assert probe(layout) is None  # the harness released what it took over
    cb.on_job_end(config=cfg, job_return=None)
    assert probe(layout) is None


def test_hydra_callback_releases_a_startup_nobody_took(tmp_path):
    cfg = compose_demo(tmp_path, "data.train_batch_size=8")
    layout = namespace_key_from_config(to_demo_config(cfg)).layout(tmp_path)
    cb = HydraStartupCallback()
    cb.on_job_start(config=cfg, task_function=None)
    assert probe(layout) is not None
    cb.on_job_end(config=cfg, job_return=None)  # the job stopped before its harness started
    assert probe(layout) is None
    assert not layout.lock_holder_path.exists()


def test_hydra_callback_validates_the_trainers_own_keys_before_the_disk(tmp_path):
    cfg = compose_demo(tmp_path, "trainer.torch_threads=0")
    HydraStartupCallback(validate="skip_harness.demo.run.validate").on_job_start(config=cfg, task_function=None)
    assert list(tmp_path.iterdir()) == []


def test_hydra_callback_leaves_a_bad_config_to_the_task_function(tmp_path):
    cfg = compose_demo(tmp_path, "trainer_mode=separate_async", "data.train_batch_size=6")
    HydraStartupCallback().on_job_start(config=cfg, task_function=None)
    assert list(tmp_path.iterdir()) == []  # nothing created for a config that will be refused


def test_hydra_callback_does_nothing_on_other_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    cfg = compose_demo(tmp_path)
    HydraStartupCallback().on_job_start(config=cfg, task_function=None)
    assert list(tmp_path.iterdir()) == []


def test_a_new_namespace_says_nothing_of_its_index_and_the_summary_says_where_the_cache_is(tmp_path, caplog):
    import torch

    from skip_harness.run.callbacks import describe_summary

    class Loop:
        def prepare_data(self, step, *, dispatch=True):
            pass

        def sample(self, step):
            return {"x": torch.arange(8) + step}

    t = Loop()
    h = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path)},
                           namespace={"experiment_name": "e", "project_name": "p", "K": 1})
    h.wrap(t)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        t.prepare_data(1)
        t.sample(1)
        summary = h.close()
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any("index" in line for line in info), info  # "index missing; rebuilt" sounded like damage
    (line,) = [m for m in info if m.startswith("rollout cache summary")]
    assert line.startswith("rollout cache summary: 1 step: ") and line.endswith(f"; cache in {h.layout.root}"), line
    assert "1 step: 0 hits, 0 repeats, 1 miss (1 committed, 0 not)" in line, line   # not "1 misses"
    assert "all 2 ranks' files" in describe_summary(summary, str(h.layout.root), world_size=2)


def test_hydra_callback_does_the_startup_with_the_config_hydra_passes_it(tmp_path):
    """Hydra hands callbacks the whole config, its `hydra` node included: not an unknown key."""
    from hydra.core.hydra_config import HydraConfig

    register_demo_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", [f"skip.rollout_tq.dump_dir={tmp_path}", "data.train_batch_size=8"],
                      return_hydra_config=True)
    assert "hydra" in cfg
    HydraConfig.instance().set_config(cfg)
    try:
        cb = HydraStartupCallback(validate="skip_harness.demo.run.validate")
        cb.on_run_start(config=cfg)   # a valid config: no exit
        cb.on_job_start(config=cfg, task_function=None)
        layout = namespace_key_from_config(to_demo_config({k: v for k, v in cfg.items() if k != "hydra"})).layout(tmp_path)
        assert f"pid {os.getpid()}" in (probe(layout) or "")   # the callback holds the namespace
        cb.on_job_end(config=cfg)
        assert probe(layout) is None
    finally:
        HydraConfig.instance().cfg = None
