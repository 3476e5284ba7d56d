"""skip_harness.integrations.trl: a TRL GRPOTrainer recorded, then replayed from the cache.

The end-to-end tests run scripts/trl_demo.py in real subprocesses (a tiny local Llama and a
character tokenizer, CPU, a few seconds each). One recording is shared by the module; each test that
replays with other settings replays into its own copy of that cache.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from replay_rig import namespace_in, serve_other_rollouts  # noqa: E402
from skip_harness.store.open import open_store
from skip_harness.errors import ConfigError, HarnessUsageError  # noqa: E402
from skip_harness.store.stepstore import StepStore  # noqa: E402
from skip_harness.integrations import trl as integration  # noqa: E402

# one xdist worker runs this file, so its module fixture is built once (.ci/run: -n 2 --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_trl")

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "scripts" / "trl_demo.py"
STEPS = 4
# Values of a training log entry that come from the rollouts alone (the recorded completions and
# the reward function): a replay with another learning rate must reproduce them exactly.
ROLLOUT_KEYS = ("num_tokens", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "completions/max_length", "completions/clipped_ratio", "rewards/digit_reward/mean")


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _demo(*args: str) -> dict:
    """The demo's REPORT, with what it printed before it (`_stdout`) and its log (`_stderr`)."""
    proc = subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, env=_env(),
                          timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, proc.stdout + proc.stderr[-4000:]
    return {**json.loads(lines[-1][len("REPORT "):]), "_stdout": proc.stdout, "_stderr": proc.stderr}


def _run(role: str, workdir: Path, dump_dir: Path, out: Path, *args: str) -> tuple:
    """One training in a fresh process; returns (its result, its stderr)."""
    result = out / f"{role}.json"
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--role", role, "--workdir", str(workdir), "--dump-dir", str(dump_dir),
         "--output-dir", str(out / f"out_{role}"), "--result", str(result), *args],
        capture_output=True, text=True, env=_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text()), proc.stderr


def _train_entries(history: list) -> list:
    return [e for e in history if "loss" in e]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """scripts/trl_demo.py run once: a record and a replay, each its own process."""
    workdir = tmp_path_factory.mktemp("trl_demo")
    report = _demo("--workdir", str(workdir), "--steps", str(STEPS))
    return SimpleNamespace(workdir=workdir, dump_dir=workdir / "cache", report=report)


def _copy_cache(recorded, tmp_path: Path) -> Path:
    dump_dir = tmp_path / "cache"
    shutil.copytree(recorded.dump_dir, dump_dir)
    for lock in dump_dir.rglob("*.lock"):
        lock.unlink()
    return dump_dir


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_demo_replay_is_bit_identical_and_skips_generation(recorded):
    report = recorded.report
    assert report["identical"] is True, report["differing_keys"]
    assert report["differing_keys"] == []
    assert report["log_entries"] >= STEPS
    assert report["record_generation_calls"]["train"] == STEPS
    assert report["replay_generation_calls"].get("train", 0) == 0
    assert report["record_summary"]["misses"] == STEPS and report["record_summary"]["hits"] == 0
    assert report["replay_summary"]["hits"] == STEPS and report["replay_summary"]["misses"] == 0
    assert report["record_wall_s"] > 0 and report["replay_wall_s"] > 0
    assert report["untouched_after_train"] is True


@pytest.mark.slow   # the module's recording
def test_the_demo_says_where_the_cache_went_and_how_steps_are_numbered(recorded):
    """Issue 40: the summary was a raw dataclass repr, nothing said where the cache went, and nothing said
    that TRL's steps are numbered from 0 (every other trainer's from 1)."""
    report, ns = recorded.report, recorded.report["namespace"]
    assert ns and Path(ns).parent == recorded.dump_dir / "trl_demo_trl", ns
    assert f"cache: {ns}; steps numbered from 0 as TRL's global_step" in report["_stdout"], report["_stdout"]
    assert integration.STEP_NUMBERS in report["_stderr"]       # attach's log line says it
    for role in ("record", "replay"):
        line = json.loads((recorded.workdir / f"{role}.json").read_text())["summary_line"]
        assert line.startswith(f"rollout cache summary: {STEPS} steps: ") and line.endswith(f"; cache in {ns}"), line
    assert "step 0: miss" in report["_stderr"] and "step 0: hit" in report["_stderr"]


@pytest.mark.slow  # one TRL training in a subprocess
def test_the_demo_without_a_workdir_leaves_no_temporary_directory(tmp_path):
    """`python scripts/trl_demo.py` made a temporary directory (model, outputs, cache) and left it. One training
    (`--role record`) takes the same path as the demo's record-and-replay: the process that made the directory
    removes it when it ends; the children the demo starts are handed it and make none."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, str(DEMO), "--role", "record", "--steps", "1", "--eval-steps", "0"],
                          cwd=tmp_path, capture_output=True, text=True, env={**_env(), "TMPDIR": str(tmp)},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rollout cache summary: 1 step: 0 hits, 0 repeats, 1 miss" in proc.stderr, proc.stderr[-4000:]
    assert not list(tmp.glob("trl_demo_*")), sorted(p.name for p in tmp.iterdir())


@pytest.mark.slow   # the module's recording: one run of the demo, shared with the slow tests above and below
def test_the_replay_check_reports_every_step_reproduced(recorded):
    replay = json.loads((recorded.workdir / "replay.json").read_text())
    assert replay["replay"].startswith(f"replay: {STEPS} of {STEPS} served steps reproduced ("), replay["replay"]
    values = open_store(namespace_in(recorded.dump_dir)).reader.read_values(1)
    assert {"loss", "learning_rate", "reward", "grad_norm"} <= set(values)   # the log_history entry of optimizer step 2


@pytest.mark.slow
def test_other_rollouts_at_step_3_are_reported_as_a_divergence_at_step_3(recorded, tmp_path):
    dump_dir = _copy_cache(recorded, tmp_path)
    serve_other_rollouts(namespace_in(dump_dir), src=2, dst=3)
    record, stderr = _run("replay", recorded.workdir, dump_dir, tmp_path)
    assert record["summary"]["hits"] == STEPS
    assert record["replay"].startswith("replay diverged at step 3 ("), record["replay"]
    assert "nothing in it explains this" in stderr


@pytest.mark.slow
def test_compare_with_the_recordings_arguments_finds_every_trajectory_identical(recorded, tmp_path):
    """Issue 39: `action=compare` generates every step again (TRL's cached unit: completion ids, cut by
    their lengths) and compares it with the recording; nothing is served, nothing written."""
    dump_dir = _copy_cache(recorded, tmp_path)
    ns = namespace_in(dump_dir).root
    before = {p: p.read_bytes() for p in ns.rglob("*") if p.is_file() and ".values/runs" not in p.as_posix()}
    result, stderr = _run("replay", recorded.workdir, dump_dir, tmp_path, "--action", "compare")
    n = STEPS * 8                              # --batch 8 completions per step
    assert result["compared"] == f"rollouts compared: {n} of {n} trajectories identical ({STEPS} steps)", stderr[-3000:]
    assert result["summary"]["hits"] == 0 and result["generation_calls"]["train"] == STEPS
    assert "step 1: miss" in stderr and "compared: 8 of 8 trajectories identical, no differing token" in stderr
    assert {p: p.read_bytes() for p in ns.rglob("*") if p.is_file() and ".values/runs" not in p.as_posix()} == before
    assert (ns / ".values" / "runs" / result["run_id"] / "1.json").is_file()     # its figures, under its run id


@pytest.mark.slow
def test_evaluation_generation_is_never_cached(recorded):
    report = recorded.report
    # the demo evaluates every 2 steps: those generations run on the replay too
    assert report["record_generation_calls"]["eval"] > 0
    assert report["replay_generation_calls"]["eval"] == report["record_generation_calls"]["eval"]
    namespace = Path(report["namespace"])
    steps = sorted(p.name for p in namespace.iterdir() if p.is_dir() and p.name.isdigit())
    assert steps == [str(s) for s in range(STEPS)]  # 0-based optimizer steps, nothing else


@pytest.mark.slow
def test_learning_rate_and_beta_change_still_replay(recorded, tmp_path):
    # training-side arguments are not in the fingerprint: every step hits, rewards and completion
    # statistics (from the recorded rollouts) are identical, the training values are not
    dump_dir = _copy_cache(recorded, tmp_path)
    record, stderr = _run("replay", recorded.workdir, dump_dir, tmp_path, "--lr", "5e-3", "--beta", "0.04")
    baseline = json.loads((recorded.workdir / "replay.json").read_text())
    assert record["summary"]["hits"] == STEPS and record["summary"]["misses"] == 0
    assert record["generation_calls"].get("train", 0) == 0
    new, old = _train_entries(record["log_history"]), _train_entries(baseline["log_history"])
    assert len(new) == len(old) == STEPS
    for a, b in zip(new, old):
        assert {k: a[k] for k in ROLLOUT_KEYS} == {k: b[k] for k in ROLLOUT_KEYS}
    assert [e["learning_rate"] for e in new] != [e["learning_rate"] for e in old]
    assert any(a["grad_norm"] != b["grad_norm"] or a["loss"] != b["loss"] for a, b in zip(new[1:], old[1:]))
    assert all("kl" in e for e in new) and not any("kl" in e for e in old)  # beta > 0: a KL term, recomputed
    # the replay check (log_history entries recorded with their steps) says so, naming the learning rate
    assert record["replay"].startswith("replay diverged at step "), record["replay"]
    assert "trl.learning_rate: 0.001 -> 0.005" in stderr and "trl.beta: 0.0 -> 0.04" in stderr


@pytest.mark.slow
def test_changed_prompt_regenerates_that_step_with_a_warning(recorded, tmp_path):
    dump_dir = _copy_cache(recorded, tmp_path)
    result, stderr = _run("replay", recorded.workdir, dump_dir, tmp_path, "--changed-prompt", "3")
    outcomes = {int(s): o for s, o in result["outcomes"].items()}
    regenerated = [s for s, o in outcomes.items() if o == "miss"]
    assert len(regenerated) == 1, outcomes  # each of the 8 prompts is used by exactly one of the 4 steps
    assert sorted(o for o in outcomes.values()) == ["hit"] * (STEPS - 1) + ["miss"]
    assert result["generation_calls"]["train"] == 1
    step = regenerated[0]
    warnings = [line for line in stderr.splitlines() if "WARNING" in line and f"step {step}" in line]
    assert warnings, stderr[-4000:]


@pytest.mark.slow
def test_a_changed_sampling_argument_stops_the_replay_naming_it(recorded, tmp_path):
    dump_dir = _copy_cache(recorded, tmp_path)
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--role", "replay", "--workdir", str(recorded.workdir), "--dump-dir",
         str(dump_dir), "--output-dir", str(tmp_path / "out"), "--temperature", "0.7"],
        capture_output=True, text=True, env=_env(), timeout=300,
    )
    assert proc.returncode != 0
    assert "FingerprintMismatchError" in proc.stderr and "trl.temperature" in proc.stderr, proc.stderr[-4000:]
    assert "on_mismatch" in proc.stderr


@pytest.mark.slow
def test_gradient_accumulation_with_two_generations_per_step(tmp_path):
    # gradient_accumulation_steps=2 with steps_per_generation=1: TRL generates at every micro-step,
    # so K = 2 generation calls per optimizer step, cached as inner indices 0 and 1.
    report = _demo("--workdir", str(tmp_path), "--steps", "2", "--grad-accum", "2", "--steps-per-generation", "1",
                   "--batch", "4", "--eval-steps", "0")
    assert report["identical"] is True, report["differing_keys"]
    assert report["record_generation_calls"]["train"] == 4
    assert report["replay_generation_calls"].get("train", 0) == 0
    namespace = Path(report["namespace"])
    assert namespace.name.endswith("_K2_W1"), namespace.name
    for step in ("0", "1"):
        assert sorted(p.name for p in (namespace / step).iterdir() if p.is_dir()) == ["0", "1"]


# --------------------------------------------------------------------------- K, digests, payload
def _config(tmp_path, **kwargs):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                      num_generations=4, **kwargs)


@pytest.mark.parametrize(
    "kwargs, K",
    [
        ({}, 1),
        ({"gradient_accumulation_steps": 2}, 1),  # steps_per_generation defaults to it: one generation per step
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 1}, 2),
        ({"gradient_accumulation_steps": 4, "steps_per_generation": 2}, 2),
        ({"gradient_accumulation_steps": 2, "num_iterations": 2}, 1),  # a generation serves two steps
        ({"gradient_accumulation_steps": 1, "steps_per_generation": 2}, 1),
    ],
)
def test_generations_per_step_from_trl_arguments(tmp_path, kwargs, K):
    assert integration.generations_per_step(_config(tmp_path, **kwargs)) == K


def test_generations_per_step_refuses_a_varying_count(tmp_path):
    with pytest.raises(ConfigError, match="steps_per_generation"):
        integration.generations_per_step(_config(tmp_path, gradient_accumulation_steps=3, steps_per_generation=2))


def test_generation_payload_round_trips_exactly():
    ids = [[5, 6, 7], [], [8]]
    assert integration.decode_generation(integration.encode_generation((ids, None))) == (ids, None)
    logprobs = [[-0.1, -2.5, None], [], [float("-inf")]]
    payload = integration.encode_generation((ids, logprobs))
    assert payload["completion_ids"].dtype == torch.int64 and payload["logprobs"].dtype == torch.float64
    assert integration.decode_generation(payload) == (ids, logprobs)
    odd = ("not", "the usual shape")
    assert integration.decode_generation(integration.encode_generation(odd)) == odd


def test_prompt_digest_sees_the_prompts_only():
    a = integration.prompt_digest(([[1, 2, 3], [4]], None, {}, 4), {})
    assert a == integration.prompt_digest(([[1, 2, 3], [4]], None, {}, 4), {})
    assert a == integration.prompt_digest(([[1, 2, 3], [4]],), {"images": None, "multimodal_fields": {},
                                                                    "num_generations": 4})
    assert a != integration.prompt_digest(([[1, 2, 3], [5]], None, {}, 4), {})
    assert a != integration.prompt_digest(([[1, 2, 3], [4]], None, {"pixel_values": torch.ones(2)}, 4), {})


def test_fingerprint_leaves_out_the_training_side(tmp_path):
    from transformers import LlamaConfig

    def trainer(**kwargs):
        model = SimpleNamespace(config=LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4))
        return SimpleNamespace(args=_config(tmp_path, **kwargs), model=model, eos_token_ids=[2])

    base = integration.generation_fingerprint(trainer())
    assert integration.generation_fingerprint(trainer(learning_rate=0.5, beta=0.1)) == base
    hotter = integration.generation_fingerprint(trainer(temperature=0.7))
    assert {k for k in base if base[k] != hotter[k]} == {"trl.temperature"}
    json.dumps(base)  # JSON-able, as the commit record needs


def test_attach_refuses_what_it_cannot_cache():
    with pytest.raises(HarnessUsageError, match="rollout_func"):
        integration.attach(SimpleNamespace(rollout_func=lambda p, t: {}, args=None))
    with pytest.raises(HarnessUsageError, match="tools"):
        integration.attach(SimpleNamespace(rollout_func=None, tools=[print], args=None))
    with pytest.raises(HarnessUsageError, match=r"attach\(\) called twice"):
        integration.attach(SimpleNamespace(rollout_func=None, tools=None, _generate_single_turn=print, args=None))


def test_tiny_llama_is_saved_once_from_its_seed_and_leaves_the_callers_random_stream_alone(tmp_path):
    """skip_harness.demo.tiny_llama (the README's TRL example and trl_demo build their model with it):
    the same seed gives the same weights, a second call keeps the saved model, and the caller's global
    torch random stream is where it was (an example that seeds, then builds the model, samples as if the
    model had not been built)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skip_harness.demo.tiny_llama import save_tiny_llama

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    first = save_tiny_llama(tmp_path / "a")
    assert torch.equal(torch.rand(4), expected)
    second = save_tiny_llama(tmp_path / "b")
    assert first == str(tmp_path / "a") and second == str(tmp_path / "b")
    a, b = (AutoModelForCausalLM.from_pretrained(p) for p in (first, second))
    assert a.config.num_hidden_layers == 2 and a.config.hidden_size == 64
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    mtime = (tmp_path / "a" / "config.json").stat().st_mtime_ns
    assert save_tiny_llama(tmp_path / "a", seed=1) == first           # already there: kept as it is
    assert (tmp_path / "a" / "config.json").stat().st_mtime_ns == mtime
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert tokenizer.decode(tokenizer("1+2=")["input_ids"], skip_special_tokens=True) == "1+2="


# --------------------------------------------------------------------------- the second tier (issue 32)
@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    """A recording whose reward is noisy (OS randomness: no seed reproduces it) and whose loss has a KL
    term against a reference model (beta > 0)."""
    workdir = tmp_path_factory.mktemp("trl_noisy")
    out = workdir / "runs"
    out.mkdir()
    record, _ = _run("record", workdir, workdir / "cache", out, *NOISY)
    return SimpleNamespace(workdir=workdir, dump_dir=workdir / "cache", record=record)


NOISY = ("--steps", "3", "--beta", "0.04", "--reward-noise", "0.5", "--eval-steps", "0")


@pytest.mark.slow
def test_a_noisy_reward_and_the_reference_are_served_and_replay_bit_identical(noisy, tmp_path):
    record = noisy.record
    assert record["phase_calls"] == {"reward": 3, "reference": 3}
    replay, stderr = _run("replay", noisy.workdir, _copy_cache(noisy, tmp_path), tmp_path, *NOISY)
    assert replay["phase_calls"] == {} and replay["generation_calls"] == {}   # no reward function, no reference forward
    assert differing(record, replay) == []
    assert replay["replay"].startswith("replay: 3 of 3 served steps reproduced"), replay["replay"]
    phases = replay["summary"]["phases"]
    assert list(phases) == ["reward", "reference"]
    assert phases["reward"]["served"] == 3 and phases["reference"]["served"] == 3
    assert phases["reference"]["spent_s"] == 0.0 and phases["reference"]["saved_s"] > 0
    assert "; reward 0.0s spent, " in stderr and "; reference 0.0s spent, " in stderr


@pytest.mark.slow
def test_without_the_tier_the_noisy_reward_diverges_and_the_check_names_it(noisy, tmp_path):
    replay, _ = _run("replay", noisy.workdir, _copy_cache(noisy, tmp_path), tmp_path, *NOISY, "--no-tier")
    assert replay["phase_calls"] == {"reward": 3, "reference": 3}
    assert replay["replay"].startswith("replay diverged at step 0 (rewards/digit_reward/mean "), replay["replay"]


@pytest.mark.slow
def test_an_edited_reward_function_is_recomputed_and_said(noisy, tmp_path):
    replay, stderr = _run("replay", noisy.workdir, _copy_cache(noisy, tmp_path), tmp_path, *NOISY,
                          "--reward-edited")
    assert replay["phase_calls"] == {"reward": 3}          # the reference is still served
    assert "rewards recomputed: reward function digit_reward changed" in stderr
    assert replay["summary"]["phases"]["reward"]["computed"] == 3


def differing(a: dict, b: dict) -> list:
    sys.path.insert(0, str(DEMO.parent))
    try:
        import trl_demo
    finally:
        sys.path.pop(0)
    return trl_demo.differing_keys(a["log_history"], b["log_history"])


def test_the_reward_key_names_each_function_and_changes_with_its_source():
    sys.path.insert(0, str(DEMO.parent))
    try:
        import trl_demo
    finally:
        sys.path.pop(0)
    from skip_harness.integrations import trl_tier

    def trainer(fn):
        return SimpleNamespace(reward_funcs=[fn], reward_func_names=["digit_reward"], reward_processing_classes=[None])

    a = trl_tier.reward_key(trainer(trl_demo.digit_reward))
    b = trl_tier.reward_key(trainer(trl_demo.digit_reward_edited))
    assert list(a) == ["reward function digit_reward"] and a != b
    assert a == trl_tier.reward_key(trainer(trl_demo.digit_reward))
    model = torch.nn.Linear(2, 2)
    before = trl_tier.model_digest(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert trl_tier.model_digest(model)["weights"] != before["weights"]


def test_the_demo_report_counts_in_words_a_single_hit_or_miss():
    """Issue 29's small ones: the demo printed `1 hits`."""
    sys.path.insert(0, str(DEMO.parent))
    try:
        import trl_demo
    finally:
        sys.path.pop(0)
    assert [trl_demo._count(n, "hit") for n in (0, 1, 3)] == ["0 hits", "1 hit", "3 hits"]
    assert [trl_demo._count(n, "miss", "misses") for n in (1, 2)] == ["1 miss", "2 misses"]
