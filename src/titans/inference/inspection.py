"""`titans inspect`: what the memory does along a text, as one self-contained HTML file.

    titans inspect --checkpoint runs/main --text notes.txt --out report.html [--threshold 0.5]

The text is read once (in pieces; streaming equals one pass) and the report shows, token by token, the
surprise (the colour; hovering a token shows its numbers), the write decisions (tokens the memory wrote are
underlined where a surprise threshold is set), and plots along the text: surprise and write rate per memory
layer, ||W|| per memory layer (against the max norm where one is set), the gates theta, eta and alpha, and
the next-token loss; then the per-layer, per-head table of `titans.models.monitor.MemoryReport`. No
network, no external files: CSS, JavaScript and the SVG plots are inline.
"""

from __future__ import annotations

import argparse
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from titans.inference.generation import IncrementalDecoder
from titans.layers.memory import NeuralMemory
from titans.models.lm import TitansLM
from titans.models.monitor import (
    HEAD_FIELDS,
    MemoryMonitor,
    MemoryReport,
    find_memory_state,
    memory_layers,
)
from titans.models.streaming import iter_pieces
from titans.ops.memory import check_threshold
from titans.runtime.device import resolve_device
from titans.runtime.loading import load_trained

DEFAULT_MAX_TOKENS = 4000
MAX_POINTS = 1200  # points per plotted line (longer series are averaged in bins)
COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


@dataclass
class Trace:
    """Per-token and per-piece numbers of one text read by a model. Token arrays are (L, T) for the L memory
    layers (head means), (L, H, T) for `written`; `norm_at` (P,) are the positions after each piece and
    `weight_norm` (L, P) the largest ||W_l|| (head mean) of each memory layer there."""

    layers: list[int]
    surprise: np.ndarray
    written: np.ndarray
    theta: np.ndarray
    eta: np.ndarray
    alpha: np.ndarray
    loss: np.ndarray  # (T,): the loss of predicting token t from the tokens before it (NaN for t = 0)
    norm_at: np.ndarray
    weight_norm: np.ndarray
    report: MemoryReport
    threshold: float | None
    max_norm: float | None
    extra: dict = field(default_factory=dict)


def _piece_len(model: TitansLM, tokens: int) -> int:
    """A multiple of the streaming unit giving about 100 pieces (the ||W|| plot's resolution)."""
    unit = model.config.spec.streaming_unit(model.config)
    return max(unit, math.ceil(tokens / 100 / unit) * unit)


@torch.no_grad()
def trace_text(model: TitansLM, tokens: Tensor, max_norm: float | None = None, state=None) -> Trace:
    """Read tokens (T,) or (1, T) with `model` from `state` and gather the `Trace`."""
    tokens = tokens.reshape(1, -1).to(next(model.parameters()).device, torch.int64)
    layers = memory_layers(model)
    if not layers:
        raise ValueError(f"inspect: the model ({model.config.variant}) has no neural memory to inspect")
    monitor = MemoryMonitor(model, max_norm)
    losses, norm_at, norms, last = [float("nan")], [], [], None
    for piece in iter_pieces(tokens, _piece_len(model, tokens.shape[1])):
        out = model.forward_with_stats(piece, state)
        state = out.state
        monitor.update(out.stats)
        logits = out.logits[0].float()
        if last is not None:
            losses.append(float(F.cross_entropy(last[None], piece[0, :1])))
        if piece.shape[1] > 1:
            losses.extend(F.cross_entropy(logits[:-1], piece[0, 1:], reduction="none").tolist())
        last = logits[-1]
        norm_at.append(state.position)
        norms.append(
            [
                max(float(torch.linalg.vector_norm(w.double(), dim=(-2, -1)).mean()) for w in ms.weights)
                for ms in (find_memory_state(state.layers[i]) for i in layers)
            ]
        )
    stats = monitor.layer_stats()

    def per_layer(name: str) -> np.ndarray:
        return np.stack([getattr(stats[i], name)[0].double().mean(0).cpu().numpy() for i in layers])

    written = np.stack([stats[i].written[0].cpu().numpy() for i in layers])
    report = monitor.report(state)
    return Trace(
        layers=layers,
        surprise=per_layer("surprise"),
        written=written,
        theta=per_layer("theta"),
        eta=per_layer("eta"),
        alpha=per_layer("alpha"),
        loss=np.array(losses),
        norm_at=np.array(norm_at),
        weight_norm=np.array(norms).T,
        report=report,
        threshold=report.surprise_threshold,
        max_norm=report.max_norm,
    )


def set_surprise_threshold(model: TitansLM, threshold: float | None) -> None:
    """Every memory of `model` gates its writes at `threshold` from now on (None: writes every token)."""
    check_threshold("inspect: threshold", threshold)
    for module in model.modules():
        if isinstance(module, NeuralMemory):
            module.surprise_threshold = threshold


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


def _fmt(v: float) -> str:
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
        label = _fmt(10**v if log else v)
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
        per_layer = ", ".join(
            f"L{layer} {_fmt(trace.surprise[i, t])}" for i, layer in enumerate(trace.layers)
        )
        written = int(round(write_share[t] * len(trace.layers) * heads))
        detail = (
            f"#{t} {json.dumps(text)[1:-1][:24]!s} | surprise {_fmt(s_mean[t])} ({per_layer}) | written by "
            f"{written}/{len(trace.layers) * heads} heads | loss {_fmt(trace.loss[t])}"
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
            + (f"; dashed: threshold {_fmt(trace.threshold)})" if gated else ")"),
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
            + (f"; dashed: max_norm {_fmt(trace.max_norm)} and 0.8 of it" if trace.max_norm else ""),
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
            util = "" if layer.utilisation is None else _fmt(max(row[h] for row in layer.utilisation))
            cells = [
                f"L{layer.layer}",
                str(h),
                *(_fmt(getattr(layer, k)[h]) for k in HEAD_FIELDS),
                _fmt(max(row[h] for row in layer.weight_norm)),
                util,
                _fmt(max(row[h] for row in layer.momentum_norm)),
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
        f"threshold {_fmt(trace.threshold)}: {rate:.1%} of (layer, head, token) entries written; written "
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
 {_fmt(lo)} <i class="bar"></i> {_fmt(hi)}</span><span>{writes}</span></div>
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


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """The text of each token, as it completes (a character split over several byte tokens shows on the
    last of them; the others are empty)."""
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    rest = decoder.finish()
    if pieces and rest:
        pieces[-1] += rest
    return pieces


# ------------------------------------------------------------------------------------------ command
def check_inspect_args(args: argparse.Namespace) -> None:
    if (args.text is None) == (args.prompt is None):
        raise ValueError("give exactly one of --text FILE and --prompt STR")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    if args.threshold is not None and not 0 <= args.threshold < math.inf:
        raise ValueError(f"--threshold must be a finite number >= 0, got {args.threshold}")
    if args.max_norm is not None and not 0 < args.max_norm < math.inf:
        raise ValueError(f"--max-norm must be a finite number > 0, got {args.max_norm}")


def run_inspect(args: argparse.Namespace) -> int:
    check_inspect_args(args)
    if args.text is not None:
        path = Path(args.text)
        if not path.is_file():
            raise FileNotFoundError(f"no text file at {str(path)!r}")
        text = path.read_text(encoding="utf-8", errors="replace")
        source = str(path)
    else:
        text, source = args.prompt, "--prompt"
    device = resolve_device(args.device)
    model, tokenizer = load_trained(args.checkpoint, map_location=device)
    if args.threshold is not None:
        set_surprise_threshold(model, args.threshold)
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise ValueError(f"{source} holds {len(ids)} token(s); inspect needs at least 2")
    truncated = len(ids) > args.max_tokens
    ids = ids[: args.max_tokens]
    trace = trace_text(model, torch.tensor(ids), max_norm=args.max_norm)
    cfg = model.config
    meta = {
        "checkpoint": args.checkpoint,
        "text": source,
        "tokens": f"{len(ids):,}" + (f" (the first {args.max_tokens:,}; --max-tokens)" if truncated else ""),
        "model": f"{cfg.variant} dim={cfg.dim} depth={cfg.depth}, memory layers {trace.layers}",
        "mean loss": _fmt(float(np.nanmean(trace.loss))),
    }
    page = render_html(trace, token_texts(tokenizer, ids), f"titans inspect: {Path(source).name}", meta)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    print(
        f"inspected {len(ids):,} tokens{' (truncated)' if truncated else ''}: write rate "
        f"{trace.report.write_rate:.1%}, mean surprise {_fmt(float(np.nanmean(trace.surprise)))}; wrote {out}"
    )
    return 0


def register(commands, evals) -> None:
    p = commands.add_parser(
        "inspect",
        help="an HTML report of what the memory does along a text (surprise, writes, ||W||, gates)",
        description="Read a text with a checkpoint's model and write one self-contained HTML report: the "
        "text coloured by surprise token by token, the write decisions, and plots of its statistics.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder")
    p.add_argument("--text", help="UTF-8 text file to read")
    p.add_argument("--prompt", help="text to read, given inline")
    p.add_argument("--out", required=True, help="where to write the HTML report")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="surprise threshold for the memory's writes (default: the model's memory_surprise_threshold)",
    )
    p.add_argument(
        "--max-norm",
        type=float,
        default=None,
        help="||W|| that counts as full (default: the model's memory_monitor_max_norm, else its "
        "memory_max_norm)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="read at most this many tokens of the text"
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    p.set_defaults(func=run_inspect, check=check_inspect_args)


__all__ = [
    "Trace",
    "check_inspect_args",
    "render_html",
    "run_inspect",
    "set_surprise_threshold",
    "svg_chart",
    "trace_text",
]
