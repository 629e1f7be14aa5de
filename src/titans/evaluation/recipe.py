"""What the task commands (`eval niah | babilong | tasks | ablate`) build from their options.

The fine-tuning recipe (``task_config``: a ``TaskTrainConfig`` from the recipe options;
``train_with_recipe``), the model (``build_model``: a fresh one; ``obtain_model``: a checkpoint's or a fresh
one, trained with the recipe first when asked), recipe-trained models as trainer checkpoints
(``save_task_model``, ``load_task_model``), and the evaluation samples with the model run on them
(``niah_samples``, ``babilong_samples``, ``evaluate_lengths``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from titans.data.tokenizers import load_tokenizer
from titans.evaluation.args import model_overrides
from titans.evaluation.babilong import babilong_grid
from titans.evaluation.niah import niah_grid
from titans.evaluation.runner import evaluate
from titans.evaluation.task_training import TaskTrainConfig, train_on_task
from titans.models import TitansConfig, TitansLM
from titans.models.config import PRESETS
from titans.runtime.checkpoint import save_checkpoint
from titans.runtime.loading import load_checkpoint_from, tokenizer_record
from titans.training.config import TrainConfig
from titans.training.model_io import load_model

# ---------------------------------------------------------------------------------------------------------
# The recipe and the model.


def task_config(args: argparse.Namespace, task: str, **task_fields: Any) -> TaskTrainConfig:
    """The recipe options (``add_recipe_args``) and ``--seed`` as a ``TaskTrainConfig`` for ``task``."""
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
        hold_lr=args.hold_lr,
        lm_loss_weight=args.lm_loss_weight,
        seed=args.seed,
        **task_fields,
    )


def build_model(args: argparse.Namespace, variant: str, vocab_size: int, overrides: dict | None = None):
    """A fresh TitansLM (seeded by ``--seed``): ``--preset``, ``variant``, ``--set`` and the gate inits
    (``model_overrides``), and then ``overrides`` (TitansConfig fields)."""
    overrides = {**model_overrides(args), **(overrides or {})}
    overrides.setdefault("vocab_size", vocab_size)
    torch.manual_seed(args.seed)
    return TitansLM(TitansConfig.preset(args.preset, variant=variant, **overrides)).to(args.device)


def train_with_recipe(args: argparse.Namespace, model, tokenizer, task_cfg) -> dict:
    """Train ``model`` in place; returns a JSON-able summary (the recipe, the last log line, the time)."""
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


# ---------------------------------------------------------------------------------------------------------
# The evaluation samples, and the model run on them.


def niah_samples(tokenizer, args, lengths: list[int]):
    return niah_grid(
        tokenizer,
        lengths,
        args.depths,
        kind=args.kind,
        haystack=args.haystack,
        samples_per_cell=args.samples,
        seed=args.seed,
    )


def babilong_samples(tokenizer, args, lengths: list[int]):
    return babilong_grid(
        tokenizer,
        lengths,
        args.tasks,
        haystack=args.haystack,
        samples_per_cell=args.samples,
        seed=args.seed,
        num_facts=args.num_facts,
    )


def fits_attention(model_config, length: int, max_attention_length: int) -> bool:
    """False for a variant with full (quadratic) attention, the transformer baseline, past
    ``max_attention_length`` tokens."""
    return not (model_config.spec.quadratic and length > max_attention_length)


def _progress(label: str):
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total} samples  {time.perf_counter() - start:.0f}s", end="", flush=True)
        if done == total:
            print()

    return report


def evaluate_lengths(model, tokenizer, samples, *, by: str, args, label: str) -> tuple[Any, list, list]:
    """Evaluate the samples whose length the model can take; returns (result or None, kept, skipped)."""
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
