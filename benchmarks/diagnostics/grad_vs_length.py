"""The outer gradient of a randomly initialised model against the sequence length: one sequence of random
tokens, next-token loss over every position, one backward pass; the largest gradient entry and the
gradient norm over all parameters. Backprop through the memory's writes multiplies the gradient by each
chunk's Jacobian, so a write that overshoots (a large inner step, with momentum summing many of them)
makes the gradient grow geometrically with the number of chunks, while the forward stays finite (the
surprise clip).

    python benchmarks/diagnostics/grad_vs_length.py [--preset 170M] [--variant lmm] [--config FILE]
        [--lengths 512,...,8192] [--set memory_eta_init=0.5 --set ...] [--seed 0] [--out grad_vs_length]

Each `--set` (FIELD=VALUE, several allowed) is one more setting, measured at every length beside the
defaults; the memory runs its torch chunk loop in float32 on CPU. `--config` takes the model from a
training config instead (its preset, variant and model fields: `configs/main.json`'s model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_utils import Timer, machine_info, save_json  # noqa: E402
from titans.training.config import parse_set  # noqa: E402


def measure(
    preset: str, variant: str, seq: int, overrides: dict, seed: int, base: dict | None = None
) -> dict:
    from titans import TitansConfig, TitansLM

    torch.manual_seed(seed)
    cfg = TitansConfig.preset(
        preset, variant=variant, memory_backend="torch", **{**(base or {}), **overrides}
    )
    model = TitansLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1))
    row = {"setting": overrides, "seq": seq}
    with Timer() as clock:
        try:
            logits, _ = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        except ValueError as e:  # the memory refuses a non-finite input: the forward itself diverged
            row["error"] = str(e)[:200]
            return row
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    row["max_abs_grad"] = max(g.abs().max().item() for g in grads)
    norm = torch.stack([g.norm() for g in grads]).norm().item()
    row["grad_norm"] = norm if norm < float("inf") else "inf"  # overflowed float32 (JSON has no inf)
    row["finite"] = all(bool(torch.isfinite(g).all()) for g in grads)
    row["seconds"] = round(clock.wall, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="170M")
    p.add_argument("--variant", default="lmm")
    p.add_argument("--config", default=None, help="a training config whose model to measure")
    p.add_argument("--lengths", default="512,1024,2048,4096,8192")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="one more setting")
    p.add_argument("--setting-lengths", default=None, help="lengths for the --set settings (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON: a path, or a name in benchmarks/results/")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base: dict = {}
    if args.config:
        from titans.training.config import TrainConfig

        train = TrainConfig.from_file(args.config)
        args.preset, args.variant, base = train.preset, train.variant, dict(train.model)
    machine = machine_info()
    # each --set is one row, its value read as the field's type (a string field too: memory_forget_to=init)
    settings = [{}] + [parse_set([item], model_only=True) for item in args.set]
    lengths = [int(x) for x in args.lengths.split(",")]
    other = [int(x) for x in args.setting_lengths.split(",")] if args.setting_lengths else lengths
    rows = []
    print(f"{args.variant} {args.preset}, random init, seed {args.seed}: one sequence, loss at every token")
    print(f"{'setting':<32}{'tokens':>8}{'max |grad|':>14}{'grad norm':>14}{'s':>7}")
    for setting in settings:
        for seq in lengths if not setting else other:
            row = measure(args.preset, args.variant, seq, setting, args.seed, base)
            rows.append(row)
            name = ", ".join(f"{k}={v}" for k, v in setting.items()) or "defaults"
            if "error" in row:
                print(f"{name:<32}{seq:>8}  forward not finite", flush=True)
            else:
                print(f"{name:<32}{seq:>8}{row['max_abs_grad']:>14.3g}{float(row['grad_norm']):>14.3g}"
                      f"{row['seconds']:>7.0f}", flush=True)  # fmt: skip
    if args.out:
        payload = {
            "preset": args.preset,
            "variant": args.variant,
            "model": base,
            "seed": args.seed,
            "rows": rows,
        }
        print(f"wrote {save_json(args.out, payload, machine)}")


if __name__ == "__main__":
    main()
