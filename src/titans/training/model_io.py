"""Build a model for a training config, and load a trained one back from a checkpoint.

    model, train_config, tokenizer = load_model("runs/main")           # newest good checkpoint of a run
    model, train_config, tokenizer = load_model("runs/main/checkpoints/step_00001000", map_location="cuda")

A checkpoint's ``meta.json`` config (written by the trainer) is
``{"train": TrainConfig dict, "model": TitansConfig dict, "tokenizer": {"spec", "name", "vocab_size",
"fingerprint"}}``. The model is rebuilt from the saved ``TitansConfig`` itself (not from the preset name),
so a checkpoint still loads if presets change later. A tokenizer given as a file is also copied into
``run_dir/tokenizer/`` at training time; loading falls back to that copy when the original path is gone.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from titans.data.tokenizers import Tokenizer, load_tokenizer
from titans.models.config import TitansConfig
from titans.models.lm import TitansLM
from titans.training.checkpoint import (
    META_FILE,
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
)
from titans.training.config import TrainConfig

log = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"


def tokenizer_record(spec: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a checkpoint stores about its tokenizer."""
    return {
        "spec": str(spec),
        "name": tokenizer.name,
        "vocab_size": int(tokenizer.vocab_size),
        "fingerprint": str(getattr(tokenizer, "fingerprint", "")),
    }


def keep_tokenizer_copy(spec: str, run_dir: str | Path) -> None:
    """Copy a file tokenizer into ``run_dir/tokenizer/`` so the run's checkpoints stay loadable."""
    path = Path(spec).expanduser()
    if path.is_file():
        dest = Path(run_dir) / TOKENIZER_DIR / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            shutil.copy2(path, dest)


def _locate_checkpoint(path: str | Path) -> tuple[Path, bool]:
    """(checkpoint folder, whether it was just verified: true when picked from a run by
    ``latest_checkpoint``, which hashes its files)."""
    path = Path(path).expanduser()
    if (path / META_FILE).is_file():
        return path, False
    run_dir = path.parent if path.name == "checkpoints" else path
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint or run folder at {str(path)!r}")
    found = latest_checkpoint(run_dir)
    if found is None:
        raise CheckpointError(f"{str(path)!r} holds no complete, undamaged checkpoint")
    return found, True


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a checkpoint folder, a run folder (its newest good checkpoint) or a
    run's ``checkpoints/`` folder."""
    return _locate_checkpoint(path)[0]


def load_checkpoint_from(path: str | Path) -> Checkpoint:
    """The checkpoint ``resolve_checkpoint(path)`` names, loaded on CPU; its files are hashed once."""
    folder, verified = _locate_checkpoint(path)
    return load_checkpoint(folder, map_location="cpu", verified=verified)


def train_config_from_saved(data: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from a checkpoint, ignoring (with a warning) fields this version does not know."""
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        log.warning("checkpoint config has fields this version does not know, ignored: %s", unknown)
    return TrainConfig.from_dict({k: v for k, v in data.items() if k in known})


def tokenizer_from_record(record: dict[str, Any], checkpoint: Path | None = None) -> Tokenizer:
    """Rebuild a checkpoint's tokenizer (from its spec, else from the run's copy) and check its vocabulary."""
    spec = record.get("spec", "bytes")
    try:
        tokenizer = load_tokenizer(spec)
    except FileNotFoundError:
        copy = checkpoint.parent.parent / TOKENIZER_DIR / Path(spec).name if checkpoint else None
        if copy is None or not copy.is_file():
            raise
        tokenizer = load_tokenizer(copy)
    want = record.get("fingerprint")
    have = str(getattr(tokenizer, "fingerprint", ""))
    if want and have and want != have:
        log.warning("tokenizer %r differs from the one the checkpoint was trained with", spec)
    if int(record.get("vocab_size", tokenizer.vocab_size)) != tokenizer.vocab_size:
        raise ValueError(
            f"tokenizer {spec!r} has {tokenizer.vocab_size} symbols; the checkpoint was trained with "
            f"{record['vocab_size']}"
        )
    return tokenizer


def load_weights(model: TitansLM, state: dict[str, torch.Tensor]) -> None:
    """Load weights strictly; a tied head may be absent from ``state`` (it is the embedding)."""
    state = dict(state)
    if model.config.tie_embeddings and "head.weight" not in state and "embed.weight" in state:
        state["head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True)
    if model.config.tie_embeddings:
        model.head.weight = model.embed.weight  # keep the tie whatever load_state_dict did


def load_model(
    checkpoint_or_run_dir: str | Path | Checkpoint, map_location: str | torch.device = "cpu"
) -> tuple[TitansLM, TrainConfig, Tokenizer]:
    """(model in eval mode on ``map_location``, its TrainConfig, its tokenizer) from a checkpoint: a
    folder as ``resolve_checkpoint`` takes, or one already loaded (``load_checkpoint_from``)."""
    if isinstance(checkpoint_or_run_dir, Checkpoint):
        ckpt = checkpoint_or_run_dir
    else:
        ckpt = load_checkpoint_from(checkpoint_or_run_dir)
    path, saved = ckpt.path, ckpt.config
    if not {"train", "model"} <= set(saved):
        raise CheckpointError(f"{str(path)!r} was not written by the titans trainer (no train/model config)")
    train_config = train_config_from_saved(saved["train"])
    tokenizer = tokenizer_from_record(saved.get("tokenizer") or {"spec": train_config.tokenizer}, path)
    model = TitansLM(TitansConfig.from_saved_dict(saved["model"]))
    load_weights(model, ckpt.model_state)
    return model.to(map_location).eval(), train_config, tokenizer
