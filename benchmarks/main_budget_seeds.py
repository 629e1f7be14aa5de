"""MAC vs Transformer++ vs SWA over seeds at the main job's budget.

Each run is `configs/mac.json` (800 steps x 16 x 256 bytes of the Python standard library, lr 4e-3) with
only the variant and the seed changed, trained by `titans train` in its own process on one thread; two
runs go side by side on this 2-core machine. The seed sets the initial weights and the order of the
training batches; the held-out windows are the same for every run. A single seed decides nothing at this
size: two seeds of one model differ by more than the models do (docs/training.md), so the table reports
each variant's mean and standard deviation over the seeds, and MAC's difference to each baseline seed
by seed.

    python benchmarks/main_budget_seeds.py [--seeds 0,1,2,3,4] [--variants mac,swa,transformer]
        [--jobs 2] [--out-dir runs/seeds] [--set KEY=VALUE ...]

Runs whose run_dir already holds a finished report are read, not re-trained (delete the folder to redo
one). One thread: MAC about 10 minutes of training, each baseline 3-4; all 15 runs about 50 minutes with
2 jobs.
Writes benchmarks/results/main_budget_seeds.json (or --name).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_utils import finished_run, machine_info, save_json
from titans.evaluation.args import str_list
from titans.training.report import read_report
from titans.validation import check_distinct, seed_list

ROOT = Path(__file__).resolve().parents[1]


def train(variant: str, seed: int, run_dir: Path, extra: list[str]) -> dict:
    """Train one run (unless finished already) and return its report."""
    cmd = ["--config", str(ROOT / "configs/mac.json")]
    cmd += ["--variant", variant, "--seed", str(seed), "--run-dir", str(run_dir)]
    cmd += ["--no-progress", "--set", "threads=1", "--set", "sample_tokens=0", "--set", "plot=false"]
    cmd += ["--set", "time_budget_min=null"]  # the same 800 steps for every run, however slow
    for kv in extra:
        cmd += ["--set", kv]
    if not finished_run(run_dir, cmd):
        cmd = [sys.executable, "-m", "titans", "train", *cmd, "--overwrite"]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} seed {seed} failed (exit {proc.returncode}); see {run_dir}.log")
    r = read_report(run_dir)
    return {
        "variant": variant,
        "seed": seed,
        "parameters": r["num_parameters"],
        "steps": r["step"],
        "tokens_per_s": r["tokens_per_s"],
        "held_out_loss": r["eval"]["loss"],
        "held_out_bpb": r["eval"]["bpb"],
    }


def summary(runs: list[dict], variants: list[str], seeds: list[int]) -> dict:
    by = {(r["variant"], r["seed"]): r["held_out_bpb"] for r in runs}
    out: dict = {"per_variant": {}, "mac_minus_baseline": {}}
    for v in variants:
        xs = [by[v, s] for s in seeds]
        out["per_variant"][v] = {
            "mean": statistics.fmean(xs),
            "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs),
            "max": max(xs),
        }
    if "mac" in variants:
        for v in variants:
            if v == "mac":
                continue
            diffs = [by["mac", s] - by[v, s] for s in seeds]
            mean = statistics.fmean(diffs)
            sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            out["mac_minus_baseline"][v] = {
                "per_seed": diffs,
                "mean": mean,
                "sd": sd,
                # paired t statistic over seeds (same data order per seed): |t| < ~2.8 at 5 seeds is noise
                "paired_t": mean / (sd / len(diffs) ** 0.5) if sd > 0 else None,
                "mac_lower_in": sum(d <= 0 for d in diffs),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=seed_list, default="0,1,2,3,4", help="distinct, comma separated")
    p.add_argument("--variants", type=str_list, default="mac,swa,transformer")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one thread each)")
    p.add_argument("--out-dir", default="runs/seeds")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    p.add_argument("--name", default="main_budget_seeds", help="results file name (no extension)")
    args = p.parse_args()
    seeds, variants = args.seeds, args.variants
    try:  # a repeat would train into the same folder twice and count twice in the means
        check_distinct("--variants", variants)
    except ValueError as e:
        p.error(str(e))
    out_dir = Path(args.out_dir).resolve()
    # seed by seed, so that an interrupted benchmark leaves whole seeds behind
    jobs = [(v, s) for s in seeds for v in variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(train, v, s, out_dir / f"{v}_seed{s}", args.set) for v, s in jobs]
        runs = [f.result() for f in futures]

    print(f"held-out bits per byte after {runs[0]['steps']} steps (configs/mac.json, 1 thread per run)\n")
    header = f"{'variant':<12} {'params':>9} " + " ".join(f"{'seed ' + str(s):>8}" for s in seeds)
    header += f" {'mean':>7} {'sd':>6}"
    print(header)
    print("-" * len(header))
    by = {(r["variant"], r["seed"]): r for r in runs}
    stats = summary(runs, variants, seeds)
    for v in variants:
        cells = " ".join(f"{by[v, s]['held_out_bpb']:>8.4f}" for s in seeds)
        st = stats["per_variant"][v]
        print(f"{v:<12} {by[v, seeds[0]]['parameters']:>9,} {cells} {st['mean']:>7.4f} {st['sd']:>6.4f}")
    for v, d in stats["mac_minus_baseline"].items():
        cells = " ".join(f"{x:>+8.4f}" for x in d["per_seed"])
        t = f", paired t {d['paired_t']:+.2f}" if d["paired_t"] is not None else ""
        print(
            f"{'mac - ' + v:<22} {cells} {d['mean']:>+7.4f} {d['sd']:>6.4f}"
            f"   (MAC at or below in {d['mac_lower_in']} of {len(seeds)} seeds{t})"
        )
    payload = {"machine": machine_info(), "seeds": seeds, "variants": variants, "set": args.set}
    path = save_json(args.name, {**payload, "runs": runs, **stats})
    print(f"\nwrote {path.relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    main()
