"""Issue 40, item "ls counts a recording's replays wherever they were made": a run replaying a recording
through `skip.rollout_tq.replay_from` keeps its values beside the recording's (`.values/runs/{run_id}/`),
where `skip-harness ls` counts them as the recording's replays, and leaves no namespace of its own unless it
had to generate a step the recording lacks (created then, at that step). In-process runs of the rig of
tests/reshard_rig.py (test_replay_from.run); `ls` through the real command-line entry point."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from skip_harness.cli import main
from s3server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)
from test_cache_states import read_only_view  # noqa: F401  (fixture)
from test_replay_from import replays_of, run, snapshot

REC = "rig_reshard/GBS8_N2_K4_W1"


def ls(capsys, dump) -> dict:
    capsys.readouterr()
    assert main(["ls", str(dump), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["namespaces"]
    return {str(Path(ns["path"]).relative_to(dump)): ns for ns in listed}


def test_a_sweep_over_k_is_counted_as_the_recordings_replays_and_leaves_no_namespace(tmp_path, capsys):
    run(tmp_path, 4, 3)
    source = tmp_path / REC
    for K in (1, 2, 2, 8):                       # a sweep over K (two jobs at K=2), replaying one recording
        _, summary, trainer = run(tmp_path, K, 3, replay_from=str(source))
        assert trainer.generated == 0 and summary.hits == 3
    listed = ls(capsys, tmp_path)
    assert list(listed) == [REC], listed        # no "ghost" namespace per K
    assert listed[REC]["replays"] == 4 and listed[REC]["counts"]["complete"] == 3, listed[REC]
    assert list(replays_of(source).values()) == [[1, 2, 3]] * 4
    docs = [json.loads((source / ".values" / "runs" / r / "run.json").read_text()) for r in listed[REC]["runs"]]
    assert sorted((d["K"], d["W"], d["replay_from"]) for d in docs) == [(K, 1, str(source)) for K in (1, 2, 2, 8)]


def test_a_step_the_recording_lacks_creates_the_runs_own_namespace_at_that_step(tmp_path, caplog, capsys):
    run(tmp_path, 4, 2)
    own = tmp_path / "rig_reshard" / "GBS8_N2_K2_W1"
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        served, summary, trainer = run(tmp_path, 2, 3, replay_from=str(tmp_path / REC))
    assert [served[s][0] for s in (1, 2, 3)] == ["hit", "hit", "miss"] and summary.committed == 1
    log = caplog.text
    assert f"rollout cache {own}: not created (this run replays" in log
    assert f"rollout cache {own}: created at step 3, a step the recording" in log
    assert log.index("step 2: hit") < log.index("created at step 3")
    listed = ls(capsys, tmp_path)
    assert sorted(listed) == ["rig_reshard/GBS8_N2_K2_W1", REC]
    assert listed[REC]["replays"] == 1 and listed["rig_reshard/GBS8_N2_K2_W1"]["replays"] == 0
    assert listed["rig_reshard/GBS8_N2_K2_W1"]["counts"]["complete"] == 1


def test_a_read_only_recording_serves_and_says_once_its_values_are_not_kept(tmp_path, read_only_view,  # noqa: F811
                                                                           caplog):
    rw, ro = read_only_view
    run(rw, 4, 2)
    before = snapshot(ro / REC)
    dump = tmp_path / "mine"
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        _, summary, trainer = run(dump, 2, 2, replay_from=str(ro / REC))
    assert trainer.generated == 0 and summary.hits == 2
    said = [r.getMessage() for r in caplog.records if "values are not kept" in r.getMessage()]
    assert len(said) == 1 and f"the recording {ro / REC} cannot be written" in said[0], said
    assert snapshot(ro / REC) == before and replays_of(ro / REC) == {}
    assert not dump.exists()                     # nothing of its own was created either


def test_a_recording_on_a_read_only_credential_says_once_its_replays_values_are_not_kept(
        tmp_path, s3_server, s3_bucket, s3_env, monkeypatch, caplog):  # noqa: F811
    url = f"s3://{s3_bucket}/cache"
    run(url, 4, 3)                               # recorded with the writer's credential
    before = s3_server.keys(s3_bucket)
    for k, v in s3_server.env("reader").items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        _, summary, trainer = run(tmp_path, 2, 3, replay_from=f"{url}/{REC}")
    assert trainer.generated == 0 and summary.hits == 3
    said = [r.getMessage() for r in caplog.records if "could not be kept beside the recording's" in r.getMessage()]
    assert len(said) == 1 and "they are not kept" in said[0], caplog.text
    assert s3_server.keys(s3_bucket) == before and not (tmp_path / "rig_reshard").exists()
