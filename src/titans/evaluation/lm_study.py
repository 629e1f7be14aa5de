"""What the studies that train one language model per row share (`eval ablate`, `eval depth`).

Every row is trained by the project's ``Trainer`` with the same data, seed, steps and schedule; only its
model overrides differ. The rows' run folders go under ``--run-root`` or a temporary folder, and a study
ends with a JSON record, a figure and a plain-text table (``titans.evaluation.reporting.write_study``).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from titans.evaluation.args import nonnegative_int, positive_float, positive_int
from titans.runtime.checkpoint import list_checkpoints
from titans.training.config import TrainConfig
from titans.validation import path_arg


def add_lm_args(p: argparse.ArgumentParser, heldout_windows: int, lm_steps_help: str) -> None:
    """The language-model training options of a study; ``lm_steps_help`` says what ``--lm-steps`` means to
    it (whether 0 skips the LM stage or is refused)."""
    g = p.add_argument_group("language-model training (the Trainer)")
    g.add_argument("--data", default="builtin:prose", help="text source for the LM training")
    g.add_argument("--heldout-fraction", type=float, default=0.05, help="share of the documents held out")
    g.add_argument("--seq-len", type=positive_int, default=256, help="training length")
    g.add_argument("--lm-batch-size", type=positive_int, default=8, help="LM training batch")
    g.add_argument("--lm-steps", type=nonnegative_int, default=200, help=lm_steps_help)
    g.add_argument("--lm-lr", type=positive_float, default=3e-3, help="LM peak learning rate")
    g.add_argument("--lm-warmup-steps", type=nonnegative_int, default=20, help="LM warm-up steps")
    g.add_argument("--heldout-windows", type=positive_int, default=heldout_windows, help="held-out windows")
    g.add_argument(
        "--run-root", type=path_arg, default=None, help="keep each row's run folder here (default: temporary)"
    )


def lm_train_config(args: argparse.Namespace, run_dir: Path, overrides: dict[str, Any]) -> TrainConfig:
    """The Trainer config of one row: identical for every row except the model overrides."""
    return TrainConfig(
        preset=args.preset,
        variant=args.variant,
        model=overrides,
        data=args.data,
        tokenizer=args.tokenizer,
        heldout_fraction=args.heldout_fraction,
        seq_len=args.seq_len,
        batch_size=args.lm_batch_size,
        steps=args.lm_steps,
        lr=args.lm_lr,
        warmup_steps=min(args.lm_warmup_steps, args.lm_steps),
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        run_dir=str(run_dir),
        log_every=max(1, args.lm_steps // 10),
        eval_every=10**9,  # only the final evaluation
        eval_windows=args.heldout_windows,
        ckpt_every=10**9,
        keep_last=1,
        progress=False,
        tensorboard=False,
        plot=False,
        sample_tokens=0,
    )


@contextmanager
def run_root(args: argparse.Namespace, prefix: str, rows: list[str]) -> Iterator[Path]:
    """``--run-root`` if given (kept), else a temporary folder removed at the end. A ``--run-root`` that
    already holds a run of one of the ``rows`` (their folder names) is refused before any row trains."""
    if args.run_root is not None:
        taken = [row for row in rows if list_checkpoints(Path(args.run_root) / row)]
        if taken:
            raise ValueError(
                f"--run-root {args.run_root} already holds runs of {taken}: give an empty or new folder"
            )
        yield Path(args.run_root)
        return
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
