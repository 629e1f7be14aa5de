"""Chunked prefill of a very long stream: wall time and peak RSS, at 64K tokens and at 2M tokens.

Each length runs in a fresh subprocess: a model (random weights, float32) reads a stream of random tokens
that a generator produces piece by piece (the stream never exists in memory), through
`titans.inference.prefill`. Memory must be bounded by the state, not the stream: the peak RSS of the 2M
run should be within 10% of the 64K run's. Also reported: the RSS right after building the model (the
fixed cost: Python, torch, weights) and the state size.

    python benchmarks/prefill_stream.py [--variant mac] [--preset tiny] [--lengths 65536,2097152]
        [--threads 1] [--json out.json]

Timings on a shared CPU are noisy (one run per row).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_utils import current_rss_gib, random_pieces


def measure(variant: str, length: int, args: argparse.Namespace) -> dict:
    from titans import TitansConfig, TitansLM
    from titans.inference import default_piece_len, prefill, state_nbytes

    torch.set_flush_denormal(True)  # as the titans commands do: subnormal memory weights slow long streams
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TitansLM(TitansConfig.preset(args.preset, variant=variant)).eval()
    piece = args.piece_len or default_piece_len(model)
    rss_model = current_rss_gib() * 1024
    t0 = time.perf_counter()
    logits, state = prefill(model, random_pieces(length, model.config.vocab_size, piece, 1), piece_len=piece)
    seconds = time.perf_counter() - t0
    return {
        "variant": variant,
        "preset": args.preset,
        "params": model.num_parameters(),
        "tokens": length,
        "piece_len": piece,
        "wall_s": round(seconds, 1),
        "tok_s": round(length / seconds),
        "rss_after_model_mib": round(rss_model, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "state_mib": round(state_nbytes(state) / 2**20, 3),
        "finite": bool(torch.isfinite(logits).all()),
        "threads": args.threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="mac")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--lengths", default="65536,2097152")
    p.add_argument("--piece-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.variant, args.worker, args)))
        return

    print(
        f"{'variant':<10}{'tokens':>11}{'wall s':>9}{'tok/s':>9}{'model RSS MiB':>15}{'peak RSS MiB':>14}"
        f"{'state MiB':>11}"
    )
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            str(length),
            "--variant",
            args.variant,
            "--preset",
            args.preset,
            "--threads",
            str(args.threads),
        ]
        if args.piece_len:
            cmd += ["--piece-len", str(args.piece_len)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
        except subprocess.TimeoutExpired:
            print(f"{args.variant:<10}{length:>11}   timed out after {args.timeout} s")
            rows.append({"variant": args.variant, "tokens": length, "timeout_s": args.timeout})
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(
            f"{r['variant']:<10}{length:>11,}{r['wall_s']:>9.1f}{r['tok_s']:>9,}{r['rss_after_model_mib']:>15.1f}"
            f"{r['peak_rss_mib']:>14.1f}{r['state_mib']:>11.3f}",
            flush=True,
        )
    done_rows = [r for r in rows if "peak_rss_mib" in r]
    result = {"benchmark": "prefill_stream", "torch": torch.__version__, "rows": rows}
    if len(done_rows) >= 2:
        ratio = done_rows[-1]["peak_rss_mib"] / done_rows[0]["peak_rss_mib"]
        result["peak_rss_ratio_longest_vs_shortest"] = round(ratio, 3)
        print(f"peak RSS, {done_rows[-1]['tokens']:,} vs {done_rows[0]['tokens']:,} tokens: x{ratio:.3f}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
