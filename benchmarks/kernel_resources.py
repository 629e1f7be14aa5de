"""What the memory's Triton kernels compile to on a Hopper GPU, read on a machine without one.

Each case compiles the forward and backward kernels (`titans.ops.memory.triton_chunk.compiled_kernels`)
for compute capability 9.0 (H100 / H200) with Triton's own compiler and `ptxas`, then reads the binary
with `cuobjdump` (shipped with Triton): registers and spill stack per thread, shared memory per program,
and the machine instructions one warp executes per chunk (the chunk loop's body, with each row loop
inside it counted as many times as it runs), split by kind: spills to local memory (`LDL` / `STL`),
barriers (`BAR`), tensor-core matrix products (`HMMA` / `HGMMA`), shared memory (`LDS` / `STS`), global
memory (`LDG` / `STG`).

The kernels run one program per sequence-head with a long dependent chain per chunk, so their time on a
GPU follows the instructions and stalls of that chain; these counts are the part of it that can be read
without running it (docs/benchmarks.md, "What the kernels compile to"). No GPU needed; on a CPU core
about 13 s a kernel with TF32, one to two minutes with exact float32 (`ieee`).

    python benchmarks/kernel_resources.py [--cases 2:128,1:64] [--rows 32] [--precisions tf32] [--out F]

A case is depth:hidden (depth 1 takes hidden = head_dim); `--rows` lists the backward's row blocks to
compile (`TITANS_MEMORY_TRITON_ROWS`), `--warps` the warps per program (`TITANS_MEMORY_TRITON_WARPS`; 0:
the kernels' own choice). The kernels are built with the `ptxas` options they run with
(`triton_chunk.ptxas_options`; `TITANS_MEMORY_TRITON_PTXAS=` for Triton's own -O3 throughout).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from bench_utils import machine_info, print_table, save_json

KINDS = {
    "spill": r"\b(LDL|STL)\b",
    "barrier": r"\bBAR\b",
    "mma": r"\b(HMMA|HGMMA)\b",
    "shared": r"\b(LDS|STS|LDSM)\b",
    "global": r"\b(LDG|STG)\b",
}


def _tool(name: str) -> str:
    """A CUDA binary tool: Triton's own copy, else one on PATH."""
    import triton

    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    found = str(shipped) if shipped.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found (it ships with triton's nvidia backend)")
    return found


def parse_sass(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) pairs of a `cuobjdump -sass` listing."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def per_chunk(instructions: list[tuple[int, str]], inner_trips: int) -> dict:
    """Counts per chunk: the loops are the ranges a backward branch closes; the outermost is the chunk
    loop, and every loop inside it runs `inner_trips` times per chunk (the backward's row blocks). Returns
    {} where no loop is found."""
    loops = []
    for address, text in instructions:
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            loops.append((int(m.group(1), 16), address))
    if not loops:
        return {}
    outer = max(loops, key=lambda r: r[1] - r[0])
    inner = [r for r in loops if r != outer and outer[0] <= r[0] and r[1] <= outer[1]]
    counts = {"instructions": 0, **{k: 0 for k in KINDS}}
    for address, text in instructions:
        if not outer[0] <= address <= outer[1]:
            continue
        weight = inner_trips if any(a <= address <= b for a, b in inner) else 1
        counts["instructions"] += weight
        for kind, pattern in KINDS.items():
            if re.search(pattern, text):
                counts[kind] += weight
    counts["row_loops"] = len(inner)
    return counts


def resources(kernel, inner_trips: int, workdir: Path, name: str) -> dict:
    """Registers, stack, shared memory and per-chunk instruction counts of a compiled kernel."""
    cubin = workdir / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run(
        [_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    sass = subprocess.run(
        [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    instructions = parse_sass(sass)
    return {
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "shared_bytes": kernel.metadata.shared,
        "static_instructions": len(instructions),
        "per_chunk": per_chunk(instructions, inner_trips),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="2:128,1:64", help="depth:hidden, comma separated")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--rows", default="32", help="the backward's row blocks, comma separated")
    p.add_argument("--warps", default="0", help="warps per program, comma separated (0: the kernels')")
    p.add_argument("--precisions", default="tf32", help="tl.dot precisions, comma separated (tf32, ieee)")
    p.add_argument("--capability", type=int, default=90)
    p.add_argument("--out", default="kernel_resources_sm90")
    args = p.parse_args()

    os.environ["TRITON_INTERPRET"] = "0"  # compiled, not interpreted (before the kernels are imported)
    from titans.ops.memory import triton_chunk

    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    row_blocks = [int(r) for r in args.rows.split(",")]
    block = triton_chunk._block(args.chunk)
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for (depth, hidden), precision, warps in itertools.product(
            cases, args.precisions.split(","), [int(w) for w in args.warps.split(",")]
        ):
            os.environ["TITANS_MEMORY_TRITON_WARPS"] = str(warps)  # read by the launch constants
            for i, rows in enumerate(row_blocks):
                kernels = triton_chunk.compiled_kernels(
                    depth,
                    args.head_dim,
                    hidden,
                    args.chunk,
                    capability=args.capability,
                    precision=precision,
                    qkv_dtype=torch.bfloat16,
                    rows=rows,
                    which=("forward", "backward") if i == 0 else ("backward",),  # rows: the backward's
                )
                for name, kernel in kernels.items():
                    trips = block // min(block, rows) if name == "backward" else 1
                    rows_out.append(
                        {
                            "kernel": name,
                            "depth": depth,
                            "hidden": hidden if depth > 1 else args.head_dim,
                            "precision": precision,
                            "warps": kernel.metadata.num_warps,
                            "rows": rows if name == "backward" else None,
                            "ptxas": triton_chunk.ptxas_options(depth, precision, args.capability) or "-O3",
                            **resources(kernel, trips, Path(tmp), name),
                        }
                    )
    flat = [{**{k: v for k, v in r.items() if k != "per_chunk"}, **r["per_chunk"]} for r in rows_out]
    print_table(
        flat,
        [
            ("kernel", "kernel"),
            ("depth", "depth"),
            ("precision", "prec"),
            ("warps", "warps"),
            ("rows", "rows"),
            ("ptxas", "ptxas"),
            ("registers", "regs"),
            ("stack_bytes", "stack B"),
            ("shared_bytes", "shared B"),
            ("instructions", "instr/chunk"),
            ("spill", "spill"),
            ("barrier", "bar"),
            ("mma", "mma"),
            ("shared", "lds/sts"),
            ("global", "ldg/stg"),
        ],
    )
    import triton  # the compiler's version: the counts are its

    config = {"head_dim": args.head_dim, "chunk": args.chunk, "capability": args.capability, "qkv": "bf16"}
    config["triton"] = triton.__version__
    save_json(args.out, {"config": config, "rows": rows_out}, machine_info())


if __name__ == "__main__":
    main()
