"""What a filter discarded, and why (issue 43 item 2; run.discards, store.discards): a trainer reports the
groups it dropped with `harness.discard(step, groups, reason)`; they are recorded beside the generated
step once it is committed, shown by `skip-harness view` on the step's own discarded page and in the step
JSON's `discarded`, travel with a pack, and a replay serves the step exactly as recorded. In process,
real files, the viewer through Starlette's test client."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from skip_harness import SkipHarness
from skip_harness.errors import HarnessUsageError
from skip_harness.store.api import unpack, write_pack
from skip_harness.store.discards import discards_key

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from skip_harness.cli.view.app import build_app  # noqa: E402
from skip_harness.cli.view.data import Cache  # noqa: E402
from skip_harness.cli.view.decode import Decoder  # noqa: E402

XSS = '<script>window.__xss = 1</script>'
TIED = "filter_groups: every sample's reward was the same (no GRPO signal)"


class Loop:
    """A GRPO-like loop: 4 prompts x 2 samples a step; a filter drops the groups whose samples tie."""

    def generate(self, step):
        g = torch.Generator().manual_seed(step)
        reward = torch.rand(8, generator=g)
        reward[2:4] = 0.5                                   # group 1 ties: the filter drops it
        return {"ids": torch.randint(0, 100, (8, 6), generator=g), "reward": reward,
                "uid": torch.arange(4).repeat_interleave(2) + 10 * step}


def run(dump, steps=(1, 2, 3), report=True, **settings):
    loop = Loop()
    harness = SkipHarness.create({"enable": True, "dump_dir": str(dump), **settings},
                                 namespace={"experiment_name": "dapo", "project_name": "demo", "K": 1, "n": 2},
                                 fingerprint={"model": "m", "temperature": 1.0})
    harness.wrap(loop, sample="generate", prepare_data=None)
    served = {}
    try:
        for step in steps:
            batch = loop.generate(step)
            served[step] = batch
            if report:
                tied = {f"g{step}-1": [0.5, 0.5], XSS: [0.5, 0.5]}
                harness.discard(step, tied, TIED)
                harness.discard(step, [f"g{step}-9"], "surplus: more groups than the batch needed")
            harness.observe(step, loss=float(batch["reward"].mean()))
    finally:
        harness.close()
    return harness, served


def namespace_of(dump: Path) -> Path:
    return next(dump.glob("dapo_demo/*"))


def client(*roots) -> TestClient:
    return TestClient(build_app(Cache(list(roots)), Decoder(), ["testserver"]), raise_server_exceptions=True)


def view_key(root: Path) -> str:
    return f"0/{root.parent.name}/{root.name}"


def test_reported_discards_are_stored_and_shown_on_their_page(tmp_path):
    run(tmp_path)
    root = namespace_of(tmp_path)
    doc = json.loads((root / discards_key(2)).read_text())
    assert doc["step"] == 2 and doc["commit_created"] == json.loads((root / "2" / "commit.json").read_text())["created"]
    assert doc["discarded"] == [
        {"group": "g2-1", "reason": TIED, "rewards": [0.5, 0.5]},
        {"group": XSS, "reason": TIED, "rewards": [0.5, 0.5]},
        {"group": "g2-9", "reason": "surplus: more groups than the batch needed", "rewards": None}]
    c = client(tmp_path)
    step = c.get(f"/api/ns/{view_key(root)}/step/2").json()
    assert [(d["group"], d["reason"]) for d in step["discarded"]] == [(d["group"], d["reason"]) for d in doc["discarded"]]
    page = c.get(f"/ns/{view_key(root)}/step/2").text
    assert re.search(r'href="/ns/[^"]+/step/2/discarded">3 groups discarded</a>', page)
    listing = c.get(f"/ns/{view_key(root)}/step/2/discarded").text
    assert re.findall(r'<tr class="discarded-group" data-group="([^"]+)">', listing) == \
        ["g2-1", "&lt;script&gt;window.__xss = 1&lt;/script&gt;", "g2-9"]
    assert XSS not in listing and "0.5, 0.5 <span class=\"dead-badge\"" in listing and "not reported" in listing
    assert "<td>" + TIED.replace("'", "&#39;") + "</td><td class=\"num\">2</td>" in listing   # the reasons, counted
    assert '<td class="mono uid">g2-1</td><td>' + TIED.replace("'", "&#39;") + "</td>\n" in listing   # each row's, escaped
    assert c.get(f"/ns/{view_key(root)}/step/7/discarded").status_code == 404


def test_a_replay_serves_the_step_as_recorded_and_keeps_the_recorded_discards(tmp_path):
    _h, recorded = run(tmp_path)
    root = namespace_of(tmp_path)
    before = {s: (root / discards_key(s)).read_bytes() for s in (1, 2, 3)}
    harness, replayed = run(tmp_path, report=False)
    assert harness.summary().hits == 3
    for s in (1, 2, 3):
        assert set(replayed[s]) == set(recorded[s])
        for k in recorded[s]:
            assert torch.equal(replayed[s][k], recorded[s][k]), (s, k)
    again, _ = run(tmp_path)            # a replay that reports other discards: the recording's stand
    assert again.summary().hits == 3
    assert {s: (root / discards_key(s)).read_bytes() for s in (1, 2, 3)} == before


def test_discards_travel_with_a_pack_and_go_with_their_step(tmp_path):
    run(tmp_path / "cache")
    root = namespace_of(tmp_path / "cache")
    pack = tmp_path / "run.shpack"
    write_pack(root, pack)
    c = client(pack)
    key = c.get("/api/namespaces").json()["namespaces"][0]["key"]
    assert [d["group"] for d in c.get(f"/api/ns/{key}/step/3").json()["discarded"]] == ["g3-1", XSS, "g3-9"]
    assert "3 groups discarded" in c.get(f"/ns/{key}/step/3").text
    restored = unpack(pack, tmp_path / "restored")
    assert (restored / discards_key(3)).read_bytes() == (root / discards_key(3)).read_bytes()
    from skip_harness.store.api import open_namespace
    from skip_harness.store.layout import Layout
    open_namespace(Layout(root, K=1, W=1)).remove_step(3)
    assert not (root / discards_key(3)).exists()


def test_a_step_without_discards_says_so_and_bad_reports_are_refused(tmp_path):
    run(tmp_path, steps=(1,), report=False)
    root = namespace_of(tmp_path)
    assert not (root / discards_key(1)).exists()
    c = client(tmp_path)
    assert c.get(f"/api/ns/{view_key(root)}/step/1").json()["discarded"] == []
    assert "groups discarded" not in c.get(f"/ns/{view_key(root)}/step/1").text
    assert 'id="none-discarded"' in c.get(f"/ns/{view_key(root)}/step/1/discarded").text
    harness = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "other")},
                                 namespace={"experiment_name": "x", "project_name": "y", "K": 1})
    loop = Loop()
    harness.wrap(loop, sample="generate", prepare_data=None)
    try:
        loop.generate(1)
        for groups, reason, said in (([1], "", "reason"), ("g1", "tied", "groups"), ([1.5], "tied", "group id"),
                                     ({"g": ["x"]}, "tied", "rewards of group 'g'")):
            with pytest.raises(HarnessUsageError, match=said):
                harness.discard(1, groups, reason)
    finally:
        harness.close()


def test_discards_on_an_object_store(s3_bucket, s3_env):
    """Recorded through the object-store backend (a real S3 server: create-only puts), read by the viewer."""
    url = f"s3://{s3_bucket}/dump"
    run(url)
    c = client(url)
    [ns] = c.get("/api/namespaces").json()["namespaces"]
    doc = c.get(f"/api/ns/{ns['key']}/step/2").json()
    assert [(d["group"], d["rewards"]) for d in doc["discarded"]] == [("g2-1", [0.5, 0.5]), (XSS, [0.5, 0.5]),
                                                                      ("g2-9", None)]
    _h, _ = run(url)                     # the replay: served, the recording's discards kept
    assert c.get(f"/api/ns/{ns['key']}/step/2").json()["discarded"] == doc["discarded"]


def test_discards_reported_after_the_commit_are_recorded_and_merged(tmp_path):
    """A trainer may report what it dropped after the step trained (its commit landed): written then, and a
    later report of the same step merged into it."""
    loop = Loop()
    harness = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path)},
                                 namespace={"experiment_name": "dapo", "project_name": "demo", "K": 1, "n": 2})
    harness.wrap(loop, sample="generate", prepare_data=None)
    try:
        loop.generate(1)
        harness.commit_finished()                 # step 1 committed before anything is reported
        harness.discard(1, ["a"], "late")
        harness.flush()
        loop.generate(2)
        harness.discard(1, {"b": [1.0, 1.0]}, "later")
    finally:
        harness.close()
    doc = json.loads((namespace_of(tmp_path) / discards_key(1)).read_text())
    assert doc["discarded"] == [{"group": "a", "reason": "late", "rewards": None},
                                {"group": "b", "reason": "later", "rewards": [1.0, 1.0]}]
