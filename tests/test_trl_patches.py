"""What attach replaces on a TRL GRPOTrainer is guarded as verl's patches are (skip_harness.integrations.
trl_patches): TRL's version in a tested range, each replaced method's parameters as checked, a changed one
refused by name, a missing optional one said. Built on TRL's real GRPOTrainer class and subclasses of it."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from skip_harness.errors import UnsupportedVersionError  # noqa: E402
from skip_harness.integrations import trl_patches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = trl_patches.installed_version()


@pytest.mark.parametrize("version,ok", [("1.16.0", True), ("1.16.3", True), ("1.15.2", False), ("1.17.0", False),
                                        ("1.17.0.dev0", False), ("2.0.0", False), ("main", False)])
def test_a_trl_outside_the_tested_range_is_refused_by_name(version, ok):
    if ok:
        trl_patches.check_trl_version(version)
        return
    with pytest.raises(UnsupportedVersionError) as err:
        trl_patches.check(GRPOTrainer, version)          # before any method is looked at
    assert f"this is TRL {version}" in str(err.value) and "supports TRL 1.16.x" in str(err.value)
    assert isinstance(err.value, ImportError)


def test_the_installed_trl_and_pyprojects_range_are_the_tested_one():
    from packaging.specifiers import SpecifierSet

    trl_patches.check_trl_version(INSTALLED)
    assert trl_patches.check(GRPOTrainer, INSTALLED) == {p.name for p in trl_patches.PATCHES}
    specs = re.findall(r'"trl([<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())   # [trl] and [dev]
    assert len(specs) == 2
    for spec in map(SpecifierSet, specs):
        assert INSTALLED in spec and "1.17.0" not in spec and "1.15.0" not in spec, spec


def test_a_changed_signature_is_refused_naming_the_method_and_trls_version():
    class ChangedRewards(GRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions):  # type: ignore[override]
            raise AssertionError("never called")

    with pytest.raises(UnsupportedVersionError) as err:
        trl_patches.check(ChangedRewards, INSTALLED)
    message = str(err.value)
    assert f"TRL {INSTALLED}'s GRPOTrainer._calculate_rewards takes ('inputs', 'prompts', 'completions')" in message
    assert "completion_ids_list" in message and "TRL 1.16.x" in message

    class Reordered(GRPOTrainer):        # the prompts are digested by position: an order change is a change
        def _generate_single_turn(self, images, prompt_ids, multimodal_fields, num_generations,  # type: ignore[override]
                                  has_tool_images=False):
            raise AssertionError("never called")

    with pytest.raises(UnsupportedVersionError, match=r"GRPOTrainer\._generate_single_turn takes \('images'"):
        trl_patches.check(Reordered, INSTALLED)


def test_an_override_that_passes_every_argument_on_is_checked_through():
    """scripts/trl_demo.py's counting trainer: ``(self, *args, **kwargs)`` then super(): TRL's own method,
    the one it calls, is the one checked."""
    class Counting(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            return super()._generate_single_turn(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    assert trl_patches.check(Counting, INSTALLED) == {p.name for p in trl_patches.PATCHES}

    class PassingOnToAChangedOne(Counting):
        def _calculate_rewards(self, *args, **kwargs):
            return super()._calculate_rewards(*args, **kwargs)

    class Changed(GRPOTrainer):
        def _calculate_rewards(self, inputs):  # type: ignore[override]
            raise AssertionError("never called")

    class Both(PassingOnToAChangedOne, Changed):   # the pass-through calls Changed's: that one is refused
        pass

    with pytest.raises(UnsupportedVersionError, match=r"_calculate_rewards takes \('inputs',\)"):
        trl_patches.check(Both, INSTALLED)



def test_a_missing_reward_method_turns_the_rewards_tier_off_and_says_so(caplog):
    class NoRewards(GRPOTrainer):
        _calculate_rewards = None

    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        usable = trl_patches.check(NoRewards, INSTALLED)
    assert trl_patches.REWARD_METHOD not in usable and trl_patches.GENERATION_METHOD in usable
    assert "the second tier's rewards is off: NoRewards has no _calculate_rewards" in caplog.text

    class NoGeneration(GRPOTrainer):
        _generate_single_turn = None

    with pytest.raises(UnsupportedVersionError, match=r"has no GRPOTrainer\._generate_single_turn"):
        trl_patches.check(NoGeneration, INSTALLED)       # caching itself needs it: refused, not turned off


@pytest.mark.parametrize("tier", [True, False])
def test_attach_leaves_a_missing_reward_method_alone_and_says_so(tmp_path, caplog, tier):
    """attach on a real trainer whose class has no _calculate_rewards: generation is wrapped, the reward is
    not, and the WARNING names what turned off -- only when the second tier is asked for (`tier=False`:
    nothing of it turns off, nothing is said)."""
    from datasets import Dataset

    from skip_harness.demo.tiny_llama import save_tiny_llama
    from skip_harness.integrations.trl import attach

    class NoRewards(GRPOTrainer):
        _calculate_rewards = None

    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=4, report_to="none", use_cpu=True,
                      save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = NoRewards(model=save_tiny_llama(tmp_path / "model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                        args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2="]}))
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        attach(trainer, dump_dir=str(tmp_path / "cache"), experiment_name="patches", tier=tier)
    assert trl_patches.GENERATION_METHOD in trainer.__dict__
    assert trl_patches.REWARD_METHOD not in trainer.__dict__
    assert ("the second tier's rewards is off: NoRewards has no _calculate_rewards" in caplog.text) is tier
    assert ("the second tier" in caplog.text) is tier
