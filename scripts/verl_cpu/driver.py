"""Run ``python -m verl.trainer.main_ppo`` on CPU in a subprocess and read back what it did: verl's logged
metrics (its ``file`` logger), the rollout backend's ``generate`` calls, the plug-in's log lines."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from verl_cpu import recipe

log = logging.getLogger("verl_cpu")

# verl's keys that measure time or the machine, never the training: left out of comparisons
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")


@dataclass
class Run:
    name: str
    returncode: int
    wall_s: float
    generate_calls: int
    metrics: Dict[int, Dict[str, float]] = field(default_factory=dict)
    output: str = ""

    def lines(self, needle: str) -> List[str]:
        return [line for line in self.output.splitlines() if needle in line]


def comparable(metrics: Dict[int, Dict[str, float]]) -> Dict[int, Dict[str, float]]:
    return {step: {k: v for k, v in data.items() if not any(p in k for p in VOLATILE)}
            for step, data in metrics.items()}


def differences(a: Dict[int, Dict[str, float]], b: Dict[int, Dict[str, float]], steps: Sequence[int],
                rel_tol: float = 0.0) -> List[str]:
    """Every (step, key) whose logged value differs between two runs, timing keys aside; with `rel_tol`,
    floats within that relative distance count as equal (integers, counts and missing keys never do)."""
    import math

    a, b = comparable(a), comparable(b)
    out = []
    for step in steps:
        x, y = a.get(step, {}), b.get(step, {})
        for key in sorted(set(x) | set(y)):
            u, v = x.get(key), y.get(key)
            if u == v:
                continue
            if rel_tol and isinstance(u, float) and isinstance(v, float) and math.isclose(u, v, rel_tol=rel_tol):
                continue
            out.append(f"step {step} {key}: {u!r} != {v!r}")
    return out


def read_metrics(path: Path) -> Dict[int, Dict[str, float]]:
    metrics: Dict[int, Dict[str, float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                metrics[int(record["step"])] = record["data"]
    return metrics


def count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def main_ppo(workdir: Path, name: str, paths: Dict[str, str], *, dump_dir: Optional[Path], steps: int = 3,
             mode: str = "sync", extra: Sequence[str] = (), kill_when: Optional[Callable[[Path], bool]] = None,
             timeout_s: float = 900, env_extra: Optional[Dict[str, str]] = None, **overrides_kwargs) -> Run:
    """One ``main_ppo`` run. With `dump_dir`, the plug-in caches every step there; without, caching is off.
    `kill_when(generate_log)` is polled; when it returns True the whole run (driver, Ray, workers: its
    session) is SIGKILLed. A run Ray failed to start because a port it picked was taken (two Ray clusters
    starting at once on one host, as the test suite's two workers do: `address already in use`) is run
    again, once, with a WARNING, when it trained no step and generated nothing; any other failure is returned
    as it is."""
    run = _main_ppo(workdir, name, paths, dump_dir=dump_dir, steps=steps, mode=mode, extra=extra,
                    kill_when=kill_when, timeout_s=timeout_s, env_extra=env_extra, **overrides_kwargs)
    # only a run that trained no step and generated nothing: one that got further is never run over again
    if run.returncode != 0 and kill_when is None and PORT_TAKEN in run.output and not run.metrics and run.generate_calls == 0:
        log.warning("main_ppo run %s: Ray found a port taken (%s); running it again", name, PORT_TAKEN)
        run = _main_ppo(workdir, name, paths, dump_dir=dump_dir, steps=steps, mode=mode, extra=extra,
                        kill_when=kill_when, timeout_s=timeout_s, env_extra=env_extra, **overrides_kwargs)
    return run


PORT_TAKEN = "address already in use"


def _main_ppo(workdir: Path, name: str, paths: Dict[str, str], *, dump_dir: Optional[Path], steps: int,
              mode: str, extra: Sequence[str], kill_when: Optional[Callable[[Path], bool]], timeout_s: float,
              env_extra: Optional[Dict[str, str]], **overrides_kwargs) -> Run:
    workdir = Path(workdir)
    gen_log = workdir / f"{name}.generate"
    metrics_path = workdir / f"{name}.metrics.jsonl"
    for p in (gen_log, metrics_path):
        p.unlink(missing_ok=True)
    args = recipe.overrides(paths, steps=steps, mode=mode, **overrides_kwargs)
    args.append(f"+actor_rollout_ref.rollout.custom.generate_log={gen_log}")
    if dump_dir is not None:
        args += ["skip.rollout_tq.enable=true", f"skip.rollout_tq.dump_dir={dump_dir}",
                 f"skip.rollout_tq.steps=[{','.join(str(s) for s in range(1, steps + 1))}]"]
    args += list(extra)
    env = recipe.environment()
    env["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    if overrides_kwargs.get("seed") is not None:
        # deterministic generation (hf_cpu's custom.seed) and prompt uids (verl_cpu._seed_prompt_uids)
        env["VERL_CPU_SEED"] = str(overrides_kwargs["seed"])
        env["PYTHONHASHSEED"] = "0"
    if mode == "separate_async":
        # verl 0.9.1 bug: with hybrid_engine=false, trainer_separate_async.py:181 calls logger.info(..., flush=True),
        # a TypeError whenever INFO is on; verl's loggers read their level from VERL_LOGGING_LEVEL
        env["VERL_LOGGING_LEVEL"] = "WARN"
    env.update(env_extra or {})
    out_path = workdir / f"{name}.log"
    start = time.monotonic()
    with open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *args], cwd=workdir, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        poll_s = 0.002 if kill_when is not None else 0.2   # a kill aims at a window of milliseconds
        try:
            while True:
                try:
                    proc.wait(timeout=poll_s)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if kill_when is not None and kill_when(gen_log):
                    _kill_session(proc)
                    break
                if time.monotonic() - start > timeout_s:
                    _kill_session(proc)
                    raise TimeoutError(f"main_ppo run {name} took over {timeout_s} s; see {out_path}")
        finally:
            if proc.poll() is None:
                _kill_session(proc)
    wall = time.monotonic() - start
    return Run(name, proc.returncode, wall, count_lines(gen_log), read_metrics(metrics_path), out_path.read_text())


def _kill_session(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGKILL the whole run and return once every process of it is gone. The run is its session, not its
    process group: Ray gives each worker (the TaskRunner that holds the cache among them) a process group
    of its own, so a `killpg` of the driver's group left them alive, writing (a commit record, say) after
    the caller had looked at what the kill left behind."""
    deadline = time.monotonic() + timeout_s
    os.killpg(proc.pid, signal.SIGKILL)
    while alive := _alive_in_session(proc.pid):
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {alive} of the killed run (session {proc.pid}) outlived SIGKILL "
                               f"by {timeout_s} s")
        time.sleep(0.01)
    proc.wait(timeout_s)


def _alive_in_session(sid: int) -> List[int]:
    """The processes (zombies aside) of session `sid`, read from /proc (Linux; elsewhere none)."""
    alive: List[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return alive
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:   # gone meanwhile
            continue
        state, _ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state not in ("Z", "X"):
            alive.append(int(entry))
    return alive
