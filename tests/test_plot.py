"""End-to-end: scripts/plot.py run as a user runs it, in real subprocesses, on real files (real Hydra
sweeps of scripts/train.py), plus runs reached through symlinks."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# one xdist worker runs this file, so its module fixture is built once (.ci/run: -n 2 --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_plot")

ROOT = Path(__file__).resolve().parents[1]
PLOT = ROOT / "scripts" / "plot.py"
TRAIN = ROOT / "scripts" / "train.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def load_script(name: str):
    """Import scripts/<name>.py as a module (registered, so its dataclasses resolve their module)."""
    mod_name = f"_skip_harness_script_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def env_for(tmp: Path) -> dict:
    env = dict(os.environ)
    env["SKIP_HARNESS_DUMP_DIR"] = str(tmp / "cache")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run(cmd, tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, cmd)], cwd=tmp, env=env_for(tmp), capture_output=True,
                          text=True, timeout=timeout)


def assert_png(path: Path, min_bytes: int = 20_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) >= min_bytes, f"{path} is only {len(data)} bytes"


def make_sweep(tmp: Path, name: str) -> Path:
    sweep = tmp / name
    proc = run(
        [TRAIN, "-m", "trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1,2",
         "trainer.total_training_steps=2", "trainer.progress=false", "data.train_batch_size=8",
         "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=6", "data.max_response_length=6",
         "actor_rollout_ref.model.d_model=32", "actor_rollout_ref.model.n_layers=1", f"hydra.sweep.dir={sweep}"],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr
    return sweep


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Two real sweeps over K = 1, 2 sharing one cache: 'first' generates, 'again' hits every step."""
    tmp = tmp_path_factory.mktemp("plot")
    first = make_sweep(tmp, "runs/first")
    again = make_sweep(tmp, "runs/again")
    return tmp, first, again


@pytest.mark.slow
def test_plot_draws_a_sweep(sweeps):
    tmp, first, _ = sweeps
    out = tmp / "out" / "sweep.png"
    proc = run([PLOT, first, "-o", out], tmp)
    assert proc.returncode == 0, proc.stderr
    assert_png(out)
    assert "separate_async K=1" in proc.stderr and "separate_async K=2" in proc.stderr
    runs = load_script("plot").find_runs(first)
    assert [r.label for r in runs] == ["separate_async K=1", "separate_async K=2"]
    assert [len(r.rows) for r in runs] == [2, 2]
    assert not any(any(r.served) for r in runs)


@pytest.mark.slow
def test_plot_draws_one_run_directory(sweeps):
    tmp, first, _ = sweeps
    run_dir = next(p for p in first.iterdir() if p.name.endswith("K2"))
    out = tmp / "one.png"
    proc = run([PLOT, run_dir, "-o", out], tmp)
    assert proc.returncode == 0, proc.stderr
    assert_png(out)
    assert [r.label for r in load_script("plot").find_runs(run_dir)] == ["separate_async K=2"]


@pytest.mark.slow
def test_plot_marks_steps_served_from_the_cache(sweeps):
    tmp, first, again = sweeps
    runs = load_script("plot").find_runs(first.parent)
    labels = {r.label: r for r in runs}
    assert set(labels) == {f"separate_async K={k} ({name})" for k in (1, 2) for name in ("first", "again")}
    for k in (1, 2):
        assert labels[f"separate_async K={k} (again)"].served == [True, True]
        assert labels[f"separate_async K={k} (first)"].served == [False, False]
    out = tmp / "both.png"
    proc = run([PLOT, first.parent, "-o", out], tmp)
    assert proc.returncode == 0, proc.stderr
    assert_png(out)


@pytest.mark.slow
def test_plot_labels_a_run_without_hydra_config_by_its_directory(tmp_path):
    run_dir = tmp_path / "my_run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "cache": "miss", "gen_s": 0.1, "step_s": 0.3, "loss": 1.0 / s,
                            "reward_mean": 0.1 * s}) + "\n" for s in (1, 2, 3))
    )
    assert [r.label for r in load_script("plot").find_runs(tmp_path)] == ["my_run"]
    proc = run([PLOT, tmp_path, "-o", tmp_path / "p.png"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_png(tmp_path / "p.png", min_bytes=10_000)


def test_plot_adds_the_seed_when_runs_differ_in_it(tmp_path):
    for seed in (0, 1):
        run_dir = tmp_path / f"run{seed}"
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "config.yaml").write_text(
            f"seed: {seed}\ntrainer:\n  v1:\n    trainer_mode: colocate_async\n"
            "    separate_async:\n      parameter_sync_step: 4\n"
        )
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "cache": "hit", "loss": 0.5}) + "\n")
    runs = load_script("plot").find_runs(tmp_path)
    assert [r.label for r in runs] == ["colocate_async K=1 seed=0", "colocate_async K=1 seed=1"]
    assert [r.served for r in runs] == [[True], [True]]


@pytest.mark.slow
def test_plot_bad_input_exits_2_naming_the_path(tmp_path, sweeps):
    _, first, _ = sweeps
    missing = tmp_path / "no_such_dir"
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    shutil.copytree(sorted(p for p in first.iterdir() if p.is_dir())[0], broken / "run")
    with open(broken / "run" / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    bad_line = str(broken / "run" / "metrics.jsonl") + ":3"
    for target, needle in ((missing, str(missing)), (empty, str(empty)), (broken, bad_line)):
        proc = run([PLOT, target, "-o", tmp_path / "x.png"], tmp_path)
        assert proc.returncode == 2, (target, proc.stderr)
        assert needle in proc.stderr, (needle, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "x.png").exists()



def write_run(run_dir: Path, cache_values, mode="separate_async", K=2) -> Path:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(
        f"seed: 0\ntrainer:\n  v1:\n    trainer_mode: {mode}\n    separate_async:\n      parameter_sync_step: {K}\n")
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "cache": c, "gen_s": 0.0 if c in ("hit", "repeat") else 0.2, "step_s": 0.3,
                    "loss": 1.0 / s, "reward_mean": 0.1 * s}) + "\n" for s, c in enumerate(cache_values, 1)))
    return run_dir


def test_plot_follows_runs_that_are_symlinks_once_each(tmp_path):
    store = tmp_path / "elsewhere"
    write_run(store / "a", ["miss", "miss", "off"], K=1)
    write_run(store / "b", ["hit", "repeat", "miss"], K=2)
    folder = tmp_path / "compare"
    folder.mkdir()
    (folder / "first").symlink_to(store / "a", target_is_directory=True)
    (folder / "rerun").symlink_to(store / "b", target_is_directory=True)
    (folder / "loop").symlink_to(folder, target_is_directory=True)        # a cycle must not hang or repeat runs
    runs = load_script("plot").find_runs(folder)
    assert [(r.label, r.name) for r in runs] == [("separate_async K=1", "first"), ("separate_async K=2", "rerun")]
    assert [r.served for r in runs] == [[False, False, False], [True, True, False]]


@pytest.mark.slow
def test_plot_draws_a_folder_of_symlinked_runs_and_says_what_the_cache_served(tmp_path):
    store = tmp_path / "elsewhere"
    write_run(store / "a", ["miss"] * 10, K=1)
    write_run(store / "b", ["hit"] * 8 + ["miss"] * 2, K=2)
    folder = tmp_path / "compare"
    folder.mkdir()
    for name in ("a", "b"):
        (folder / name).symlink_to(store / name, target_is_directory=True)
    out = tmp_path / "p.png"
    proc = run([PLOT, folder, "-o", out], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_png(out, min_bytes=10_000)
    assert "separate_async K=2 (10 steps, 8 served from the cache)" in proc.stderr
    assert "separate_async K=1 (10 steps, 0 served from the cache)" in proc.stderr


def _saved_figures(monkeypatch):
    """Record every figure plot.py saves (the real savefig still runs)."""
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


@pytest.mark.parametrize("n_runs", [1, 3, 6])
def test_plot_legend_lies_inside_the_figure_and_off_the_panels(tmp_path, monkeypatch, n_runs):
    """Issue 15 item 7: with three runs the legend was wider than the figure (a run's label and the key
    for hollow markers cut off). Every legend entry, with the longest labels plot.py makes (mode, K, seed,
    the run's directory), must lie inside the saved figure and not over a panel."""
    pytest.importorskip("matplotlib")
    plot = load_script("plot")
    for n in range(n_runs):
        cache = ["hit"] * 20 if n % 2 else ["miss"] * 20
        run_dir = write_run(tmp_path / "runs" / ("rerun" if n % 2 else "first") / f"{n // 2}_separate_async_K{n}",
                            cache, K=[1, 2, 4][n // 2 % 3])
        cfg = run_dir / ".hydra" / "config.yaml"
        cfg.write_text(cfg.read_text().replace("seed: 0", f"seed: {n // 2}"))
    runs = plot.find_runs(tmp_path / "runs")
    assert len(runs) == n_runs
    saved = _saved_figures(monkeypatch)
    plot.draw(runs, tmp_path / "p.png", "a title")
    (fig,) = saved
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)   # plot.py closed the figure after saving it; lay it out again
    canvas.draw()
    renderer = canvas.get_renderer()
    figure_box = fig.bbox
    panels = [ax.get_tightbbox(renderer) for ax in fig.axes]
    assert len(fig.legends) >= 1
    texts = []
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        assert box.x0 >= figure_box.x0 - 1 and box.x1 <= figure_box.x1 + 1, (box, figure_box)
        assert box.y0 >= figure_box.y0 - 1 and box.y1 <= figure_box.y1 + 1, (box, figure_box)
        for panel in panels:
            assert not box.overlaps(panel), (box, panel)
        texts += [t.get_text() for t in legend.get_texts()]
    for run in runs:
        assert any(t.startswith(run.label + ":") for t in texts), (run.label, texts)
    assert "served from the cache" in texts


def write_sweep_job(run_dir: Path, K: int, overrides, lr: float = 0.003) -> Path:
    """A job directory as Hydra writes it: .hydra/overrides.yaml (the command line's overrides) and the
    composed .hydra/config.yaml, beside its metrics."""
    write_run(run_dir, ["miss"] * 3, K=K)
    cfg = run_dir / ".hydra" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("trainer:\n", "trainer:\n  progress: false\n  total_training_steps: 3\n")
                   + f"actor_rollout_ref:\n  actor:\n    optim:\n      lr: {lr}\n")
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return run_dir


def _legend_colors(fig) -> dict:
    """Each run's legend text -> the color of its line."""
    runs_legend = max(fig.legends, key=lambda lg: len(lg.get_texts()))
    return {t.get_text(): tuple(h.get_color()) for t, h in zip(runs_legend.get_texts(), runs_legend.legend_handles)}


def test_plot_names_every_swept_key_and_gives_each_configuration_its_own_color(tmp_path, monkeypatch):
    """Issue 40: a sweep over K and lr was coloured by K alone and its legend left lr out, so the three
    learning rates at one K could not be told apart."""
    pytest.importorskip("matplotlib")
    plot = load_script("plot")
    sweep = tmp_path / "multirun"
    job = 0
    for K in (1, 4):
        for lr in ("0.001", "0.003", "0.01"):
            write_sweep_job(sweep / f"{job}_separate_async_K{K}", K, [
                "hydra/launcher=joblib", "trainer_mode=separate_async",
                f"trainer.v1.separate_async.parameter_sync_step={K}", f"actor_rollout_ref.actor.optim.lr={lr}",
                "trainer.total_training_steps=3", "trainer.progress=False"], lr=float(lr))
            job += 1
    # a run of the defaults beside the sweep: lr is not on its command line, its config says 0.003; it
    # wrote `false` where Hydra's sweeper wrote `False` (the same value: no label says it)
    write_sweep_job(tmp_path / "multirun" / "default", 4, ["trainer_mode=separate_async", "trainer.progress=false"])
    runs = plot.find_runs(tmp_path / "multirun")
    labels = [r.label for r in runs]
    assert labels == ["separate_async K=1 lr=0.001", "separate_async K=1 lr=0.003", "separate_async K=1 lr=0.01",
                      "separate_async K=4 lr=0.001", "separate_async K=4 lr=0.003 (4_separate_async_K4)",
                      "separate_async K=4 lr=0.003 (default)", "separate_async K=4 lr=0.01"], labels
    saved = _saved_figures(monkeypatch)
    plot.draw(runs, tmp_path / "p.png", "a title")
    (fig,) = saved
    colors = _legend_colors(fig)
    assert len(colors) == 7 and all(any(t.startswith(lab + ":") for t in colors) for lab in labels), colors
    by_config = {}
    for text, color in colors.items():
        by_config.setdefault(text.split(" (")[0].split(":")[0], set()).add(color)
    assert all(len(c) == 1 for c in by_config.values()), by_config   # a rerun of a configuration: its color
    assert len({next(iter(c)) for c in by_config.values()}) == 6, by_config   # six configurations, six colors


def test_plot_names_two_keys_of_one_name_by_their_longer_ends(tmp_path):
    plot = load_script("plot")
    for n, (a, c) in enumerate((("0.1", "0.2"), ("0.1", "0.3"), ("0.2", "0.3"))):
        write_sweep_job(tmp_path / str(n), 2, [f"actor_rollout_ref.actor.optim.lr={a}", f"critic.optim.lr={c}",
                                               "+trainer.note=same"], lr=float(a))
    assert [r.label for r in plot.find_runs(tmp_path)] == [
        "separate_async K=2 actor.optim.lr=0.1 critic.optim.lr=0.2", "separate_async K=2 actor.optim.lr=0.1 critic.optim.lr=0.3",
        "separate_async K=2 actor.optim.lr=0.2 critic.optim.lr=0.3"]


@pytest.mark.slow   # a real sweep: two jobs of two tiny steps
def test_plot_of_a_real_sweep_over_the_learning_rate_names_it(tmp_path):
    sweep = tmp_path / "multirun"
    proc = run([TRAIN, "-m", "actor_rollout_ref.actor.optim.lr=0.001,0.01", "trainer.total_training_steps=2",
                "trainer.progress=false", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                "data.max_prompt_length=6", "data.max_response_length=6", "actor_rollout_ref.model.d_model=32",
                "actor_rollout_ref.model.n_layers=1", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "p.png"
    proc = run([PLOT, sweep, "-o", out], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_png(out)
    assert "drew sync K=1 lr=0.001 (2 steps" in proc.stderr and "drew sync K=1 lr=0.01 (2 steps" in proc.stderr, proc.stderr
