"""`titans eval niah | babilong | tasks | ablate | depth`: the paper's long-context evaluations as commands.

Every command writes a JSON result file and a PNG next to it (``--out``, default ``results/evals/<task>``)
and prints its table. ``niah`` and ``babilong`` evaluate one model, either a trained checkpoint
(``--checkpoint``) or one trained first with the fine-tuning recipe (``--train-recipe``, see
``task_training``); ``tasks`` trains and evaluates several variants on one task; ``ablate`` and ``depth``
are the paper's Table 5 and Figures 7-8 (see ``ablation`` and ``depth_study``). docs/evaluations.md has
the commands that produced our results.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from titans.evaluation.scoring import AccuracyTable, format_table, plot_heatmap, write_results

# ---------------------------------------------------------------------------------------------------------
# Argument helpers.


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def str_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one name")
    return values


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="folder for the JSON and PNG (default results/evals/<task>)")
    p.add_argument("--name", default=None, help="file name stem of the results (default from the settings)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is best on a busy machine)"
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the fresh model, the training and the samples"
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    """A fresh model for the recipe: a preset, a variant and TitansConfig overrides."""
    p.add_argument("--preset", default="tiny", help="model size preset (tiny, small, base, ...)")
    p.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="override a TitansConfig field of a fresh model (repeatable; the model.<field> entries of "
        "`titans train --list-fields`, without the model. prefix)",
    )
    p.add_argument("--tokenizer", default="bytes", help="tokenizer of a fresh model (bytes, gpt2, a file)")
    p.add_argument(
        "--memory-alpha-init",
        type=float,
        default=None,
        help="initial forgetting gate, e.g. 1e-4 (same as --set memory_alpha_init=...)",
    )
    p.add_argument(
        "--memory-eta-init",
        type=float,
        default=None,
        help="initial momentum gate (same as --set memory_eta_init=...)",
    )


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The TitansConfig overrides of a fresh model: ``--set``, then the gate-init shortcuts (config fields,
    so they land in the saved config and a checkpoint carries them)."""
    from titans.training.config import parse_set

    out = parse_set(args.set or [], model_only=True)
    for key in ("memory_eta_init", "memory_alpha_init"):
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    return out


def add_recipe_args(
    p: argparse.ArgumentParser,
    *,
    default_length: int = 1024,
    steps_flag: str = "--steps",
    default_steps: int = 300,
) -> None:
    """The fine-tuning recipe (``TaskTrainConfig``); its step count is ``args.steps`` whatever the flag."""
    g = p.add_argument_group("fine-tuning recipe")
    g.add_argument("--train-length", type=int, default=default_length, help="longest training length")
    g.add_argument("--start-length", type=int, default=256, help="curriculum: longest length at step 0")
    g.add_argument("--curriculum", type=float, default=0.5, help="share of steps over which lengths grow")
    g.add_argument(
        "--curriculum-loss",
        type=float,
        default=None,
        help="adaptive curriculum: grow lengths by 25%% whenever the running answer loss is below this",
    )
    g.add_argument(steps_flag, dest="steps", type=int, default=default_steps, help="fine-tuning steps")
    g.add_argument("--batch-size", type=int, default=8, help="fine-tuning batch")
    g.add_argument("--lr", type=float, default=3e-3, help="fine-tuning peak learning rate")
    g.add_argument("--warmup-steps", type=int, default=20, help="fine-tuning warm-up steps")
    g.add_argument("--lm-loss-weight", type=float, default=0.0, help="add the LM loss of all tokens x this")
    g.add_argument("--time-budget", type=float, default=None, metavar="MINUTES", help="stop training early")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, default=4, help="samples per table cell")
    p.add_argument("--eval-batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per forward call")
    p.add_argument(
        "--max-attention-length",
        type=int,
        default=16384,
        help="skip full-attention (transformer) evaluations longer than this (quadratic time)",
    )


def set_threads(args: argparse.Namespace) -> None:
    """The runtime options of every evaluation command: ``--threads``, and ``--device auto`` resolved."""
    from titans.training.distributed import resolve_device

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    args.device = str(resolve_device(args.device))


def task_config(args: argparse.Namespace, task: str, **task_fields: Any):
    from titans.evaluation.task_training import TaskTrainConfig

    return TaskTrainConfig(
        task=task,
        train_length=args.train_length,
        start_length=args.start_length,
        curriculum=args.curriculum,
        curriculum_loss=args.curriculum_loss,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=min(args.warmup_steps, args.steps),
        lm_loss_weight=args.lm_loss_weight,
        seed=args.seed,
        **task_fields,
    )


def build_model(args: argparse.Namespace, variant: str, vocab_size: int, overrides: dict | None = None):
    """A fresh TitansLM (seeded by ``--seed``): ``--preset``, ``variant``, ``--set`` and the gate inits
    (``model_overrides``), and then ``overrides`` (TitansConfig fields)."""
    from titans.models import TitansConfig, TitansLM

    overrides = {**model_overrides(args), **(overrides or {})}
    overrides.setdefault("vocab_size", vocab_size)
    torch.manual_seed(args.seed)
    return TitansLM(TitansConfig.preset(args.preset, variant=variant, **overrides)).to(args.device)


def train_with_recipe(args: argparse.Namespace, model, tokenizer, task_cfg) -> dict:
    """Train ``model`` in place; returns a JSON-able summary (the recipe, the last log line, the time)."""
    from titans.evaluation.task_training import train_on_task

    budget = None if args.time_budget is None else 60.0 * args.time_budget
    t0 = time.perf_counter()
    history = train_on_task(model, tokenizer, task_cfg, max_seconds=budget)
    return {
        "recipe": task_cfg.to_dict(),
        "seconds": time.perf_counter() - t0,
        "steps_done": history[-1]["step"] + 1 if history else 0,
        "final": history[-1] if history else None,
        "history": history,
    }


def save_task_model(
    path: str | Path,
    model,
    tokenizer,
    args: argparse.Namespace,
    summary: dict,
    tokenizer_info: dict | None = None,
) -> Path:
    """Save a recipe-trained model as a trainer checkpoint (``model_io.load_model`` reads it back)."""
    from titans.models.config import PRESETS
    from titans.training.checkpoint import save_checkpoint
    from titans.training.config import TrainConfig
    from titans.training.model_io import tokenizer_record

    cfg = model.config
    preset = cfg.name if cfg.name in PRESETS else "tiny"
    train_cfg = TrainConfig(
        preset=preset,
        variant=cfg.variant,
        model={k: v for k, v in cfg.to_dict().items() if k not in ("name", "variant")},
        tokenizer=args.tokenizer,
        steps=max(1, summary["steps_done"]),
        lr=args.lr,
        seed=args.seed,
        run_dir=str(path),
    )
    config = {
        "train": train_cfg.to_dict(),
        "model": cfg.to_dict(),
        "tokenizer": tokenizer_info or tokenizer_record(args.tokenizer, tokenizer),
        "task_training": {k: v for k, v in summary.items() if k != "history"},
    }
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return save_checkpoint(
        path, summary["steps_done"], model_state=state, trainer_state={}, config=config, keep_last=1
    )


def load_task_model(path: str | Path, device: str) -> tuple[Any, Any, dict]:
    """(model, tokenizer, info) from a checkpoint; ``info`` carries the recipe it was trained with, if any."""
    from titans.training.model_io import load_checkpoint_from, load_model

    checkpoint = load_checkpoint_from(path)  # read and verified once, for the model and the record
    model, _, tokenizer = load_model(checkpoint, map_location=device)
    saved = checkpoint.config
    info = {
        "checkpoint": str(path),
        "model_config": model.config.to_dict(),
        "parameters": model.num_parameters(),
    }
    info["tokenizer"] = saved.get("tokenizer")
    if "task_training" in saved:
        info["training"] = saved["task_training"]
    return model, tokenizer, info


def obtain_model(args: argparse.Namespace, task_cfg_factory) -> tuple[Any, Any, dict]:
    """(model, tokenizer, info): the ``--checkpoint`` model or a fresh one, trained with the recipe first
    when ``--train-recipe`` is given (a checkpoint is then fine-tuned: the paper's fine-tuning setup)."""
    if not args.checkpoint and not args.train_recipe:
        raise ValueError("give --checkpoint (a model to evaluate or fine-tune) and/or --train-recipe")
    if args.checkpoint:
        fresh_only = [
            flag
            for flag, value in (
                ("--set", args.set),
                ("--memory-alpha-init", args.memory_alpha_init),
                ("--memory-eta-init", args.memory_eta_init),
            )
            if value is not None
        ]
        if fresh_only:
            raise ValueError(
                f"{', '.join(fresh_only)} configure a fresh model, but --checkpoint {args.checkpoint} brings "
                "its own config: drop them, or train a fresh model (--train-recipe without --checkpoint)"
            )
        model, tokenizer, info = load_task_model(args.checkpoint, args.device)
        if not args.train_recipe:
            return model, tokenizer, info
    else:
        from titans.data.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        model = build_model(args, args.variant, tokenizer.vocab_size)
        info = {"model_config": model.config.to_dict(), "parameters": model.num_parameters()}
    summary = train_with_recipe(args, model, tokenizer, task_cfg_factory())
    if args.checkpoint:
        summary["fine_tuned_from"] = str(args.checkpoint)
        summary["earlier"] = info.get("training")
    info["training"] = summary
    if args.save_model:
        saved = save_task_model(args.save_model, model, tokenizer, args, summary, info.get("tokenizer"))
        info["saved"] = str(saved)
        print(f"saved the trained model to {info['saved']}")
    return model, tokenizer, info


def add_source_args(p: argparse.ArgumentParser, default_length: int) -> None:
    p.add_argument("--checkpoint", help="a trainer checkpoint or run folder to evaluate (or fine-tune)")
    p.add_argument(
        "--train-recipe",
        action="store_true",
        help="train with the fine-tuning recipe first: the --checkpoint model, else a fresh one",
    )
    p.add_argument("--variant", default="mac", help="variant of a fresh model")
    p.add_argument("--save-model", default=None, help="save the recipe-trained model here (a run folder)")
    add_model_args(p)
    add_recipe_args(p, default_length=default_length)


def output_paths(args: argparse.Namespace, task: str, default_name: str) -> tuple[Path, Path]:
    out = Path(args.out or f"results/evals/{task}")
    name = args.name or default_name
    return out / f"{name}.json", out / f"{name}.png"


# options that only shape a fresh model: a checkpoint brings its own, so they are left out of its record
_FRESH_MODEL_OPTIONS = ("variant", "preset", "set", "tokenizer", "memory_alpha_init", "memory_eta_init")


def command_line(args: argparse.Namespace) -> dict:
    """The options of this run, for its result file (without defaults that did not apply)."""
    skip = {"func", "check"}
    if getattr(args, "checkpoint", None):
        skip.update(_FRESH_MODEL_OPTIONS)
    return {k: v for k, v in vars(args).items() if k not in skip}


def report_table(json_path: Path, png_path: Path, table: AccuracyTable, title: str, **metadata) -> None:
    """Every evaluation's ending: the JSON (table + metadata), the heat map, and the table on stdout."""
    write_results(json_path, table, **metadata)
    plot_heatmap(table, png_path, title=title)
    print(title)
    print(format_table(table))
    print(f"wrote {json_path} and {png_path}")


def fits_attention(model_config, length: int, max_attention_length: int) -> bool:
    """False for full attention (the transformer baseline) past ``max_attention_length`` tokens."""
    return not (model_config.variant == "transformer" and length > max_attention_length)


def _progress(label: str):
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total} samples  {time.perf_counter() - start:.0f}s", end="", flush=True)
        if done == total:
            print()

    return report


def evaluate_lengths(model, tokenizer, samples, *, by: str, args, label: str) -> tuple[Any, list, list]:
    """Evaluate the samples whose length the model can take; returns (result or None, kept, skipped)."""
    from titans.evaluation.runner import evaluate

    kept = [s for s in samples if fits_attention(model.config, s.length, args.max_attention_length)]
    skipped = sorted({s.length for s in samples} - {s.length for s in kept})
    if skipped:
        print(f"{label}: skipping lengths {skipped} (full attention beyond --max-attention-length)")
    if not kept:
        return None, kept, skipped
    result = evaluate(
        model,
        tokenizer,
        kept,
        by=by,
        batch_size=args.eval_batch_size,
        prefill_chunk=args.prefill_chunk,
        progress=_progress(label),
    )
    return result, kept, skipped


# ---------------------------------------------------------------------------------------------------------
# titans eval niah


def niah_samples(tokenizer, args, lengths: list[int]):
    from titans.evaluation.niah import niah_grid

    return niah_grid(
        tokenizer,
        lengths,
        args.depths,
        kind=args.kind,
        haystack=args.haystack,
        samples_per_cell=args.samples,
        seed=args.seed,
    )


def run_niah(args: argparse.Namespace) -> int:
    set_threads(args)
    model, tokenizer, info = obtain_model(
        args, lambda: task_config(args, "niah", kind=args.kind, haystack=args.haystack)
    )
    samples = niah_samples(tokenizer, args, args.lengths)
    result, kept, skipped = evaluate_lengths(model, tokenizer, samples, by="depth", args=args, label="niah")
    if result is None:
        raise ValueError("every requested length was skipped: nothing to evaluate")
    variant = model.config.variant
    json_path, png_path = output_paths(args, "niah", f"niah_{args.kind}_{variant}")
    haystack = samples[0].haystack
    title = f"{variant}, {args.kind} in {haystack}: {100 * result.table.overall:.1f}%"
    report_table(
        json_path,
        png_path,
        result.table,
        title,
        task="niah",
        kind=args.kind,
        haystack=haystack,
        variant=variant,
        skipped_lengths=skipped,
        eval_seconds=result.seconds,
        model=info,
        samples=result.records(kept, "depth"),
        command=command_line(args),
    )
    return 0


def add_niah_parser(evals) -> None:
    from titans.evaluation.haystack import HAYSTACK_NAMES
    from titans.evaluation.niah import NEEDLE_KINDS

    p = evals.add_parser("niah", help="single needle in a haystack (RULER S-NIAH, paper Table 2)")
    add_source_args(p, default_length=1024)
    p.add_argument("--kind", default="passkey", choices=tuple(NEEDLE_KINDS), help="what the needle is")
    p.add_argument("--lengths", type=int_list, default=[1024, 4096, 16384], help="context lengths")
    p.add_argument("--depths", type=float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths")
    p.add_argument(
        "--haystack", default=None, choices=HAYSTACK_NAMES, help="default: noise (passkey), essays (others)"
    )
    add_eval_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run_niah)


# ---------------------------------------------------------------------------------------------------------
# titans eval babilong


def babilong_samples(tokenizer, args, lengths: list[int]):
    from titans.evaluation.babilong import babilong_grid

    return babilong_grid(
        tokenizer,
        lengths,
        args.tasks,
        haystack=args.haystack,
        samples_per_cell=args.samples,
        seed=args.seed,
        num_facts=args.num_facts,
    )


def run_babilong(args: argparse.Namespace) -> int:
    set_threads(args)
    model, tokenizer, info = obtain_model(
        args,
        lambda: task_config(
            args, "babilong", babi_tasks=tuple(args.tasks), haystack=args.haystack, num_facts=args.num_facts
        ),
    )
    samples = babilong_samples(tokenizer, args, args.lengths)
    result, kept, skipped = evaluate_lengths(
        model, tokenizer, samples, by="task", args=args, label="babilong"
    )
    if result is None:
        raise ValueError("every requested length was skipped: nothing to evaluate")
    variant = model.config.variant
    json_path, png_path = output_paths(args, "babilong", f"babilong_{'_'.join(args.tasks)}_{variant}")
    title = f"{variant}, BABILong: {100 * result.table.overall:.1f}%"
    report_table(
        json_path,
        png_path,
        result.table,
        title,
        task="babilong",
        tasks=args.tasks,
        haystack=args.haystack,
        variant=variant,
        skipped_lengths=skipped,
        eval_seconds=result.seconds,
        model=info,
        samples=result.records(kept, "task"),
        command=command_line(args),
    )
    return 0


def add_babilong_parser(evals) -> None:
    from titans.evaluation.babilong import TASKS
    from titans.evaluation.haystack import HAYSTACK_NAMES

    p = evals.add_parser("babilong", help="bAbI facts in long prose (BABILong, paper Figure 6)")
    add_source_args(p, default_length=1024)
    p.add_argument("--tasks", type=str_list, default=["qa1", "qa2"], help=f"subset of {','.join(TASKS)}")
    p.add_argument("--lengths", type=int_list, default=[1024, 4096, 16384], help="context lengths")
    p.add_argument(
        "--haystack", default="moby_dick", choices=HAYSTACK_NAMES, help="the prose the facts hide in"
    )
    p.add_argument("--num-facts", type=int, default=None, help="facts per story (default: per task)")
    add_eval_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run_babilong)


# ---------------------------------------------------------------------------------------------------------
# titans eval tasks: several variants, one recipe


def run_tasks(args: argparse.Namespace) -> int:
    from titans.data.tokenizers import load_tokenizer

    set_threads(args)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.eval_task == "niah":
        task_cfg = task_config(args, "niah", kind=args.kind, haystack=args.haystack)
        samples = niah_samples(tokenizer, args, args.eval_lengths)
        by = "depth"
    else:
        haystack = args.haystack or "moby_dick"
        task_cfg = task_config(
            args, "babilong", babi_tasks=tuple(args.tasks), haystack=haystack, num_facts=args.num_facts
        )
        args.haystack = haystack
        samples = babilong_samples(tokenizer, args, args.eval_lengths)
        by = "task"
    combined = AccuracyTable(row_name="length", col_name="variant")
    per_variant: dict[str, dict] = {}
    for variant in args.variants:
        if args.from_models:
            model, model_tokenizer, entry = load_task_model(Path(args.from_models) / variant, args.device)
            if model.config.variant != variant:
                raise ValueError(f"{args.from_models}/{variant} holds a {model.config.variant} model")
            if model_tokenizer.vocab_size != tokenizer.vocab_size:
                raise ValueError(f"{args.from_models}/{variant} was trained with another tokenizer")
            print(f"=== {variant}: loaded from {entry['checkpoint']}")
        else:
            print(f"=== {variant}: training {task_cfg.steps} steps at <= {task_cfg.train_length} tokens")
            model = build_model(args, variant, tokenizer.vocab_size)
            summary = train_with_recipe(args, model, tokenizer, task_cfg)
            entry = {"parameters": model.num_parameters(), "model_config": model.config.to_dict()}
            entry["training"] = summary
            if args.save_models:
                entry["saved"] = str(
                    save_task_model(Path(args.save_models) / variant, model, tokenizer, args, summary)
                )
        result, kept, skipped = evaluate_lengths(model, tokenizer, samples, by=by, args=args, label=variant)
        entry["skipped_lengths"] = skipped
        if result is not None:
            for s, ok in zip(kept, result.correct):
                combined.add(s.length, variant, ok)
            entry.update(
                table=result.table.to_dict(),
                eval_seconds=result.seconds,
                samples=result.records(kept, by),
            )
            print(format_table(result.table))
        per_variant[variant] = entry
    if not combined.counts:
        raise ValueError("every evaluation was skipped: nothing to report")
    name = f"tasks_{args.eval_task}_{'_'.join(args.variants)}"
    json_path, png_path = output_paths(args, "tasks", name)
    source = (
        f"models from {args.from_models}"
        if args.from_models
        else f"trained at <= {task_cfg.train_length} tokens"
    )
    for variant, entry in per_variant.items():
        if entry["skipped_lengths"]:
            print(f"  {variant}: not evaluated at {entry['skipped_lengths']} (marked '-')")
    report_table(
        json_path,
        png_path,
        combined,
        f"{args.eval_task}: accuracy by variant ({source})",
        task=args.eval_task,
        variants=per_variant,
        recipe=None if args.from_models else task_cfg.to_dict(),
        command=command_line(args),
    )
    return 0


def add_tasks_parser(evals) -> None:
    from titans.evaluation.haystack import HAYSTACK_NAMES
    from titans.evaluation.niah import NEEDLE_KINDS
    from titans.models.config import VARIANTS

    p = evals.add_parser("tasks", help="fine-tune each variant on a task at short length, evaluate longer")
    p.add_argument(
        "--task",
        dest="eval_task",
        choices=("niah", "babilong"),
        default="niah",
        help="the task to train and evaluate",
    )
    p.add_argument(
        "--variants", type=str_list, default=["mac", "lmm", "swa"], help=f"subset of {','.join(VARIANTS)}"
    )
    p.add_argument(
        "--eval-lengths", type=int_list, default=[1024, 4096, 16384], help="evaluation context lengths"
    )
    p.add_argument("--kind", default="passkey", choices=tuple(NEEDLE_KINDS), help="niah needle kind")
    p.add_argument("--depths", type=float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="niah depths")
    p.add_argument("--tasks", type=str_list, default=["qa1", "qa2"], help="babilong tasks")
    p.add_argument("--num-facts", type=int, default=None, help="babilong facts per story")
    p.add_argument(
        "--haystack",
        default=None,
        choices=HAYSTACK_NAMES,
        help="default: noise (passkey), essays (other niah), moby_dick",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--save-models", default=None, help="save each trained model as FOLDER/<variant>")
    src.add_argument(
        "--from-models",
        default=None,
        help="evaluate models saved by --save-models (FOLDER/<variant>): no training",
    )
    add_model_args(p)
    add_recipe_args(p, default_length=1024)
    add_eval_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run_tasks)


# ---------------------------------------------------------------------------------------------------------
# Registration.


def register(commands, evals) -> None:
    """Add ``niah``, ``babilong``, ``tasks``, ``ablate`` and ``depth`` to ``titans eval``."""
    from titans.evaluation import ablation, depth_study

    add_niah_parser(evals)
    add_babilong_parser(evals)
    add_tasks_parser(evals)
    ablation.add_parser(evals)
    depth_study.add_parser(evals)
