"""The README's promises: every example marked `# readme-example: NAME` runs exactly as written -- the
block's text saved to a file in a folder outside the clone and run with `python` in a subprocess, as
often as the README says -- and prints what the README says it prints; .ci/run runs the README's test
command."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TAG = re.compile(r"^# readme-example: ([\w-]+)$", re.M)
# The tagged examples this file checks, with the file name the README tells the reader to save each as
# (a new tagged example needs a check here: see the first test).
CHECKED = {"plain-dict": "plain_dict.py", "trl": "grpo_cached.py"}
# TRL's log-history keys that measure time: the only ones that may differ between a record and a replay.
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def examples() -> Dict[str, str]:
    found: Dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", README, flags=re.S):
        for name in TAG.findall(block):
            assert name not in found, f"two README examples are tagged {name}"
            found[name] = block
    return found


def run_example(name: str, tmp_path: Path, times: int, timeout: float = 300) -> List[subprocess.CompletedProcess]:
    """Save the example as written into a folder outside the clone and run it `times` times there, with
    the cache root in tmp_path (the examples use the default root: $SKIP_HARNESS_DUMP_DIR)."""
    folder = tmp_path / "my_project"
    folder.mkdir(exist_ok=True)
    assert ROOT not in folder.resolve().parents
    script = folder / CHECKED[name]
    script.write_text(examples()[name])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SKIP_HARNESS_DUMP_DIR")}
    env["SKIP_HARNESS_DUMP_DIR"] = str(tmp_path / "cache")
    procs = []
    for _ in range(times):
        proc = subprocess.run([sys.executable, script.name], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"{name}, run {len(procs) + 1}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        procs.append(proc)
    return procs


def test_every_tagged_readme_example_is_checked_here():
    assert set(examples()) == set(CHECKED)
    prose = " ".join(README.split())
    for file_name in CHECKED.values():   # the README says what to call the file and to run it twice
        assert f"Save this as `{file_name}` and run `python {file_name}` twice" in prose, file_name


@pytest.mark.slow  # two runs of the README's example in subprocesses
def test_plain_dict_example_runs_as_written_and_hits_on_the_second_run(tmp_path):
    first, again = run_example("plain-dict", tmp_path, times=2)
    assert [line.split() for line in first.stdout.splitlines()[:3]] == [
        [str(s), "miss", "(8,", "16)"] for s in (1, 2, 3)], first.stdout
    assert [line.split() for line in again.stdout.splitlines()[:3]] == [
        [str(s), "hit", "(8,", "16)"] for s in (1, 2, 3)], again.stdout
    # the printed summary is the run's summary line, not a dataclass's repr (issue 40)
    assert "rollout cache summary: 3 steps: 0 hits, 0 repeats, 3 misses (3 committed" in first.stdout, first.stdout
    assert "rollout cache summary: 3 steps: 3 hits, 0 repeats, 0 misses" in again.stdout, again.stdout
    assert "RunSummary(" not in first.stdout + again.stdout
    # the example says where its cache went: under the default root, named by experiment and project
    where = [line for line in first.stdout.splitlines() if line.startswith("cache:")]
    assert where and where[0].split(maxsplit=1)[1].startswith(str(tmp_path / "cache" / "my_run_demo")), first.stdout


@pytest.mark.slow  # runs the example in a subprocess
def test_an_example_saved_beside_a_clone_named_skip_harness_fails_as_the_readme_says(tmp_path):
    """The README warns that a script saved in the folder holding the clone imports the clone's folder
    instead of the package; the message it quotes must be the one Python gives."""
    quoted = "ImportError: cannot import name 'SkipHarness' from 'skip_harness' (unknown location)"
    assert quoted in README
    (tmp_path / "my_project" / "skip_harness" / "skip_harness").mkdir(parents=True)  # a clone, named as the repo
    with pytest.raises(AssertionError) as failed:
        run_example("plain-dict", tmp_path, times=1)
    assert quoted in str(failed.value)


def _without_timing(stdout: str) -> List[dict]:
    """TRL's printed log entries (one dict a line), less the keys that measure time."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("{'") and line.endswith("}"):
            entry = json.loads(line.replace("'", '"'))
            out.append({k: v for k, v in entry.items() if k not in TIMING})
    return out


@pytest.mark.slow
def test_trl_example_runs_as_written_and_replays(tmp_path):
    pytest.importorskip("trl")
    first, again = run_example("trl", tmp_path, times=2, timeout=600)
    # the printed summary: the run's summary line, ending with where the cache went (issue 40: a raw repr)
    (line,) = [x for x in first.stdout.splitlines() if x.startswith("rollout cache summary: ")]
    assert line.startswith("rollout cache summary: 4 steps: 0 hits, 0 repeats, 4 misses (4 committed"), line
    namespace = Path(line.rsplit("; cache in ", 1)[1])
    assert namespace.parent == tmp_path / "cache" / "grpo-readme_trl" and (namespace / "0").is_dir(), line
    assert "rollout cache summary: 4 steps: 4 hits, 0 repeats, 0 misses" in again.stdout, again.stdout
    assert "RunSummary(" not in first.stdout + again.stdout
    record, replay = _without_timing(first.stdout), _without_timing(again.stdout)
    assert len(record) == 5, first.stdout          # four steps, then train()'s totals
    assert record == replay                        # "its log history is the same, bit for bit"
    assert (tmp_path / "my_project" / "tiny_llama" / "config.json").exists()


def test_ci_runs_the_readmes_test_command():
    commands = re.findall(r"```bash\n(pip install [^\n]*)\n```", README)
    assert len(commands) == 2, commands  # one runs the main job, one passes the tests
    run_cmd, test_cmd = commands
    assert run_cmd.endswith("python scripts/train.py")
    assert test_cmd == "pip install torch==2.13.0 -e '.[dev,verl]' && python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0 -e '.[dev,verl]'" in ci
    assert "python -m pytest -q" in ci


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_and_docs_links_resolve():
    """Every relative link in README.md and docs/*.md names a file that is there (and a heading that is
    there, for `file.md#anchor`): the README sends readers to docs/ for what moved out of it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.relative_to(ROOT)}: no heading #{anchor} in {path}"
            checked += 1
    assert checked >= 8


def sweep_example() -> str:
    """The bash block of the README's "Sweep the training side" section."""
    section = README.split("## Sweep the training side", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]


@pytest.mark.slow  # a recording and a nine-job sweep of the demo in subprocesses
def test_sweep_the_training_side_example_runs_as_written_with_no_generation(tmp_path):
    """Issue 28, item 6: the example runs as written, from the root of a clone (scripts/ and conf/ as the
    clone has them), and every one of its nine jobs serves every step from the one recording."""
    import shutil

    clone = tmp_path / "clone"
    for folder in ("scripts", "conf"):
        shutil.copytree(ROOT / folder, clone / folder)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SKIP_HARNESS_DUMP_DIR", "HYDRA_FULL_ERROR")}
    env["SKIP_HARNESS_DUMP_DIR"] = str(tmp_path / "cache")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])   # `python`: this one
    proc = subprocess.run(["bash", "-e", "-c", sweep_example()], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    jobs = sorted((clone / "multirun").glob("*/*/metrics.jsonl"))
    assert len(jobs) == 9, jobs
    for job in jobs:
        rows = [json.loads(line) for line in job.read_text().splitlines()]
        assert [r["cache"] for r in rows] == ["hit"] * 3, job
    assert out.count("3 hits, 0 repeats, 0 misses") == 9, out[-6000:]
    for K in (1, 2, 8):
        assert f"served re-chunked from K=4 to K={K}" in out
        assert (f"replay: 3 of 3 served steps reproduced (2 values each); re-chunked from K=4 to K={K}: values "
                "recorded at K=4; approx_kl, clip_frac, grad_norm, loss not compared (they depend on K); "
                "response_len, reward_mean compared within rounding noise (32 x float32 eps)") in out
    # the lr=1e-2 jobs are compared with the lr=3e-3 job's values at their K (the recording's training side)
    diverged = [ln for ln in out.splitlines() if "rollout cache summary" in ln and "replay diverged" in ln]
    assert len(diverged) == 3, out[-6000:]
    assert all("training side changed: actor_rollout_ref.actor.optim.lr 0.003 -> 0.01" in ln for ln in diverged)
    readme = " ".join(README.split())
    assert "`step 3: hit, K=2, loaded 19.1 KiB in 0.01s, served re-chunked from K=4 to K=2`" in readme
    assert re.search(r"step 3: hit, K=2, loaded 19\.1 KiB in \d\.\d\ds, served re-chunked from K=4 to K=2", out)
