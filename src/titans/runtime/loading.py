"""A trained model and its tokenizer back from a checkpoint, and what a checkpoint records about its
tokenizer.

    model, tokenizer = load_trained("runs/main")                           # newest good checkpoint of a run
    model, tokenizer = load_trained("runs/main/checkpoints/step_00001000", map_location="cuda")

A checkpoint's ``meta.json`` config (written by the trainer) is
``{"train": TrainConfig dict, "model": TitansConfig dict, "tokenizer": {"spec", "name", "vocab_size",
"fingerprint"}}``. The model is rebuilt from the saved ``TitansConfig`` itself (not from the preset name),
so a checkpoint still loads if presets change later. A tokenizer given as a file is also copied into
``run_dir/tokenizer/`` at training time; loading falls back to that copy when the original path is gone
or its contents have changed since (a tokenizer that differs, with no matching copy, is refused).
``titans.training.model_io.load_model`` adds the run's ``TrainConfig``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from titans.data.tokenizers import Tokenizer, load_tokenizer
from titans.models.config import TitansConfig
from titans.models.lm import TitansLM
from titans.runtime.checkpoint import (
    META_FILE,
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    run_folder_of,
)

log = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"
# TrainConfig.tokenizer's default: what a checkpoint without a tokenizer record was trained with
DEFAULT_TOKENIZER = "bytes"


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """What identifies a tokenizer's contents ("" where it has no fingerprint)."""
    return str(getattr(tokenizer, "fingerprint", ""))


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether ``a`` and ``b`` give the same ids: their fingerprints, where both have one, else their
    names; and their vocabulary sizes."""
    fa, fb = tokenizer_fingerprint(a), tokenizer_fingerprint(b)
    same = fa == fb if fa and fb else a.name == b.name
    return same and a.vocab_size == b.vocab_size


def tokenizer_record(spec: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a checkpoint stores about its tokenizer."""
    return {
        "spec": str(spec),
        "name": tokenizer.name,
        "vocab_size": int(tokenizer.vocab_size),
        "fingerprint": tokenizer_fingerprint(tokenizer),
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
    """The checkpoint ``resolve_checkpoint(path)`` names, loaded on CPU; its files are hashed once. One
    picked from a run folder that vanishes before it is loaded (pruned by the run's writer after a newer
    save) is picked again."""
    attempts = 3
    while True:
        folder, verified = _locate_checkpoint(path)
        try:
            return load_checkpoint(folder, map_location="cpu", verified=verified)
        except (CheckpointError, OSError):
            attempts -= 1
            if not verified or folder.exists() or not attempts:  # named, or damaged: as it is
                raise


def tokenizer_from_record(record: dict[str, Any], checkpoint: Path | None = None) -> Tokenizer:
    """Rebuild a checkpoint's tokenizer and check it is the one it was trained with: from its spec, else
    (the file gone, or its contents changed since) from the run's copy; a tokenizer whose contents differ
    from the checkpoint's, with no matching copy, is refused."""
    spec = record.get("spec", DEFAULT_TOKENIZER)
    copy = run_folder_of(checkpoint) / TOKENIZER_DIR / Path(spec).name if checkpoint else None
    try:
        tokenizer = load_tokenizer(spec)
    except FileNotFoundError:
        if copy is None or not copy.is_file():
            raise
        tokenizer = load_tokenizer(copy)
    want = record.get("fingerprint")
    if want and tokenizer_fingerprint(tokenizer) and want != tokenizer_fingerprint(tokenizer):
        kept = load_tokenizer(copy) if copy is not None and copy.is_file() else None
        if kept is None or tokenizer_fingerprint(kept) != want:
            raise ValueError(
                f"tokenizer {spec!r} is not the one the checkpoint was trained with (its contents differ) "
                f"and the run holds no copy of it in its {TOKENIZER_DIR}/ folder: give the original file"
            )
        log.warning("tokenizer %r has changed since training; using the run's copy of the original", spec)
        tokenizer = kept
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
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # torch's message: a header line, then one line per tensor (a traceback above)
        problems = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            f"the weights do not fit the model its config describes: {'; '.join(problems[:3])}{more}"
        ) from None
    if model.config.tie_embeddings:
        model.head.weight = model.embed.weight  # keep the tie whatever load_state_dict did


def checkpoint_of(checkpoint_or_run_dir: str | Path | Checkpoint) -> Checkpoint:
    """A checkpoint already loaded, or the one ``resolve_checkpoint`` names, loaded; either way one
    written by the titans trainer (it holds a train and a model config)."""
    if isinstance(checkpoint_or_run_dir, Checkpoint):
        ckpt = checkpoint_or_run_dir
    else:
        ckpt = load_checkpoint_from(checkpoint_or_run_dir)
    if not {"train", "model"} <= set(ckpt.config):
        raise CheckpointError(
            f"{str(ckpt.path)!r} was not written by the titans trainer (no train/model config)"
        )
    return ckpt


def load_trained(
    checkpoint_or_run_dir: str | Path | Checkpoint, map_location: str | torch.device = "cpu"
) -> tuple[TitansLM, Tokenizer]:
    """(model in eval mode on ``map_location``, its tokenizer) from a checkpoint: a folder as
    ``resolve_checkpoint`` takes, or one already loaded (``load_checkpoint_from``)."""
    ckpt = checkpoint_of(checkpoint_or_run_dir)
    saved = ckpt.config
    record = saved.get("tokenizer") or {"spec": saved["train"].get("tokenizer", DEFAULT_TOKENIZER)}
    tokenizer = tokenizer_from_record(record, ckpt.path)
    model = TitansLM(TitansConfig.from_saved_dict(saved["model"]))
    load_weights(model, ckpt.model_state)
    return model.to(map_location).eval(), tokenizer


__all__ = [
    "DEFAULT_TOKENIZER",
    "TOKENIZER_DIR",
    "checkpoint_of",
    "keep_tokenizer_copy",
    "load_checkpoint_from",
    "load_trained",
    "load_weights",
    "resolve_checkpoint",
    "same_tokenizer",
    "tokenizer_fingerprint",
    "tokenizer_from_record",
    "tokenizer_record",
]
