"""Schemas and cross-field checks: every error names its key."""
from __future__ import annotations


import pytest
from omegaconf import OmegaConf

from skip_harness.config import DemoConfig, RolloutTQConfig, check_batch_split, namespace_key_from_config, to_demo_config
from skip_harness.errors import ConfigError


def demo(*dotlist):
    return to_demo_config(OmegaConf.merge(OmegaConf.structured(DemoConfig), OmegaConf.from_dotlist(list(dotlist))))


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
        (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n"),
        (["trainer.torch_threads=0"], "trainer.torch_threads"),
    ],
)
def test_cross_field_errors_name_the_key(dotlist, key):
    with pytest.raises(ConfigError) as err:
        demo(*dotlist)
    assert err.value.key == key and str(err.value).startswith(key)


def test_k_is_one_outside_separate_async_whatever_parameter_sync_step_says():
    assert demo("trainer.v1.separate_async.parameter_sync_step=8").K == 1
    assert demo("trainer.v1.trainer_mode=colocate_async", "trainer.v1.separate_async.parameter_sync_step=8").K == 1
    assert demo("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=8").K == 8


def test_world_size_must_divide_the_per_sample_batch():
    cfg = demo("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4",
               "data.train_batch_size=12")
    with pytest.raises(ConfigError, match="K x W = 4 x 2"):
        cfg.check_world_size(2)
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        check_batch_split(cfg.data.train_batch_size, cfg.K, 2)
    check_batch_split(cfg.data.train_batch_size, cfg.K, 3)
    assert namespace_key_from_config(OmegaConf.structured(cfg)).with_world_size(3).leaf_name == "GBS12_N8_in8_out10_K4_W3"


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
