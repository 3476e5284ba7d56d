"""Kill -9 the demo at random moments of a K = 4 run, restart it, and check the cache and the metrics.

    python scripts/crash_test.py --trials 10 [--seed 0] [--json] [--keep DIR]

First one uninterrupted run gives the reference metrics and how long a run takes. Then each trial,
in a fresh cache directory:

1. starts `scripts/train.py trainer_mode=separate_async trainer.v1.separate_async.parameter_sync_step=4`
   (a small batch, a few steps) and SIGKILLs it: at a random moment of its training (drawn from the
   uninterrupted run's, counted from when this run locked its namespace), or (every other trial) at
   the first moment a cache file is being written (a temporary file is present) after a random
   number of steps has committed; a targeted run that ended before the probe saw a write runs again
   on a fresh cache (up to 3 attempts), so that a run of 4 trials kills mid-write at least once;
2. records whether the kill landed mid-write (temporary files left in the cache after the kill) and
   which steps it left incomplete;
3. `skip-harness verify` must pass (no corrupt step);
4. restarts the same run to the end: it must succeed, leave no temporary file, every step complete,
   hit every step the kill left complete, `skip-harness verify` must pass again, and its training
   metrics in `metrics.jsonl` (every key but timings `*_s` and `cache`) must equal the uninterrupted
   run's exactly.

Prints one line per trial and a summary (trials, kills, kills mid-write, failures); `--json` prints
the summary as one JSON document instead. Exit status 0 when no trial failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
TMP_PREFIX = ".tmp-"  # skip_harness.store.layout.TMP_PREFIX

log = logging.getLogger("crash_test")
_CHILDREN: List[subprocess.Popen] = []  # the run being killed, killed too if this script is stopped


def _stop(signum, frame):
    raise SystemExit(f"crash_test: stopped by signal {signum}")


def _kill_children() -> None:
    for proc in list(_CHILDREN):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()


def demo_overrides(steps: int, batch: int) -> List[str]:
    return [
        "trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=4",
        "trainer.progress=false",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=0",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=8",
        "data.max_response_length=10",
        "data.val_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.model.d_model=32",
        "actor_rollout_ref.model.n_layers=1",
    ]


def _env(cache: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("HYDRA_FULL_ERROR", None)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["SKIP_HARNESS_DUMP_DIR"] = str(cache)
    return env


def _train_cmd(run_dir: Path, cache: Path, overrides: List[str]) -> List[str]:
    return [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", f"skip.rollout_tq.dump_dir={cache}", *overrides]


def _skip_harness_cmd() -> List[str]:
    exe = shutil.which("skip-harness")
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; from skip_harness.cli import main; sys.exit(main())"]


def temporary_files(cache: Path) -> List[str]:
    """Temporary names anywhere under `cache` (a write that had not been renamed into place)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(cache):
        for name in dirnames + filenames:
            if name.startswith(TMP_PREFIX):
                found.append(os.path.relpath(os.path.join(dirpath, name), cache))
    return sorted(found)


def training_metrics(run_dir: Path) -> List[Dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "cache"} for r in rows]


def cache_outcomes(run_dir: Path) -> List[str]:
    return [json.loads(line)["cache"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _verify_in_process(cache: Path) -> Optional[tuple]:
    """`skip-harness verify CACHE --json` through the CLI's own entry point in this process (its
    imports cost seconds; a trial should not): (exit status, output), None if that is not possible."""
    try:
        from skip_harness.cli import main as cli_main
    except Exception:  # pragma: no cover - fall back to the installed command
        return None
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli_main(["verify", str(cache), "--json"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return int(code or 0), out.getvalue()


def _parse_json(text: str) -> Optional[dict]:
    start = text.find("{")
    if start < 0:
        return None
    try:
        doc, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def verify(cache: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """`skip-harness verify CACHE --json`: whether it passed, the status of every step, its output.
    A cache directory the run never created has nothing to verify: it passes."""
    if not cache.exists():
        return {"passed": True, "returncode": 0, "statuses": {}, "corrupt": [], "output": "no cache yet"}
    result = _verify_in_process(cache)
    doc = _parse_json(result[1]) if result is not None else None
    if doc is None:
        proc = subprocess.run([*_skip_harness_cmd(), "verify", str(cache), "--json"], capture_output=True,
                              text=True, env=env, timeout=300)
        result, doc = (proc.returncode, proc.stdout + proc.stderr), _parse_json(proc.stdout)
    code, output = result
    statuses: Dict[int, str] = {}
    for ns in (doc or {}).get("namespaces", []):
        for s in ns.get("steps", []):
            statuses[int(s["step"])] = s["status"]
    corrupt = sorted(s for s, st in statuses.items() if st == "corrupt")
    return {
        "passed": code == 0 and doc is not None and not corrupt,
        "returncode": code,
        "statuses": statuses,
        "corrupt": corrupt,
        "output": output[-2000:],
    }


@dataclass
class Trial:
    index: int
    targeted: bool
    kill_at_s: Optional[float] = None
    killed: bool = False
    mid_write: bool = False
    temporary_files: List[str] = field(default_factory=list)
    incomplete_after_kill: List[int] = field(default_factory=list)
    complete_after_kill: List[int] = field(default_factory=list)
    hits_on_restart: int = 0
    attempts: int = 1
    failures: List[str] = field(default_factory=list)


def _wait_for(pattern: str, cache: Path, proc: subprocess.Popen, t0: float, timeout: float = 600) -> Optional[float]:
    """Seconds from t0 until a path matching `pattern` exists under `cache`, None if the run ended first."""
    while time.monotonic() - t0 < timeout:
        if any(cache.glob(pattern)):
            return time.monotonic() - t0
        if proc.poll() is not None:
            return None
        time.sleep(0.003)
    return None


def reference_run(work: Path, overrides: List[str], steps: int) -> Dict[str, Any]:
    """The uninterrupted run: its training metrics, and when its writes start and end (the window
    the kills are drawn from)."""
    cache, run_dir = work / "reference-cache", work / "reference-run"
    env = _env(cache)
    t0 = time.monotonic()
    log_file = open(work / "reference.log", "w+")
    proc = subprocess.Popen(_train_cmd(run_dir, cache, overrides), env=env, cwd=work, stdout=log_file,
                            stderr=subprocess.STDOUT)
    ready = _wait_for("*/*/.lock.holder.json", cache, proc, t0)
    last = _wait_for(f"*/*/{steps}/commit.json", cache, proc, t0)
    proc.wait(timeout=600)
    total = time.monotonic() - t0
    log_file.seek(0)
    if proc.returncode != 0:
        raise SystemExit(f"crash_test: the uninterrupted run failed ({proc.returncode}):\n{log_file.read()[-4000:]}")
    log_file.close()
    ready = ready if ready is not None else 0.0
    return {"metrics": training_metrics(run_dir), "ready_s": ready, "last_commit_s": last or total, "total_s": total}


def _flip_a_byte(cache: Path) -> None:
    """--self-check: damage one committed payload, which verify must then report."""
    payload = sorted(cache.glob("*/*/1/*/tq_batch*.pt"))[0]
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))


TARGET_ATTEMPTS = 3  # a targeted trial whose run wrote its last file before the probe saw one runs again


def _start_and_kill(cache: Path, run_dir: Path, overrides: List[str], env: Dict[str, str], delay: float,
                    after_step: Optional[int]) -> tuple:
    """Start a run on `cache` and SIGKILL it: `delay` seconds after it locked its namespace or, when
    `after_step` is given (a targeted trial), at the first moment a cache file is being written once
    step `after_step` has committed (0: from the start). Returns (killed, seconds into training)."""
    proc = subprocess.Popen(_train_cmd(run_dir, cache, overrides), env=env, cwd=run_dir.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _CHILDREN.append(proc)
    try:
        ready = _wait_for("*/*/.lock.holder.json", cache, proc, time.monotonic())
        t0 = time.monotonic()
        if after_step is None:
            while ready is not None and proc.poll() is None and time.monotonic() - t0 < delay:
                time.sleep(0.002)
        else:
            if ready is not None and after_step > 0:
                _wait_for(f"*/*/{after_step}/commit.json", cache, proc, t0)
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline and not temporary_files(cache):
                pass
        killed = proc.poll() is None
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        at = round(time.monotonic() - t0, 3)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:   # this script stopped (SIGTERM -> SystemExit) while the run went on
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _CHILDREN.remove(proc)
    return killed, at


def run_trial(index: int, work: Path, overrides: List[str], ref: Dict[str, Any], rnd: random.Random,
              targeted: bool, self_check: bool = False) -> Trial:
    """A random trial kills at a moment drawn from the uninterrupted run's training window (namespace
    locked -> last commit), counted from when this run has locked its namespace, so a slow start (a
    loaded machine) does not push every kill into the startup. A targeted trial draws how many steps
    must have committed first and then kills at the first write the probe sees; the probe polls, so
    when it saw none before the run ended (a write lasts a millisecond or so) the trial runs again on a
    fresh cache, up to TARGET_ATTEMPTS times."""
    trial = Trial(index, targeted)
    cache = work / f"trial{index}-cache"
    env = _env(cache)
    window = max(ref["last_commit_s"] - ref["ready_s"], 0.1)
    steps = len(ref["metrics"])
    for attempt in range(1, (TARGET_ATTEMPTS if targeted else 1) + 1):
        shutil.rmtree(cache, ignore_errors=True)
        run_dir = work / f"trial{index}-killed" if attempt == 1 else work / f"trial{index}-killed-{attempt}"
        after_step = rnd.randrange(steps) if targeted else None
        trial.attempts = attempt
        delay = 0.0 if targeted else rnd.uniform(0.0, window)
        trial.killed, trial.kill_at_s = _start_and_kill(cache, run_dir, overrides, env, delay, after_step)
        if not targeted or (trial.killed and temporary_files(cache)):
            break

    trial.temporary_files = temporary_files(cache)
    trial.mid_write = bool(trial.temporary_files)
    after_kill = verify(cache, env)
    trial.incomplete_after_kill = sorted(s for s, st in after_kill["statuses"].items() if st == "incomplete")
    trial.complete_after_kill = sorted(s for s, st in after_kill["statuses"].items() if st == "complete")
    if not after_kill["passed"]:
        trial.failures.append(f"verify after the kill failed (exit {after_kill['returncode']}, corrupt steps "
                              f"{after_kill['corrupt']}): {after_kill['output']}")

    run_dir = work / f"trial{index}-restart"
    restart = subprocess.run(_train_cmd(run_dir, cache, overrides), env=env, cwd=work, capture_output=True,
                             text=True, timeout=600)
    if restart.returncode != 0:
        trial.failures.append(f"the restart failed ({restart.returncode}): {(restart.stdout + restart.stderr)[-3000:]}")
        return trial
    outcomes = cache_outcomes(run_dir)
    trial.hits_on_restart = outcomes.count("hit")
    if training_metrics(run_dir) != ref["metrics"]:
        trial.failures.append("the restart's training metrics differ from the uninterrupted run's")
    left = temporary_files(cache)
    if left:
        trial.failures.append(f"temporary files left after the restart: {left}")
    if self_check:
        _flip_a_byte(cache)
    after = verify(cache, env)
    if not after["passed"]:
        trial.failures.append(f"verify after the restart failed (corrupt {after['corrupt']}): {after['output']}")
    steps = len(ref["metrics"])
    complete = sorted(s for s, st in after["statuses"].items() if st == "complete")
    if complete != list(range(1, steps + 1)):
        trial.failures.append(f"after the restart the complete steps are {complete}, expected 1..{steps}")
    if trial.complete_after_kill and trial.hits_on_restart < len(trial.complete_after_kill):
        trial.failures.append(f"{len(trial.complete_after_kill)} steps were complete after the kill but the "
                              f"restart hit only {trial.hits_on_restart}")
    return trial


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--steps", type=int, default=6, help="trainer.total_training_steps of each run")
    parser.add_argument("--batch", type=int, default=64, help="data.train_batch_size (a multiple of 4)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    parser.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it")
    parser.add_argument("--self-check", action="store_true",
                        help="damage one committed payload after each restart: every trial must then fail "
                             "(shows that the checks can fail)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="crash_test: %(message)s", stream=sys.stderr)
    if args.trials < 1 or args.batch % 4:
        parser.error("--trials must be >= 1 and --batch a multiple of 4")

    signal.signal(signal.SIGTERM, _stop)  # so that the work directory is removed and no run is left behind
    work = Path(tempfile.mkdtemp(prefix="skip_harness_crash_")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    overrides = demo_overrides(args.steps, args.batch)
    rnd = random.Random(args.seed)
    try:
        ref = reference_run(work, overrides, args.steps)
        log.info("uninterrupted run: %d steps in %.1f s (namespace locked at %.1f s, last commit at %.1f s)",
                 len(ref["metrics"]), ref["total_s"], ref["ready_s"], ref["last_commit_s"])
        trials = []
        for i in range(args.trials):
            t = run_trial(i, work, overrides, ref, rnd, targeted=bool(i % 2), self_check=args.self_check)
            trials.append(t)
            log.info(
                "trial %d: %s %.2f s into training, %s, %d complete / %d incomplete steps after the kill, %d hits on restart: %s",
                i, "killed" if t.killed else "finished before the kill", t.kill_at_s or 0.0,
                ("mid-write" if t.mid_write else "not mid-write") + (f" (attempt {t.attempts})" if t.attempts > 1 else ""),
                len(t.complete_after_kill),
                len(t.incomplete_after_kill), t.hits_on_restart, "FAILED: " + "; ".join(t.failures) if t.failures else "ok",
            )
    finally:
        _kill_children()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    summary = {
        "trials": len(trials),
        "kills": sum(t.killed for t in trials),
        "kills_mid_write": sum(t.killed and t.mid_write for t in trials),
        "kills_leaving_incomplete_steps": sum(t.killed and bool(t.incomplete_after_kill) for t in trials),
        "failures": sum(bool(t.failures) for t in trials),
        "failed_trials": [{"trial": t.index, "why": t.failures} for t in trials if t.failures],
        "trial_details": [asdict(t) for t in trials],
    }
    print(json.dumps(summary, indent=1) if args.json else summary_line(summary))
    return 1 if summary["failures"] else 0


def summary_line(summary: Dict[str, Any]) -> str:
    """The one line printed without --json (tests/test_crash.py writes it for CI's log from the --json document)."""
    return (f"crash test: {summary['trials']} trials, {summary['kills']} kills ({summary['kills_mid_write']} mid-write, "
            f"{summary['kills_leaving_incomplete_steps']} leaving an incomplete step), {summary['failures']} failures")


if __name__ == "__main__":
    sys.exit(main())
