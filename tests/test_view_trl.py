"""A real TRL GRPOTrainer's cache in the viewer (scripts/trl_demo.py's record run: a tiny Llama, a character
tokenizer, the real trainer): each generation stores its prompt ids, so the step page shows prompt,
completion and the step's recorded reward; the record's generations still replay exactly (test_trl.py)."""
from __future__ import annotations

import json
import os
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
from skip_harness.store.stepstore import StepStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_a_trl_step_page_shows_prompt_completion_and_reward(tmp_path):
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
