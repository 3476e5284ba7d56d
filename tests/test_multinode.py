"""Past one machine: two torchrun agents (`--nnodes 2 --nproc_per_node 1`, c10d rendezvous on this host)
stand for two nodes. When their caches are not one shared directory the run stops at startup naming
skip.rollout_tq.dump_dir; when they share one, steps commit and a rerun hits."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import List

import pytest

from conftest import subprocess_env

from test_train_e2e import TINY as _TINY, TRAIN

TINY = [o for o in _TINY if not o.startswith("trainer.total_training_steps=")] + ["trainer.total_training_steps=2"]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(tmp_path: Path, dump_dirs: List[Path], run: str, timeout: float = 400, envs=None):
    """Start two agents (node A hosts the rendezvous store), wait for both; [(returncode, output)].
    `envs`: per node, variables to set in that node's environment (e.g. another endpoint)."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    procs = []
    for i, dump in enumerate(dump_dirs):
        env = subprocess_env()
        env.update((envs or [{}, {}])[i])
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "HYDRA_FULL_ERROR"):
            env.pop(name, None)
        env["SKIP_HARNESS_DUMP_DIR"] = str(dump)
        env["OMP_NUM_THREADS"] = "1"
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
            "--rdzv_conf", f"is_host={'true' if i == 0 else 'false'},join_timeout=120",
            "--max_restarts", "0",
            str(TRAIN), f"hydra.run.dir={tmp_path / run / f'node{i}'}", *TINY,
        ]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def metrics(tmp_path: Path, run: str) -> list:
    [path] = list((tmp_path / run).glob("node*/metrics.jsonl"))   # rank 0's node writes it
    return [json.loads(line) for line in path.read_text().splitlines()]


def committed_steps(dump: Path) -> list:
    return sorted(int(p.parent.name) for p in dump.glob("*/*/*/commit.json"))


def test_nodes_with_separate_cache_dirs_stop_at_startup(tmp_path):
    a, b = tmp_path / "node-a-cache", tmp_path / "node-b-cache"
    results = two_nodes(tmp_path, [a, b], "separate")
    output = "\n".join(out for _, out in results)
    assert all(code != 0 for code, _ in results), output[-5000:]
    assert "skip.rollout_tq.dump_dir" in output, output[-5000:]
    assert "cannot see the rollout cache" in output, output[-5000:]
    # and told of the other way to share one: an object store (also what test_objstore_scenarios.py relied on)
    assert "skip.rollout_tq.dump_dir=s3://bucket/prefix" in output, output[-5000:]
    assert committed_steps(a) == [] and committed_steps(b) == []          # stopped before any work
    assert not list(tmp_path.glob("separate/node*/metrics.jsonl")) or all(
        not p.read_text().strip() for p in tmp_path.glob("separate/node*/metrics.jsonl"))
    # the marker the check used is gone, and no holder record outlives the run
    assert not list(a.rglob(".run-marker-*")) and not list(b.rglob(".run-marker-*"))
    assert not list(a.rglob(".lock.holder.json")) and not list(b.rglob(".lock.holder.json"))


def test_nodes_sharing_one_cache_dir_commit_and_rerun_hits(tmp_path):
    shared = tmp_path / "shared-cache"
    for code, out in two_nodes(tmp_path, [shared, shared], "first"):
        assert code == 0, out[-5000:]
    first = metrics(tmp_path, "first")
    assert [r["cache"] for r in first] == ["miss", "miss"]
    assert committed_steps(shared) == [1, 2]
    [ns] = shared.glob("*/GBS*")
    assert ns.name.endswith("_W2")
    assert sorted(p.name for p in (ns / "1").iterdir() if not p.name.startswith(".")) == [
        "commit.json", "meta_rank0.json", "meta_rank1.json", "tq_batch_rank0.pt", "tq_batch_rank1.pt"]
    for code, out in two_nodes(tmp_path, [shared, shared], "again"):
        assert code == 0, out[-5000:]
    again = metrics(tmp_path, "again")
    assert [r["cache"] for r in again] == ["hit", "hit"]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s") and k != "cache"} for r in rows]
    assert strip(first) == strip(again)
    assert not list(shared.rglob(".run-marker-*"))
