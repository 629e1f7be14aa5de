"""Why the `titans` commands flush subnormal floats: per-piece prefill time along a long CPU stream.

Tiny MAC (random weights, random tokens), pieces of 4096 tokens, 1 thread. Each setting runs in a fresh
process, because `torch.set_flush_denormal` must be set before torch starts its thread pool. Prints the
time of every --every-th piece and, at the end, the share of memory weights that are subnormal.

    python benchmarks/subnormal_stream.py [--pieces 49] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_utils import Timer, machine_info, reply, run_worker, save_json


def measure(flush: bool, pieces: int, every: int) -> dict:
    torch.set_flush_denormal(flush)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from titans import TitansConfig, TitansLM

    model = TitansLM(TitansConfig.preset("tiny", variant="mac")).eval()
    gen = torch.Generator().manual_seed(0)
    state, times = None, {}
    with torch.no_grad():
        for i in range(pieces):
            x = torch.randint(0, 256, (1, 4096), generator=gen)
            with Timer() as clock:
                _, state = model(x, state, last_only=True)
            if i % every == 0 or i == pieces - 1:
                times[str(i * 4096)] = clock.wall
    tiny = torch.finfo(torch.float32).tiny
    weights = [w for layer in state.layers for w in layer.memory.weights]
    subnormal = sum(((w != 0) & (w.abs() < tiny)).sum().item() for w in weights)
    return {
        "flush": flush,
        "piece_s": times,
        "subnormal_weight_share": subnormal / sum(w.numel() for w in weights),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pieces", type=int, default=49)
    p.add_argument("--every", type=int, default=8, help="report every n-th piece")
    p.add_argument(
        "--json",
        nargs="?",
        const="subnormal_stream",
        default=None,
        help="write the results: a path, or a name in benchmarks/results/ "
        "(--json alone: subnormal_stream.json there)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        reply(measure(spec["flush"], spec["pieces"], spec["every"]))
        return
    machine = machine_info()
    rows = [
        run_worker(__file__, {"flush": flush, "pieces": args.pieces, "every": args.every}, timeout=3600)
        | {"flush": flush}
        for flush in (False, True)
    ]
    for row in rows:
        if "error" in row:
            raise SystemExit(f"worker (flush={row['flush']}) failed: {row['error']}")
    positions = list(rows[0]["piece_s"])
    print("seconds per 4096-token piece, tiny MAC, 1 thread")
    print(f"{'tokens read':>12s}  {'subnormals kept':>16s}  {'flushed':>8s}")
    for pos in positions:
        kept, flushed = rows[0]["piece_s"][pos], rows[1]["piece_s"][pos]
        print(f"{int(pos):12,d}  {kept:16.2f}  {flushed:8.2f}")
    for row in rows:
        label = "flushed" if row["flush"] else "kept"
        print(f"subnormal memory weights at the end ({label}): {100 * row['subnormal_weight_share']:.1f}%")
    if args.json:
        path = save_json(args.json, {"rows": rows}, machine)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
