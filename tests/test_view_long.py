"""skip-harness view on LLM-length rollouts and the TRL route (issue 31), in process: padding dropped and
never counted, long responses folded with their real count, a legend, masked tokens neutral, any
per-token field, the demo's digits decoded, every recorded value reachable, compare by identity, TRL
prompts, and the small ones (histogram, recorded values, previous / next trajectory, bad URLs answered)."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from starlette.testclient import TestClient  # noqa: E402

from skip_harness.store.open import open_store
from skip_harness.cli.view.app import build_app  # noqa: E402
from skip_harness.cli.view.data import Cache  # noqa: E402
from skip_harness.cli.view.decode import DEMO_VOCAB, Decoder  # noqa: E402
from skip_harness.cli.view.values import default_order  # noqa: E402
from skip_harness.store.stepstore import StepStore  # noqa: E402
from skip_harness.store.values import ValuesStore  # noqa: E402
from view_rig import demo_batch, long_payload, write_namespace  # noqa: E402

P, R = 256, 1024


def client(*roots, decoder=None) -> TestClient:
    return TestClient(build_app(Cache(list(roots)), decoder or Decoder(), ["testserver"]))


def key(layout, root_index: int = 0) -> str:
    return f"{root_index}/{layout.root.parent.name}/{layout.root.name}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    dump = tmp_path_factory.mktemp("llm") / "cache"
    batch = long_payload(16, prompt_len=P, response_len=R)
    lay = write_namespace(dump, "llm_run", {1: batch, 2: long_payload(16, prompt_len=P, response_len=R, seed=1)})
    return dump, lay, batch


def record(layout, values):
    store = open_store(layout)
    for s, v in values.items():
        ValuesStore(store.namespace).write_step(s, v, commit_created=store.reader.read_commit(s).created)


# -------------------------------------------------------------------------------------- item 1


def test_padding_is_dropped_and_never_counted(llm):
    dump, lay, batch = llm
    c = client(dump)
    real = int(batch["response_length"][0])
    prompt_real = int(batch["attention_mask"][0, :P].sum())
    t = c.get(f"/api/ns/{key(lay)}/step/1/t/0.0.0").json()
    full = batch["input_ids"][0]
    assert t["response_tokens"] == [str(x) for x in full[P:P + real].tolist()]        # right padding dropped
    assert t["prompt_tokens"] == [str(x) for x in full[P - prompt_real:P].tolist()]   # left padding dropped
    assert len(t["per_token"]["old_log_probs"]) == real
    page = c.get(f"/ns/{key(lay)}/step/1").text
    assert f"… {real - 64} more tokens ({real} in all, padding dropped)" in page
    assert f"more prompt tokens ({prompt_real} in all, {P - prompt_real} padding dropped)" in page
    assert 'class="tok masked"' not in page               # the bench's mask is its padding: none of it shown
    traj = c.get(f"/ns/{key(lay)}/step/1/t/0.0.0").text
    assert f"{real} tokens ({R - real} padding dropped)" in traj


def test_a_long_response_is_folded_and_expands_in_place(llm):
    dump, lay, batch = llm
    real = int(batch["response_length"][0])
    page = client(dump).get(f"/ns/{key(lay)}/step/1").text
    first = page.index('data-ref="0.0.0"')
    row = page[first: page.index("</tr>", first)]
    assert row.count('class="tok"') + row.count('class="tok masked"') == 64
    rest = re.search(r'<details class="fold"><summary>… (\d+) more tokens.*?<div class="rest">(.*?)</div>', row, re.S)
    assert rest and int(rest.group(1)) == real - 64
    assert rest.group(2).split() == [str(x) for x in batch["input_ids"][0, P + 64:P + real].tolist()]


def test_folded_ids_are_written_as_the_list_would_be():
    """The folded tokens of a page's rows, made in one pass, are each row's ids as its list writes them."""
    from skip_harness.cli.view.decode import ids_texts

    edges = torch.tensor([0, 9, 10, 99, 100, 9999, 10_000, 99_999, 10 ** 7 - 1, 10 ** 7, 10 ** 8 - 1, 151_935])
    rows = [edges, torch.tensor([], dtype=torch.int64), torch.randint(0, 151_936, (3000,)), edges[:1].to(torch.int32)]
    for batch in (rows, rows + [torch.tensor([10 ** 8, -100])]):     # beyond 8 digits or negative: the list's repr
        assert ids_texts(batch) == [str(r.tolist())[1:-1].replace(",", "") for r in batch]


def test_tokens_wrap_between_tokens():
    from skip_harness.cli.view.style import CSS, tokens_html

    html = str(tokens_html(["1", "2", "3"]))
    assert "</span> <span" in html                       # a break opportunity between tokens, never inside one
    assert ".tokens{display:block" in CSS and "white-space:pre;" not in CSS


def test_the_demo_decodes_its_own_digits(tmp_path):
    from skip_harness.demo import task

    assert DEMO_VOCAB[task.BOS] == "⟨bos⟩" and DEMO_VOCAB[task.SEP] == "⟨sep⟩" and DEMO_VOCAB[task.EOS] == "⟨eos⟩"
    assert len(DEMO_VOCAB) == task.VOCAB_SIZE and DEMO_VOCAB[:task.NUM_DIGITS] == tuple("0123456789")
    batch = demo_batch(1)
    batch["prompts"][:, 0], batch["prompts"][:, -1] = task.BOS, task.SEP
    lay = write_namespace(tmp_path / "cache", "sync_seed0_skip_harness_demo", {1: batch})
    t = client(tmp_path / "cache").get(f"/api/ns/{key(lay)}/step/1/t/0.0.0").json()
    ids = batch["prompts"][0].tolist()
    assert t["prompt_text"] == " ".join(DEMO_VOCAB[i] for i in ids) and t["prompt_text"].startswith("⟨bos⟩")
    assert t["prompt_tokens"][-1] == "⟨sep⟩"
    other = write_namespace(tmp_path / "cache", "not_the_demo", {1: batch})
    assert client(tmp_path / "cache").get(f"/api/ns/{key(other)}/step/1/t/0.0.0").json()["prompt_text"] is None


# -------------------------------------------------------------------------------------- item 2


def test_a_legend_masked_tokens_neutral_and_any_per_token_field(tmp_path):
    batch = demo_batch(1, length=6)
    batch["response_mask"][0] = torch.tensor([1, 0, 1, 1, 0, 0])        # a masked token inside the response
    batch["old_logprobs"][0] = torch.tensor([-1.0, 0.0, -3.0, -2.0, 0.0, 0.0])
    batch["rollout_log_probs"] = batch["old_logprobs"] + 0.5
    batch["entropies"] = torch.rand(6, 6)
    lay = write_namespace(tmp_path / "cache", "col", {1: batch})
    c = client(tmp_path / "cache")
    page = c.get(f"/ns/{key(lay)}/step/1/t/0.0.0?color=old_logprobs").text
    tokens = page[page.index('id="response-tokens"'):]
    spans = re.findall(r'<span class="(tok[^"]*)"([^>]*)>', tokens[: tokens.index("</div>")])
    assert len(spans) == 4                                               # trailing padding dropped
    assert spans[1][0] == "tok masked" and "background" not in spans[1][1]   # 0.0 of a masked token: not green
    legend = re.search(r'id="legend">(.*?)</div>', page).group(1)
    assert "old_logprobs" in legend and "-3" in legend and ">-1<" in legend and "masked" in legend
    assert 'hsl(120' in spans[0][1]                       # -1.0: the highest unmasked value is the top of the scale
    for field in ("entropies", "rollout_log_probs − old_logprobs"):
        assert f"<option selected>{field}</option>" in c.get(f"/ns/{key(lay)}/step/1/t/0.0.0",
                                                             params={"color": field}).text
    t = c.get(f"/api/ns/{key(lay)}/step/1/t/0.0.0").json()
    assert t["per_token"]["rollout_log_probs − old_logprobs"] == pytest.approx([0.5] * 4)
    step = c.get(f"/ns/{key(lay)}/step/1?color=entropies").text
    assert 'id="legend"' in step and "<b class=\"mono\">entropies</b>" in step


# -------------------------------------------------------------------------------------- item 3


def test_every_recorded_value_is_listed_and_chartable(tmp_path):
    keys = [f"clip_ratio/k{i}" for i in range(8)] + [f"completions/c{i}" for i in range(8)] + \
        ["loss", "reward", "kl", "grad_norm", "timing/gen_s", "response_length/mean"]
    assert default_order(keys)[:5] == ["loss", "reward", "kl", "grad_norm", "response_length/mean"]
    assert default_order(["frac_reward_zero_std", "reward_std", "reward"])[:2] == ["reward", "reward_std"]
    assert default_order(keys)[-1] == "timing/gen_s"
    a = write_namespace(tmp_path / "cache", "trl_like", {s: demo_batch(s) for s in (1, 2, 3)})
    b = write_namespace(tmp_path / "cache", "other_run", {s: demo_batch(s) for s in (1, 2, 3)})
    record(a, {s: {k: float(s + i) for i, k in enumerate(keys)} for s in (1, 2, 3)})
    record(b, {s: {"loss": 10.0 + s} for s in (1, 2, 3)})
    c = client(tmp_path / "cache")
    ns_page = c.get(f"/ns/{key(a)}").text
    for k in keys:                                        # nothing capped: every key listed
        assert f'value="{k}"' in ns_page
    assert '<legend class="mono">clip_ratio</legend>' in ns_page            # grouped by prefix
    frame = c.get(f"/ns/{key(a)}/charts").text
    for k in ("loss", "reward", "kl", "grad_norm"):
        assert f"recorded: {k}<" in frame
    assert "recorded: timing/gen_s" not in frame                              # timings last
    picked = c.get(f"/ns/{key(a)}/charts", params=[("k", "timing/gen_s"), ("k", "clip_ratio/k7")]).text
    assert "recorded: timing/gen_s" in picked and "recorded: clip_ratio/k7" in picked and "recorded: loss" not in picked
    found = c.get(f"/ns/{key(a)}/charts", params={"q": "completions/"}).text
    assert found.count(">recorded: completions/") == 8
    overlaid = c.get(f"/ns/{key(a)}/charts", params={"with": key(b)}).text
    loss = overlaid[overlaid.index("recorded: loss<"):]
    assert "other_run/GBS6_N2_in4_out5 step 3: 13<" in loss[: loss.index("</svg>")]   # B's line on A's chart
    assert 'class="mark mark-complete"' in frame                              # steps marked on the time axis
    assert c.get(f"/ns/{key(a)}", params={"k": "no_such_key"}).status_code == 400


# -------------------------------------------------------------------------------------- item 4


def test_compare_pairs_by_identity_across_k_and_pages(tmp_path):
    rows = [demo_batch(1, prompts=40, n=2)]                                 # 80 trajectories
    b0 = rows[0]
    half = {k: v[:40] for k, v in b0.items()}
    rest = {k: v[40:] for k, v in b0.items()}
    rest["rewards"] = rest["rewards"].clone()
    rest["rewards"][5] += 1.0                                              # one pair differs (trajectory 45)
    a = write_namespace(tmp_path / "cache", "k1", {1: b0})
    b = write_namespace(tmp_path / "cache", "k2", {1: [half, rest]}, K=2)
    c = client(tmp_path / "cache")
    doc = c.get("/api/compare", params={"a": key(a), "b": key(b), "step": 1}).json()
    assert doc["same"] == 79 and doc["differ"] == 1 and doc["only_in_a"] == 0 and doc["only_in_b"] == 0
    odd = [t for t in doc["trajectories"] if not t["same"]]
    assert [(t["ref_a"], t["ref_b"]) for t in odd] == [("0.0.45", "1.0.5")]   # paired by identity, not position
    page = c.get("/compare", params={"a": key(a), "b": key(b), "step": 1}).text
    assert "K differs: A has K = 1, B has K = 2" in page
    assert "79 pairs identical, 1 differ" in page and "a pair differs when" in page
    assert page.count('<tr class="same">') + page.count('<tr class="differs">') == 50 and "page 1 of 2" in page
    assert "trajectories_differ" not in page.split("<details>")[0]           # one definition of differs on the page
    only = c.get("/compare", params={"a": key(a), "b": key(b), "step": 1, "only": "differ"}).text
    assert only.count('<tr class="differs">') == 1 and '<tr class="same">' not in only
    assert c.get("/compare", params={"a": key(a), "b": key(b), "step": 1, "page": 9}).status_code == 400


def test_compare_reads_a_pair_of_steps_once(tmp_path, monkeypatch):
    a = write_namespace(tmp_path / "cache", "a", {1: demo_batch(1)})
    b = write_namespace(tmp_path / "cache", "b", {1: demo_batch(1)})
    reads = []
    original = Cache.read_step
    monkeypatch.setattr(Cache, "read_step", lambda self, ns, step: reads.append(ns.key) or original(self, ns, step))
    c = client(tmp_path / "cache")
    for page in (1, 1, 1):
        assert c.get("/compare", params={"a": key(a), "b": key(b), "step": 1, "page": page}).status_code == 200
    assert sorted(reads) == sorted([key(a), key(b)])


def test_compare_differs_by_real_tokens_up_to_the_last_unmasked_one(tmp_path):
    """The whole-batch paths (each response's end from its mask, the first differing token, prompt digests)
    against the definition row by row: a response ends at its last unmasked token (masked tokens before it
    are real), padding after it and a fully masked response never differ, a prompt is its attended tokens
    whatever its left padding."""
    g = torch.Generator().manual_seed(5)
    n, P, R = 8, 6, 10
    real_prompt = torch.randint(1, 50, (n, P), generator=g)
    starts = [0, 2, 1, 3, 0, 4, 2, 1]

    def run(pad: int, extra: int, mask: torch.Tensor, responses: torch.Tensor) -> dict:
        prompts = torch.full((n, P + extra), pad)
        att = torch.zeros(n, P + extra + R, dtype=torch.int64)
        for j, s in enumerate(starts):
            prompts[j, extra + s:] = real_prompt[j, s:]
            att[j, extra + s:P + extra] = 1
        att[:, P + extra:] = mask
        return {"prompts": prompts, "responses": responses, "attention_mask": att, "response_mask": mask,
                "rewards": torch.arange(n, dtype=torch.float32)}

    mask = torch.zeros(n, R, dtype=torch.int64)
    mask[0, [0, 1, 3]] = 1                    # a hole: position 2 is a real (masked) token, the end is 4
    mask[2] = 1                               # a full response; response 1 is fully masked: no real token
    for j in range(3, n):
        mask[j, :2 + j] = 1
    responses = torch.randint(0, 50, (n, R), generator=g)
    mask_b, responses_b = mask.clone(), responses.clone()
    responses_b[0, 2] += 1                    # inside the span (a masked token before the end): differs
    responses_b[1] += 1                       # nothing real: the same
    responses_b[3, 9] += 1                    # after the end (5): padding, the same
    responses_b[4, 1] += 1                    # inside: differs
    mask_b[5, 7] = 1                          # B's response 5 ends later: differs
    a = write_namespace(tmp_path / "cache", "a", {1: run(99, 0, mask, responses)})
    b = write_namespace(tmp_path / "cache", "b", {1: run(77, 3, mask_b, responses_b)})
    doc = client(tmp_path / "cache").get("/api/compare", params={"a": key(a), "b": key(b), "step": 1}).json()
    assert doc["paired_by"] == "prompt tokens" and doc["only_in_a"] == 0 and doc["only_in_b"] == 0
    assert sorted(t["ref_a"] for t in doc["trajectories"] if not t["same"]) == ["0.0.0", "0.0.4", "0.0.5"]
    assert all(t["ref_a"] == t["ref_b"] for t in doc["trajectories"])         # each prompt found whatever its padding


# -------------------------------------------------------------------------------------- item 5


def test_trl_generations_store_their_prompts_and_serve_exactly():
    from skip_harness.integrations.trl_payload import Generation, decode_generation, encode_generation

    def generator(prompt_ids, images, multimodal_fields, has_tool_images=False):     # TRL's signature
        return [[p[-1] + 1, 2] for p in prompt_ids], [[-0.5, -0.25] for _ in prompt_ids]

    prompts = [[5, 6, 7], [5, 6, 7], [8, 9]]
    g = Generation(generator)
    payload = g.generate(prompts, None, {})
    assert payload["prompt_ids"].tolist() == [5, 6, 7, 5, 6, 7, 8, 9] and payload["prompt_lengths"].tolist() == [3, 3, 2]
    assert decode_generation(payload) == generator(prompts, None, {})         # served exactly
    assert g(prompt_ids=prompts, images=None, multimodal_fields={}) == generator(prompts, None, {})
    old = encode_generation(generator(prompts, None, {}))                        # a cache from before: no prompts
    assert "prompt_ids" not in old and decode_generation(old) == generator(prompts, None, {})


def test_a_trl_step_shows_prompt_completion_and_recorded_reward(tmp_path):
    from skip_harness.integrations.trl_payload import Generation

    def generator(prompt_ids, images, multimodal_fields, has_tool_images=False):
        return [[p[-1] + 1, 2, 3][: 1 + j % 3] for j, p in enumerate(prompt_ids)], None

    prompts = [[5, 6, 7]] * 2 + [[8, 9]] * 2
    new = Generation(generator).generate(prompts, None, {})
    from skip_harness.integrations.trl_payload import encode_generation
    old = encode_generation(generator(prompts, None, {}))
    lay = write_namespace(tmp_path / "cache", "trl_run", {0: new, 1: old}, fingerprint={"trl.num_generations": 2})
    record(lay, {0: {"loss": 0.1, "reward": 0.75}})
    c = client(tmp_path / "cache")
    t = c.get(f"/api/ns/{key(lay)}/step/0/t/0.0.2").json()
    assert t["prompt_tokens"] == ["8", "9"] and t["response_tokens"] == ["10", "2", "3"]
    page = c.get(f"/ns/{key(lay)}/step/0").text
    assert page.count('<div class="prompt">') == 2 and "no prompt stored" not in page
    assert 'id="recorded"' in page and '<span class="mono key">reward</span> <span class="num">0.75<' in page
    assert "no reward stored with these rollouts" in page
    assert "no prompt stored" in c.get(f"/ns/{key(lay)}/step/1").text           # an older cache still loads


# -------------------------------------------------------------------------------------- item 7


def test_small_ones(llm, tmp_path):
    dump, lay, batch = llm
    c = client(dump)
    page = c.get(f"/ns/{key(lay)}/step/1").text
    assert 'id="reward-hist"' in page
    traj = c.get(f"/ns/{key(lay)}/step/1/t/0.0.1").text
    assert 'id="prev-traj" href="/ns/%s/step/1/t/0.0.0' % key(lay) in traj
    assert 'id="next-traj" href="/ns/%s/step/1/t/0.0.2' % key(lay) in traj
    for url, words in ((f"/ns/{key(lay)}/step/1?min_reward=abc", "min_reward=&#39;abc&#39; is not a number"),
                       (f"/ns/{key(lay)}/step/1?sort=bogus", "sort by one of"),
                       (f"/ns/{key(lay)}/step/1?page=0", "a page is a number"),
                       (f"/ns/{key(lay)}/step/1?color=nope", "colour by one of"),
                       (f"/ns/{key(lay)}/step/x1", "is not a step number"),
                       (f"/ns/{key(lay)}/step/x1/t/0.0.0", "is not a step number")):
        r = c.get(url)
        assert r.status_code == 400 and words in r.text, url
    r = c.get(f"/ns/{key(lay)}/step/99")
    assert r.status_code == 404 and "holds steps 1 .. 2" in r.text
    assert c.get("/favicon.ico").status_code == 200
    overview = c.get("/").text
    cells = re.findall(r'<td class="num status-corrupt( nonzero)?">(\d+)</td>', overview)
    assert cells and all(n == "0" and not flag for flag, n in cells)
    from skip_harness.cli.view.style import CSS
    assert not re.search(r"(?<![\w.-])\.status-(corrupt|incomplete)[{,]", CSS)   # a zero count: never an alarm
