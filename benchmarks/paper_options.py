"""The block options against today's defaults at a short language-modelling budget: the table in
docs/design.md, "Departures from the paper".

Each row is `configs/compare_mac.json` with the row's variant (tiny preset, the Python standard library
as bytes, batch 8 x 256, lr 1e-3) cut to `--steps` steps, with the row's model options set, trained by
`titans train` in its own process on one thread, the same seed for every row (the same batches). Held-out
bits per byte on the config's 64 held-out windows.

    python benchmarks/paper_options.py [--rows mag,mag_attn_gate,...] [--steps 200] [--jobs 2]
        [--out-dir runs/paper_options] [--name paper_options]

A short budget and one seed: differences below the seed spread of docs/training.md (about 0.01-0.02 bpb
at the main job's budget) decide nothing. Runs whose run_dir holds a finished report are read, not
re-trained. Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_utils import finished_run, machine_info, save_json
from titans.training.report import read_report

ROOT = Path(__file__).resolve().parents[1]

# name: (variant, model options, what the row is)
ROWS: dict[str, tuple[str, dict[str, object], str]] = {
    "mag": ("mag", {}, "MAG as the library builds it"),
    "mag_attn_gate": ("mag", {"attn_output_gate": True}, "attention output normalised and gated"),
    "mag_prefix_memory": ("mag", {"persistent_to_memory": True}, "persistent tokens also to the memory"),
    "mal": ("mal", {}, "MAL as the library builds it"),
    "mal_attn_gate": ("mal", {"attn_output_gate": True}, "attention output normalised and gated"),
    "mal_paper": (
        "mal",
        {"persistent_to_memory": True, "mal_attn_persistent": False},
        "persistent tokens to the memory only (eqs. 29-31)",
    ),
    "mac": ("mac", {}, "MAC, the compare block (open gate, normalised h), memory input normalised"),
    "mac_attn_gate": ("mac", {"attn_output_gate": True}, "attention output normalised and gated"),
    "mac_raw_memory_input": ("mac", {"mac_norm_memory_input": False}, "memory writes y unnormalised"),
}


def train(row: str, steps: int, seed: int, run_dir: Path) -> dict:
    variant, options, what = ROWS[row]
    config = ROOT / "configs/compare_mac.json"  # the compare configs differ only in variant and run_dir
    cmd = ["--config", str(config), "--variant", variant]
    cmd += ["--steps", str(steps), "--seed", str(seed), "--run-dir", str(run_dir)]
    cmd += ["--no-progress", "--set", "threads=1", "--set", "plot=false", "--set", "sample_tokens=0"]
    cmd += ["--set", f"eval_every={steps}", "--set", f"ckpt_every={steps}"]
    for key, value in options.items():
        cmd += ["--set", f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"]
    if not finished_run(run_dir, cmd):
        cmd = [sys.executable, "-m", "titans", "train", *cmd, "--overwrite"]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{row} failed (exit {proc.returncode}); see {run_dir}.log")
    r = read_report(run_dir)
    return {
        "row": row,
        "variant": variant,
        "options": options,
        "what": what,
        "parameters": r["num_parameters"],
        "steps": r["step"],
        "tokens_per_s": r["tokens_per_s"],
        "held_out_loss": r["eval"]["loss"],
        "held_out_bpb": r["eval"]["bpb"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one thread each)")
    p.add_argument("--out-dir", default="runs/paper_options")
    p.add_argument("--name", default="paper_options")
    args = p.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise SystemExit(f"unknown rows {bad}; choose from {list(ROWS)}")
    out = Path(args.out_dir)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda r: train(r, args.steps, args.seed, out / r), rows))
    print(f"{'row':<24}{'params':>9}{'bpb':>8}  what")
    for r in results:
        print(f"{r['row']:<24}{r['parameters']:>9,}{r['held_out_bpb']:>8.4f}  {r['what']}")
    save_json(args.name, {"args": vars(args), "machine": machine_info(), "rows": results})


if __name__ == "__main__":
    main()
