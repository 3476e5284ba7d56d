"""verl's REAL trainer with the plug-in: ``python -m verl.trainer.main_ppo`` (verl 0.9.1, V1 trainer, GRPO,
FSDP2 on gloo, TransferQueue, verl's agent loop, reward loop and weight sync) on CPU, loaded with
``VERL_USE_EXTERNAL_MODULES=skip_harness.integrations.verl,verl_cpu`` (tests/verl_cpu: what verl needs to run
on a CPU, through its registries). A tiny random-weight Llama, 4 prompts x 2 samples, 3 steps (sync), 2 (async modes).

One chain of sync runs covers four claims, each run doing double duty (every run costs ~1-2 min of Ray and
worker start-up):

  killed  records, SIGKILLed (driver, Ray, workers) once step 1 is committed and step 2 is being written;
  rerun   cleans the interrupted step 2, serves step 1 (its metrics equal the killed run's), generates 2, 3;
  replay  serves all three: 0 generate calls, verl's metrics identical to the rerun's, timing aside; the
          harness closes at the last step -- summary logged, lock released -- though Ray force-exits the
          TaskRunner at the end of a replay;
  fresh   the same run without the cache: its metrics differ (the comparison can fail).

Then colocate_async (num_warmup_batches=0) and separate_async with K = 2 (verl's standalone rollout
replica): record, replay.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from verl_cpu import driver, recipe  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.timeout(2400)]   # minutes of Ray start-up per run

STEPS = 2
SYNC_STEPS = 3   # the chain's step 2 is not the last: it commits in the background, the kill's window
CALLS_PER_STEP = 4 * 2          # data.train_batch_size x rollout.n
NAMESPACE = "GBS4_N2_in16_out16"


def _trl_blocks_verl() -> str:
    """verl 0.9.x imports trl.experimental.ppo / trl.AutoModelForCausalLMWithValueHead whenever trl imports
    (verl/models/transformers/monkey_patch.py:352); TRL 1.13 removed both."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return ""
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
    except ImportError:
        try:
            from trl import AutoModelForCausalLMWithValueHead  # noqa: F401,F811
        except ImportError:
            import trl

            return (f"TRL {trl.__version__} is installed: verl 0.9.x cannot build its FSDP actor with it "
                    "(pip install 'trl<1.13', as skip_harness's [trl] and [dev] extras pin)")
    return ""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    problem = _trl_blocks_verl()
    if problem:
        pytest.fail(problem)
    work = tmp_path_factory.mktemp("verl_real")
    return work, recipe.prepare(work)


def _namespace(dump_dir: Path, experiment: str) -> Path:
    return dump_dir / f"{experiment}_verl_cpu" / NAMESPACE


@pytest.fixture(scope="module")
def sync_chain(workdir):
    work, paths = workdir
    cache = work / "cache"
    ns = _namespace(cache, "sync")

    def step1_committed_and_step2_being_written(gen_log: Path) -> bool:
        # the writer makes the step's directory first, then the payload, its meta, the commit record
        # (fsync'd each): killed at the first sight of it, step 2 is interrupted mid-write
        return (ns / "2").exists() and (ns / "1" / "commit.json").exists()

    runs = {"killed": driver.main_ppo(work, "killed", paths, dump_dir=cache, experiment="sync", steps=SYNC_STEPS,
                                      kill_when=step1_committed_and_step2_being_written)}
    runs["killed_state"] = sorted(p.relative_to(ns).as_posix() for p in ns.rglob("*") if p.is_file())
    for name in ("rerun", "replay"):
        runs[name] = driver.main_ppo(work, name, paths, dump_dir=cache, experiment="sync", steps=SYNC_STEPS)
    runs["fresh"] = driver.main_ppo(work, "fresh", paths, dump_dir=None, experiment="sync", steps=SYNC_STEPS)
    runs["namespace"] = ns
    return runs


def test_a_killed_recording_is_rerun_cleaned_served_and_regenerated(sync_chain):
    killed, rerun = sync_chain["killed"], sync_chain["rerun"]
    state = sync_chain["killed_state"]
    assert killed.returncode == -9, killed.output[-3000:]
    assert "1/commit.json" in state and "2/commit.json" not in state, state   # killed inside step 2's write
    assert sorted(killed.metrics) == [1], "verl logged step 1 only before the kill"

    assert rerun.returncode == 0, rerun.output[-5000:]
    assert rerun.generate_calls == 2 * CALLS_PER_STEP, "step 1 must be served, steps 2 and 3 generated"
    assert rerun.lines("step 1: hit"), rerun.lines("skip_harness")
    if any(p.startswith("2/") for p in state):   # killed mid-write (the kill aims there): set aside first
        assert any("1 incomplete [2]" in line and "deleted 1" in line for line in rerun.lines("rollout cache")), \
            rerun.lines("rollout cache")
    for step in (1, 2, 3):
        assert (sync_chain["namespace"] / str(step) / "commit.json").is_file()
    # the step served equals what the killed run trained on
    assert driver.differences(killed.metrics, rerun.metrics, [1]) == []


def test_the_replay_generates_nothing_and_verls_metrics_are_identical(sync_chain):
    rerun, replay = sync_chain["rerun"], sync_chain["replay"]
    assert replay.returncode == 0, replay.output[-5000:]
    assert replay.generate_calls == 0
    assert sorted(replay.metrics) == [1, 2, 3]
    assert driver.differences(rerun.metrics, replay.metrics, [1, 2, 3]) == []
    assert len(driver.comparable(replay.metrics)[1]) > 30   # verl's real metrics, not an empty dict


def test_a_replay_under_main_ppo_closes_its_cache(sync_chain):
    """Ray force-exits the TaskRunner at the end of a replay (no exit handlers): the plug-in closes after the
    last step, so the summary is logged and the namespace released anyway."""
    replay = sync_chain["replay"]
    summary = replay.lines("rollout cache summary")
    assert summary and "3 hits" in summary[-1], replay.lines("skip_harness")
    # verl's logged metrics reached the replay check (integrations/verl_values.py) on every served step
    assert "served steps reproduced" in summary[-1] and "diverged" not in summary[-1], summary[-1]
    assert not (sync_chain["namespace"] / ".lock.holder.json").exists(), "the namespace is still held"


def test_without_the_cache_the_comparison_fails(sync_chain):
    fresh, replay = sync_chain["fresh"], sync_chain["replay"]
    assert fresh.returncode == 0, fresh.output[-5000:]
    assert fresh.generate_calls == SYNC_STEPS * CALLS_PER_STEP
    assert driver.differences(replay.metrics, fresh.metrics, [1, 2, 3]) != []


def test_colocate_async_is_recorded_then_replayed_without_generating(workdir):
    work, paths = workdir
    cache = work / "cache"
    record = driver.main_ppo(work, "async_record", paths, dump_dir=cache, experiment="colocate",
                             mode="colocate_async", steps=STEPS)
    assert record.returncode == 0, record.output[-5000:]
    assert record.generate_calls == STEPS * CALLS_PER_STEP
    replay = driver.main_ppo(work, "async_replay", paths, dump_dir=cache, experiment="colocate",
                             mode="colocate_async", steps=STEPS)
    assert replay.returncode == 0, replay.output[-5000:]
    assert replay.generate_calls == 0
    assert driver.differences(record.metrics, replay.metrics, [1, 2]) == []
    summary = replay.lines("rollout cache summary")
    assert summary and f"replay: {STEPS} of {STEPS} served steps reproduced" in summary[-1], summary


def test_separate_async_k2_is_recorded_then_replayed_call_by_call(workdir):
    """separate_async, K = 2 (parameter_sync_step): verl's standalone rollout replica (hf_cpu on its own
    Ray "GPU" bundle, weights through the ray_store checkpoint engine), two sample calls per step, each
    stored as its own inner index and served to the same call on the replay."""
    work, paths = workdir
    cache = work / "cache"
    record = driver.main_ppo(work, "sep_record", paths, dump_dir=cache, experiment="separate", mode="separate_async",
                             K=2, steps=STEPS)
    assert record.returncode == 0, record.output[-5000:]
    assert record.generate_calls == 2 * CALLS_PER_STEP
    ns = cache / "separate_verl_cpu"
    namespaces = [p for p in ns.iterdir() if p.is_dir()]
    assert len(namespaces) == 1 and namespaces[0].name.endswith("_K2_W1"), namespaces
    for step in (1, 2):
        assert sorted(p.relative_to(namespaces[0] / str(step)).as_posix()
                      for p in (namespaces[0] / str(step)).rglob("tq_batch.pt")) == ["0/tq_batch.pt", "1/tq_batch.pt"]
    replay = driver.main_ppo(work, "sep_replay", paths, dump_dir=cache, experiment="separate", mode="separate_async",
                             K=2, steps=STEPS)
    assert replay.returncode == 0, replay.output[-5000:]
    assert replay.generate_calls == 0
    assert driver.differences(record.metrics, replay.metrics, [1, 2]) == []
