"""The verl plug-in's patches are guarded by one table (skip_harness.integrations.verl_patches): each
replaced or called method of verl's real classes takes the parameters listed, and a verl whose method
changed is refused by name before anything is wrapped. Built on verl's real classes and subclasses of
them. No Ray needed."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

pytest.importorskip("verl")

from skip_harness.errors import UnsupportedVersionError  # noqa: E402
from skip_harness.integrations import verl_patches  # noqa: E402
from conftest import subprocess_env  # noqa: E402

pytestmark = pytest.mark.verl


def classes():
    import skip_harness.integrations.verl as plugin

    return plugin._verl_classes()


def test_the_installed_verls_methods_are_the_ones_the_table_lists():
    import verl
    from verl.utils.tracking import Tracking

    assert verl_patches.check_shapes(classes(), verl.__version__) == set()
    verl_patches.check_tracking_log(Tracking, verl.__version__)
    listed = {p.owner for p in verl_patches.PATCHES if p.params is not None}
    assert listed == {"PPOTrainer", "ReplayBuffer", "ReplayBufferAsync", "Tracking"}


def _copy(cls: type, **changed) -> type:
    """A subclass of verl's `cls` defining every listed method of it itself (as verl's class does), some
    `changed`."""
    own = {p.name: cls.__dict__[p.name] for p in verl_patches.PATCHES if p.owner == cls.__name__}
    return type(cls.__name__, (cls,), {**own, **changed})


def test_a_verl_whose_wrapped_method_changed_is_refused_naming_it():
    found = classes()

    def _add_prompts_to_generate(self, num_prompts, priority):
        raise AssertionError("never called")

    changed = {**found, "PPOTrainer": _copy(found["PPOTrainer"], _add_prompts_to_generate=_add_prompts_to_generate)}
    with pytest.raises(UnsupportedVersionError) as err:
        verl_patches.check_shapes(changed, "0.9.2")
    assert "verl 0.9.2's PPOTrainer._add_prompts_to_generate takes ('num_prompts', 'priority')" in str(err.value)
    assert isinstance(err.value, ImportError)

    missing = {**found, "ReplayBufferAsync": type("ReplayBufferAsync", (found["ReplayBuffer"],), {})}
    with pytest.raises(UnsupportedVersionError, match=r"verl 0.9.2 has no ReplayBufferAsync\.sample"):
        verl_patches.check_shapes(missing, "0.9.2")


def test_a_verl_whose_tracking_log_changed_is_refused_before_it_is_wrapped():
    """verl_values wraps Tracking.log on import, passing data, step and backend by name."""
    from verl.utils.tracking import Tracking

    class ChangedTracking(Tracking):
        def log(self, data, step):   # no backend
            raise AssertionError("never called")

    ChangedTracking.__name__ = "Tracking"
    with pytest.raises(UnsupportedVersionError, match=r"verl 0.9.2's Tracking\.log takes \('data', 'step'\)"):
        verl_patches.check_tracking_log(ChangedTracking, "0.9.2")


def test_a_verl_whose_evicting_method_changed_is_refused_naming_it():
    """verl_discards' wrappers are rows of the table: a changed one is refused like the rest."""
    found = classes()

    def _evict_terminal_groups(self, global_steps, partition_id, eviction_reasons, metrics):
        raise AssertionError("never called")

    changed = {**found, "ReplayBuffer": _copy(found["ReplayBuffer"], _evict_terminal_groups=_evict_terminal_groups)}
    with pytest.raises(UnsupportedVersionError, match=r"verl 0\.9\.2's ReplayBuffer\._evict_terminal_groups takes "
                                                      r"\('global_steps', 'partition_id', 'eviction_reasons', 'metrics'\)"):
        verl_patches.check_shapes(changed, "0.9.2")


def test_a_verl_without_an_evicting_method_turns_the_discards_off_with_a_warning_naming_it(caplog):
    """What the sampler dropped is a record, never needed to train: a verl without one of the two methods
    verl_discards wraps trains on, the feature off and said, the other rows still checked."""
    found = classes()
    missing = {**found, "ReplayBuffer": _copy(found["ReplayBuffer"], _evict_terminal_groups=None)}
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        off = verl_patches.check_shapes(missing, "0.9.2")
    assert off == {verl_patches.DISCARDS}
    assert ("skip_harness.integrations.verl: recording discarded groups is off: ReplayBuffer has no "
            "_evict_terminal_groups (record each group the sampler evicts") in caplog.text


@pytest.mark.slow
def test_the_plug_in_does_not_wrap_the_discards_of_a_verl_without_them(tmp_path):
    """A real process whose verl ReplayBuffer lacks _evict_terminal_groups: install_hooks wraps verl_hooks'
    methods and leaves _clear_groups as verl has it, saying why."""
    code = """
import logging
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
del ReplayBuffer._evict_terminal_groups
clear = ReplayBuffer.__dict__["_clear_groups"]
import skip_harness.integrations.verl as plugin
from skip_harness.integrations import verl_discards, verl_hooks
logging.basicConfig(level=logging.WARNING)
plugin.install_hooks()
assert ReplayBuffer.__dict__["_clear_groups"] is clear, "wrapped"
assert not verl_discards._installed and verl_hooks._installed
print("installed without discards")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "installed without discards" in proc.stdout
    assert "recording discarded groups is off: ReplayBuffer has no _evict_terminal_groups" in proc.stderr


@pytest.mark.slow
def test_a_refused_config_leaves_verls_classes_unpatched(tmp_path):
    """A real process: verl builds the plug-in with a config it refuses (a name outside dump_dir); the
    ConfigError comes before any of verl's methods is wrapped."""
    code = f"""
from types import SimpleNamespace
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
before = dict(PPOTrainer.__dict__), dict(ReplayBuffer.__dict__)
import skip_harness.integrations.verl as plugin
from skip_harness.errors import ConfigError
from skip_harness.integrations import verl_discards, verl_hooks
from omegaconf import OmegaConf
cfg = OmegaConf.create({{"trainer": {{"experiment_name": "../../etc", "project_name": "p", "v1": {{"trainer_mode": "sync"}}}},
       "data": {{"train_batch_size": 8, "max_prompt_length": 4, "max_response_length": 6}},
       "actor_rollout_ref": {{"rollout": {{"n": 2}}}}}})
local = SimpleNamespace(enable=True, dump_dir={str(tmp_path / "dump")!r}, steps=[1], action="cache")
try:
    plugin.HarnessRolloutTqSkip(local, cfg)
except ConfigError as exc:
    print("refused:", exc)
assert not verl_hooks._installed and not verl_discards._installed, "patched"
assert (dict(PPOTrainer.__dict__), dict(ReplayBuffer.__dict__)) == before, "patched"
print("unpatched")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: trainer.experiment_name" in proc.stdout and "unpatched" in proc.stdout
    assert not (tmp_path / "dump").exists()
