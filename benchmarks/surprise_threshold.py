"""Surprise-gated writes on a trained checkpoint: held-out loss and write rate against the threshold.

Thresholds: none, the quantiles of the ungated memory's surprise on the same windows (so the write rates
are spread), and 1e30 (above every surprise: nothing written, only the decay acts). Every held-out window
is read from a fresh state with `forward_with_stats`; the mean next-token loss (nats; bits per byte for a
byte tokenizer: loss / ln 2) and the share of (layer, head, token) entries written are reported. 1 thread.

    python benchmarks/surprise_threshold.py --checkpoint RUN [--seq-len 1024] [--windows 16] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

from bench_utils import machine_info, save_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--quantiles", default="0.1,0.25,0.5,0.75,0.9")
    p.add_argument(
        "--json",
        nargs="?",
        const="surprise_threshold",
        default=None,
        help="write the results: a path, or a name in benchmarks/results/ "
        "(--json alone: surprise_threshold.json there)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from titans.data.loader import EvalWindows
    from titans.data.stream import load_token_streams
    from titans.inference.inspection import set_surprise_threshold
    from titans.training.model_io import load_model

    model, cfg, tokenizer = load_model(args.checkpoint)
    stream = load_token_streams(
        cfg.data, tokenizer, heldout_fraction=cfg.heldout_fraction, cache_dir=cfg.cache_dir
    ).heldout
    windows = list(EvalWindows(stream, seq_len=args.seq_len, num_windows=args.windows, batch_size=4))

    def run(threshold: float | None) -> dict:
        set_surprise_threshold(model, threshold)
        loss, tokens, written, entries, surprises = 0.0, 0, 0, 0, []
        with torch.no_grad():
            for x, y in windows:
                out = model.forward_with_stats(x)
                loss += float(F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
                tokens += y.numel()
                for s in out.stats:
                    written += int(s.written.sum())
                    entries += s.written.numel()
                    surprises.append(s.surprise.flatten())
        mean = loss / tokens
        return {
            "threshold": threshold,
            "loss": mean,
            "bits_per_token": mean / math.log(2),
            "write_rate": written / entries,
            "surprise": torch.cat(surprises).double().numpy(),
        }

    rows = [run(None)]
    quantiles = [float(q) for q in args.quantiles.split(",")]
    for q, tau in zip(quantiles, np.quantile(rows[0]["surprise"], quantiles)):
        row = run(float(tau))
        row["quantile"] = q
        rows.append(row)
    rows.append(run(1e30))  # above every surprise: nothing written, only the decay acts
    print(f"{args.windows} held-out windows x {args.seq_len} tokens, fresh state per window")
    print(f"{'threshold':>10} {'quantile':>9} {'write rate':>11} {'loss':>8} {'bits/token':>11}")
    for r in rows:
        tau = "none" if r["threshold"] is None else f"{r['threshold']:.4g}"
        q = f"{r.get('quantile', 0):.2f}" if "quantile" in r else "-"
        print(f"{tau:>10} {q:>9} {r['write_rate']:>11.3f} {r['loss']:>8.4f} {r['bits_per_token']:>11.4f}")
    for r in rows:
        del r["surprise"]
    if args.json:
        path = save_json(
            args.json,
            {
                "checkpoint": args.checkpoint,
                "seq_len": args.seq_len,
                "windows": args.windows,
                "rows": rows,
                "machine": machine_info(),
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
