"""How many operations the memory op's Triton path launches per call: its Triton kernel launches and the
torch operators around them (everything a GPU would run as a kernel of its own), forward alone (inference,
prefill, a decode step that writes a chunk) and forward + backward (training).

The kernels run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set here), so this needs no GPU: the
count is the same on a device, only the time differs. The torch operators are counted at the dispatcher
(`TorchDispatchMode`), leaf ATen operators that compute (views, reshapes, empty allocations excluded, as in
`decode_ops.py`); the interpreter's own work inside a launch is not counted. Each case is one
`neural_memory_triton` call over `--chunks` complete chunks plus a partial one, the gates passed as the
views of one (B, H, T, 3) tensor (as `neural_memory` passes them); in the training case q, k, v, the gates,
weights and momentum all require gradients, and the backward starts from given gradients of every output
(made outside the count). `--checkpoint-every 0,4` adds training rows with the memory's state kept every 4
chunks (`checkpoint_every`), and `--torch-backward` rows with the backward on the torch chunk step (the path
a backward kernel too big for the device's shared memory falls back to) beside the kernels'.

    python benchmarks/memory_kernel_ops.py [--depths 1,2] [--chunks 1,8] [--checkpoint-every 0]
        [--torch-backward] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's kernels are first imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from bench_utils import print_table, save_json  # noqa: E402
from decode_ops import NO_KERNEL  # noqa: E402


class _Counter(TorchDispatchMode):
    """Counts the computing ATen operators dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("titans::"):  # the op's custom ops: their Python bodies run with the count on
            from titans.ops.memory import triton_chunk

            body = getattr(triton_chunk, name.split("::")[1])._init_fn  # the function the op wraps
            with self:
                return body(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if name in ("aten::to", "aten::contiguous"):  # a kernel only where they copy
            if out is not args[0]:
                self.ops[name] += 1
        elif name not in NO_KERNEL and name != "aten::new_empty":
            self.ops[name] += 1
        return out


class _CountedKernel:
    """A Triton kernel whose launches are counted and run outside the dispatch counter."""

    def __init__(self, kernel, launches: collections.Counter, name: str):
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


def _problem(depth: int, seq: int, args: argparse.Namespace, grad: bool):
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, seq)
    q, k, v = (torch.randn(*shape, args.head_dim, generator=g) for _ in range(3))
    gates = torch.stack(
        [
            0.1 * torch.rand(shape, generator=g),
            -torch.rand(shape, generator=g),
            -torch.rand(shape, generator=g),
        ],
        -1,
    )
    sizes = [args.head_dim] + [2 * args.head_dim] * (depth - 1) + [args.head_dim]
    w = [torch.randn(*shape[:2], sizes[i], sizes[i + 1], generator=g) / sizes[i] ** 0.5 for i in range(depth)]
    s = [torch.zeros_like(x) for x in w]
    leaves = [x.requires_grad_(grad) for x in (q, k, v, gates, *w, *s)]
    return leaves


def measure(
    depth: int,
    chunks: int,
    grad: bool,
    args: argparse.Namespace,
    every: int = 0,
    torch_backward: bool = False,
) -> dict:
    from titans.ops.memory import triton_chunk

    seq = chunks * args.chunk + args.chunk // 2  # a trailing partial chunk too
    leaves = _problem(depth, seq, args, grad)
    q, k, v, gates, *rest = leaves
    w, s = tuple(rest[:depth]), tuple(rest[depth:])
    launches: collections.Counter = collections.Counter()
    real = triton_chunk._kernels()
    stub = type("Kernels", (), {})()
    for name in ("memory_chunks_fwd", "memory_chunks_bwd"):
        setattr(stub, name, _CountedKernel(getattr(real, name), launches, name))
    stub.OutOfResources = real.OutOfResources
    kernels, triton_chunk._kernels = triton_chunk._kernels, lambda: stub
    fused, triton_chunk.FUSED_BACKWARD = triton_chunk.FUSED_BACKWARD, not torch_backward
    try:
        with torch.set_grad_enabled(grad), _Counter() as counter:
            gate_views = (gates[..., 0], gates[..., 1], gates[..., 2])
            y, w_out, s_out, norm = triton_chunk.neural_memory_triton(
                q,
                k,
                v,
                *gate_views,
                w,
                s,
                chunk_size=args.chunk,
                surprise_clip=1.0,
                checkpoint_every=every or None,
            )
            if grad:
                outs = [y, norm, *w_out, *s_out]
                with _disable_current_modes():
                    grads_out = [torch.randn_like(x) for x in outs]
                torch.autograd.grad(outs, leaves, grads_out)
    finally:
        triton_chunk._kernels = kernels
        triton_chunk.FUSED_BACKWARD = fused
    return {
        "depth": depth,
        "chunks": chunks,
        "T": seq,
        "pass": "forward + backward" if grad else "forward",
        "checkpoint_every": every or None,
        "backward": ("torch chunk step" if torch_backward else "kernels") if grad else None,
        "kernel_launches": sum(launches.values()),
        "torch_ops": sum(counter.ops.values()),
        "total": sum(launches.values()) + sum(counter.ops.values()),
        "ops": dict(sorted(counter.ops.items())),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="1,2")
    p.add_argument("--chunks", default="1,8", help="complete chunks per call (a partial one is added)")
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--checkpoint-every", default="0", help="training rows for each (0: every state kept)")
    p.add_argument("--torch-backward", action="store_true", help="training rows with the torch backward too")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument(
        "--json", default=None, help="write the rows here (a path, or a name in benchmarks/results/)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for depth in map(int, args.depths.split(",")):
        for chunks in map(int, args.chunks.split(",")):
            rows.append(measure(depth, chunks, False, args))
            for every in map(int, args.checkpoint_every.split(",")):
                for torch_backward in (False, True) if args.torch_backward else (False,):
                    rows.append(measure(depth, chunks, True, args, every, torch_backward))
    print("Triton path of the memory op, per call: kernel launches and computing torch operators")
    columns = [("depth", "depth"), ("chunks", "chunks"), ("pass", "pass"), ("checkpoint_every", "ckpt")]
    columns += [("backward", "backward"), ("kernel_launches", "launches")]
    print_table(rows, columns + [("torch_ops", "torch ops"), ("total", "total")])
    if args.json:
        print(f"wrote {save_json(args.json, {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
