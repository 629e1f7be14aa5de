"""`titans inspect`: what the memory does along a text, as one self-contained HTML file.

    titans inspect --checkpoint runs/main --text notes.txt --out report.html [--threshold 0.5]

The text is read once (in pieces; streaming equals one pass; `trace`) and the report (`render`) shows,
token by token, the surprise (the colour; hovering a token shows its numbers), the write decisions (tokens
the memory wrote are underlined where a surprise threshold is set), and plots along the text: surprise and
write rate per memory layer, ||W|| per memory layer (against the max norm where one is set), the gates
theta, eta and alpha, and the next-token loss; then the per-layer, per-head table of
`titans.models.monitor.MemoryReport`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

from titans._fs import check_writable, write_text_atomic
from titans.data.sources import open_text
from titans.inference.inspection.render import fmt, render_html
from titans.inference.inspection.trace import set_surprise_threshold, token_texts, trace_text
from titans.runtime.device import resolve_device
from titans.runtime.loading import load_trained
from titans.validation import path_arg, text_arg

DEFAULT_MAX_TOKENS = 4000


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
        source = str(path)
    else:
        source = "--prompt"
    out = Path(args.out)
    check_writable(out, {"--text": args.text})  # before the trace: a report that cannot be written loses it
    device = resolve_device(args.device)
    model, tokenizer = load_trained(args.checkpoint, map_location=device)
    if args.threshold is not None:
        set_surprise_threshold(model, args.threshold)
    if args.text is not None:
        ids, truncated = _first_tokens(path, tokenizer, args.max_tokens)
    else:
        ids = tokenizer.encode(args.prompt)
        truncated = len(ids) > args.max_tokens
    if len(ids) < 2:
        raise ValueError(f"{source} holds {len(ids)} token(s); inspect needs at least 2")
    ids = ids[: args.max_tokens]
    trace = trace_text(model, torch.tensor(ids), max_norm=args.max_norm)
    cfg = model.config
    meta = {
        "checkpoint": args.checkpoint,
        "text": source,
        "tokens": f"{len(ids):,}" + (f" (the first {args.max_tokens:,}; --max-tokens)" if truncated else ""),
        "model": f"{cfg.variant} dim={cfg.dim} depth={cfg.depth}, memory layers {trace.layers}",
        "mean loss": fmt(float(np.nanmean(trace.loss))),
    }
    page = render_html(trace, token_texts(tokenizer, ids), f"titans inspect: {Path(source).name}", meta)
    write_text_atomic(out, page)
    print(
        f"inspected {len(ids):,} tokens{' (truncated)' if truncated else ''}: write rate "
        f"{trace.report.write_rate:.1%}, mean surprise {fmt(float(np.nanmean(trace.surprise)))}; wrote {out}"
    )
    return 0


# tokens past --max-tokens encoded before the text is cut: a subword tokenizer may merge across the cut,
# and this many tokens later the first --max-tokens are those of the whole text
_CUT_MARGIN = 64


def _first_tokens(path: Path, tokenizer, max_tokens: int) -> tuple[list[int], bool]:
    """(the ids of the start of the file at `path`, whether it holds more than `max_tokens`): read in
    growing pieces until the tokens pass `max_tokens` (the whole file was read and encoded for a
    100-token report). Line ends are kept as they are, as `titans read` and training read files."""
    with open_text(path) as f:
        text = f.read(4 * (max_tokens + _CUT_MARGIN))
        while True:
            ids = tokenizer.encode(text)
            if len(ids) > max_tokens + _CUT_MARGIN:
                return ids, True
            more = f.read(len(text))
            if not more:
                return ids, len(ids) > max_tokens
            text += more


def register(commands, evals) -> None:
    p = commands.add_parser(
        "inspect",
        help="an HTML report of what the memory does along a text (surprise, writes, ||W||, gates)",
        description="Read a text with a checkpoint's model and write one self-contained HTML report: the "
        "text coloured by surprise token by token, the write decisions, and plots of its statistics.",
    )
    p.add_argument("--checkpoint", type=path_arg, required=True, help="checkpoint folder or run folder")
    p.add_argument("--text", type=path_arg, help="UTF-8 text file to read")
    p.add_argument("--prompt", type=text_arg, help="text to read, given inline")
    p.add_argument("--out", type=path_arg, required=True, help="where to write the HTML report")
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


__all__ = ["check_inspect_args", "register", "run_inspect"]
