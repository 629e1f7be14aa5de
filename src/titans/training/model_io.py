"""A trained model back from a checkpoint together with the ``TrainConfig`` it was trained with.

    model, train_config, tokenizer = load_model("runs/main")           # newest good checkpoint of a run
    model, train_config, tokenizer = load_model("runs/main/checkpoints/step_00001000", map_location="cuda")

The model and tokenizer come from ``titans.runtime.loading.load_trained`` (which inference and serving use
on their own); this module adds the run's training config.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from titans.data.tokenizers import Tokenizer
from titans.models.lm import TitansLM
from titans.runtime.checkpoint import Checkpoint
from titans.runtime.loading import checkpoint_of, load_trained
from titans.training.config import TrainConfig

log = logging.getLogger(__name__)


def train_config_from_saved(data: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from a checkpoint, ignoring (with a warning) fields this version does not know."""
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        log.warning("checkpoint config has fields this version does not know, ignored: %s", unknown)
    return TrainConfig.from_dict({k: v for k, v in data.items() if k in known})


def load_model(
    checkpoint_or_run_dir: str | Path | Checkpoint, map_location: str | torch.device = "cpu"
) -> tuple[TitansLM, TrainConfig, Tokenizer]:
    """(model in eval mode on ``map_location``, its TrainConfig, its tokenizer) from a checkpoint: a
    folder as ``resolve_checkpoint`` takes, or one already loaded (``load_checkpoint_from``)."""
    ckpt = checkpoint_of(checkpoint_or_run_dir)
    train_config = train_config_from_saved(ckpt.config["train"])
    model, tokenizer = load_trained(ckpt, map_location)
    return model, train_config, tokenizer


__all__ = ["load_model", "train_config_from_saved"]
