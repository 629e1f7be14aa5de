"""Where the NeuralMemory layer's time goes, at the README's benchmark shapes (batch 2, seq 2048, dim 256,
4 heads of 256 -> 1024 -> 256, chunk 64), forward + backward. One process, medians of --reps runs, printed
as tables:

1. the layer, and the share of its time in matmuls (torch.profiler, by op name);
2. the causal conv + SiLU on the (2, 2048, 3072) q/k/v projections: the fused C++ kernel (the default on
   CPU), the torch-op path in cache-sized blocks (its fallback) and as one whole-tensor block, and
   `F.conv1d` (the reference), and its share of the layer; and, for scale,
   oneDNN's depthwise conv on the channels-last view (forward, input gradient, weight gradient apart);
3. the layer with the backward's state gradients in reused buffers (the default) vs a fresh tensor per
   chunk, alternating in one process;
4. the q/k l2 normalisation and the output RMSNorm on a (2, 4, 2048, 256) read, fwd+bwd: the fused-backward
   versions in `titans.ops.norms` against `F.normalize` / `F.rms_norm`;
5. a 2048^3 matmul in float32 and bfloat16 (whether bf16 could help on this CPU).

    python benchmarks/memory_profile.py [--threads 2] [--reps 5] [--json [PATH]]
"""

from __future__ import annotations

import argparse

import torch

from bench_utils import Timer, machine_info, median, save_json, time_runs

MATMUL_OPS = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::addmm", "aten::addmm_", "aten::mm")


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    return 1e3 * median(time_runs(fn, reps, warmup=warmup))


def layer_rows(reps: int) -> tuple[list[dict], float]:
    from torch.profiler import ProfilerActivity, profile

    from titans import NeuralMemory

    torch.manual_seed(0)
    mem = NeuralMemory(256, heads=4, head_dim=256, depth=2, expansion=4, chunk_size=64, activation="gelu")
    x = torch.randn(2, 2048, 256, requires_grad=True)

    def step():
        mem(x)[0].sum().backward()

    ms = median_ms(step, reps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    rows = [{"what": "layer fwd+bwd", "ms": ms, "tok_s": 4096 / ms * 1e3, "matmul_share": matmul / total}]
    return rows, ms


def conv_rows(reps: int, layer_ms: float) -> list[dict]:
    import torch.nn.functional as F

    import titans.ops.conv as conv
    from titans.ops.conv_ref import causal_conv_silu_ref

    torch.manual_seed(0)
    x = torch.randn(2, 2048, 3072, requires_grad=True)
    tail = torch.randn(2, 3, 3072, requires_grad=True)
    weight = torch.randn(3072, 1, 4, requires_grad=True)
    bias = torch.randn(3072, requires_grad=True)
    grad = torch.randn(2, 2048, 3072)
    rows = []
    blocked = conv._BLOCK_ELEMENTS

    def fast():
        conv.causal_conv_silu(x, weight, bias, tail).backward(grad)

    def reference():  # the plain F.conv1d formulation: tail and rows concatenated first
        causal_conv_silu_ref(torch.cat([tail, x], 1), weight, bias).backward(grad)

    kernels = conv.kernels
    for name, fn, block_elements, use_kernel in (
        ("conv + SiLU, fused C++ kernel", fast, blocked, True),
        ("conv + SiLU, torch ops in blocks", fast, blocked, False),
        ("conv + SiLU, torch ops, one block", fast, 1 << 62, False),
        ("F.conv1d reference", reference, blocked, False),
    ):
        if use_kernel and kernels() is None:
            continue  # not built here: the layer row above ran the torch-op path
        conv._BLOCK_ELEMENTS = block_elements
        conv.kernels = kernels if use_kernel else (lambda: None)
        ms = median_ms(fn, reps)
        rows.append({"what": name, "ms": ms, "share_of_layer": ms / layer_ms})
    conv._BLOCK_ELEMENTS, conv.kernels = blocked, kernels
    # oneDNN's depthwise conv on the channels-last (B, C, 1, T) view of the (B, T, C) rows (no copies), its
    # pieces timed apart: how far a library kernel gets (no SiLU, no causal tail here)
    c, t = x.shape[2], x.shape[1]
    x_cl = x.detach().view(2, 1, t, c).permute(0, 3, 1, 2)
    w_2d = weight.detach().view(c, 1, 1, 4)
    g_cl = torch.randn(2, t - 3, c).view(2, 1, t - 3, c).permute(0, 3, 1, 2)

    def backward(mask):
        args = (g_cl, x_cl, w_2d, [c], [1, 1], [0, 0], [1, 1], False, [0, 0], c, mask)
        return lambda: torch.ops.aten.convolution_backward(*args)

    with torch.no_grad():
        for name, fn in (
            ("oneDNN channels-last conv, forward", lambda: F.conv2d(x_cl, w_2d, bias.detach(), groups=c)),
            ("oneDNN ..., input gradient", backward([True, False, False])),
            ("oneDNN ..., weight + bias gradient", backward([False, True, True])),
        ):
            rows.append({"what": name, "ms": median_ms(fn, reps)})
    return rows


def grad_buffer_rows(reps: int) -> list[dict]:
    """The layer fwd+bwd with the chunk steps' state gradients in reused buffers (the default) and, for
    comparison, in a fresh tensor per chunk, alternating run by run in this one process."""
    import titans.ops.memory.chunk as op  # the torch path's gradient buffers, swapped for a comparison
    from titans import NeuralMemory

    torch.manual_seed(0)
    mem = NeuralMemory(256, heads=4, head_dim=256, depth=2, expansion=4, chunk_size=64, activation="gelu")
    x = torch.randn(2, 2048, 256, requires_grad=True)
    reused = op._GradBuffers.take

    def fresh(self, slot, layer, like):
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)

    times: dict[str, list[float]] = {"reused": [], "fresh": []}
    try:
        for _ in range(reps + 1):  # the first round warms up
            for name, take in (("reused", reused), ("fresh", fresh)):
                op._GradBuffers.take = take
                with Timer() as clock:
                    mem(x)[0].sum().backward()
                times[name].append(clock.wall)
    finally:
        op._GradBuffers.take = reused
    return [
        {"what": f"state gradients, {name} buffers", "ms": 1e3 * median(ts[1:])} for name, ts in times.items()
    ]


def norm_rows(reps: int) -> list[dict]:
    import torch.nn.functional as F

    from titans.ops.norms import l2_normalize, rms_norm

    torch.manual_seed(0)
    x = torch.randn(2, 4, 2048, 256, requires_grad=True)
    weight = torch.randn(256, requires_grad=True)
    grad = torch.randn_like(x)
    cases = (
        ("l2 normalize, titans.ops.norms", lambda: l2_normalize(x)),
        ("l2 normalize, F.normalize", lambda: F.normalize(x, dim=-1)),
        ("RMSNorm, titans.ops.norms", lambda: rms_norm(x, weight)),
        ("RMSNorm, F.rms_norm", lambda: F.rms_norm(x, (256,), weight)),
    )
    return [{"what": name, "ms": median_ms(lambda fn=fn: fn().backward(grad), reps)} for name, fn in cases]


def matmul_rows(reps: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        ms = median_ms(lambda a=a, b=b: a @ b, reps)
        rows.append({"what": f"2048^3 matmul, {dtype}", "ms": ms, "gflops": 2 * 2048**3 / ms / 1e6})
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    for r in rows:
        cells = [f"{r['what']:34s}", f"{r['ms']:9.2f} ms"]
        for key, fmt in (("tok_s", "{:,.0f} tok/s"), ("gflops", "{:.0f} GFLOP/s")):
            if key in r:
                cells.append(fmt.format(r[key]))
        for key in ("matmul_share", "share_of_layer"):
            if key in r:
                cells.append(f"{key.replace('_', ' ')} {100 * r[key]:.1f}%")
        print("  ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--json",
        nargs="?",
        const="memory_profile",
        default=None,
        help="write the results: a path, or a name in benchmarks/results/ "
        "(--json alone: memory_profile.json there)",
    )
    args = p.parse_args()
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    layer, layer_ms = layer_rows(args.reps)
    results = {
        "layer": layer,
        "conv": conv_rows(args.reps, layer_ms),
        "state_gradients": grad_buffer_rows(args.reps),
        "norms": norm_rows(args.reps),
        "matmul": matmul_rows(args.reps),
    }
    print(f"{args.threads} threads, median of {args.reps}")
    for title, rows in results.items():
        show(title, rows)
    if args.json:
        path = save_json(args.json, {"threads": args.threads, **results}, machine_info())
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
