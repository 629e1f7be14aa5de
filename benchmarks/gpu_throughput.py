"""Training throughput and peak GPU memory of every variant on a CUDA device (bf16 autocast, as `titans
train` runs there), eager and with the micro-step replayed as a CUDA graph (`titans train --cuda-graphs`),
plus the neural memory layer alone in float32 and bf16. Every memory row also runs with the memory's chunk
loop on the Triton kernels (`memory_backend="triton"`, `titans.ops.memory.triton_chunk`): modes "kernels"
(eager) and "kernels+graphs"; the torch chunk loop is modes "eager" and "graphs". A mode with "compile"
compiles each block first (`titans train --compile`, `TitansLM.compile_blocks`): "kernels+compile",
"kernels+compile+graphs", "compile+graphs" (the baselines); `warmup_s` is then mostly the compile. A mode
with "recompute" recomputes each block in the backward pass (`TitansLM.gradient_checkpointing`).

One process, one model at a time, eager and graphed side by side. A step is forward + backward + AdamW;
its time is the median over `--steps` steps after two warm-up steps, read with CUDA events. All variants
share the preset's sizes (dim, depth, heads, window = segment_len, chunk_size), so the rows compare like
with like; the memory variants carry the memory's extra parameters.

    python benchmarks/gpu_throughput.py [--preset 170M] [--seqs 2048,8192] [--variants mac,mag,...]
        [--modes eager,graphs,kernels,kernels+graphs] [--rows 2048:mac:kernels+graphs,...]

`--rows` runs just the listed seq:variant:mode rows, in that order (no memory-alone rows unless
`--memory-backends` names some): `gpu_suite.py` puts the rows a goal needs first. Each row is printed as a
JSON line as soon as it is measured.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.nn.functional as F

from bench_utils import Timer, machine_info, median, save_json, time_cuda


def _timed(step, steps: int) -> tuple[float, float, float]:
    """(median seconds per call of `step`, peak GiB reserved, seconds of the two warm-up calls: with
    torch.compile, the compile) after two warm-up calls. Reserved, not allocated: a CUDA graph's memory pool
    counts as reserved only."""
    with Timer(sync=torch.cuda.synchronize) as warmup:
        for _ in range(2):
            step()
    torch.cuda.reset_peak_memory_stats()
    return median(time_cuda(step, steps, warmup=0)), torch.cuda.max_memory_reserved() / 2**30, warmup.wall


def model_row(variant: str, seq: int, mode: str, args: argparse.Namespace, every: int | None = None) -> dict:
    from titans import NeuralMemory, TitansConfig, TitansLM
    from titans.training.cuda_graphs import GraphedMicroStep

    torch.manual_seed(0)
    every = every or args.memory_checkpoint_every
    parts = mode.split("+")
    backend = "triton" if "kernels" in parts else "torch"
    cfg = TitansConfig.preset(
        args.preset, variant=variant, memory_checkpoint_every=every, memory_backend=backend
    )
    model = TitansLM(cfg).cuda()
    model.gradient_checkpointing = "recompute" in parts  # `titans train --set gradient_checkpointing=true`
    if "compile" in parts:  # as `titans train --compile` runs it
        model.compile_blocks()
    for module in model.modules():  # as `titans train` runs it: no host sync per memory call
        if isinstance(module, NeuralMemory):
            module.check_finite = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    graphed = None
    if "graphs" in parts:
        torch.cuda.reset_peak_memory_stats()
        graphed = GraphedMicroStep(model, tuple(inputs.shape), 1, torch.bfloat16, model.config.vocab_size)

    def step() -> None:
        if graphed is not None:
            graphed(inputs, targets)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, _ = model(inputs.cuda())
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.cuda().flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=graphed is None)

    sec, peak, warmup = _timed(step, args.steps)
    top = _profile(step, args.profile) if args.profile else None
    # whether the timed steps kept the weights finite (a step of non-finite numbers takes as long, but the
    # row then times a model that no longer trains)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {
        "variant": variant,
        "mode": mode,
        "memory_checkpoint_every": every,
        "seq": seq,
        "batch": args.batch,
        "params": model.num_parameters(),
        "step_s": sec,
        "tokens_per_s": args.batch * seq / sec,
        "peak_reserved_gib": peak,
        "warmup_s": warmup,
        "weights_finite": finite,
        **({"kernels": top} if top is not None else {}),
    }


def _profile(step, top: int) -> dict:
    """One more step under the torch profiler: the device time of all its kernels together, and the `top`
    ops by the device time of the kernels each launched itself (name, ms, calls): where a step's GPU time
    goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    ops = sorted(
        (e for e in events if e.device_type == DeviceType.CPU), key=lambda e: -e.self_device_time_total
    )
    return {
        "device_ms": kernels / 1e3,
        "kernels": sum(e.count for e in events if e.device_type == DeviceType.CUDA),
        "top": [
            {"name": e.key[:99], "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in ops[:top]
        ],
    }


def memory_row(seq: int, dtype: str, backend: str, args: argparse.Namespace) -> dict:
    """The NeuralMemory layer alone at the preset's sizes: forward + backward, no optimizer; its chunk loop
    on `backend` ("torch" or "triton")."""
    from titans import TitansConfig
    from titans.layers.memory import NeuralMemory

    cfg = TitansConfig.preset(args.preset)
    torch.manual_seed(0)
    mem = NeuralMemory(
        cfg.dim, heads=cfg.heads, depth=cfg.memory_depth, chunk_size=cfg.chunk_size, backend=backend
    ).cuda()
    x = torch.randn(args.batch, seq, cfg.dim, device="cuda", requires_grad=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            y, _ = mem(x)
        y.float().square().mean().backward()
        mem.zero_grad(set_to_none=True)
        x.grad = None

    sec, peak, _ = _timed(step, args.steps)
    return {"layer": "NeuralMemory", "dtype": dtype, "backend": backend, "seq": seq, "batch": args.batch,
            "step_s": sec, "tokens_per_s": args.batch * seq / sec, "peak_reserved_gib": peak}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="170M")
    p.add_argument("--variants", default="mac,mag,mal,lmm,swa,transformer")
    p.add_argument("--seqs", default="2048,8192")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--memory-checkpoint-every", type=int, help="TitansConfig.memory_checkpoint_every")
    p.add_argument(
        "--modes",
        default="eager,graphs,kernels,kernels+graphs",
        help="eager, graphs (CUDA graph replay), kernels (the memory's Triton kernels), compile (each block "
        "compiled, `titans train --compile`), recompute (activation checkpointing), or several joined by +: "
        "kernels+graphs, kernels+compile+graphs",
    )
    p.add_argument(
        "--memory-backends",
        default=None,
        help="memory-alone rows: torch and/or triton (default both; none with --rows)",
    )
    p.add_argument("--profile", type=int, default=0, help="per row, the N ops that take most GPU time")
    p.add_argument(
        "--rows",
        default="",
        help="seq:variant:mode[:checkpoint_every],... instead of --seqs x --variants x --modes",
    )
    p.add_argument("--out", default="gpu_throughput", help="a path, or a name in benchmarks/results/")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py: needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    machine = machine_info()
    seqs = [int(s) for s in args.seqs.split(",")]
    rows: list[dict] = []

    def run(fn, *a, **kw) -> None:
        try:
            rows.append(fn(*a, args, **kw))
        except torch.OutOfMemoryError:
            rows.append({"args": [str(x) for x in a], "error": "out of GPU memory"})
        except Exception as e:  # a kernel that fails to build: recorded, and the other rows still run
            rows.append({"args": [str(x) for x in a], "error": f"{type(e).__name__}: {e}"[:400]})
        gc.collect()  # a captured graph holds its memory pool until it is collected
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)

    for row in filter(None, args.rows.split(",")):
        seq, variant, mode, *every = row.split(":")  # a fourth field: that row's memory_checkpoint_every
        run(model_row, variant, int(seq), mode, **({"every": int(every[0])} if every else {}))
    default_backends = "" if args.rows else "torch,triton"
    backends = [b for b in (args.memory_backends or default_backends).split(",") if b]
    for seq in [] if args.rows else seqs:
        for variant in args.variants.split(","):
            for mode in args.modes.split(","):
                if "kernels" in mode.split("+") and variant in ("swa", "transformer"):
                    continue  # no memory: the kernels change nothing
                run(model_row, variant, seq, mode)
    for seq in seqs if backends else []:
        for dtype in ("fp32", "bf16"):
            for backend in backends:
                run(memory_row, seq, dtype, backend)

    name = machine["gpu"]
    print(f"\n{name}, preset {args.preset}, batch {args.batch}, bf16 autocast, median of {args.steps} steps")
    print("variant rows: fwd+bwd+AdamW; memory rows: the NeuralMemory layer alone, fwd+bwd;")
    print("reserved: peak GPU memory the allocator held, GiB")
    if args.memory_checkpoint_every:
        print(f"memory_checkpoint_every={args.memory_checkpoint_every}")
    print(f"{'variant':<14}{'mode':<15}{'seq':>7}{'params':>13}{'step ms':>10}{'tok/s':>12}{'reserved':>10}"
          f"{'vs eager':>10}")  # fmt: skip
    eager = {(r["variant"], r["seq"]): r["step_s"] for r in rows if r.get("mode") == "eager"}
    for r in rows:
        if "error" in r:
            print(f"{' '.join(r['args']):<36}  {r['error']}")
            continue
        label = r.get("variant") or f"memory {r['dtype']}"
        mode = r.get("mode", r.get("backend", ""))
        mode += f" c{r['memory_checkpoint_every']}" if r.get("memory_checkpoint_every") else ""
        params = f"{r['params']:,}" if "params" in r else ""
        ref = eager.get((r.get("variant"), r["seq"]))
        ratio = f"{ref / r['step_s']:.2f}x" if ref and r.get("mode") != "eager" else ""
        print(f"{label:<14}{mode:<15}{r['seq']:>7}{params:>13}{r['step_s'] * 1e3:>10.1f}"
              f"{r['tokens_per_s']:>12,.0f}{r['peak_reserved_gib']:>10.2f}{ratio:>10}")  # fmt: skip
        if "kernels" in r:
            k = r["kernels"]
            print(
                f"  {k['kernels']} kernels, {k['device_ms']:.1f} GPU ms in a {r['step_s'] * 1e3:.1f} ms step"
            )
            for k in r["kernels"]["top"]:
                print(f"  {k['ms']:>9.2f} ms {k['calls']:>6}x  {k['name'][:90]}")
    print(f"wrote {save_json(args.out, {'device': name, 'args': vars(args), 'rows': rows}, machine)}")


if __name__ == "__main__":
    main()
