"""What drifts as a trained model's memory reads on past its training length, and what it costs.

Streams held-out windows of a checkpoint's own data through the model in pieces, and per position bucket
(`titans.evaluation.context.position_buckets`) and memory layer reports:

    loss, frozen      next-token loss (nats) of the model and of its frozen twin (writes off) in the bucket
    |W_l|, |S_l|      Frobenius norms of the memory MLP's weights and momentum per layer (head mean) at
                      the bucket's end (printed first: the learned W_0's); dW = ||W - W_0|| / ||W_0||
                      summed over the MLP's layers
    theta eta alpha   the gates' means over the bucket's tokens
    surprise          mean inner-gradient norm ||u_t||
    |read|            mean norm of the raw read M(q; W) per head, before the read's RMS norm
    read cos          mean cosine between the normalised reads of the bucket's tokens (1: every token gets
                      the same read, whatever its query)
    |out| / |x|       the memory branch's output norm relative to the block input's

with the forgetting gate as trained, and with it off (alpha = 0, `--no-forgetting`). JSON to --out.

    python benchmarks/diagnostics/memory_drift.py runs/main --length 16384 --windows 4 --out drift
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
from bench_utils import save_json  # noqa: E402


def _hook_reads(model, records: dict) -> None:
    """Wrap every memory's forward_heads (one call per memory call: per segment in MAC) to record its read
    y (B, H, T, d) and the branch output."""
    for i, block in enumerate(model.blocks):
        mem = getattr(block, "memory", None)
        if mem is None:
            continue
        inner = mem.forward_heads

        def heads(x, state=None, inner=inner, mem=mem, i=i):
            result = inner(x, state)
            y, out = result.output, mem.combine_heads(result.output, x)
            yn = F.normalize(y.float(), dim=-1)
            rec = records.setdefault(i, {"read": [], "cos": [], "ratio": []})
            rec["read"].append(y.float().norm(dim=-1).mean().item())
            # mean pairwise cosine over tokens = ||mean of unit reads||^2 (minus the diagonal's share)
            t = yn.shape[2]
            if t > 1:
                s = yn.sum(2).pow(2).sum(-1)  # (B, H)
                rec["cos"].append(((s - t) / (t * (t - 1))).mean().item())
            rec["ratio"].append((out.float().norm(dim=-1).mean() / x.float().norm(dim=-1).mean()).item())
            return result

        mem.forward_heads = heads


def measure(model, inputs, targets, piece: int, buckets, twin=None) -> list[dict]:
    """Per bucket: the numbers of the module docstring, averaged over the windows (rows of inputs)."""
    from titans.models.monitor import MemoryMonitor, find_memory_state

    records: dict = {}
    _hook_reads(model, records)
    rows = []
    state, twin_state = None, None
    w0 = {
        i: [w[0].detach() for w in model.blocks[i].memory.initial_state(1).weights]
        for i in _memory_blocks(model)
    }
    for lo, hi in buckets:
        losses, twin_losses, monitor = [], [], MemoryMonitor(model)
        records.clear()
        for start in range(lo, hi, piece):
            end = min(hi, start + piece)
            x, y = inputs[:, start:end], targets[:, start:end]
            with torch.no_grad():
                out = model.forward_with_stats(x, state)
                state = out.state
                monitor.update(out.stats)
                losses.append(F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="sum").item())
                if twin is not None:
                    logits, twin_state = twin(x, twin_state)
                    twin_losses.append(
                        F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
                    )
        n = (hi - lo) * inputs.shape[0]
        row = {"bucket": [lo, hi], "loss": sum(losses) / n}
        if twin is not None:
            row["frozen"] = sum(twin_losses) / n
        layers = {}
        reports = {r.layer: r for r in monitor.report(state).layers}
        for i in _memory_blocks(model):
            report = reports[i]
            mem_state = find_memory_state(state.layers[i])
            drift = sum(
                ((w - w0[i][j]).flatten(2).norm(dim=-1) / w0[i][j].flatten(1).norm(dim=-1)).mean().item()
                for j, w in enumerate(mem_state.weights)
            )
            rec = records.get(i, {})
            layers[str(i)] = {
                "weight_norm": [float(np.mean(h)) for h in report.weight_norm],
                "momentum_norm": [float(np.mean(h)) for h in report.momentum_norm],
                "drift": drift,
                "theta": float(np.mean(report.theta)),
                "eta": float(np.mean(report.eta)),
                "alpha": float(np.mean(report.alpha)),
                "surprise": float(np.mean(report.surprise_mean)),
                "read_norm": float(np.mean(rec.get("read", [math.nan]))),
                "read_cos": float(np.mean(rec.get("cos", [math.nan]))),
                "out_ratio": float(np.mean(rec.get("ratio", [math.nan]))),
            }
        row["layers"] = layers
        rows.append(row)
    return rows


def _memory_blocks(model) -> list[int]:
    from titans.models.monitor import memory_layers

    return memory_layers(model)


def table(rows: list[dict]) -> str:
    from titans.evaluation.context import bucket_label

    lines = []
    head = f"{'bucket':>10} {'loss':>6} {'frozen':>6} {'layer':>5} {'|W_l|':>13} {'|S_l|':>13} {'dW':>6} "
    head += f"{'theta':>7} {'eta':>5} {'alpha':>7} {'surpr':>6} {'|read|':>6} {'cos':>5} {'out/x':>6}"
    lines.append(head)
    for r in rows:
        for j, (i, v) in enumerate(r["layers"].items()):
            lead = f"{bucket_label(tuple(r['bucket'])):>10} {r['loss']:6.3f} {r.get('frozen', math.nan):6.3f}"
            lead = lead if j == 0 else " " * len(lead)
            lines.append(
                f"{lead} {i:>5} {'/'.join(f'{w:.2f}' for w in v['weight_norm']):>13} "
                f"{'/'.join(f'{w:.3f}' for w in v['momentum_norm']):>13} {v['drift']:6.2f} {v['theta']:7.4f} "
                f"{v['eta']:5.3f} {v['alpha']:7.5f} {v['surprise']:6.3f} {v['read_norm']:6.2f} "
                f"{v['read_cos']:5.2f} {v['out_ratio']:6.3f}"
            )
    return "\n".join(lines)


def main() -> None:
    from titans.evaluation.context import context_windows, frozen_twin, position_buckets
    from titans.evaluation.perplexity import heldout_stream
    from titans.training.model_io import load_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder or a run folder (its newest good checkpoint)")
    p.add_argument("--length", type=int, default=16384, help="tokens read per window")
    p.add_argument("--windows", type=int, default=4, help="held-out windows")
    p.add_argument("--piece", type=int, default=256, help="tokens per forward call")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default=None, help="JSON output (a path, or a name in benchmarks/results/)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, cfg, tokenizer = load_model(args.checkpoint)
    model.eval()
    heldout = heldout_stream(cfg, tokenizer)
    win = context_windows(heldout, args.length, args.windows, what="the held-out split")
    buckets = position_buckets(args.length)
    result = {"checkpoint": str(args.checkpoint), "length": args.length, "windows": win.count,
              "train_length": cfg.seq_len}  # fmt: skip
    result["w0_norm"] = {  # per head, as the table's |W_l|
        str(i): [
            w.flatten(2).norm(dim=-1).mean().item() for w in model.blocks[i].memory.initial_state(1).weights
        ]
        for i in _memory_blocks(model)
    }
    print(
        "||W_0|| per memory layer:",
        {i: "/".join(f"{v:.2f}" for v in n) for i, n in result["w0_norm"].items()},
    )
    for name, forgetting in (("as trained", True), ("forgetting off", False)):
        model, _, _ = load_model(args.checkpoint)
        model.eval()
        for block in model.blocks:
            if getattr(block, "memory", None) is not None:
                block.memory.forgetting = forgetting
        twin = frozen_twin(model) if forgetting else None
        x, y = torch.as_tensor(win.inputs), torch.as_tensor(win.targets)
        rows = measure(model, x, y, args.piece, buckets, twin)
        result[name] = rows
        print(f"== {name} ({win.count} windows of {args.length} tokens, trained on {cfg.seq_len})")
        print(table(rows), flush=True)
    if args.out:
        print(f"wrote {save_json(args.out, result)}")


if __name__ == "__main__":
    main()
