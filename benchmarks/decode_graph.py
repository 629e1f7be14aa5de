"""Marginal decode cost of one token: the eager step (`TitansLM.forward` on one token) against the static
decoder (`titans.models.decode_graph.StaticDecoder`: fixed state buffers, one step per chunk/segment
phase) run eagerly, compiled with `torch.compile` and, on a CUDA device, replayed as CUDA graphs
(`--paths ...,cuda_graph`), side by side in one process.

A model (random weights, float32, `--preset`, `--variant`) reads a `--context` of random tokens in each of
`--batch` rows, then each path decodes `--steps` greedy tokens from that same state, after `--warmup`
untimed steps (which include the compilation: its time is reported separately). On CUDA each step's time
runs to the device's synchronisation (a sampler reads the token on the host anyway). Reported per path: median
and best-burst ms per token (per step: one token in each row) over whole chunk/segment cycles
(`decode_cycle`), the largest logit difference from the eager step, and with `--ops` the compute operators
per step (`decode_ops.py`'s count: leaf ATen operators; inside a compiled step only those left outside its
generated code).

    python benchmarks/decode_graph.py [--variant mac] [--preset tiny] [--batch 1] [--threads 2] [--steps 256]
        [--paths eager,static,compiled] [--device cpu] [--json decode_graph_tiny_mac_cpu]
"""

from __future__ import annotations

import argparse
import math
import statistics
from functools import partial

import torch

from bench_utils import Timer, machine_info, save_json, timing_summary
from decode_ops import count_ops


def decode_setup(
    preset: str, variant: str, threads: int, device: str = "cpu"
) -> tuple[dict, torch.nn.Module, int]:
    """The decode benchmarks' common start: torch threads set, the machine described, a randomly
    initialised model of ``preset`` / ``variant`` (seed 0) on ``device`` in eval mode and its chunk/segment
    cycle."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    machine = machine_info()
    from titans import TitansConfig, TitansLM
    from titans.models.decode_graph import decode_cycle

    torch.manual_seed(0)
    model = TitansLM(TitansConfig.preset(preset, variant=variant)).to(device).eval()
    return machine, model, decode_cycle(model)


def run_path(model, path: str, logits, state, args, cycle: int) -> dict:
    from titans.models.decode_graph import StaticDecoder

    if path == "eager":
        decoder = None

        def step(token):
            nonlocal state
            out, state = model(token, state)
            return out[:, -1]
    else:
        decoder = StaticDecoder(model, state, mode={"static": "eager", "compiled": "compile"}.get(path, path))
        step = partial(decoder.step, check_ids=False)  # ids it sampled itself, as `generate` steps
    sync = torch.cuda.synchronize if logits.is_cuda else None
    token = logits.argmax(-1, keepdim=True)
    warmup = args.warmup  # whole cycles (main)
    times, all_logits = [], []
    with torch.no_grad(), Timer() as total:
        for i in range(warmup + args.steps):
            with Timer(sync) as clock:
                out = step(token)
                token = out.argmax(-1, keepdim=True)
            if i == warmup - 1:
                compile_s = total.elapsed()
            if i >= warmup:
                times.append(clock.wall)
                all_logits.append(out)
    bursts = [times[i : i + cycle] for i in range(0, len(times), cycle)]
    ops = []  # compute operators per step over one cycle (outside fused code: a compiled step's leftovers)
    with torch.no_grad():
        for _ in range(cycle if args.ops else 0):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                token = step(token).argmax(-1, keepdim=True)
            ops.append(count_ops(prof, "cpu"))
    return {
        "path": path,
        "ms_per_token": 1000 * statistics.median(times),
        "ms_best_cycle": 1000 * min(statistics.median(b) for b in bursts),
        "warmup_s": round(compile_s, 2),
        "ops_per_step_median": statistics.median(ops) if ops else None,
        "ops_per_step_max": max(ops) if ops else None,
        "timing": timing_summary(times),
        "logits": torch.stack(all_logits),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="mac")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--steps", type=int, default=256, help="timed steps (rounded up to whole cycles)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps (rounded up to a whole cycle)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", default="eager,static,compiled", help="also cuda_graph, on --device cuda")
    p.add_argument("--device", default="cpu")
    p.add_argument("--ops", action="store_true", help="also count operators per step (one cycle, profiled)")
    p.add_argument("--json", default=None, help="write the results here (a path, or a name in results/)")
    args = p.parse_args()
    if args.batch < 1:
        p.error(f"--batch must be at least 1, got {args.batch}")
    if args.warmup < 1:
        p.error(f"--warmup must be at least 1 (the first steps compile), got {args.warmup}")
    machine, model, cycle = decode_setup(args.preset, args.variant, args.threads, args.device)
    cfg = model.config
    # whole cycles, as run (and recorded): every phase's step compiled before timing, each timed alike
    args.steps = math.ceil(args.steps / cycle) * cycle
    args.warmup = math.ceil(args.warmup / cycle) * cycle
    with torch.no_grad():
        prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.context), device=args.device)
        out, state = model(prompt, last_only=True)
    rows = [run_path(model, path, out[:, -1], state, args, cycle) for path in args.paths.split(",")]
    ref = rows[0]["logits"]
    print(
        f"{args.variant} {args.preset} on {args.device}, batch {args.batch}, {args.threads} threads, "
        f"context {args.context}, "
        f"{args.steps} tokens"
        + (f" (ms/token: per step, one token in each of {args.batch} rows)" if args.batch > 1 else "")
    )
    print(f"{'path':<10}{'ms/token':>10}{'best cycle':>12}{'warmup s':>10}{'max |dlogit|':>14}{'speedup':>9}"
          f"{'ops/step':>10}")  # fmt: skip
    for r in rows:
        diff = (r.pop("logits") - ref).abs().max().item()
        r["max_logit_diff_vs_" + rows[0]["path"]] = diff
        r["speedup"] = rows[0]["ms_per_token"] / r["ms_per_token"]
        print(f"{r['path']:<10}{r['ms_per_token']:>10.3f}{r['ms_best_cycle']:>12.3f}{r['warmup_s']:>10.1f}"
              f"{diff:>14.2e}{r['speedup']:>9.2f}{r['ops_per_step_median'] or '-':>10}")  # fmt: skip
    if args.json:
        result = {"benchmark": "decode_graph", "args": vars(args), "rows": rows}
        print(f"wrote {save_json(args.json, result, machine)}")


if __name__ == "__main__":
    main()
