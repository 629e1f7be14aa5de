"""Does the needle reach the memory? MAC against the LMM on S-NIAH pass-key prompts, at initialisation.

Pairs of prompts that differ only in the pass key's digits (same haystack, same depth): whatever depends on
the key differs between the two, everything else is equal. Per memory layer, with the pass-key recipe's
model (tiny preset, conv 8, no forgetting, theta 0.002; ``--set`` adds fields):

- ``write_input_change``: at the key's digit positions, ||u_A - u_B|| / ||u_A|| of the input u the memory
  writes (the LMM: the normed block input; MAC: its attention output y, normalised, or x + y with
  ``mac_memory_residual``): how much of the digit the write carries. Different digits in the block input
  give about 1.4 (nearly orthogonal embeddings).
- ``question_read_change``: the same ratio for what the answer's first two positions (whose input tokens
  are equal in A and B) read from the memory (the LMM: the memory's output; MAC: the retrieved tokens h):
  does the read carry the key at all.
- ``memory_grad_norm``: the gradient norm of the answer loss over the memory's parameters (the answer's
  gradient that reaches the memory), and ``other_grad_norm`` over the rest of the model.

    python benchmarks/diagnostics/mac_passkey_diagnosis.py --variants lmm,mac --set mac_memory_residual=true
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from titans import TitansConfig, TitansLM
from titans.data.tokenizers import load_tokenizer
from titans.evaluation.niah import make_niah_sample
from titans.evaluation.task_training import collate, masked_loss
from titans.models.blocks import MACBlock
from titans.training.config import parse_set

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
from bench_utils import save_json  # noqa: E402

RECIPE = dict(memory_conv_kernel=8, memory_max_lr=0.03, memory_theta_init=0.002, memory_forgetting=False)


def pair(tokenizer, length: int, depth: float, seed: int):
    """Two samples with the same haystack and depth and different pass keys (different seeds give different
    keys; the noise haystack always starts at its first sentence, so equal lengths give equal haystacks)."""
    a = make_niah_sample(tokenizer, length=length, depth=depth, seed=seed, split="train")
    for other in range(seed + 1, seed + 1000):
        b = make_niah_sample(tokenizer, length=length, depth=depth, seed=other, split="train")
        if b.needle_token_span == a.needle_token_span and all(x != y for x, y in zip(a.answer, b.answer)):
            return a, b
    raise RuntimeError("no pair with the same needle span")


def measure(variant: str, overrides: dict, length: int, depth: float, pairs: int, seed: int) -> dict:
    tokenizer = load_tokenizer("bytes")
    torch.manual_seed(seed)
    cfg = TitansConfig.preset("tiny", variant=variant, vocab_size=tokenizer.vocab_size, **RECIPE, **overrides)
    model = TitansLM(cfg)
    captured: dict[str, list] = {}

    # per memory call, its input u and its output: `forward_heads` is what every variant calls (MAC's
    # segment loop calls it directly, not through the module's forward)
    originals = []
    for i, block in enumerate(model.blocks):
        mem = getattr(block, "memory", None)
        if isinstance(mem, torch.nn.Module):

            def heads(x, state=None, _mem=mem, _orig=mem.forward_heads, _name=f"mem{i}"):
                out = _orig(x, state)
                with torch.no_grad():
                    captured.setdefault(_name, []).append(((x,), (_mem.combine_heads(out.output, x),)))
                return out

            originals.append((mem, mem.forward_heads))
            mem.forward_heads = heads
    samples = [pair(tokenizer, length, depth, seed * 1000 + 17 * k) for k in range(pairs)]
    a_list = [s[0] for s in samples]
    b_list = [s[1] for s in samples]

    # MAC's retrieved tokens: wrap memory_tokens (the read of each segment) to record h per call
    retrieved: dict[int, list] = {}
    for i, block in enumerate(model.blocks):
        if isinstance(block, MACBlock):

            def wrapped(q, gate, w, _orig=block.memory_tokens, _i=i):
                h = _orig(q, gate, w)
                retrieved.setdefault(_i, []).append(h)
                return h

            block.memory_tokens = wrapped

    def run(batch):
        captured.clear()
        retrieved.clear()
        inputs, targets, mask = collate([s.training_example() for s in batch])
        model.zero_grad()
        _, answer = masked_loss(model, inputs, targets, mask)
        return inputs, mask, answer

    out = {"variant": variant, "overrides": overrides, "length": length, "depth": depth, "layers": {}}
    inputs, mask, answer_a = run(a_list)
    cap_a = {k: [(i[0].detach(), o[0].detach()) for i, o in v] for k, v in captured.items()}
    ret_a = {k: torch.cat([h.detach() for h in v], 1) for k, v in retrieved.items()}
    answer_a.backward()
    mem_sq = other_sq = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".memory." in name:
            mem_sq += float(p.grad.pow(2).sum())
        else:
            other_sq += float(p.grad.pow(2).sum())
    out["answer_loss"] = float(answer_a.detach())
    out["memory_grad_norm"] = mem_sq**0.5
    out["other_grad_norm"] = other_sq**0.5
    with torch.no_grad():
        run(b_list)
    cap_b = {k: [(i[0].detach(), o[0].detach()) for i, o in v] for k, v in captured.items()}
    ret_b = {k: torch.cat([h.detach() for h in v], 1) for k, v in retrieved.items()}
    # digit positions of the needle's first mention, and the answer positions (inputs predicting digits)
    s0 = a_list[0]
    start = s0.needle_token_span[0]
    text = tokenizer.decode(s0.prompt_ids[start : s0.needle_token_span[1]])
    first = start + text.index(s0.answer)
    digits = torch.arange(first, first + len(s0.answer))
    # the answer's first two positions read the same tokens in A and B (the prompt's end, then the space
    # before the digits): a difference there can only come from the memory
    answer_pos = mask[0].nonzero().squeeze(-1)[:2]
    for key in cap_a:
        u_a = torch.cat([u for u, _ in cap_a[key]], 1)
        u_b = torch.cat([u for u, _ in cap_b[key]], 1)
        o_a = torch.cat([o for _, o in cap_a[key]], 1)
        o_b = torch.cat([o for _, o in cap_b[key]], 1)
        layer = int(key[3:])
        rec = {
            "write_input_change": float((u_a[:, digits] - u_b[:, digits]).norm() / u_a[:, digits].norm()),
            "write_input_rms": float(u_a.pow(2).mean().sqrt()),
        }
        if layer in ret_a:
            h_a, h_b = ret_a[layer], ret_b[layer]
            rec["question_read_change"] = float(
                (h_a[:, answer_pos] - h_b[:, answer_pos]).norm() / h_a[:, answer_pos].norm()
            )
            rec["read_rms"] = float(h_a.pow(2).mean().sqrt())
        else:
            rec["question_read_change"] = float(
                (o_a[:, answer_pos] - o_b[:, answer_pos]).norm() / o_a[:, answer_pos].norm()
            )
            rec["read_rms"] = float(o_a.pow(2).mean().sqrt())
        out["layers"][str(layer)] = rec
    for mem, original in originals:
        mem.forward_heads = original
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="lmm,mac")
    p.add_argument("--set", action="append", default=[], help="TitansConfig field for the MAC rows")
    p.add_argument("--length", type=int, default=320)
    p.add_argument("--depth", type=float, default=0.3)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, help="write the rows as JSON here (a path, or a name in benchmarks/results/)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    random.seed(args.seed)
    rows = []
    for variant in args.variants.split(","):
        overrides = parse_set(args.set, model_only=True) if variant == "mac" else {}
        row = measure(variant, overrides, args.length, args.depth, args.pairs, args.seed)
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        print(f"wrote {save_json(args.out, {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
