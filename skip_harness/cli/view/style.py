"""The pages' look: one stylesheet, the colours of per-token values, how numbers are written."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

from html import escape as html_escape

from markupsafe import Markup

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#f7f8fa}
header{background:#1d2330;color:#fff;padding:8px 16px}header a{color:#fff;text-decoration:none}
.brand{font-weight:600;margin-right:12px}.crumbs a{color:#cfe0ff}
main{padding:12px 20px}h1{font-size:20px;margin:8px 0}h2{font-size:16px;margin:16px 0 6px}h3{font-size:14px;margin:0 0 6px}
.grid-table{border-collapse:collapse;background:#fff;margin:6px 0}.grid-table th,.grid-table td{border:1px solid #dde1e8;padding:3px 7px;vertical-align:top}
.grid-table th{background:#eef1f6;text-align:left}.small{font-size:12px}.num{text-align:right;font-variant-numeric:tabular-nums}
.mono,.tok,pre{font-family:ui-monospace,SFMono-Regular,Menlo,monospace}.facts{color:#4a5366}.note{color:#8a5a00}
.status-corrupt{color:#b00020}.status-incomplete{color:#9a6a00}.nonzero.status-corrupt{font-weight:700}
.refused{background:#fff0f0;border:1px solid #f0b8b8;padding:8px 12px}
.group{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 10px;margin:10px 0}
.prompt{margin:0 0 6px}.label{font-size:11px;text-transform:uppercase;color:#6b7487;margin-right:6px}
.tokens{display:inline;line-height:1.9}.tok{padding:1px 2px;margin:0 1px;border-radius:3px;white-space:pre;font-size:12px}
.tok.masked{opacity:.35;text-decoration:line-through}
pre.text{white-space:pre-wrap;word-break:break-word;margin:2px 0;background:#f3f5f8;padding:4px 6px;border-radius:4px}
.samples{width:100%}.samples td:nth-child(-n+4),.samples th:nth-child(-n+4){width:84px}.response{max-width:900px}
.controls{background:#fff;border:1px solid #dde1e8;padding:6px 10px;border-radius:6px}.controls label{margin-right:10px}
.stepnav{display:flex;gap:16px;align-items:center}.stepnav h1{margin:0}
iframe#charts{border:0;width:100%;height:200px;resize:vertical}
.charts-frame{margin:0;background:#fff;display:flex;flex-wrap:wrap;gap:6px}
svg.chart{background:#fff;border:1px solid #dde1e8}.chart-title{font-size:12px;font-weight:600}
.axis{font-size:10px;fill:#6b7487}.grid{stroke:#eef1f6}.band{fill:#4c78a8;fill-opacity:.18}
.line{fill:none;stroke:#4c78a8;stroke-width:1.5}.point circle{fill:#4c78a8}.point:hover circle{fill:#e45756;r:6}
.side-by-side{display:flex;gap:16px}.side{flex:1;background:#fff;border:1px solid #dde1e8;padding:8px}
tr.differs td{background:#fff4e5}.pertoken{overflow-x:auto}
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


def tokens_html(tokens: Sequence[str], row: Any = None, mask: Any = None) -> Markup:
    """Token spans, each escaped, coloured by `row`'s value and struck through where `mask` is 0: built
    here in one pass (a template loop costs ten times as much on a page of thousands of tokens)."""
    parts: List[str] = ['<div class="tokens">']
    add = parts.append
    values = row.values if row is not None else ()
    masks = mask.values if mask is not None else ()
    name = html_escape(row.name) if row is not None else ""
    low, span = (row.low, row.high - row.low) if row is not None else (0.0, 0.0)
    nv, nm = len(values), len(masks)
    for k, tok in enumerate(tokens):
        text = tok if tok.isalnum() else html_escape(tok)      # ids and plain words need no escaping
        cls = "tok masked" if k < nm and masks[k] == 0 else "tok"
        v = values[k] if k < nv else None
        if v is None:
            add(f'<span class="{cls}">{text}</span>')
            continue
        if span > 0:
            t = (v - low) / span
            bg = f"hsl({round(120 * t)},65%,{round(86 - 6 * abs(t - 0.5))}%)"
        else:
            bg = "hsl(120,55%,88%)" if v else "hsl(0,0%,88%)"
        add(f'<span class="{cls}" style="background:{bg}" title="{name} = {v:.4g}">{text}</span>')
    add("</div>")
    return Markup("".join(parts))
