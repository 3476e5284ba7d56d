"""The second tier (issue 32): a step's rewards and reference log-probs stored after its commit, under
their own validity keys, served on a replay whose keys match, recomputed (and said) when one differs;
the setting that turns it off; what the summary says was spent and saved; the store's side (create-only,
checksummed, removed with its step, on every backend)."""
from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from skip_harness import SkipHarness
from skip_harness.errors import CorruptStepError
from skip_harness.run.callbacks import HarnessCallback
from skip_harness.run.tier import key_changes
from skip_harness.store.open import open_namespace
from skip_harness.store.tier import TierStore, key_digest, read_step_tier


class GenOnly:
    def __init__(self):
        self.calls = 0

    def generate(self, prompts):
        self.calls += 1
        return {"ids": torch.tensor([[len(p), 7] for p in prompts])}


class Phases(HarnessCallback):
    def __init__(self):
        self.events = []

    def on_phase(self, **kw):
        self.events.append(kw)


REWARD_KEY = {"reward function length_reward": "v1"}
REF_KEY = {"reference model": "tiny@abc", "temperature": "1.0"}


def run(tmp_path, steps=(0, 1, 2), K=2, reward_key=REWARD_KEY, ref_key=REF_KEY, noise=True, callbacks=(),
        **settings):
    """A plain-dict loop: generate K times a step, then a noisy reward and a reference pass per call."""
    t = GenOnly()
    state = {"step": 0}
    h = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c"), **settings},
                           namespace={"experiment_name": "e", "project_name": "p", "K": K},
                           fingerprint={"model": "tiny"}, callbacks=callbacks)
    h.wrap(t, sample="generate", prepare_data=None, step_of=lambda: state["step"], first_step=0)
    counts = {"reward": 0, "reference": 0}
    got = []

    def reward(batch):
        counts["reward"] += 1
        r = batch["ids"][:, 0].float()
        return r + (torch.rand(len(r)) if noise else 0.0)      # a judge: not deterministic

    def reference(batch):
        counts["reference"] += 1
        return torch.log_softmax(batch["ids"].float() + torch.randn(batch["ids"].shape), dim=-1)

    for s in steps:
        state["step"] = s
        batches = [t.generate([f"p{s}-{i}", "q"]) for i in range(K)]
        for b in batches:
            r = h.phase("reward", s, lambda b=b: reward(b), key=reward_key)
            ref = h.phase("reference", s, lambda b=b: reference(b), key=ref_key)
            got.append((r, ref))
    summary = h.close()
    return h, t, counts, got, summary


def test_a_replay_serves_the_tier_bit_identical_and_runs_no_phase(tmp_path):
    h1, t1, c1, first, s1 = run(tmp_path)
    assert c1 == {"reward": 6, "reference": 6}
    assert set(s1.phases) == {"reward", "reference"} and s1.phases["reward"].computed == 6
    h2, t2, c2, again, s2 = run(tmp_path)
    assert t2.calls == 0 and c2 == {"reward": 0, "reference": 0}      # nothing recomputed
    for (r1, f1), (r2, f2) in zip(first, again):
        assert torch.equal(r1, r2) and torch.equal(f1, f2)
    assert s2.phases["reward"].served == 6 and s2.phases["reward"].spent_s == 0.0
    assert s2.phases["reward"].saved_s == pytest.approx(s1.phases["reward"].spent_s, rel=1e-6)
    assert "reward 0.0s spent" in s2.phases_line and s2.phases_line.startswith("generation 0.0s spent")


def test_without_the_tier_a_noisy_reward_diverges(tmp_path):
    _, _, _, first, _ = run(tmp_path)
    _, _, counts, again, summary = run(tmp_path, tier=False)
    assert counts == {"reward": 6, "reference": 6}
    assert not torch.equal(first[0][0], again[0][0])      # the noise: recomputed, other values
    assert summary.phases["reward"].served == 0


def test_a_changed_key_recomputes_that_phase_says_which_component_and_stores_both(tmp_path, caplog):
    run(tmp_path)
    edited = {"reward function length_reward": "v2"}
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        _, _, counts, _, summary = run(tmp_path, reward_key=edited)
    assert counts == {"reward": 6, "reference": 0}       # only the reward ran again
    assert "rewards recomputed: reward function length_reward changed" in caplog.text
    assert caplog.text.count("rewards recomputed") == 1  # said once, not per step
    # the replay stored the new key's values beside the first key's: both now serve
    _, _, counts, _, _ = run(tmp_path, reward_key=edited)
    assert counts == {"reward": 0, "reference": 0}
    _, _, counts, _, _ = run(tmp_path)
    assert counts == {"reward": 0, "reference": 0}


def test_a_recording_without_the_tier_gets_it_from_the_first_replay(tmp_path, caplog):
    run(tmp_path, tier=False)
    ns = namespace_of_run(tmp_path)
    assert not TierStore(ns).step_records(0)                 # tier off: nothing stored
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        _, t, counts, _, _ = run(tmp_path)
    assert t.calls == 0 and counts == {"reward": 6, "reference": 6}
    assert "rewards recomputed: none stored with the step (stored now)" in caplog.text
    _, _, counts, _, _ = run(tmp_path)
    assert counts == {"reward": 0, "reference": 0}


def test_the_callbacks_hear_each_phase(tmp_path):
    cb = Phases()
    run(tmp_path, steps=(0,), callbacks=[cb])
    assert [(e["phase"], e["inner_index"], e["served"]) for e in cb.events] == [
        ("reward", 0, False), ("reference", 0, False), ("reward", 1, False), ("reference", 1, False)]
    cb = Phases()
    run(tmp_path, steps=(0,), callbacks=[cb])
    assert all(e["served"] and e["seconds"] == 0.0 and e["saved"] >= 0 for e in cb.events)


def test_the_summary_line_counts_each_phase(tmp_path, caplog):
    run(tmp_path, steps=(0,))
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        run(tmp_path, steps=(0,))
    line = [r.message for r in caplog.records if r.message.startswith("rollout cache summary")][-1]
    assert "; reward 0.0s spent, " in line and "; reference 0.0s spent, " in line


def namespace_of_run(tmp_path):
    h = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path / "c")},
                           namespace={"experiment_name": "e", "project_name": "p", "K": 2})
    h.start()
    layout = h.layout
    h.close()
    return open_namespace(layout)


def test_the_tier_is_beside_the_step_create_only_checksummed_and_goes_with_the_step(tmp_path):
    run(tmp_path)
    ns = namespace_of_run(tmp_path)
    root = tmp_path / "c" / "e_p" / "K2_W1"
    files = sorted(p.relative_to(root).as_posix() for p in (root / ".tier" / "0").rglob("*") if p.is_file())
    digest = key_digest(REWARD_KEY)
    assert f".tier/0/reward/{digest}/0-r0.json" in files and f".tier/0/reward/{digest}/1-r0.tensors" in files
    assert not any(".tier" in p.as_posix() for p in (root / "0").rglob("*"))   # the step's own files untouched
    doc = json.loads((root / ".tier/0/reward" / digest / "0-r0.json").read_text())
    assert doc["key"] == REWARD_KEY and doc["size"] > 0 and len(doc["checksum"]) == 32
    commit = json.loads((root / "0" / "commit.json").read_text())
    assert doc["commit_created"] == commit["created"]          # bound to the step's commit record
    store = TierStore(ns)
    # create-only: a second write under the same key keeps the first
    assert store.write(0, "reward", 0, 0, REWARD_KEY, store.encode(torch.zeros(2)), commit_created=commit["created"],
                       seconds=1.0) is False
    # the viewer's read: every phase of a step, verified
    tier = read_step_tier(ns, 0, commit_created=commit["created"])
    assert set(tier) == {"reward", "reference"} and set(tier["reward"]) == {(0, 0), (1, 0)}
    assert tier["reward"][(0, 0)].values.shape == (2,)
    # a flipped byte is refused before anything is served
    path = root / ".tier/0/reward" / digest / "0-r0.tensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStepError, match="checksum"):
        store.read(0, "reward", REWARD_KEY, 0, 0, commit_created=commit["created"])
    # a removed step takes its tier with it
    ns.remove_step(0)
    assert not (root / ".tier" / "0").exists() and (root / ".tier" / "1").is_dir()


def test_a_corrupt_entry_is_recomputed_with_a_warning(tmp_path, caplog):
    run(tmp_path, steps=(0,))
    root = tmp_path / "c" / "e_p" / "K2_W1"
    path = root / ".tier/0/reward" / key_digest(REWARD_KEY) / "1-r0.tensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        _, _, counts, _, _ = run(tmp_path, steps=(0,))
    assert counts == {"reward": 1, "reference": 0}
    assert "checksum" in caplog.text and "rewards recomputed" in caplog.text


def test_a_regenerated_step_is_not_served_its_old_tier(tmp_path):
    """A step removed and generated again is other rollouts: the tier bound to its old commit is not served."""
    run(tmp_path, steps=(0,))
    root = tmp_path / "c" / "e_p" / "K2_W1"
    shutil.rmtree(root / "0")                 # the step gone, its tier left behind (a step rewritten in place)
    _, t, counts, _, _ = run(tmp_path, steps=(0,), tier=False)      # generated again, no tier written
    assert t.calls == 2
    _, t, counts, _, _ = run(tmp_path, steps=(0,))                   # a hit: the stale tier is not served
    assert t.calls == 0 and counts == {"reward": 2, "reference": 2}
    # the new write of the step replaced the stale entries: a replay serves them
    _, t, counts, _, _ = run(tmp_path, steps=(0,))
    assert t.calls == 0 and counts == {"reward": 0, "reference": 0}


def test_a_step_generated_with_sync_writes_stores_its_tier_too(tmp_path):
    run(tmp_path, async_write=False)
    _, _, counts, _, _ = run(tmp_path, async_write=False)
    assert counts == {"reward": 0, "reference": 0}


def test_phase_runs_plainly_when_caching_is_off_or_the_harness_closed(tmp_path):
    h = SkipHarness.create({"enable": False}, namespace={"experiment_name": "e", "project_name": "p"})
    assert h.phase("reward", 0, lambda: 3, key={}) == 3
    h.close()
    assert h.phase("reward", 0, lambda: 4, key={}) == 4


def test_key_changes_name_the_component():
    assert key_changes({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "0"}) == ["b changed", "c added"]
    assert key_changes({"a": "1"}, {}) == ["a removed"]
    assert key_digest({"a": "1", "b": "2"}) == key_digest({"b": "2", "a": "1"})


@pytest.mark.parametrize("url", ["memory://tier-test"])
def test_the_tier_on_another_backend(url, tmp_path):
    random.seed(0)
    np.random.seed(0)
    ns = open_namespace(SkipHarness.create({"enable": True, "dump_dir": url},
                                         namespace={"experiment_name": "e", "project_name": "p"})
                      ._key.layout(url))
    store = TierStore(ns)
    data = store.encode({"r": torch.arange(4.0)})
    assert store.write(3, "reward", 0, 0, REWARD_KEY, data, commit_created=1.5, seconds=0.2)
    assert not store.write(3, "reward", 0, 0, REWARD_KEY, data, commit_created=1.5, seconds=0.2)
    got = store.read(3, "reward", REWARD_KEY, 0, 0, commit_created=1.5)
    assert torch.equal(got.values["r"], torch.arange(4.0)) and got.record.seconds == 0.2
    assert store.read(3, "reward", REWARD_KEY, 0, 0, commit_created=2.0) is None      # another write of the step
    assert store.read(3, "reward", {"other": "x"}, 0, 0, commit_created=1.5) is None


@pytest.mark.slow
def test_the_tier_bench_reports_both_ratios(tmp_path):
    """scripts/bench_tier.py --quick as a user runs it: both replay_step_ratio figures are there and sane (never
    how fast: speed is the bench's to report), and the replay with the tier reproduced the recording."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_tier.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--json", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    for key in ("replay_step_ratio_tier", "replay_step_ratio_no_tier", "tier_record_step_s", "tier_reward_cost_s"):
        assert isinstance(doc[key], float) and doc[key] > 0, key
    assert doc["tier_replay_reproduced"] is True
    assert "reward 0.0s spent" in proc.stderr             # the replay with the tier ran no reward
    assert not list(tmp_path.iterdir())                   # its work dir removed


# --------------------------------------------------------------------------- the demo
CONF = Path(__file__).resolve().parents[1] / "conf"


def _demo(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from skip_harness.demo import TINY_OVERRIDES
    from skip_harness.demo.config import register_demo_configs
    from skip_harness.demo.run import train

    register_demo_configs()
    OmegaConf.register_new_resolver("skip_harness_run_id", lambda: "run", replace=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_OVERRIDES, "trainer.total_training_steps=3", "trainer.torch_threads=1",
                                           f"skip.rollout_tq.dump_dir={tmp_path / 'cache'}", *overrides])
    GlobalHydra.instance().clear()
    return train(cfg, run_dir=tmp_path / "run")


NOISY_DEMO = ("trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
              "reward_model.noise=0.5", "actor_rollout_ref.actor.use_kl_loss=true")


def test_the_demo_replays_a_noisy_reward_and_its_kl_term_exactly_with_the_tier(tmp_path, caplog):
    first = _demo(tmp_path, *NOISY_DEMO)
    assert set(first.summary.phases) == {"reward", "reference"} and first.summary.phases["reward"].computed == 6
    assert all(row["kl_loss"] >= 0 for row in first.metrics)
    again = _demo(tmp_path, *NOISY_DEMO)
    assert again.summary.replay_line.startswith("replay: 3 of 3 served steps reproduced ("), again.summary.replay_line
    assert again.summary.phases["reward"].served == 6 and again.summary.phases["reference"].served == 6
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        off = _demo(tmp_path, *NOISY_DEMO, "skip.rollout_tq.tier=false")
    assert off.summary.replay_line.startswith("replay diverged at step 1 (reward_mean "), off.summary.replay_line
    assert off.summary.phases["reward"].computed == 6


def test_the_demos_reward_and_kl_term_are_off_by_default(tmp_path):
    run = _demo(tmp_path)
    assert run.summary.phases == {} and "kl_loss" not in run.metrics[0]


@pytest.mark.parametrize("key", ["reward_model.cost_s", "reward_model.noise", "actor_rollout_ref.actor.kl_loss_coef"])
def test_the_demos_tier_keys_refuse_a_negative_value_naming_the_key(key):
    from skip_harness.demo.config import to_demo_config
    from skip_harness.errors import ConfigError

    section, _, leaf = key.rpartition(".")
    cfg: dict = {}
    node = cfg
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[leaf] = -1.0
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_demo_config(cfg)


def test_the_tier_setting_is_a_bool_off_by_hydras_words():
    from omegaconf import OmegaConf

    from skip_harness.config import rollout_tq_from

    assert rollout_tq_from({}).tier is True
    assert rollout_tq_from(OmegaConf.create({"skip": {"rollout_tq": {"tier": "off"}}})).tier is False
