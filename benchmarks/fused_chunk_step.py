"""The memory's fused no-grad chunk step (C++, `chunk_step_forward`) against the torch-op step it replaces
on CPU: the step alone, and prefill through `titans.inference.prefill` as a user runs it, side by side.

Without autograd (prefill, evaluation, the server's writes, eager decoding when a chunk completes) each
complete chunk of the memory is one call of the fused step where it applies (the l2 inner loss, memory
depth 1 or 2, float32/64 on CPU); the torch-op step (`titans.ops.memory.chunk._chunk_forward`) runs 35
small computing ATen operators a chunk at the tiny preset. Both run in one process, taking turns
repetition by repetition (the machine's load falls on both alike), the fused step switched off by patching
the chunk module's kernel lookup, as `TITANS_CPU_KERNELS=0` would (without turning off the conv kernel
beside it).

Per variant (`--variants`, the `--preset` at random weights, byte vocabulary), per batch x length
(`--shapes`), and per thread count (`--threads`): prefill tokens/s of each step (median of `--reps`) and
their ratio, the step alone (microseconds, at the first memory layer's chunk of that shape, and the
computing operators the torch-op step runs), and the largest
difference of the last position's logits between the two, and of each from the same model run in float64.

    python benchmarks/fused_chunk_step.py [--variants mal,mac,mag,lmm] [--shapes 1x4096,8x1024,32x256]
        [--threads 1,2] [--reps 7] [--set KEY=VALUE ...] [--out fused_chunk_step_cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics

import torch

from bench_utils import machine_info, print_table, save_json, time_alternating
from decode_ops import OpCounter
from titans import TitansConfig, TitansLM
from titans.inference import prefill
from titans.ops.memory import chunk as memory_chunk


@contextlib.contextmanager
def step(fused: bool):
    """The fused step on (as the library runs) or off (the torch-op step)."""
    lookup = memory_chunk._step_kernel
    if not fused:
        memory_chunk._step_kernel = lambda *args: None
    try:
        yield
    finally:
        memory_chunk._step_kernel = lookup


def first_chunk_call(model: TitansLM, tokens: torch.Tensor) -> tuple:
    """The arguments of the first torch-op chunk step a prefill of `tokens` runs (the first memory layer)."""
    calls = []
    forward = memory_chunk._chunk_forward

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return forward(*args, **kwargs)

    memory_chunk._chunk_forward = record
    try:
        with step(False), torch.no_grad():
            model(tokens[:, : model.config.chunk_size])
    finally:
        memory_chunk._chunk_forward = forward
    return calls[0]


def step_us(model: TitansLM, tokens: torch.Tensor, reps: int) -> dict:
    """The chunk step alone, the torch-op one and the fused one, alternating in blocks of 200 calls:
    microseconds per call, and the computing ATen operators one torch-op step runs (as `decode_ops.py`
    counts them: views and other metadata-only operators left out)."""
    (kq, v, gamma, beta, mix, activation, residual, clip, threshold, states), kwargs = first_chunk_call(
        model, tokens
    )
    kernel = memory_chunk._step_kernel(kq, None, states)
    if kernel is None:
        return {}
    outs = [torch.empty_like(x) for x in states]
    kwargs = {key: value for key, value in kwargs.items() if key != "out"}
    options = memory_chunk._step_options(activation, residual, clip, threshold, None)
    calls = {
        "torch": lambda: memory_chunk._chunk_forward(
            kq, v, gamma, beta, mix, activation, residual, clip, threshold, states, out=outs, **kwargs
        ),
        "fused": lambda: kernel.chunk_step_forward(kq, v, gamma, beta, mix, states, outs, *options),
    }
    with torch.no_grad():
        with OpCounter() as counter:
            calls["torch"]()
        blocks = {name: lambda fn=fn: [fn() for _ in range(200)] for name, fn in calls.items()}
        times = time_alternating(blocks, reps, warmup=1)
    return {f"{name}_step_us": statistics.median(t) / 200 * 1e6 for name, t in times.items()} | {
        "torch_step_ops": counter.ops
    }


def measure(
    variant: str, preset: str, batch: int, length: int, threads: int, reps: int, overrides: dict | None = None
) -> dict:
    torch.set_num_threads(threads)
    cfg = TitansConfig.preset(preset, variant=variant, vocab_size=256, **(overrides or {}))
    torch.manual_seed(0)
    model = TitansLM(cfg).eval()
    tokens = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))
    logits = {}

    def run(name: str):
        with step(name == "fused"):
            logits[name], _ = prefill(model, tokens)

    times = time_alternating({name: lambda name=name: run(name) for name in ("torch", "fused")}, reps, 1)
    torch_s, fused_s = statistics.median(times["torch"]), statistics.median(times["fused"])
    with step(True):  # the same model in float64 (the fused step there too): how far float32 is from it
        exact, _ = prefill(copy.deepcopy(model).double(), tokens)
    return {
        "variant": variant,
        "batch": batch,
        "length": length,
        "threads": threads,
        "torch_tok_s": batch * length / torch_s,
        "fused_tok_s": batch * length / fused_s,
        "speedup": torch_s / fused_s,
        "logits_max_abs_diff": (logits["torch"] - logits["fused"]).abs().max().item(),
        "torch_vs_float64": (logits["torch"].double() - exact).abs().max().item(),
        "fused_vs_float64": (logits["fused"].double() - exact).abs().max().item(),
        **step_us(model, tokens, reps),
        "times": times,
    }


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="mal,mac,mag,lmm")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--shapes", default="1x4096,8x1024,32x256", help="batch x length, comma-separated")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a TitansConfig field for every model (a JSON value or a string), e.g. memory_forget_to=init",
    )
    p.add_argument("--out", default="fused_chunk_step_cpu", help="a path, or a name in benchmarks/results/")
    args = p.parse_args()
    if memory_chunk.kernels() is None:
        raise SystemExit("the fused CPU kernels are not available (no compiler, or TITANS_CPU_KERNELS=0)")
    overrides = {key: _value(value) for key, value in (item.split("=", 1) for item in args.set)}
    machine = machine_info()
    torch.set_flush_denormal(True)  # as the titans commands do
    print(f"prefill, preset {args.preset}, median of {args.reps}, alternating; {machine['cpu']}")
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for variant in args.variants.split(","):
            for shape in args.shapes.split(","):
                batch, length = (int(x) for x in shape.split("x"))
                rows.append(measure(variant, args.preset, batch, length, threads, args.reps, overrides))
                speedup = rows[-1]["speedup"]
                print(f"  {variant} {batch}x{length}, {threads} thread(s): x{speedup:.2f}", flush=True)
    columns = [
        ("variant", "variant"),
        ("batch", "batch"),
        ("length", "tokens"),
        ("threads", "threads"),
        ("torch_tok_s", "torch-op tok/s"),
        ("fused_tok_s", "fused tok/s"),
        ("speedup", "speed-up"),
        ("torch_step_us", "torch-op step us"),
        ("fused_step_us", "fused step us"),
        ("torch_step_ops", "torch-op step ops"),
        ("logits_max_abs_diff", "logits max diff"),
        ("torch_vs_float64", "torch-op vs float64"),
        ("fused_vs_float64", "fused vs float64"),
    ]
    print_table(rows, columns)
    print(f"wrote {save_json(args.out, {'args': vars(args), 'results': rows}, machine)}")


if __name__ == "__main__":
    main()
