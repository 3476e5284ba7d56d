"""Charts over steps, drawn on the server as SVG (no script, no network): a line of a value per step,
with a band for its spread where there is one; each point is a link to its step."""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Callable, Dict, List, Optional, Sequence, Tuple

WIDTH, HEIGHT = 560, 180
PAD_L, PAD_R, PAD_T, PAD_B = 52, 12, 22, 26


@dataclass(frozen=True)
class Point:
    step: int
    value: float
    low: Optional[float] = None      # the band (mean - std, min ...), when the value has a spread
    high: Optional[float] = None


def _finite(x: Optional[float]) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1000 or abs(x) < 0.01:
        return f"{x:.3g}"
    return f"{x:.3f}".rstrip("0").rstrip(".")


RUN_COLOURS = ("#4c78a8", "#e45756", "#54a24b", "#b279a2", "#f58518", "#72b7b2", "#9d755d", "#bab0ac")
MARK_COLOURS = {"complete": "#54a24b", "unverified": "#9a6a00", "incomplete": "#f58518", "corrupt": "#b00020",
                "missing": "#bab0ac"}


def line_chart(title: str, points: Sequence[Point], href: Callable[[int], str], *, css_id: str = "",
               overlays: Sequence[Tuple[str, Sequence[Point]]] = (),
               marks: Sequence[Tuple[int, str]] = ()) -> str:
    """One chart as an <svg> element: `title` on top, a point per step linking to `href(step)`; other runs'
    `overlays` ((label, points)) drawn over it in their own colours, with a legend; `marks` ((step,
    status)) as ticks along the step axis: servable steps (a replay's hits) and the others (its misses)."""
    if overlays:
        return _overlaid(title, points, href, css_id, overlays, marks)
    pts = [p for p in points if _finite(p.value)]
    ident = f' id="{escape(css_id)}"' if css_id else ""
    head = (f'<svg{ident} class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">'
            f'<text x="{PAD_L}" y="14" class="chart-title">{escape(title)}</text>')
    if not pts:
        return head + f'<text x="{PAD_L}" y="{HEIGHT // 2}" class="chart-empty">no values</text></svg>'
    lows = [p.low for p in pts if _finite(p.low)]
    highs = [p.high for p in pts if _finite(p.high)]
    y_min = min([p.value for p in pts] + lows)
    y_max = max([p.value for p in pts] + highs)
    if y_max == y_min:
        y_min, y_max = y_min - 0.5, y_max + 0.5
    s_min, s_max = pts[0].step, pts[-1].step
    x, y, axis = _scales(s_min, s_max, y_min, y_max)
    parts: List[str] = [head, *axis]
    parts.append(f'<text x="{PAD_L}" y="{HEIGHT - 6}" class="axis">step {s_min}</text>'
                 f'<text x="{WIDTH - PAD_R}" y="{HEIGHT - 6}" class="axis" text-anchor="end">step {s_max}</text>')
    parts += _marks(marks, x, s_min, s_max)
    band = [p for p in pts if _finite(p.low) and _finite(p.high)]
    if len(band) >= 2:
        upper = " ".join(f"{x(p.step):.1f},{y(p.high):.1f}" for p in band)
        lower = " ".join(f"{x(p.step):.1f},{y(p.low):.1f}" for p in reversed(band))
        parts.append(f'<polygon points="{upper} {lower}" class="band"/>')
    if len(pts) >= 2:
        parts.append('<polyline class="line" points="'
                     + " ".join(f"{x(p.step):.1f},{y(p.value):.1f}" for p in pts) + '"/>')
    r = 3.5 if len(pts) <= 200 else 2
    for p in pts:
        spread = f" ({_fmt(p.low)} .. {_fmt(p.high)})" if _finite(p.low) and _finite(p.high) else ""
        parts.append(f'<a href="{escape(href(p.step))}" target="_top" class="point" data-step="{p.step}">'
                     f'<circle cx="{x(p.step):.1f}" cy="{y(p.value):.1f}" r="{r}"/>'
                     f'<title>step {p.step}: {_fmt(p.value)}{escape(spread)}</title></a>')
    parts.append("</svg>")
    return "".join(parts)


def _marks(marks: Sequence[Tuple[int, str]], x: Callable[[int], float], s_min: int, s_max: int) -> List[str]:
    """Ticks under the plot, one per step: green where the step is servable (a replay hits it), else the
    colour of its status (a replay generates it again: a miss)."""
    out = []
    y0 = HEIGHT - PAD_B + 2
    for step, status in marks:
        if s_min <= step <= s_max:
            colour = MARK_COLOURS.get(status, "#bab0ac")
            out.append(f'<line class="mark mark-{escape(status)}" x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{y0}" '
                       f'y2="{y0 + 5}" stroke="{colour}" stroke-width="2"><title>step {step}: {escape(status)}'
                       f'{" (a replay serves it)" if status == "complete" else " (a replay generates it)"}</title></line>')
    return out


def _scales(s_min: int, s_max: int, y_min: float, y_max: float
            ) -> Tuple[Callable[[int], float], Callable[[float], float], List[str]]:
    """A chart's step -> x and value -> y, and its axis: three labels and grid lines."""
    span = max(s_max - s_min, 1)

    def x(step: int) -> float:
        return PAD_L + (step - s_min) / span * (WIDTH - PAD_L - PAD_R) if s_max != s_min else (PAD_L + WIDTH - PAD_R) / 2

    def y(v: float) -> float:
        return PAD_T + (y_max - v) / (y_max - y_min) * (HEIGHT - PAD_T - PAD_B)

    axis = [f'<line x1="{PAD_L}" x2="{WIDTH - PAD_R}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
            f'<text x="{PAD_L - 4}" y="{y(v) + 4:.1f}" class="axis" text-anchor="end">{_fmt(v)}</text>'
            for v in (y_min, (y_min + y_max) / 2, y_max)]
    return x, y, axis


def _overlaid(title: str, points: Sequence[Point], href: Callable[[int], str], css_id: str,
              overlays: Sequence[Tuple[str, Sequence[Point]]], marks: Sequence[Tuple[int, str]]) -> str:
    """Several runs' lines on one chart (the first is this namespace's; its points link to its steps)."""
    series: List[Tuple[str, List[Point]]] = [("this run", [p for p in points if _finite(p.value)])]
    series += [(label, [p for p in pts if _finite(p.value)]) for label, pts in overlays]
    ident = f' id="{escape(css_id)}"' if css_id else ""
    height = HEIGHT + 14 * len(series)
    head = (f'<svg{ident} class="chart overlaid" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
            f'width="{WIDTH}" height="{height}" role="img" aria-label="{escape(title)}">'
            f'<text x="{PAD_L}" y="14" class="chart-title">{escape(title)}</text>')
    every = [p for _l, pts in series for p in pts]
    if not every:
        return head + f'<text x="{PAD_L}" y="{HEIGHT // 2}" class="chart-empty">no values</text></svg>'
    y_min, y_max = min(p.value for p in every), max(p.value for p in every)
    if y_max == y_min:
        y_min, y_max = y_min - 0.5, y_max + 0.5
    s_min, s_max = min(p.step for p in every), max(p.step for p in every)
    x, y, axis = _scales(s_min, s_max, y_min, y_max)
    parts: List[str] = [head, *axis]
    parts.append(f'<text x="{PAD_L}" y="{HEIGHT - 6}" class="axis">step {s_min}</text>'
                 f'<text x="{WIDTH - PAD_R}" y="{HEIGHT - 6}" class="axis" text-anchor="end">step {s_max}</text>')
    parts += _marks(marks, x, s_min, s_max)
    seen: Dict[str, int] = {}
    for n, (label, pts) in enumerate(series):
        colour = RUN_COLOURS[n % len(RUN_COLOURS)]
        seen[label] = n
        if len(pts) >= 2:
            parts.append(f'<polyline class="line run-{n}" style="stroke:{colour}" points="'
                         + " ".join(f"{x(p.step):.1f},{y(p.value):.1f}" for p in pts) + '"/>')
        for p in pts:
            dot = (f'<circle cx="{x(p.step):.1f}" cy="{y(p.value):.1f}" r="2.5" style="fill:{colour}"/>'
                   f'<title>{escape(label)} step {p.step}: {_fmt(p.value)}</title>')
            if n == 0:
                parts.append(f'<a href="{escape(href(p.step))}" target="_top" class="point" data-step="{p.step}">{dot}</a>')
            else:
                parts.append(f'<g class="point run-{n}">{dot}</g>')
        parts.append(f'<rect x="{PAD_L}" y="{HEIGHT + 14 * n - 4}" width="10" height="8" style="fill:{colour}"/>'
                     f'<text x="{PAD_L + 14}" y="{HEIGHT + 14 * n + 4}" class="axis legend-run">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)
