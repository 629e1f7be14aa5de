"""`titans eval ppl | context | niah | babilong | tasks | ablate | depth`: the evaluation commands.

``ppl`` scores held-out text (``perplexity``); ``context`` measures a checkpoint's loss against position
over long windows, beside its frozen-memory twin (``context``; JSON and PNG in the run folder). The others
are the paper's long-context evaluations, and each of them writes a JSON result file and a PNG next to it
(``--out``, default ``results/evals/<task>``) and prints its table. ``niah`` and ``babilong`` evaluate one
model, either a trained checkpoint (``--checkpoint``) or one trained first with the fine-tuning recipe
(``--train-recipe``, see ``task_training``); ``tasks`` trains and evaluates several variants on one task;
``ablate`` and ``depth`` are the paper's Table 5 and Figures 7-8 (see ``ablation`` and ``depth_study``).
docs/evaluations.md has the
commands that produced our results.

This module holds the ``niah``, ``babilong`` and ``tasks`` commands and registers them all; what they share
lives below it: their options (``args``), the models and samples they build (``recipe``) and their result
files (``reporting``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from titans.data.tokenizers import load_tokenizer
from titans.evaluation import ablation, context, depth_study
from titans.evaluation.args import (
    add_eval_args,
    add_model_args,
    add_recipe_args,
    add_runtime_args,
    add_source_args,
    float_list,
    int_list,
    set_threads,
    str_list,
)
from titans.evaluation.babilong import TASKS
from titans.evaluation.haystack import HAYSTACK_NAMES
from titans.evaluation.niah import NEEDLE_KINDS
from titans.evaluation.perplexity import add_ppl_parser
from titans.evaluation.recipe import (
    babilong_samples,
    build_model,
    check_save_folder,
    evaluate_lengths,
    load_task_model,
    niah_samples,
    obtain_model,
    save_task_model,
    task_config,
    train_with_recipe,
)
from titans.evaluation.reporting import command_line, output_paths, report_table
from titans.evaluation.scoring import AccuracyTable, format_table, write_json
from titans.evaluation.seeds import aggregate_tables, format_seed_table
from titans.models.config import VARIANTS
from titans.runtime.checkpoint import CheckpointError
from titans.runtime.loading import resolve_checkpoint, same_tokenizer
from titans.validation import check_distinct, path_arg, seed_list

# ---------------------------------------------------------------------------------------------------------
# titans eval niah


def run_niah(args: argparse.Namespace) -> int:
    set_threads(args)
    model, tokenizer, info, samples = obtain_model(
        args,
        lambda: task_config(args, "niah", kind=args.kind, haystack=args.haystack),
        lambda tokenizer: niah_samples(tokenizer, args, args.lengths),
    )
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


def run_babilong(args: argparse.Namespace) -> int:
    set_threads(args)
    if args.seeds:
        return _run_babilong_seeds(args)
    _babilong_once(args)
    return 0


def _babilong_once(
    args: argparse.Namespace,
    samples: list | None = None,
    sample_seed: int | None = None,
    name_suffix: str = "",
) -> tuple[Path, AccuracyTable, list, str]:
    """Obtain (train) one model, evaluate it on ``samples`` (default: drawn with ``sample_seed``, default
    ``--seed``), write its result file (``--name``, default after the tasks and the model's variant, then
    ``name_suffix``); returns (its path, its table, the samples, the model's variant)."""
    model, tokenizer, info, samples = obtain_model(
        args,
        lambda: task_config(
            args, "babilong", babi_tasks=tuple(args.tasks), haystack=args.haystack, num_facts=args.num_facts
        ),
        lambda tokenizer: (
            babilong_samples(tokenizer, args, args.lengths, seed=sample_seed) if samples is None else samples
        ),
    )
    result, kept, skipped = evaluate_lengths(
        model, tokenizer, samples, by="task", args=args, label="babilong"
    )
    if result is None:
        raise ValueError("every requested length was skipped: nothing to evaluate")
    variant = model.config.variant
    name = (args.name or f"babilong_{'_'.join(args.tasks)}_{variant}") + name_suffix
    json_path, png_path = output_paths(argparse.Namespace(out=args.out, name=name), "babilong", "")
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
        # with --seeds, the command's seed is this model's training seed; the stories are --seed's
        sample_seed=args.seed if sample_seed is None else sample_seed,
        samples=result.records(kept, "task"),
        # a seed of --seeds records the name its file got (<name>_seed<k>), as its own command would give
        command={**command_line(args), **({"name": name} if name_suffix else {})},
    )
    return json_path, result.table, samples, variant


def _run_babilong_seeds(args: argparse.Namespace) -> int:
    """``--seeds``: one model per seed (``--seed`` set to each), all evaluated on the samples drawn with
    the given ``--seed``; each seed's result file is ``<name>_seed<k>``, the summary ``<name>_seeds``
    (``<name>``: ``--name``, default after the tasks and the evaluated model's variant: the checkpoint's
    with ``--checkpoint``, else ``--variant``)."""
    if args.checkpoint and not args.train_recipe:
        raise ValueError("--seeds trains one model per seed: give --train-recipe")
    base = argparse.Namespace(**vars(args))
    if base.save_model:  # every seed's folder, before the first seed trains
        for seed in args.seeds:
            check_save_folder(f"{base.save_model}_seed{seed}", f"--save-model (seed {seed})", note=False)
    files, tables, samples, variant = [], [], None, args.variant
    for seed in args.seeds:
        run = argparse.Namespace(**vars(base))
        run.seed = seed
        if base.save_model:
            run.save_model = f"{base.save_model}_seed{seed}"
        print(f"=== seed {seed}")
        # the samples are drawn once, with --seed (run.seed is the training seed); the file is named after
        # the model's variant (a --checkpoint brings its own), known once it is loaded
        path, table, samples, variant = _babilong_once(
            run, samples, sample_seed=base.seed, name_suffix=f"_seed{seed}"
        )
        files.append(str(path))
        tables.append(table)
    stem = args.name or f"babilong_{'_'.join(args.tasks)}_{variant}"
    summary = aggregate_tables(args.seeds, tables)
    json_path, _ = output_paths(argparse.Namespace(out=args.out, name=f"{stem}_seeds"), "babilong", "")
    payload = {
        **summary,
        "task": "babilong",
        "tasks": args.tasks,
        "variant": variant,
        "sample_seed": args.seed,
    }
    payload.update(per_seed_files=files, command=command_line(args))
    write_json(json_path, payload)
    print(f"BABILong over seeds {args.seeds}: mean accuracy % [min-max]")
    print(format_seed_table(summary))
    print(f"wrote {json_path}")
    return 0


def add_babilong_parser(evals) -> None:
    p = evals.add_parser("babilong", help="bAbI facts in long prose (BABILong, paper Figure 6)")
    add_source_args(p, default_length=1024)
    p.add_argument("--tasks", type=str_list, default=["qa1", "qa2"], help=f"subset of {','.join(TASKS)}")
    p.add_argument("--lengths", type=int_list, default=[1024, 4096, 16384], help="context lengths")
    p.add_argument(
        "--haystack", default="moby_dick", choices=HAYSTACK_NAMES, help="the prose the facts hide in"
    )
    p.add_argument("--num-facts", type=int, default=None, help="facts per story (default: per task)")
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=None,
        help="train and evaluate one model per seed (with --train-recipe), then write mean and range",
    )
    add_eval_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run_babilong)


# ---------------------------------------------------------------------------------------------------------
# titans eval tasks: several variants, one recipe


def run_tasks(args: argparse.Namespace) -> int:
    set_threads(args)
    check_distinct("--variants", args.variants)  # one result per variant: a second would replace it
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
    for variant in args.variants:  # every folder checked before the first variant trains or is evaluated
        if args.from_models:
            try:  # as `load_task_model` will find it
                resolve_checkpoint(Path(args.from_models) / variant)
            except (OSError, CheckpointError) as e:
                raise ValueError(f"--from-models {args.from_models}: no {variant} model ({e})") from None
        if args.save_models:
            check_save_folder(Path(args.save_models) / variant, f"--save-models ({variant})")
    combined = AccuracyTable(row_name="length", col_name="variant")
    per_variant: dict[str, dict] = {}
    for variant in args.variants:
        if args.from_models:
            model, model_tokenizer, entry = load_task_model(Path(args.from_models) / variant, args.device)
            if model.config.variant != variant:
                raise ValueError(f"{args.from_models}/{variant} holds a {model.config.variant} model")
            if not same_tokenizer(model_tokenizer, tokenizer):  # the prompts are --tokenizer's ids
                raise ValueError(
                    f"{args.from_models}/{variant} was trained with tokenizer {model_tokenizer.name!r}, not "
                    f"--tokenizer {tokenizer.name!r} (or a file of that name with other contents): give "
                    "its tokenizer"
                )
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
    src.add_argument(
        "--save-models", type=path_arg, default=None, help="save each trained model as FOLDER/<variant>"
    )
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
# titans lm-eval: lm-eval's command line with the `titans` model type registered


def run_lm_eval(args: argparse.Namespace) -> int:
    # lm-eval is an optional extra (titans[lmeval]): imported only when this command runs
    from titans.evaluation.lm_eval_adapter import main

    return main(args.lm_eval_args)


def add_lm_eval_parser(commands) -> None:
    # every argument goes to lm-eval as it is: '+' as the prefix so that argparse reads none of them
    p = commands.add_parser(
        "lm-eval",
        help="lm-eval harness with the titans model type: titans lm-eval --model titans "
        "--model_args checkpoint=RUN --tasks ...",
        add_help=False,
        prefix_chars="+",
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments (lm-eval --help)")
    p.set_defaults(func=run_lm_eval)


# ---------------------------------------------------------------------------------------------------------
# Registration.


def register(commands, evals) -> None:
    """Add ``ppl``, ``context``, ``niah``, ``babilong``, ``tasks``, ``ablate`` and ``depth`` to
    ``titans eval``, and the ``titans lm-eval`` command."""
    add_lm_eval_parser(commands)
    add_ppl_parser(evals)
    context.add_parser(evals)
    add_niah_parser(evals)
    add_babilong_parser(evals)
    add_tasks_parser(evals)
    ablation.add_parser(evals)
    depth_study.add_parser(evals)
