"""Residual blocks of the Titans variants (docs/design.md, "The variants"). Every block:
`x, state = block(x, state)`.

x: (B, T, dim). A block's state is whatever its mixers need to continue the same sequences in a later
call (KV caches, memory weights), so streaming a sequence in pieces equals one parallel pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titans.layers.attention import AttentionState, SegmentAttention, SegmentAttentionState, SelfAttention
from titans.layers.memory import MemoryState, MemoryStats, NeuralMemory
from titans.layers.mlp import SwiGLU
from titans.layers.norm import RMSNorm
from titans.layers.residual import residual_output
from titans.layers.state_tree import StateTree, register_state_type
from titans.ops.norms import l2_normalize

if TYPE_CHECKING:  # the config imports the variant registry, which imports the blocks
    from titans.models.config import TitansConfig


def make_memory(cfg: TitansConfig) -> NeuralMemory:
    """The neural memory a config describes (its ``memory_*`` fields: `TitansConfig.memory_kwargs`)."""
    return NeuralMemory(cfg.dim, **cfg.memory_kwargs())


def make_attention(cfg: TitansConfig, window: int | None, persistent: bool = True) -> SelfAttention:
    return SelfAttention(
        cfg.dim,
        cfg.heads,
        cfg.attn_head_dim,
        window=window,
        persistent_tokens=cfg.persistent_tokens if persistent else 0,
        rope_base=cfg.rope_base,
        qk_norm=cfg.qk_norm,
        output_gate=cfg.attn_output_gate,
        persistent_rope=cfg.persistent_rope,
    )


class GatedCombine(nn.Module):
    """o = W (norm(a) * sigmoid(norm(b))): both branches normalised with learned weights; b gates a."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm_a, self.norm_b = RMSNorm(dim, eps=eps), RMSNorm(dim, eps=eps)
        self.proj = residual_output(nn.Linear(dim, dim, bias=False))

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.proj(self.norm_a(a) * torch.sigmoid(self.norm_b(b)))


class IdentityInitGate(nn.Module):
    """o = y * 2 sigmoid(W norm(m)) with W zero-initialised: the gate starts as the identity on y, and the
    memory read m learns to scale y's channels (MAC's o = y * M(y), `TitansConfig.mac_gate="open"`).

    With `GatedCombine` instead, a MAC at our small language-modelling budgets learned markedly worse than
    with y alone (docs/design.md); starting open, the gate only departs from y as it helps.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm_m = RMSNorm(dim, eps=eps)
        self.gate = nn.Linear(dim, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.gate.weight)

    def forward(self, y: Tensor, m: Tensor) -> Tensor:
        return y * (2 * torch.sigmoid(self.gate(self.norm_m(m))))


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + SwiGLU(norm(x)). Subclasses define the mixer
    (`mix`), and a block with a residual sub-layer before the mixer (MAL's memory) defines `pre_mix`.

    `stats`: a list that memory calls append their `MemoryStats` to, or None.
    """

    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.norm_mix = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.norm_mlp = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp_hidden)

    def pre_mix(self, x: Tensor, state, stats: list | None) -> tuple[Tensor, object]:
        """x (B, T, dim) -> x with any residual sub-layer before the mixer added, and the state."""
        return x, state

    def mix(self, x: Tensor, state, stats: list | None) -> tuple[Tensor, object]:
        raise NotImplementedError

    def forward(self, x: Tensor, state=None, stats: list | None = None):
        x, state = self.pre_mix(x, state, stats)
        h, state = self.mix(self.norm_mix(x), state, stats)
        x = x + h
        return x + self.mlp(self.norm_mlp(x)), state


def _run_memory(
    mem: NeuralMemory,
    x: Tensor,
    state: MemoryState | None,
    stats: list | None,
    prefix: Tensor | None = None,
    heads: bool = False,
):
    """y, state = mem(x, state), with the stats of the call appended to `stats` when it is a list.

    prefix: (P, dim) tokens the memory reads before x at the start of a sequence (state None): the paper's
    x~ = [p || x] as the memory's input (`TitansConfig.persistent_to_memory`). Their outputs are dropped.
    heads: y is the per-head reads (B, H, T, d) of `NeuralMemory.forward_heads`, not the output (B, T, dim).
    """
    if prefix is not None and state is None:
        _, state = mem(prefix.to(x.dtype).unsqueeze(0).expand(x.shape[0], -1, -1))
    if stats is None and not heads:
        return mem(x, state)
    out = mem.forward_heads(x, state) if heads else mem.forward_with_stats(x, state)
    if stats is not None:
        stats.append(out.stats)
    return out.output, out.state


def _split(t: Tensor | None, sizes: list[int], dim: int) -> list[Tensor | None]:
    """t cut into consecutive pieces of `sizes` along dim (Nones for a t of None)."""
    return [None] * len(sizes) if t is None else list(t.split(sizes, dim=dim))


class AttentionBlock(Block):
    """Transformer++ (window None) or sliding-window attention, with persistent tokens."""

    def __init__(self, cfg: TitansConfig, window: int | None):
        super().__init__(cfg)
        self.attn = make_attention(cfg, window)

    def mix(self, x, state: AttentionState | None, stats):
        return self.attn(x, state)


class MemoryBlock(Block):
    """LMM: the neural memory alone as the token mixer."""

    def __init__(self, cfg: TitansConfig):
        super().__init__(cfg)
        self.memory = make_memory(cfg)

    def mix(self, x, state: MemoryState | None, stats):
        return _run_memory(self.memory, x, state, stats)


@register_state_type
@dataclass
class MAGState(StateTree):
    attention: AttentionState | None
    memory: MemoryState | None


class MAGBlock(Block):
    """Memory as gate: sliding-window attention and the memory read the same input; o = gate(attn, mem)."""

    def __init__(self, cfg: TitansConfig):
        super().__init__(cfg)
        self.attn = make_attention(cfg, cfg.window)
        self.memory = make_memory(cfg)
        self.combine = GatedCombine(cfg.dim, cfg.norm_eps)
        self.persistent_to_memory = cfg.persistent_to_memory

    def mix(self, x, state: MAGState | None, stats):
        state = state or MAGState(None, None)
        y, attn_state = self.attn(x, state.attention)
        prefix = self.attn.persistent if self.persistent_to_memory else None  # eq. 26: the same p for both
        m, mem_state = _run_memory(self.memory, x, state.memory, stats, prefix)
        return self.combine(y, m), MAGState(attn_state, mem_state)


@register_state_type
@dataclass
class MALState(StateTree):
    attention: AttentionState | None
    memory: MemoryState | None


class MALBlock(Block):
    """Memory as layer: x + M(norm x) (`pre_mix`), then x + SWA(norm x) (`mix`), then the MLP (an H3-like
    stack).

    The persistent tokens go to the attention (`mal_attn_persistent`), to the memory's input
    (`persistent_to_memory`), or both: one set of tokens either way.
    """

    def __init__(self, cfg: TitansConfig):
        super().__init__(cfg)
        self.norm_mem = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.memory = make_memory(cfg)
        self.attn = make_attention(cfg, cfg.window, persistent=cfg.mal_attn_persistent)
        self.memory_persistent = None  # the memory's own prefix, where the attention has none to share
        if cfg.persistent_to_memory and not cfg.mal_attn_persistent and cfg.persistent_tokens:
            self.memory_persistent = nn.Parameter(torch.randn(cfg.persistent_tokens, cfg.dim))
        self.persistent_to_memory = cfg.persistent_to_memory

    def pre_mix(self, x: Tensor, state: MALState | None, stats):
        state = state or MALState(None, None)
        prefix = None
        if self.persistent_to_memory:  # eq. 29
            prefix = self.attn.persistent if self.memory_persistent is None else self.memory_persistent
        m, mem_state = _run_memory(self.memory, self.norm_mem(x), state.memory, stats, prefix)
        return x + m, MALState(state.attention, mem_state)

    def mix(self, x, state: MALState, stats):
        y, attn_state = self.attn(x, state.attention)
        return y, MALState(attn_state, state.memory)


@register_state_type
@dataclass
class MACState(StateTree):
    memory: MemoryState
    segment_weights: tuple[Tensor, ...]  # memory weights at the start of the current segment (for retrieval)
    attention: SegmentAttentionState | None


class MACBlock(Block):
    """Memory as context (docs/design.md, "The variants").

    For each segment s: retrieve h = M_{s-1}(q(x)) with the weights from before the segment; causal attention
    over [persistent || h || segment] (h_j visible only to tokens >= j); write the attention output y into the
    memory chunk by chunk; output o = gate(y, M(y)), each token reading the memory before its chunk's write.
    With `mac_norm_memory_tokens`, h is RMS-normalised first, as the block input x is (the memory's output
    projection is initialised small, for its residual uses: unnormalised, h is far below x's scale).
    With `mac_norm_memory_input`, the memory writes and reads norm(y) (RMSNorm, learned weight) instead of y:
    y comes out of the attention's small output projection, and unnormalised it is so small that the
    memory's keys and values are its conv bias alone, the same for every token.
    """

    def __init__(self, cfg: TitansConfig):
        super().__init__(cfg)
        self.segment_len = cfg.segment_len
        self.memory = make_memory(cfg)
        mem = self.memory
        self.retrieve_q = nn.Linear(cfg.dim, mem.heads * mem.head_dim, bias=False)
        self.attn = SegmentAttention(
            cfg.dim,
            cfg.heads,
            cfg.attn_head_dim,
            segment_len=cfg.segment_len,
            persistent_tokens=cfg.persistent_tokens,
            rope_base=cfg.rope_base,
            qk_norm=cfg.qk_norm,
            output_gate=cfg.attn_output_gate,
        )
        self.norm_tokens, self.eps = cfg.mac_norm_memory_tokens, cfg.norm_eps
        self.norm_memory_input = RMSNorm(cfg.dim, eps=cfg.norm_eps) if cfg.mac_norm_memory_input else None
        self.memory_residual = cfg.mac_memory_residual
        gate = IdentityInitGate if cfg.mac_gate == "open" else GatedCombine
        self.combine = gate(cfg.dim, cfg.norm_eps)

    def retrieve(self, x: Tensor, weights: tuple[Tensor, ...]) -> Tensor:
        """h = M(q(x); W) for every token of a segment piece, read-only. x: (B, n, dim) -> (B, n, dim)."""
        return self.memory_tokens(self.retrieval_queries(x), self.memory.output_gate(x), weights)

    def retrieval_queries(self, x: Tensor) -> Tensor:
        """x (B, n, dim) -> q(x) (B, H, n, d): the queries the memory tokens read with."""
        b, n, _ = x.shape
        mem = self.memory
        q = F.silu(self.retrieve_q(x)).view(b, n, mem.heads, mem.head_dim).transpose(1, 2)
        return l2_normalize(q, fused_backward=False)

    def memory_tokens(self, q: Tensor, gate: Tensor | None, weights: tuple[Tensor, ...]) -> Tensor:
        """h = M(q; W) (B, n, dim) from `retrieval_queries` and the memory's `output_gate` of the tokens."""
        h = self.memory.gated_output(self.memory.read(q, weights), gate)
        return F.rms_norm(h, (h.shape[-1],), eps=self.eps) if self.norm_tokens else h

    def mix(self, x, state: MACState | None, stats):
        b, t, _ = x.shape
        if state is None:
            mem_state = self.memory.initial_state(b, x.device, x.dtype)
            state = MACState(mem_state, mem_state.weights, None)
        if t == 0:  # an empty piece reads and writes nothing
            return x, state
        mem, mem_state, seg_w, attn_state = self.memory, state.memory, state.segment_weights, state.attention
        pos, c = mem_state.position, self.segment_len
        # pieces end at segment boundaries, counted in absolute positions
        first = min(t, c - pos % c)
        sizes = [first] + [c] * ((t - first) // c) + ([(t - first) % c] if (t - first) % c else [])
        # What depends on x alone is computed for all pieces at once, outside the loop; what reads the
        # memory stays in it. Split, not sliced: the backward of n slices writes n gradients of x's size.
        tokens = self.attn.project_tokens(x, 0 if attn_state is None else attn_state.position)
        queries, gates = self.retrieval_queries(x), mem.output_gate(x)
        ys, reads, writes = [], [], []
        for xs, tok, q, gate in zip(
            x.split(sizes, dim=1), tokens.split(sizes), queries.split(sizes, dim=2), _split(gates, sizes, 1)
        ):
            h = self.memory_tokens(q, gate, seg_w)
            y, attn_state = self.attn.attend(tok, h, attn_state)
            u = xs + y if self.memory_residual else y
            u = u if self.norm_memory_input is None else self.norm_memory_input(u)
            read, mem_state = _run_memory(mem, u, mem_state, stats, heads=True)
            ys.append(y)
            reads.append(read)
            writes.append(u)
            if mem_state.position % c == 0:  # segment complete: chunks divide it, nothing pending
                seg_w = mem_state.weights
        # the memory's output, o = gate(y, M(y)): per token, so for all pieces at once as well
        m = mem.combine_heads(torch.cat(reads, dim=2), torch.cat(writes, dim=1))
        return self.combine(torch.cat(ys, dim=1), m), MACState(mem_state, seg_w, attn_state)


__all__ = [
    "AttentionBlock",
    "Block",
    "IdentityInitGate",
    "MACBlock",
    "MACState",
    "MAGBlock",
    "MAGState",
    "MALBlock",
    "MALState",
    "MemoryBlock",
    "MemoryStats",
]
