"""`titans demo`: watch the neural memory learn at test time, in a few seconds, with no training.

A fresh memory (random W_0, no outer training) reads a stream of random key -> value associations, one
chunk at a time; afterwards it is queried with the keys alone. Recall error falls far below that of the
empty memory; for the linear memory (the default here) per-token surprise (the norm of the inner
gradient) also falls with every pass over the stream.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from titans.ops.memory import memory_forward, neural_memory
from titans.validation import seed_arg


def run_demo(pairs: int = 32, dim: int = 64, depth: int = 1, epochs: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(pairs, dim, generator=g), dim=-1)
    values = torch.randn(pairs, dim, generator=g)
    sizes = [dim] + [2 * dim] * (depth - 1) + [dim]
    w0 = tuple(
        torch.randn(1, 1, sizes[i], sizes[i + 1], generator=g) / math.sqrt(sizes[i]) for i in range(depth)
    )
    s0 = tuple(torch.zeros_like(w) for w in w0)
    k = keys.repeat(epochs, 1)[None, None]
    v = values.repeat(epochs, 1)[None, None]
    n = k.shape[2]
    theta = torch.full((1, 1, n), 0.05 if depth > 1 else 0.25)
    log_eta = torch.full((1, 1, n), math.log(0.5))
    log_keep = torch.zeros(1, 1, n)
    start = time.perf_counter()
    gates = torch.stack([theta, log_eta, log_keep], -1)
    _, w_end, _, surprise = neural_memory(k, k, v, gates, w0, s0, chunk_size=4)
    seconds = time.perf_counter() - start

    def recall(w):
        return (
            (memory_forward(keys[None, None], w, "silu", False)[0, 0] - values).pow(2).sum(-1).mean().item()
        )

    per_epoch = surprise[0, 0].view(epochs, pairs).mean(-1).tolist()
    return {
        "empty_mse": recall(w0),
        "written_mse": recall(w_end),
        "surprise_per_epoch": per_epoch,
        "tokens": n,
        "seconds": seconds,
    }


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    r = run_demo(args.pairs, args.dim, args.depth, args.epochs, args.seed)
    print(
        f"Neural memory (depth {args.depth}, dim {args.dim}) reading {args.pairs} random associations "
        f"x {args.epochs} passes ({r['tokens']} tokens, {r['seconds'] * 1e3:.0f} ms)"
    )
    print(f"  recall error, empty memory   : {r['empty_mse']:.3f}")
    print(
        f"  recall error, after reading  : {r['written_mse']:.3f}  "
        f"({r['empty_mse'] / max(r['written_mse'], 1e-12):.0f}x lower)"
    )
    print("  mean surprise per pass       : " + "  ".join(f"{s:.2f}" for s in r["surprise_per_epoch"]))
    return 0


def register(commands, evals) -> None:
    p = commands.add_parser(
        "demo", help="watch the neural memory memorize at test time (seconds, no training)"
    )
    p.add_argument("--pairs", type=int, default=32, help="random key -> value associations to memorize")
    p.add_argument("--dim", type=int, default=64, help="width of keys, values and the memory")
    p.add_argument("--depth", type=int, default=1, help="layers of the memory MLP (1: a linear memory)")
    p.add_argument("--epochs", type=int, default=6, help="passes over the stream of associations")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the associations and the initial memory")
    p.set_defaults(func=main, check=check_demo_args)


def check_demo_args(args) -> None:
    for name in ("pairs", "dim", "depth", "epochs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
