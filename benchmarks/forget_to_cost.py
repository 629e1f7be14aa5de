"""What forgetting toward the learned initial weights costs the MAC recipe: forward + backward of the model
of `configs/mac.json` (or `--config`: its preset, variant and model overrides; batch 16 x 256 tokens) with
`memory_forget_to="init"` against `"zero"` (the paper's forgetting), the two models taking turns every
repetition (A B, B A, ...) in one process on one thread, so that drift of a shared machine hits both alike.
`--profile` adds a torch.profiler table of each (self CPU time per op), whose difference shows where the
extra time goes.

    python benchmarks/forget_to_cost.py [--reps 20] [--threads 1] [--profile] [--old-op REV] [--name NAME]

`--old-op REV` adds a third model in the rotation: forget_to="init" on the memory op of git revision REV
(its `src/titans/ops/memory/chunk.py`), so that an old and a new anchor step are timed side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench_utils import Timer, machine_info, save_json, timing_summary

ROOT = Path(__file__).resolve().parent.parent


def build(forget_to: str, config_path: Path, seed: int = 0):
    """The main job's model with `memory_forget_to` set, and a config dict of batch size and length."""
    from titans.models import TitansConfig, TitansLM

    job = json.loads(config_path.read_text())
    overrides = {**job.get("model", {}), "memory_forget_to": forget_to}
    cfg = TitansConfig.preset(job["preset"], variant=job["variant"], vocab_size=256, **overrides)
    torch.manual_seed(seed)
    return TitansLM(cfg), job


def load_op(rev: str, folder: Path):
    """`neural_memory_chunked` of git revision `rev`'s src/titans/ops/memory/chunk.py."""
    op = "src/titans/ops/memory/chunk.py"
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{op}"], capture_output=True, text=True)
    if source.returncode != 0:
        raise SystemExit(f"forget_to_cost: {rev} has no {op}")
    path = folder / "chunk_old.py"
    path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location("titans_chunk_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.neural_memory_chunked


@contextlib.contextmanager
def memory_op(fn):
    """Run the memory layers on `fn` as `neural_memory_chunked` (None: the working tree's)."""
    import titans.ops.memory as ops

    saved = ops.neural_memory_chunked
    ops.neural_memory_chunked = fn or saved
    try:
        yield
    finally:
        ops.neural_memory_chunked = saved


def step(model, tokens: torch.Tensor) -> None:
    """One forward + backward (the gradients are dropped, as the optimiser step is not timed)."""
    model.zero_grad(set_to_none=True)
    logits, _ = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def profile_table(model, tokens: torch.Tensor, reps: int) -> tuple[str, dict[str, float], dict[str, float]]:
    """torch.profiler's table of `reps` steps (self CPU time per op), and per op and step the self CPU
    microseconds and the number of calls (which load on a shared machine does not blur)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            step(model, tokens)
    events = prof.key_averages()
    per_op = {e.key: e.self_cpu_time_total / reps for e in events}
    calls = {e.key: e.count / reps for e in events}
    return events.table(sort_by="self_cpu_time_total", row_limit=25), per_op, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "mac.json"))
    p.add_argument("--reps", type=int, default=20, help="timed repetitions of each model")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="also profile each model (5 steps each)")
    p.add_argument("--old-op", help="git revision whose memory op runs a third model, forget_to='init'")
    p.add_argument("--name", help="write benchmarks/results/NAME.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    models = {}
    for forget_to in ("init", "zero"):
        models[forget_to], job = build(forget_to, Path(args.config))
    models["zero"].load_state_dict(models["init"].state_dict())  # the same weights: only forgetting differs
    ops = {name: None for name in models}
    if args.old_op:
        models["init_old"] = models["init"]
        ops["init_old"] = load_op(args.old_op, Path(tempfile.mkdtemp()))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (job["batch_size"], job["seq_len"] + 1), generator=gen)

    for _ in range(args.warmup):
        for name, model in models.items():
            with memory_op(ops[name]):
                step(model, tokens)
    times: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}  # process CPU time: less hit by load
    for rep in range(args.reps):
        order = list(models) if rep % 2 == 0 else list(models)[::-1]
        for name in order:
            with memory_op(ops[name]), Timer() as t:
                step(models[name], tokens)
            times[name].append(t.wall)
            cpu[name].append(t.cpu)
    summary = {name: timing_summary(ts) for name, ts in times.items()}
    cpu_summary = {name: timing_summary(ts) for name, ts in cpu.items()}
    ratio = timing_summary([a / b for a, b in zip(times["init"], times["zero"])])
    cpu_ratio = timing_summary([a / b for a, b in zip(cpu["init"], cpu["zero"])])
    old = {}
    if args.old_op:
        old = {
            "old_op": args.old_op,
            "init_old_over_zero_cpu": timing_summary([a / b for a, b in zip(cpu["init_old"], cpu["zero"])]),
            "init_over_init_old_cpu": timing_summary([a / b for a, b in zip(cpu["init"], cpu["init_old"])]),
        }
    print(f"forward+backward, batch {job['batch_size']} x {job['seq_len']}, {args.threads} thread(s)")
    for name, s in summary.items():
        c = cpu_summary[name]
        print(
            f"  forget_to={name:<5} wall median {s['median_s'] * 1e3:7.1f} ms (spread {s['spread']:.2f})"
            f"  cpu median {c['median_s'] * 1e3:7.1f} ms (spread {c['spread']:.2f})"
        )
    rows = [("init / zero, wall", ratio), ("init / zero, cpu", cpu_ratio)]
    if old:
        rows += [
            (f"init@{args.old_op} / zero, cpu", old["init_old_over_zero_cpu"]),
            (f"init / init@{args.old_op}, cpu", old["init_over_init_old_cpu"]),
        ]
    for label, r in rows:
        lo, hi = r["min_s"], r["max_s"]
        print(f"  {label} per rep: median {r['median_s']:.3f} (min {lo:.3f}, max {hi:.3f})")

    profiles = {}
    if args.profile:
        per_op, calls = {}, {}
        for name in ("init", "zero"):
            model = models[name]
            table, per_op[name], calls[name] = profile_table(model, tokens, 5)
            print(f"\n--- forget_to={name} (self CPU, 5 steps)\n{table}")
        keys = set(per_op["init"]) | set(per_op["zero"])
        diff = {k: per_op["init"].get(k, 0.0) - per_op["zero"].get(k, 0.0) for k in keys}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:20]
        print("\n--- self CPU us per step, init - zero (largest first)")
        for key, us in top:
            print(f"  {us:+9.0f}  {key}")
        keys = set(calls["init"]) | set(calls["zero"])
        count_diff = {k: calls["init"].get(k, 0.0) - calls["zero"].get(k, 0.0) for k in keys}
        count_top = sorted(((k, c) for k, c in count_diff.items() if c), key=lambda kv: -abs(kv[1]))[:20]
        print("\n--- calls per step, init - zero")
        for key, c in count_top:
            print(f"  {c:+9.0f}  {key}")
        profiles = {
            "self_cpu_us_per_step_init_minus_zero": dict(top),
            "calls_per_step_init_minus_zero": dict(count_top),
        }

    if args.name:
        payload = {
            "config": args.config,
            "batch": job["batch_size"],
            "seq_len": job["seq_len"],
            "threads": args.threads,
            "reps": args.reps,
            "wall": summary,
            "cpu": cpu_summary,
            "init_over_zero_wall": ratio,
            "init_over_zero_cpu": cpu_ratio,
            **old,
            **profiles,
        }
        print(save_json(args.name, {"machine": machine_info(), **payload}))


if __name__ == "__main__":
    sys.exit(main())
