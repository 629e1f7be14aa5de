"""The `titans inspect` page: the text coloured by surprise, SVG line charts along the text and the
per-layer, per-head table of the `MemoryReport`, as one self-contained HTML file (CSS, JavaScript and the
plots inline; no network, no external files).

    page = render_html(trace, token_texts(tokenizer, ids), "title", meta={"checkpoint": "runs/main"})
"""

from __future__ import annotations

import html
import json
import math

import numpy as np

from titans.inference.inspection.trace import Trace
from titans.models.monitor import HEAD_FIELDS

MAX_POINTS = 1200  # points per plotted line (longer series are averaged in bins)
COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


# ------------------------------------------------------------------------------------------ plots
def _binned(xs: np.ndarray, ys: np.ndarray, points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    if len(xs) <= points:
        return xs, ys
    edges = np.linspace(0, len(xs), points + 1).astype(int)
    bx = np.array([xs[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
    by = np.array(
        [np.nanmean(ys[a:b]) if np.isfinite(ys[a:b]).any() else np.nan for a, b in zip(edges[:-1], edges[1:])]
    )
    return bx, by


def fmt(v: float) -> str:
    """A number in three significant digits (small ones in exponent form)."""
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def svg_chart(
    title: str,
    series: list[tuple[str, np.ndarray, np.ndarray]],
    x_max: float,
    hlines: tuple[tuple[float, str], ...] = (),
    width: int = 1100,
    height: int = 150,
    log: bool = False,
) -> str:
    """A line chart as inline SVG: series of (label, xs, ys), dashed horizontal lines (y, label)."""
    left, right, top, bottom = 62, 150, 22, 22
    values = [y for _, _, ys in series for y in ys if math.isfinite(y) and (y > 0 or not log)]
    values += [y for y, _ in hlines]
    if not values:
        return f'<div class="chart"><b>{html.escape(title)}</b>: no values</div>'
    lo, hi = min(values), max(values)
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
    pad = (hi - lo) * 0.06
    floor = 0.0 if not log and lo >= 0 else -math.inf  # a non-negative quantity keeps its axis at >= 0
    lo, hi = max(floor, lo - pad), hi + pad
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + pw * x / max(x_max, 1)

    def sy(y: float) -> float:
        y = math.log10(y) if log else y
        return top + ph * (1 - (y - lo) / (hi - lo))

    parts = [
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
        f'<text x="{left}" y="14" class="title">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>',
    ]
    for frac in (0, 0.5, 1):
        y = top + ph * (1 - frac)
        v = lo + (hi - lo) * frac
        label = fmt(10**v if log else v)
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{label}</text>')
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
    for frac in (0, 0.25, 0.5, 0.75, 1):
        x = left + pw * frac
        label = round(x_max * frac)
        parts.append(f'<text x="{x:.1f}" y="{height - 6}" class="tick" text-anchor="middle">{label}</text>')
    for y, label in hlines:
        if (not log or y > 0) and lo <= (math.log10(y) if log else y) <= hi:
            parts.append(
                f'<line x1="{left}" x2="{left + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" class="hline"/>'
            )
            parts.append(f'<text x="{left + 4}" y="{sy(y) - 3:.1f}" class="tick">{html.escape(label)}</text>')
    for n, (label, xs, ys) in enumerate(series):
        colour = COLOURS[n % len(COLOURS)]
        xs, ys = _binned(np.asarray(xs, float), np.asarray(ys, float))
        runs, run = [], []
        for x, y in zip(xs, ys):
            if math.isfinite(y) and (y > 0 or not log):
                run.append(f"{sx(x):.1f},{sy(y):.1f}")
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
        for r in runs:
            if len(r) == 1:
                cx, cy = r[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{colour}"/>')
            else:
                parts.append(
                    f'<polyline points="{" ".join(r)}" fill="none" stroke="{colour}" stroke-width="1.3"/>'
                )
        ly = top + 12 + 14 * n
        parts.append(f'<rect x="{left + pw + 8}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>')
        parts.append(f'<text x="{left + pw + 22}" y="{ly}" class="tick">{html.escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _rolling(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of the last `window` values (fewer at the start), NaNs skipped."""
    v = np.where(np.isfinite(values), values, 0.0)
    ok = np.isfinite(values).astype(float)
    cs, cn = np.concatenate([[0], np.cumsum(v)]), np.concatenate([[0], np.cumsum(ok)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    n = cn[idx] - cn[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (cs[idx] - cs[lo]) / np.maximum(n, 1), np.nan)


# ------------------------------------------------------------------------------------------ html
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d1d1f;
 background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 8px}
.meta{color:#555;margin-bottom:10px} .legend span{display:inline-block;margin-right:14px}
#text{font:13px/1.9 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;
 border:1px solid #ddd;border-radius:6px;padding:12px;max-height:420px;overflow:auto;background:#fcfcfc}
.t{border-radius:2px;cursor:default} .t:hover{outline:1px solid #000}
.w{box-shadow:inset 0 -3px 0 rgba(20,70,230,var(--w))}
#info{position:sticky;top:0;background:#f4f6fa;border:1px solid #d8dce6;border-radius:6px;padding:6px 10px;
 margin:8px 0;font:12px ui-monospace,Menlo,Consolas,monospace;min-height:18px}
.chart{display:block;margin:6px 0} .chart .title{font:600 12px system-ui,sans-serif;fill:#222}
.chart .tick{font:10px system-ui,sans-serif;fill:#555} .chart .frame{fill:#fafafa;stroke:#ccc}
.chart .grid{stroke:#eee} .chart .hline{stroke:#444;stroke-dasharray:4 3}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
th{background:#f3f3f3} .bar{display:inline-block;width:160px;height:10px;vertical-align:middle;
 background:linear-gradient(90deg,hsl(52,95%,96%),hsl(40,95%,85%),hsl(27,95%,74%),hsl(14,95%,63%),
 hsl(2,95%,52%));border:1px solid #ccc}
"""

JS = """
const info=document.getElementById('info');
document.getElementById('text').addEventListener('mouseover',e=>{
 const t=e.target.closest('.t'); if(!t) return;
 info.textContent=t.dataset.i;
});
"""


def _colour(z: float) -> str:
    """Pale yellow (low surprise) through orange to red (high), z in [0, 1]; dark text stays readable."""
    z = min(1.0, max(0.0, z)) if math.isfinite(z) else 0.0
    return f"hsl({52 - 50 * z:.0f},95%,{96 - 44 * z:.0f}%)"


def render_html(trace: Trace, pieces: list[str], title: str, meta: dict[str, str] | None = None) -> str:
    """The report page for `trace` and the text of each token (`pieces`, T strings)."""
    T = len(pieces)
    s_mean = trace.surprise.mean(0)
    finite = s_mean[np.isfinite(s_mean)]
    lo, hi = (np.percentile(finite, 2), np.percentile(finite, 98)) if finite.size else (0.0, 1.0)
    heads = trace.written.shape[1]
    write_share = trace.written.reshape(len(trace.layers) * heads, T).mean(0)
    gated = trace.threshold is not None
    spans = []
    for t, text in enumerate(pieces):
        z = (s_mean[t] - lo) / (hi - lo) if hi > lo else 0.0
        per_layer = ", ".join(f"L{layer} {fmt(trace.surprise[i, t])}" for i, layer in enumerate(trace.layers))
        written = int(round(write_share[t] * len(trace.layers) * heads))
        detail = (
            f"#{t} {json.dumps(text)[1:-1][:24]!s} | surprise {fmt(s_mean[t])} ({per_layer}) | written by "
            f"{written}/{len(trace.layers) * heads} heads | loss {fmt(trace.loss[t])}"
        )
        cls = "t w" if gated and write_share[t] > 0 else "t"
        style = f"background:{_colour(z)}"
        if gated and write_share[t] > 0:
            style += f";--w:{0.25 + 0.75 * write_share[t]:.2f}"
        shown = html.escape(text) if text else "\u200b"
        tip = html.escape(detail)
        spans.append(f'<span class="{cls}" style="{style}" title="{tip}" data-i="{tip}">{shown}</span>')
    xs = np.arange(T)
    window = max(8, T // 100)
    names = [f"L{layer}" for layer in trace.layers]
    charts = [
        svg_chart(
            "surprise ||u_t|| (head mean"
            + (f"; dashed: threshold {fmt(trace.threshold)})" if gated else ")"),
            [(n, xs, trace.surprise[i]) for i, n in enumerate(names)],
            T,
            hlines=((trace.threshold, "threshold"),) if gated else (),
        ),
        svg_chart(
            f"write rate (share of heads writing, rolling mean over {window} tokens)",
            [(n, xs, _rolling(trace.written[i].mean(0), window)) for i, n in enumerate(names)],
            T,
            hlines=((0.2, "0.2"),),
        ),
        svg_chart(
            "||W|| (largest memory-MLP layer, head mean) after each piece"
            + (f"; dashed: max_norm {fmt(trace.max_norm)} and 0.8 of it" if trace.max_norm else ""),
            [(n, trace.norm_at, trace.weight_norm[i]) for i, n in enumerate(names)],
            T,
            hlines=((trace.max_norm, "max_norm"), (0.8 * trace.max_norm, "0.8 max"))
            if trace.max_norm
            else (),
        ),
        svg_chart("theta (inner learning rate)", [(n, xs, trace.theta[i]) for i, n in enumerate(names)], T),
        svg_chart("eta (momentum decay)", [(n, xs, trace.eta[i]) for i, n in enumerate(names)], T),
        svg_chart("alpha (forgetting)", [(n, xs, trace.alpha[i]) for i, n in enumerate(names)], T, log=True),
        svg_chart(
            f"next-token loss (nats; rolling mean over {window} tokens)",
            [("loss", xs, _rolling(trace.loss, window))],
            T,
        ),
    ]
    rows = []
    for layer in trace.report.layers:
        for h in range(len(layer.surprise_mean)):
            util = "" if layer.utilisation is None else fmt(max(row[h] for row in layer.utilisation))
            cells = [
                f"L{layer.layer}",
                str(h),
                *(fmt(getattr(layer, k)[h]) for k in HEAD_FIELDS),
                fmt(max(row[h] for row in layer.weight_norm)),
                util,
                fmt(max(row[h] for row in layer.momentum_norm)),
            ]
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    header = "".join(
        f"<th>{c}</th>"
        for c in (
            "layer",
            "head",
            "surprise mean",
            "p50",
            "p95",
            "write rate",
            "theta",
            "eta",
            "alpha",
            "||W|| (max over MLP layers)",
            "utilisation",
            "||S||",
        )
    )
    meta_line = " · ".join(f"{html.escape(k)}: {html.escape(str(v))}" for k, v in (meta or {}).items())
    rate = trace.report.write_rate
    writes = (
        f"threshold {fmt(trace.threshold)}: {rate:.1%} of (layer, head, token) entries written; written "
        "tokens are underlined (darker: more heads wrote)"
        if gated
        else "no surprise threshold: every token is written"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<div class="meta">{meta_line}</div>
<div class="legend"><span>surprise (mean over memory layers and heads):
 {fmt(lo)} <i class="bar"></i> {fmt(hi)}</span><span>{writes}</span></div>
<h2>The text, token by token</h2>
<div id="info">hover a token for its surprise, write decision and loss</div>
<div id="text">{"".join(spans)}</div>
<h2>Along the text</h2>
{"".join(charts)}
<h2>Per layer and head (whole text)</h2>
<table><tr>{header}</tr>{"".join(rows)}</table>
<script>{JS}</script>
</body></html>
"""


__all__ = ["fmt", "render_html", "svg_chart"]
