"""Where does a needle model's answer come from? Answer loss with the memory's writes on and off.

Loads a model trained on an S-NIAH needle (`titans eval niah --train-recipe ... --save-model DIR`; the pass
key unless `--kind` says otherwise) and scores the answer tokens of fresh training-stream samples at one
length, by needle depth: as trained, and with
`memory_write=False` (theta = 0; with `memory_forgetting=false`, as in the pass-key recipe, the memory then
stays at its learned initial weights). If the two match, the answer does not come through the memory.
Depth 1.0 puts the needle next to the question, inside the attention's reach for MAC; smaller depths put
it segments away.

    python benchmarks/diagnostics/passkey_memory_probe.py RUN_DIR [--length 320] [--samples 32]
        [--per-position] [--kind passkey|number|uuid] [--haystack noise|essays|moby_dick|sotu]

With `--per-position`, also each answer position's loss and greedy accuracy (memory on, all depths pooled)
and the fraction of answers right in every position: a model can carry the key half-way, every digit
often right and the whole key seldom.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from titans import TitansLM
from titans.evaluation.haystack import HAYSTACK_NAMES
from titans.evaluation.niah import NEEDLE_KINDS, niah_training_example
from titans.evaluation.task_training import collate, masked_loss
from titans.training.model_io import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--length", type=int, default=320)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--depths", default="0,0.5,0.9,1")
    p.add_argument("--per-position", action="store_true")
    p.add_argument("--kind", default="passkey", choices=tuple(NEEDLE_KINDS), help="the needle trained on")
    p.add_argument("--haystack", default=None, choices=HAYSTACK_NAMES, help="default: the kind's own")
    args = p.parse_args()
    model, _, tokenizer = load_model(args.checkpoint)
    frozen = TitansLM(dataclasses.replace(model.config, memory_write=False)).eval()
    frozen.load_state_dict(model.state_dict())
    print(
        f"{model.config.variant}: {args.kind} answer loss at length {args.length}, "
        f"{args.samples} samples per depth"
    )
    print(f"{'depth':>6}{'memory on':>11}{'writes off':>12}")
    losses, hits = [], []  # per answer, per position (memory on)
    for depth in (float(d) for d in args.depths.split(",")):
        examples = [
            niah_training_example(
                tokenizer,
                length=args.length,
                kind=args.kind,
                haystack=args.haystack,
                seed=10_000 + i,
                depth=depth,
            )
            for i in range(args.samples)
        ]
        inputs, targets, mask = collate(examples)
        with torch.no_grad():
            on = masked_loss(model, inputs, targets, mask)[1].item()
            off = masked_loss(frozen, inputs, targets, mask)[1].item()
        print(f"{depth:>6.2f}{on:>11.3f}{off:>12.3f}")
        if args.per_position:
            with torch.no_grad():
                logits, _ = model(inputs)
            token_loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            right = logits.argmax(-1) == targets
            for b in range(len(examples)):
                where = mask[b].nonzero().flatten()
                losses.append(token_loss[b, where].tolist())
                hits.append(right[b, where].tolist())
    if args.per_position:
        n = min(len(h) for h in hits)
        print(f"per answer position (memory on, {len(hits)} answers): position, loss, accuracy")
        for j in range(n):
            loss = sum(x[j] for x in losses) / len(losses)
            acc = sum(h[j] for h in hits) / len(hits)
            print(f"{j:>6}{loss:>11.3f}{acc:>12.2f}")
        print(f"whole answer right: {sum(all(h) for h in hits) / len(hits):.2f}")


if __name__ == "__main__":
    main()
