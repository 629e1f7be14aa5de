"""Our neural memory against titans-pytorch 0.5.5, same memory shapes, same run, same CPU.

    python benchmarks/memory_vs_titans_pytorch.py [--reps 3] [--batch 2] [--seq 2048]

Configurations (each in a fresh subprocess, so peak RSS is per configuration):
  titans-pytorch  NeuralMemory(dim=256, chunk_size=64, heads=4): per head a 256 -> 1024 -> 256 MLP memory
                  (its defaults: GELU MLP inside a LayerNorm + residual wrapper).
  ours            NeuralMemory(256, heads=4, head_dim=256, depth=2, expansion=4, chunk_size=64,
                  activation="gelu"): the same memory MLP per head, the layer with its projections.
  ours ckpt 8     the same layer with checkpoint_every=8 (fwd+bwd only): memory traded for recomputation.
  ours (op)       neural_memory_chunked alone on the same shapes (random q/k/v/gates, W_0 trainable):
                  the fast path without the layer's projections, used for the FLOP-rate comparison.
Modes: forward+backward (loss = sum of outputs, gradients for all parameters) and forward-only under
torch.no_grad(). Reported: median tokens/s over --reps timed repetitions after one warm-up (and tokens per
second of process CPU time: with --threads 1 on a shared machine, the rate on a core of its own), peak RSS of
the worker process (interpreter and torch included; the RSS right before the timed work is shown too),
and the ratios ours / theirs. A large fp32 matmul measured in the same run gives the practical FLOP
peak (best of a probe before and one after the runs); our analytic matmul FLOPs per token times our
tokens/s, divided by it, says how close to the hardware the fast path runs.

titans-pytorch is a benchmark-only dependency (`pip install -e '.[bench]'`, with CPU torch installed
first). Without it, only our rows are measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench_utils import (
    current_rss_gib,
    describe,
    fast_path_flops_per_token,
    machine_info,
    matmul_gflops,
    median,
    peak_rss_gib,
    print_table,
    projection_flops_per_token,
    run_worker,
    save_json,
    time_runs,
)

DIM, HEADS, HEAD_DIM, EXPANSION, CHUNK = 256, 4, 256, 4, 64
CKPT = 8  # chunks per checkpointed group in the "ours ckpt" row


def build(impl: str, batch: int, seq: int):
    """Return a closure running one forward (and backward) pass, for this implementation and mode."""
    import torch

    torch.manual_seed(0)
    if impl == "titans-pytorch":
        from titans_pytorch import NeuralMemory as TheirMemory

        module = TheirMemory(dim=DIM, chunk_size=CHUNK, heads=HEADS)
        x = torch.randn(batch, seq, DIM)
        return module, lambda: module(x)[0]
    if impl.startswith("ours") and "op" not in impl:
        from titans import NeuralMemory

        module = NeuralMemory(
            DIM,
            heads=HEADS,
            head_dim=HEAD_DIM,
            depth=2,
            expansion=EXPANSION,
            chunk_size=CHUNK,
            activation="gelu",
            checkpoint_every=CKPT if "ckpt" in impl else None,
        )
        x = torch.randn(batch, seq, DIM)
        return module, lambda: module(x)[0]
    if impl == "ours (op)":
        import torch.nn.functional as F

        from titans.ops.memory import neural_memory_chunked

        hidden = HEAD_DIM * EXPANSION
        q, k, v = (torch.randn(batch, HEADS, seq, HEAD_DIM) for _ in range(3))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        theta = torch.full((batch, HEADS, seq), 0.1)
        log_eta = torch.full((batch, HEADS, seq), -0.1)
        log_keep = torch.full((batch, HEADS, seq), -0.01)
        w0 = torch.nn.ParameterList(
            [
                torch.nn.Parameter(torch.randn(HEADS, HEAD_DIM, hidden) / HEAD_DIM**0.5),
                torch.nn.Parameter(torch.randn(HEADS, hidden, HEAD_DIM) / hidden**0.5),
            ]
        )
        leaves = [q, k, v, theta, log_eta, log_keep]

        def run():
            for t in leaves:
                t.grad = None
            inputs = [t.requires_grad_(torch.is_grad_enabled()) for t in leaves]
            w = tuple(p.expand(batch, *p.shape) for p in w0)
            s = tuple(torch.zeros_like(x) for x in w)
            return neural_memory_chunked(
                *inputs, w, s, chunk_size=CHUNK, activation="gelu", surprise_clip=1.0
            )[0]

        return w0, run
    raise ValueError(f"unknown implementation {impl!r}")


def worker(spec: dict) -> dict:
    import torch

    module, forward = build(spec["impl"], spec["batch"], spec["seq"])
    rss_before = current_rss_gib()

    def fwd_bwd():
        module.zero_grad(set_to_none=True)
        forward().sum().backward()

    def fwd_only():
        with torch.no_grad():
            forward()

    cpu = []
    times = time_runs(
        fwd_bwd if spec["mode"] == "fwd+bwd" else fwd_only, spec["reps"], warmup=1, cpu_times=cpu
    )
    return {
        "times_s": times,
        "cpu_times_s": cpu,
        "rss_before_gib": rss_before,
        "peak_rss_gib": peak_rss_gib(),
        "threads": torch.get_num_threads(),
    }


def peak_worker(spec: dict) -> dict:
    return matmul_gflops(spec["n"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per configuration (median)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--skip-theirs", action="store_true", help="measure our rows only")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--name", default="memory_vs_titans_pytorch", help="results file stem")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        if spec.get("threads"):
            import torch

            torch.set_num_threads(spec["threads"])
        print(json.dumps(peak_worker(spec) if spec.get("peak") else worker(spec)))
        return

    impls = ["ours", "ours (op)"]
    if not args.skip_theirs:
        try:
            import titans_pytorch  # noqa: F401

            impls.insert(0, "titans-pytorch")
        except ImportError:
            print("titans-pytorch is not installed (pip install -e '.[bench]'): measuring our rows only\n")
    info = machine_info()
    print(describe(info))
    probe = {"peak": True, "n": 4096, "threads": args.threads}
    peaks = [run_worker(__file__, probe)]
    print(f"fp32 matmul 4096^3: {peaks[0].get('gflops_median', 0):.0f} GFLOP/s (median)\n")

    tokens = args.batch * args.seq
    op = fast_path_flops_per_token(HEAD_DIM, HEAD_DIM * EXPANSION, HEADS)
    proj = projection_flops_per_token(DIM, HEADS, HEAD_DIM)
    flops = {
        ("ours (op)", "fwd+bwd"): op["total"],
        ("ours (op)", "forward"): op["forward"],
        ("ours", "fwd+bwd"): op["total"] + proj["total"],
        ("ours", "forward"): op["forward"] + proj["forward"],
    }  # the checkpointed row recomputes the forward: its useful FLOPs are the plain row's, not counted
    rows = []
    plan = [(impl, "fwd+bwd") for impl in impls]
    plan.insert(plan.index(("ours", "fwd+bwd")) + 1, (f"ours ckpt {CKPT}", "fwd+bwd"))
    plan += [(impl, "forward") for impl in impls]
    for impl, mode in plan:
        spec = {"impl": impl, "mode": mode, "batch": args.batch, "seq": args.seq, "reps": args.reps}
        spec["threads"] = args.threads
        print(f"  running {impl} {mode} ...", file=sys.stderr, flush=True)
        r = run_worker(__file__, spec)
        row = {"impl": impl, "mode": mode, **r}
        if "times_s" in r:
            row["tok_s"] = tokens / median(r["times_s"])
            row["tok_s_min"] = tokens / max(r["times_s"])
            row["tok_s_max"] = tokens / min(r["times_s"])
            row["tok_cpu_s"] = tokens / median(r["cpu_times_s"])
            if (impl, mode) in flops:
                row["gflop_per_token"] = flops[impl, mode] / 1e9
                row["gflops"] = row["tok_s"] * flops[impl, mode] / 1e9
        rows.append(row)
    # the practical peak: best of a probe before and one after (load on a shared machine drifts)
    peaks.append(run_worker(__file__, probe))
    peak = max(peaks, key=lambda p: p.get("gflops_median", 0))
    peak_cpu = max(p.get("gflops_cpu", 0) for p in peaks)
    for row in rows:
        if "gflops" in row and "gflops_median" in peak:
            row["of_matmul_peak"] = row["gflops"] / peak["gflops_median"]
            row["gflops_cpu"] = row["tok_cpu_s"] * row["gflop_per_token"]
            row["of_matmul_cpu"] = row["gflops_cpu"] / peak_cpu

    theirs = {r["mode"]: r for r in rows if r["impl"] == "titans-pytorch" and "tok_s" in r}
    for r in rows:
        base = theirs.get(r["mode"])
        if base and "tok_s" in r and r["impl"] != "titans-pytorch":
            r["speedup"] = r["tok_s"] / base["tok_s"]
            r["cpu_speedup"] = r["tok_cpu_s"] / base["tok_cpu_s"]
            r["memory_ratio"] = r["peak_rss_gib"] / base["peak_rss_gib"]

    print(
        f"\nNeuralMemory, batch {args.batch} x seq {args.seq}, chunk {CHUNK}, {HEADS} heads of 256->1024->256"
    )
    print_table(
        rows,
        [
            ("impl", "implementation"),
            ("mode", "mode"),
            ("tok_s", "tok/s (median)"),
            ("tok_s_min", "min"),
            ("tok_s_max", "max"),
            ("speedup", "x theirs"),
            ("tok_cpu_s", "tok/CPU-s"),
            ("cpu_speedup", "x theirs"),
            ("peak_rss_gib", "peak RSS GiB"),
            ("rss_before_gib", "RSS before"),
            ("memory_ratio", "RSS / theirs"),
            ("gflops", "GFLOP/s"),
            ("of_matmul_peak", "of matmul"),
            ("of_matmul_cpu", "(CPU time)"),
            ("error", "error"),
        ],
    )
    print(
        f"\nFLOPs/token (matmuls, analytic): fast path {op['forward'] / 1e6:.1f}M forward + "
        f"{op['backward'] / 1e6:.1f}M backward = {op['total'] / 1e6:.1f}M; layer projections "
        f"{proj['total'] / 1e6:.1f}M more. Matmul peak: {peak.get('gflops_median', 0):.0f} GFLOP/s wall, "
        f"{peak_cpu:.0f} per CPU-second."
    )
    path = save_json(
        args.name,
        {
            "machine": info,
            "config": {
                "batch": args.batch,
                "seq": args.seq,
                "chunk": CHUNK,
                "heads": HEADS,
                "reps": args.reps,
            },
            "matmul_peak": peak,
            "matmul_probes": peaks,
            "flops_per_token": {"fast_path": op, "projections": proj},
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
