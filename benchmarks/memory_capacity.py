"""Capacity of the neural memory at test time: deep (MLP) vs linear memory, no outer training.

    python benchmarks/memory_capacity.py [--dim 64] [--pairs 16,32,...,1024] [--epochs 4] [--seeds 2]
        [--out memory_capacity]

N random associations k_i -> v_i (unit-norm keys, values ~ N(0, 1/d) so |v|^2 ~ 1) are written into a
fresh memory by `neural_memory_chunked` itself: chunk size 1 (the exact per-token recurrence), --epochs
passes over the stream, no momentum (eta = 0), no forgetting (alpha = 0), no surprise clipping. Then the
final weights are read with every key: recall error = sum_i |M(k_i) - v_i|^2 / sum_i |v_i|^2 (1.0 is an
empty memory, whose last layer starts at zero; 0 is perfect recall).

Memories, per head of width d: linear (a d x d matrix, d^2 parameters); depth-2 MLPs with hidden width
d/2 (2 d (d/2) = d^2 parameters: the same state size), d (2 d^2) and 4d (8 d^2). The inner learning rate
theta is tuned per memory and N over a small grid and the best is reported (a diverged run counts as
failed), so each memory is shown at its best.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from bench_utils import Timer, machine_info, print_table, save_json
from titans.ops.memory import memory_forward, neural_memory_chunked

THETAS = (0.003, 0.01, 0.03, 0.1, 0.3, 0.5, 1.0, 2.0)


def memories(d: int) -> dict[str, list[int]]:
    """name -> layer sizes [d_in, hidden..., d_out]."""
    return {
        "linear (d^2)": [d, d],
        "mlp h=d/2 (d^2)": [d, d // 2, d],
        "mlp h=d (2d^2)": [d, d, d],
        "mlp h=4d (8d^2)": [d, 4 * d, d],
    }


def recall_error(sizes: list[int], keys, values, theta: float, epochs: int, seed: int) -> float:
    """Write keys -> values `epochs` times with chunk size 1; relative recall error of the final weights."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(1, 1, a, b, generator=g) / math.sqrt(a) for a, b in zip(sizes[:-1], sizes[1:])]
    weights[-1].zero_()  # an empty memory reads 0: error 1.0 before writing
    momentum = tuple(torch.zeros_like(w) for w in weights)
    k = keys.repeat(epochs, 1)[None, None]
    v = values.repeat(epochs, 1)[None, None]
    t = k.shape[2]
    theta_t = torch.full((1, 1, t), theta)
    no_momentum = torch.full((1, 1, t), float("-inf"))
    no_forgetting = torch.zeros(1, 1, t)
    with torch.no_grad():
        _, w_end, _, _ = neural_memory_chunked(
            k, k, v, theta_t, no_momentum, no_forgetting, tuple(weights), momentum, chunk_size=1
        )
        pred = memory_forward(keys[None, None], w_end, "silu", False)[0, 0]
    err = ((pred - values).pow(2).sum() / values.pow(2).sum()).item()
    return err if math.isfinite(err) else float("inf")


def measure_all(args: argparse.Namespace, d: int, counts: list[int], info: dict, clock: Timer) -> None:
    """Every memory at every N and theta; print the tables and write the result file."""
    results = {}  # (memory, N) -> {theta: mean error}
    for name, sizes in memories(d).items():
        for n in counts:
            per_theta = {}
            for theta in THETAS:
                errs = []
                for seed in range(args.seeds):
                    g = torch.Generator().manual_seed(1000 * seed + n)
                    keys = F.normalize(torch.randn(n, d, generator=g), dim=-1)
                    values = torch.randn(n, d, generator=g) / math.sqrt(d)
                    errs.append(recall_error(sizes, keys, values, theta, args.epochs, seed))
                per_theta[theta] = sum(errs) / len(errs)
            results[name, n] = per_theta
        print(f"  {name} done ({clock.elapsed():.0f} s)", flush=True)

    rows = []
    for n in counts:
        row = {"N": n, "N/d": n / d}
        for name in memories(d):
            theta, err = min(results[name, n].items(), key=lambda kv: kv[1])
            row[name] = f"{err:.3f} @{theta:g}" if math.isfinite(err) else "diverged"
        rows.append(row)
    print(f"\nRecall error (best over theta; 1.0 = empty memory), d = {d}, {args.epochs} epochs, chunk 1")
    print_table(rows, [("N", "N"), ("N/d", "N/d")] + [(m, m) for m in memories(d)])
    print("\nLargest N recalled with error < 0.1:")
    for name in memories(d):
        ok = [n for n in counts if min(results[name, n].values()) < 0.1]
        print(f"  {name:18s} {max(ok) if ok else '-'}")
    path = save_json(
        args.out,
        {
            "machine": info,
            "config": {"dim": d, "epochs": args.epochs, "seeds": args.seeds, "thetas": THETAS, "chunk": 1},
            "errors": [
                {"memory": m, "N": n, "theta": th, "error": e if math.isfinite(e) else None}
                for (m, n), per in results.items()
                for th, e in per.items()
            ],
            "rows": rows,
        },
    )
    print(f"wrote {path}  ({clock.elapsed():.0f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pairs", default="16,32,64,128,256,512,1024")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seeds", type=int, default=2, help="random association sets averaged per point")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny matmuls: 1 is fastest)")
    p.add_argument("--out", default="memory_capacity", help="a path, or a name in benchmarks/results/")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    d, counts = args.dim, [int(n) for n in args.pairs.split(",")]
    info = machine_info()
    with Timer() as clock:
        measure_all(args, d, counts, info, clock)


if __name__ == "__main__":
    main()
