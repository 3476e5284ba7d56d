"""The hit/miss/repeat policy is pure: these tests need no disk."""
import pytest

from skip_harness.config import RolloutTQConfig
from skip_harness.run.decision import HIT, MISS, OFF, REPEAT, decide, nearest_step


def settings(**kw):
    return RolloutTQConfig(enable=True, **kw)


def test_off_when_disabled_validation_or_step_not_listed():
    assert decide(3, RolloutTQConfig(enable=False), {3}).kind == OFF
    assert decide(3, settings(), {3}, validate=True).kind == OFF
    assert decide(2, settings(steps=[1, 3]), {1, 2, 3}).kind == OFF
    assert decide(3, settings(steps=[1, 3]), {1, 2, 3}).kind == HIT


def test_cache_hits_only_servable_steps():
    d = decide(4, settings(), {1, 2, 3})
    assert (d.kind, d.serves_cache) == (MISS, False)
    d = decide(2, settings(), {1, 2, 3})
    assert (d.kind, d.source_step, d.serves_cache) == (HIT, 2, True)


@pytest.mark.parametrize(
    "step, servable, expected",
    [(5, {1, 3, 7}, 3), (2, {3, 7}, 3), (9, {1, 3, 7}, 7), (4, {4}, 4)],
)
def test_repeat_serves_nearest_earlier_else_later(step, servable, expected):
    d = decide(step, settings(action="repeat"), servable)
    assert d.source_step == expected
    assert d.kind == (HIT if expected == step else REPEAT)


def test_repeat_without_any_complete_step_behaves_as_cache():
    d = decide(5, settings(action="repeat"), set())
    assert d.kind == MISS


def test_nearest_step():
    assert nearest_step(5, {6, 9}) == 6
    assert nearest_step(5, set()) is None
