"""Does a model depend on where a stretch of text sits in the stream, beyond what it has read?

Scores the same held-out tokens twice: inside one window from its start (the tokens at positions
SHIFT..LENGTH) and as a window of their own (positions 0..LENGTH-SHIFT). For a model whose output depends
only on the last tokens it has read (an SWA, or a memory model's frozen twin with sliding-window
attention), the two agree once the window has filled; a gap that does not close means the model reads
its absolute position, as attention does when RoPE-rotated queries score unrotated persistent keys
(`TitansConfig.persistent_rope`, docs/long_context.md). Memory models are scored as their frozen twin
(writes off), so the memory's own learning cannot explain the gap.

    python benchmarks/diagnostics/position_shift.py runs/exp/mag_init [--length 8192] [--shift 4096]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    from titans.evaluation.context import frozen_twin, per_token_losses, source_documents
    from titans.runtime.loading import checkpoint_of, load_trained

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder or a run folder (its newest checkpoint)")
    p.add_argument("--length", type=int, default=8192, help="tokens of the long window")
    p.add_argument("--shift", type=int, default=4096, help="where the second scoring starts")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if not 0 < args.shift < args.length:
        p.error(f"--shift must be in (0, --length), got {args.shift}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_trained(args.checkpoint)
    train = checkpoint_of(args.checkpoint).config["train"]
    scored = frozen_twin(model) or model
    docs = source_documents(train["data"], tokenizer, heldout_fraction=train["heldout_fraction"])
    ids = np.concatenate([d for _, d in docs])
    if len(ids) < args.length + 1:
        p.error(f"the held-out split has {len(ids)} tokens, fewer than --length + 1")
    x = torch.from_numpy(ids[: args.length].astype(np.int64))[None]
    y = torch.from_numpy(ids[1 : args.length + 1].astype(np.int64))[None]
    whole = per_token_losses(scored, x, y, batch_size=1)[0]
    alone = per_token_losses(scored, x[:, args.shift :], y[:, args.shift :], batch_size=1)[0]
    what = "frozen twin" if scored is not model else "model"
    cfg = model.config
    print(f"{args.checkpoint} ({cfg.variant}, {what}, persistent_rope={cfg.persistent_rope})")
    print(f"{'tokens':>13s}  {'from position 0':>16s}  {'as their own window':>20s}  {'gap':>7s}")
    scored = args.length - args.shift  # positions scored as their own window: edges inside it only
    edges = [0] + [e for e in (256, 1024, 2048, 4096, 8192, 16384) if e < scored] + [scored]
    for a, b in zip(edges, edges[1:]):
        w, s = whole[args.shift + a : args.shift + b].mean(), alone[a:b].mean()
        print(f"{args.shift + a:>6d}-{args.shift + b:<6d}  {w:16.3f}  {s:20.3f}  {w - s:+7.3f}")


if __name__ == "__main__":
    main()
