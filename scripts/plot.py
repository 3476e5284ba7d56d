"""Draw the runs of the demo: time generating vs the rest, loss and reward per step, one line per run.

    python scripts/plot.py RUNS_DIR [-o plot.png]

RUNS_DIR is one run directory, a sweep directory, or a folder of them: every `metrics.jsonl` under it
is a run (hidden directories such as `.hydra` are not searched; symlinked run or sweep directories are
followed, each real directory once). A run is labelled by its trainer mode
and K, read from the `.hydra/config.yaml` next to its metrics (plus the seed when the runs differ in
seed), or by its directory name when that file says nothing, and by every other key whose value
differs between the runs found (`lr=0.001`: the keys of each run's `.hydra/overrides.yaml`, each
named by the shortest end of its dotted name that no other such key shares). Each configuration has a
color of its own; steps served from the cache (`cache` is `hit` or `repeat`) have hollow markers,
generated steps (`miss`, `off`) filled ones, and the legend says how many steps of each run came from
the cache.

Bad input (no such directory, no metrics.jsonl, a line that is not a JSON object with a step) stops
with one message naming the path, exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from _plot_labels import read_overrides, sortable, swept_values

log = logging.getLogger("skip_harness.plot")

METRICS_NAME = "metrics.jsonl"
SERVED = ("hit", "repeat")   # `cache` values of steps whose rollouts came from the cache


class PlotInputError(Exception):
    """RUNS_DIR or a metrics file cannot be used; the message names the path."""


@dataclass(frozen=True)
class Run:
    path: Path                        # the run directory (holding metrics.jsonl)
    rows: Tuple[Dict[str, Any], ...]  # metrics.jsonl, one dict a step, in file order
    mode: Optional[str]
    K: Optional[int]
    seed: Optional[int]
    name: str = ""                    # the run directory relative to RUNS_DIR (its own name if it is RUNS_DIR)
    label: str = ""
    overrides: Tuple[Tuple[str, str], ...] = ()   # .hydra/overrides.yaml: (key, value) as given
    swept: Tuple[Tuple[str, str], ...] = ()       # the keys whose values differ between the runs found

    @property
    def steps(self) -> List[int]:
        return [int(r["step"]) for r in self.rows]

    def series(self, key: str) -> List[float]:
        return [_number(r.get(key)) for r in self.rows]

    @property
    def rest_s(self) -> List[float]:
        """Seconds of each step not spent generating: step_s - gen_s, else train_s."""
        out = []
        for r in self.rows:
            step_s, gen_s = _number(r.get("step_s")), _number(r.get("gen_s"))
            out.append(step_s - gen_s if not (math.isnan(step_s) or math.isnan(gen_s)) else _number(r.get("train_s")))
        return out

    @property
    def served(self) -> List[bool]:
        return [r.get("cache") in SERVED for r in self.rows]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return float("nan")
    return float(value)


# --------------------------------------------------------------------------------------------
# finding and reading runs


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlotInputError(f"{path}: cannot be read: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise PlotInputError(f"{path}:{n}: not a JSON line: {exc}") from None
        if not isinstance(row, dict):
            raise PlotInputError(f"{path}:{n}: not a JSON object")
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise PlotInputError(f"{path}:{n}: has no integer 'step'")
        rows.append(row)
    return rows


def read_run_config(run_dir: Path) -> Tuple[Optional[str], Optional[int], Optional[int]]:
    """(trainer mode, K, seed) from run_dir/.hydra/config.yaml; None for what it does not say."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None, None, None
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(path)
        mode = OmegaConf.select(cfg, "trainer.v1.trainer_mode", default=None)
        k = OmegaConf.select(cfg, "trainer.v1.separate_async.parameter_sync_step", default=None)
        seed = OmegaConf.select(cfg, "seed", default=None)
    except Exception as exc:  # a config we cannot read only costs the label
        log.warning("%s: cannot be read (%s); labelling the run by its directory name", path, exc)
        return None, None, None
    mode = str(mode) if mode is not None else None
    if mode is None:
        K = None
    elif mode == "separate_async":
        K = int(k) if isinstance(k, int) and not isinstance(k, bool) else None
    else:
        K = 1
    seed = int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else None
    return mode, K, seed


def _metrics_files(root: Path) -> List[Path]:
    if root.is_file():
        return [root] if root.name == METRICS_NAME else []
    found = []
    seen = set()
    # Runs may be symlinks (a folder of links to the runs being compared): follow them, once each.
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if METRICS_NAME in filenames:
            found.append(Path(dirpath) / METRICS_NAME)
    return found


def find_runs(root: os.PathLike | str) -> List[Run]:
    """Every run under `root` (a run directory, a sweep, a folder of them, or a metrics.jsonl), with
    its label, sorted by mode, K, seed and path. Raises PlotInputError naming the path."""
    root = Path(root)
    if not root.exists():
        raise PlotInputError(f"{root}: no such directory")
    if not (root.is_dir() or root.is_file()):
        raise PlotInputError(f"{root}: not a directory")
    files = _metrics_files(root)
    if not files:
        raise PlotInputError(f"{root}: no {METRICS_NAME} found under it")
    runs = []
    for path in files:
        rows = read_metrics(path)
        if not rows:
            log.warning("%s: no steps yet; skipped", path)
            continue
        mode, K, seed = read_run_config(path.parent)
        rel = path.parent.relative_to(root) if root.is_dir() else Path(path.parent.name)
        name = str(rel) if str(rel) != "." else (path.parent.resolve().name or str(path.parent))
        runs.append(Run(path.parent, tuple(rows), mode, K, seed, name, overrides=read_overrides(path.parent)))
    if not runs:
        raise PlotInputError(f"{root}: every {METRICS_NAME} under it is empty")
    return label_runs(runs)


def _distinguishing(run: Run, group: Sequence[Run]) -> str:
    """The parts of run.name (a relative path) that differ within `group`, e.g. 'rerun' for
    'rerun/0_separate_async_K1' next to 'first/0_separate_async_K1'."""
    parts = [Path(r.name).parts for r in group]
    mine = Path(run.name).parts
    if any(len(p) != len(mine) for p in parts):
        return run.name
    keep = [c for i, c in enumerate(mine) if len({p[i] for p in parts}) > 1]
    return "/".join(keep) or run.name


def label_runs(runs: Sequence[Run]) -> List[Run]:
    """'mode K=k' (plus ' seed=s' when the runs differ in seed, and ' key=value' for each other key that
    differs between them); the directory name when the config says nothing, or added when two runs
    would otherwise share a label."""
    seeds = {r.seed for r in runs if r.mode is not None}
    with_seed = len(seeds) > 1
    runs = [dataclasses.replace(r, swept=v) for r, v in zip(runs, swept_values([(r.path, r.overrides) for r in runs]))]

    def base(r: Run) -> str:
        swept = "".join(f" {k}={v}" for k, v in r.swept)
        if r.mode is None or r.K is None:
            return (r.name or str(r.path)) + swept
        text = f"{r.mode} K={r.K}"
        if with_seed and r.seed is not None:
            text += f" seed={r.seed}"
        return text + swept

    bases = [base(r) for r in runs]
    labels = []
    for b, r in zip(bases, runs):
        same = [o for o, ob in zip(runs, bases) if ob == b]
        labels.append(b if len(same) == 1 or b == r.name else f"{b} ({_distinguishing(r, same)})")
    out = [dataclasses.replace(r, label=lab) for r, lab in zip(runs, labels)]
    out.sort(key=lambda r: (r.mode is None, r.mode or "", r.K or 0, r.seed or 0, [sortable(v) for _, v in r.swept],
                            str(r.path)))
    return out


# --------------------------------------------------------------------------------------------
# drawing


def _marked_line(ax, x: Sequence[int], y: Sequence[float], served: Sequence[bool], color, linestyle: str,
                 marker: str, size: float, label: Optional[str] = None) -> None:
    ax.plot(x, y, color=color, linestyle=linestyle, linewidth=1.4, label=label)
    filled = [(a, b) for a, b, s in zip(x, y, served) if not s]
    hollow = [(a, b) for a, b, s in zip(x, y, served) if s]
    if filled:
        ax.plot(*zip(*filled), linestyle="none", marker=marker, markersize=size, color=color)
    if hollow:
        ax.plot(*zip(*hollow), linestyle="none", marker=marker, markersize=size, markerfacecolor="white",
                markeredgecolor=color, markeredgewidth=1.2)


def _clip_outliers(ax, values: Sequence[float]) -> None:
    """Keep a few outliers (a first step that warms everything up) from flattening the rest: cap the
    y axis and mark each step above it with a triangle on the top edge."""
    finite = sorted(v for v in values if not math.isnan(v))
    if len(finite) < 8:
        return
    p95 = finite[int(0.95 * (len(finite) - 1))]
    if p95 <= 0 or finite[-1] <= 3 * p95:
        return
    top = 1.6 * p95
    ax.set_ylim(bottom=min(0.0, finite[0]), top=top)
    above = 0
    for line in list(ax.get_lines()):
        if line.get_linestyle() in ("None", "none", ""):  # the marker overlays repeat their line's points
            continue
        xs = [x for x, y in zip(line.get_xdata(), line.get_ydata()) if not math.isnan(y) and y > top]
        if xs:
            above += len(xs)
            ax.plot(xs, [top] * len(xs), marker="^", markersize=7, color=line.get_color(), linestyle="none",
                    clip_on=False)
    ax.text(0.99, 0.98, f"axis capped at {top:.2f} s: \u25b2 marks {above} value{'s' if above != 1 else ''} "
            f"above it (up to {finite[-1]:.2f} s)", transform=ax.transAxes, ha="right", va="top", fontsize=7,
            color="0.35", bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))


# Figure geometry, in inches: the four panels keep their size; the legend gets rows of its own below them,
# so the figure grows with the number of runs instead of the legend running off its edges.
FIG_WIDTH = 13.0
PANELS_HEIGHT = 8.4
LEGEND_ROW = 0.27
LEGEND_PAD = 0.35


def _legend_columns(labels: Sequence[str], fontsize: float) -> int:
    """How many run entries fit side by side in the figure's width (1 to 3), from their longest label."""
    longest = max(len(label) for label in labels)
    entry_in = 0.9 + longest * fontsize * 0.62 / 72    # handle + gap + text, characters ~0.62 em wide
    return max(1, min(3, len(labels), int((FIG_WIDTH - 0.6) // entry_in)))


def make_figure(runs: Sequence[Run], title: str):
    """The figure for `runs`: four panels (seconds per step, cumulative seconds, loss, reward), and below
    them a legend of the runs (label by mode and K, steps from the cache) and a key to the line and marker
    styles. Nothing of the legend lies outside the figure, whatever the number of runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    # One color per configuration (mode, K, seed, the swept keys' values): a rerun served from the cache
    # shares its first run's color, its hollow markers on the first run's filled ones.
    keys = [(r.mode, r.K, r.seed, r.swept) if r.mode is not None else ("", None, n, r.swept) for n, r in enumerate(runs)]
    distinct = list(dict.fromkeys(keys))
    cmap: Any = plt.get_cmap("tab10" if len(distinct) <= 10 else "tab20")   # a ListedColormap: it has .colors
    colors = cmap.colors
    color_of = [colors[distinct.index(k) % len(colors)] for k in keys]
    longest = max(len(r.rows) for r in runs)
    size = 5 if longest <= 40 else 3 if longest <= 150 else 1.5
    fontsize = 9
    run_labels = [f"{run.label}: {sum(run.served)}/{len(run.rows)} steps from the cache" for run in runs]
    ncol = _legend_columns(run_labels, fontsize)
    run_rows = math.ceil(len(runs) / ncol)
    legend_h = LEGEND_PAD + (run_rows + 1) * LEGEND_ROW + LEGEND_PAD    # the runs, then one row of style keys
    fig_h = PANELS_HEIGHT + legend_h
    fig, axes = plt.subplots(2, 2, figsize=(FIG_WIDTH, fig_h), sharex=True)
    (ax_time, ax_cum), (ax_loss, ax_reward) = axes
    per_step_values: List[float] = []
    # Runs served from the cache are drawn last, so their hollow markers sit on top of the generated
    # run they reproduce (identical losses and rewards would otherwise hide them).
    order = sorted(range(len(runs)), key=lambda n: sum(runs[n].served))
    for n in order:
        run = runs[n]
        c = color_of[n]
        x, served = run.steps, run.served
        gen, rest = run.series("gen_s"), run.rest_s
        per_step_values += gen + rest
        _marked_line(ax_time, x, gen, served, c, "-", "o", size)
        _marked_line(ax_time, x, rest, served, c, "--", "s", size * 0.8)
        cum_total, cum_gen, t_all, t_gen = [], [], 0.0, 0.0
        for g, r in zip(gen, rest):
            g, r = (0.0 if math.isnan(g) else g), (0.0 if math.isnan(r) else r)
            t_gen += g
            t_all += g + r
            cum_gen.append(t_gen)
            cum_total.append(t_all)
        _marked_line(ax_cum, x, cum_gen, served, c, "-", "o", size)
        _marked_line(ax_cum, x, cum_total, served, c, ":", "D", size * 0.8)
        _marked_line(ax_loss, x, run.series("loss"), served, c, "-", "o", size)
        _marked_line(ax_reward, x, run.series("reward_mean"), served, c, "-", "o", size)
    _clip_outliers(ax_time, per_step_values)

    ax_time.set_title("seconds per step: generating (solid) vs the rest (dashed)", fontsize=10)
    ax_time.set_ylabel("seconds")
    ax_cum.set_title("cumulative seconds: generating (solid), whole steps (dotted)", fontsize=10)
    ax_cum.set_ylabel("seconds")
    ax_loss.set_title("loss", fontsize=10)
    ax_reward.set_title("reward_mean", fontsize=10)
    for ax in (ax_loss, ax_reward):
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)

    # a run's legend marker is hollow when most of its steps came from the cache
    run_handles = [Line2D([], [], color=color_of[n], linewidth=2.5, marker="o", markersize=6, label=label,
                          markerfacecolor="white" if 2 * sum(run.served) > len(run.rows) else color_of[n])
                   for n, (run, label) in enumerate(zip(runs, run_labels))]
    key_handles = [
        Line2D([], [], color="0.3", linestyle="-", label="generating"),
        Line2D([], [], color="0.3", linestyle="--", label="rest of the step"),
        Line2D([], [], color="0.3", linestyle=":", label="whole steps"),
        Line2D([], [], color="0.3", marker="o", linestyle="none", label="generated"),
        Line2D([], [], color="0.3", marker="o", linestyle="none", markerfacecolor="white",
               label="served from the cache"),
    ]
    fig.suptitle(title)
    bottom = legend_h / fig_h                       # the panels sit above the legend's band
    fig.tight_layout(rect=(0, bottom, 1, 0.985))
    runs_legend = fig.legend(handles=run_handles, loc="upper center", ncol=ncol, fontsize=fontsize, frameon=False,
                             bbox_to_anchor=(0.5, (legend_h - LEGEND_PAD * 0.5) / fig_h))
    fig.legend(handles=key_handles, loc="lower center", ncol=len(key_handles), fontsize=fontsize - 1, frameon=False,
               bbox_to_anchor=(0.5, LEGEND_PAD * 0.3 / fig_h))
    fig.add_artist(runs_legend)
    return fig


def draw(runs: Sequence[Run], out: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = make_figure(runs, title)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dir", metavar="RUNS_DIR", help="a run directory, a sweep directory, or a folder of them")
    p.add_argument("-o", "--output", default="plot.png", help="the PNG to write (default: plot.png)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="[plot] %(message)s")
    log.setLevel(logging.INFO)
    out = Path(args.output)
    if out.suffix.lower() != ".png" or out.is_dir():
        log.error("%s: -o must name a .png file", out)
        return 2
    try:
        runs = find_runs(args.runs_dir)
        served = sum(sum(r.served) for r in runs)
        title = f"{Path(args.runs_dir).resolve().name}: {len(runs)} run{'s' if len(runs) != 1 else ''}"
        if served:
            title += f", {served} steps served from the cache"
        draw(runs, out, title)
    except PlotInputError as exc:
        log.error("%s", exc)
        return 2
    except ImportError as exc:
        log.error("plotting needs matplotlib (pip install 'skip_harness[plot]'): %s", exc)
        return 2
    except OSError as exc:
        log.error("%s: cannot be written: %s", out, exc.strerror or exc)
        return 2
    for run in runs:
        log.info("drew %s (%d steps, %d served from the cache): %s", run.label, len(run.rows), sum(run.served), run.path)
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
