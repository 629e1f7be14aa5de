"""The neural memory's gates and surprise in a trained model: do they move from their initial values?

Runs a checkpoint (or run folder) over held-out windows of its own data with `forward_with_stats` and
prints, per memory call, the median theta / eta / alpha and surprise quantiles, next to the values the
config starts the gates at, and the size of the learned initial memory weights W_0.

    python benchmarks/diagnostics/memory_gate_stats.py runs/compare/mac [--windows 4]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from titans.data.loader import EvalWindows
    from titans.data.stream import load_token_streams
    from titans.training.model_io import load_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder or a run folder (its newest good checkpoint)")
    p.add_argument("--windows", type=int, default=4, help="held-out windows of the training length")
    args = p.parse_args()
    model, cfg, tokenizer = load_model(args.checkpoint)
    heldout = load_token_streams(cfg.data, tokenizer, heldout_fraction=cfg.heldout_fraction).heldout
    windows = EvalWindows(heldout, seq_len=cfg.seq_len, num_windows=args.windows, batch_size=args.windows)
    inputs, _ = next(iter(windows))
    with torch.no_grad():
        stats = model.forward_with_stats(inputs).stats
    mc = model.config
    print(
        f"{cfg.variant}: {len(stats)} memory calls on {inputs.shape[0]} x {inputs.shape[1]} held-out tokens; "
        f"initial gates theta {mc.memory_theta_init}, eta {mc.memory_eta_init}, alpha {mc.memory_alpha_init}"
    )
    clip = mc.memory_surprise_clip
    print(f"surprise: the inner gradient's norm before the clip at {clip} (clipped: the share above it)")
    print(f"{'call':>4s}  {'theta':>7s}  {'eta':>6s}  {'alpha':>7s}  surprise q10 / q50 / q90  clipped")
    for i, s in enumerate(stats):
        q = [float(s.surprise.float().quantile(v)) for v in (0.1, 0.5, 0.9)]
        clipped = float((s.surprise > clip).float().mean()) if clip is not None else 0.0
        print(
            f"{i:4d}  {float(s.theta.median()):7.4f}  {float(s.eta.median()):6.3f}  "
            f"{float(s.alpha.median()):7.4f}  {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}  {clipped:15.0%}"
        )
    for name, w in model.named_parameters():
        if "init_weights" in name:
            norm = float(w.detach().norm(dim=(-2, -1)).mean())
            print(f"{name} {tuple(w.shape)}: mean per-head Frobenius norm {norm:.2f}")


if __name__ == "__main__":
    main()
