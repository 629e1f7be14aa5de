"""The paper's ablation (Table 5): take one component out of the model at a time, same training budget.

Rows (``ABLATIONS``; each a set of ``TitansConfig`` overrides on the base model):

- ``full``: the base model as configured.
- ``linear_memory``: memory depth 1 (a matrix) instead of an MLP.
- ``no_conv``: no causal convolution on the memory's q/k/v.
- ``no_momentum``: eta = 0, the surprise is the momentary gradient only.
- ``no_weight_decay``: alpha = 0, the memory never forgets.
- ``no_persistent``: no persistent-memory tokens (only meaningful where the model has attention).

Each row is (1) trained as a language model with the project's ``Trainer`` (same data, seed, steps and
schedule for every row) and scored on held-out text, then (2), when ``task_steps > 0``, fine-tuned on the
S-NIAH pass-key task with the ``task_training`` recipe and evaluated at ``eval_lengths``.
The paper ablates the LMM at 400M parameters; our base default is MAC (persistent tokens only matter
where there is attention), at the tiny preset.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path
from typing import Any

from titans.data.tokenizers import load_tokenizer
from titans.evaluation.args import (
    add_eval_args,
    add_model_args,
    add_recipe_args,
    add_runtime_args,
    float_list,
    model_overrides,
    positive_int_list,
    set_threads,
    str_list,
)
from titans.evaluation.lm_study import add_lm_args, lm_train_config, run_root
from titans.evaluation.recipe import build_model, evaluate_lengths, niah_samples, task_config
from titans.evaluation.reporting import write_study
from titans.evaluation.scoring import new_figure, render_table, save_figure
from titans.evaluation.task_training import check_train_length, train_on_task
from titans.models.config import TitansConfig
from titans.models.variants import VARIANT_SPECS
from titans.ops.memory import resolve_rule
from titans.training.signals import exit_if_stopped
from titans.training.trainer import Trainer
from titans.validation import check_distinct

ABLATIONS: dict[str, dict[str, Any]] = {
    "full": {},
    "linear_memory": {"memory_depth": 1},
    "no_conv": {"memory_conv_kernel": 0},
    "no_momentum": {"memory_momentum": False},
    "no_weight_decay": {"memory_forgetting": False},
    "no_persistent": {"persistent_tokens": 0},
}


def run_row(
    args: argparse.Namespace, name: str, overrides: dict[str, Any], root: Path, samples: list | None
) -> dict:
    """Train and evaluate one ablation row on the NIAH ``samples`` (None without a task stage); returns
    its JSON-able record."""
    overrides = {**args.base_overrides, **overrides}
    record: dict[str, Any] = {"name": name, "overrides": overrides}
    t0 = time.perf_counter()
    if args.lm_steps > 0:
        trainer = Trainer(lm_train_config(args, root / name, overrides))
        model, tokenizer = trainer.model, trainer.tokenizer
        result = trainer.train()
        exit_if_stopped(result.stopped_by, f"while row {name!r} trained (step {result.step})")
        record.update(
            heldout_loss=result.eval.loss,
            heldout_bpb=result.eval.bpb,
            train_loss=result.train_loss,
            lm_tokens_per_s=result.tokens_per_s,
        )
        print(f"[{name}] held-out loss {result.eval.loss:.4f} after {result.step} LM steps")
    else:
        tokenizer = load_tokenizer(args.tokenizer)
        model = build_model(args, args.variant, tokenizer.vocab_size, overrides)  # seeded: rows start alike
    record["parameters"] = model.num_parameters()
    if args.steps > 0:
        task_cfg = task_config(args, "niah", kind="passkey", haystack=None)
        history = train_on_task(model, tokenizer, task_cfg, max_seconds=args.task_time_budget)
        exit_if_stopped(history[-1].get("stopped_by") if history else None, f"while row {name!r} trained")
        # as `eval niah`: --eval-batch-size, --prefill-chunk, and --max-attention-length's skipped lengths
        res, _, skipped = evaluate_lengths(model, tokenizer, samples, by="depth", args=args, label=name)
        record.update(
            niah_accuracy=None if res is None else res.table.overall,
            niah_by_length={} if res is None else {str(n): res.table.row_accuracy(n) for n in res.table.rows},
            niah_skipped_lengths=skipped,
            niah_final_task_loss=history[-1]["loss_avg"] if history else None,
        )
        if res is not None:
            print(f"[{name}] NIAH accuracy {100 * res.table.overall:.1f}%")
    record["seconds"] = time.perf_counter() - t0
    return record


def task_samples(args: argparse.Namespace) -> list | None:
    """The NIAH samples every row is evaluated on (None without a task stage), drawn, and the recipe's
    length checked, before any row trains: a length or depth they refuse ends the study at once."""
    if args.steps <= 0:
        return None
    tokenizer = load_tokenizer(args.tokenizer)
    check_train_length(tokenizer, task_config(args, "niah", kind="passkey", haystack=None))
    return niah_samples(tokenizer, args, args.eval_lengths)


def format_rows(rows: list[dict], eval_lengths: list[int]) -> str:
    head = ["row", "params", "heldout loss", "NIAH all"] + [f"NIAH@{n}" for n in eval_lengths]
    lines = [head]
    for r in rows:
        loss = r.get("heldout_loss")
        acc = r.get("niah_accuracy")
        by = r.get("niah_by_length", {})
        lines.append(
            [
                r["name"],
                f"{r['parameters']:,}",
                "-" if loss is None else f"{loss:.4f}",
                "-" if acc is None else f"{100 * acc:.1f}",
            ]
            + ["-" if by.get(str(n)) is None else f"{100 * by[str(n)]:.1f}" for n in eval_lengths]
        )
    return render_table(lines)


def plot_rows(rows: list[dict], png_path: Path, title: str) -> Path:
    """Two bar charts side by side: held-out loss (lower is better) and NIAH accuracy per row."""
    names = [r["name"] for r in rows]
    fig = new_figure((10, 3.6))
    panels = [("heldout_loss", "held-out loss (nats/token)"), ("niah_accuracy", "NIAH pass-key accuracy")]
    for i, (key, label) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        values = [r.get(key) for r in rows]
        shown = [0.0 if v is None else v for v in values]
        ax.bar(range(len(rows)), shown, color=["tab:green"] + ["tab:gray"] * (len(rows) - 1))
        for x, v in enumerate(values):
            ax.text(x, shown[x], "n/a" if v is None else f"{v:.3f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_xlabel("model")
        ax.set_ylabel(label)
        known = [v for v in values if v is not None]
        if key == "heldout_loss" and known:
            ax.set_ylim(min(known) * 0.95, max(known) * 1.03)
        if key == "niah_accuracy":
            ax.set_ylim(0, 1.05)
    fig.suptitle(title)
    return save_figure(fig, png_path)


def removes_nothing(args: argparse.Namespace, row: str) -> bool:
    """Whether ablation ``row`` trains `full`'s model again: the base model (its preset, variant, --set
    and memory rule) lacks already what the row removes (a rule without momentum, a conv kernel of 0)."""
    config = partial(TitansConfig.preset, args.preset, variant=args.variant)
    base = config(**args.base_overrides)
    if any(k.startswith("memory_") for k in ABLATIONS[row]):
        if not any(base.has_memory(i) for i in range(base.depth)):
            return True  # no memory layer (`memory_layers=[]`)
        if row in ("no_momentum", "no_weight_decay") and not base.memory_write:
            return True  # parts of the write, which a frozen memory never makes (its reads stay the same)
        if row == "no_momentum" and not resolve_rule(base.memory_rule).uses_momentum:
            return True
    return config(**{**args.base_overrides, **ABLATIONS[row]}) == base


def run_ablate(args: argparse.Namespace) -> int:
    set_threads(args)
    unknown = [r for r in args.rows if r not in ABLATIONS]
    if unknown:
        raise ValueError(f"unknown ablation row(s) {unknown}: choose from {list(ABLATIONS)}")
    check_distinct("--rows", args.rows)  # the second trained into the first's run folder
    spec = VARIANT_SPECS.get(args.variant)
    memory_rows = [r for r in args.rows if any(k.startswith("memory_") for k in ABLATIONS[r])]
    if spec is not None and not spec.memory and memory_rows:  # each would be `full` under another label
        raise ValueError(
            f"--variant {args.variant} has no memory, so the rows {memory_rows} would remove nothing; give "
            "--rows full (a baseline) or a variant with memory"
        )
    if spec is not None and not spec.attention and "no_persistent" in args.rows:
        # persistent tokens are attention keys: a memory-only variant has none, the row would equal `full`
        args.rows = [r for r in args.rows if r != "no_persistent"]
        print(f"skipping no_persistent: {args.variant} has no attention, hence no persistent tokens")
    if args.lm_steps <= 0 and args.steps <= 0:
        raise ValueError("nothing to train: set --lm-steps and/or --task-steps above 0")
    args.base_overrides = model_overrides(args)
    same = [r for r in args.rows if r != "full" and removes_nothing(args, r)]
    if same:  # each would be `full` under another label, reported as a removal
        args.rows = [r for r in args.rows if r not in same]
        print(f"skipping {', '.join(same)}: the base model has nothing there to remove")
    args.task_time_budget = None if args.time_budget is None else 60.0 * args.time_budget
    samples = task_samples(args)
    with run_root(args, "titans-ablate-", args.rows) as root:
        rows = [run_row(args, name, ABLATIONS[name], root, samples) for name in args.rows]
    title = f"ablation of {args.variant} ({args.preset}): {args.lm_steps} LM steps, {args.steps} NIAH steps"
    table = format_rows(rows, args.eval_lengths)
    write_study(args, "ablate", f"ablate_{args.variant}", rows, title, plot_rows, table)
    return 0


def add_parser(evals) -> None:
    p = evals.add_parser("ablate", help="the paper's Table 5: one memory component removed per row")
    p.add_argument("--variant", default="mac", help="the base model's variant")
    p.add_argument("--rows", type=str_list, default=list(ABLATIONS), help=f"subset of {','.join(ABLATIONS)}")
    add_lm_args(p, heldout_windows=32, lm_steps_help="LM steps per row (0: skip the LM stage)")
    p.add_argument(
        "--eval-lengths", type=positive_int_list, default=[512, 1024], help="NIAH evaluation lengths"
    )
    p.add_argument("--depths", type=float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="NIAH depths")
    add_model_args(p)
    add_recipe_args(p, default_length=512, steps_flag="--task-steps", default_steps=0)
    add_eval_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run_ablate, kind="passkey", haystack=None)
