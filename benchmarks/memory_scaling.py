"""Scaling of the neural memory with sequence length: tokens/s and peak memory from 1K to 64K tokens.

    python benchmarks/memory_scaling.py [--seqs 1024,4096,16384,65536] [--reps 3] [--checkpoint-every 16]
        [--out memory_scaling]

Memory: NeuralMemory(256, heads=4, head_dim=256, depth=2, expansion=4, chunk_size=64, activation="gelu"),
batch 1 at every length (the long runs must fit on a 24 GiB machine). Each row is a fresh subprocess;
the timed runs follow one untimed warm-up on 1024 tokens. Modes:
  fwd+bwd          one call over the whole sequence, loss = sum of outputs, backward to all parameters.
                   Every chunk's state is kept for the backward pass: memory grows linearly.
  fwd+bwd ckpt     the same with checkpoint_every=N chunks: only group-boundary states are kept and each
                   group's forward is recomputed in the backward pass. The 64K row runs only this way.
  forward          one call under torch.no_grad(): the state is carried, not kept; what grows is the
                   O(T x dim) activations of the call itself (input, projections, outputs).
  forward stream   torch.no_grad(), the sequence fed in 2048-token calls that carry the MemoryState: memory
                   is bounded by the state and one piece, whatever the length.
Time should grow linearly (flat tokens/s); outputs and the final state must stay finite at 64K.
tok/CPU-s is tokens per second of process CPU time: with --threads 1 on a shared machine, the rate the run
would have on a core of its own. "kernel s/run" is the operating system's share of that time, mostly page
faults as a run touches memory it has not used before; tok/user-CPU-s leaves it out: the op's own work.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench_utils import (
    current_rss_gib,
    describe,
    machine_info,
    median,
    peak_rss_gib,
    print_table,
    run_worker,
    save_json,
    time_runs,
)

STREAM_PIECE = 2048


def worker(spec: dict) -> dict:
    import torch

    from titans import NeuralMemory

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    mem = NeuralMemory(
        256,
        heads=4,
        head_dim=256,
        depth=2,
        expansion=4,
        chunk_size=64,
        activation="gelu",
        checkpoint_every=spec.get("checkpoint_every"),
    )
    mode, seq = spec["mode"], spec["seq"]
    finite = []

    def finite_state(state) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in state.weights + state.momentum)

    def run(x):
        if mode == "fwd+bwd":
            mem.zero_grad(set_to_none=True)
            y, state = mem(x)
            y.sum().backward()
        elif mode == "forward":
            with torch.no_grad():
                y, state = mem(x)
        else:  # forward stream: pieces carry the state; only the current piece's activations exist
            state, ok = None, True
            with torch.no_grad():
                for piece in x.split(STREAM_PIECE, dim=1):
                    y, state = mem(piece, state)
                    ok = ok and bool(torch.isfinite(y).all())
            finite.append(ok and all(bool(torch.isfinite(w).all()) for w in state.weights))
            return
        finite.append(
            bool(torch.isfinite(y).all()) and all(bool(torch.isfinite(w).all()) for w in state.weights)
        )

    gen = torch.Generator().manual_seed(1)
    run(torch.randn(1, 1024, 256, generator=gen))  # warm-up on a short sequence
    x = torch.randn(1, seq, 256, generator=gen)
    rss_before = current_rss_gib()
    cpu, kernel = [], []
    times = time_runs(lambda: run(x), spec["reps"], warmup=0, cpu_times=cpu, sys_times=kernel)
    return {
        "times_s": times,
        "cpu_times_s": cpu,
        "sys_times_s": kernel,
        "finite": all(finite),
        "rss_before_gib": rss_before,
        "peak_rss_gib": peak_rss_gib(),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="1024,4096,16384,65536")
    p.add_argument(
        "--reps", type=int, default=3, help="timed repetitions up to 4K tokens (2 at 16K, 1 above)"
    )
    p.add_argument("--checkpoint-every", type=int, default=16, help="chunks per checkpointed group")
    p.add_argument("--plain-max", type=int, default=16384, help="longest fwd+bwd run without checkpointing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="memory_scaling", help="a path, or a name in benchmarks/results/")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    seqs = [int(s) for s in args.seqs.split(",")]
    info = machine_info()
    print(describe(info))
    plan = []
    for seq in seqs:
        reps = args.reps if seq <= 4096 else 2 if seq <= 16384 else 1
        if seq <= args.plain_max:
            plan.append(("fwd+bwd", seq, None, reps))
        if seq >= 4096:
            plan.append(("fwd+bwd", seq, args.checkpoint_every, reps))
        plan.append(("forward", seq, None, reps))
        plan.append(("forward stream", seq, None, reps))
    rows = []
    for mode, seq, every, reps in plan:
        label = f"{mode} ckpt {every}" if every else mode
        print(f"  running {label} seq {seq} ...", file=sys.stderr, flush=True)
        spec = {"mode": mode, "seq": seq, "checkpoint_every": every, "reps": reps, "threads": args.threads}
        r = run_worker(__file__, spec, timeout=3600)
        row = {"mode": label, "seq": seq, "batch": 1, **r}
        if "times_s" in r:
            row["tok_s"] = seq / median(r["times_s"])
            row["seconds"] = median(r["times_s"])
            row["tok_cpu_s"] = seq / median(r["cpu_times_s"])
            # the kernel's share (page faults) and the user-space rate: the work of the op itself
            row["sys_s"] = median(r["sys_times_s"])
            row["tok_user_s"] = seq / median([c - k for c, k in zip(r["cpu_times_s"], r["sys_times_s"])])
        rows.append(row)
    # flatness: tokens/s relative to the shortest run of the same mode
    first = {}
    for r in rows:
        if "tok_s" in r:
            first.setdefault(r["mode"], (r["tok_s"], r["tok_cpu_s"], r["tok_user_s"]))
            r["tok_s_vs_first"] = r["tok_s"] / first[r["mode"]][0]
            r["tok_cpu_s_vs_first"] = r["tok_cpu_s"] / first[r["mode"]][1]
            r["tok_user_s_vs_first"] = r["tok_user_s"] / first[r["mode"]][2]

    print("\nNeuralMemory scaling, batch 1, chunk 64, 4 heads of 256-1024-256 (state 16 MiB)")
    print_table(
        rows,
        [
            ("mode", "mode"),
            ("seq", "seq"),
            ("tok_s", "tok/s"),
            ("tok_s_vs_first", "vs shortest"),
            ("seconds", "s/run"),
            ("tok_cpu_s", "tok/CPU-s"),
            ("tok_cpu_s_vs_first", "vs shortest"),
            ("sys_s", "kernel s/run"),
            ("tok_user_s", "tok/user-CPU-s"),
            ("tok_user_s_vs_first", "vs shortest"),
            ("peak_rss_gib", "peak RSS GiB"),
            ("rss_before_gib", "RSS before"),
            ("finite", "finite"),
            ("error", "error"),
        ],
    )
    path = save_json(
        args.out,
        {
            "machine": info,
            "config": {"batch": 1, "checkpoint_every": args.checkpoint_every, "stream_piece": STREAM_PIECE},
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
