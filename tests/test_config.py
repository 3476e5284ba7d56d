"""Schemas and cross-field checks: every error names its key."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from skip_harness.config import RolloutTQConfig, as_node, check_batch_split, namespace_key_from_config
from skip_harness.demo.config import DemoConfig, to_demo_config
from skip_harness.errors import ConfigError


def settings(*dotlist):
    """The demo's run settings through its adapter (demo.run.validate): the schema, K, the batch split."""
    from skip_harness.demo.run import validate

    return validate(OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.from_dotlist(list(dotlist))))


def demo(*dotlist):
    """The demo's config, checked (`settings(...).config`)."""
    return settings(*dotlist).config


def test_dump_dir_explicit_key_beats_env_which_beats_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("SKIP_HARNESS_DUMP_DIR", raising=False)
    default = RolloutTQConfig().resolved_dump_dir()
    assert default.parts[-2:] == ("skip_harness", "rollouts")
    monkeypatch.setenv("SKIP_HARNESS_DUMP_DIR", str(tmp_path / "env"))
    assert RolloutTQConfig().resolved_dump_dir() == tmp_path / "env"
    assert RolloutTQConfig(dump_dir=str(tmp_path / "key")).resolved_dump_dir() == tmp_path / "key"


@pytest.mark.parametrize(
    "dotlist, key",
    [
        (["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=0"],
         "trainer.v1.separate_async.parameter_sync_step"),
        (["trainer.v1.trainer_mode=separate_async", "data.train_batch_size=30"], "data.train_batch_size"),
        (["trainer.v1.trainer_mode=fast"], "trainer.v1.trainer_mode"),
        (["skip.rollout_tq.lock_timeout=-1"], "skip.rollout_tq.lock_timeout"),
        (["skip.rollout_tq.follow_timeout=-1"], "skip.rollout_tq.follow_timeout"),
        (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n"),
        (["trainer.torch_threads=0"], "trainer.torch_threads"),
    ],
)
def test_cross_field_errors_name_the_key(dotlist, key):
    with pytest.raises(ConfigError) as err:
        demo(*dotlist)
    assert err.value.key == key and str(err.value).startswith(key)


def test_k_is_one_outside_separate_async_whatever_parameter_sync_step_says():
    assert settings("trainer.v1.separate_async.parameter_sync_step=8").K == 1
    assert settings("trainer.v1.trainer_mode=colocate_async", "trainer.v1.separate_async.parameter_sync_step=8").K == 1
    assert settings("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=8").K == 8


def test_world_size_must_divide_the_per_sample_batch():
    run = settings("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4",
                   "data.train_batch_size=12")
    with pytest.raises(ConfigError, match="K x W = 4 x 2"):
        run.check_world_size(2)
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        check_batch_split(run.config.data.train_batch_size, run.K, 2)
    check_batch_split(run.config.data.train_batch_size, run.K, 3)
    assert namespace_key_from_config(OmegaConf.structured(run.config)).with_world_size(3).leaf_name == "GBS12_N8_in8_out10_K4_W3"


def test_rollout_tq_rejects_non_int_steps_and_unknown_choices():
    with pytest.raises(ConfigError, match=r"skip.rollout_tq.steps\[1\]"):
        RolloutTQConfig(steps=[1, -1])
    with pytest.raises(ConfigError, match="skip.rollout_tq.action"):
        RolloutTQConfig(action="replay")
    assert RolloutTQConfig(action="repeat", cleanup="off").action.value == "repeat"


def test_own_trainer_config_can_use_the_rollout_tq_schema(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from skip_harness.config import register_configs, rollout_tq_from

    (tmp_path / "config.yaml").write_text(
        "defaults:\n  - skip: rollout_tq_schema\n  - _self_\nskip:\n  rollout_tq:\n    enable: true\n"
    )
    register_configs()
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        settings = rollout_tq_from(compose("config", ["skip.rollout_tq.action=repeat"]))
        assert settings.enable and settings.action.value == "repeat" and settings.cleanup.value == "delete"
        with pytest.raises(ConfigCompositionException, match="skip.rollout_tq.action"):
            compose("config", ["skip.rollout_tq.action=bogus"])


def test_namespace_gbs_is_gen_batch_size_when_set():
    """verl names the namespace GBS{data.gen_batch_size or data.train_batch_size} (verl #7051)."""
    from skip_harness.config import namespace_key_from_config

    base = {"trainer": {"experiment_name": "e", "project_name": "p", "v1": {"trainer_mode": "sync"}},
            "data": {"train_batch_size": 8, "max_prompt_length": 4, "max_response_length": 6},
            "actor_rollout_ref": {"rollout": {"n": 2}}}
    assert namespace_key_from_config(base).leaf_name == "GBS8_N2_in4_out6"
    base["data"]["gen_batch_size"] = 24
    assert namespace_key_from_config(base).leaf_name == "GBS24_N2_in4_out6"
    base["data"]["gen_batch_size"] = None
    assert namespace_key_from_config(base).leaf_name == "GBS8_N2_in4_out6"


def test_compression_keys_validated():
    from skip_harness.config import settings_from

    assert settings_from({"compression": "zstd", "compression_level": 5}).compression.value == "zstd"
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.compression"):
        settings_from({"compression": "gzip"})
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.compression_level"):
        settings_from({"compression_level": 99})


# ---------------------------------------------------------------- unknown keys (issue 15, item 1)
def _compose(*overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from skip_harness.demo.config import register_demo_configs

    register_demo_configs()
    for name, fn in (("skip_harness_run_id", lambda: "x"), ("skip_harness_k", lambda mode, k: 1)):
        OmegaConf.register_new_resolver(name, fn, replace=True)
    GlobalHydra.instance().clear()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose("config", list(overrides))


@pytest.mark.parametrize(
    "override, key, hint",
    [
        ("+skip.rollout_tq.actoin=cache", "skip.rollout_tq.actoin", "did you mean `action`?"),
        ("+trainer.v1.separate_async.paramter_sync_step=2", "trainer.v1.separate_async.paramter_sync_step",
         "did you mean `parameter_sync_step`?"),
        ("+sed=1", "sed", "did you mean `seed`?"),
    ],
)
def test_a_key_hydra_adds_with_plus_is_refused_with_the_closest_name(override, key, hint):
    cfg = _compose(override)  # Hydra's own advice for an unknown key: `+key=value`, which it accepts
    with pytest.raises(ConfigError) as err:
        to_demo_config(cfg)
    assert err.value.key == key and hint in str(err.value)


@pytest.mark.parametrize(
    "settings",
    [{"actoin": "cache"}, OmegaConf.create({"enable": True, "actoin": "cache"})],
)
def test_unknown_settings_of_the_harness_are_refused_with_the_closest_name(tmp_path, settings):
    from skip_harness import SkipHarness

    with pytest.raises(ConfigError) as err:
        SkipHarness.create(settings, namespace={"experiment_name": "e", "project_name": "p", "K": 1})
    assert err.value.key == "skip.rollout_tq.actoin" and "did you mean `action`?" in str(err.value)
    cfg = OmegaConf.structured(DemoConfig)
    with open_dict(cfg.skip.rollout_tq):
        cfg.skip.rollout_tq.actoin = "cache"  # a typed node with an extra key, as `+key=` leaves it
    with pytest.raises(ConfigError) as err:
        SkipHarness.from_config(cfg)
    assert err.value.key == "skip.rollout_tq.actoin" and "did you mean `action`?" in str(err.value)


# ---------------------------------------------------------------- fingerprint per mode (issue 15, item 2)
def test_parameter_sync_step_is_in_the_fingerprint_only_in_separate_async():
    from skip_harness.demo.config import demo_fingerprint_keys
    from skip_harness.store.fingerprint import Fingerprint

    key = "trainer.v1.separate_async.parameter_sync_step"
    for mode in ("sync", "colocate_async"):
        a = Fingerprint.from_config(as_node(demo(f"trainer.v1.trainer_mode={mode}", f"{key}=4")), demo_fingerprint_keys(mode))
        b = Fingerprint.from_config(as_node(demo(f"trainer.v1.trainer_mode={mode}", f"{key}=2")), demo_fingerprint_keys(mode))
        assert key not in a.values and a.matches(b)
    sep = demo_fingerprint_keys("separate_async")
    a = Fingerprint.from_config(as_node(demo("trainer.v1.trainer_mode=separate_async", f"{key}=4")), sep)
    b = Fingerprint.from_config(as_node(demo("trainer.v1.trainer_mode=separate_async", f"{key}=2")), sep)
    assert not a.matches(b) and a.differing_keys(b) == [key]


def test_a_cache_whose_fingerprint_held_more_keys_still_matches_when_the_values_agree():
    from skip_harness.demo.config import demo_fingerprint_keys
    from skip_harness.store.fingerprint import Fingerprint

    key = "trainer.v1.separate_async.parameter_sync_step"
    now = Fingerprint.from_config(as_node(demo(f"{key}=2")), demo_fingerprint_keys("sync"))
    # what the previous version recorded in sync mode: every key, parameter_sync_step included
    old = Fingerprint.from_values({**now.values, key: 4})
    assert now.matches(old)
    assert not now.matches(Fingerprint.from_values({**old.values, "seed": 7}))  # the others still count
    # a key this run records that the cache lacks is a difference (the cache cannot show it agreed)
    fewer = Fingerprint.from_values({k: v for k, v in now.values.items() if k != "seed"})
    assert not now.matches(fewer) and "seed: cache has no value for it" in now.describe_difference(fewer)


def test_the_replay_environment_replaces_the_defaults_and_a_set_key_wins(monkeypatch, tmp_path):
    """`skip-harness replay` sets $SKIP_HARNESS_REPLAY_FROM / _CHECK for its run: every trainer's settings
    (settings_from: the demo, TRL, a plain dict, verl's plug-in) take them where the keys keep their defaults."""
    from skip_harness.config import settings_from

    monkeypatch.setenv("SKIP_HARNESS_REPLAY_FROM", str(tmp_path))
    monkeypatch.setenv("SKIP_HARNESS_REPLAY_CHECK", "error")
    for given in (None, {}, OmegaConf.create({"enable": True}), RolloutTQConfig()):
        s = settings_from(given)
        assert (s.replay_from, s.replay_check.value) == (str(tmp_path), "error")
    s = settings_from({"replay_from": "/elsewhere", "replay_check": "off"})
    assert (s.replay_from, s.replay_check.value) == ("/elsewhere", "off")
    assert settings_from(demo().skip.rollout_tq).replay_check.value == "error"
    monkeypatch.setenv("SKIP_HARNESS_REPLAY_CHECK", "loud")
    with pytest.raises(ConfigError, match=r"^\$SKIP_HARNESS_REPLAY_CHECK: unknown value 'loud'"):
        settings_from({})
    monkeypatch.setenv("SKIP_HARNESS_REPLAY_CHECK", "warn")
    monkeypatch.setenv("SKIP_HARNESS_REPLAY_FROM", "s3:/bucket")
    with pytest.raises(ConfigError, match=r"^\$SKIP_HARNESS_REPLAY_FROM: "):
        settings_from({})
