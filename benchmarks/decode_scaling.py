"""Decode speed and peak memory vs context length: does the cost per generated token stay flat?

For each (variant, context) a fresh subprocess builds a model (random weights, float32), reads a context of
random tokens with chunked prefill (`titans.inference.prefill`, tokens produced piece by piece, so the
context never exists in memory at once), then times `--bursts` x `--steps` single-token decode steps
through the state. The timed prefill follows one untimed prefill of min(context, 1024) tokens, so that no
row times the process's first call into the model. Reported: prefill tokens/s, decode ms/token and
tokens/s, state size, and the subprocess's peak RSS.
The memory and sliding-window variants should be flat in all of these; the full-attention baseline's KV
cache (and its per-token cost) grows with the context.

    python benchmarks/decode_scaling.py [--variants mac,mag,lmm,swa,transformer] [--contexts 1024,16384,...]
        [--preset tiny] [--steps 32] [--bursts 5] [--threads 1] [--transformer-max 131072] [--json out.json]

Timings on a shared CPU are noisy: decode time is reported as the median over all timed steps and as the
best median of one burst (the least disturbed by other jobs); each row is one run.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench_utils import Timer, machine_info, peak_rss_mib, random_pieces, reply, run_worker, save_json

WORKER_ARGS = ("preset", "steps", "bursts", "warmup", "threads")


def measure(variant: str, context: int, args: argparse.Namespace) -> dict:
    from titans import TitansConfig, TitansLM
    from titans.inference import decode_step, default_piece_len, prefill, state_nbytes

    torch.set_flush_denormal(True)  # as the titans commands do: subnormal memory weights slow long streams
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TitansLM(TitansConfig.preset(args.preset, variant=variant)).eval()
    vocab = model.config.vocab_size
    piece = default_piece_len(model)
    warm = min(context, 1024)  # one untimed prefill first: the timed one is not the process's first call
    prefill(model, random_pieces(warm, vocab, piece, seed=2), piece_len=piece)
    with Timer() as clock:
        logits, state = prefill(model, random_pieces(context, vocab, piece, seed=1), piece_len=piece)
    prefill_s = clock.wall
    token = logits.argmax(-1, keepdim=True)
    bursts = []  # several bursts of steps: the best burst median is least disturbed by other jobs
    with torch.no_grad():
        for i in range(args.warmup + args.bursts * args.steps):
            with Timer() as clock:
                logits, state = decode_step(model, token, state)
                token = logits.argmax(-1, keepdim=True)
            if i >= args.warmup:
                if (i - args.warmup) % args.steps == 0:
                    bursts.append([])
                bursts[-1].append(clock.wall)
    ms = 1000 * statistics.median([t for burst in bursts for t in burst])
    best_ms = 1000 * min(statistics.median(burst) for burst in bursts)
    return {
        "variant": variant,
        "preset": args.preset,
        "params": model.num_parameters(),
        "context": context,
        "prefill_s": round(prefill_s, 2),
        "prefill_tok_s": round(context / prefill_s),
        "decode_ms_median": round(ms, 3),
        "decode_tok_s": round(1000 / ms, 1),
        "decode_ms_best_burst": round(best_ms, 3),
        "state_mib": round(state_nbytes(state) / 2**20, 3),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "threads": args.threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="mac,mag,mal,lmm,swa,transformer")
    p.add_argument("--contexts", default="1024,16384,131072,1048576")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per burst")
    p.add_argument("--bursts", type=int, default=5, help="bursts of timed steps")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--transformer-max", type=int, default=131072, help="largest context for full attention")
    p.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    p.add_argument(
        "--json", default=None, help="write the results here (a path, or a name in benchmarks/results/)"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        reply(measure(spec["variant"], spec["context"], argparse.Namespace(**spec)))
        return
    machine = machine_info()

    rows = []
    header = (
        f"{'variant':<12}{'context':>10}{'prefill tok/s':>15}{'decode ms/tok':>15}{'best burst':>12}"
        f"{'decode tok/s':>14}"
        f"{'state MiB':>11}{'peak RSS MiB':>14}"
    )
    print(header)
    for variant in args.variants.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            if variant == "transformer" and context > args.transformer_max:
                continue
            spec = {"variant": variant, "context": context, **{k: getattr(args, k) for k in WORKER_ARGS}}
            r = run_worker(__file__, spec, timeout=args.timeout)
            if "error" in r:
                print(f"{variant:<12}{context:>10}   {r['error']}")
                rows.append({"variant": variant, "context": context, **r})
                continue
            rows.append(r)
            print(
                f"{variant:<12}{context:>10}{r['prefill_tok_s']:>15,}{r['decode_ms_median']:>15.2f}"
                f"{r['decode_ms_best_burst']:>12.2f}"
                f"{r['decode_tok_s']:>14.1f}{r['state_mib']:>11.3f}{r['peak_rss_mib']:>14.1f}",
                flush=True,
            )
    result = {"benchmark": "decode_scaling", "rows": rows}
    print(json.dumps(result))
    if args.json:
        print(f"wrote {save_json(args.json, result, machine)}")


if __name__ == "__main__":
    main()
