"""How a compiled MAC's first step (the compile) grows with the segments a window holds, on CPU.

`TitansLM.compile_blocks` (`titans train --compile`) compiles each block whole, MAC's segment loop
unrolled into its graph: a longer window, more segments, more graph. Each run here is a fresh
interpreter (`run_worker`) with inductor's caches off, a `tiny` MAC (segments of 32 tokens, chunks of 16,
one sequence, one thread) and one forward + backward timed twice: the first is the compile plus a step,
the second a step. `--backends triton` runs the memory on its Triton kernels (under Triton's CPU
interpreter here: the custom ops a compiled block calls as they are, as on a GPU); `torch`, the torch
chunk loop (traced into the graph).

    python benchmarks/compile_segments.py [--segments 2,8] [--backends triton,torch] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench_utils import Timer, machine_info, print_table, reply, run_worker, save_json

SEGMENT, CHUNK = 32, 16


def worker(spec: dict) -> dict:
    """One run: the first and second step's seconds."""
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # a compile from scratch, every run
    if spec["backend"] == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    # imported here, after the environment above is set
    import torch
    import torch.nn.functional as F

    from titans import TitansConfig, TitansLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = TitansConfig.preset(
        "tiny", variant="mac", segment_len=SEGMENT, chunk_size=CHUNK, memory_backend=spec["backend"]
    )
    model = TitansLM(cfg)
    model.compile_blocks()
    tokens = torch.randint(0, cfg.vocab_size, (1, spec["segments"] * SEGMENT + 1))
    times = []
    for _ in range(2):
        with Timer() as t:
            logits, _ = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        times.append(t.wall)
    return {**spec, "first_s": times[0], "second_s": times[1], "compile_s": times[0] - times[1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segments", default="2,8", help="segments per window, comma separated")
    p.add_argument("--backends", default="triton", help="triton, torch (comma separated)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    p.add_argument("--out", default="compile_segments")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        reply(worker(json.loads(args.worker)))
        return
    rows = []
    for backend in args.backends.split(","):
        for segments in (int(s) for s in args.segments.split(",")):
            spec = {"backend": backend, "segments": segments}
            rows.append({**spec, **run_worker(sys.argv[0], spec, timeout=args.timeout)})
            print(json.dumps(rows[-1]), flush=True)
    print_table(
        rows,
        [
            ("backend", "memory"),
            ("segments", "segments"),
            ("first_s", "first step s"),
            ("second_s", "second step s"),
            ("compile_s", "first - second s"),
        ],
    )
    config = {"preset": "tiny", "variant": "mac", "segment_len": SEGMENT, "chunk_size": CHUNK, "batch": 1}
    save_json(args.out, {"config": config, "rows": rows}, machine_info())


if __name__ == "__main__":
    main()
