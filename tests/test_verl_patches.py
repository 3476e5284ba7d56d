"""The verl plug-in's patches are guarded by one table (skip_harness.integrations.verl_patches): each
replaced or called method of verl's real classes takes the parameters listed, and a verl whose method
changed is refused by name before anything is wrapped. Built on verl's real classes and subclasses of
them. No Ray needed."""
from __future__ import annotations

import pytest

pytest.importorskip("verl")

from skip_harness.errors import UnsupportedVersionError  # noqa: E402
from skip_harness.integrations import verl_patches  # noqa: E402

pytestmark = pytest.mark.verl


def classes():
    import skip_harness.integrations.verl as plugin

    return plugin._verl_classes()


def test_the_installed_verls_methods_are_the_ones_the_table_lists():
    import verl
    from verl.utils.tracking import Tracking

    verl_patches.check_shapes(classes(), verl.__version__)
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
