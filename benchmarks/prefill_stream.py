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

import torch

from bench_utils import (
    Timer,
    current_rss_mib,
    machine_info,
    peak_rss_mib,
    random_pieces,
    reply,
    run_worker,
    save_json,
)

WORKER_ARGS = ("variant", "preset", "piece_len", "threads")


def measure(variant: str, length: int, args: argparse.Namespace) -> dict:
    from titans import TitansConfig, TitansLM
    from titans.inference import default_piece_len, prefill, state_nbytes

    torch.set_flush_denormal(True)  # as the titans commands do: subnormal memory weights slow long streams
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TitansLM(TitansConfig.preset(args.preset, variant=variant)).eval()
    piece = args.piece_len or default_piece_len(model)
    rss_model = current_rss_mib()
    with Timer() as clock:
        logits, state = prefill(
            model, random_pieces(length, model.config.vocab_size, piece, 1), piece_len=piece
        )
    seconds = clock.wall
    return {
        "variant": variant,
        "preset": args.preset,
        "params": model.num_parameters(),
        "tokens": length,
        "piece_len": piece,
        "wall_s": round(seconds, 1),
        "tok_s": round(length / seconds),
        "rss_after_model_mib": round(rss_model, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
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
    p.add_argument(
        "--json", default=None, help="write the results here (a path, or a name in benchmarks/results/)"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        reply(measure(spec["variant"], spec["length"], argparse.Namespace(**spec)))
        return
    machine = machine_info()

    print(
        f"{'variant':<10}{'tokens':>11}{'wall s':>9}{'tok/s':>9}{'model RSS MiB':>15}{'peak RSS MiB':>14}"
        f"{'state MiB':>11}"
    )
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        spec = {"length": length, **{k: getattr(args, k) for k in WORKER_ARGS}}
        r = run_worker(__file__, spec, timeout=args.timeout)
        if "error" in r:
            print(f"{args.variant:<10}{length:>11}   {r['error']}")
            rows.append({"variant": args.variant, "tokens": length, **r})
            continue
        rows.append(r)
        print(
            f"{r['variant']:<10}{length:>11,}{r['wall_s']:>9.1f}{r['tok_s']:>9,}{r['rss_after_model_mib']:>15.1f}"
            f"{r['peak_rss_mib']:>14.1f}{r['state_mib']:>11.3f}",
            flush=True,
        )
    done_rows = [r for r in rows if "peak_rss_mib" in r]
    result = {"benchmark": "prefill_stream", "rows": rows}
    if len(done_rows) >= 2:
        longest = max(done_rows, key=lambda r: r["tokens"])
        shortest = min(done_rows, key=lambda r: r["tokens"])
        ratio = longest["peak_rss_mib"] / shortest["peak_rss_mib"]
        result["peak_rss_ratio_longest_vs_shortest"] = round(ratio, 3)
        print(f"peak RSS, {longest['tokens']:,} vs {shortest['tokens']:,} tokens: x{ratio:.3f}")
    print(json.dumps(result))
    if args.json:
        print(f"wrote {save_json(args.json, result, machine)}")


if __name__ == "__main__":
    main()
