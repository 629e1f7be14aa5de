"""Monitoring a model's memory in operation: per memory layer and head, what it is writing and how full it is.

    out = model.forward_with_stats(tokens, state)
    report = memory_report(model, out.stats, out.state)      # a MemoryReport
    logits, state, report = prefill_with_report(model, tokens, state)   # the same, streamed in pieces

Per memory layer (the index of its block) and head:

    surprise_mean, surprise_p50, surprise_p95   the surprise ||u_t|| (the norm of the token's inner-loss
                                                gradient at its chunk-start weights) over rows and tokens
    write_rate                                  the share of tokens written (below the surprise threshold a
                                                token is not; a frozen memory writes none)
    theta, eta, alpha                           the effective gates, averaged over rows and tokens
    weight_norm[l], momentum_norm[l]            ||W_l||, ||S_l|| (Frobenius) of each layer l of the memory
                                                MLP in the state, averaged over rows (with a memory rule's
                                                retention map, of the pre-retention A the state holds):
                                                `weight_norms`, the one definition of ||W|| in the package
    utilisation[l]                              weight_norm[l] / max_norm (default
                                                `TitansConfig.utilisation_max_norm`: the monitor's
                                                max_norm, else the weights' bound; None without one)

`MemoryMonitor` accumulates the stats of successive calls (a stream read in pieces) into one report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from titans.layers.memory import MemoryState, MemoryStats
from titans.models.state import TitansState
from titans.models.streaming import _whole_shape, default_piece_len, iter_pieces
from titans.ops.memory import check_max_norm
from titans.validation import check_int

if TYPE_CHECKING:  # the model imports nothing from here
    from titans.models.lm import TitansLM

STAT_FIELDS = ("surprise", "theta", "eta", "alpha", "written")
# LayerReport's numbers with one value per head
HEAD_FIELDS = ("surprise_mean", "surprise_p50", "surprise_p95", "write_rate", "theta", "eta", "alpha")


@dataclass
class LayerReport:
    """One memory layer's numbers; every list is per head (weight, momentum and utilisation lists are per
    memory-MLP layer, then per head)."""

    layer: int
    tokens: int
    surprise_mean: list[float]
    surprise_p50: list[float]
    surprise_p95: list[float]
    write_rate: list[float]
    theta: list[float]
    eta: list[float]
    alpha: list[float]
    weight_norm: list[list[float]]
    momentum_norm: list[list[float]]
    utilisation: list[list[float]] | None

    @property
    def max_weight_norm(self) -> float:
        """||W|| of the memory-MLP layer with the largest head mean: that mean."""
        return max(_mean(row) for row in self.weight_norm)

    def summary(self) -> dict[str, float]:
        """Head means of every number (`weight_norm` etc. as the largest over the MLP's layers)."""
        out = {name: _mean(getattr(self, name)) for name in HEAD_FIELDS}
        out["weight_norm"] = self.max_weight_norm
        out["momentum_norm"] = max(_mean(row) for row in self.momentum_norm)
        if self.utilisation is not None:
            out["utilisation"] = max(_mean(row) for row in self.utilisation)
        return out


@dataclass
class MemoryReport:
    """Every memory layer's `LayerReport`, and the settings they are read against."""

    layers: list[LayerReport] = field(default_factory=list)
    max_norm: float | None = None
    surprise_threshold: float | None = None

    @property
    def write_rate(self) -> float:
        """The share of (layer, head, token) entries written (NaN with no memory or no tokens)."""
        rates = [r for layer in self.layers for r in layer.write_rate]
        return _mean(rates)

    @property
    def max_utilisation(self) -> float | None:
        """The largest ||W|| / max_norm of any memory layer and head (None without a max_norm)."""
        if self.max_norm is None or not self.layers:
            return None
        return max(u for layer in self.layers for row in layer.utilisation for u in row)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: plain floats and lists, None where a number is undefined (no tokens) or not finite
        (strict JSON has no NaN)."""
        return _json_safe(
            {
                "max_norm": self.max_norm,
                "surprise_threshold": self.surprise_threshold,
                "write_rate": self.write_rate,
                "max_utilisation": self.max_utilisation,
                "layers": [dataclasses.asdict(layer) for layer in self.layers],
            }
        )

    def summary(self, prefix: str = "") -> dict[str, float]:
        """Flat numbers for a metrics log: ``{prefix}L{layer}/{name}`` (head means), plus the overall
        ``{prefix}write_rate`` and ``{prefix}max_utilisation``."""
        out: dict[str, float] = {f"{prefix}write_rate": self.write_rate}
        if self.max_utilisation is not None:
            out[f"{prefix}max_utilisation"] = self.max_utilisation
        for layer in self.layers:
            out.update({f"{prefix}L{layer.layer}/{k}": v for k, v in layer.summary().items()})
        return out


def _json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


# ------------------------------------------------------------------------------------------ structure
def memory_layers(model: TitansLM) -> list[int]:
    """The indices of the blocks that carry a neural memory, in order."""
    return [i for i, block in enumerate(model.blocks) if getattr(block, "memory", None) is not None]


def find_memory_state(layer_state: Any) -> MemoryState | None:
    """The `MemoryState` inside one block's state (itself, or a field of MAG/MAL/MAC states), or None."""
    if isinstance(layer_state, MemoryState):
        return layer_state
    if dataclasses.is_dataclass(layer_state) and not isinstance(layer_state, type):
        for f in dataclasses.fields(layer_state):
            found = find_memory_state(getattr(layer_state, f.name))
            if found is not None:
                return found
    return None


def stats_by_layer(model: TitansLM, stats: Sequence[MemoryStats]) -> dict[int, MemoryStats]:
    """The stats list of one `forward_with_stats` call (per memory layer, per MAC segment piece, in block
    order) as one `MemoryStats` per memory layer, its pieces joined along the tokens."""
    layers = memory_layers(model)
    if not layers:
        return {}
    if len(stats) % len(layers):
        raise ValueError(
            f"stats_by_layer: {len(stats)} memory stats do not divide among the model's {len(layers)} memory "
            "layers: pass the stats of one forward_with_stats call"
        )
    per = len(stats) // len(layers)
    return {layer: _join(stats[i * per : (i + 1) * per]) for i, layer in enumerate(layers)}


def _join(pieces: Sequence[MemoryStats]) -> MemoryStats:
    """Stats of consecutive calls joined along the tokens (dim 2)."""
    if len(pieces) == 1:
        return pieces[0]
    values = {}
    for name in STAT_FIELDS:
        parts = [getattr(p, name) for p in pieces]
        if name == "written":
            parts = [
                torch.ones_like(p.surprise, dtype=torch.bool) if w is None else w
                for p, w in zip(pieces, parts)
            ]
        values[name] = torch.cat(parts, dim=2)
    return MemoryStats(**values)


# ------------------------------------------------------------------------------------------ ||W||
def weight_norms(tensors: Iterable[Tensor]) -> list[list[float]]:
    """The memory's ||W|| (the one definition every report uses): per memory-MLP layer l and head h, the
    Frobenius norm of each row's W_l[b, h], averaged over rows. tensors: (B, H, d_in, d_out) per layer
    (`MemoryState.weights` or `.momentum`) -> [l][h]."""
    return [
        torch.linalg.vector_norm(t.detach().double(), dim=(-2, -1)).mean(0).cpu().tolist() for t in tensors
    ]


def total_weight_norm(state: MemoryState) -> float:
    """||W|| of all of one memory's weights together (every MLP layer and head): the root of the summed
    squares of `weight_norms` (for a one-row state, the Frobenius norm of the whole row)."""
    return math.sqrt(sum(n * n for row in weight_norms(state.weights) for n in row))


# ------------------------------------------------------------------------------------------ the report
def _per_head(t: Tensor) -> Tensor:
    """(B, H, T) -> (H, B * T) float64 on the CPU."""
    return t.detach().to("cpu", torch.float64).transpose(0, 1).reshape(t.shape[1], -1)


def _layer_report(
    layer: int, stats: MemoryStats | None, state: MemoryState, max_norm: float | None
) -> LayerReport:
    heads = state.weights[0].shape[1]
    nan = [float("nan")] * heads
    numbers: dict[str, list[float]] = {}
    if stats is None or stats.surprise.shape[2] == 0:
        tokens = 0
        for name in HEAD_FIELDS:
            numbers[name] = list(nan)
    else:
        tokens = stats.surprise.shape[2]
        surprise = _per_head(stats.surprise).numpy()
        numbers["surprise_mean"] = surprise.mean(1).tolist()
        p50, p95 = np.percentile(surprise, [50, 95], axis=1)
        numbers["surprise_p50"], numbers["surprise_p95"] = p50.tolist(), p95.tolist()
        written = stats.written if stats.written is not None else torch.ones_like(stats.surprise)
        numbers["write_rate"] = _per_head(written).mean(1).tolist()
        for name in ("theta", "eta", "alpha"):
            numbers[name] = _per_head(getattr(stats, name)).mean(1).tolist()

    weight_norm = weight_norms(state.weights)
    utilisation = None if max_norm is None else [[w / max_norm for w in row] for row in weight_norm]
    return LayerReport(
        layer=layer,
        tokens=tokens,
        weight_norm=weight_norm,
        momentum_norm=weight_norms(state.momentum),
        utilisation=utilisation,
        **numbers,
    )


def memory_report(
    model: TitansLM,
    stats: Sequence[MemoryStats] | dict[int, MemoryStats] | None,
    state: TitansState,
    max_norm: float | None = None,
) -> MemoryReport:
    """The `MemoryReport` of a model's memory: the per-token numbers from `stats` (the list of one
    `forward_with_stats` call, or `stats_by_layer`'s dict; None: state norms only) and the norms from
    `state` (the state after those tokens). max_norm: default `model.config.utilisation_max_norm`
    (memory_monitor_max_norm, else the weights' bound memory_max_norm)."""
    if not isinstance(state, TitansState):
        raise TypeError(f"memory_report: state must be a TitansState, got {type(state).__name__}")
    if max_norm is None:
        max_norm = model.config.utilisation_max_norm
    max_norm = check_max_norm("memory_report: max_norm", max_norm)
    if stats is None:
        by_layer: dict[int, MemoryStats] = {}
    elif isinstance(stats, dict):
        by_layer = stats
    else:
        by_layer = stats_by_layer(model, stats)
    layers = []
    for i in memory_layers(model):
        mem_state = find_memory_state(state.layers[i]) if i < len(state.layers) else None
        if mem_state is None:  # a block that has not run yet (an empty state): its initial state
            mem_state = model.blocks[i].memory.initial_state(1)
        layers.append(_layer_report(i, by_layer.get(i), mem_state, max_norm))
    # the memories' own setting (an operator may change it at run time: `titans inspect --threshold`)
    thresholds = {model.blocks[i].memory.surprise_threshold for i in memory_layers(model)}
    threshold = thresholds.pop() if len(thresholds) == 1 else model.config.memory_surprise_threshold
    return MemoryReport(layers, max_norm, threshold)


class MemoryMonitor:
    """Accumulates the stats of successive `forward_with_stats` calls (a stream read in pieces):

    monitor = MemoryMonitor(model)
    for piece in pieces:
        out = model.forward_with_stats(piece, state); state = out.state; monitor.update(out.stats)
    report = monitor.report(state)
    """

    def __init__(
        self, model: TitansLM, max_norm: float | None = None, *, caller: str = "MemoryMonitor"
    ) -> None:
        """max_norm: None (the config's `utilisation_max_norm`) or a finite number > 0, checked here (a
        ValueError naming `caller`), before any tokens are read."""
        self.model, self.max_norm = model, check_max_norm(f"{caller}: max_norm", max_norm)
        self._pieces: dict[int, list[MemoryStats]] = {i: [] for i in memory_layers(model)}

    def update(self, stats: Sequence[MemoryStats]) -> None:
        for layer, s in stats_by_layer(self.model, stats).items():
            self._pieces[layer].append(_detached(s))

    def layer_stats(self) -> dict[int, MemoryStats]:
        """Every update so far, one `MemoryStats` per memory layer (tokens of all updates, in order)."""
        return {layer: _join(pieces) for layer, pieces in self._pieces.items() if pieces}

    def report(self, state: TitansState) -> MemoryReport:
        return memory_report(self.model, self.layer_stats(), state, self.max_norm)


def _detached(stats: MemoryStats) -> MemoryStats:
    return MemoryStats(
        **{n: None if getattr(stats, n) is None else getattr(stats, n).detach() for n in STAT_FIELDS}
    )


@torch.no_grad()
def prefill_with_report(
    model: TitansLM,
    tokens: Tensor | Iterable,
    state: TitansState | None = None,
    *,
    piece_len: int | None = None,
    max_norm: float | None = None,
) -> tuple[Tensor | None, TitansState | None, MemoryReport]:
    """`titans.models.streaming.prefill` (tokens (B, T) or an iterable of pieces, cut into `piece_len`),
    which also returns the `MemoryReport` of the tokens read: (logits of the last token (B, vocab), state,
    report). With no tokens: (None, state, a report of the state's norms alone; the initial weights' for
    state None)."""
    monitor = MemoryMonitor(model, max_norm, caller="prefill_with_report")  # checks max_norm first
    if piece_len is None:
        shape = _whole_shape(tokens)
        piece_len = default_piece_len(model, shape[0] if shape else 1)
    check_int("prefill_with_report: piece_len", piece_len)
    device = next(model.parameters()).device
    last = None
    for piece in iter_pieces(tokens, piece_len):
        out = model.forward_with_stats(piece.to(device), state, last_only=True)
        state, last = out.state, out.logits[:, -1]
        monitor.update(out.stats)
    report = monitor.report(state if state is not None else TitansState([], 0, model.config_dict))
    return last, state, report


__all__ = [
    "LayerReport",
    "MemoryMonitor",
    "MemoryReport",
    "find_memory_state",
    "memory_layers",
    "memory_report",
    "prefill_with_report",
    "stats_by_layer",
    "total_weight_norm",
    "weight_norms",
]
