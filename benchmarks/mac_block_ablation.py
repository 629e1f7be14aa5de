"""Ablations of the MAC block at the `make compare` budget: the table in docs/design.md, "The MAC block".

Each row is `configs/compare_mac.json` on the library's default MAC block (`mac_gate=norm`, memory tokens
as the memory's output head gives them), 1 thread, with one change made by patching the block in its own
process (so these are diagnostics, not library options; the options that came out of them are
`mac_gate="open"` and `mac_norm_memory_tokens`). Prints held-out bits per byte per row.

    python benchmarks/mac_block_ablation.py [--rows default,no_gate,...] [--out-dir runs/mac_ablation]
        [--name mac_block_ablation]

About 4 minutes per row on one core; rows run one after the other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_utils import machine_info, save_json

ROOT = Path(__file__).resolve().parents[1]

ROWS = {
    "default": "default block",
    "zero_h": "h replaced by zeros",
    "no_gate": "output o = y (no gate)",
    "no_gate_zero_h": "output o = y, h zeros",
    "no_gate_norm_h": "output o = y, h RMS-normalised",
    "keep_scale": "gate o = W(y * sigmoid(norm(M(y)))) (y's scale kept)",
    "norm_h": "h RMS-normalised, default gate",
    "open": "y * 2 sigmoid(W_g norm(M(y))), W_g = 0 at init",
    "open_norm_h": "the same gate, h RMS-normalised",
}


def patch(row: str) -> None:
    """Change the MAC block in this process as `row` says."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from titans.layers.norm import RMSNorm
    from titans.models import blocks, lm

    if "no_gate" in row:
        mix = blocks.MACBlock.mix

        def mix_without_gate(self, x, state, stats):
            self.combine.forward = lambda y, m: y
            return mix(self, x, state, stats)

        blocks.MACBlock.mix = mix_without_gate
    # the memory tokens h of a segment: `memory_tokens(q (B, H, n, d), gate, weights)` -> (B, n, dim)
    if row.endswith("zero_h"):
        blocks.MACBlock.memory_tokens = lambda self, q, gate, weights: q.new_zeros(
            q.shape[0], q.shape[2], self.memory.dim
        )
    if row.endswith("norm_h"):
        memory_tokens = blocks.MACBlock.memory_tokens

        def memory_tokens_normalised(self, q, gate, weights):
            h = memory_tokens(self, q, gate, weights)
            return F.rms_norm(h, (h.shape[-1],))

        blocks.MACBlock.memory_tokens = memory_tokens_normalised
    if row == "keep_scale":
        blocks.GatedCombine.forward = lambda self, a, b: self.proj(a * torch.sigmoid(self.norm_b(b)))
    if row.startswith("open"):

        class OpenGate(nn.Module):
            def __init__(self, dim, eps):
                super().__init__()
                self.norm_m = RMSNorm(dim, eps=eps)
                self.gate = nn.Linear(dim, dim, bias=False)

            def forward(self, y, m):
                return y * (2 * torch.sigmoid(self.gate(self.norm_m(m))))

        init, reset = blocks.MACBlock.__init__, lm.TitansLM.reset_parameters

        def init_open(self, cfg):
            init(self, cfg)
            self.combine = OpenGate(cfg.dim, cfg.norm_eps)

        def reset_open(self):
            reset(self)
            for m in self.modules():
                if isinstance(m, OpenGate):
                    nn.init.zeros_(m.gate.weight)

        blocks.MACBlock.__init__, lm.TitansLM.reset_parameters = init_open, reset_open


def run_row(row: str, run_dir: Path) -> int:
    import torch

    from titans.cli import main

    patch(row)
    torch.set_flush_denormal(True)
    # the block the table measured: the memory writes y as the attention gives it
    default_block = ["--set", "model.mac_gate=norm", "--set", "model.mac_norm_memory_tokens=false"]
    default_block += ["--set", "model.mac_norm_memory_input=false"]
    config = str(ROOT / "configs/compare_mac.json")
    return main(["train", "--config", config, *default_block, "--set", "threads=1",
                 "--no-progress", "--overwrite", "--run-dir", str(run_dir)])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--out-dir", default="runs/mac_ablation")
    p.add_argument("--name", help="also write benchmarks/results/NAME.json")
    p.add_argument("--row", help=argparse.SUPPRESS)
    args = p.parse_args()
    out_dir = Path(args.out_dir).resolve()  # the rows' processes run in the repository root
    if args.row:
        sys.exit(run_row(args.row, out_dir / args.row))
    machine = machine_info()
    results = []
    for row in args.rows.split(","):
        if row not in ROWS:
            raise SystemExit(f"unknown row {row!r}; choose from {list(ROWS)}")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--out-dir", str(out_dir)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
            raise SystemExit(f"row {row} failed (exit {done.returncode}):\n{tail}")
        report = json.loads((out_dir / row / "report.json").read_text())
        results.append((row, report["eval"]["bpb"]))
        print(f"{ROWS[row]:<56} {results[-1][1]:.3f}", flush=True)
    if args.name:
        rows = [{"row": row, "what": ROWS[row], "held_out_bpb": bpb} for row, bpb in results]
        print(f"wrote {save_json(args.name, {'args': vars(args), 'rows': rows}, machine)}")


if __name__ == "__main__":
    main()
