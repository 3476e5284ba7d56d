"""verl's REAL trainer with the plug-in: ``python -m verl.trainer.main_ppo`` (verl 0.9.1, V1 trainer, GRPO,
FSDP2 on gloo, TransferQueue, verl's agent loop, reward loop and weight sync) on CPU, loaded with
``VERL_USE_EXTERNAL_MODULES=skip_harness.integrations.verl,verl_cpu`` (scripts/verl_cpu: what verl needs to run
on a CPU, through its registries). A tiny random-weight Llama, 4 prompts x 2 samples, 3 steps (sync), 2 (async modes).

Every run costs about a minute of Ray and worker start-up, so each run does several jobs. One chain of sync runs
(unseeded: two runs generate different rollouts) with a reference model (actor_rollout_ref.actor.use_kl_loss=true:
verl's KL loss against the reference policy):

  killed  records, SIGKILLed (driver, Ray, workers) once step 2 is generated, before it is written;
  rerun   serves step 1 (its metrics equal the killed run's; its reference log-probs from the second tier),
          generates 2, 3;
  replay  serves all three: 0 generate calls, no reference forward, verl's metrics identical to the rerun's
          (timing aside); the harness closes at the last step -- summary logged, lock released -- though Ray
          force-exits the TaskRunner at the end of a replay.

Without the cache two runs differ (the comparison can fail): the killed run and the rerun both generated step 2
(same prompts, the same weights), and their responses differ.

Then two seeded experiments (hf_cpu's custom.seed: deterministic generation; verl_cpu seeds verl's prompt uids
and lets the sampler poll a settled queue), 2 steps: colocate_async with verl's warm-up and DAPO, recorded
(checkpointing each step), run without the cache and replayed resumed from the recording's step-1 checkpoint;
separate_async K = 2 with the warm-up, recorded and replayed (the recording is its replay's baseline). Every logged
value (timing aside) of the cached colocate_async run equals the uncached run's; the replays generate nothing and
log the recording's values, DAPO counts included. (DAPO's refills are verl's ReplayBuffer, in trainer_base for
every mode; sync DAPO is checked on verl's own ReplayBuffer by tests/test_verl_plugin.py. A real sync DAPO
record-and-replay was dropped from here to keep CI within its 30 minutes: two runs, four minutes of a loaded lane.)

Eight runs, each mostly the start-up of ten processes that import verl one after another: `.ci/run` runs this
file on two xdist workers (`-n 2 --dist loadgroup`) with the other slow tests, the sync chain on one worker,
colocate_async and separate_async on one.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from verl_cpu import driver, recipe  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.timeout(2400)]   # minutes of Ray start-up per run
# two lanes for `-n 2 --dist loadgroup`: three runs and five (each xdist worker builds its own workdir)
SYNC_LANE = pytest.mark.xdist_group("verl_real_sync")
ASYNC_LANE = pytest.mark.xdist_group("verl_real_async")

STEPS = 2
SYNC_STEPS = 3   # killed in step 2, the rerun generates 2 and 3
CALLS_PER_STEP = 4 * 2          # data.train_batch_size x rollout.n
NAMESPACE = "GBS4_N2_in16_out16"
SEED = 7   # hf_cpu's custom.seed: deterministic generation, seeded prompt uids, a settled sampler (verl_cpu)
# a reference model: verl's KL loss against the initial policy (verl_cpu unpins its FSDP2 CPU offload)
REFERENCE = ["actor_rollout_ref.actor.use_kl_loss=true"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("verl_real")
    return work, recipe.prepare(work)


def _namespace(dump_dir: Path, experiment: str) -> Path:
    return dump_dir / f"{experiment}_verl_cpu" / NAMESPACE


@pytest.fixture(scope="module")
def sync_chain(workdir):
    work, paths = workdir
    cache = work / "cache"
    ns = _namespace(cache, "sync")
    common = dict(experiment="sync", steps=SYNC_STEPS)

    def step2_generated(gen_log: Path) -> bool:
        # once step 2's rollouts are all back (weights version 1 in the generate log): its write comes about
        # 1.8 s later, after verl's reward and log-prob passes (its commit record some 10 ms after that).
        # Aiming at the write itself missed both ways.
        return (ns / "1" / "commit.json").exists() and _calls_of(gen_log, "1") >= CALLS_PER_STEP

    runs = {"killed": driver.main_ppo(work, "killed", paths, dump_dir=cache, extra=REFERENCE, **common,
                                      kill_when=step2_generated)}
    runs["killed_state"] = sorted(p.relative_to(ns).as_posix() for p in ns.rglob("*") if p.is_file())
    for name in ("rerun", "replay"):
        runs[name] = driver.main_ppo(work, name, paths, dump_dir=cache, extra=REFERENCE, **common)
    runs["namespace"] = ns
    runs["generated"] = {name: _generated(work / f"{name}.generate") for name in ("killed", "rerun")}
    for name in ("killed", "rerun", "replay"):
        _show(f"sync {name}", runs[name])
    return runs


@SYNC_LANE
def test_a_killed_recording_is_rerun_served_and_regenerated(sync_chain):
    killed, rerun = sync_chain["killed"], sync_chain["rerun"]
    state = sync_chain["killed_state"]
    assert killed.returncode == -9, killed.output[-3000:]
    assert "1/commit.json" in state and "2/commit.json" not in state, state   # killed before step 2's commit
    assert killed.generate_calls == 2 * CALLS_PER_STEP, killed.generate_calls   # steps 1 and 2 generated
    assert sorted(killed.metrics) == [1], "verl logged step 1 only before the kill"

    assert rerun.returncode == 0, rerun.output[-5000:]
    assert rerun.generate_calls == 2 * CALLS_PER_STEP, "step 1 must be served, steps 2 and 3 generated"
    assert rerun.lines("step 1: hit"), rerun.lines("skip_harness")
    for step in (1, 2, 3):
        assert (sync_chain["namespace"] / str(step) / "commit.json").is_file()
    # the step served equals what the killed run trained on
    assert driver.differences(killed.metrics, rerun.metrics, [1]) == []


@SYNC_LANE
def test_the_replay_generates_nothing_and_verls_metrics_are_identical(sync_chain):
    rerun, replay = sync_chain["rerun"], sync_chain["replay"]
    assert replay.returncode == 0, replay.output[-5000:]
    assert replay.generate_calls == 0
    assert sorted(replay.metrics) == [1, 2, 3]
    assert driver.differences(rerun.metrics, replay.metrics, [1, 2, 3]) == []
    assert len(driver.comparable(replay.metrics)[1]) > 30   # verl's real metrics, not an empty dict


@SYNC_LANE
def test_a_replay_under_main_ppo_closes_its_cache(sync_chain):
    """Ray force-exits the TaskRunner at the end of a replay (no exit handlers): the plug-in closes after the
    last step, so the summary is logged and the namespace released anyway."""
    replay = sync_chain["replay"]
    summary = replay.lines("rollout cache summary")
    assert summary and "3 hits" in summary[-1], replay.lines("skip_harness")
    # verl's logged metrics reached the replay check (integrations/verl_values.py) on every served step
    assert "served steps reproduced" in summary[-1] and "diverged" not in summary[-1], summary[-1]
    assert not (sync_chain["namespace"] / ".lock.holder.json").exists(), "the namespace is still held"


@SYNC_LANE
def test_the_replay_runs_no_reference_forward(sync_chain):
    """Issue 32, verl's part: with a reference model (use_kl_loss), the recording stores the reference log-probs
    of each step (the second tier); a run serving the step puts them into verl's batch instead of running
    verl's _compute_ref_log_prob, and trains exactly as the recording did (verl's KL loss included)."""
    killed, rerun, replay = sync_chain["killed"], sync_chain["rerun"], sync_chain["replay"]
    ran = "reference log-probs verl's _compute_ref_log_prob ran"
    served = "reference log-probs served from the cache"
    assert len(killed.lines(ran)) >= 1          # the recording ran the reference forward
    # the rerun generates steps 2 and 3 (their reference forward runs) and serves step 1: its reference log-probs
    # too, unless the kill struck between step 1's commit record and its second tier (then it computes and
    # stores them: "reference log-probs recomputed: none stored with the step")
    assert len(rerun.lines(ran)) + len(rerun.lines(served)) == 3 and len(rerun.lines(ran)) in (2, 3), \
        rerun.lines("reference log-probs")
    assert (len(replay.lines(served)), len(replay.lines(ran))) == (3, 0), replay.lines("reference log-probs")
    summary = replay.lines("rollout cache summary")[-1]
    assert "reference 0.0s spent" in summary, summary
    for step in (1, 2, 3):   # verl's KL loss, from the served reference log-probs, as recorded
        # (0.0 here: this tiny model's bf16 forward does not move in 3 steps at verl's learning rate)
        assert replay.metrics[step]["actor/kl_loss"] == rerun.metrics[step]["actor/kl_loss"]


def _calls_of(path: Path, version: str) -> int:
    """How many generate calls hf_cpu's log (rollout.py) holds for weights `version` so far."""
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.split(" ", 2)[1:2] == [version])


def _generated(path: Path) -> dict:
    """hf_cpu's generate log (rollout.py): weights version -> prompt -> the responses sampled for it."""
    out: dict = {}
    for line in path.read_text().splitlines():
        _, version, rest = line.split(" ", 2)
        prompt, response = rest.split(" -> ")
        out.setdefault(version, {}).setdefault(prompt, []).append(response)
    return {version: {p: sorted(r) for p, r in prompts.items()} for version, prompts in out.items()}


@SYNC_LANE
def test_without_the_cache_the_comparison_fails(sync_chain):
    """Unseeded, two runs generate different rollouts (hf_cpu samples from the OS, as vLLM does): a replay
    that logs the recording's values can only have read the cache. Both the killed run and the rerun
    generated step 2 (weights version 1: step 1 trained on the same served batch) from the same prompts."""
    killed, rerun = sync_chain["generated"]["killed"], sync_chain["generated"]["rerun"]
    assert "1" in killed and sorted(rerun) == ["1", "2"], (sorted(killed), sorted(rerun))   # rerun: step 1 served
    assert sorted(killed["1"]) == sorted(rerun["1"]), "step 2 drew other prompts"
    assert sum(len(r) for r in killed["1"].values()) == CALLS_PER_STEP
    assert killed["1"] != rerun["1"], "two unseeded runs sampled the same responses"


def _show(label: str, run) -> None:
    print(f"{label}: {run.generate_calls} generate calls, {run.wall_s:.0f} s, steps {sorted(run.metrics)}; " + "; ".join(
        f"step {step} " + ", ".join(f"{k}={v}" for k, v in values.items() if k in SHOWN)
        for step, values in sorted(run.metrics.items())))


MISMATCH_KEYS = ("rollout_corr/", "training/rollout_probs_diff", "training/rollout_actor_probs_pearson_corr")
REL_TOL = 1e-3   # cached vs uncached: floats summed over the batch in another order (_caching_changes_nothing)
SHOWN = ("actor/pg_loss", "actor/kl_loss", "critic/score/mean", "response_length/mean",
         "training/filter_groups/evicted_samples", "training/filter_groups/discarded_surplus_samples")


def _chain(workdir, experiment: str, mode: str, *, resume: bool, uncached: bool, **kwargs) -> dict:
    """One experiment, seeded: recorded with the cache (checkpointing each step when `resume`), (`uncached`)
    run without the cache, and replayed -- from the start, or (`resume`) resumed from the recording's step-1
    checkpoint."""
    work, paths = workdir
    cache = work / "cache"
    ckpt = work / f"ckpt_{experiment}"
    common = dict(experiment=experiment, mode=mode, steps=STEPS, seed=SEED, **kwargs)
    save = [f"trainer.default_local_dir={ckpt}", "trainer.save_freq=1"] if resume else []
    runs = {"record": driver.main_ppo(work, f"{experiment}_record", paths, dump_dir=cache, extra=save, **common)}
    if uncached:
        runs["uncached"] = driver.main_ppo(work, f"{experiment}_uncached", paths, dump_dir=None, **common)
    if not resume:
        runs["replay"] = driver.main_ppo(work, f"{experiment}_replay", paths, dump_dir=cache, **common)
    else:
        runs["resumed"] = driver.main_ppo(
            work, f"{experiment}_resumed", paths, dump_dir=cache, extra=[
                f"trainer.default_local_dir={work / f'ckpt_{experiment}_resumed'}", "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={ckpt / 'global_step_1'}"], **common)
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.output[-5000:])
        _show(f"{experiment} {name}", run)
    return runs


def _caching_changes_nothing(record, uncached, steps) -> None:
    """Caching on changes nothing verl trains: the cached run logs what the uncached run logs."""
    assert sorted(record.metrics) == list(steps)
    # verl puts trajectories into its batch in the order the rollout finished them, which varies from run to run
    # on this CPU: a float sum over the batch may then differ in its last bits, and step 2 trains from weights
    # that differ as little (measured: at most 1e-4 relative, step 2's actor/grad_norm, colocate_async; most
    # keys equal exactly); every count and integer is equal. Runs that train on other rollouts differ by 10%+
    # (the sync chain's unseeded run). MISMATCH_KEYS measure how far the rollout's log-probs are from the
    # trainer's -- near-zero differences of near-equal numbers, whose last bits they magnify (separate_async's
    # step 2: rollout_corr/kl 2.3e-4 vs 4.9e-5) -- and are left out of this comparison, not of the replay's
    assert [d for d in driver.differences(uncached.metrics, record.metrics, steps, rel_tol=REL_TOL)
            if not any(k in d for k in MISMATCH_KEYS)] == []


def _replays_the_recording(record, replay, steps) -> None:
    """The replay generates nothing and logs the recording's values, every key but timing."""
    assert replay.generate_calls == 0
    assert driver.differences(record.metrics, replay.metrics, steps) == []
    summary = replay.lines("rollout cache summary")
    assert summary and f"replay: {len(steps)} of {len(steps)} served steps reproduced" in summary[-1], summary


def _resumed_serves_the_later_steps(record, resumed, steps) -> None:
    assert resumed.returncode == 0, resumed.output[-5000:]
    assert sorted(resumed.metrics) == list(steps), resumed.lines("skip_harness")
    assert resumed.generate_calls == 0
    assert driver.differences(record.metrics, resumed.metrics, steps) == []


def _dapo_counted(record, replay) -> None:
    counts = [values.get("training/filter_groups/evicted_samples", 0) for values in record.metrics.values()]
    assert sum(counts) > 0, "the tied reward should have made DAPO evict groups"
    for step, values in replay.metrics.items():   # the sampler's counts, replayed
        assert values.get("training/filter_groups/evicted_samples") == \
            record.metrics[step].get("training/filter_groups/evicted_samples")


@ASYNC_LANE
def test_colocate_async_with_warmup_and_dapo_records_replays_and_resumes_as_it_trains(workdir):
    """colocate_async with verl's warm-up (num_warmup_batches=1) and DAPO: the cached run keeps the warm-up
    (it generates what the uncached run generates and trains the same); the replay, resumed from the recording's
    step-1 checkpoint (verl's warm-up runs again on resume), serves warm-up and refills and step 2."""
    runs = _chain(workdir, "colocate", "colocate_async", resume=True, uncached=True, warmup=1, dapo=True)
    record = runs["record"]
    assert record.generate_calls >= (STEPS + 1) * CALLS_PER_STEP, "the warm-up batch was not generated"
    assert record.generate_calls == runs["uncached"].generate_calls
    _caching_changes_nothing(record, runs["uncached"], [1, 2])
    _resumed_serves_the_later_steps(record, runs["resumed"], [2])
    summary = runs["resumed"].lines("rollout cache summary")
    assert summary and "1 hit," in summary[-1] and "reproduced" in summary[-1] and "diverged" not in summary[-1], \
        summary
    _dapo_counted(record, runs["resumed"])
    [ns] = [p for p in (workdir[0] / "cache" / "colocate_verl_cpu").iterdir() if p.is_dir()]   # GBS: gen_batch_size
    _discards_recorded(ns, record)


def _discards_recorded(ns: Path, record) -> None:
    """Issue 43: every group DAPO evicted at a step is recorded beside it with its reason and its samples'
    tied reward (integrations.verl_discards); the resumed replay that served step 2 left them as they were."""
    import json

    for step, values in record.metrics.items():
        path = ns / ".values" / f"discarded-{step}.json"
        doc = json.loads(path.read_text()) if path.exists() else {"discarded": []}
        tied = [d for d in doc["discarded"] if d["reason"].startswith("filter_groups: every sample's reward was")]
        assert len(tied) == values.get("training/filter_groups/evicted_samples", 0), (step, doc)
        assert all(d["rewards"] and len(set(d["rewards"])) == 1 for d in tied), doc


@ASYNC_LANE
def test_separate_async_k2_with_warmup_is_recorded_then_replayed_call_by_call(workdir):
    """separate_async, K = 2 (parameter_sync_step) with verl's warm-up: verl's standalone rollout replica (hf_cpu
    on its own Ray "GPU" bundle, weights through the ray_store checkpoint engine), two sample calls per step,
    each stored as its own inner index and served to the same call on the replay (the recording is its baseline:
    that caching changes nothing verl trains, the colocate_async chain shows with an uncached run)."""
    work, _ = workdir
    runs = _chain(workdir, "separate", "separate_async", resume=False, uncached=False, K=2, warmup=1)
    assert runs["record"].generate_calls >= (STEPS + 1) * CALLS_PER_STEP, "the warm-up batch was not generated"
    assert sorted(runs["record"].metrics) == [1, 2]
    _replays_the_recording(runs["record"], runs["replay"], [1, 2])
    ns = work / "cache" / "separate_verl_cpu"
    namespaces = [p for p in ns.iterdir() if p.is_dir()]
    assert len(namespaces) == 1 and namespaces[0].name.endswith("_K2_W1"), namespaces
    for step in (1, 2):
        assert sorted(p.relative_to(namespaces[0] / str(step)).as_posix()
                      for p in (namespaces[0] / str(step)).rglob("tq_batch.pt")) == ["0/tq_batch.pt", "1/tq_batch.pt"]
