"""What verl's DAPO filter discarded, recorded with the step (issue 43 item 2; integrations.verl_discards): verl's
own V1 ReplayBuffer with algorithm.filter_groups on and groups that tie (tests/verl_rig.py), on Ray and
TransferQueue. The recording keeps, beside each step, every group DAPO evicted with its reason and its
samples' shared reward; the replay serves every step as recorded and leaves those records as they were."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import verl_rig as rig  # noqa: E402

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import skip_harness.integrations.verl  # noqa: F401 - what VERL_USE_EXTERNAL_MODULES imports

    address = rig.start(rig.compose(str(tmp_path_factory.mktemp("boot"))))
    yield address
    rig.clear_queue()


def test_dapo_evictions_are_recorded_with_their_reason_and_a_replay_keeps_them(cluster, tmp_path):
    extra = ["data.gen_batch_size=1", "algorithm.filter_groups.enable=true"]
    steps = (1, 2)
    cfg = rig.compose(str(tmp_path / "cache"), steps=steps, extra=extra, mode="sync")
    first = rig.run_steps(cfg, buffer="sync", salt=1, steps=steps, tie_every=3)
    assert first.outcomes == {1: "miss", 2: "miss"}
    files = sorted((tmp_path / "cache").glob("*/*/.values/discarded-*.json"))
    docs = {json.loads(f.read_text())["step"]: json.loads(f.read_text()) for f in files}
    n = int(cfg.actor_rollout_ref.rollout.n)
    for s in steps:
        evicted = sum(x.metrics.get("training/filter_groups/evicted_samples", 0) for x in first.sampled if x.step == s)
        tied = [d for d in docs.get(s, {"discarded": []})["discarded"] if d["reason"].startswith("filter_groups: every")]
        assert len(tied) == evicted, (s, docs.get(s))
        kept = {k.split("_")[0] for x in first.sampled if x.step == s for k in x.keys}
        for d in tied:
            assert d["reason"] == "filter_groups: every sample's reward was 0.5 (no spread, no GRPO signal)"
            assert d["rewards"] == [0.5] * n and d["group"] not in kept
    assert sum(len(d["discarded"]) for d in docs.values()) > 0
    before = {f: f.read_bytes() for f in files}

    second = rig.run_steps(cfg, buffer="sync", salt=2, steps=steps, tie_every=3)
    assert second.outcomes == {1: "hit", 2: "hit"} and second.train_generations == 0
    assert [rig.comparable(x) for x in second.sampled] == [rig.comparable(x) for x in first.sampled]
    assert {f: f.read_bytes() for f in files} == before
    assert sorted((tmp_path / "cache").glob("*/*/.values/discarded-*.json")) == files
