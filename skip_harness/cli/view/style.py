"""The pages' look: one stylesheet, the colours of per-token values, how numbers are written."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

from html import escape as html_escape

import numpy as np

from markupsafe import Markup

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#f7f8fa}
header{background:#1d2330;color:#fff;padding:8px 16px}header a{color:#fff;text-decoration:none}
.brand{font-weight:600;margin-right:12px}.crumbs a{color:#cfe0ff}
main{padding:12px 20px}h1{font-size:20px;margin:8px 0}h2{font-size:16px;margin:16px 0 6px}h3{font-size:14px;margin:0 0 6px}
.grid-table{border-collapse:collapse;background:#fff;margin:6px 0}.grid-table th,.grid-table td{border:1px solid #dde1e8;padding:3px 7px;vertical-align:top}
.grid-table th{background:#eef1f6;text-align:left}.small{font-size:12px}.num{text-align:right;font-variant-numeric:tabular-nums}
.mono,.tok,pre{font-family:ui-monospace,SFMono-Regular,Menlo,monospace}.facts{color:#4a5366}.note{color:#8a5a00}
tr.status-corrupt,.nonzero.status-corrupt{color:#b00020}tr.status-incomplete,.nonzero.status-incomplete{color:#9a6a00}
.nonzero.status-corrupt{font-weight:700}
.refused{background:#fff0f0;border:1px solid #f0b8b8;padding:8px 12px}
.group{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 10px;margin:10px 0}
.prompt{margin:0 0 6px}.label{font-size:11px;text-transform:uppercase;color:#6b7487;margin-right:6px}
.tokens{display:block;line-height:1.9;overflow-wrap:anywhere;max-width:100%}
.tok{padding:1px 2px;margin:0 1px;border-radius:3px;white-space:pre-wrap;font-size:12px;overflow-wrap:anywhere}
.drift-badge{font-size:11px;border-radius:3px;padding:0 4px;white-space:nowrap}.drift-badge.same{background:#e6f4ea;color:#1e6b34}
.drift-badge.differs{background:#fff3cd;color:#8a5a00;border:1px solid #e0b84a}
th.first-diff-at{width:5.5em}
mark.first-diff{background:#ffd54a;color:#1d2330;outline:2px solid #b00020;border-radius:3px;padding:0 2px;font-weight:700}
.tok.masked{color:#8a93a6;background:none;border:1px dashed #c9ced8}
.legend{font-size:12px;color:#4a5366;margin:4px 0;display:flex;gap:6px;align-items:center;flex-wrap:wrap}
.legend .scale{display:inline-block;width:160px;height:10px;border:1px solid #c9ced8;
background:linear-gradient(90deg,hsl(0,65%,80%),hsl(60,65%,86%),hsl(120,65%,80%))}
.legend .swatch{display:inline-block;width:18px;height:10px;border:1px dashed #c9ced8}
details.fold>summary{cursor:pointer;color:#2458b3;font-size:12px}details.fold .rest{white-space:pre-wrap;overflow-wrap:anywhere;
font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;color:#1d2330;margin:4px 0}
.hist{display:inline-block;vertical-align:middle}.hist rect{fill:#4c78a8}
.values-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:2px 14px;font-size:12px;
background:#fff;border:1px solid #dde1e8;padding:4px 8px;margin:4px 0}.values-grid .value{display:flex;justify-content:space-between;
gap:8px;border-bottom:1px solid #eef1f6}.values-grid .key{overflow-wrap:anywhere}
table{max-width:100%}td.mono,td.response,td.reason{overflow-wrap:anywhere}
.trajnav{display:flex;gap:16px;align-items:center}
fieldset.key-group{border:1px solid #dde1e8;margin:4px 0;padding:2px 8px}label.key{margin-right:10px;font-size:12px;white-space:nowrap}
pre.text{white-space:pre-wrap;word-break:break-word;margin:2px 0;background:#f3f5f8;padding:4px 6px;border-radius:4px}
.samples{width:100%;table-layout:fixed}.samples td:nth-child(-n+4),.samples th:nth-child(-n+4){width:84px}.response{overflow-wrap:anywhere}
.controls{background:#fff;border:1px solid #dde1e8;padding:6px 10px;border-radius:6px}.controls label{margin-right:10px}
.stepnav{display:flex;gap:16px;align-items:center}.stepnav h1{margin:0}
iframe#charts{border:0;width:100%;height:200px;resize:vertical}
.charts-frame{margin:0;background:#fff;display:flex;flex-wrap:wrap;gap:6px}
svg.chart{background:#fff;border:1px solid #dde1e8}.chart-title{font-size:12px;font-weight:600}
.axis{font-size:10px;fill:#6b7487}.grid{stroke:#eef1f6}.band{fill:#4c78a8;fill-opacity:.18}
.line{fill:none;stroke:#4c78a8;stroke-width:1.5}.point circle{fill:#4c78a8}.point:hover circle{fill:#e45756;r:6}
.side-by-side{display:flex;gap:16px}.side{flex:1;background:#fff;border:1px solid #dde1e8;padding:8px}
tr.differs td{background:#fff4e5}.pertoken{overflow-x:auto}
.group.dead{border-color:#c9ced8;background:#f4f5f7}.dead-badge{font-size:11px;font-weight:600;color:#7a4b00;
background:#fff1d6;border:1px solid #e8c77a;border-radius:3px;padding:0 5px;margin-left:6px}a.dead-some{color:#7a4b00;font-weight:600}
.live{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:2px 10px;margin:6px 0}.live p{margin:4px 0}
.rec{color:#b00020;font-weight:600}
.compare-form{margin:10px 0}.roots .root{margin-right:14px;color:#4a5366}
"""


def colour(value: Optional[float], row: Any) -> str:
    """A background for a per-token value: red (low) to green (high) over the row's own range; a mask's
    1 is plain, its 0 grey."""
    if value is None or not math.isfinite(value):
        return "transparent"
    low, high = row.low, row.high
    if high <= low:
        return "hsl(120,55%,88%)" if value else "hsl(0,0%,88%)"
    t = (value - low) / (high - low)
    return f"hsl({round(120 * t)},65%,{round(86 - 6 * abs(t - 0.5))}%)"


def adv_colour(value: Optional[float]) -> str:
    if value is None or not math.isfinite(value):
        return "inherit"
    return "#1a7f37" if value > 0 else "#b00020" if value < 0 else "inherit"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def tokens_html(tokens: Sequence[str], row: Any = None, masked: Sequence[bool] = (), mark: Any = None) -> Markup:
    """Token spans, each escaped, coloured by `row`'s value; a masked token (`masked[k]`) is neutral: never
    coloured; token `mark` (an index: the first that differs when generated again) marked. Built here in one pass (a template loop costs ten times as much on a page of thousands of
    tokens); the colours' hue and lightness computed for the whole row at once (numpy rounds half to even,
    as `round` does)."""
    parts: List[str] = ['<div class="tokens">']
    add = parts.append
    values = row.values if row is not None else ()
    name = html_escape(row.name) if row is not None else ""
    low, span = (row.low, row.high - row.low) if row is not None else (0.0, 0.0)
    nv, nm = len(values), len(masked)
    hues: List[int] = []
    lights: List[int] = []
    if span > 0 and nv:
        t = (np.array([math.nan if v is None else v for v in values], dtype=np.float64) - low) / span
        finite = np.isfinite(t)
        hues = np.rint(np.where(finite, 120 * t, 0)).astype(np.int64).tolist()
        lights = np.rint(np.where(finite, 86 - 6 * np.abs(t - 0.5), 0)).astype(np.int64).tolist()
    for k, tok in enumerate(tokens):
        text = tok if tok.isalnum() else html_escape(tok)      # ids and plain words need no escaping
        if k < nm and masked[k]:
            add(f'<span class="tok masked" title="masked (not trained on)">{text}</span>')
            continue
        v = values[k] if k < nv else None
        if v is None:
            add(f'<span class="tok">{text}</span>')
        elif span > 0:
            add(f'<span class="tok" style="background:hsl({hues[k]},65%,{lights[k]}%)" title="{name} = {v:.4g}">'
                f'{text}</span>')
        else:
            bg = "hsl(120,55%,88%)" if v else "hsl(0,0%,88%)"
            add(f'<span class="tok" style="background:{bg}" title="{name} = {v:.4g}">{text}</span>')
    if isinstance(mark, int) and 0 <= mark < len(tokens):
        parts[1 + mark] = f'<mark class="first-diff" title="first token that differs when generated again">{parts[1 + mark]}</mark>'
    add("</div>")
    return Markup(" ".join(parts))       # a space between tokens: lines break there, never inside a token


def legend_html(row: Any, masked: bool = True) -> Markup:
    """What the colours mean: the field, its scale (low red .. high green, over the real unmasked tokens
    shown), and that masked tokens are neutral."""
    if row is None:
        return Markup('<div class="legend">no per-token values to colour by</div>')
    name = html_escape(row.name)
    if row.high > row.low:
        scale = (f'<span class="num">{fmt(row.low)}</span><span class="scale" title="low .. high"></span>'
                 f'<span class="num">{fmt(row.high)}</span>')
    else:
        scale = f'<span>every value {fmt(row.low)}</span>'
    mask = '· <span class="swatch"></span> masked: not coloured' if masked else ""
    return Markup(f'<div class="legend" id="legend">colour: <b class="mono">{name}</b> {scale} {mask}</div>')


def histogram_svg(values: Sequence[float], bins: int = 12, width: int = 240, height: int = 48) -> Markup:
    """A small histogram of `values` (the step's rewards), as SVG."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return Markup("")
    lo, hi = min(xs), max(xs)
    counts = [0] * bins
    for v in xs:
        k = 0 if hi == lo else min(bins - 1, int((v - lo) / (hi - lo) * bins))
        counts[k] += 1
    top = max(counts)
    w = width / bins
    bars = "".join(f'<rect x="{k * w + 1:.1f}" y="{height - 12 - (c / top) * (height - 14):.1f}" width="{w - 2:.1f}" '
                   f'height="{(c / top) * (height - 14):.1f}"><title>{c}</title></rect>' for k, c in enumerate(counts))
    return Markup(f'<svg class="hist" id="reward-hist" xmlns="http://www.w3.org/2000/svg" width="{width}" '
                  f'height="{height}" role="img" aria-label="reward histogram">{bars}'
                  f'<text x="0" y="{height - 1}" class="axis">{fmt(lo)}</text>'
                  f'<text x="{width}" y="{height - 1}" class="axis" text-anchor="end">{fmt(hi)}</text></svg>')


def per_token_html(shown: Any) -> Markup:
    """Every per-token value of a response as a table with a row per token (long, never wide), built in
    one pass (the coloured tokens above carry the colours; a masked token's row is marked)."""
    rows = shown.token_rows
    tokens = shown.response_tokens or []
    masked = shown.masked
    parts: List[str] = ['<table id="per-token" class="grid-table small"><thead><tr><th>#</th><th>token</th>']
    parts += [f'<th class="mono">{html_escape(r.name)}</th>' for r in rows]
    parts.append("</tr></thead><tbody>")
    n = len(tokens)
    # each row's cells of every column made once, column by column (a column shorter than the tokens: "-")
    cells = [""] * n
    for r in rows:
        col = ['<td class="num">-</td>' if v is None else f'<td class="num">{v:.3g}</td>' for v in r.values[:n]]
        col += ['<td class="num">-</td>'] * (n - len(col))
        cells = [a + b for a, b in zip(cells, col)]
    marks = [' class="masked"' if m else "" for m in masked[:n]] + [""] * (n - min(n, len(masked)))
    add = parts.append
    for k, (tok, cls, row) in enumerate(zip(tokens, marks, cells)):
        add(f'<tr{cls}><td class="num">{k}</td><td class="mono">{tok if tok.isalnum() else html_escape(tok)}</td>{row}</tr>')
    parts.append("</tbody></table>")
    return Markup("".join(parts))
