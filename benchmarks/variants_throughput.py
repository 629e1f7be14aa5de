"""Training throughput (tokens/s, forward+backward) and peak memory of every variant vs sequence length.

Each (variant, seq) runs in a fresh subprocess, so its peak RSS is its own. All variants share one size
(dim, depth, heads, window = segment_len), so the comparison is like for like. The memory variants
should keep flat tokens/s as the sequence grows; full attention should not.

    python benchmarks/variants_throughput.py [--seqs 1024,4096,16384] [--variants mac,mag,...] [--steps 3]

``--preset tiny --set memory_conv_kernel=8`` measures a named preset (any TitansConfig field overridden) in
place of the --dim/--depth/--heads/--window/--chunk-size shape. ``--recompute off,on`` measures each model
also with its blocks recomputed in the backward pass (`TitansLM.gradient_checkpointing`).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench_utils import Timer, machine_info, peak_rss_mib, reply, run_worker, save_json

SHAPE_FLAGS = ("dim", "depth", "heads", "window", "chunk_size")
WORKER_ARGS = (*SHAPE_FLAGS, "batch", "steps", "threads", "preset", "set", "recompute")


def measure(variant: str, seq: int, args: argparse.Namespace) -> dict:
    from titans import TitansConfig, TitansLM
    from titans.training.config import parse_set

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    overrides = parse_set(args.set, model_only=True)
    if args.preset:
        cfg = TitansConfig.preset(args.preset, variant=variant, vocab_size=256, **overrides)
    else:
        cfg = TitansConfig(
            variant=variant,
            vocab_size=256,
            dim=args.dim,
            depth=args.depth,
            heads=args.heads,
            segment_len=args.window,
            window=args.window,
            chunk_size=args.chunk_size,
            persistent_tokens=4,
            **overrides,
        )
    model = TitansLM(cfg)
    model.gradient_checkpointing = args.recompute == "on"
    tokens = torch.randint(0, 256, (args.batch, seq + 1))
    times, cpu_times = [], []
    for i in range(args.steps + 1):  # the first step warms up allocators and caches
        with Timer() as clock:
            logits, _ = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)
        if i:
            times.append(clock.wall)
            cpu_times.append(clock.cpu)
    med, cpu_med = statistics.median(times), statistics.median(cpu_times)
    # tokens per CPU-second: with one thread, the rate the run has on a core of its own (robust on a
    # shared machine, where wall time also counts the neighbours)
    return {
        "variant": variant,
        "seq": seq,
        "recompute": args.recompute,
        "batch": args.batch,
        "tokens_per_s": args.batch * seq / med,
        "tokens_per_cpu_s": args.batch * seq / cpu_med,
        "step_s": med,
        "peak_rss_mb": peak_rss_mib(),
        "params": model.num_parameters(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="mac,mag,mal,lmm,swa,transformer")
    p.add_argument("--seqs", default="1024,4096,16384")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--preset", help="a TitansConfig preset (tiny, small, ...) in place of the shape flags")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a TitansConfig field")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each worker")
    p.add_argument("--recompute", default="off", help="off, on (gradient checkpointing) or off,on")
    p.add_argument("--out", default="variants_throughput", help="a path, or a name in benchmarks/results/")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        reply(measure(spec["variant"], spec["seq"], argparse.Namespace(**spec)))
        return
    settings = args.recompute.split(",")
    if not set(settings) <= {"off", "on"}:
        p.error(f"--recompute takes off, on or off,on, got {args.recompute!r}")
    machine = machine_info()
    rows = []
    shape = (
        f"preset {args.preset}"
        if args.preset
        else f"dim {args.dim}, depth {args.depth}, window/segment {args.window}, chunk {args.chunk_size}"
    )
    if args.set:
        shape += ", " + ", ".join(args.set)
    print(
        f"fwd+bwd, batch {args.batch}, {shape}, {args.threads} threads; median of {args.steps} steps; "
        f"load average {machine['loadavg_start'][0]:.1f}"
    )
    print(
        f"{'variant':12s} {'seq':>7s} {'recompute':>9s} {'tokens/s':>10s} {'tok/CPU-s':>10s} {'step s':>8s} "
        f"{'peak RSS MB':>12s}"
    )
    for variant in args.variants.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            for recompute in settings:
                spec = {k: getattr(args, k) for k in WORKER_ARGS}
                row = run_worker(__file__, {**spec, "variant": variant, "seq": seq, "recompute": recompute})
                if "error" in row:
                    row = {"variant": variant, "seq": seq, "recompute": recompute, **row}
                    print(f"{variant:12s} {seq:7d} {recompute:>9s}  failed: {row['error']}")
                else:
                    print(
                        f"{variant:12s} {seq:7d} {recompute:>9s} {row['tokens_per_s']:10.0f} "
                        f"{row['tokens_per_cpu_s']:10.0f} {row['step_s']:8.2f} {row['peak_rss_mb']:12.0f}"
                    )
                rows.append(row)
    # with a preset the shape flags did not apply: record only what did
    recorded = {k: v for k, v in vars(args).items() if not (args.preset and k in SHAPE_FLAGS)}
    print(f"wrote {save_json(args.out, {'args': recorded, 'results': rows}, machine)}")


if __name__ == "__main__":
    main()
