"""What a training step keeps for its backward pass, per token, by module: the activation memory that sets
how long a sequence and how large a batch fit on a GPU, measured on a CPU.

One forward of a preset's model over one sequence under bf16 autocast, with
`torch.autograd.graph.saved_tensors_hooks` counting every tensor autograd saves (each storage once, in
the module that saved it first). The paths are set as they run on a GPU, not as they run on a CPU: the
attention through the fused kernel that keeps the log-sum-exp rather than the probabilities
(`SDPBackend.FLASH_ATTENTION`, which on CPU takes masks as CUDA's efficient kernel does), `F.rms_norm`
keeping what CUDA's fused kernel keeps (`fused_rms_norm`: on CPU it is a composition that keeps three float32
copies of its input), the other norms and the convolution as torch ops (no fused CPU backward), and the
memory on its Triton kernels, run by Triton's
interpreter (`TRITON_INTERPRET=1`, set here): the op saves what it saves on a GPU. The weights' bf16
copies that autocast keeps (and any parameter autograd saves as it is) do not grow with the sequence: each
saved storage that is a parameter, or a cast or view of one (its autograd graph leads back to the parameter
through casts and views only), is counted apart, as "weight copies", once per step.

    python benchmarks/activation_memory.py [--preset 170M] [--variants mac,transformer] [--seq 2048]
        [--memory-checkpoint-every 0,4] [--batch 4] [--json FILE]

Prints, per model, MB saved per token (the weight copies left out) and the GiB that `--batch` sequences of
`--seq` tokens keep (the activations times the batch, plus the weight copies once), the weight copies' MB, the
same with `gradient_checkpointing` (the most kept at once: every block's input, the saves outside the
blocks and the largest block's while it is recomputed, from the same forward), then the largest parts by
module. Weights, gradients and optimizer state come on top (16 bytes a parameter with
AdamW in float32). About 2 minutes for a 170M MAC at 2,048 tokens on one core (the interpreter).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton's kernels are first imported
os.environ["TITANS_CPU_KERNELS"] = "0"  # the convolution as torch ops, as on a GPU

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench_utils import machine_info, print_table, save_json  # noqa: E402
from titans import TitansConfig, TitansLM  # noqa: E402
from titans.ops import norms  # noqa: E402

_RMS_NORM = F.rms_norm  # torch's own, which `measure` replaces with `fused_rms_norm` while it counts


def fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    """F.rms_norm keeping what CUDA's fused kernel keeps for its backward pass: the input, the weight and
    the float32 rstd per row (`titans.ops.norms._RMSNorm` saves just these). On CPU F.rms_norm is a
    composition whose autograd keeps three float32 tensors of the input's size."""
    if not torch.is_grad_enabled() or len(normalized_shape) != 1:
        return _RMS_NORM(x, normalized_shape, weight, eps)
    return norms._RMSNorm.apply(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)


# autograd nodes that cast or view their one input: a saved tensor reached from a parameter through these
# alone is a copy of the weight (autocast's bf16 cast, a transpose of it), the same size at any length
_CAST_OR_VIEW = {
    "ToCopyBackward0",
    "TBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "UnsqueezeBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackwardAutogradNestedTensor0",
    "SliceBackward0",
    "SelectBackward0",
    "CloneBackward0",
    "AliasBackward0",
}


def is_weight_copy(t: torch.Tensor, params: set[int]) -> bool:
    """True when `t` is a parameter, or reached from one through casts and views only."""
    if id(t) in params:
        return True
    fn = t.grad_fn
    while fn is not None:
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return id(fn.variable) in params
        if name not in _CAST_OR_VIEW:
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def measure(preset: str, variant: str, seq: int, every: int) -> dict:
    """Bytes autograd saves over one sequence of `seq` tokens: in total, by module class and by block; and
    with `gradient_checkpointing` (the blocks recomputed in the backward pass), the most kept at once:
    every block's input, what is saved outside the blocks, and the largest block's own saves while it is
    recomputed."""
    torch.manual_seed(0)
    cfg = TitansConfig.preset(preset, variant=variant)
    if cfg.variant not in ("transformer", "swa"):
        cfg.memory_backend = "triton"
        cfg.memory_checkpoint_every = every or None
    model = TitansLM(cfg)
    stack: list[torch.nn.Module] = []
    hooks = []
    blocks = {id(b): i for i, b in enumerate(model.blocks)}
    block_inputs = []

    def enter(module, args) -> None:
        stack.append(module)
        if id(module) in blocks:
            block_inputs.append(args[0].numel() * args[0].element_size())

    def leave(module, args, out) -> None:  # returns None: the output stays as it is
        stack.pop()

    for module in model.modules():
        hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    seen: set[int] = set()
    by_module: collections.Counter = collections.Counter()
    by_block: collections.Counter = collections.Counter()
    copies_by_block: collections.Counter = collections.Counter()  # the weight copies among by_block's bytes
    params = {id(p) for p in model.parameters()}

    modules = {id(m) for m in model.modules()}

    def running_module() -> torch.nn.Module | None:
        """The innermost module of the model whose code is running: a method a block calls directly
        (MAC's segment loop calls its attention's and memory's) is found as a forward is."""
        frame = sys._getframe(2)
        while frame is not None and id(frame.f_locals.get("self")) not in modules:
            frame = frame.f_back
        return None if frame is None else frame.f_locals["self"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            module = running_module()
            by_module["(outside modules)" if module is None else type(module).__name__] += storage.nbytes()
            block = next((blocks[id(m)] for m in stack if id(m) in blocks), "outside")
            by_block[block] += storage.nbytes()
            if is_weight_copy(t, params):
                copies_by_block[block] += storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    records_grad, sdpa = norms._records_grad, F.scaled_dot_product_attention
    norms._records_grad = lambda *t: False  # F.rms_norm / F.normalize's own autograd, as off CPU

    def fused_sdpa(q, k, v, attn_mask=None, **kw):
        """SDPA, a (G, Lq, Lk) mask as (1, G, Lq, Lk): the same broadcast, as the CPU kernel takes it."""
        return sdpa(
            q,
            k,
            v,
            attn_mask=attn_mask[None] if attn_mask is not None and attn_mask.dim() == 3 else attn_mask,
            **kw,
        )

    F.scaled_dot_product_attention, F.rms_norm = fused_sdpa, fused_rms_norm
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            logits, _ = model(tokens)
    finally:
        norms._records_grad, F.scaled_dot_product_attention, F.rms_norm = records_grad, sdpa, _RMS_NORM
        for h in hooks:
            h.remove()
    total = sum(by_module.values())
    n_params = sum(p.numel() for p in model.parameters())
    largest = max((k for k in by_block if k != "outside"), key=lambda k: by_block[k])
    return {
        "variant": variant,
        "seq": seq,
        "memory_checkpoint_every": every or None,
        "params": n_params,
        "saved_bytes": total,
        "weight_copy_bytes": sum(copies_by_block.values()),
        "recomputed_peak_bytes": sum(block_inputs) + by_block["outside"] + by_block[largest],
        "recomputed_weight_copy_bytes": copies_by_block["outside"] + copies_by_block[largest],
        "by_module": dict(by_module.most_common()),
        "by_block": {str(k): v for k, v in by_block.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="170M")
    p.add_argument("--variants", default="mac,transformer")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--memory-checkpoint-every", default="0", help="comma separated; 0: every state kept")
    p.add_argument("--batch", type=int, default=4, help="sequences per step, for the GiB column")
    p.add_argument(
        "--json", default=None, help="write the rows here (a path, or a name in benchmarks/results/)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for variant in args.variants.split(","):
        memory = variant not in ("transformer", "swa")
        for every in map(int, args.memory_checkpoint_every.split(",")) if memory else [0]:
            row = measure(args.preset, variant, args.seq, every)
            gc.collect()  # the model and its graph, before the next is built
            # the weight copies once a step, the rest per sequence of the batch
            copies, saved = row["weight_copy_bytes"], row["saved_bytes"]
            row["mb_per_token"] = round((saved - copies) / args.seq / 1e6, 3)
            row["weight_copy_mb"] = round(copies / 1e6, 1)
            row["gib"] = round(((saved - copies) * args.batch + copies) / 2**30, 2)
            copies, peak = row["recomputed_weight_copy_bytes"], row["recomputed_peak_bytes"]
            row["recomputed_mb_per_token"] = round((peak - copies) / args.seq / 1e6, 3)
            row["recomputed_gib"] = round(((peak - copies) * args.batch + copies) / 2**30, 2)
            rows.append(row)
    print(f"Saved for backward, {args.preset}, one sequence of {args.seq} tokens, bf16 autocast, GPU paths")
    print_table(
        rows,
        [
            ("variant", "variant"),
            ("memory_checkpoint_every", "ckpt"),
            ("params", "params"),
            ("mb_per_token", "MB / token"),
            ("weight_copy_mb", "weight copies MB"),
            ("gib", f"GiB at {args.batch} x {args.seq}"),
            ("recomputed_mb_per_token", "recomputed: MB / token"),
            ("recomputed_gib", "GiB"),
        ],
    )
    for row in rows:
        parts = ", ".join(f"{k} {v / 1e6:,.0f}" for k, v in list(row["by_module"].items())[:6])
        print(f"{row['variant']} (ckpt {row['memory_checkpoint_every'] or '-'}), MB by module: {parts}")
    if args.json:
        print(f"wrote {save_json(args.json, {'args': vars(args), 'rows': rows}, machine_info())}")


if __name__ == "__main__":
    main()
