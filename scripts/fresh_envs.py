"""Each extra installed alone into a new virtualenv, and its documented example (or a smoke of it) run there.

    python scripts/fresh_envs.py [--extras base,trl,...] [--workdir DIR] [--keep]

CI's environment holds `[dev,verl]`, whose packages hide a dependency an extra forgot (TRL 1.12 imports
`requests` without declaring it; `moto[server]` in `[dev]` brings it). Here every extra gets a fresh
virtualenv made by `uv` (installed beside this Python: `pip install uv`) from the same package sources
pip is configured with (`pip config list`: find-links, extra indexes, constraints) plus torch (the
`--torch` requirement, 2.13.0 by default: the CPU wheel where the local wheel folder holds one), then
`-e '.[EXTRA]'` as the README says; nothing else. Then, in that environment, from a folder outside the clone:

- base: the README's plain-dict example twice (the second run hits) and `skip-harness ls` (the demo,
  `scripts/train.py`, runs in the plot and sweep environments);
- trl: `from trl import GRPOTrainer`, then the README's TRL example as written (4 steps);
- verl: `import verl` with the plug-in named in VERL_USE_EXTERNAL_MODULES (verl imports it), the plug-in's
  modules and `verl.trainer.main_ppo`;
- view: `skip-harness view` on a tiny cache and a GET of its first page (it lists the namespace);
- s3: the plain-dict example twice against a moto S3 server (`dump_dir` s3://): the server runs from THIS
  Python (moto is a [dev] package, not [s3]'s), the client side is only what [s3] installs;
- export: `skip-harness export` of a tiny cache to Parquet, read back with pandas;
- plot: a 2-step `scripts/train.py`, then `scripts/plot.py` on its run directory;
- sweep: `scripts/train.py -m hydra/launcher=joblib` with two 1-step jobs;
- dev: `ruff check` and `mypy` (pyproject's files) clean without verl or any other extra beside [dev].

Each extra's lines start with `[EXTRA]`; a failure names the extra and the command, and the table at the
end gives each extra's install and smoke seconds. Exit status 1 when an extra failed, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ("base", "trl", "verl", "view", "s3", "export", "plot", "sweep", "dev")
HOST = "127.0.0.1"
# the tiny demo (a copy of skip_harness.demo.TINY_OVERRIDES, as the tests run it): a smoke, not a measurement
TINY = ("trainer.progress=false", "trainer.test_freq=0", "data.train_batch_size=8", "data.max_prompt_length=6",
        "data.max_response_length=6", "data.val_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.model.d_model=32", "actor_rollout_ref.model.n_layers=1")


class SmokeFailed(Exception):
    """One command of an extra's smoke failed; the message names the command and shows its output."""


@dataclass
class Outcome:
    extra: str
    install_s: float = 0.0
    smoke_s: float = 0.0
    error: str = ""
    commands: List[str] = field(default_factory=list)


def say(extra: str, text: str) -> None:
    for line in text.rstrip("\n").splitlines():
        print(f"[{extra}] {line}", flush=True)


def readme_example(name: str) -> str:
    """The README's ```python block tagged `# readme-example: NAME`, as written."""
    text = (REPO / "README.md").read_text()
    tag = f"# readme-example: {name}\n"
    for block in text.split("```python\n")[1:]:
        body = block.split("```", 1)[0]
        if body.startswith(tag) or f"\n{tag}" in body:
            return body
    raise SystemExit(f"README.md has no ```python block tagged `# readme-example: {name}`")


def pip_sources() -> List[str]:
    """uv options for the package sources pip is configured with here (find-links, index URLs, constraints)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    options: List[str] = []
    seen = set()
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.split(".")[-1]
        for item in value.strip().strip("'\"").split():
            flag = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
                    "constraint": "--constraint"}.get(name)
            if flag and (flag, item) not in seen:
                seen.add((flag, item))
                options += [flag, item]
    if any(flag == "--extra-index-url" for flag, _ in seen) and not any(flag == "--index-url" for flag, _ in seen):
        options += ["--index-url", "https://pypi.org/simple"]
    # the local indexes hold some releases of some packages: pick the best version over all sources
    return options + ["--index-strategy", "unsafe-best-match"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return bytes(reply.read())
        except OSError as exc:
            if proc.poll() is not None:
                raise SmokeFailed(f"the server exited with status {proc.returncode} before answering {url}") from exc
            if time.monotonic() > deadline:
                raise SmokeFailed(f"no answer from {url} within {timeout:.0f} s: {exc}") from exc
            time.sleep(0.3)


class Env:
    """One fresh virtualenv and the folder outside the clone its smoke runs in."""

    def __init__(self, extra: str, root: Path, outcome: Outcome) -> None:
        self.extra = extra
        self.dir = root / extra
        self.venv = self.dir / "venv"
        self.work = self.dir / "my_project"   # the user's folder: outside the clone
        self.cache = self.dir / "cache"
        self.outcome = outcome
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "SKIP_HARNESS_DUMP_DIR")}
        self.env.update({"SKIP_HARNESS_DUMP_DIR": str(self.cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                         "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                         "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"})

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def run(self, argv: Sequence[object], *, timeout: float = 600, env: Optional[Dict[str, str]] = None,
            cwd: Optional[Path] = None, expect: Optional[str] = None) -> str:
        shown = " ".join(shlex.quote(str(a)) for a in argv)
        self.outcome.commands.append(shown)
        say(self.extra, f"$ {shown}")
        try:
            proc = subprocess.run([str(a) for a in argv], cwd=cwd or self.work, env={**self.env, **(env or {})},
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise SmokeFailed(f"`{shown}` ran past {timeout:.0f} s") from exc
        if proc.returncode != 0:
            raise SmokeFailed(f"`{shown}` exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        if expect is not None and expect not in proc.stdout:
            raise SmokeFailed(f"`{shown}` did not print {expect!r}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return proc.stdout

    def example(self, name: str, file_name: str, *, times: int = 1, env: Optional[Dict[str, str]] = None,
                expect: Sequence[str] = ()) -> None:
        script = self.work / file_name
        script.write_text(readme_example(name))
        for i in range(times):
            out = self.run([self.python, file_name], env=env, expect=expect[i] if i < len(expect) else None)
            say(self.extra, "  " + " | ".join(out.strip().splitlines()[-2:]))

    def train(self, *overrides: str) -> Path:
        """`scripts/train.py`, a short run of the tiny demo (what the tests run); returns its Hydra run directory."""
        run_dir = self.dir / "run"
        self.run([self.python, REPO / "scripts" / "train.py", *TINY, "trainer.total_training_steps=2",
                  f"hydra.run.dir={run_dir}", *overrides], timeout=600)
        return run_dir


# --------------------------------------------------------------------------- the smokes, one per extra
def smoke_base(e: Env) -> None:
    e.example("plain-dict", "plain_dict.py", times=2, expect=("3 misses", "3 hits"))
    e.run(["skip-harness", "ls"], expect="my_run_demo")


def smoke_trl(e: Env) -> None:
    e.run([e.python, "-c", "import trl; from trl import GRPOTrainer; print('TRL', trl.__version__)"], expect="TRL")
    e.example("trl", "grpo_cached.py", expect=("4 misses",))


def smoke_verl(e: Env) -> None:
    e.run([e.python, "-c", "import verl, skip_harness.integrations.verl, skip_harness.integrations.verl_tq, "
           "skip_harness.integrations.verl_values, transfer_queue, verl.trainer.main_ppo; print('verl', verl.__version__)"],
          env={"VERL_USE_EXTERNAL_MODULES": "skip_harness.integrations.verl"}, expect="verl")


def stop(proc: subprocess.Popen) -> None:
    """A server this script started: terminated, killed if it does not end within 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def smoke_view(e: Env) -> None:
    e.example("plain-dict", "plain_dict.py")
    port = free_port()
    argv = ["skip-harness", "view", str(e.cache), "--host", HOST, "--port", str(port)]
    e.outcome.commands.append(" ".join(argv))
    say(e.extra, "$ " + " ".join(argv) + " &")
    log = e.dir / "view.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=e.work, env=e.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            page = wait_http(f"http://{HOST}:{port}/", proc).decode()
        except SmokeFailed as exc:
            raise SmokeFailed(f"{exc}\n{log.read_text()[-3000:]}") from exc
        if "my_run_demo" not in page:
            raise SmokeFailed(f"the viewer's first page does not list the namespace my_run_demo:\n{page[:2000]}")
        say(e.extra, f"  GET / -> {len(page)} characters, lists my_run_demo")
    finally:
        stop(proc)


def smoke_s3(e: Env) -> None:
    try:
        import moto  # noqa: F401 - the server side only: a [dev] package of the Python running this script
    except ImportError as exc:
        raise SmokeFailed(f"the [s3] smoke needs moto in the Python running this script ({sys.executable}): "
                          "install '.[dev]' there") from exc
    port = free_port()
    log = e.dir / "moto.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "moto_server.py"), "-H", HOST, "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://{HOST}:{port}"
    try:
        wait_http(f"{endpoint}/moto-api/", server)
        with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/fresh-envs", method="PUT"), timeout=10):
            pass
        say(e.extra, f"  moto S3 server on {endpoint} (from {sys.executable}), bucket fresh-envs")
        aws = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
               "SKIP_HARNESS_DUMP_DIR": "s3://fresh-envs/cache"}
        e.example("plain-dict", "plain_dict.py", times=2, env=aws, expect=("3 misses", "3 hits"))
    finally:
        stop(server)


def smoke_export(e: Env) -> None:
    e.example("plain-dict", "plain_dict.py")
    e.run(["skip-harness", "export", str(e.cache), "-o", "rollouts.parquet"])
    e.run([e.python, "-c", "import pandas; df = pandas.read_parquet('rollouts.parquet'); "
           "assert len(df) == 24, len(df); print('rows', len(df), 'columns', len(df.columns))"], expect="rows 24")


def smoke_plot(e: Env) -> None:
    run_dir = e.train()
    e.run([e.python, REPO / "scripts" / "plot.py", run_dir, "-o", "plot.png"])
    if not (e.work / "plot.png").stat().st_size:
        raise SmokeFailed("scripts/plot.py wrote an empty plot.png")


def smoke_sweep(e: Env) -> None:
    e.run([e.python, REPO / "scripts" / "train.py", "-m", *TINY, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
           "trainer.total_training_steps=1", "seed=0,1", f"hydra.sweep.dir={e.dir / 'multirun'}"], timeout=600)
    found = sorted(str(p.relative_to(e.dir)) for p in (e.dir / "multirun").rglob("metrics.jsonl"))
    if len(found) != 2:
        raise SmokeFailed(f"the 2-job sweep left {len(found)} metrics.jsonl: {found}")
    say(e.extra, "  " + ", ".join(found))


def smoke_dev(e: Env) -> None:
    """ruff and mypy hold in a [dev]-only install (no verl): the types must not depend on other extras."""
    e.run([e.python, "-m", "ruff", "check", "--no-cache", "skip_harness", "scripts"], cwd=REPO)
    e.run([e.python, "-m", "mypy", "--cache-dir", e.dir / "mypy_cache"], cwd=REPO, expect="Success")


SMOKES: Dict[str, Callable[[Env], None]] = {
    "base": smoke_base, "trl": smoke_trl, "verl": smoke_verl, "view": smoke_view, "s3": smoke_s3,
    "export": smoke_export, "plot": smoke_plot, "sweep": smoke_sweep, "dev": smoke_dev,
}


def one_extra(extra: str, root: Path, uv: List[str], sources: List[str], torch_req: str) -> Outcome:
    outcome = Outcome(extra)
    e = Env(extra, root, outcome)
    shutil.rmtree(e.dir, ignore_errors=True)
    e.work.mkdir(parents=True)
    target = str(REPO) if extra == "base" else f"{REPO}[{extra}]"
    t0 = time.monotonic()
    try:
        e.run([*uv, "venv", "--quiet", "--python", sys.executable, e.venv], cwd=e.dir)
        e.run([*uv, "pip", "install", "--quiet", "--python", e.python, *sources, torch_req, "-e", target], cwd=e.dir)
    except SmokeFailed as exc:
        outcome.install_s = time.monotonic() - t0
        outcome.error = f"install failed: {exc}"
        return outcome
    outcome.install_s = time.monotonic() - t0
    say(extra, f"installed in {outcome.install_s:.1f} s")
    t0 = time.monotonic()
    try:
        SMOKES[extra](e)
    except SmokeFailed as exc:
        outcome.error = str(exc)
    outcome.smoke_s = time.monotonic() - t0
    return outcome


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default=",".join(EXTRAS), help=f"comma-separated, of {', '.join(EXTRAS)}")
    parser.add_argument("--workdir", type=Path, default=None, help="where the environments go (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the environments (default: removed at the end)")
    parser.add_argument("--jobs", type=int, default=2, help="extras at a time (default 2; lines carry their [extra])")
    parser.add_argument("--torch", default="torch==2.13.0", help="the torch requirement installed with every extra")
    args = parser.parse_args(argv)
    extras = [x.strip() for x in args.extras.split(",") if x.strip()]
    unknown = [x for x in extras if x not in EXTRAS]
    if unknown:
        print(f"error: --extras: unknown {', '.join(unknown)} (choose from {', '.join(EXTRAS)})", file=sys.stderr)
        return 2
    uv_bin = shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if uv_bin is None:
        print(f"error: uv not found beside {sys.executable} nor on PATH: pip install uv", file=sys.stderr)
        return 2
    torch_req = args.torch
    if torch_req == "torch==2.13.0" and any(Path(d).glob("torch-2.13.0+cpu-*.whl") for d in ("/opt/wheels",)):
        torch_req = "torch==2.13.0+cpu"   # the local CPU wheel, as pip picks it here (uv would prefer the CUDA one)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="fresh_envs_"))
    root.mkdir(parents=True, exist_ok=True)
    sources = pip_sources()
    print(f"== fresh environments under {root}: {', '.join(extras)}; uv {uv_bin}; {torch_req}; "
          f"sources {' '.join(sources)}", flush=True)
    results: List[Outcome] = []
    t_all = time.monotonic()

    def one(extra: str) -> Outcome:
        print(f"== [{extra}] a fresh virtualenv with {'the package alone' if extra == 'base' else f'.[{extra}]'}",
              flush=True)
        outcome = one_extra(extra, root, [uv_bin], sources, torch_req)
        if outcome.error:
            say(extra, f"FAILED: extra [{extra}] installed alone: {outcome.error}")
        else:
            say(extra, f"ok: install {outcome.install_s:.1f} s, smoke {outcome.smoke_s:.1f} s")
        return outcome

    try:   # --jobs extras at a time: one installs (network, disk) while another's example runs (CPU)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(one, extras))
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    total = time.monotonic() - t_all
    print(f"{'extra':<8} {'install s':>10} {'smoke s':>8}  result")
    for r in results:
        print(f"{r.extra:<8} {r.install_s:>10.1f} {r.smoke_s:>8.1f}  {'FAILED' if r.error else 'ok'}")
    print(f"total {total:.1f} s")
    failed = [r.extra for r in results if r.error]
    if failed:
        print(f"error: fresh environments failed for extra(s): {', '.join(f'[{x}]' for x in failed)}", file=sys.stderr)
        print(json.dumps({r.extra: r.error.splitlines()[0] for r in results if r.error}, indent=1), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
