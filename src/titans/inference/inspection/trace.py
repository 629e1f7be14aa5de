"""What `titans inspect` reads off a model along a text: per token the surprise, the write decisions, the
gates and the loss, ||W|| after each piece (all from `titans.models.monitor`), and the text of each token.

    trace = trace_text(model, tokens)                # a Trace
    set_surprise_threshold(model, 0.5)               # gate the model's writes before tracing
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from titans.inference.generation import IncrementalDecoder
from titans.layers.memory import NeuralMemory
from titans.models.lm import TitansLM
from titans.models.monitor import MemoryMonitor, MemoryReport, memory_layers, memory_report
from titans.models.streaming import iter_pieces
from titans.ops.memory import check_threshold


@dataclass
class Trace:
    """Per-token and per-piece numbers of one text read by a model. Token arrays are (L, T) for the L memory
    layers (head means), (L, H, T) for `written`; `norm_at` (P,) are the positions after each piece and
    `weight_norm` (L, P) the largest ||W_l|| (head mean) of each memory layer there
    (`LayerReport.max_weight_norm`)."""

    layers: list[int]
    surprise: np.ndarray
    written: np.ndarray
    theta: np.ndarray
    eta: np.ndarray
    alpha: np.ndarray
    loss: np.ndarray  # (T,): the loss of predicting token t from the tokens before it (NaN for t = 0)
    norm_at: np.ndarray
    weight_norm: np.ndarray
    report: MemoryReport
    threshold: float | None
    max_norm: float | None
    extra: dict = field(default_factory=dict)


def _piece_len(model: TitansLM, tokens: int) -> int:
    """A multiple of the streaming unit giving about 100 pieces (the ||W|| plot's resolution)."""
    unit = model.config.spec.streaming_unit(model.config)
    return max(unit, math.ceil(tokens / 100 / unit) * unit)


@torch.no_grad()
def trace_text(model: TitansLM, tokens: Tensor, max_norm: float | None = None, state=None) -> Trace:
    """Read tokens (T,) or (1, T) with `model` from `state` and gather the `Trace`."""
    tokens = tokens.reshape(1, -1).to(next(model.parameters()).device, torch.int64)
    layers = memory_layers(model)
    if not layers:
        raise ValueError(f"inspect: the model ({model.config.variant}) has no neural memory to inspect")
    monitor = MemoryMonitor(model, max_norm)
    losses, norm_at, norms, last = [float("nan")], [], [], None
    for piece in iter_pieces(tokens, _piece_len(model, tokens.shape[1])):
        out = model.forward_with_stats(piece, state)
        state = out.state
        monitor.update(out.stats)
        logits = out.logits[0].float()
        if last is not None:
            losses.append(float(F.cross_entropy(last[None], piece[0, :1])))
        if piece.shape[1] > 1:
            losses.extend(F.cross_entropy(logits[:-1], piece[0, 1:], reduction="none").tolist())
        last = logits[-1]
        norm_at.append(state.position)
        norms.append([layer.max_weight_norm for layer in memory_report(model, None, state, max_norm).layers])
    stats = monitor.layer_stats()

    def per_layer(name: str) -> np.ndarray:
        return np.stack([getattr(stats[i], name)[0].double().mean(0).cpu().numpy() for i in layers])

    written = np.stack([stats[i].written[0].cpu().numpy() for i in layers])
    report = monitor.report(state)
    return Trace(
        layers=layers,
        surprise=per_layer("surprise"),
        written=written,
        theta=per_layer("theta"),
        eta=per_layer("eta"),
        alpha=per_layer("alpha"),
        loss=np.array(losses),
        norm_at=np.array(norm_at),
        weight_norm=np.array(norms).T,
        report=report,
        threshold=report.surprise_threshold,
        max_norm=report.max_norm,
    )


def set_surprise_threshold(model: TitansLM, threshold: float | None) -> None:
    """Every memory of `model` gates its writes at `threshold` from now on (None: writes every token)."""
    check_threshold("inspect: threshold", threshold)
    for module in model.modules():
        if isinstance(module, NeuralMemory):
            module.surprise_threshold = threshold


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """The text of each token, as it completes (a character split over several byte tokens shows on the
    last of them; the others are empty)."""
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    rest = decoder.finish()
    if pieces and rest:
        pieces[-1] += rest
    return pieces


__all__ = ["Trace", "set_surprise_threshold", "token_texts", "trace_text"]
