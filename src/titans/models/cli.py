"""`titans presets`: every preset's size, per variant, counted on the meta device (nothing allocated)."""

from __future__ import annotations

import torch

from titans.models.config import PRESETS, VARIANTS, TitansConfig
from titans.models.lm import TitansLM


def parameter_table(variants=VARIANTS, presets=tuple(PRESETS)) -> list[tuple[str, str, int]]:
    rows = []
    for name in presets:
        for variant in variants:
            with torch.device("meta"):
                model = TitansLM(TitansConfig.preset(name, variant=variant))
            rows.append((name, variant, model.num_parameters()))
    return rows


def main(args) -> int:
    rows = parameter_table([v.strip() for v in args.variants.split(",")])  # "mac, swa" as "mac,swa"
    variants = list(dict.fromkeys(v for _, v, _ in rows))
    print(f"{'preset':8s} " + " ".join(f"{v:>12s}" for v in variants))
    for name in PRESETS:
        counts = {v: n for p, v, n in rows if p == name}
        print(f"{name:8s} " + " ".join(f"{counts[v] / 1e6:11.1f}M" for v in variants))
    return 0


def register(commands, evals) -> None:
    p = commands.add_parser("presets", help="parameter count of every model preset, per variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants to count")
    p.set_defaults(func=main)
