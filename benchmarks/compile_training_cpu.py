"""A compiled block's training step against the eager one, on CPU, per variant.

`titans train --compile` calls `TitansLM.compile_blocks` (inductor), each block one graph with the memory's
torch chunk loop traced into it. Each variant here runs in a fresh interpreter (`run_worker`) with
inductor's caches off: a `tiny` model, a batch of 2 sequences of `--seq` tokens, `--threads` torch threads
and the memory's finiteness check off, as the trainer sets it. One training step is forward,
cross-entropy and backward (gradients cleared before each). The eager step's median over `--steps` steps
after `--warmup` untimed ones; then `compile_blocks()` and the first compiled step (the compile plus a
step), `--warmup` more untimed compiled steps and the compiled step's median over `--steps`, in the same
process on the same weights and tokens. Also reported: the graph breaks torch.compile counted
(`torch._dynamo.utils.counters["graph_break"]`) and the graphs it compiled, and how far the compiled
steps' losses are from the eager loss (the run fails its check above `--loss-tol`).

    python benchmarks/compile_training_cpu.py [--variants mac,mag,mal,lmm] [--seq 128] [--threads 1]
        [--steps 10] [--warmup 2] [--loss-tol 1e-4] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench_utils import Timer, machine_info, median, print_table, reply, run_worker, save_json, time_runs

BATCH = 2


def worker(spec: dict) -> dict:
    """One variant: eager and compiled step times, the compile, graph breaks and the loss difference."""
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # a compile from scratch, every run
    # imported here, after the environment above is set
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from titans import NeuralMemory, TitansConfig, TitansLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    cfg = TitansConfig.preset("tiny", variant=spec["variant"])
    model = TitansLM(cfg).train()
    for module in model.modules():  # as the trainer sets it
        if isinstance(module, NeuralMemory):
            module.check_finite = False
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, spec["seq"] + 1), generator=gen)
    losses: list[float] = []

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits, _ = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())

    eager = time_runs(step, spec["steps"], warmup=spec["warmup"])
    eager_losses, losses = losses, []

    torch._dynamo.reset()
    counters.clear()
    model.compile_blocks()
    with Timer() as first:
        step()
    compiled = time_runs(step, spec["steps"], warmup=spec["warmup"])
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"].get("unique_graphs", 0)
    diff = max(abs(x - eager_losses[0]) for x in losses)
    eager_s, compiled_s = median(eager), median(compiled)
    return {
        **spec,
        "eager_ms": eager_s * 1e3,
        "first_compiled_step_s": first.wall,
        "compiled_ms": compiled_s * 1e3,
        "speedup": eager_s / compiled_s,
        "graph_breaks": breaks,
        "graph_break_reasons": {k: v for k, v in counters["graph_break"].items()},
        "graphs": graphs,
        "eager_loss": eager_losses[0],
        "eager_loss_spread": max(eager_losses) - min(eager_losses),
        "loss_max_diff": diff,
        "loss_ok": diff <= spec["loss_tol"],
        "eager_times_s": eager,
        "compiled_times_s": compiled,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="mac,mag,mal,lmm", help="comma separated")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--steps", type=int, default=10, help="timed steps, eager and compiled")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each timing")
    p.add_argument("--loss-tol", type=float, default=1e-4, help="largest |compiled - eager| loss allowed")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a variant's run may take")
    p.add_argument("--out", default="compile_training_cpu")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        reply(worker(json.loads(args.worker)))
        return
    machine = machine_info()
    rows = []
    for variant in args.variants.split(","):
        spec = {
            "variant": variant,
            "seq": args.seq,
            "threads": args.threads,
            "steps": args.steps,
            "warmup": args.warmup,
            "loss_tol": args.loss_tol,
        }
        rows.append({**spec, **run_worker(sys.argv[0], spec, timeout=args.timeout)})
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("times_s")}), flush=True)
    print_table(
        rows,
        [
            ("variant", "variant"),
            ("eager_ms", "eager ms"),
            ("first_compiled_step_s", "first compiled s"),
            ("compiled_ms", "compiled ms"),
            ("speedup", "eager/compiled"),
            ("graph_breaks", "graph breaks"),
            ("graphs", "graphs"),
            ("loss_max_diff", "loss max diff"),
            ("error", "error"),
        ],
    )
    config = {"preset": "tiny", "batch": BATCH, "seq": args.seq, "threads": args.threads}
    config.update(steps=args.steps, warmup=args.warmup, check_finite=False, backend="inductor")
    save_json(args.out, {"config": config, "rows": rows}, machine)
    failed = [r["variant"] for r in rows if "error" in r or not r.get("loss_ok")]
    if failed:
        sys.exit(f"compiled loss off the eager one (or run failed): {', '.join(failed)}")


if __name__ == "__main__":
    main()
