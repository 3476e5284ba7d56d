"""What the viewer tests share: caches shaped like the demo's, TRL's and verl's, written through the
store; a snapshot of a namespace's files (the viewer must leave it as it was); the viewer run as a
real `skip-harness view` process."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from skip_harness.store.open import open_store
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import Layout
from skip_harness.store.stepstore import StepStore

REPO = Path(__file__).resolve().parents[1]
XSS = ['<script>window.__xss = 1</script>', '"><img src=x onerror="window.__xss = 2">']


def demo_batch(step: int, prompts: int = 3, n: int = 2, length: int = 5, texts: Optional[List[str]] = None) -> dict:
    """A mini-batch as the demo's `sample` returns it (token ids, mask, log-probs, rewards, uid)."""
    g = torch.Generator().manual_seed(step)
    rows = prompts * n
    mask = torch.ones(rows, length, dtype=torch.int64)
    for j in range(rows):
        mask[j, 1 + (j + step) % (length - 1):] = 0
    out = {
        "prompts": torch.randint(0, 10, (prompts, 4), generator=g).repeat_interleave(n, dim=0),
        "responses": torch.randint(0, 13, (rows, length), generator=g),
        "response_mask": mask,
        "old_logprobs": -torch.rand(rows, length, generator=g),
        "rewards": torch.rand(rows, generator=g),
        "uid": torch.arange(prompts).repeat_interleave(n) + 100 * step,
    }
    if texts is not None:
        out["response_text"] = texts
    return out


def trl_payload(step: int) -> dict:
    """TRL's generation as skip_harness.integrations.trl stores it: flat ids and log-probs, and lengths."""
    from skip_harness.integrations.trl import encode_generation

    ids = [[5 + step, 6, 7], [8, 9], [10, 11, 12, 13]]
    logprobs = [[-0.1 * (k + 1) for k in range(len(r))] for r in ids]
    return encode_generation((ids, logprobs))


def verl_payload(step: int) -> dict:
    """verl's sampled mini-batch: a TensorDict of jagged tensors, a uid stack, keys and tags."""
    from tensordict import NonTensorStack, TensorDict

    lengths, prompts = [2, 3, 1, 4], [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    uids = ["uA", "uA", "uB", "uB"]
    rm = [torch.zeros(n) for n in lengths]
    for j, r in enumerate(rm):
        r[-1] = 0.25 * (j + 1)
    td = TensorDict({
        "prompts": torch.nested.nested_tensor([torch.tensor(p) for p in prompts], layout=torch.jagged),
        "responses": torch.nested.nested_tensor([torch.arange(n) + 20 for n in lengths], layout=torch.jagged),
        "response_mask": torch.nested.nested_tensor([torch.ones(n, dtype=torch.int64) for n in lengths], layout=torch.jagged),
        "rollout_log_probs": torch.nested.nested_tensor([-torch.rand(n) for n in lengths], layout=torch.jagged),
        "rm_scores": torch.nested.nested_tensor(rm, layout=torch.jagged),
        "uid": NonTensorStack(*uids),
    }, batch_size=[4])
    keys = [f"{u}_{j % 2}_0" for j, u in enumerate(uids)]
    return {"tensordict": td, "keys": keys, "tags": [{"status": "success"} for _ in keys], "global_steps": step}


def write_namespace(dump_dir, name: str, payloads: Dict[int, object], K: int = 1,
                    fingerprint: Optional[dict] = None, commit: bool = True) -> Layout:
    """Steps {step: payload (K = 1) or [payload per inner index]} committed into `{dump_dir}/{name}/GBS..`."""
    leaf = "GBS6_N2_in4_out5" if K == 1 else f"GBS6_N2_in4_out5_K{K}_W1"
    layout = Layout(Path(dump_dir) / name / leaf, K=K, W=1)
    store = open_store(layout)
    fp = Fingerprint.from_values(fingerprint or {"seed": 0, "trainer_mode": "sync"})
    for step, payload in payloads.items():
        batches = payload if isinstance(payload, list) else [payload]
        entries = []
        for i, b in enumerate(batches):
            entries += store.writer.write_inner(step, i, 0, b, {"gen_s": 0.5})
        if commit:
            store.writer.commit(step, entries, fp)
    return layout


def snapshot(root: Path) -> Dict[str, Tuple[int, int]]:
    """Every file and directory under `root`: (size, mtime_ns), links not followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if not p.is_dir() else 0, st.st_mtime_ns)
    return out


def subprocess_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    for k, v in (extra or {}).items():     # None: leave the variable out
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


class Viewer:
    def __init__(self, proc: subprocess.Popen, url: str, err_path: Path):
        self.proc, self.url, self.err_path = proc, url, err_path

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()


@contextmanager
def viewer(tmp_path: Path, *args: str, env: Optional[dict] = None, timeout: float = 90) -> Iterator[Viewer]:
    """`skip-harness view ARGS --port 0` as a real process; its URL read from what it prints; stopped
    with Ctrl-C (SIGINT), which must end it cleanly."""
    err_path = tmp_path / f"view-{time.monotonic_ns()}.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "skip_harness.cli", "view", *args, "--port", "0"],
                                stdout=subprocess.DEVNULL, stderr=err, env=subprocess_env(env))
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            m = re.search(r"at (http://\S+) \(read-only", err_path.read_text())
            if m:
                url = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"skip-harness view did not start: {err_path.read_text()}")
            else:
                time.sleep(0.1)
        v = Viewer(proc, url, err_path)
        yield v
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, v.stderr
        assert "stopped" in v.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def long_payload(rows: int = 16, prompt_len: int = 1024, response_len: int = 4096, seed: int = 0) -> dict:
    """An LLM-length mini-batch: scripts/_benchlib.make_payload's (the benchmark's: left-padded prompts and
    right-padded responses in verl's `input_ids`, an attention mask over both, a response mask, log-probs,
    per-token rewards, uids of 8 samples), plus the rollout's own log-probs (the trainer's plus a little noise)."""
    import sys as _sys

    _sys.path.insert(0, str(REPO / "scripts"))
    from _benchlib import make_payload

    out = make_payload(rows, seed=seed, prompt_len=prompt_len, response_len=response_len)
    g = torch.Generator().manual_seed(seed + 1)
    out["rollout_log_probs"] = out["old_log_probs"] + 0.01 * torch.randn(out["old_log_probs"].shape, generator=g) \
        * out["response_mask"]
    return out
