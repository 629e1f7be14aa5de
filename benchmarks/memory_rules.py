"""The memory rules side by side (docs/benchmarks.md, "Memory rules"): cost, capacity, language modelling
and S-NIAH pass-key retrieval for each preset of `titans.ops.memory` (`MemoryRule`) at the same budget.

    python benchmarks/memory_rules.py [--sections speed,capacity,lm] [--rules titans,moneta,yaad,memora,atlas]
        [any `titans eval ablate` option for the lm section, e.g. --lm-steps 60 --task-steps 150]

Sections:
- speed: forward + backward time of the memory op (batch 8, 4 heads of width 32, 256 tokens or `--tokens`,
  depth 2, hidden 64, chunk 16, float32, the threads given): the Titans fast path, each rule as it runs,
  Titans's and Yaad's parts on the generic autograd op (the implementation's own cost); the Muon
  orthogonalisation alone.
- capacity: `benchmarks/memory_capacity.py`'s protocol per rule: N random associations written by the
  rule's own op at chunk size 1, 4 epochs, no momentum, no forgetting, no clip, the inner learning rate
  tuned over a grid, recall error of the final weights (1.0 = a memory that reads 0). Depth-2 memory, hidden
  width d. Huber delta fixed at 0.1 (a v entry is ~N(0, 1/d)); Omega window gates 1.
- lm: one row of `titans eval ablate` per rule (model override `memory_rule`): the same seed, data, LM steps
  (held-out bits per byte on the built-in text), then the same pass-key recipe (S-NIAH accuracy at lengths
  beyond its training length).
Writes benchmarks/results/memory_rules.json (or --name).
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
import torch.nn.functional as F

from bench_utils import Timer, machine_info, print_table, save_json
from titans.ops.memory import (
    RULE_PRESETS,
    MemoryRule,
    fits_fast_path,
    memory_rule_chunked,
    memory_rule_chunked_autograd,
    neural_memory_chunked,
    newton_schulz,
)

THETAS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def speed(rules: list[str], reps: int, t: int = 256) -> list[dict]:
    """Median forward + backward seconds of the memory op per rule (B 8, 4 heads of width 32, T tokens, depth
    2 with hidden width 64, chunk 16, float32): the Titans fast path, Titans's parts on the generic autograd
    op (the implementation's own cost), and each rule on the generic op."""
    g = torch.Generator().manual_seed(0)
    b, h, d = 8, 4, 32
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    core = [0.01 * torch.rand(b, h, t, generator=g), F.logsigmoid(torch.randn(b, h, t, generator=g) + 2)]
    core.append(F.logsigmoid(torch.randn(b, h, t, generator=g) - 4))
    w0 = (
        torch.randn(h, d, 2 * d, generator=g) / d**0.5,
        torch.randn(h, 2 * d, d, generator=g) / (2 * d) ** 0.5,
    )

    def timed(fn, n_extra):
        extra = [torch.rand(b, h, t, generator=g) + 0.1 for _ in range(n_extra)]
        gates = torch.stack(core + extra, -1)
        times = []
        for i in range(reps + 1):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, gates, *w0)]
            ws = tuple(w.expand(b, *w.shape) for w in leaves[4:])
            ms = tuple(torch.zeros_like(w) for w in ws)
            with Timer() as clock:
                y, *_ = fn(*leaves[:4], ws, ms)
                y.square().mean().backward()
            if i:  # the first run warms up
                times.append(clock.wall)
        return sorted(times)[len(times) // 2]  # the upper median: one of the runs

    def fast(q, k, v, gates, ws, ms):
        return neural_memory_chunked(q, k, v, *gates.unbind(-1), ws, ms, chunk_size=16, surprise_clip=1.0)

    def op(rule, fn=memory_rule_chunked):
        return partial(fn, rule=rule, chunk_size=16, surprise_clip=1.0)

    rows = [{"rule": "titans (fast path)", "fwd_bwd_s": timed(fast, 0)}]
    for name in rules:
        if name != "titans":
            rule = RULE_PRESETS[name]
            path = "fast path" if fits_fast_path(rule) else "autograd op"
            rows.append({"rule": f"{name} ({path})", "fwd_bwd_s": timed(op(rule), len(rule.extra_gates))})
    for name, rule in (("titans", MemoryRule()), ("yaad", RULE_PRESETS["yaad"])):
        seconds = timed(op(rule, memory_rule_chunked_autograd), len(rule.extra_gates))
        rows.append({"rule": f"{name} on the autograd op", "fwd_bwd_s": seconds})
    for r in rows:
        r["vs_titans"] = r["fwd_bwd_s"] / rows[0]["fwd_bwd_s"]
    # Muon's orthogonalisation alone, forward: once per chunk per layer on the (B H, d_in, d_out) momentum
    s = [torch.randn(b * h, d, 2 * d), torch.randn(b * h, 2 * d, d)]
    with Timer() as clock:
        for _ in range(reps * t // 16):
            for m in s:
                newton_schulz(m, 5)
    ns = clock.wall / reps
    rows.append({"rule": "atlas: its Newton-Schulz alone (forward)", "fwd_bwd_s": ns, "vs_titans": None})
    return rows


def capacity_error(rule_name: str, d: int, n: int, theta: float, epochs: int, seed: int) -> float:
    rule = RULE_PRESETS[rule_name]
    g = torch.Generator().manual_seed(1000 * seed + n)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    values = torch.randn(n, d, generator=g) / math.sqrt(d)
    g = torch.Generator().manual_seed(seed)
    sizes = [d, d, d]
    weights = [torch.randn(1, 1, a, b, generator=g) / math.sqrt(a) for a, b in zip(sizes[:-1], sizes[1:])]
    weights[-1].zero_()
    momentum = tuple(torch.zeros_like(w) for w in weights)
    k = keys.repeat(epochs, 1)[None, None]
    v = values.repeat(epochs, 1)[None, None]
    t = k.shape[2]
    core = [torch.full((1, 1, t), theta), torch.full((1, 1, t), float("-inf")), torch.zeros(1, 1, t)]
    extra = [torch.ones(1, 1, t) if e == "omega" else torch.full((1, 1, t), 0.1) for e in rule.extra_gates]
    gates = torch.stack(core + extra, -1)
    with torch.no_grad():
        _, a_end, _, _ = memory_rule_chunked(
            k, k, v, gates, tuple(weights), momentum, rule=rule, chunk_size=1
        )
        w = [rule.retention.read(a) for a in a_end]
        h = F.silu(keys @ w[0][0, 0])
        pred = h @ w[1][0, 0]
    err = ((pred - values).pow(2).sum() / values.pow(2).sum()).item()
    return err if math.isfinite(err) else float("inf")


def capacity(rules: list[str], d: int, counts: list[int], epochs: int, seeds: int) -> list[dict]:
    rows = []
    for n in counts:
        row = {"N": n}
        for name in rules:
            best = min(
                (sum(capacity_error(name, d, n, th, epochs, s) for s in range(seeds)) / seeds, th)
                for th in THETAS
            )
            row[name] = best[0]
            row[f"{name}_theta"] = best[1]
        rows.append(row)
        print(f"  capacity N={n} done", flush=True)
    return rows


def lm(rules: list[str], rest: list[str], control: bool = False) -> tuple[list[dict], dict]:
    """One `titans eval ablate` row per rule (its parser, its defaults, `rest` on top); with `control`, a
    last row of Titans with its momentum gate off (eta = 0, as the MIRAS presets' plain gradient descent)."""
    from titans.evaluation import ablation
    from titans.evaluation.args import model_overrides, set_threads
    from titans.evaluation.lm_study import run_root

    parser = argparse.ArgumentParser()
    ablation.add_parser(parser.add_subparsers())
    args = parser.parse_args(["ablate", *rest])
    set_threads(args)
    args.base_overrides = model_overrides(args)
    args.task_time_budget = None if args.time_budget is None else 60.0 * args.time_budget
    samples = ablation.task_samples(args)
    control_row = "titans, eta = 0"
    with run_root(args, "titans-rules-", [*rules, *([control_row] if control else [])]) as root:
        rows = [ablation.run_row(args, name, {"memory_rule": name}, root, samples) for name in rules]
        if control:
            overrides = {"memory_rule": "titans", "memory_momentum": False}
            rows.append(ablation.run_row(args, control_row, overrides, root, samples))
    return rows, vars(args)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--sections", default="speed,capacity,lm")
    p.add_argument("--rules", default=",".join(RULE_PRESETS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5, help="speed: timed runs per rule (median)")
    p.add_argument("--tokens", type=int, default=256, help="speed: sequence length")
    p.add_argument("--dim", type=int, default=32, help="capacity: head width d")
    p.add_argument("--pairs", default="16,32,64,128", help="capacity: association counts N")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--name", default="memory_rules")
    p.add_argument("--control", action="store_true", help="lm: add Titans with momentum off (eta = 0)")
    args, rest = p.parse_known_args()  # the rest: `titans eval ablate`'s options, for the lm section
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [f"section {s!r}" for s in sections if s not in ("speed", "capacity", "lm")]
    unknown += [f"rule {r!r}" for r in rules if r not in RULE_PRESETS]  # a bare KeyError
    if unknown or not sections or not rules:
        p.error(f"unknown {', '.join(unknown)}" if unknown else "give at least one section and one rule")
    if (rest or args.control) and "lm" not in sections:  # a typo was dropped without a word
        p.error(f"{' '.join(rest) or '--control'}: options of the lm section, which --sections leaves out")
    torch.set_num_threads(args.threads)
    out = {"machine": machine_info(), "rules": rules}
    clock = Timer.started()
    if "speed" in sections:
        out["speed"] = speed(rules, args.reps, args.tokens)
        out["speed_tokens"] = args.tokens
        print(
            f"\nforward + backward of the memory op (B 8, 4 heads x 32, T {args.tokens}, depth 2, hidden 64, "
            "chunk 16)"
        )
        print_table(out["speed"], [("rule", "rule"), ("fwd_bwd_s", "seconds"), ("vs_titans", "x titans")])
    if "capacity" in sections:
        counts = [int(n) for n in args.pairs.split(",")]
        out["capacity"] = capacity(rules, args.dim, counts, args.epochs, args.seeds)
        out["capacity_config"] = {
            "dim": args.dim,
            "epochs": args.epochs,
            "seeds": args.seeds,
            "thetas": THETAS,
        }
        print(
            f"\nrecall error (best over theta; d = {args.dim}, depth 2, hidden d, {args.epochs} epochs, "
            "chunk 1)"
        )
        print_table(out["capacity"], [("N", "N")] + [(r, r) for r in rules])
    if "lm" in sections:
        rows, lm_args = lm(rules, ["--threads", str(args.threads), *rest], args.control)
        out["lm"] = rows
        out["lm_args"] = {
            k: v for k, v in lm_args.items() if isinstance(v, (int, float, str, list, type(None)))
        }
        cols = [("name", "rule"), ("parameters", "params"), ("heldout_bpb", "held-out bpb")]
        cols += [("niah_accuracy", "NIAH"), ("niah_final_task_loss", "answer loss"), ("seconds", "seconds")]
        print_table(rows, cols)
        for r in rows:
            print(r["name"], r.get("niah_by_length"))
    out["seconds"] = clock.elapsed()
    print(f"wrote {save_json(args.name, out)}")


if __name__ == "__main__":
    main()
