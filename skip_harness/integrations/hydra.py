"""Hydra callbacks: the startup before the task function, and a sweep that survives a failed job.

:class:`HydraStartupCallback` validates the whole config (the schema, every cross-field check and the
trainer's own, through ``validate``) in ``on_run_start``, before Hydra makes the run directory: a
config error stops a single run there with one message and exit status 2, and nothing is created
(no ``outputs/...`` folder, nothing in the cache). In ``on_job_start`` it takes the namespace lock,
scans and cleans, and hands the result to the harness of the job (:func:`startup.hand_over`); a
namespace another live run holds makes the job a reader of it (docs/design.md, "Many runs on one
namespace"). Any other exception in a Hydra callback only becomes a warning, so ``on_job_start``
never raises: an error is left to the task function, which stops with one clear message — before
anything touched the disk.

:class:`SweepReport` ends a multirun with one table of its jobs (each recorded its line with
:func:`record_job_summary`: overrides, hits / misses, the replay verdict in a few words, the last step's
values), logged and written to ``{sweep_dir}/sweep_summary.md``; ``.json`` holds every job's full record
(the replay sentence, a failed job's error). A job that stopped on its own cause (a fingerprint
mismatch, a config error) recorded it with :func:`record_job_failure` and returned, so the other jobs
still ran; at the end the sweep names every failed job and exits non-zero.
"""
from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from skip_harness.run.callbacks import LoggingCallback
from skip_harness.config import Action
from skip_harness.errors import ConfigError
from skip_harness.nodes import plain
from skip_harness.integrations.hydra_run import RunDirTakenError, claim_run_dir
from skip_harness.run.settings import RunSettings, from_verl_keys, hand_over as hand_over_settings, launched_world_size, take
from skip_harness.run.startup import StartupResult, hand_over, prepare_namespace, take_over

log = logging.getLogger("skip_harness")

FAILURE_FILE = "job_failed.json"
SUMMARY_FILE = "job_summary.json"          # each job's line of the sweep's table (record_job_summary)
SWEEP_TABLE = "sweep_summary"              # {sweep_dir}/sweep_summary.md and .json: the table of every job

# Set once Hydra composed the config and started a run or a sweep in this process (see `config_composed`).
_COMPOSED = threading.Event()


def note_config_composed() -> None:
    """Called by a task function (a config reached it), for apps whose config has no HydraStartupCallback."""
    _COMPOSED.set()


def config_composed() -> bool:
    """Whether Hydra got as far as starting a run or a sweep in this process. When it exits 1 before
    that, its error was in the command line or the config it composed (an unknown key, a bad override):
    a config error, which `scripts/train.py` turns into exit status 2 like its own config errors."""
    return _COMPOSED.is_set()


def _import(path: str) -> Callable[[Any], Any]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class HydraStartupCallback(Callback):
    """``validate``: dotted path of the trainer's own check of the whole config (raises ConfigError)."""

    def __init__(self, validate: Optional[str] = None) -> None:
        self._validate = validate
        self._held: Dict[int, StartupResult] = {}

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        """A single run: the config checked before Hydra makes the run directory. A ConfigError ends the
        process here (exit 2, nothing created); anything else is left to the task function."""
        _COMPOSED.set()
        task = _task_config(config) if self._validate else None
        if task is not None:
            try:
                checked = _import(self._validate)(task)   # type: ignore[arg-type]  # set when task is
                if isinstance(checked, RunSettings):
                    hand_over_settings(task, checked)   # resolved once: on_job_start and the task function take them
            except ConfigError as exc:
                log.error("%s (nothing was created: no run directory, nothing in the cache)", exc)
                sys.stderr.flush()
                raise SystemExit(2) from None  # not an Exception: Hydra would turn it into a warning
            except Exception as exc:  # noqa: BLE001 - the task function repeats the check and reports it
                log.debug("skip_harness config check deferred to the task function: %s", exc)
        _claim(config, "run")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _COMPOSED.set()  # each job's config is checked by its task function (the sweep goes on)
        _claim(config, "sweep")

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        task = _task_config(config)   # what the task function gets: no `hydra` node
        if task is None:
            return
        try:
            # the run's settings, resolved once here: what the trainer's check returns when it is the front
            # end's adapter (the demo's validate), else the verl-keyed adapter
            checked = (take(task) or _import(self._validate)(task)) if self._validate else None
            run = checked if isinstance(checked, RunSettings) else from_verl_keys(task)
            hand_over_settings(task, run)   # the task function takes them (demo.run.train, SkipHarness.from_config)
            settings = run.rollout
            if not settings.enable or settings.replay_from is not None or settings.action == Action.compare:
                return    # replay_from: the harness checks the recording first, and creates its own namespace lazily;
                # action=compare: the recording is only read (no lock, no cleanup)
            layout = run.namespace.with_world_size(launched_world_size()).layout(settings.resolved_dump_dir())
            result = prepare_namespace(layout, settings)   # waits lock_timeout s, then reads beside a holder
        except Exception as exc:  # the task function repeats the checks and reports properly
            log.debug("skip_harness startup deferred to the harness: %s", exc)
            return
        self._held[id(config)] = result
        report = LoggingCallback()  # the same lines the harness logs when it does the startup itself
        for path, reason in result.faults():
            report.on_fault(path=path, reason=reason)
        report.on_startup(namespace=str(layout.root), startup=result)
        hand_over(result)

    def on_job_end(self, config: Any, **kwargs: Any) -> None:  # type: ignore[override]  # job_return in kwargs
        result = self._held.pop(id(config), None)
        if result is not None and take_over(result.layout) is result:
            result.release()  # nobody took it over (the job stopped before its harness started)


def _claim(config: Any, mode: str) -> None:
    """The run (or sweep) directory held by this launch before Hydra writes anything there
    (`hydra_run.claim_run_dir`): another live run in it stops this one, exit 2."""
    try:
        named = OmegaConf.select(config, f"hydra.{mode}.dir", throw_on_missing=True)
    except Exception as exc:  # noqa: BLE001 - Hydra reports a directory it cannot name
        log.debug("skip_harness: the %s directory could not be claimed: %s", mode, exc)
        return
    if named is None:   # a config without a `hydra` node (composed by hand): no directory to hold, not `./None`
        return
    where = Path(str(named))
    try:
        claim_run_dir(where, key=f"hydra.{mode}.dir")
    except RunDirTakenError as exc:
        log.error("%s", exc)
        sys.stderr.flush()
        raise SystemExit(2) from None
    except (OSError, ImportError) as exc:   # no flock here (fcntl is POSIX's)
        log.debug("skip_harness: %s could not be claimed: %s", where, exc)


def _task_config(config: Any) -> Optional[DictConfig]:
    """The task function's config (without the `hydra` node), resolved; None when it cannot be resolved
    yet (an interpolation that needs the job's runtime, such as ${hydra:runtime.output_dir})."""
    try:
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            task.pop("hydra", None)
        plain(task)   # resolves every interpolation, or raises
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
        log.debug("skip_harness config check deferred to the task function: %s", exc)
        return None
    return task


def record_job_failure(exc: BaseException) -> bool:
    """In a multirun job: log `exc`, record it in the job's directory for :class:`SweepReport`, and return
    True (the job then returns normally, so the sweep goes on). False outside a multirun."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return False
        out = Path(hc.runtime.output_dir)
        record = {"job": hc.job.num, "overrides": list(hc.overrides.task), "error": str(exc),
                  "kind": type(exc).__name__}
    except Exception:  # not under Hydra
        return False
    log.error("%s", exc)
    out.mkdir(parents=True, exist_ok=True)
    (out / FAILURE_FILE).write_text(json.dumps(record) + "\n")
    return True


def record_job_summary(summary: Any, values: Optional[Dict[str, Any]] = None, run_id: Optional[str] = None,
                       step: Optional[int] = None) -> bool:
    """In a multirun job: record the job's line of the sweep's table (its hits and misses, the replay
    verdict in full (`replay`) and in a few words (`replay_short`), the values of its last step `step`,
    its run id) in the job's directory for :class:`SweepReport`. False outside a multirun."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return False
        out = Path(hc.runtime.output_dir)
        record = {"job": hc.job.num, "overrides": list(hc.overrides.task)}
    except Exception:  # not under Hydra
        return False
    record.update({
        "hits": int(getattr(summary, "hits", 0)), "repeats": int(getattr(summary, "repeats", 0)),
        "misses": int(getattr(summary, "misses", 0)), "committed": int(getattr(summary, "committed", 0)),
        "replay": str(getattr(summary, "replay_line", "") or ""),
        "replay_short": str(getattr(summary, "replay_short", "") or ""), "run_id": run_id, "values_step": step,
        "values": {str(k): v for k, v in (values or {}).items() if isinstance(v, (int, float, str, bool))},
    })
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_FILE).write_text(json.dumps(record) + "\n")
    return True


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _short_verdict(job: dict) -> str:
    """A job's replay verdict in a few words (`4/4 reproduced`, `diverged at 2: loss`; `recorded`: it
    served nothing and committed steps); the full sentence stays in the sweep's JSON (`replay`). A job recorded before `replay_short` existed: its sentence."""
    if "replay_short" in job:
        return job["replay_short"] or ("recorded" if job.get("committed") else "-")
    verdict = job.get("replay") or "-"
    return verdict[len("replay: "):] if verdict.startswith("replay: ") else verdict


def sweep_table(jobs: List[dict]) -> List[str]:
    """The sweep's table as Markdown lines: job, overrides (those that differ between its jobs), hits /
    misses, the replay verdict in a few words, the values of each job's last step. The full replay
    sentences and each job's error are in the sweep's JSON (`SweepReport`)."""
    keys: List[str] = []
    for j in jobs:
        for k in j.get("values", {}):
            if k not in keys:
                keys.append(k)
    lines = ["| job | overrides | hits / misses | replay |" + "".join(f" {k} (last step) |" for k in keys),
             "|" + "---|" * (4 + len(keys))]
    every = [set(j.get("overrides", [])) for j in jobs]
    common = set.intersection(*every) if len(every) > 1 else set()   # the sweep's own overrides are shown
    for j in sorted(jobs, key=lambda j: int(j["job"]) if str(j.get("job")).isdigit() else 0):
        if "error" in j:
            verdict, counts = f"failed: {j.get('kind') or 'error'} (below)", "-"
        else:
            counts = f"{j.get('hits', 0)} / {j.get('misses', 0)}"
            verdict = _short_verdict(j)
        vals = [_fmt(j.get("values", {}).get(k, "-")) for k in keys]
        lines.append("| " + " | ".join(_cell(c) for c in [j.get("job"), " ".join(o for o in j.get("overrides", []) if o not in common) or "-",
                                                            counts, verdict, *vals]) + " |")
    return lines


class SweepReport(Callback):
    """At the end of a multirun: one table of every job (job, overrides, hits / misses, replay verdict in
    a few words, last step's values), logged and written to `{sweep_dir}/sweep_summary.md`; every job's
    full record (the replay sentence, the error of a failed job) to `{sweep_dir}/sweep_summary.json`;
    then name the failed jobs and exit non-zero (after every job ran)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        failures: List[dict] = []
        for path in sorted(sweep_dir.glob(f"*/{FAILURE_FILE}")):
            try:
                failures.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                failures.append({"job": path.parent.name, "overrides": [], "error": f"unreadable {path}"})
        jobs: List[dict] = []
        for path in sorted(sweep_dir.glob(f"*/{SUMMARY_FILE}")):
            try:
                jobs.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        if jobs:
            self._table(sweep_dir, jobs + failures)
        if not failures:
            return
        for f in sorted(failures, key=lambda f: str(f.get("job"))):
            log.error("sweep job %s (%s) failed: %s", f.get("job"), " ".join(f.get("overrides", [])), f.get("error"))
        log.error("%d of the sweep's jobs failed (see above); the others ran", len(failures))
        sys.stdout.flush()
        raise SystemExit(1)  # not an Exception: Hydra does not turn it into a warning

    @staticmethod
    def _table(sweep_dir: Path, jobs: List[dict]) -> None:
        lines = sweep_table(jobs)
        log.info("sweep of %d jobs (%s; each job's full replay verdict: %s):\n%s", len(jobs),
                 sweep_dir / f"{SWEEP_TABLE}.md", sweep_dir / f"{SWEEP_TABLE}.json", "\n".join(lines))
        try:
            (sweep_dir / f"{SWEEP_TABLE}.md").write_text("\n".join(lines) + "\n")
            (sweep_dir / f"{SWEEP_TABLE}.json").write_text(json.dumps({"jobs": jobs}, indent=1) + "\n")
        except OSError as exc:
            log.warning("%s: could not write the sweep's table: %s", sweep_dir, exc)
