"""The whole config is checked before the disk: every bad value, with the Hydra startup callback on,
stops the run with one message naming the key and exit status 2 — and nothing is created or removed:
no run directory, nothing in the cache."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"

pytestmark = pytest.mark.slow

SEP4 = ["trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4"]
BAD = [  # (overrides, the key the message must name)
    (["data.train_batch_size=0"], "data.train_batch_size"),
    (SEP4[:1] + ["data.train_batch_size=6"], "data.train_batch_size"),
    (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n"),
    (["data.max_prompt_length=0"], "data.max_prompt_length"),
    (["data.max_response_length=0"], "data.max_response_length"),
    (["trainer.total_training_steps=0"], "trainer.total_training_steps"),
    (["trainer.torch_threads=0"], "trainer.torch_threads"),
    (["trainer.test_freq=-1"], "trainer.test_freq"),
    (["trainer.v1.trainer_mode=bogus"], "trainer.v1.trainer_mode"),
    (SEP4[:1] + ["trainer.v1.separate_async.parameter_sync_step=0"], "trainer.v1.separate_async.parameter_sync_step"),
    (["skip.rollout_tq.action=bogus"], "skip.rollout_tq.action"),
    (["skip.rollout_tq.cleanup=bogus"], "skip.rollout_tq.cleanup"),
    (["skip.rollout_tq.on_mismatch=bogus"], "skip.rollout_tq.on_mismatch"),
    (["skip.rollout_tq.lock_timeout=-1"], "skip.rollout_tq.lock_timeout"),
    (["skip.rollout_tq.steps=[1,x]"], "skip.rollout_tq.steps"),
    (["skip.rollout_tq.steps=[-2]"], "skip.rollout_tq.steps"),
    (["skip.rollout_tq.max_pending_writes=0"], "skip.rollout_tq.max_pending_writes"),
]


def tree(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_every_bad_value_stops_before_the_disk(tmp_path):
    cache = tmp_path / "cache"
    # A namespace the runs would use, holding an interrupted step that cleanup would remove.
    stale = cache / "sync_seed0_skip_harness_demo" / "GBS512_N8_in8_out10" / "3"
    stale.mkdir(parents=True)
    (stale / "tq_batch.pt").write_bytes(b"half a file")
    before = tree(cache)
    env = {**os.environ, "SKIP_HARNESS_DUMP_DIR": str(cache)}
    env.pop("HYDRA_FULL_ERROR", None)

    def run(case):
        overrides, key = case
        out = tmp_path / f"run{BAD.index(case)}"
        proc = subprocess.run([sys.executable, str(TRAIN), f"hydra.run.dir={out}", "trainer.progress=false", *overrides],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        return case, proc

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, BAD))
    for (overrides, key), proc in results:
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0, (overrides, text)
        assert key in text, (overrides, text)
        assert "Traceback" not in text, (overrides, text)
        assert tree(cache) == before, (overrides, tree(cache))
        assert proc.returncode == 2, (overrides, text)
        assert not (tmp_path / f"run{BAD.index((overrides, key))}").exists(), (overrides, "a run directory was made")


@pytest.mark.parametrize(
    "override, says",
    [
        # Hydra's advice for an unknown key is `+key=value`; following it must not run with the key ignored
        ("+skip.rollout_tq.actoin=cache", "skip.rollout_tq.actoin: unknown key"),
        ("skip.rollout_tq.actoin=cache", "skip.rollout_tq.actoin"),  # Hydra's own refusal (it exits 1)
        ("+trainer.total_trainig_steps=3", "did you mean `total_training_steps`?"),
    ],
)
def test_an_unknown_key_stops_with_exit_2_and_creates_nothing(tmp_path, override, says):
    env = {**os.environ, "SKIP_HARNESS_DUMP_DIR": str(tmp_path / "cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(TRAIN), "trainer.progress=false", "data.train_batch_size=8", override],
                          cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert says in text and "Traceback" not in text, text
    if override.startswith("+skip"):
        assert "did you mean `action`?" in text, text
    assert list(work.iterdir()) == [], "the run left files (an outputs/ folder?)"
    assert not (tmp_path / "cache").exists()
