"""An object store out of reach when a hit is read: the step is a plain miss (regenerated, never
blamed, never set aside), and the run goes on. Against a real moto server, paused with SIGSTOP."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("obstore")

from s3server import s3_bucket, s3_env, s3_server  # noqa: F401,E402  (fixtures)
from skip_harness import SkipHarness  # noqa: E402


class Gen:
    def __init__(self):
        self.calls = 0

    def generate(self, prompts):
        self.calls += 1
        return {"ids": torch.arange(6).reshape(2, 3) + 10 * self.calls, "text": list(prompts)}


def _run(url, steps, between=lambda s: None, **settings):
    h = SkipHarness.create({"enable": True, "dump_dir": url, "prefetch": False, **settings},
                           namespace={"experiment_name": "e", "project_name": "p", "K": 1, "n": 2},
                           fingerprint={"model": "tiny"})
    t, state = Gen(), {"step": 0}
    h.wrap(t, sample="generate", prepare_data=None, step_of=lambda: state["step"], first_step=0)
    out = []
    try:
        for s in steps:
            between(s)
            state["step"] = s
            out.append(t.generate([f"p{s}"]))
    finally:
        h.close()
    return h, t, out


def test_a_hit_during_an_outage_is_a_plain_miss_and_nothing_is_set_aside(s3_server, s3_env, monkeypatch, caplog):
    monkeypatch.setenv("SKIP_HARNESS_OBJSTORE_TIMEOUT_S", "1")
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/x"
    _run(url, [0, 1, 2])
    before = sorted(s3_server.keys(bucket))

    def outage(step):
        if step == 1:
            s3_server.pause()

    try:
        with caplog.at_level(logging.WARNING, logger="skip_harness"):
            h, t, out = _run(url, [0, 1], between=outage, cleanup="quarantine")
    finally:
        s3_server.resume()
    assert h.outcome(0) == "hit" and h.outcome(1) == "miss", caplog.text
    assert t.calls == 1                               # step 1 regenerated, step 0 served
    assert "cannot be read now" in caplog.text, caplog.text
    keys = sorted(s3_server.keys(bucket))
    assert not [k for k in keys if ".quarantine" in k], keys      # a sound step is never set aside
    assert "could not quarantine" not in caplog.text
    assert [k for k in before if "/0/" in k or k.endswith("0/commit.json")] == \
           [k for k in keys if "/0/" in k or k.endswith("0/commit.json")]
