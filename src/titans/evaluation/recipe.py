"""What the task commands (`eval niah | babilong | tasks | ablate`) build from their options.

Each variant's pass-key recipe (``RECIPES``, ``variant_recipe``: the options of ``titans eval niah
--train-recipe`` that train it; ``benchmarks/niah_seeds.py`` runs them over seeds), the fine-tuning recipe
(``task_config``: a ``TaskTrainConfig`` from the recipe options; ``train_with_recipe``), the model
(``build_model``: a fresh one; ``obtain_model``: a checkpoint's or a fresh one, trained with the recipe
first when asked), recipe-trained models as trainer checkpoints (``save_task_model``, ``load_task_model``),
and the evaluation samples with the model run on them (``niah_samples``, ``babilong_samples``,
``evaluate_lengths``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titans.data.tokenizers import load_tokenizer
from titans.evaluation.args import model_overrides
from titans.evaluation.babilong import babilong_grid
from titans.evaluation.niah import niah_grid
from titans.evaluation.runner import evaluate
from titans.evaluation.task_training import TaskTrainConfig, check_train_length, train_on_task
from titans.models import TitansConfig, TitansLM
from titans.models.config import PRESETS
from titans.runtime.checkpoint import META_FILE, list_checkpoints, save_checkpoint
from titans.runtime.loading import load_checkpoint_from, tokenizer_record
from titans.training.config import TrainConfig
from titans.training.model_io import load_model
from titans.training.signals import exit_status

# ---------------------------------------------------------------------------------------------------------
# Each variant's pass-key recipe, as options of `titans eval niah --train-recipe`.

# The pass-key recipe (docs/evaluations.md): a memory without forgetting, a conv of 8 on q/k/v, the inner
# learning rate bounded, lengths <= 1,024 grown by the adaptive curriculum, a little LM loss.
BASE_RECIPE = (
    "--set memory_conv_kernel=8 --set memory_max_lr=0.03 --set memory_theta_init=0.002 "
    "--set memory_forgetting=false --train-length 1024 --start-length 320 --curriculum 0.5 "
    "--curriculum-loss 0.3 --steps 800 --batch-size 8 --lr 0.003 --warmup-steps 20 --lm-loss-weight 0.1"
)
# Full attention needs its own recipe (docs/evaluations.md, "Transformer++"): the linear length ramp (the
# adaptive one keeps it at <= 500 tokens, where its loss never stays under the threshold), lr 1e-3 and more
# steps; it solves the task at <= 1,024 tokens after 1,500 to 3,200 steps, depending on the seed.
TRANSFORMER_RECIPE = (
    "--train-length 1024 --start-length 320 --curriculum 0.5 --steps 5000 --batch-size 8 --lr 0.001 "
    "--warmup-steps 50 --lm-loss-weight 0.1"
)
# Each variant's recipe: the base recipe with the variant's changes appended (a later flag wins).
RECIPES: dict[str, str] = {
    "lmm": BASE_RECIPE,
    # MAC learns later than the LMM, at a step that varies by seed (about 650 to 1,000): 1,500 steps, and the
    # peak learning rate held until the curriculum reaches 1,024 tokens (on the plain cosine the latest
    # seed met the longer lengths on a decayed rate and stalled). Its default gate ("norm"); the "open"
    # gate passes the answer's gradient to the memory scaled by the attention output, about 20x less at
    # initialisation, and two seeds of three did not learn with it.
    "mac": BASE_RECIPE + " --steps 1500 --hold-lr",
    "mag": BASE_RECIPE,
    "mal": BASE_RECIPE,
    "swa": BASE_RECIPE,
    "transformer": TRANSFORMER_RECIPE,
}


def variant_recipe(variant: str) -> list[str]:
    """The recipe options of ``variant`` as command-line arguments of ``titans eval niah --train-recipe``
    (the base recipe for a variant without its own)."""
    return shlex.split(RECIPES.get(variant, BASE_RECIPE))


# ---------------------------------------------------------------------------------------------------------
# The recipe and the model.


def task_config(args: argparse.Namespace, task: str, **task_fields: Any) -> TaskTrainConfig:
    """The recipe options (``add_recipe_args``) and ``--seed`` as a ``TaskTrainConfig`` for ``task``;
    ``--train-haystack``, when given, replaces the ``haystack`` of ``task_fields``."""
    if args.train_haystack:
        task_fields["haystack"] = tuple(args.train_haystack)
    if args.train_distractors:
        task_fields["distractors"] = args.train_distractors
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


def train_with_recipe(
    args: argparse.Namespace,
    model,
    tokenizer,
    task_cfg,
    checkpoint: Callable[[int, list[dict]], object] | None = None,
) -> dict:
    """Train ``model`` in place; returns a JSON-able summary (the recipe, the last log line, the time).
    ``checkpoint(step, history)``: saves the model every ``--ckpt-every`` steps and at the end; with it a
    SIGTERM / SIGINT stops training after the current step (the summary's ``final`` says ``stopped_by``)."""
    budget = None if args.time_budget is None else 60.0 * args.time_budget
    t0 = time.perf_counter()
    history = train_on_task(
        model,
        tokenizer,
        task_cfg,
        max_seconds=budget,
        handle_signals=checkpoint is not None,
        checkpoint=checkpoint,
        ckpt_every=getattr(args, "ckpt_every", None),
    )
    return {**_summary(task_cfg, history), "seconds": time.perf_counter() - t0}


def _summary(task_cfg, history: list[dict]) -> dict:
    return {
        "recipe": task_cfg.to_dict(),
        "steps_done": history[-1]["step"] if history else 0,
        "final": history[-1] if history else None,
        "history": history,
    }


def _recipe_checkpoint(path: Path) -> bool:
    """Whether a checkpoint was written by ``save_task_model`` (its config records the recipe)."""
    try:
        return "task_training" in json.loads((path / META_FILE).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def check_save_folder(path: str | Path, flag: str = "--save-model", note: bool = True) -> None:
    """Before training into ``path``: an earlier recipe run's model there is replaced once this run saves
    its own (``note``: say so); checkpoints of any other kind (a ``titans train`` run's) are refused, as
    replacing would delete them."""
    existing = list_checkpoints(path)
    foreign = [p.name for p in existing if not _recipe_checkpoint(p)]
    if foreign:
        raise ValueError(
            f"{flag} {path} holds checkpoints that no recipe run saved ({', '.join(foreign)}; a `titans "
            "train` run's?): saving there would delete them; choose another folder"
        )
    if existing and note:
        print(
            f"note: {flag} {path} holds the model of an earlier run ({existing[-1].name}); this run's model "
            "replaces it once saved"
        )


def save_task_model(
    path: str | Path,
    model,
    tokenizer,
    args: argparse.Namespace,
    summary: dict,
    tokenizer_info: dict | None = None,
) -> Path:
    """Save a recipe-trained model as a trainer checkpoint (``model_io.load_model`` reads it back), then
    delete every other checkpoint in ``path``: the folder holds, and loads, exactly this model. (An earlier
    run's model at a later step would otherwise be the one it loads.)"""
    cfg = model.config
    preset = cfg.name if cfg.name in PRESETS else "tiny"
    train_cfg = TrainConfig(
        preset=preset,
        variant=cfg.variant,
        model={k: v for k, v in cfg.to_dict().items() if k not in ("name", "variant")},
        tokenizer=args.tokenizer,
        seq_len=summary["recipe"]["train_length"],  # the length it trained up to (`eval context` marks it)
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
    saved = save_checkpoint(
        path, summary["steps_done"], model_state=state, trainer_state={}, config=config, keep_last=1
    )
    for other in list_checkpoints(path):  # only once this one is safely written
        if other != saved:
            shutil.rmtree(other)
    return saved


def load_task_model(path: str | Path, device: str) -> tuple[Any, Any, dict]:
    """(model, tokenizer, info) from a checkpoint; ``info`` carries the recipe it was trained with, if any."""
    checkpoint = load_checkpoint_from(path)  # read and verified once, for the model and the record
    model, _, tokenizer = load_model(checkpoint, map_location=device)
    saved = checkpoint.config
    info = {
        "checkpoint": str(checkpoint.path),  # the step folder scored, not the run folder as typed
        "step": checkpoint.step,
        "weights": checkpoint.weights_id,
        "model_config": model.config.to_dict(),
        "parameters": model.num_parameters(),
    }
    info["tokenizer"] = saved.get("tokenizer")
    if "task_training" in saved:
        info["training"] = saved["task_training"]
    return model, tokenizer, info


def obtain_model(
    args: argparse.Namespace, task_cfg_factory, draw_samples: Callable[[Any], list]
) -> tuple[Any, Any, dict, list]:
    """(model, tokenizer, info, samples): the ``--checkpoint`` model or a fresh one, trained with the recipe
    first when ``--train-recipe`` is given (a checkpoint is then fine-tuned: the paper's fine-tuning setup),
    and the evaluation samples, ``draw_samples(tokenizer)``. Those are drawn, and the recipe's length
    checked, before any training: a length or depth they refuse ends the command before it trains."""
    if not args.checkpoint and not args.train_recipe:
        raise ValueError("give --checkpoint (a model to evaluate or fine-tune) and/or --train-recipe")
    if getattr(args, "ckpt_every", None) is not None and not (args.train_recipe and args.save_model):
        raise ValueError("--ckpt-every saves the model being trained: give --train-recipe and --save-model")
    if args.save_model and not args.train_recipe:  # nothing is trained, so nothing would be saved
        raise ValueError("--save-model saves the model the recipe trains: give --train-recipe")
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
            return model, tokenizer, info, draw_samples(tokenizer)
    else:
        tokenizer = load_tokenizer(args.tokenizer)
        model = build_model(args, args.variant, tokenizer.vocab_size)
        info = {"model_config": model.config.to_dict(), "parameters": model.num_parameters()}
    samples = draw_samples(tokenizer)
    task_cfg = task_cfg_factory()
    check_train_length(tokenizer, task_cfg)
    if args.save_model:
        check_save_folder(args.save_model)
    earlier = (
        {"fine_tuned_from": str(args.checkpoint), "earlier": info.get("training")} if args.checkpoint else {}
    )
    checkpoint = None
    if args.save_model:

        def checkpoint(step: int, history: list[dict]) -> None:  # the model so far, as --save-model
            summary = {**_summary(task_cfg, history), "steps_done": step, **earlier}
            save_task_model(args.save_model, model, tokenizer, args, summary, info.get("tokenizer"))

    summary = {**train_with_recipe(args, model, tokenizer, task_cfg, checkpoint), **earlier}
    info["training"] = summary
    if args.checkpoint:  # what is scored is that checkpoint fine-tuned: the model saved now, if any
        info["fine_tuned_from"] = info.pop("checkpoint")
        info["checkpoint"] = None
    if args.save_model:
        saved = save_task_model(args.save_model, model, tokenizer, args, summary, info.get("tokenizer"))
        info["saved"] = str(saved)
        if args.checkpoint:
            info["checkpoint"] = info["saved"]
        print(f"saved the trained model to {info['saved']}")
    stopped_by = (summary["final"] or {}).get("stopped_by")
    if stopped_by is not None:  # the model is saved; the evaluation is not what a stop asked for
        print(
            f"titans: stopped by {stopped_by} at step {summary['steps_done']}; the model trained so far is "
            f"saved to {info['saved']}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(exit_status(signal.Signals[stopped_by]))
    return model, tokenizer, info, samples


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


def babilong_samples(tokenizer, args, lengths: list[int], seed: int | None = None):
    """The BABILong evaluation samples, drawn with ``seed`` (default ``--seed``)."""
    return babilong_grid(
        tokenizer,
        lengths,
        args.tasks,
        haystack=args.haystack,
        samples_per_cell=args.samples,
        seed=args.seed if seed is None else seed,
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
