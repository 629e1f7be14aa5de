"""A/B timing of two versions of the memory op's torch path (`src/titans/ops/memory/chunk.py`) in ONE
process: the NeuralMemory layer's fwd+bwd at the README's benchmark shapes (batch 2, seq 2048, dim 256,
4 heads of 256 -> 1024 -> 256, chunk 64, GELU), the two versions taking turns every repetition (A B, B A,
A B, ...) on the same module, weights and input, so that drift of the machine hits both alike. Separate
runs of a script on this VM differ by a few percent, more than most single changes to the op gain
(docs/benchmarks.md quotes its result for the op's Python-side changes at 21ad462 against 339cebb).

    python benchmarks/memory_ab.py --a HEAD~1 [--b WORKTREE] [--reps 12] [--threads 2] [--name NAME]

A and B are git revisions (their `src/titans/ops/memory/chunk.py`, or `src/titans/ops/memory.py` in
revisions where the op is one file) or paths to such a file; B defaults to the working tree's. Only the
op's `neural_memory_chunked` is swapped, so both versions must call the compiled CPU kernels
(`titans.ops.cpu_kernels`) with the signatures of the installed ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_utils import Timer, machine_info, print_table, save_json, timing_summary

ROOT = Path(__file__).resolve().parent.parent
OP = "src/titans/ops/memory/chunk.py"
OLD_OP = "src/titans/ops/memory.py"  # the torch path's file in revisions where the op was one file


def load_version(spec: str, label: str, folder: Path):
    """The memory op module of a git revision or a file path (WORKTREE: the working tree's)."""
    path = ROOT / OP if spec == "WORKTREE" else Path(spec)
    if spec != "WORKTREE" and not path.is_file():
        shown = [
            subprocess.run(["git", "-C", str(ROOT), "show", f"{spec}:{op}"], capture_output=True, text=True)
            for op in (OP, OLD_OP)
        ]
        source = next((run.stdout for run in shown if run.returncode == 0), None)
        if source is None:
            raise SystemExit(f"memory_ab: {spec} has neither {OP} nor {OLD_OP}")
        path = folder / f"memory_{label}.py"
        path.write_text(source)
    module_spec = importlib.util.spec_from_file_location(f"titans_memory_{label}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def taking_todays_keywords(fn):
    """`fn` (an older revision's op) called with the keywords today's layer passes: one it does not have is
    dropped where it is off (None / False: the option did not exist, so the revision ran without it), and
    refused where it is on (an older op raised a TypeError with a traceback)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn

    def call(*args, **kwargs):
        extra = {k: v for k, v in kwargs.items() if k not in params}
        on = sorted(k for k, v in extra.items() if v is not None and v is not False)
        if on:
            raise SystemExit(f"memory_ab: this revision's op has no {', '.join(on)}, which the layer sets")
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="git revision or path to the op's torch path (chunk.py)")
    p.add_argument("--b", default="WORKTREE", help="git revision or path (default: the working tree)")
    p.add_argument("--reps", type=int, default=12, help="timed repetitions of each version")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (each step ends with a device sync)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--name", help="also write benchmarks/results/NAME.json")
    args = p.parse_args()

    import torch

    import titans.ops.memory as op_module
    from titans import NeuralMemory

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    machine = machine_info()
    with tempfile.TemporaryDirectory() as folder:
        versions = {
            "A": load_version(args.a, "A", Path(folder)),
            "B": load_version(args.b, "B", Path(folder)),
        }
    torch.manual_seed(0)
    module = NeuralMemory(256, heads=4, head_dim=256, depth=2, expansion=4, chunk_size=64, activation="gelu")
    module.to(args.device)
    x = torch.randn(args.batch, 2048, 256, device=args.device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def step() -> None:
        module(x)[0].sum().backward()
        sync()

    times: dict[str, list[float]] = {"A": [], "B": []}
    for rep in range(args.reps + 1):
        for label in ("A", "B") if rep % 2 == 0 else ("B", "A"):
            # the entry point's dispatch calls the torch path by this name
            op_module.neural_memory_chunked = taking_todays_keywords(versions[label].neural_memory_chunked)
            with Timer() as clock:
                step()
            if rep:  # the first round is the warm-up
                times[label].append(clock.wall)
    summary = {k: timing_summary(v) for k, v in times.items()}
    rows = [
        {
            "version": label,
            "source": spec,
            "median_s": summary[label]["median_s"],
            "min_s": summary[label]["min_s"],
            "max_s": summary[label]["max_s"],
            "tok_s": args.batch * 2048 / summary[label]["median_s"],
            "vs_A": summary[label]["median_s"] / summary["A"]["median_s"],
        }
        for label, spec in (("A", args.a), ("B", args.b))
    ]
    where = f"{args.threads} threads" if args.device == "cpu" else machine["gpu"]
    print(f"layer fwd+bwd, batch {args.batch} x seq 2048, {where}, {args.reps} alternating reps each")
    cols = [("version", "version"), ("source", "source"), ("median_s", "median s"), ("min_s", "min s")]
    cols += [("max_s", "max s"), ("tok_s", "tok/s"), ("vs_A", "time vs A")]
    print_table(rows, cols)
    if args.name:
        path = save_json(
            args.name,
            {
                "machine": machine,
                "device": args.device,
                "threads": args.threads,
                "rows": rows,
                "times": times,
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
