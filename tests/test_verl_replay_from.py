"""Issue 28, item 4 in verl's own V1 trainer code (tests/verl_rig.py): a recording at K = 2 serves a run at
K = 1 (sync mode) through the plug-in's decorated methods with `+skip_harness.replay_from=auto`: no
rollout, and the one mini-batch verl's trainer reads is the recorded two concatenated in order."""
from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import verl_rig as rig  # noqa: E402

from skip_harness import codec  # noqa: E402

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import skip_harness.integrations.verl as plugin  # what VERL_USE_EXTERNAL_MODULES imports
    from verl.utils.skip.base_skip import SKIP_REGISTRY

    assert SKIP_REGISTRY["rollout_tq"] is plugin.HarnessRolloutTqSkip
    cfg = rig.compose(str(tmp_path_factory.mktemp("boot")))
    address = rig.start(cfg)
    yield address
    rig.clear_queue()


def test_a_k2_recording_serves_k1_rechunked(cluster, tmp_path):
    recorded = rig.run_steps(rig.compose(str(tmp_path), K=2), buffer="sync", salt=1, steps=(1, 2))
    assert recorded.outcomes == {1: "miss", 2: "miss"}
    cfg = rig.compose(str(tmp_path), K=1, extra=["+skip_harness.replay_from=auto"])
    replay = rig.run_steps(cfg, buffer="sync", salt=2, steps=(1, 2))
    assert replay.outcomes == {1: "hit", 2: "hit"}
    assert replay.train_generations == 0, "the replay dispatched a rollout"
    for step in (1, 2):
        two = [s for s in recorded.sampled if s.step == step]
        [one] = [s for s in replay.sampled if s.step == step]
        whole = codec.merge([s.data for s in two])
        fields = sorted(k for k in one.data.keys() if k != "uid")
        assert fields == sorted(k for k in whole.keys() if k != "uid")
        for k in fields:
            assert rig.plain(one.data.get(k)) == rig.plain(whole.get(k)), f"step {step}: field {k} differs"
        assert rig.uid_field_matches_keys(one)
    # the recording's namespace holds K = 2; this run's own (K = 1) holds nothing: it generated nothing
    own = tmp_path / f"{rig.EXPERIMENT}_{rig.PROJECT}" / "GBS4_N2_in8_out6"
    assert not own.exists() or not [p for p in own.iterdir() if p.name.isdigit()]
