"""skip-harness view, in process (Starlette's test client; the browser tests are test_view_browser.py):
the JSON API has `ls --json`'s shapes, a step's trajectories are grouped and valued as GRPO does for the
demo's, TRL's and verl's field names, a damaged step is shown by its reason only, every field is
escaped, and nothing in the cache is written or locked."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from starlette.testclient import TestClient  # noqa: E402

from conftest import HolderProcess  # noqa: E402
from skip_harness.store.open import open_namespace, open_store
from skip_harness.cli import main  # noqa: E402
from skip_harness.cli.view.app import build_app  # noqa: E402
from skip_harness.cli.view.data import Cache  # noqa: E402
from skip_harness.cli.view.decode import Decoder  # noqa: E402
from skip_harness.store import index as _index  # noqa: E402
from skip_harness.store import scan as _scan  # noqa: E402
from view_rig import XSS, demo_batch, snapshot, subprocess_env, trl_payload, verl_payload, write_namespace  # noqa: E402


def client(*roots, decoder=None) -> TestClient:
    return TestClient(build_app(Cache(list(roots)), decoder or Decoder(), ["testserver"]), raise_server_exceptions=True)


def key(layout, root_index: int = 0) -> str:
    return f"{root_index}/{layout.root.parent.name}/{layout.root.name}"


@pytest.fixture
def demo(tmp_path):
    dump = tmp_path / "cache"
    a = write_namespace(dump, "demo_a", {s: demo_batch(s) for s in (1, 2, 3)})
    b = write_namespace(dump, "demo_b", {s: demo_batch(s + (s == 2)) for s in (1, 2, 3)})
    return dump, a, b


def test_the_api_has_ls_json_shapes(demo, capsys):
    dump, a, b = demo
    assert main(["ls", str(dump), "--json"]) == 0
    ls = json.loads(capsys.readouterr().out)
    api = client(dump).get("/api/namespaces").json()
    assert api["dump_dir"] == ls["dump_dir"] and api["total_bytes"] == ls["total_bytes"]
    assert [n["path"] for n in api["namespaces"]] == [n["path"] for n in ls["namespaces"]]
    for got, want in zip(api["namespaces"], ls["namespaces"]):
        for k in ("K", "W", "counts", "total_bytes", "written", "gen_s", "mode", "seed"):
            assert got[k] == want[k], k
        assert [{k: s[k] for k in ("step", "status", "bytes", "reason", "fingerprint", "written", "gen_s")}
                for s in got["steps"]] == \
               [{k: s[k] for k in ("step", "status", "bytes", "reason", "fingerprint", "written", "gen_s")}
                for s in want["steps"]]
    one = client(dump).get(f"/api/ns/{key(a)}").json()
    assert one["path"] == str(a.root) and [s["step"] for s in one["steps"]] == [1, 2, 3]
    assert main(["show", str(a.root), "2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    step = client(dump).get(f"/api/ns/{key(a)}/step/2").json()
    assert step["mini_batches"][0]["structure"] == shown["structure"]
    assert step["mini_batches"][0]["meta"] == shown["meta"]


def test_a_step_is_grouped_by_uid_with_grpo_advantages(demo):
    dump, a, _ = demo
    batch = demo_batch(2)
    doc = client(dump).get(f"/api/ns/{key(a)}/step/2").json()
    rows = doc["trajectories"]
    assert [r["group"] for r in rows] == [str(u) for u in batch["uid"].tolist()]
    assert [r["length"] for r in rows] == batch["response_mask"].sum(1).tolist()
    assert [r["reward"] for r in rows] == pytest.approx(batch["rewards"].double().tolist())
    assert doc["advantage_computed"] is True
    for g in set(r["group"] for r in rows):
        rewards = torch.tensor([r["reward"] for r in rows if r["group"] == g], dtype=torch.float64)
        want = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        assert [r["advantage"] for r in rows if r["group"] == g] == pytest.approx(want.tolist())
    t = client(dump).get(f"/api/ns/{key(a)}/step/2/t/0.0.3").json()
    real = int(batch["response_mask"][3].sum())             # the demo's mask: real tokens, then padding
    assert t["response_tokens"] == [str(x) for x in batch["responses"][3][:real].tolist()]
    assert t["per_token"]["old_logprobs"] == pytest.approx(batch["old_logprobs"][3][:real].double().tolist())
    assert t["per_token"]["response_mask"] == batch["response_mask"][3][:real].double().tolist()
    html = client(dump).get(f"/ns/{key(a)}/step/2?sort=reward&order=desc").text
    best = max(range(6), key=lambda j: batch["rewards"][j].item())
    assert html.index(f'data-ref="0.0.{best}"') < min(html.index(f'data-ref="0.0.{j}"') for j in range(6) if j != best)
    page = client(dump).get(f"/ns/{key(a)}/step/2?min_reward=2").text
    assert "0 of 6 trajectories shown" in page
    nav = client(dump).get(f"/ns/{key(a)}/step/2").text
    assert f'href="/ns/{key(a)}/step/1"' in nav and f'href="/ns/{key(a)}/step/3"' in nav


def test_trl_and_verl_field_names(tmp_path):
    pytest.importorskip("tensordict")
    dump = tmp_path / "cache"
    trl = write_namespace(dump, "trl_run", {1: trl_payload(1)}, fingerprint={"trl.num_generations": 3})
    verl = write_namespace(dump, "verl_run", {1: verl_payload(1)})
    c = client(dump)
    doc = c.get(f"/api/ns/{key(trl)}/step/1").json()
    assert [r["length"] for r in doc["trajectories"]] == [3, 2, 4]
    assert len({r["group"] for r in doc["trajectories"]}) == 1          # num_generations=3: one prompt
    t = c.get(f"/api/ns/{key(trl)}/step/1/t/0.0.2").json()
    assert t["response_tokens"] == ["10", "11", "12", "13"]
    assert t["per_token"]["logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    doc = c.get(f"/api/ns/{key(verl)}/step/1").json()
    rows = doc["trajectories"]
    assert [r["group"] for r in rows] == ["uA", "uA", "uB", "uB"]
    assert [r["length"] for r in rows] == [2, 3, 1, 4]
    assert [r["reward"] for r in rows] == pytest.approx([0.25, 0.5, 0.75, 1.0])   # rm_scores summed
    t = c.get(f"/api/ns/{key(verl)}/step/1/t/0.0.3").json()
    assert t["prompt_tokens"] == ["4", "5"] and t["response_tokens"] == ["20", "21", "22", "23"]
    assert set(t["per_token"]) >= {"tensordict.rollout_log_probs", "tensordict.response_mask"}
    assert c.get(f"/ns/{key(verl)}/step/1").status_code == 200
    assert c.get(f"/ns/{key(trl)}/step/1/t/0.0.0").status_code == 200


def test_a_damaged_step_shows_its_reason_never_its_bytes(tmp_path):
    dump = tmp_path / "cache"
    secret = "PAYLOAD-TEXT-NEVER-SHOWN"
    lay = write_namespace(dump, "bad", {1: demo_batch(1, texts=[secret] * 6), 2: demo_batch(2, texts=[secret] * 6)})
    write_namespace(dump, "bad", {3: demo_batch(3, texts=[secret] * 6)}, commit=False)
    payload = lay.step_dir(2) / "tq_batch.pt"
    data = bytearray(payload.read_bytes())
    data[-3] ^= 0xFF
    payload.write_bytes(bytes(data))
    c = client(dump)
    assert secret in c.get(f"/ns/{key(lay)}/step/1").text
    for step, status, why in ((2, "corrupt", "checksum"), (3, "incomplete", "")):
        page = c.get(f"/ns/{key(lay)}/step/{step}").text
        assert f"<b>{status}</b>" in page and why in page and secret not in page
        doc = c.get(f"/api/ns/{key(lay)}/step/{step}").json()
        assert doc["status"] == status and doc["reason"] and "trajectories" not in doc
        assert c.get(f"/api/ns/{key(lay)}/step/{step}/t/0.0.0").status_code == 404
    assert c.get(f"/ns/{key(lay)}/step/9").status_code == 404


def test_every_field_is_escaped(tmp_path):
    dump = tmp_path / "cache"
    texts = [XSS[j % 2] for j in range(6)]
    batch = demo_batch(1, texts=texts)
    batch["uid"] = [XSS[1]] * 3 + ["u2"] * 3
    batch[XSS[0]] = torch.zeros(6)
    lay = write_namespace(dump, "x", {1: batch})
    c = client(dump)
    for url in (f"/ns/{key(lay)}/step/1", f"/ns/{key(lay)}/step/1/t/0.0.0", f"/ns/{key(lay)}/step/1/t/0.0.1",
                f"/ns/{key(lay)}/step/1?q={XSS[1]}"):
        page = c.get(url).text
        for bad in XSS:
            assert bad not in page
        assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in page or "&#34;&gt;&lt;img" in page
        assert "<script" not in page and "onerror=" not in page.replace("onerror=&#34;", "")
    assert c.get(f"/ns/{key(lay)}/step/1").headers["content-security-policy"].startswith("default-src 'none'")


def test_nothing_is_written_or_locked_beside_a_running_job(tmp_path):
    dump = tmp_path / "cache"
    lay = write_namespace(dump, "busy", {s: demo_batch(s) for s in (1, 2)})
    write_namespace(dump, "busy", {3: demo_batch(3)}, commit=False)
    _index.remove(open_namespace(lay))      # a missing index: a scan that may write would rebuild it
    holder = HolderProcess(lay)             # a training run holds the namespace
    try:
        before = snapshot(dump)
        c = client(dump)
        for url in ("/", "/api/namespaces", f"/ns/{key(lay)}", f"/ns/{key(lay)}/charts", f"/ns/{key(lay)}/step/1",
                    f"/ns/{key(lay)}/step/3", f"/api/ns/{key(lay)}/step/2", f"/ns/{key(lay)}/step/2/t/0.0.0",
                    f"/compare?a={key(lay)}&b={key(lay)}&step=1"):
            assert c.get(url).status_code == 200, url
        assert snapshot(dump) == before
        assert not (lay.root / _index.INDEX_NAME).exists()
    finally:
        holder.kill()


def test_a_scan_that_may_not_write_leaves_a_stale_index_alone(tmp_path):
    lay = write_namespace(tmp_path / "cache", "ns", {s: demo_batch(s) for s in (1, 2, 3)})
    _scan.scan_namespace(lay, open_namespace(lay))
    index = (lay.root / _index.INDEX_NAME).read_bytes()
    write_namespace(tmp_path / "cache", "ns", {4: demo_batch(4)})
    ns = open_namespace(lay)
    _index.rewrite(lay, ns, [e for s, e in _index.read(lay, ns).items() if s != 2])   # stale: step 2 and 4 unindexed
    stale = (lay.root / _index.INDEX_NAME).read_bytes()
    report = _scan.scan_namespace(lay, open_namespace(lay), rewrite_index=False)
    assert [s.step for s in report.steps if s.status == "complete"] == [1, 2, 3, 4]
    assert "stale" in report.index_note and "rebuilt" not in report.index_note
    assert (lay.root / _index.INDEX_NAME).read_bytes() == stale != index
    _scan.scan_namespace(lay, open_namespace(lay))                                     # a run's scan still rebuilds it
    assert (lay.root / _index.INDEX_NAME).read_bytes() != stale


def test_charts_link_every_point_to_its_step(demo):
    dump, a, _ = demo
    svg = client(dump).get(f"/ns/{key(a)}/charts").text
    for s in (1, 2, 3):
        assert f'href="/ns/{key(a)}/step/{s}" target="_top"' in svg
    means = [demo_batch(s)["rewards"].double().mean().item() for s in (1, 2, 3)]
    assert all(math.isfinite(m) for m in means)
    assert 'id="chart-reward"' in svg and 'id="chart-length"' in svg


def test_compare_shows_which_trajectories_differ(demo):
    dump, a, b = demo
    c = client(dump)
    doc = c.get(f"/api/compare?a={key(a)}&b={key(b)}&step=1").json()
    assert all(r["same"] for r in doc["trajectories"]) and len(doc["trajectories"]) == 6
    doc = c.get(f"/api/compare?a={key(a)}&b={key(b)}&step=2").json()
    assert not any(r["same"] for r in doc["trajectories"])
    # B's step 2 is another step's batch: other prompts, so no trajectory pairs (never paired by position)
    assert "0 pairs identical, 0 differ, 6 only in A, 6 only in B" in c.get(f"/compare?a={key(a)}&b={key(b)}&step=2").text


def test_a_tokenizer_decodes_the_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {c: i for i, c in enumerate("0123456789abcdefghijklmnopqrstuvwxyz")}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="a"))
    tok.decoder = tokenizers.decoders.Fuse()
    tok.save(str(tmp_path / "tokenizer.json"))
    dump = tmp_path / "cache"
    lay = write_namespace(dump, "tok", {1: demo_batch(1)})
    batch = demo_batch(1)
    t = client(dump, decoder=Decoder(str(tmp_path / "tokenizer.json"))).get(f"/api/ns/{key(lay)}/step/1/t/0.0.0").json()
    real = int(batch["response_mask"][0].sum())
    assert t["response_text"] == "".join("0123456789abc"[i] for i in batch["responses"][0][:real].tolist())


@pytest.mark.slow
def test_a_missing_tokenizer_stops_the_viewer_in_one_line(tmp_path):
    dump = tmp_path / "cache"
    write_namespace(dump, "tok", {1: demo_batch(1)})
    proc = subprocess.run([sys.executable, "-m", "skip_harness.cli", "view", str(dump), "--tokenizer",
                           str(tmp_path / "no-such-tokenizer")], capture_output=True, text=True,
                          env=subprocess_env({"HF_HUB_OFFLINE": "1"}), timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tokenizer" in lines[0] and "never downloads" in lines[0], proc.stderr


def test_recorded_values_are_charted_and_compare_shows_the_diff(demo):
    pytest.importorskip("skip_harness.cli.diff")
    from skip_harness.store.stepstore import StepStore
    from skip_harness.store.values import ValuesStore

    dump, a, b = demo
    for lay, lr in ((a, 0.1), (b, 0.2)):
        store = open_store(lay)
        for s in (1, 2, 3):
            created = store.reader.read_commit(s).created
            ValuesStore(store.namespace).write_step(s, {"loss": lr * s, "reward_mean": 0.5 + s}, commit_created=created)
    c = client(dump)
    svg = c.get(f"/ns/{key(a)}/charts").text
    assert "recorded: loss" in svg and "recorded: reward_mean" in svg
    assert "step 3: 0.3<" in svg and 'id="chart-value-1"' in svg
    page = c.get(f"/compare?a={key(a)}&b={key(b)}&step=2").text
    assert 'id="diff-verdict"' in page
    assert "recorded values first diverge at step 1: loss 0.1 vs 0.2" in page
    doc = c.get(f"/api/compare?a={key(a)}&b={key(b)}&step=2").json()
    from skip_harness.cli.diff import compare
    assert doc["diff"] == json.loads(json.dumps(compare(str(a.root), str(b.root), read_payloads=False)))


def test_a_step_is_read_once_for_its_pages_while_its_commit_record_stays(demo):
    """The step page's links to its trajectories (and paging, next / previous) read the step once: its read
    and trajectories are kept while its commit record (time, size, status) is the same; one step is kept,
    so reading another gives the first one's buffers back."""
    import dataclasses

    dump, a, _ = demo
    cache = Cache([dump])
    ns = cache.namespace(key(a))
    report = cache.scan(ns)
    s1, s2 = report.get(1), report.get(2)
    read, table = cache.table(ns, s1)
    assert read.ok and table is not None and len(table.trajectories) == 6
    assert cache.table(ns, s1)[1] is table                       # kept: not read again
    c = TestClient(build_app(cache, Decoder(), ["testserver"]))
    assert c.get(f"/ns/{key(a)}/step/1/t/0.0.2").status_code == 200
    assert cache.table(ns, s1)[1] is table                       # the trajectory page used the kept read
    assert cache.table(ns, dataclasses.replace(s1, created=(s1.created or 0) + 1))[1] is not table   # rewritten
    again = cache.table(ns, s1)[1]
    cache.table(ns, s2)
    assert cache.table(ns, s1)[1] is not again                   # one step kept: another read replaced it


def test_compare_marks_each_pairs_first_differing_token_on_both_sides(tmp_path):
    """The compare JSON's `first_difference` per pair (a token index, or null), and the page marks that token
    on both sides -- in view when it lies past the fold (the tokens before it folded)."""
    dump = tmp_path / "cache"
    a = demo_batch(1, length=100)
    a["response_mask"][:] = 1
    b = {k: v.clone() for k, v in a.items()}
    b["responses"][1, 3] = (a["responses"][1, 3] + 1) % 13          # pair 1: differs at token 3
    b["responses"][2, 90] = (a["responses"][2, 90] + 1) % 13        # pair 2: at token 90, past the fold
    b["response_mask"][4, 50:] = 0                                  # pair 4: B's response ends at 50
    la, lb = write_namespace(dump, "run_a", {1: a}), write_namespace(dump, "run_b", {1: b})
    c = client(dump)
    doc = c.get(f"/api/compare?a={key(la)}&b={key(lb)}&step=1").json()
    assert [r["first_difference"] for r in doc["trajectories"]] == [None, 3, 90, None, 50, None]
    page = c.get(f"/compare?a={key(la)}&b={key(lb)}&step=1").text
    marks = page.split('<mark class="first-diff"')
    assert len(marks) == 1 + 2 * 3                                  # both sides of the three differing pairs
    tok = lambda x, j, i: str(int(x["responses"][j, i]))            # noqa: E731 - the demo's tokens are ids here
    got = [m.split(">", 1)[1].split("</mark>", 1)[0] for m in marks[1:]]
    assert got == [tok(a, 1, 3), tok(b, 1, 3), tok(a, 2, 90), tok(b, 2, 90), tok(a, 4, 50), "⟨ends⟩"]
    assert "… 82 tokens …" in page                                 # token 90 shown from 8 tokens before it
