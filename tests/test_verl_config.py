"""What the verl plug-in reads from verl's own composed ppo_trainer.yaml, and the errors that stop a run
before any work (through verl's own SkipManager.init, as verl's trainer calls it). No Ray needed."""
from __future__ import annotations

import pytest

pytest.importorskip("verl")

import verl_rig as rig  # noqa: E402

from skip_harness.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.verl


@pytest.fixture(autouse=True)
def plugin():
    import skip_harness.integrations.verl as plugin
    from verl.utils.skip import SkipManager

    yield plugin
    plugin.close_all()
    SkipManager.skip_instances = {}


def init(cfg):
    from verl.utils.skip import SkipManager

    SkipManager.init(cfg)
    return SkipManager.skip_instances["rollout_tq"]


def test_settings_k_namespace_and_fingerprint_come_from_verls_keys(tmp_path):
    cfg = rig.compose(str(tmp_path), K=2, action="repeat", steps=(1, 3),
                      extra=["+skip_harness.on_mismatch=regenerate", "+skip_harness.lock_timeout=5",
                             "data.gen_batch_size=2", "actor_rollout_ref.rollout.temperature=0.7"])
    skip = init(cfg)
    plan = skip.plan
    s = plan.settings
    assert (s.enable, s.action.value, s.steps, s.dump_dir) == (True, "repeat", [1, 3], str(tmp_path))
    assert (s.cleanup.value, s.on_mismatch.value, s.lock_timeout) == ("quarantine", "regenerate", 5.0)
    assert plan.K == 2 and plan.trainer_mode == "separate_async" and plan.prompts_per_sample == 2
    # verl's own naming: GBS is data.gen_batch_size when set (verl #7051), else train_batch_size
    assert plan.namespace == {"experiment_name": "rig", "project_name": "verl", "train_batch_size": 2, "n": 2,
                              "max_prompt_length": 8, "max_response_length": 6, "K": 2}
    fp = plan.fingerprint
    assert fp["actor_rollout_ref.model.path"] == "stand-in/tiny"
    assert fp["actor_rollout_ref.rollout.temperature"] == 0.7
    assert fp["actor_rollout_ref.rollout.n"] == 2 and "actor_rollout_ref.rollout.top_p" in fp
    assert fp["actor_rollout_ref.rollout.seed"] == 42 and fp["parameter_sync_step"] == 2
    assert not any(k.startswith("actor_rollout_ref.actor.") for k in fp)   # the training side is not in it
    assert 7 not in skip.steps and 3 in skip.steps                        # verl's list keeps its meaning


def test_the_plugin_takes_the_replay_check_skip_harness_replay_sets(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIP_HARNESS_REPLAY_CHECK", "error")
    assert init(rig.compose(str(tmp_path))).plan.settings.replay_check.value == "error"


def test_colocate_async_is_k1_and_all_steps_caches_every_step(tmp_path):
    cfg = rig.compose(str(tmp_path), extra=["trainer.v1.trainer_mode=colocate_async", "+skip_harness.all_steps=true"])
    skip = init(cfg)
    assert skip.plan.K == 1 and skip.plan.settings.steps is None
    assert 12345 in skip.steps


def test_disabled_builds_nothing(tmp_path):
    skip = init(rig.compose(str(tmp_path), extra=["skip.rollout_tq.enable=false", "++skip_harness.cleanup=bogus"]))
    assert skip.harness is None and skip.plan is None


@pytest.mark.parametrize("override, key", [
    ("++skip_harness.cleanup=bogus", "skip_harness.cleanup"),
    ("+skip_harness.clenup=delete", "skip_harness.clenup"),
    ("+skip_harness.lock_timeout=-1", "skip_harness.lock_timeout"),
    ("+skip_harness.action=repeat", "skip_harness.action"),
    ("+skip_harness.all_steps=maybe", "skip_harness.all_steps"),
    ("+skip_harness.fingerprint_keys=[data.no_such_key]", "skip_harness.fingerprint_keys"),
    ("data.train_batch_size=5", "data.train_batch_size"),
    ("trainer.v1.separate_async.parameter_sync_step=0", "trainer.v1.separate_async.parameter_sync_step"),
])
def test_a_bad_value_stops_verls_skip_manager_naming_the_key(tmp_path, override, key):
    cfg = rig.compose(str(tmp_path), K=2, extra=[override])
    with pytest.raises(ConfigError) as info:
        init(cfg)
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(key + ":")
    assert not any(tmp_path.iterdir()), "nothing may touch the disk before the config is valid"


def test_enabling_verls_other_roles_says_who_runs_them(tmp_path, caplog):
    cfg = rig.compose(str(tmp_path), extra=["skip.rollout.enable=true", "skip.async_rollout.enable=true"])
    with caplog.at_level("WARNING", logger="skip_harness"):
        init(cfg)
    text = caplog.text
    assert "skip.rollout is enabled" in text and "RolloutSkip" in text
    assert "skip.async_rollout is enabled" in text and "AsyncRolloutSkip" in text


def test_its_info_lines_show_under_verls_warning_root_logger(tmp_path):
    import logging

    logger = logging.getLogger("skip_harness")
    saved = logger.level
    logger.setLevel(logging.NOTSET)
    try:
        init(rig.compose(str(tmp_path)))
        assert logger.getEffectiveLevel() == logging.INFO
        logger.setLevel(logging.ERROR)                     # a level the user chose is kept
        init(rig.compose(str(tmp_path)))
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(saved)


@pytest.mark.parametrize("version,ok", [("0.9.1", True), ("0.9.2", True), ("0.9.0", False), ("0.10.0.dev0", False),
                                        ("0.8.5", False), ("0.10.0", False), ("0.11.0", False), ("main", False)])
def test_the_plugin_names_the_verl_versions_it_supports_and_refuses_others(plugin, version, ok):
    if ok:
        plugin.check_verl_version(version)
        return
    with pytest.raises(ImportError) as err:
        plugin.check_verl_version(version)
    assert f"this is verl {version}" in str(err.value) and "supports verl >=0.9.1,<0.10" in str(err.value)


def test_the_installed_verl_is_a_supported_one(plugin):
    import verl

    plugin.check_verl_version(verl.__version__)   # the CI's verl; importing the plug-in ran the same check


def test_the_plugins_verl_range_is_pyprojects():
    """The range the plug-in lets in is the one `pip install 'skip_harness[verl]'` installs."""
    import re
    from pathlib import Path

    from packaging.specifiers import SpecifierSet

    from skip_harness.integrations.verl_patches import SUPPORTED_VERL

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    specs = re.findall(r'"verl([<>=!~][^"]*)"', pyproject)   # the [verl] extra
    assert specs and all(SpecifierSet(spec) == SpecifierSet(SUPPORTED_VERL) for spec in specs), specs
