"""MAC's segment loop as built against the paper's segment-by-segment reading: training step time and
operations per step, the same model and weights side by side.

`MACBlock.mix` computes what depends on the block input x alone (the attention's queries, keys, values and
output gate of x's tokens, the persistent keys, the retrieval queries and the memory tokens' gate) once for
all segments of a call, cuts it into segments with split(), and after the loop applies the memory's output
(norm, gate, projection) and the combine to all tokens at once; only what reads or writes the memory runs
per segment. `mix_per_segment` below is the loop read off the paper: each segment sliced from x,
retrieving, attending, writing and combining on its own. Both give the same logits (checked here, and to
the bit in float64 by `tests/test_benchmarks.py`).

Per sequence length (`--preset`, batch 1, one thread): the median forward + backward time of `--steps`
steps of each form, alternating step by step (the machine's load falls on both alike); and, once per
form, the operations one step runs (leaf ATen operators that compute, at the dispatcher, metadata-only
ones left out as `decode_ops.py` does: on a GPU each is at least one kernel launch). `--count-preset 170M`
adds operation counts for that preset's structure (its depth, segments and chunks at `--count-seq` tokens)
at a narrow width, where a step runs on a CPU in seconds: the count depends on the structure, not the width.

    python benchmarks/mac_segment_loop.py [--preset tiny] [--seqs 1024,4096,16384] [--steps 5]
        [--count-preset 170M] [--count-seq 2048] [--out mac_segment_loop_cpu]
"""

from __future__ import annotations

import argparse
import statistics
import types

import torch

from bench_utils import machine_info, print_table, save_json, time_alternating
from decode_ops import OpCounter
from titans import TitansConfig, TitansLM
from titans.models.blocks import MACState


def mix_per_segment(block, x, state, stats):
    """`MACBlock.mix` segment by segment: x (B, T, dim) sliced into pieces that end at segment boundaries,
    each piece retrieving, attending, writing and combining on its own."""
    if state is None:
        mem_state = block.memory.initial_state(x.shape[0], x.device, x.dtype)
        state = MACState(mem_state, mem_state.weights, None)
    mem_state, seg_w, attn_state = state.memory, state.segment_weights, state.attention
    outs, start, c = [], 0, block.segment_len
    while start < x.shape[1]:
        end = min(x.shape[1], start + c - mem_state.position % c)
        xs = x[:, start:end]
        y, attn_state = block.attn(xs, block.retrieve(xs, seg_w), attn_state)
        u = xs + y if block.memory_residual else y
        u = u if block.norm_memory_input is None else block.norm_memory_input(u)
        out = block.memory.forward_with_stats(u, mem_state)
        if stats is not None:
            stats.append(out.stats)
        m, mem_state = out.output, out.state
        outs.append(block.combine(y, m))
        if mem_state.position % c == 0:  # segment complete
            seg_w = mem_state.weights
        start = end
    return torch.cat(outs, 1), MACState(mem_state, seg_w, attn_state)


def _step(model, tokens):
    logits, _ = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
    return logits.detach()


def _ops(model, tokens) -> int:
    with OpCounter() as counter:
        _step(model, tokens)
    return counter.ops


def _models(cfg):
    """The block as built and its per-segment twin, with the same weights."""
    torch.manual_seed(0)
    built = TitansLM(cfg)
    twin = TitansLM(cfg)
    twin.load_state_dict(built.state_dict())
    for block in twin.blocks:
        block.mix = types.MethodType(mix_per_segment, block)
    return built, twin


def measure(cfg, seq: int, steps: int) -> dict:
    built, twin = _models(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    diff = (_step(built, tokens) - _step(twin, tokens)).abs().max().item()  # also the warm-up step
    steps_of = {"built": lambda: _step(built, tokens), "per_segment": lambda: _step(twin, tokens)}
    times = time_alternating(steps_of, steps)
    built_s, twin_s = statistics.median(times["built"]), statistics.median(times["per_segment"])
    return {
        "seq": seq,
        "per_segment_step_s": twin_s,
        "built_step_s": built_s,
        "speedup": twin_s / built_s,
        "per_segment_tokens_per_s": seq / twin_s,
        "built_tokens_per_s": seq / built_s,
        "per_segment_ops": _ops(twin, tokens),
        "built_ops": _ops(built, tokens),
        "logits_max_abs_diff": diff,
        "times": times,
    }


def structure_counts(cfg, seq: int) -> dict:
    built, twin = _models(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    _step(built, tokens), _step(twin, tokens)
    return {"seq": seq, "per_segment_ops": _ops(twin, tokens), "built_ops": _ops(built, tokens)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seqs", default="1024,4096,16384")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--count-preset", default="170M", help="a preset whose structure's operations to count")
    p.add_argument("--count-seq", type=int, default=2048)
    p.add_argument("--count-dim", type=int, default=96, help="the narrow width the count runs at")
    p.add_argument("--out", default="mac_segment_loop_cpu", help="a path, or a name in benchmarks/results/")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info()
    cfg = TitansConfig.preset(args.preset, variant="mac", vocab_size=256)
    print(
        f"MAC, preset {args.preset}, batch 1, fwd+bwd, {args.threads} thread(s), median of {args.steps} "
        f"alternating steps; {machine['cpu']}"
    )
    rows = [measure(cfg, int(s), args.steps) for s in args.seqs.split(",")]
    columns = [
        ("seq", "seq"),
        ("per_segment_step_s", "per-segment s"),
        ("built_step_s", "built s"),
        ("speedup", "speed-up"),
        ("per_segment_ops", "per-segment ops"),
        ("built_ops", "built ops"),
        ("logits_max_abs_diff", "logits max diff"),
    ]
    print_table(rows, columns)
    counts = None
    if args.count_preset:
        count_cfg = TitansConfig.preset(args.count_preset, variant="mac", vocab_size=256, dim=args.count_dim)
        counts = {"preset": args.count_preset, "dim": args.count_dim}
        counts |= structure_counts(count_cfg, args.count_seq)
        print(
            f"\n{args.count_preset}'s structure (depth {count_cfg.depth}, segments of "
            f"{count_cfg.segment_len}, chunks of {count_cfg.chunk_size}) at {args.count_seq} tokens, width "
            f"{args.count_dim}: operations per training step, per segment {counts['per_segment_ops']:,}, "
            f"built {counts['built_ops']:,}"
        )
    payload = {"args": vars(args), "results": rows, "structure_counts": counts}
    print(f"wrote {save_json(args.out, payload, machine)}")


if __name__ == "__main__":
    main()
