"""The options the evaluation commands share, and their argument types.

``add_runtime_args`` (output, threads, device, seed), ``add_model_args`` (a fresh model: preset, ``--set``,
tokenizer, gate inits), ``add_recipe_args`` (the fine-tuning recipe, ``TaskTrainConfig``),
``add_eval_args`` (samples and decoding), ``add_source_args`` (``--checkpoint`` and/or ``--train-recipe``);
``int_list`` / ``float_list`` / ``str_list`` / ``haystack_list`` parse comma-separated values.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from titans.data.tokenizers import TOKENIZER_HELP
from titans.evaluation.haystack import HAYSTACK_NAMES
from titans.runtime.device import resolve_device, set_cpu_threads
from titans.runtime.loading import DEFAULT_TOKENIZER
from titans.training.config import parse_set
from titans.validation import path_arg, seed_arg


def _number_list(text: str, cast, plural: str, singular: str) -> list:
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated {plural}, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one {singular}")
    return values


def int_list(text: str) -> list[int]:
    return _number_list(text, int, "integers", "integer")


def positive_int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 (lengths, sizes: 0 measured an empty window as 0 tokens/s)."""
    values = int_list(text)
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    return _number_list(text, float, "numbers", "number")


def file_stem(text: str) -> str:
    """`--name`: a file name without a folder ("../x" wrote outside --out; "" meant the default silently)."""
    if not text.strip() or "/" in text or "\\" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"expected a file name without a folder (see --out), got {text!r}")
    return text


def _int_at_least(text: str, minimum: int, want: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _finite(text: str, ok, want: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):  # NaN compares false: "nan" would pass a bare bound
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _finite(text, lambda v: v > 0, "a finite number > 0")


def nonnegative_float(text: str) -> float:
    return _finite(text, lambda v: v >= 0, "a finite number >= 0")


def str_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one name")
    return values


def haystack_list(text: str) -> list[str]:
    values = str_list(text)
    unknown = [v for v in values if v not in HAYSTACK_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown haystack {', '.join(unknown)}: use names from {HAYSTACK_NAMES}"
        )
    return values


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=path_arg,
        default=None,
        help="folder for the JSON and PNG (default results/evals/<task>)",
    )
    p.add_argument(
        "--name",
        type=file_stem,
        default=None,
        help="file name stem of the results (default from the settings)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is best on a busy machine)"
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."
    )
    p.add_argument(
        "--seed", type=seed_arg, default=0, help="seed of the fresh model, the training and the samples"
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
    p.add_argument(
        "--tokenizer", default=DEFAULT_TOKENIZER, help=f"tokenizer of a fresh model: {TOKENIZER_HELP}"
    )
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
        type=positive_float,
        default=None,
        help="adaptive curriculum: grow lengths by 25%% whenever the running answer loss is below this",
    )
    g.add_argument(
        steps_flag, dest="steps", type=nonnegative_int, default=default_steps, help="fine-tuning steps"
    )
    g.add_argument("--batch-size", type=int, default=8, help="fine-tuning batch")
    g.add_argument("--lr", type=positive_float, default=3e-3, help="fine-tuning peak learning rate")
    g.add_argument("--warmup-steps", type=nonnegative_int, default=20, help="fine-tuning warm-up steps")
    g.add_argument(
        "--hold-lr",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep the peak learning rate until the curriculum reaches --train-length, then decay (cosine) "
        "over the remaining steps (off by default; --no-hold-lr: the plain cosine, a later flag wins)",
    )
    g.add_argument(
        "--lm-loss-weight", type=nonnegative_float, default=0.0, help="add the LM loss of all tokens x this"
    )
    g.add_argument(
        "--train-haystack",
        type=haystack_list,
        default=None,
        metavar="NAMES",
        help="haystacks to train on, comma-separated, mixed evenly in every batch (default: --haystack's)",
    )
    g.add_argument(
        "--train-distractors",
        type=nonnegative_float,
        default=0.0,
        metavar="PER_1K",
        help="pass-key training: decoy numbers per 1,000 haystack tokens (half of them the key with a digit "
        "or two changed), to keep the key apart from a haystack's own numbers",
    )
    g.add_argument(
        "--time-budget", type=positive_float, default=None, metavar="MINUTES", help="stop training early"
    )


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=positive_int, default=4, help="samples per table cell")
    p.add_argument("--eval-batch-size", type=positive_int, default=8, help="prompts decoded together")
    p.add_argument("--prefill-chunk", type=positive_int, default=2048, help="prompt tokens per forward call")
    p.add_argument(
        "--max-attention-length",
        type=int,
        default=16384,
        help="skip full-attention (transformer) evaluations longer than this (quadratic time)",
    )


def set_threads(args: argparse.Namespace) -> None:
    """The runtime options of every evaluation command: ``--threads``, and ``--device auto`` resolved."""
    set_cpu_threads(args.threads)
    args.device = str(resolve_device(args.device))


def add_source_args(p: argparse.ArgumentParser, default_length: int) -> None:
    p.add_argument(
        "--checkpoint", type=path_arg, help="a trainer checkpoint or run folder to evaluate (or fine-tune)"
    )
    p.add_argument(
        "--train-recipe",
        action="store_true",
        help="train with the fine-tuning recipe first: the --checkpoint model, else a fresh one",
    )
    p.add_argument("--variant", default="mac", help="variant of a fresh model")
    p.add_argument(
        "--save-model", type=path_arg, default=None, help="save the recipe-trained model here (a run folder)"
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="with --save-model: also save the model every STEPS training steps (with --save-model, a "
        "SIGTERM or Ctrl-C during training saves the model trained so far and ends the command)",
    )
    add_model_args(p)
    add_recipe_args(p, default_length=default_length)
