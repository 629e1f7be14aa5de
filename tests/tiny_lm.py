"""Tiny Titans LMs shared by the model, streaming, state, generation and transformers tests.

Sizes are chosen to exercise every boundary in a few dozen tokens: segments of 8, windows of 6, memory
chunks of 4 and 2 persistent tokens. Each test module fixes its own vocabulary size (and width where it
needs one) with ``functools.partial``.
"""

from __future__ import annotations

import torch

from titans import TitansConfig, TitansLM


def tiny_config(variant: str = "mac", **overrides) -> TitansConfig:
    base = dict(
        variant=variant,
        vocab_size=61,
        dim=24,
        depth=2,
        heads=2,
        segment_len=8,
        window=6,
        chunk_size=4,
        persistent_tokens=2,
    )
    return TitansConfig(**{**base, **overrides})


def tiny_model(
    variant: str = "mac", seed: int = 0, dtype: torch.dtype = torch.float64, train: bool = False, **overrides
) -> TitansLM:
    """A freshly initialised tiny model (seeded), in eval mode unless ``train``."""
    torch.manual_seed(seed)
    return TitansLM(tiny_config(variant, **overrides)).to(dtype).train(train)


def random_tokens(batch: int, length: int, seed: int = 1, *, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def save_tiny_run(run_dir, model: TitansLM):
    """Save `model` as a trainer-style checkpoint of a byte-level run in `run_dir` (what `titans generate`,
    `read` and `export-hf` load; see titans.runtime.loading); returns `run_dir`."""
    from titans.data.tokenizers import ByteTokenizer
    from titans.runtime.checkpoint import save_checkpoint
    from titans.runtime.loading import tokenizer_record
    from titans.training.config import TrainConfig

    config = {
        "train": TrainConfig().to_dict(),
        "model": model.config.to_dict(),
        "tokenizer": tokenizer_record("bytes", ByteTokenizer()),
    }
    save_checkpoint(run_dir, 1, model_state=model.state_dict(), trainer_state={}, config=config)
    return run_dir
