"""Does the MAC memory really carry information across segments? A trained MAC vs its memory-off twin.

Task (memory induction): each sequence is a random permutation of `segment_len` tokens followed by the same
permutation again. In the second segment, every next token is determined by the current one, but only
through the FIRST segment, which lies outside the attention span (MAC attends within a segment). The only
path from segment 1 to segment 2 is the neural memory.

The twin has the same architecture and parameters, with `memory_write=False`: a frozen memory, read but
never written (its weights and momentum never change: no test-time learning, no forgetting), which also
spares it the write's compute. We train both with the same seed, steps and data, then report the loss and
next-token accuracy on the repeated segment (chance accuracy = 1/vocab).

    python benchmarks/mac_memory_twin.py [--steps 600] [--segment-len 16] [--vocab 32]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from bench_utils import Timer, save_json
from titans import TitansConfig, TitansLM


def batch(n: int, seg: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    perms = torch.stack([torch.randperm(vocab, generator=gen)[:seg] for _ in range(n)])
    return torch.cat([perms, perms], dim=1)  # (n, 2 * seg)


def second_segment_metrics(model: TitansLM, tokens: torch.Tensor, seg: int) -> tuple[torch.Tensor, float]:
    logits, _ = model(tokens[:, :-1])
    # predictions for positions seg+1 .. 2seg-1 (targets inside the repeated segment, given the current token)
    pred = logits[:, seg:]
    target = tokens[:, seg + 1 :]
    loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1))
    acc = (pred.argmax(-1) == target).float().mean().item()
    return loss, acc


def train_and_eval(write: bool, args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    cfg = TitansConfig(
        variant="mac",
        vocab_size=args.vocab,
        dim=args.dim,
        depth=2,
        heads=4,
        segment_len=args.segment_len,
        window=args.segment_len,
        chunk_size=args.chunk_size,
        persistent_tokens=4,
        memory_depth=args.memory_depth,
        memory_write=write,
        memory_max_lr=args.memory_max_lr,
        memory_theta_init=args.memory_theta_init,
        mac_gate=args.mac_gate,
        mac_norm_memory_tokens=args.mac_norm_memory_tokens == "true",
        mac_norm_memory_input=args.mac_norm_memory_input == "true",
        mac_memory_residual=args.mac_memory_residual == "true",
    )
    model = TitansLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    with Timer() as clock:
        for _ in range(args.steps):
            loss, _ = second_segment_metrics(
                model, batch(args.batch, args.segment_len, args.vocab, gen), args.segment_len
            )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        test = batch(512, args.segment_len, args.vocab, torch.Generator().manual_seed(10_000 + args.seed))
        loss, acc = second_segment_metrics(model, test, args.segment_len)
    return {"memory_write": write, "loss": loss.item(), "accuracy": acc, "train_seconds": clock.wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--segment-len", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--memory-depth", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--memory-max-lr", type=float, default=TitansConfig.memory_max_lr)
    p.add_argument("--memory-theta-init", type=float, default=TitansConfig.memory_theta_init)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mac-gate", default=TitansConfig.mac_gate, help="open or norm (TitansConfig.mac_gate)")
    p.add_argument("--mac-norm-memory-tokens", choices=("true", "false"), default="true")
    p.add_argument(
        "--mac-norm-memory-input",
        choices=("true", "false"),
        default=str(TitansConfig.mac_norm_memory_input).lower(),
        help="TitansConfig.mac_norm_memory_input",
    )
    p.add_argument(
        "--mac-memory-residual",
        choices=("true", "false"),
        default=str(TitansConfig.mac_memory_residual).lower(),
        help="TitansConfig.mac_memory_residual (the block input added to what the memory writes)",
    )
    p.add_argument("--out", default="mac_memory_twin", help="a path, or a name in benchmarks/results/")
    args = p.parse_args()
    for name in ("steps", "batch", "segment_len", "chunk_size", "dim", "memory_depth"):
        if getattr(args, name) < 1:  # 0 steps raised OneCycleLR's error with a traceback
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab < max(2, args.segment_len):  # a segment is a random permutation of distinct tokens
        p.error(f"--vocab must be >= --segment-len ({args.segment_len}) and >= 2, got {args.vocab}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [train_and_eval(True, args), train_and_eval(False, args)]
    chance_loss = math.log(args.vocab - 1)
    print(
        f"MAC memory-induction task: segment {args.segment_len}, vocab {args.vocab}, {args.steps} steps, "
        f"batch {args.batch}; chance accuracy {1 / args.vocab:.3f}, uniform loss {chance_loss:.2f}; "
        f"mac_gate={args.mac_gate}, mac_norm_memory_tokens={args.mac_norm_memory_tokens}, "
        f"mac_norm_memory_input={args.mac_norm_memory_input}, mac_memory_residual={args.mac_memory_residual}"
    )
    print(f"{'model':24s} {'loss':>7s} {'accuracy':>9s} {'train s':>8s}")
    for r in rows:
        name = "MAC" if r["memory_write"] else "MAC, memory off (twin)"
        print(f"{name:24s} {r['loss']:7.3f} {r['accuracy']:9.3f} {r['train_seconds']:8.1f}")
    save_json(args.out, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
