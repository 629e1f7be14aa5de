"""Bits per byte and per token of a checkpoint by position in one long held-out document, read through
the state.

    python benchmarks/lm_eval_tasks/loss_by_position.py RUN_DIR [--doc 1] [--tokens 16384] [--out FILE]

Reads document ``--doc`` of ``data/prose_heldout.jsonl`` (``make_data.py``) after the separator, in pieces
of 2,048 tokens through the model's state (what the lm-eval adapter's rolling loglikelihood does), and
reports the mean loss over position ranges: whether the model keeps its loss past its training length.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from titans.data.stream import separator_ids
from titans.training.model_io import load_model

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "prose_heldout.jsonl"


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--doc", type=int, default=1, help="index of the held-out document")
    p.add_argument("--tokens", type=int, default=16384, help="tokens to read")
    p.add_argument("--out", default=None, help="JSON output")
    args = p.parse_args()
    if not DATA.is_file():
        sys.exit(f"error: {DATA} not found: run python benchmarks/lm_eval_tasks/make_data.py first")
    if args.tokens < 1:
        sys.exit(f"error: --tokens must be >= 1, got {args.tokens}")
    docs = [json.loads(line)["text"] for line in DATA.open()]
    if not 0 <= args.doc < len(docs):  # -1 read the last document silently
        sys.exit(
            f"error: --doc must be in [0, {len(docs) - 1}] ({DATA.name} holds {len(docs)}), got {args.doc}"
        )
    torch.set_num_threads(1)
    try:
        model, _, tok = load_model(args.checkpoint)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    ids = torch.tensor([(separator_ids(tok) + tok.encode(docs[args.doc]))[: args.tokens + 1]])
    state, losses = None, []
    for start in range(0, ids.shape[1] - 1, 2048):
        inputs = ids[:, start : min(start + 2048, ids.shape[1] - 1)]
        logits, state = model(inputs, state)
        target = ids[:, start + 1 : start + 1 + inputs.shape[1]]
        losses.append(F.cross_entropy(logits[0].double(), target[0], reduction="none"))
    nll = torch.cat(losses)
    edges = [e for e in (0, 256, 1024, 4096, 16384, 65536) if e < len(nll)] + [len(nll)]
    targets = ids[0, 1:].tolist()
    # UTF-8 bytes of the targets before each edge: a subword token holds several bytes (the bits per token
    # of a BPE model are not its bits per byte); exact for the byte tokenizer
    before = {e: len(tok.decode(targets[:e]).encode("utf-8")) for e in edges}
    rows = []
    for a, b in zip(edges, edges[1:]):
        bits = nll[a:b].sum().item() / math.log(2)
        rows.append(
            {"from": a, "to": b, "bpb": bits / (before[b] - before[a]), "bits_per_token": bits / (b - a)}
        )
    for r in rows:
        print(
            f"tokens {r['from']:>6}-{r['to']:<6} {r['bpb']:.3f} bits per byte, "
            f"{r['bits_per_token']:.3f} bits per token"
        )
    if args.out:
        payload = {
            "checkpoint": args.checkpoint,
            "tokenizer": getattr(tok, "name", type(tok).__name__),
            "doc": args.doc,
            "tokens": len(nll),
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
