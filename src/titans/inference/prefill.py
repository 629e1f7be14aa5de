"""Chunked prefill: read a prompt of any length (a million tokens and beyond) piece by piece.

    logits, state = prefill(model, tokens, state=None, piece_len=None)

`tokens` is a (B, T) tensor or an iterable of pieces (a streaming reader: tensors (B, t) or (t,), lists or
numpy arrays of ids), so the whole prompt never needs to be in memory. Pieces are re-cut to `piece_len`
tokens and fed through the model under `torch.no_grad()`, threading the state. Memory stays bounded by the
state plus one piece (the state of the memory and sliding-window variants does not grow with context; the
full-attention baseline's KV cache does). Streaming equals one parallel pass, so the result does not
depend on how the input is cut.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from titans.models.lm import TitansLM, TitansState

# Default piece size: batch x piece_len x vocab near this many elements. Prefill computes the last
# position's logits only, so this now just bounds a piece's activations (shorter for large vocabularies).
_LOGITS_BUDGET = 1 << 24


def default_piece_len(model: TitansLM, batch_size: int = 1) -> int:
    """A piece length that is a multiple of the chunk size (and MAC segment) with batch x length x vocab
    near 16M: 4096 tokens for a byte vocabulary, about 512 for a 32K vocabulary."""
    cfg = model.config
    unit = math.lcm(cfg.chunk_size, cfg.segment_len if cfg.variant == "mac" else 1)
    target = max(64, min(4096, _LOGITS_BUDGET // max(1, batch_size * cfg.vocab_size)))
    return max(unit, target // unit * unit)


def _as_piece(item, batch_size: int | None, index: int) -> Tensor:
    """One piece from a reader as a (B, t) int64 tensor; a 1-D piece is batch 1."""
    if isinstance(item, Tensor):
        t = item
    elif isinstance(item, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(item))
    elif isinstance(item, (list, tuple)):
        t = torch.tensor(item, dtype=torch.int64)
    else:
        kind = type(item).__name__
        raise TypeError(f"prefill: piece {index} is a {kind}; expected a tensor, array or list")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"prefill: piece {index} must be (batch, len) or (len,), got shape {tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"prefill: piece {index} must hold integer token ids, got dtype {t.dtype}")
    if batch_size is not None and t.shape[0] != batch_size:
        raise ValueError(f"prefill: piece {index} has batch {t.shape[0]}, earlier pieces had {batch_size}")
    return t.long()


def iter_pieces(tokens: Tensor | Iterable, piece_len: int) -> Iterator[Tensor]:
    """Re-cut a (B, T) tensor or an iterable of pieces into (B, <= piece_len) int64 pieces, in order.

    Small pieces from a reader are buffered (one model call per `piece_len` tokens); empty pieces skipped.
    """
    if isinstance(tokens, Tensor):
        tokens = _as_piece(tokens, None, 0)
        for start in range(0, tokens.shape[1], piece_len):
            yield tokens[:, start : start + piece_len]
        return
    if isinstance(tokens, (str, bytes)):
        raise TypeError("prefill: got text; tokenize it first (tokens are integer ids)")
    buffer: list[Tensor] = []
    buffered = 0
    batch_size = None
    for i, item in enumerate(tokens):
        piece = _as_piece(item, batch_size, i)
        batch_size = piece.shape[0]
        if piece.shape[1] == 0:
            continue
        buffer.append(piece)
        buffered += piece.shape[1]
        if buffered >= piece_len:
            joined = torch.cat(buffer, dim=1) if len(buffer) > 1 else buffer[0]
            full = buffered // piece_len * piece_len
            for start in range(0, full, piece_len):
                yield joined[:, start : start + piece_len]
            rest = joined[:, full:]
            buffer, buffered = ([rest.clone()] if rest.shape[1] else []), rest.shape[1]
    if buffered:
        yield torch.cat(buffer, dim=1)


@torch.no_grad()
def prefill(
    model: TitansLM,
    tokens: Tensor | Iterable,
    state: TitansState | None = None,
    *,
    piece_len: int | None = None,
    progress: bool = False,
    total: int | None = None,
) -> tuple[Tensor | None, TitansState | None]:
    """Feed `tokens` through `model` piece by piece, threading `state`.

    tokens: (B, T) int tensor, or an iterable of pieces (see `iter_pieces`).
    piece_len: tokens per model call (default `default_piece_len`); any value gives the same result.
    progress: show a tqdm bar (tokens); `total` sets its length for a reader of known size.
    Returns (logits of the last token (B, vocab), state after all tokens). With no tokens at all:
    (None, state) — the state unchanged.
    """
    if piece_len is None:
        batch = tokens.shape[0] if isinstance(tokens, Tensor) and tokens.dim() == 2 else 1
        piece_len = default_piece_len(model, batch)
    if isinstance(piece_len, bool) or not isinstance(piece_len, int) or piece_len < 1:
        raise ValueError(f"prefill: piece_len must be a positive int, got {piece_len!r}")
    if isinstance(tokens, Tensor) and total is None and tokens.dim() == 2:
        total = tokens.shape[1]
    device = next(model.parameters()).device
    last = None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prefill", dynamic_ncols=True)
    try:
        for piece in iter_pieces(tokens, piece_len):
            logits, state = model(piece.to(device), state, last_only=True)
            last = logits[:, -1]
            if bar is not None:
                bar.update(piece.shape[1])
    finally:
        if bar is not None:
            bar.close()
    return last, state


__all__ = ["default_piece_len", "iter_pieces", "prefill"]
