"""S-NIAH over training seeds: train each variant with the pass-key recipe once per seed, evaluate every
trained model on several haystacks and lengths, and aggregate the accuracy per length as mean and range.

    python benchmarks/niah_seeds.py --variants lmm,mac --seeds 0,1,2 --jobs 2 --name main
    python benchmarks/niah_seeds.py --aggregate-only --name main      # re-read the per-run JSON files

For every (variant, seed) one pipeline runs, pipelines in parallel up to ``--jobs``:

1. ``titans eval niah --train-recipe --variant V --seed S <recipe> --save-model RUNS/V_sS``: the variant's
   recipe (``titans.evaluation.recipe.RECIPES``; ``--recipe-extra`` is appended) from a fresh model seeded
   by S; it evaluates once at ``--train-eval-length`` as a check;
2. with ``--then FLAGS`` (repeatable), further training stages, each from the model the stage before
   saved: ``titans eval niah --checkpoint RUNS/V_sS --train-recipe --seed S FLAGS --save-model
   RUNS/V_sS_stage2`` (then ``_stage3``, ...); FLAGS are the stage's recipe options, in full.
   With ``--keep-stages``, a stage whose checkpoint folder already holds a good checkpoint of a finished
   run (not one a signal stopped) is not trained again: a pipeline gains a stage (one more ``--then``)
   at the cost of that stage alone;
3. ``titans eval niah --checkpoint <last stage> --haystack H --lengths ... --seed 0`` for each haystack:
   the same test prompts for every model and seed (``--seed`` of an evaluation only picks the prompts).

Each command writes its own JSON (the command line, the training history, every prompt's answer) under
``OUT/runs/``; the summary ``OUT/niah_seeds_<name>.json`` holds, per variant, haystack and length, the
accuracy of every seed and their mean, min and max. The commands run as subprocesses of
``python -m titans``, so what the summary reports is exactly what those commands print.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from titans._fs import write_text_atomic
from titans.evaluation.args import str_list
from titans.evaluation.haystack import get_haystack
from titans.evaluation.recipe import RECIPES, variant_recipe
from titans.runtime.checkpoint import latest_checkpoint, verify_checkpoint
from titans.validation import check_distinct, seed_list


def run_commands(variant: str, seed: int, args: argparse.Namespace) -> list[list[str]]:
    """The pipeline of one (variant, seed): the training commands (the recipe, then each `--then` stage),
    then one evaluation per haystack."""
    tag = f"{variant}_s{seed}"
    ckpt = Path(args.runs) / tag
    out = Path(args.out) / "runs"
    common = ["--threads", str(args.threads), "--device", args.device, "--out", str(out)]
    train = [
        *("eval", "niah", "--train-recipe", "--variant", variant, "--seed", str(seed)),
        *variant_recipe(variant),
        *("--kind", args.kind),
        *shlex.split(args.recipe_extra),
        *("--lengths", str(args.train_eval_length), "--samples", "1"),
        *("--save-model", str(ckpt), "--name", f"{tag}_train"),
        *common,
    ]
    if args.time_budget is not None:
        train += ["--time-budget", str(args.time_budget)]
    commands = [train]
    for i, flags in enumerate(args.then, start=2):  # each further stage trains on from the stage before
        previous, ckpt = ckpt, Path(args.runs) / f"{tag}_stage{i}"
        commands.append(
            [
                *("eval", "niah", "--checkpoint", str(previous), "--train-recipe", "--seed", str(seed)),
                *("--kind", args.kind),
                *shlex.split(flags),
                *("--lengths", str(args.train_eval_length), "--samples", "1"),
                *("--save-model", str(ckpt), "--name", f"{tag}_stage{i}_train"),
                *common,
            ]
        )
    for haystack in args.haystacks.split(","):
        commands.append(
            [
                *("eval", "niah", "--checkpoint", str(ckpt), "--haystack", haystack, "--kind", args.kind),
                *("--lengths", args.lengths, "--samples", str(args.samples), "--seed", "0"),
                *("--eval-batch-size", str(args.eval_batch_size), "--name", f"{tag}_{haystack}"),
                *common,
            ]
        )
    return commands


def finished_stage(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a good checkpoint of a stage that ran to its end: a stage stopped by a
    signal saves the model it had (``stopped_by`` in its summary), and that one is trained again."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return False
    final = verify_checkpoint(path)["config"].get("task_training", {}).get("final") or {}
    return final.get("stopped_by") is None


def run_pipeline(variant: str, seed: int, args: argparse.Namespace) -> None:
    log_dir = Path(args.out) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{variant}_s{seed}.log", "a") as log:
        for cmd in run_commands(variant, seed, args):
            full = [sys.executable, "-m", "titans", *cmd]
            if args.keep_stages and "--save-model" in cmd:
                saved = cmd[cmd.index("--save-model") + 1]
                if finished_stage(saved):  # a stage already trained: train on from it
                    log.write(f"# kept {saved}: it holds a finished stage's checkpoint\n")
                    log.flush()
                    continue
            log.write("$ " + shlex.join(full) + "\n")
            log.flush()
            t0 = time.perf_counter()
            rc = subprocess.call(full, stdout=log, stderr=subprocess.STDOUT)
            log.write(f"# exit {rc} after {time.perf_counter() - t0:.0f}s\n")
            log.flush()
            if rc != 0:
                print(f"{variant} seed {seed}: `{shlex.join(cmd[:3])} ...` failed (exit {rc})", flush=True)
                return
    print(f"{variant} seed {seed}: done", flush=True)


def per_length(result: dict) -> dict[int, float]:
    """An evaluation JSON's accuracy per length (all depths pooled)."""
    correct: dict[int, int] = {}
    total: dict[int, int] = {}
    for cell in result["cells"]:
        n = int(cell["length"])
        correct[n] = correct.get(n, 0) + int(cell["correct"])
        total[n] = total.get(n, 0) + int(cell["total"])
    return {n: correct[n] / total[n] for n in sorted(total)}


def aggregate(out: Path) -> dict:
    """Read ``out/runs/<variant>_s<seed>_<haystack>.json`` -> {variant: {haystack: {length: stats}}}."""
    table: dict[str, dict[str, dict[int, dict[int, float]]]] = {}
    prompts: dict[str, int] = {}
    train: dict[str, dict] = {}
    for path in sorted((out / "runs").glob("*_s*_*.json")):
        stem = path.stem
        match = re.fullmatch(
            r"(?P<variant>[a-z]+)_s(?P<seed>\d+)(?P<stage>_stage\d+)?_(?P<haystack>[a-z_]+)", stem
        )
        if match is None:
            continue
        variant, seed_text, haystack = match["variant"], match["seed"], match["haystack"]
        data = json.loads(path.read_text())
        if match["stage"] and haystack != "train":
            continue
        if haystack == "train":  # a training stage's check
            training = data["metadata"]["model"].get("training", {})
            final = training.get("final") or {}
            train[f"{variant}_s{seed_text}{match['stage'] or ''}"] = {
                "steps_done": training.get("steps_done"),
                "seconds": training.get("seconds"),
                "final_answer_loss_avg": final.get("loss_avg"),
            }
            continue
        for length, acc in per_length(data).items():
            cell = table.setdefault(variant, {}).setdefault(haystack, {}).setdefault(length, {})
            cell[int(seed_text)] = acc
        prompts[stem] = len(data["metadata"]["samples"])
    summary: dict = {"variants": {}, "training": train}
    for variant, by_haystack in table.items():
        summary["variants"][variant] = {}
        for haystack, by_length in by_haystack.items():
            rows = {}
            for length, by_seed in sorted(by_length.items()):
                values = list(by_seed.values())
                rows[str(length)] = {
                    "seeds": {str(s): a for s, a in sorted(by_seed.items())},
                    "mean": sum(values) / len(values),
                    "min": min(values),
                    "max": max(values),
                }
            summary["variants"][variant][haystack] = rows
    summary["prompts_per_run"] = prompts
    return summary


def markdown(summary: dict) -> str:
    """One row per variant and haystack: mean accuracy per length with the range over seeds."""
    lengths = sorted({int(n) for v in summary["variants"].values() for h in v.values() for n in h}, key=int)
    head = "| model | haystack | seeds | " + " | ".join(f"{n / 1024:g}K" for n in lengths) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(lengths)]
    for variant, by_haystack in sorted(summary["variants"].items()):
        for haystack, rows in sorted(by_haystack.items()):
            seeds = max((len(r["seeds"]) for r in rows.values()), default=0)
            cells = []
            for n in lengths:
                r = rows.get(str(n))
                if r is None:
                    cells.append("-")
                    continue
                cells.append(f"{100 * r['mean']:.0f}% ({100 * r['min']:.0f}-{100 * r['max']:.0f})")
            lines.append(f"| {variant} | {haystack} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", type=str_list, default="lmm,mac,mag,mal,swa,transformer")
    p.add_argument("--seeds", type=seed_list, default="0,1,2", help="distinct, comma separated")
    p.add_argument("--kind", default="passkey", help="needle kind: passkey, number, uuid")
    p.add_argument("--haystacks", default="noise,essays,moby_dick")
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--samples", type=int, default=2, help="prompts per (length, depth) cell; 5 depths")
    p.add_argument("--train-eval-length", type=int, default=1024)
    p.add_argument("--time-budget", type=float, default=None, help="minutes of training per run")
    p.add_argument("--recipe-extra", default="", help="flags appended to every training command")
    p.add_argument(
        "--then",
        action="append",
        default=[],
        metavar="FLAGS",
        help="a further training stage from the last stage's model, with these recipe options (repeatable)",
    )
    p.add_argument(
        "--keep-stages",
        action="store_true",
        help="skip a training stage whose checkpoint folder (under --runs) already holds a good checkpoint "
        "of a finished run (not one a signal stopped), so a pipeline can gain a stage without retraining "
        "the ones before",
    )
    p.add_argument("--jobs", type=int, default=1, help="pipelines run in parallel")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--eval-batch-size", type=int, default=10)
    p.add_argument("--name", default="passkey")
    p.add_argument("--out", default=None, help="default results/evals/niah_seeds/<name>")
    p.add_argument("--runs", default=None, help="checkpoints; default runs/evals/niah_seeds/<name>")
    p.add_argument("--aggregate-only", action="store_true")
    args = p.parse_args()
    args.out = args.out or f"results/evals/niah_seeds/{args.name}"
    args.runs = args.runs or f"runs/evals/niah_seeds/{args.name}"
    if not args.aggregate_only:
        try:  # a repeat would run two pipelines into one checkpoint folder at once
            check_distinct("--variants", args.variants)
        except ValueError as e:
            p.error(str(e))
        for haystack in args.haystacks.split(","):  # a missing one fails now, not after hours of training
            try:
                get_haystack(haystack)
            except (ValueError, OSError, ImportError) as e:
                p.error(str(e))
        jobs = [(v, s) for v in args.variants for s in args.seeds]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(lambda job: run_pipeline(*job, args), jobs))
    out = Path(args.out)
    path = out / f"niah_seeds_{args.name}.json"
    summary = aggregate(out)
    recipe = {"per_variant": RECIPES, "extra": args.recipe_extra, "then": args.then, "kind": args.kind}
    if args.aggregate_only and path.exists():
        # re-aggregating trains nothing: keep the recipe the runs were trained with (and any hand-written
        # evaluation commands), not today's defaults of the options not given
        recipe = json.loads(path.read_text()).get("recipe", recipe)
    summary["recipe"] = recipe
    write_text_atomic(path, json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
