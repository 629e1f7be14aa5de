"""How many operations one decode step runs, per variant and per layer: the launch count a GPU pays for
every generated token when generation is not replayed as a CUDA graph.

Each variant (random weights, float32, `--preset`) reads a `--context` of random tokens, then decodes one
token at a time for a whole cycle of its chunk and segment boundaries (`lcm(chunk_size, segment_len)`
steps: a step that completes a memory chunk also writes it). Each step runs under `torch.profiler`.
Counted per step:

- on CPU, the leaf ATen operators that compute (views, reshapes and other metadata-only operators
  excluded), with the fused CPU kernels off (`TITANS_CPU_KERNELS=0`), as a GPU runs: each is at least one
  kernel launch there, while a C++ kernel's work would not be counted;
- on CUDA (`--device cuda`), the GPU kernels themselves.

Reported: median and max over the cycle, per step and per block (the count divided by `depth`).

    python benchmarks/decode_ops.py [--variants lmm,mac,mag,mal,transformer] [--preset tiny] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from bench_utils import save_json
from titans.ops.cpu_kernels import kernels

# operators that only change a tensor's metadata (or allocate without writing): no kernel on a GPU
NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::as_strided", "aten::transpose", "aten::t",
    "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::slice", "aten::select",
    "aten::narrow", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::alias",
    "aten::detach", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::view_as", "aten::unflatten", "aten::flatten",
    "aten::expand_as", "aten::result_type", "aten::_reshape_alias", "aten::item", "aten::_local_scalar_dense",
    "aten::is_nonzero", "aten::contiguous", "aten::set_", "aten::size", "aten::stride", "aten::dim",
}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts the computing ATen operators dispatched inside it (leaf operators: composites arrive
    decomposed; metadata-only ones, `NO_KERNEL`, left out)."""

    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func._schema.name not in NO_KERNEL
        return func(*args, **(kwargs or {}))


def count_ops(prof, device: str) -> int:
    events = list(prof.events())
    if device == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    parents = {id(e.cpu_parent) for e in events if e.cpu_parent is not None and e.name.startswith("aten::")}
    return sum(
        1 for e in events if e.name.startswith("aten::") and id(e) not in parents and e.name not in NO_KERNEL
    )


def measure(variant: str, args: argparse.Namespace) -> dict:
    from titans import TitansConfig, TitansLM

    torch.manual_seed(0)
    cfg = TitansConfig.preset(args.preset, variant=variant)
    model = TitansLM(cfg).to(args.device).eval()
    cycle = math.lcm(cfg.chunk_size, cfg.segment_len)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    counts = []
    with torch.no_grad():
        context = torch.randint(0, cfg.vocab_size, (1, args.context), device=args.device)
        _, state = model(context)
        token = context[:, -1:]
        for _ in range(cycle):
            with profile(activities=activities) as prof:
                _, state = model(token, state)
            counts.append(count_ops(prof, args.device))
    return {
        "variant": variant,
        "preset": args.preset,
        "depth": cfg.depth,
        "device": args.device,
        "steps": cycle,
        "median_per_step": statistics.median(counts),
        "max_per_step": max(counts),
        "median_per_block": statistics.median(counts) / cfg.depth,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="lmm,mac,mag,mal,swa,transformer")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--json", default=None, help="write the rows here (a path, or a name in benchmarks/results/)"
    )
    args = p.parse_args()
    if args.device == "cpu":  # count the torch-op paths a GPU runs, not the CPU's C++ kernels
        os.environ["TITANS_CPU_KERNELS"] = "0"
        kernels.cache_clear()
    torch.set_num_threads(1)
    rows = [measure(v, args) for v in args.variants.split(",")]
    what = "GPU kernels" if args.device == "cuda" else "compute operators (leaf ATen, views excluded)"
    print(f"{what} per single-token decode step, preset {args.preset}, over one chunk/segment cycle")
    print(f"{'variant':<13}{'blocks':>7}{'steps':>7}{'median/step':>13}{'max/step':>10}{'median/block':>14}")
    for r in rows:
        print(f"{r['variant']:<13}{r['depth']:>7}{r['steps']:>7}{r['median_per_step']:>13g}"
              f"{r['max_per_step']:>10}{r['median_per_block']:>14g}")  # fmt: skip
    if args.json:
        print(f"wrote {save_json(args.json, {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
