"""A real TRL GRPOTrainer's cache in the viewer (scripts/trl_demo.py's record run: a tiny Llama, a character
tokenizer, the real trainer): each generation stores its prompt ids and the second tier its rewards per
reward function, so the step page shows prompt, completion, reward and advantage per trajectory (the
tier's values), the trajectory page too, and the step's recorded reward; the record's generations still
replay exactly (test_trl.py)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from skip_harness.store.open import open_store
from skip_harness.cli.view.app import build_app  # noqa: E402
from skip_harness.cli.view.data import Cache  # noqa: E402
from skip_harness.cli.view.decode import Decoder  # noqa: E402
from skip_harness.store.layout import Layout  # noqa: E402
from skip_harness.store.open import open_namespace  # noqa: E402
from skip_harness.store.tier import read_step_tier  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_a_trl_step_page_shows_prompt_completion_reward_and_advantage(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "trl_demo.py"), "--role", "record", "--workdir",
                           str(tmp_path), "--dump-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out"),
                           "--result", str(tmp_path / "r.json"), "--steps", "2", "--eval-steps", "0"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [leaf] = [p for p in (tmp_path / "cache").glob("*/*") if p.is_dir()]
    layout = Layout(leaf, K=1, W=1)
    [payload] = open_store(layout).reader.read_step(0, 0)
    assert payload["prompt_ids"].numel() == int(payload["prompt_lengths"].sum()) > 0
    c = TestClient(build_app(Cache([tmp_path / "cache"]), Decoder(str(tmp_path / "model")), ["testserver"]))
    key = f"0/{leaf.parent.name}/{leaf.name}"
    t = c.get(f"/api/ns/{key}/step/0/t/0.0.0").json()
    assert t["prompt_text"] and t["prompt_text"].endswith("=") and t["response_text"] is not None
    page = c.get(f"/ns/{key}/step/0").text
    assert "no prompt stored" not in page and 'id="recorded"' in page
    recorded = json.loads(json.dumps(c.get(f"/api/ns/{key}").json()))
    assert recorded["steps"][0]["status"] == "complete"
    assert '<span class="mono key">reward</span>' in page     # TRL's logged reward, recorded with the step

    # the second tier's rewards (digit_reward, one column) per trajectory, and GRPO's advantage from them
    commit = json.loads((leaf / "0" / "commit.json").read_text())
    tier = read_step_tier(open_namespace(layout), 0, commit_created=commit["created"])
    stored = tier["reward"][(0, 0)].values.double().reshape(-1)
    doc = c.get(f"/api/ns/{key}/step/0").json()
    assert doc["reward_functions"] == ["digit_reward"] and doc["advantage_computed"] is True
    rows = doc["trajectories"]
    assert [t["reward"] for t in rows] == pytest.approx(stored.tolist()) and len(rows) == stored.numel() > 0
    assert all(t["rewards_by"] == {"digit_reward": pytest.approx(t["reward"])} for t in rows)
    n = 4                                          # trl_demo's num_generations: the groups TRL normalises in
    for g in range(0, len(rows), n):
        r = stored[g:g + n]
        want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
        assert [t["advantage"] for t in rows[g:g + n]] == pytest.approx(want, abs=1e-6)   # 0 within rounding: 0
    assert "no reward stored" not in page and 'id="reward-source"' in page
    cells = re.findall(r'<td class="num reward">([^<]*)</td><td class="num advantage" style="color:([^"]*)">([^<]*)</td>',
                       page)
    assert len(cells) == len(rows)
    for (reward, colour, adv), t in zip(cells, rows):
        assert float(reward) == pytest.approx(t["reward"], rel=1e-3, abs=1e-4)
        assert float(adv) == pytest.approx(t["advantage"], rel=1e-3, abs=1e-4)
        assert colour == ("#1a7f37" if t["advantage"] > 0 else "#b00020" if t["advantage"] < 0 else "inherit")
    assert '<p class="facts">rewards <svg' in page          # the reward histogram, from the tier's rewards
    best = max(rows, key=lambda t: t["reward"])
    tpage = c.get(f"/ns/{key}/step/0/t/{best['ref']}").text
    shown = re.search(r'<b id="reward">([^<]*)</b>.*?<b id="advantage"[^>]*>([^<]*)</b>', tpage, re.S)
    assert shown and float(shown.group(1)) == pytest.approx(best["reward"], rel=1e-3, abs=1e-4)
    assert float(shown.group(2)) == pytest.approx(best["advantage"], rel=1e-3, abs=1e-4)
    assert 'id="rewards-by"' in tpage and "digit_reward" in tpage
    assert math.isfinite(c.get(f"/api/ns/{key}/step/0/t/{best['ref']}").json()["rewards_by"]["digit_reward"])
