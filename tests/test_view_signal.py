"""skip-harness view, what a researcher reads first (issue 43): dead groups flagged, filtered, counted and
charted; advantages within rounding of zero shown as zero; group labels unlike trajectory ids; the
--tokenizer hint; the prompt once; a namespace being recorded says who records and replays it and
refreshes until the recording ends. In process (Starlette's test client), real files, a real lock holder."""
from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from starlette.testclient import TestClient  # noqa: E402

from conftest import HolderProcess  # noqa: E402
from skip_harness.cli.view.app import build_app  # noqa: E402
from skip_harness.cli.view.data import Cache  # noqa: E402
from skip_harness.cli.view.decode import Decoder  # noqa: E402
from view_rig import demo_batch, trl_payload, write_namespace  # noqa: E402


def client(*roots) -> TestClient:
    return TestClient(build_app(Cache(list(roots)), Decoder(), ["testserver"]), raise_server_exceptions=True)


def key(layout) -> str:
    return f"0/{layout.root.parent.name}/{layout.root.name}"


def dead_batch(step: int) -> dict:
    """The demo's batch of 4 prompts x 2 samples: prompt 0 both rewarded 0.7 (dead), prompt 1 0.1 and
    0.3 (float32), prompt 2 both 0.25 (dead), prompt 3 0.2 and 0.2000001 (differ by more than rounding)."""
    b = demo_batch(step, prompts=4, n=2)
    b["rewards"] = torch.tensor([0.7, 0.7, 0.1, 0.3, 0.25, 0.25, 0.2, 0.2 + 2e-6], dtype=torch.float32)
    return b


@pytest.fixture
def dead(tmp_path):
    dump = tmp_path / "cache"
    lay = write_namespace(dump, "dead_run", {s: dead_batch(s) for s in (1, 2)})
    return dump, lay


def test_dead_groups_in_the_json_flagged_and_filtered(dead):
    dump, lay = dead
    c = client(dump)
    doc = c.get(f"/api/ns/{key(lay)}/step/1").json()
    assert doc["dead_groups"] == ["100", "102"]                  # uid 100 + k: prompts 0 and 2
    assert doc["summary"]["dead_group_count"] == 2 and doc["summary"]["dead_group_share"] == 0.5
    page = c.get(f"/ns/{key(lay)}/step/1").text
    assert re.findall(r'<section class="group dead" data-group="(\w+)"', page) == ["100", "102"]
    assert "2 dead groups</a> (50%" in page
    only = c.get(f"/ns/{key(lay)}/step/1?groups=dead").text
    assert re.findall(r'data-group="(\w+)"', only) == ["100", "102"]
    assert re.findall(r'data-ref="([\d.]+)"', only) == ["0.0.0", "0.0.1", "0.0.4", "0.0.5"]
    assert "4 of 8 trajectories shown" in only
    live = c.get(f"/ns/{key(lay)}/step/1?groups=live&sort=reward").text
    assert re.findall(r'data-group="(\w+)"', live) == ["101", "103"]
    r = c.get(f"/ns/{key(lay)}/step/1?groups=bogus")
    assert r.status_code == 400 and "groups=dead" in r.text


def test_dead_groups_counted_per_step_and_charted(dead):
    dump, lay = dead
    c = client(dump)
    page = c.get(f"/ns/{key(lay)}").text
    cells = re.findall(r'<td class="num dead-cell"><a href="/ns/[^"]+/step/(\d)\?groups=dead" class="dead-some">'
                       r'(\d+) \((\d+)%\)</a></td>', page)
    assert cells == [("1", "2", "50"), ("2", "2", "50")]
    svg = c.get(f"/ns/{key(lay)}/charts").text
    chart = svg[svg.index('id="chart-dead"'):]
    chart = chart[:chart.index("</svg>")]
    assert chart.count('class="point"') == 2 and "step 1: 0.5" in chart


def test_computed_advantages_within_rounding_are_zero_and_uncoloured(dead):
    dump, lay = dead
    c = client(dump)
    b = demo_batch(1, prompts=1, n=3)
    b["rewards"] = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)  # 0.2 is their mean, but not in float32
    b["uid"] = torch.tensor([7, 7, 7])
    lay3 = write_namespace(dump, "rounding", {1: b})
    doc = c.get(f"/api/ns/{key(lay3)}/step/1").json()
    adv = [t["advantage"] for t in doc["trajectories"]]
    assert adv[1] == 0.0 and adv[0] == pytest.approx(-1.0, abs=1e-4) and adv[2] == pytest.approx(1.0, abs=1e-4)
    page = c.get(f"/ns/{key(lay3)}/step/1").text
    assert '<td class="num advantage" style="color:inherit">0</td>' in page and "e-0" not in page.split("samples")[-1]
    dead_doc = c.get(f"/api/ns/{key(lay)}/step/1").json()       # a dead group's advantages: exactly 0
    assert [t["advantage"] for t in dead_doc["trajectories"] if t["group"] == "100"] == [0.0, 0.0]


def test_stored_advantages_within_rounding_show_as_zero(tmp_path):
    b = demo_batch(1, prompts=2, n=2)
    b["advantages"] = torch.tensor([2.439e-08, -2.439e-08, 1.5, -1.5], dtype=torch.float32)
    lay = write_namespace(tmp_path / "cache", "stored", {1: b})
    c = client(tmp_path / "cache")
    doc = c.get(f"/api/ns/{key(lay)}/step/1").json()
    assert doc["advantage_computed"] is False
    assert doc["trajectories"][0]["advantage"] == pytest.approx(2.439e-08, rel=1e-3)    # the JSON keeps it
    page = c.get(f"/ns/{key(lay)}/step/1").text
    cells = re.findall(r'<td class="num advantage" style="color:([^"]+)">([^<]+)</td>', page)
    assert cells == [("inherit", "0"), ("inherit", "0"), ("#1a7f37", "1.5"), ("#b00020", "-1.5")]
    traj = c.get(f"/ns/{key(lay)}/step/1/t/0.0.0").text
    assert '<b id="advantage" style="color:inherit">0</b>' in traj
    # a float64 advantage of 1e-9 beside others of 1e-9 is no rounding: shown as it is
    b["advantages"] = torch.tensor([1e-9, -1e-9, 2e-9, -2e-9], dtype=torch.float64)
    lay2 = write_namespace(tmp_path / "cache", "tiny", {1: b})
    assert '>1e-09</td>' in c.get(f"/ns/{key(lay2)}/step/1").text


def test_group_labels_are_not_trajectory_ids(tmp_path):
    dump = tmp_path / "cache"
    trl = write_namespace(dump, "trl_run", {1: trl_payload(1)}, fingerprint={"trl.num_generations": 3})
    c = client(dump)
    doc = c.get(f"/api/ns/{key(trl)}/step/1").json()
    groups = {t["group"] for t in doc["trajectories"]}
    assert groups == {"p0@0.0"}
    assert not any(re.fullmatch(r"\d+\.\d+\.\d+", g) for g in groups)
    assert 'group <span class="mono uid">p0@0.0</span>' in c.get(f"/ns/{key(trl)}/step/1").text


def test_token_ids_alone_get_a_tokenizer_hint(tmp_path):
    dump = tmp_path / "cache"
    trl = write_namespace(dump, "trl_run", {1: trl_payload(1)}, fingerprint={"trl.num_generations": 3})
    c = client(dump)
    page = c.get(f"/ns/{key(trl)}/step/1").text
    assert 'id="tokenizer-hint"' in page and "--tokenizer NAME_OR_PATH" in page
    assert 'id="tokenizer-hint"' in c.get(f"/ns/{key(trl)}/step/1/t/0.0.0").text
    demo = write_namespace(dump, "run_skip_harness_demo", {1: demo_batch(1)})   # the demo decodes its digits
    assert 'id="tokenizer-hint"' not in c.get(f"/ns/{key(demo)}/step/1").text
    half = demo_batch(1, texts=[f"answer {j}" for j in range(6)])        # response text, prompt ids only
    mixed = write_namespace(dump, "mixed", {1: half})
    assert 'id="tokenizer-hint"' in c.get(f"/ns/{key(mixed)}/step/1").text
    half["raw_prompt"] = [f"question {j // 2}" for j in range(6)]             # text of both: nothing to hint
    texts = write_namespace(dump, "texts", {1: half})
    assert 'id="tokenizer-hint"' not in c.get(f"/ns/{key(texts)}/step/1").text


def test_the_trajectory_page_shows_the_prompt_once(tmp_path):
    dump = tmp_path / "cache"
    demo = write_namespace(dump, "run_skip_harness_demo", {1: demo_batch(1)})
    page = client(dump).get(f"/ns/{key(demo)}/step/1/t/0.0.0").text
    assert page.count('id="prompt-text"') == 1 and 'id="prompt-tokens"' not in page
    ids = write_namespace(dump, "plain", {1: demo_batch(1)})          # ids only: the tokens, once
    page = client(dump).get(f"/ns/{key(ids)}/step/1/t/0.0.0").text
    assert 'id="prompt-text"' not in page and page.count('id="prompt-tokens"') == 1


# -------------------------------------------------------------------------------------- a recording still running


def _replay_record(lay, run_id: str, pid: int, host: str, started: float) -> None:
    d = lay.root / ".values" / "runs" / run_id
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"format": 1, "run": run_id, "started": started, "host": host, "pid": pid}))


def test_a_namespace_being_recorded_refreshes_and_says_who(dead):
    dump, lay = dead
    _replay_record(lay, "20261204T000000Z-here-1", os.getpid(), socket.gethostname(), time.time())
    _replay_record(lay, "20261204T000001Z-gone-2", 2 ** 22 + 12345, socket.gethostname(), time.time())
    _replay_record(lay, "20261204T000002Z-far-3", 42, "another-host.example", time.time())
    _replay_record(lay, "20261204T000003Z-reused-4", os.getpid(), socket.gethostname(), 1e9)  # pid reused since
    c = client(dump)
    urls = ("/", f"/ns/{key(lay)}", f"/ns/{key(lay)}/step/1")
    for url in urls:                       # nobody records: no refresh
        assert "refresh" not in c.get(url).headers, url
    holder = HolderProcess(lay)
    try:
        for url, every in zip(urls, ("5", "5", "10")):
            r = c.get(url)
            assert r.headers.get("refresh") == every, url
        page = c.get(f"/ns/{key(lay)}").text
        assert f"recording</b> by pid {holder.pid} on host {socket.gethostname()} since" in page
        assert "refreshes every 5 s" in page
        assert f"run <span class=\"mono\">20261204T000000Z-here-1</span>, pid {os.getpid()}" in page
        assert "gone-2" not in page and "reused-4" not in page   # its process is gone; its pid is another's now
        assert "1 replay recorded here from other hosts" in page
        assert "● recording" in c.get("/").text
        doc = c.get(f"/api/ns/{key(lay)}").json()["live"]
        assert doc["recording"]["pid"] == holder.pid and doc["recording"]["alive"] is True
        assert [r["run"] for r in doc["replaying"]] == ["20261204T000000Z-here-1"]
    finally:
        holder.kill()
    for url in urls:                       # the recording ended (killed: its record stays, its pid is gone)
        r = c.get(url)
        assert "refresh" not in r.headers and "● recording" not in r.text, url
