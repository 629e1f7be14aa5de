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
    mem: NeuralMemory, x: Tensor, state: MemoryState | None, stats: list | None, prefix: Tensor | None = None
):
    """y, state = mem(x, state), with the stats of the call appended to `stats` when it is a list.

    prefix: (P, dim) tokens the memory reads before x at the start of a sequence (state None): the paper's
    x~ = [p || x] as the memory's input (`TitansConfig.persistent_to_memory`). Their outputs are dropped.
    """
    if prefix is not None and state is None:
        _, state = mem(prefix.to(x.dtype).unsqueeze(0).expand(x.shape[0], -1, -1))
    if stats is None:
        return mem(x, state)
    out = mem.forward_with_stats(x, state)
    stats.append(out.stats)
    return out.output, out.state


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
        b, n, _ = x.shape
        mem = self.memory
        q = F.silu(self.retrieve_q(x)).view(b, n, mem.heads, mem.head_dim).transpose(1, 2)
        q = l2_normalize(q, fused_backward=False)
        h = mem.combine_heads(mem.read(q, weights), x)
        return F.rms_norm(h, (h.shape[-1],), eps=self.eps) if self.norm_tokens else h

    def mix(self, x, state: MACState | None, stats):
        b, t, _ = x.shape
        if state is None:
            mem_state = self.memory.initial_state(b, x.device, x.dtype)
            state = MACState(mem_state, mem_state.weights, None)
        if t == 0:  # an empty piece reads and writes nothing
            return x, state
        mem_state, seg_w, attn_state = state.memory, state.segment_weights, state.attention
        pos = mem_state.position
        outs = []
        start = 0
        while start < t:
            # pieces end at segment boundaries, counted in absolute positions
            end = min(t, start + self.segment_len - (pos + start) % self.segment_len)
            xs = x[:, start:end]
            h = self.retrieve(xs, seg_w)
            y, attn_state = self.attn(xs, h, attn_state)
            u = xs + y if self.memory_residual else y
            u = u if self.norm_memory_input is None else self.norm_memory_input(u)
            m, mem_state = _run_memory(self.memory, u, mem_state, stats)
            outs.append(self.combine(y, m))
            if (pos + end) % self.segment_len == 0:  # segment complete: chunks divide it, nothing pending
                seg_w = mem_state.weights
            start = end
        return torch.cat(outs, dim=1), MACState(mem_state, seg_w, attn_state)


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
