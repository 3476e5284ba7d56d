"""A run's settings resolved once (issue 41, item 1): one K rule, one namespace-key builder and one batch-split
check shared by every front end, and one demo run that computes K once and builds one harness."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from skip_harness.demo import TINY_OVERRIDES
from skip_harness.demo.config import DemoConfig
from skip_harness.errors import ConfigError, HarnessUsageError
from skip_harness.integrations.verl_config import plan_of
from skip_harness.run.harness import SkipHarness
from skip_harness.run.settings import RunSettings, from_parts, from_verl_keys


def verl_keyed(tmp_path, mode="sync", **trainer):
    """A whole config with verl's key names, as `from_config` and the verl plug-in read it."""
    v1 = {"trainer_mode": mode, "separate_async": {"parameter_sync_step": 2}}
    v1.update(trainer.pop("v1", {}))
    return {"trainer": {"experiment_name": "e", "project_name": "p", "v1": v1, **trainer},
            "data": {"train_batch_size": 8, "max_prompt_length": 4, "max_response_length": 6},
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "skip": {"rollout_tq": {"enable": True, "dump_dir": str(tmp_path)}}}


def verl_local(tmp_path):
    """verl's `skip.rollout_tq` dataclass as the plug-in gets it (its four keys)."""
    return SimpleNamespace(enable=True, dump_dir=str(tmp_path), steps=[], action="cache")


def every_verl_keyed_front_end(tmp_path, cfg):
    """What each verl-keyed front end resolves from `cfg`: from_config, the plug-in, the Hydra callback's adapter."""
    return {
        "from_config": lambda: SkipHarness.from_config(cfg).run_settings,
        "verl plug-in": lambda: plan_of(verl_local(tmp_path), cfg).run,
        "hydra callback": lambda: from_verl_keys(cfg, training=False),
    }


def demo_cfg(*dotlist):
    return OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.from_dotlist(list(dotlist)))


# ---------------------------------------------------------------- one K rule
def test_an_unknown_trainer_mode_is_refused_by_every_front_end_naming_the_key(tmp_path):
    from skip_harness.demo.run import validate

    for name, build in every_verl_keyed_front_end(tmp_path, verl_keyed(tmp_path, mode="fast")).items():
        with pytest.raises(ConfigError) as err:
            build()
        assert err.value.key == "trainer.v1.trainer_mode" and "unknown mode 'fast'" in str(err.value), name
    with pytest.raises(ConfigError) as err:
        validate(demo_cfg("trainer.v1.trainer_mode=fast"))
    assert err.value.key == "trainer.v1.trainer_mode" and "unknown mode 'fast'" in str(err.value)
    assert not any(tmp_path.iterdir())   # refused before the disk


@pytest.mark.parametrize("mode, v1, K", [
    ("sync", {}, 1),
    ("separate_async", {}, 2),
    ("colocate_async", {}, 1),
    # verl's V1 trainer reads the mode's own node: trainer.v1.{mode}.parameter_sync_step, 1 when absent
    ("colocate_async", {"colocate_async": {"parameter_sync_step": 4}}, 4),
])
def test_every_verl_keyed_front_end_computes_the_same_k(tmp_path, mode, v1, K):
    cfg = verl_keyed(tmp_path, mode=mode, v1=v1)
    got = {name: build().K for name, build in every_verl_keyed_front_end(tmp_path, cfg).items()}
    assert got == dict.fromkeys(got, K)


def test_a_k_below_one_names_the_modes_own_key(tmp_path):
    cfg = verl_keyed(tmp_path, mode="separate_async", v1={"separate_async": {"parameter_sync_step": 0}})
    for name, build in every_verl_keyed_front_end(tmp_path, cfg).items():
        with pytest.raises(ConfigError) as err:
            build()
        assert err.value.key == "trainer.v1.separate_async.parameter_sync_step", name


# ---------------------------------------------------------------- one namespace-key builder
@pytest.mark.parametrize("missing", ["experiment_name", "project_name"])
def test_a_missing_name_is_a_config_error_naming_it_for_every_front_end(tmp_path, missing):
    """The one builder's behaviour: no made-up `default_experiment_name` (verl's composed config always
    has both keys); the plug-in used to invent one where from_config refused."""
    cfg = verl_keyed(tmp_path)
    del cfg["trainer"][missing]
    for name, build in every_verl_keyed_front_end(tmp_path, cfg).items():
        with pytest.raises(ConfigError) as err:
            build()
        assert err.value.key == f"trainer.{missing}" and "missing" in str(err.value), name


@pytest.mark.parametrize("field,value", [("experiment_name", "../../etc"), ("project_name", ".."),
                                         ("experiment_name", "a/b"), ("project_name", ".hidden")])
def test_a_name_that_is_not_one_path_component_is_refused_by_every_front_end(tmp_path, field, value):
    """The config builder runs the same field check as `namespace_key_from`: `../../etc` would lay the
    namespace out of dump_dir."""
    cfg = verl_keyed(tmp_path / "dump")
    cfg["trainer"][field] = value
    for name, build in every_verl_keyed_front_end(tmp_path / "dump", cfg).items():
        with pytest.raises(ConfigError) as err:
            build()
        assert err.value.key == f"trainer.{field}" and "without '/'" in str(err.value), name
    assert not any(tmp_path.iterdir())   # refused before the disk


def test_every_verl_keyed_front_end_names_the_same_namespace(tmp_path):
    cfg = verl_keyed(tmp_path, mode="separate_async")
    cfg["data"]["gen_batch_size"] = 16
    keys = {name: build().namespace for name, build in every_verl_keyed_front_end(tmp_path, cfg).items()}
    assert len(set(keys.values())) == 1
    assert next(iter(keys.values())).leaf_name == "GBS16_N2_in4_out6_K2_W1"


# ---------------------------------------------------------------- one batch-split check
def test_the_batch_split_is_checked_when_built_and_again_only_for_another_world_size(tmp_path, monkeypatch):
    cfg = verl_keyed(tmp_path, mode="separate_async", v1={"separate_async": {"parameter_sync_step": 4}})
    cfg["data"]["train_batch_size"] = 12
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"data\.train_batch_size: 12 is not a multiple of K x W = 4 x 2"):
        from_verl_keys(cfg)
    run = from_verl_keys(cfg, world_size=1)
    assert run.checked_world_size == 1
    run.check_world_size(1)
    with pytest.raises(ConfigError, match="K x W = 4 x 2"):
        run.check_world_size(2)


def test_the_harness_accepts_only_run_settings(tmp_path):
    from skip_harness.config import RolloutTQConfig

    with pytest.raises(HarnessUsageError, match="a RunSettings, got RolloutTQConfig"):
        SkipHarness(RolloutTQConfig(enable=True, dump_dir=str(tmp_path)))   # type: ignore[arg-type]
    run = from_parts({"enable": True, "dump_dir": str(tmp_path)}, namespace={"experiment_name": "e",
                                                                           "project_name": "p", "K": 2})
    assert isinstance(run, RunSettings) and SkipHarness(run).K == 2
    with pytest.raises(Exception):
        run.namespace = None   # type: ignore[misc]  # frozen


# ---------------------------------------------------------------- one demo run: K once, one harness
class _Calls:
    """Counts calls of the K rule and of SkipHarness construction, by their code, while a run goes on."""

    def __init__(self) -> None:
        self.k_rule = self.harnesses = 0

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "k_for" and code.co_filename.endswith("skip_harness/config.py"):
            self.k_rule += 1
        elif code.co_name == "__init__" and code.co_filename.endswith("skip_harness/run/harness.py"):
            self.harnesses += 1


def test_one_demo_run_computes_k_once_and_builds_one_harness(tmp_path, monkeypatch):
    from skip_harness.demo.run import train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = demo_cfg(*TINY_OVERRIDES, "trainer.total_training_steps=1", "trainer.v1.trainer_mode=separate_async",
                   "trainer.v1.separate_async.parameter_sync_step=2", f"skip.rollout_tq.dump_dir={tmp_path / 'cache'}",
                   "skip.rollout_tq.enable=true")
    calls = _Calls()
    sys.setprofile(calls)
    try:
        result = train(cfg, run_dir=tmp_path / "run")
    finally:
        sys.setprofile(None)
    assert [row["cache"] for row in result.metrics] == ["miss"]
    assert (calls.k_rule, calls.harnesses) == (1, 1)


def test_under_the_hydra_callback_the_run_is_resolved_once_for_the_callback_and_the_task(tmp_path, monkeypatch):
    """scripts/train.py's order: on_run_start (the config checked before the run directory), on_job_start
    (the namespace locked and cleaned), the task function. The settings are resolved in the first and handed
    on: K computed once, one harness, for the whole process."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from skip_harness.demo.config import register_demo_configs
    from skip_harness.demo.run import train
    from skip_harness.integrations.hydra import HydraStartupCallback

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)   # whatever a callback writes relative to the working directory lands here
    register_demo_configs()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", [*TINY_OVERRIDES, "trainer.total_training_steps=1",
                                 f"skip.rollout_tq.dump_dir={tmp_path / 'cache'}"])
    callback = HydraStartupCallback(validate="skip_harness.demo.run.validate")
    calls = _Calls()
    assert not (tmp_path / "None").exists()
    sys.setprofile(calls)
    try:
        callback.on_run_start(config=cfg)
        callback.on_job_start(config=cfg, task_function=None)
        result = train(cfg, run_dir=tmp_path / "run")
        callback.on_job_end(config=cfg, job_return=None)
    finally:
        sys.setprofile(None)
    assert [row["cache"] for row in result.metrics] == ["miss"]
    assert (calls.k_rule, calls.harnesses) == (1, 1)
    assert not (tmp_path / "None").exists()   # a config without a `hydra` node claims no `./None` run directory


def test_settings_handed_over_for_another_config_or_environment_are_not_taken(tmp_path, monkeypatch):
    from skip_harness.run.settings import hand_over, take

    cfg = verl_keyed(tmp_path)
    run = from_verl_keys(cfg)
    hand_over(cfg, run)
    assert take(cfg) is run and take(cfg) is None          # taken once
    hand_over(cfg, run)
    assert take(verl_keyed(tmp_path, mode="separate_async")) is None
    hand_over(cfg, run)
    monkeypatch.setenv("SKIP_HARNESS_REPLAY_CHECK", "error")
    assert take(cfg) is None


# ---------------------------------------------------------------- one conversion of a config node
def test_the_training_side_records_interpolations_resolved_as_the_fingerprint_does(tmp_path, monkeypatch):
    """The training side and the fingerprint convert a node the one way (`nodes.plain`): `${...}` resolved,
    so a replay compares values, not the text that named them."""
    monkeypatch.delenv("SKIP_HARNESS_TEST_UNSET", raising=False)
    cfg = verl_keyed(tmp_path)
    cfg["trainer"]["lr"] = 0.5
    cfg["optim"] = {"lr": "${trainer.lr}"}
    run = from_verl_keys(OmegaConf.create(cfg), fingerprint_keys=["optim.lr"], world_size=1)
    assert run.fingerprint.values == {"optim.lr": 0.5}
    cfg["actor"] = {"lr": "${trainer.lr}"}
    assert from_verl_keys(OmegaConf.create(cfg), world_size=1).training_config["actor.lr"] == 0.5
    # an interpolation that cannot resolve outside its run (an unset variable here) is recorded as its text
    cfg["actor"]["home"] = "${oc.env:SKIP_HARNESS_TEST_UNSET}"
    side = from_verl_keys(OmegaConf.create(cfg), world_size=1).training_config
    assert side["actor.home"] == "${oc.env:SKIP_HARNESS_TEST_UNSET}" and side["actor.lr"] == "${trainer.lr}"


@pytest.mark.parametrize("fingerprint_keys", [(), ("data.max_prompt_length",)])
def test_under_the_hydra_callback_without_validate_from_config_takes_the_callbacks_settings(
        tmp_path, monkeypatch, fingerprint_keys):
    """The callback with no `validate` resolves the job's settings with the verl-keyed adapter (to lock and
    clean the namespace) and hands them over: the task function's `SkipHarness.from_config(cfg)` takes them
    (K computed once), its fingerprint keys and the training side added to them."""
    from skip_harness.integrations.hydra import HydraStartupCallback

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create(verl_keyed(tmp_path / "cache"))
    callback = HydraStartupCallback()
    calls = _Calls()
    sys.setprofile(calls)
    try:
        callback.on_job_start(config=cfg)
        harness = SkipHarness.from_config(cfg, fingerprint_keys=fingerprint_keys)
    finally:
        sys.setprofile(None)
    try:
        assert (calls.k_rule, calls.harnesses) == (1, 1)
        run = harness.run_settings
        assert run == from_verl_keys(cfg, fingerprint_keys=fingerprint_keys)   # what resolving again would give
        assert ("data.max_prompt_length" in run.training_config) is not bool(fingerprint_keys)
    finally:
        harness.close()
        callback.on_job_end(config=cfg)


def test_from_config_keeps_the_w_invariance_the_settings_were_handed_over_with(tmp_path):
    """A Hydra callback's settings say the trainer is W-invariant: `from_config(cfg)` without the argument
    keeps it (it used to reset it to False, so a W-invariant trainer lost its comparison at another W); an
    explicit argument still wins."""
    import dataclasses

    from skip_harness.run.harness import SkipHarness
    from skip_harness.run.settings import hand_over

    cfg = verl_keyed(tmp_path)
    for given, expected in ((None, True), (False, False)):
        hand_over(cfg, dataclasses.replace(from_verl_keys(cfg, w_invariant=True), training_config={"a": 1}))
        harness = SkipHarness.from_config(cfg, w_invariant=given)
        assert harness.run_settings.w_invariant is expected, given
