"""Drift where it happened (issue 43 item 3, issue 39): a recording's pages show what each `action=compare`
run measured -- per step the share identical and the first differing token, per trajectory whether it is
identical and where it first differs -- and every compare run of the namespace can be chosen."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from starlette.testclient import TestClient  # noqa: E402

from skip_harness.cli.view.app import build_app  # noqa: E402
from skip_harness.cli.view.data import Cache  # noqa: E402
from skip_harness.cli.view.decode import Decoder  # noqa: E402
from skip_harness.store.api import ValuesStore, open_namespace  # noqa: E402

from test_compare_action import _run  # noqa: E402


@pytest.fixture
def runs(tmp_path):
    rec, _ = _run(tmp_path, 1.0)
    same, _ = _run(tmp_path, 1.0, action="compare")
    hot, _ = _run(tmp_path, 0.5, action="compare")
    c = TestClient(build_app(Cache([tmp_path / "c"]), Decoder(), ["testserver"]), raise_server_exceptions=True)
    key = f"0/{rec.layout.root.parent.name}/{rec.layout.root.name}"
    return c, key, rec, same, hot


def test_every_compare_run_is_listed_and_the_newest_is_shown_per_step_and_trajectory(runs):
    c, key, rec, same, hot = runs
    store = ValuesStore(open_namespace(rec.layout))
    doc = c.get(f"/api/ns/{key}/step/2").json()
    assert doc["compare_runs"] == [same.run_id, hot.run_id] and doc["compare_run"] == hot.run_id
    kept = store.read_run_step(hot.run_id, 2).values
    drift = doc["drift"]
    assert drift["identical_share"] == kept["compare/identical_share"] < 1
    assert drift["identical"] == kept["compare/identical"] and drift["trajectories"] == 4
    assert drift["first_difference"] == store.read_run_drift(hot.run_id, 2)["first_difference"]
    assert sorted(drift["first_difference"]) == [t["ref"] for t in doc["trajectories"]]
    differing = {r: v for r, v in drift["first_difference"].items() if v is not None}
    assert differing and drift["first_diff_token"] == min(differing.values())
    page = c.get(f"/ns/{key}/step/2").text
    assert f"{int(kept['compare/identical'])} of 4 trajectories identical" in page
    assert page.count("generated again: differs from token") == len(differing)
    assert page.count("identical when generated again") == 4 - len(differing)
    assert page.count('<mark class="first-diff"') == len(differing)       # the token marked in the response
    assert f"?compare_run={same.run_id}" in page                     # the other run, one click away


def test_an_older_compare_run_can_be_chosen_and_an_unknown_one_is_named(runs):
    c, key, _rec, same, _hot = runs
    doc = c.get(f"/api/ns/{key}/step/2?compare_run={same.run_id}").json()
    assert doc["compare_run"] == same.run_id and doc["drift"]["identical_share"] == 1.0
    assert set(doc["drift"]["first_difference"].values()) == {None}
    assert "4 of 4 trajectories identical (100%), no differing token" in c.get(f"/ns/{key}/step/2?compare_run={same.run_id}").text
    page = c.get(f"/ns/{key}?compare_run={same.run_id}").text
    assert f'<option value="{same.run_id}" selected>' in page
    charts = c.get(f"/ns/{key}/charts?k=compare/identical_share&compare_run={same.run_id}").text
    assert 'id="chart-value-0"' in charts and f"step/1?compare_run={same.run_id}" in charts
    for url in (f"/ns/{key}/step/2?compare_run=nope", f"/ns/{key}?compare_run=nope", f"/api/ns/{key}/step/2?compare_run=nope"):
        r = c.get(url)
        assert r.status_code == 400 and "compare_run=" in r.text and "nope" in r.text and same.run_id in r.text
