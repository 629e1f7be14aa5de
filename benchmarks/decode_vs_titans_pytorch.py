"""Sampling speed of a same-size MAC language model: ours (eager steps, and the static decoder compiled with
`torch.compile`) against titans-pytorch 0.5.5's `MemoryAsContextTransformer.sample` (its KV/memory cache
on), side by side in one process, on the same CPU threads.

Each repetition times, path after path, a sample of 1 new token and one of 1 + `--new` new tokens after
the same `--prompt`-token prompt (temperature 1, random weights, float32); the marginal rate is
`--new` / (the difference of the two times), the prompt's prefill cancelling out. The compiled path
compiles before timing (its time is reported apart).

    python benchmarks/decode_vs_titans_pytorch.py [--threads 2] [--reps 5] [--new 128] [--prompt 256]
        [--paths titans-pytorch,eager,compiled,compiled@1] [--json decode_vs_titans_pytorch_2threads]

A path "compiled@N" is the compiled one with torch's intra-op threads set to N for the call (the process
keeps `--threads`; one thread can beat two on a model this small); "compiled:state" (and
"compiled:state@N") compiles with `guards="state"` (`StaticDecoder`'s guards: the steps check only the
tensors, torch's global state and the decoder's own objects).

Models (dim 384, depth 4, 6 heads of 64, byte vocabulary, MAC segments of 64 tokens, 4 persistent tokens,
a memory in every layer):
  ours            `TitansConfig.preset("tiny", variant="mac", dim=384, depth=4, heads=6)`: memory chunks of
                  16, a depth-2 memory MLP of expansion 2.
  titans-pytorch  `MemoryAsContextTransformer(num_tokens=256, dim=384, depth=4, segment_len=64, heads=6,
                  dim_head=64, num_persist_mem_tokens=4, num_longterm_mem_tokens=4,
                  neural_memory_segment_len=16)`, its other settings its defaults (a depth-2 memory MLP of
                  expansion 4, 4 hyper-connection streams).

titans-pytorch is a benchmark-only dependency (`pip install -e '.[bench]'` in its own environment, see
docs/benchmarks.md); without it, only our paths are measured.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench_utils import Timer, describe, machine_info, median, print_table, save_json, timing_summary

VOCAB = 256


def ours(args):
    from titans import TitansConfig, TitansLM

    torch.manual_seed(0)
    cfg = TitansConfig.preset("tiny", variant="mac", dim=args.dim, depth=args.depth, heads=args.heads)
    return TitansLM(cfg).eval()


def theirs(args):
    from titans_pytorch import MemoryAsContextTransformer

    torch.manual_seed(0)
    return MemoryAsContextTransformer(
        num_tokens=VOCAB,
        dim=args.dim,
        depth=args.depth,
        segment_len=64,
        heads=args.heads,
        dim_head=args.dim // args.heads,
        num_persist_mem_tokens=4,
        num_longterm_mem_tokens=4,
        neural_memory_segment_len=16,
    ).eval()


def sampler(path: str, model, prompt: torch.Tensor):
    """A function new_tokens -> the sampled tokens, for this path."""
    if path == "titans-pytorch":
        return lambda n: model.sample(
            prompt, prompt.shape[1] + n, temperature=1.0, use_cache=True, show_progress=False
        )
    from titans.inference import generate

    compiled = "compile" if path.startswith("compiled") else False
    guards = "state" if path.split("@")[0].endswith(":state") else "full"
    if "@" not in path:
        return lambda n: generate(model, prompt, n, temperature=1.0, compiled=compiled, guards=guards)
    threads = int(path.split("@")[1])  # "compiled@1": the same, torch on 1 intra-op thread during the call

    def run(n):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return generate(model, prompt, n, temperature=1.0, compiled=compiled, guards=guards)
        finally:
            torch.set_num_threads(before)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--new", type=int, default=128, help="new tokens over which the marginal rate is taken")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", default="titans-pytorch,eager,compiled,compiled@1")
    p.add_argument("--json", default=None, help="write the results here (a path, or a name in results/)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the titans commands do
    machine = machine_info()
    paths = args.paths.split(",")
    if "titans-pytorch" in paths:
        try:
            import titans_pytorch  # noqa: F401
        except ImportError:
            print("titans-pytorch is not installed (pip install -e '.[bench]'): measuring ours only")
            paths.remove("titans-pytorch")
    prompt = torch.randint(0, VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    fns, rows = {}, {}
    with torch.no_grad():
        for path in paths:
            model = theirs(args) if path == "titans-pytorch" else ours(args)
            fns[path] = sampler(path, model, prompt)
            n_params = sum(t.numel() for t in model.parameters())
            with Timer() as warm:  # compiles every phase's step (a cycle of them) on the compiled path
                fns[path](1 + (math.lcm(16, 64) if path.startswith("compiled") else 1))
            rows[path] = {"path": path, "params_m": n_params / 1e6, "warmup_s": warm.wall, "t1": [], "tn": []}
        for _ in range(args.reps):  # the paths take turns
            for path in paths:
                for n, key in ((1, "t1"), (1 + args.new, "tn")):
                    with Timer() as t:
                        fns[path](n)
                    rows[path][key].append(t.wall)
    base = rows[paths[0]]
    for r in rows.values():
        rates = [args.new / (tn - t1) for t1, tn in zip(r["t1"], r["tn"])]
        r["tok_per_s"] = median(rates)
        r["ms_per_token"] = 1000 / r["tok_per_s"]
        r["rates"] = rates
        r["timing_1"], r["timing_n"] = timing_summary(r.pop("t1")), timing_summary(r.pop("tn"))
        r["x_vs_" + paths[0]] = r["tok_per_s"] / base["tok_per_s"]
    head = (
        f"MAC dim {args.dim}, depth {args.depth}: {args.prompt}-token prompt, marginal rate over {args.new}"
    )
    print(f"{head} new tokens, {args.threads} threads, median of {args.reps}; {describe(machine)}")
    print_table(
        list(rows.values()),
        [("path", "path"), ("params_m", "params M"), ("tok_per_s", "tok/s"), ("ms_per_token", "ms/token"),
         ("x_vs_" + paths[0], f"x {paths[0]}"), ("warmup_s", "warm-up s")],
    )  # fmt: skip
    if args.json:
        # the paths measured: titans-pytorch is left out of --paths where it is not installed
        result = {"benchmark": "decode_vs_titans_pytorch", "args": {**vars(args), "paths": ",".join(paths)},
                  "rows": list(rows.values())}  # fmt: skip
        print(f"wrote {save_json(args.json, result, machine)}")


if __name__ == "__main__":
    main()
