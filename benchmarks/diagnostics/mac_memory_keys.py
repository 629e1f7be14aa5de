"""Does MAC's memory see its input at initialisation? Keys and values of every memory call, untrained.

For the tiny preset with random tokens, per memory call: the RMS of what the memory is given to write, the
mean cosine between the keys of different tokens (keys are l2-normalised; 1 means every token has the same
key) and the spread of the values across tokens (standard deviation over tokens / mean |value|, averaged
over channels). Rows: MAC writing its attention output y as it is (`mac_norm_memory_input=false`), MAC
writing norm(y) (the default), and the LMM (which writes its normed block input) for reference.

    python benchmarks/diagnostics/mac_memory_keys.py [--tokens 64] [--seed 0] [--json [PATH]]

`--json` alone writes benchmarks/results/mac_memory_keys.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from titans import TitansConfig, TitansLM
from titans.layers.memory import NeuralMemory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
from bench_utils import save_json  # noqa: E402

ROWS = {
    "mac, y written as it is": dict(variant="mac", mac_norm_memory_input=False),
    "mac, norm(y) written (default)": dict(variant="mac"),
    "lmm": dict(variant="lmm"),
}


def memory_inputs(model: TitansLM, tokens: torch.Tensor) -> list[dict]:
    """Per memory call, in call order: the input's RMS, the keys' mean pairwise cosine, the values' spread."""
    calls = []
    for mem in (m for m in model.modules() if isinstance(m, NeuralMemory)):
        project = mem.project

        def spy(x, tail, project=project):
            q, k, v, new_tail = project(x, tail)
            cos = k @ k.transpose(-1, -2)  # (B, H, T, T)
            off = ~torch.eye(cos.shape[-1], dtype=torch.bool)
            spread = v.std(dim=2) / v.abs().mean(dim=2).clamp_min(1e-30)  # over tokens, per channel
            calls.append(
                {
                    "input_rms": x.pow(2).mean().sqrt().item(),
                    "key_mean_pairwise_cosine": cos[..., off].mean().item(),
                    "value_spread": spread.mean().item(),
                }
            )
            return q, k, v, new_tail

        mem.project = spy
    with torch.no_grad():
        model(tokens)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="sequence length (one MAC segment of the preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        nargs="?",
        const="mac_memory_keys",
        default=None,
        help="write the results: a path, or a name in benchmarks/results/ "
        "(--json alone: mac_memory_keys.json there)",
    )
    args = p.parse_args()
    tokens = torch.randint(0, 256, (2, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    results = {}
    print(f"{'model':<32}{'call':>5}{'input rms':>11}{'key cos':>10}{'value spread':>14}")
    for name, overrides in ROWS.items():
        torch.manual_seed(args.seed)
        calls = memory_inputs(TitansLM(TitansConfig.preset("tiny", **overrides)), tokens)
        results[name] = {"config": overrides, "calls": calls}
        for i, c in enumerate(calls):
            print(
                f"{name:<32}{i:>5}{c['input_rms']:>11.4g}{c['key_mean_pairwise_cosine']:>10.6f}"
                f"{c['value_spread']:>14.4f}"
            )
    if args.json:
        print(f"wrote {save_json(args.json, {'args': vars(args), 'rows': results})}")


if __name__ == "__main__":
    main()
