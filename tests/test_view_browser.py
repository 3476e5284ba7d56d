"""skip-harness view in a real browser: headless Chromium (Debian's package) driven by Playwright, the
viewer a real `skip-harness view` process on caches the demo's `scripts/train.py` wrote (locally and on
the S3 test server). Clicks overview -> namespace -> chart point -> step -> trajectory -> compare and
checks what the pages show against the cache read directly.

Under CI (CI set) a missing browser fails the run; elsewhere these tests skip, naming what to install.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from skip_harness.store.open import open_store
from skip_harness.demo import TINY_OVERRIDES
from skip_harness.store.layout import Layout
from skip_harness.store.stepstore import StepStore
from skip_harness.cli.view.decode import DEMO_VOCAB
from view_rig import REPO, XSS, demo_batch, long_payload, snapshot, subprocess_env, viewer, write_namespace

# one xdist worker runs this file, so its module fixture is built once (.ci/run: -n 2 --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_view_browser")]

CHROMIUM = Path("/usr/bin/chromium")
INSTALL = "apt-get install -y chromium && pip install playwright"
TRAIN = REPO / "scripts" / "train.py"
SYNC = "sync_seed0_skip_harness_demo/GBS8_N2_in6_out6"
ASYNC = "colocate_async_seed0_skip_harness_demo/GBS8_N2_in6_out6"


@pytest.fixture(scope="module")
def browser():
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the playwright package"
    if missing is None and not CHROMIUM.exists():
        missing = f"Chromium at {CHROMIUM}"
    if missing is not None:
        message = f"the browser tests need {missing}: {INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI installs it: a missing browser fails the run)")
        pytest.skip(message)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    dialogs = []
    pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    pg.dialogs = dialogs
    yield pg
    context.close()


def train(cwd: Path, run: str, *overrides: str, env=None, steps: int = 3, wait: bool = True):
    cmd = [sys.executable, str(TRAIN), f"hydra.run.dir={cwd / run}", *TINY_OVERRIDES,
           f"trainer.total_training_steps={steps}", *overrides]
    e = subprocess_env(env)
    e.pop("HYDRA_FULL_ERROR", None)
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def train_in_process(where: Path, dump_dir: str, mode: str, steps: int = 3) -> None:
    """The demo's training (`skip_harness.demo.run.train`, what scripts/train.py runs) in this process."""
    from hydra import compose, initialize_config_dir

    from skip_harness.demo.config import register_demo_configs
    from skip_harness.demo.run import train as demo_train

    register_demo_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", [*TINY_OVERRIDES, f"trainer.total_training_steps={steps}", f"trainer_mode={mode}",
                                 f"skip.rollout_tq.dump_dir={dump_dir}"])
    demo_train(cfg, run_dir=where / f"run_{mode}")


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    """Two demo runs (sync and colocate_async, 3 steps each), trained in this process."""
    where = tmp_path_factory.mktemp("view_demo")
    for mode in ("sync", "colocate_async"):
        train_in_process(where, str(where / "cache"), mode)
    return where / "cache"


def read_batch(root: Path, ns: str, step: int) -> dict:
    leaf = root / ns
    [batch] = open_store(Layout(leaf, K=1, W=1)).reader.read_step(step, 0)
    return batch


def fmt(x: float) -> str:
    return f"{x:.4g}"


def test_click_through_overview_namespace_step_trajectory_compare(demo_cache, page, tmp_path):
    before = snapshot(demo_cache)
    with viewer(tmp_path, str(demo_cache)) as v:
        page.goto(v.url)
        links = page.locator("a.ns-link")
        assert sorted(links.all_inner_texts()) == sorted([SYNC, ASYNC])
        assert page.locator("#totals").inner_text().startswith("2 namespaces, 6 steps, ")
        page.get_by_role("link", name=SYNC, exact=True).click()
        page.wait_for_url("**/ns/**")   # the click navigates: count on the new page, not the old one
        assert page.locator("#steps tbody tr").count() == 3
        charts = page.frame_locator("#charts")
        assert charts.locator("svg[id^=chart-value]").count() >= 1      # the values the demo recorded per step
        assert "recorded: reward_mean" in charts.locator("body").inner_text()
        # a point of the reward chart opens its step
        page.frame_locator("#charts").locator("#chart-reward a.point[data-step='2']").click()
        page.wait_for_url("**/step/2")
        batch = read_batch(demo_cache, SYNC, 2)
        rewards = batch["rewards"].double()
        summary = page.locator("#summary").inner_text()
        assert f"{rewards.numel()} trajectories in {batch['uid'].unique().numel()} groups" in summary
        assert f"reward mean {fmt(rewards.mean().item())}" in summary
        shown = [float(x) for x in page.locator("tr.sample td:nth-child(2)").all_inner_texts()]
        assert shown == pytest.approx(rewards.tolist(), rel=1e-3, abs=1e-4)
        # sort and search are plain URLs
        page.select_option("select[name=sort]", "reward")
        page.select_option("select[name=order]", "desc")
        page.click("#controls button[type=submit]")
        assert "sort=reward" in page.url
        first = float(page.locator("tr.sample td:nth-child(2)").first.inner_text())
        assert first == pytest.approx(rewards.max().item(), rel=1e-3)
        needle = " ".join(str(x) for x in batch["responses"][5].tolist())      # its whole response
        page.fill("input[name=q]", needle)
        page.click("#controls button[type=submit]")
        hits = [j for j in range(16) if needle in " ".join(str(x) for x in batch["responses"][j].tolist())]
        assert page.locator("#shown").inner_text().startswith(f"{len(hits)} of 16")
        assert page.locator("tr.sample").evaluate_all("rows => rows.map(r => r.dataset.ref)") == [f"0.0.{j}" for j in hits]
        # a trajectory: its response tokens (the demo's own digits and separators, padding dropped) and
        # log-probs are the cache's
        page.goto(f"{v.url}ns/0/{SYNC}/step/2")
        page.locator("a.traj-link", has_text="0.0.5").click()
        page.wait_for_url("**/t/0.0.5")
        real = int(torch.nonzero(batch["response_mask"][5]).flatten()[-1]) + 1
        tokens = page.locator("#response-tokens .tok").all_inner_texts()
        assert tokens == [DEMO_VOCAB[x] for x in batch["responses"][5][:real].tolist()]
        assert float(page.locator("#reward").inner_text()) == pytest.approx(rewards[5].item(), rel=1e-3)
        assert float(page.locator("#length").inner_text()) == batch["response_mask"][5].sum().item()
        assert "old_logprobs" in page.locator("#legend").inner_text()
        page.locator("#per-token-values summary").click()                 # expands in place
        column = page.locator("#per-token th").all_inner_texts().index("old_logprobs") + 1
        logprobs = page.locator(f"#per-token tbody td:nth-child({column})").all_inner_texts()
        assert [float(x) for x in logprobs] == pytest.approx(batch["old_logprobs"][5][:real].tolist(), rel=1e-2, abs=1e-3)
        page.click("#next-traj")
        page.wait_for_url("**/t/0.0.6")
        # previous / next step
        page.goto(f"{v.url}ns/0/{SYNC}/step/2")
        page.click("#next")
        page.wait_for_url("**/step/3")
        page.click("#prev")
        page.wait_for_url("**/step/2")
        # compare the two runs at step 2, from the overview's form
        page.goto(v.url)
        page.select_option("select[name=a]", f"0/{SYNC}")
        page.select_option("select[name=b]", f"0/{ASYNC}")
        page.fill("input[name=step]", "2")
        page.click("form.compare-form button")
        page.wait_for_url("**/compare?*")
        other = read_batch(demo_cache, ASYNC, 2)
        same = sum(int(torch.equal(batch["responses"][j], other["responses"][j])
                       and batch["rewards"][j].item() == other["rewards"][j].item()) for j in range(16))
        assert page.locator("#diff-summary").inner_text().startswith(f"{same} pairs identical, {16 - same} differ")
        assert page.locator("#side-0 h2").inner_text() == SYNC and page.locator("#side-1 h2").inner_text() == ASYNC
        assert page.locator("#diff-verdict").count() == 1                          # skip-harness diff's values
        assert page.dialogs == []
    assert snapshot(demo_cache) == before           # nothing written, nothing locked


def test_dead_groups_filtered_in_the_browser(demo_cache, page, tmp_path):
    """A demo recording's dead groups (every sample of a prompt the same reward) are the ones the step's form
    filters to, flagged, and counted on the namespace page."""
    steps = {}
    for s in (1, 2, 3):
        batch = read_batch(demo_cache, SYNC, s)
        by: dict = {}
        for u, r in zip(batch["uid"].tolist(), batch["rewards"].tolist()):
            by.setdefault(str(u), []).append(r)
        steps[s] = [g for g, rs in by.items() if len(rs) >= 2 and max(rs) == min(rs)]
    step = max(steps, key=lambda s: len(steps[s]))
    assert steps[step], steps            # the seeded demo run has some (n = 2, an untrained policy)
    with viewer(tmp_path, str(demo_cache)) as v:
        page.goto(f"{v.url}ns/0/{SYNC}/step/{step}")
        page.select_option("#group-filter", "dead")
        page.click("#controls button[type=submit]")
        page.wait_for_url("**groups=dead*")
        assert page.locator("section.group").evaluate_all("s => s.map(e => e.dataset.group)") == steps[step]
        assert page.locator("section.group.dead .dead-badge").count() == len(steps[step])
        assert page.locator("#dead-count").inner_text() == f"{len(steps[step])} dead group{'s' if len(steps[step]) != 1 else ''}"
        page.goto(f"{v.url}ns/0/{SYNC}")
        cells = page.locator("#steps td.dead-cell").all_inner_texts()
        assert [c.split(" ")[0] for c in cells] == [str(len(steps[s])) for s in (1, 2, 3)]
        assert page.frame_locator("#charts").locator("#chart-dead a.point").count() == 3


def test_a_recording_refreshes_its_pages_until_it_ends(page, tmp_path):
    """While a run holds the namespace (a real lock holder) Chromium reloads its page by itself (the
    HTTP Refresh header, no script), and stops once the run has ended."""
    from conftest import HolderProcess

    dump = tmp_path / "cache"
    lay = write_namespace(dump, "rec", {1: demo_batch(1)})
    with viewer(tmp_path, str(dump)) as v:
        url = f"{v.url}ns/0/rec/{lay.root.name}"
        asked: list = []
        page.on("request", lambda r: asked.append(r.url) if r.url == url else None)
        holder = HolderProcess(lay)
        try:
            page.goto(url)
            assert f"pid {holder.pid}" in page.locator("#recording").inner_text()
            page.wait_for_timeout(6500)
            assert len(asked) >= 2, asked          # reloaded by itself after 5 s
        finally:
            holder.kill()
        page.goto(url)
        assert page.locator("#recording").count() == 0
        asked.clear()
        page.wait_for_timeout(6500)
        assert asked == []                         # the recording ended: no more reloads


def test_untrusted_text_never_runs(page, tmp_path):
    dump = tmp_path / "cache"
    batch = demo_batch(1, texts=[XSS[j % 2] for j in range(6)])
    batch["uid"] = [XSS[1]] * 2 + [XSS[0]] * 2 + ["u3"] * 2
    batch[XSS[1]] = torch.zeros(6)                                   # a field's name
    write_namespace(dump, "xss", {1: batch})
    ns = "0/xss/GBS6_N2_in4_out5"
    with viewer(tmp_path, str(dump)) as v:
        for url in (f"{v.url}ns/{ns}/step/1", f"{v.url}ns/{ns}/step/1/t/0.0.0", f"{v.url}ns/{ns}/step/1/t/0.0.1"):
            page.goto(url)
            assert page.evaluate("window.__xss") is None
            assert page.locator("img").count() == 0 and page.locator("main script").count() == 0
            assert XSS[0] in page.locator("main").inner_text() or XSS[1] in page.locator("main").inner_text()
        page.goto(f"{v.url}ns/{ns}/step/1")
        assert page.get_by_text(XSS[0]).count() >= 2 and page.get_by_text(XSS[1]).count() >= 2
        assert page.dialogs == []


def test_beside_a_running_training(demo_cache, page, tmp_path):
    """A training writes a new namespace while the viewer shows it: the viewer sees its steps as they
    are committed and the training never waits for it."""
    with viewer(tmp_path, str(demo_cache)) as v:
        run = train(tmp_path, "live", "trainer_mode=sync", "seed=7", f"skip.rollout_tq.dump_dir={demo_cache}",
                    steps=4, wait=False)
        ns = "0/sync_seed7_skip_harness_demo/GBS8_N2_in6_out6"
        try:
            seen = set()
            while run.poll() is None or not seen:
                doc = json.loads(urllib.request.urlopen(f"{v.url}api/namespaces", timeout=30).read())
                live = [n for n in doc["namespaces"] if n["key"] == ns]
                done = [s["step"] for s in live[0]["steps"] if s["status"] == "complete"] if live else []
                for step in done[-1:]:
                    if step not in seen:
                        page.goto(f"{v.url}ns/{ns}/step/{step}")
                        assert "16 trajectories" in page.locator("#summary").inner_text()
                        seen.add(step)
                if run.poll() is not None and not done:
                    break
                time.sleep(0.5)
            assert run.wait(timeout=600) == 0, run.stderr.read()[-4000:]
        finally:
            if run.poll() is None:
                run.kill()
        assert seen
        page.goto(f"{v.url}ns/{ns}")
        assert page.locator("#steps tbody tr").count() == 4


@pytest.fixture
def s3(request):
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from s3server import start_server
    server = start_server(Path(request.getfixturevalue("tmp_path_factory").mktemp("moto")))
    yield server
    server.stop()


def test_a_cache_on_s3(s3, page, tmp_path, monkeypatch):
    bucket = s3.create_bucket()
    url = f"s3://{bucket}/cache"
    env = {k: None for k in os.environ if k.startswith("AWS_")}
    for k in env:
        monkeypatch.delenv(k)
    for k, value in s3.env("writer").items():
        monkeypatch.setenv(k, value)
    train_in_process(tmp_path, url, "sync", steps=2)
    objects = {o["Key"]: o["ETag"] for o in s3.boto3().list_objects_v2(Bucket=bucket)["Contents"]}
    with viewer(tmp_path, url, env={**env, **s3.env("reader")}) as v:    # read-only credentials
        page.goto(v.url)
        page.get_by_role("link", name=SYNC, exact=True).click()
        page.wait_for_url("**/ns/**")   # the click navigates: count on the new page, not the old one
        assert page.locator("#steps tbody tr").count() == 2
        page.locator("a.step-link", has_text="2").click()
        page.wait_for_url("**/step/2")
        assert "complete · 16 trajectories" in page.locator("#summary").inner_text()
        page.locator("a.traj-link").first.click()
        page.wait_for_url("**/t/**")
        assert 1 <= page.locator("#response-tokens .tok").count() <= 6          # padding dropped
    assert {o["Key"]: o["ETag"] for o in s3.boto3().list_objects_v2(Bucket=bucket)["Contents"]} == objects


def test_long_rollouts_fit_the_screen(page, tmp_path):
    """4,096-token responses (the benchmark's batch shape, 64 trajectories): the step, trajectory and compare
    pages are no wider than a 1,400 px viewport; a folded response expands in place."""
    dump = tmp_path / "cache"
    batch = long_payload(64)
    other = dict(batch, scores=1.0 - batch["scores"])
    write_namespace(dump, "llm_a", {1: batch})
    write_namespace(dump, "llm_b", {1: other})
    a, b = "0/llm_a/GBS6_N2_in4_out5", "0/llm_b/GBS6_N2_in4_out5"
    longest = int(batch["response_length"].argmax())
    page.set_viewport_size({"width": 1400, "height": 900})
    with viewer(tmp_path, str(dump)) as v:
        for url in (f"ns/{a}/step/1", f"ns/{a}/step/1/t/0.0.{longest}", f"compare?a={a}&b={b}&step=1"):
            page.goto(v.url + url)
            assert page.evaluate("document.documentElement.scrollWidth") <= 1400, url
        page.goto(f"{v.url}ns/{a}/step/1")
        fold = page.locator("tr.sample details.fold").first
        assert not fold.locator(".rest").is_visible()
        fold.locator("summary").click()
        assert fold.locator(".rest").is_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 1400
        response = page.goto(f"{v.url}favicon.ico")
        assert response is not None and response.status == 200


def test_discarded_groups_listed_with_their_reasons(page, tmp_path):
    """Issue 43: what a filter dropped from a step (recorded through the store beside it, as a trainer's
    harness.discard does) is linked from the step page with its count and listed on its own page: every
    group, its reason, its samples' rewards; untrusted ids never run; the page fits 1,400 px."""
    from skip_harness.store.discards import Discarded, DiscardStore

    dump = tmp_path / "cache"
    lay = write_namespace(dump, "dapo", {1: demo_batch(1), 2: demo_batch(2)})
    store = open_store(lay)
    created = store.reader.read_commit(2).created
    tied = "filter_groups: every sample's reward was 0.5 (no spread, no GRPO signal)"
    DiscardStore(store.namespace).write_step(2, [Discarded("u7", tied, (0.5, 0.5)), Discarded(XSS[0], tied, (0.5, 0.5)),
                                               Discarded("u9", "rollout failed")], commit_created=created)
    ns = "0/dapo/GBS6_N2_in4_out5"
    page.set_viewport_size({"width": 1400, "height": 900})
    with viewer(tmp_path, str(dump)) as v:
        page.goto(f"{v.url}ns/{ns}/step/1")
        assert page.locator("#discarded-link").count() == 0          # step 1: nothing dropped
        page.goto(f"{v.url}ns/{ns}/step/2")
        link = page.locator("#discarded-link a")
        assert link.inner_text() == "3 groups discarded"
        link.click()
        page.wait_for_url("**/step/2/discarded")
        rows = page.locator("tr.discarded-group")
        assert [rows.nth(i).get_attribute("data-group") for i in range(rows.count())] == ["u7", XSS[0], "u9"]
        assert "0.5, 0.5 tied" in rows.nth(0).inner_text() and "not reported" in rows.nth(2).inner_text()
        assert page.locator("#reasons tr").count() == 3                # a header and the two reasons
        assert page.evaluate("window.__xss") is None and page.dialogs == []


def test_a_compare_pairs_first_difference_is_marked_in_view_on_both_sides(page, tmp_path):
    """Issue 43 item 3: each differing pair's first differing token is marked on both sides, and one past the
    fold (token 150 of 200) is shown in its cell, inside a 1,400 px viewport."""
    dump = tmp_path / "cache"
    a = demo_batch(1, length=200)
    a["response_mask"][:] = 1
    b = {k: v.clone() for k, v in a.items()}
    b["responses"][1, 150] = (a["responses"][1, 150] + 1) % 13
    write_namespace(dump, "run_a", {1: a})
    write_namespace(dump, "run_b", {1: b})
    page.set_viewport_size({"width": 1400, "height": 900})
    with viewer(tmp_path, str(dump)) as v:
        page.goto(f"{v.url}compare?a=0/run_a/GBS6_N2_in4_out5&b=0/run_b/GBS6_N2_in4_out5&step=1&only=differ")
        marks = page.locator("mark.first-diff")
        assert marks.count() == 2
        assert marks.nth(0).inner_text() == str(int(a["responses"][1, 150]))
        assert marks.nth(1).inner_text() == str(int(b["responses"][1, 150]))
        for k in range(2):
            marks.nth(k).scroll_into_view_if_needed()
            assert marks.nth(k).is_visible()
            box = marks.nth(k).bounding_box()
            assert box is not None and box["x"] + box["width"] <= 1400
        assert page.locator("td.first-diff-at").first.inner_text() == "150"
        assert page.evaluate("document.documentElement.scrollWidth") <= 1400
