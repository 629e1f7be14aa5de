"""Attention layers of the Titans architectures: sliding-window / full causal self-attention (MAG, MAL,
Transformer++, SWA baselines) and segment attention over ``[persistent || memory tokens || segment]``
(MAC), each with a streaming state so that feeding a sequence in pieces equals one parallel call.

Shapes: x is (batch, seq, dim); inside, heads are (batch, heads, seq, head_dim).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titans.layers.residual import residual_output
from titans.layers.rotary import RotaryEmbedding
from titans.layers.state_tree import StateTree, register_state_type
from titans.ops.attention import causal_attention, segment_attention
from titans.ops.norms import l2_normalize
from titans.validation import check_int

__all__ = [
    "PERSISTENT_ROPE",
    "AttentionState",
    "SegmentAttention",
    "SegmentAttentionState",
    "SegmentTokens",
    "SelfAttention",
]

# how a query scores the persistent keys (SelfAttention's persistent_rope)
PERSISTENT_ROPE = ("absolute", "none")


@register_state_type
@dataclass(frozen=True)
class AttentionState(StateTree):
    """Streaming state of :class:`SelfAttention`: a KV cache.

    k, v: (batch, heads, n, head_dim), keys already rotated (RoPE). ``n = min(position, window - 1)`` for a
    sliding window (the next query at ``position`` sees keys ``position - window + 1 .. position``, the last
    of which it brings itself), ``n = position`` for full attention.
    position: absolute position of the next token.
    """

    k: Tensor
    v: Tensor
    position: int


@register_state_type
@dataclass(frozen=True)
class SegmentAttentionState(StateTree):
    """Streaming state of :class:`SegmentAttention`: keys/values of the current, unfinished segment.

    k, v: (batch, heads, n, head_dim) from the segment's tokens; ctx_k, ctx_v: the same from the memory
    tokens h. ``n = position % segment_len`` (0 right after a segment boundary: the cache resets).
    position: absolute position of the next token.
    """

    k: Tensor
    v: Tensor
    ctx_k: Tensor
    ctx_v: Tensor
    position: int


@dataclass
class SegmentTokens:
    """`SegmentAttention.project_tokens`: what the attention takes from a piece's own tokens x, the first
    at absolute position `position`.

    q, k, v: (B, H, T, D), q and k rotated at segment-local positions; gate: the output gate (B, T, H, D)
    or None; persistent_k, persistent_v: (H, P, D) or None.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    gate: Tensor | None
    persistent_k: Tensor | None
    persistent_v: Tensor | None
    position: int

    def split(self, sizes: list[int]) -> list[SegmentTokens]:
        """Consecutive pieces of `sizes` tokens (summing to T), each starting at its own position."""
        q, k, v = (t.split(sizes, dim=2) for t in (self.q, self.k, self.v))
        gates = [None] * len(sizes) if self.gate is None else self.gate.split(sizes, dim=1)
        starts = itertools.accumulate(sizes[:-1], initial=self.position)
        pk, pv = self.persistent_k, self.persistent_v
        return [SegmentTokens(*parts, pk, pv, p) for *parts, p in zip(q, k, v, gates, starts)]


# q and k of attention are l2-normalised in at least float32 (bf16 under autocast), eps on the norm 1e-6
_l2_normalize = partial(l2_normalize, eps=1e-6, in_float32=True)


def _check_position(state: AttentionState | SegmentAttentionState | None) -> int:
    if state is None:
        return 0
    check_int("state.position", state.position, 0)
    return state.position


def _take_last(t: Tensor, n: int) -> Tensor:
    """The last n positions of (B, H, T, D), as a fresh tensor (a view would pin the whole input).

    Contiguous, not in t's memory order: k and v are head views of (B, T, H, D) projections, and once
    `torch.compile` sees the position change (MAC's third segment) n is a symbolic length that may be 0 or
    1, for which inductor cannot lay out an output in that transposed order (an AssertionError in
    `require_strides`). The values, and so every result, are the same either way."""
    total = t.shape[2]
    return t[:, :, total - n :].clone(memory_format=torch.contiguous_format) if n < total else t


class _ProjectedAttention(nn.Module):
    """Shared parts: q/k/v/o projections, SiLU + l2 norm + RoPE on heads, persistent tokens, output."""

    persistent_rope = "absolute"  # how queries score the persistent keys (`SelfAttention` has the option)

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        *,
        persistent_tokens: int,
        rope_base: float,
        qk_norm: bool,
        silu_qkv: bool,
        output_gate: bool,
    ):
        super().__init__()
        check_int("dim", dim)
        check_int("heads", heads)
        check_int("head_dim", head_dim)
        check_int("persistent_tokens", persistent_tokens, 0)
        self.dim, self.heads, self.head_dim = dim, heads, head_dim
        self.qk_norm, self.silu_qkv = qk_norm, silu_qkv
        inner = heads * head_dim
        self.q_proj = nn.Linear(dim, inner, bias=False)
        self.k_proj = nn.Linear(dim, inner, bias=False)
        self.v_proj = nn.Linear(dim, inner, bias=False)
        self.o_proj = residual_output(nn.Linear(inner, dim, bias=False))
        self.rotary = RotaryEmbedding(head_dim, base=rope_base)
        # Persistent memory (Titans §3.3): learned tokens in model space, shaped like normalised block inputs
        # (unit-variance entries), that go through the same k/v projections as the sequence.
        self.persistent = nn.Parameter(torch.randn(persistent_tokens, dim)) if persistent_tokens > 0 else None
        # With l2-normalised q and k every logit lies in [-1, 1]: with the usual 1/sqrt(d) scale the softmax
        # would be almost uniform and could barely attend to one token. So the logits get a learnable
        # per-head temperature, initialised to sqrt(head_dim): the logit range of standard attention with
        # unit-variance q, k entries. It is parameterised as sqrt(head_dim) * exp(s) with s = 0 at init, so
        # weight decay on s pulls it back to that sensible default rather than towards a flat softmax.
        self.qk_log_scale = nn.Parameter(torch.zeros(heads)) if qk_norm else None
        # Optional normalise-and-gate before the output projection (Titans §4.4, after Mehta et al.).
        self.gate_proj = nn.Linear(dim, inner, bias=False) if output_gate else None

    @property
    def persistent_tokens(self) -> int:
        return 0 if self.persistent is None else self.persistent.shape[0]

    def _check_x(self, x: Tensor, name: str = "x") -> None:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{name} must be (batch, seq, dim={self.dim}), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")

    def _split_heads(self, t: Tensor) -> Tensor:
        """(B, T, H*D) -> (B, H, T, D)."""
        b, t_len, _ = t.shape
        return t.view(b, t_len, self.heads, self.head_dim).transpose(1, 2)

    def _keys(self, x: Tensor) -> Tensor:
        """Keys before RoPE: (..., T, dim) -> (..., T, H*D)."""
        k = self.k_proj(x)
        if self.silu_qkv:
            k = F.silu(k)
        return k

    def _values(self, x: Tensor) -> Tensor:
        v = self.v_proj(x)
        return F.silu(v) if self.silu_qkv else v

    def _query_heads(self, x: Tensor) -> Tensor:
        """(B, T, dim) -> (B, H, T, D): projected, activated, normalised and scaled queries, not rotated."""
        q = self.q_proj(x)
        if self.silu_qkv:
            q = F.silu(q)
        q = self._split_heads(q)
        if self.qk_norm:
            scale = math.sqrt(self.head_dim) * self.qk_log_scale.exp()
            q = (_l2_normalize(q) * scale.view(-1, 1, 1)).to(q.dtype)
        return q

    def _queries(self, x: Tensor, positions: Tensor, max_position: int) -> Tensor:
        """(B, T, dim) -> (B, H, T, D): `_query_heads` rotated at ``positions``."""
        return self.rotary(self._query_heads(x), positions, max_position)

    def _keys_values(self, x: Tensor, positions: Tensor, max_position: int) -> tuple[Tensor, Tensor]:
        """(B, T, dim) -> k, v: (B, H, T, D), k rotated."""
        k = self._split_heads(self._keys(x))
        if self.qk_norm:
            k = _l2_normalize(k)
        v = self._split_heads(self._values(x))
        return self.rotary(k, positions, max_position), v

    def _persistent_kv(self) -> tuple[Tensor | None, Tensor | None]:
        """Keys/values of the persistent tokens, (H, P, D) each; no RoPE (they have no position)."""
        if self.persistent is None:
            return None, None
        p = self.persistent.shape[0]
        k = self._keys(self.persistent).view(p, self.heads, self.head_dim).transpose(0, 1)
        if self.qk_norm:
            k = _l2_normalize(k)
        v = self._values(self.persistent).view(p, self.heads, self.head_dim).transpose(0, 1)
        return k, v

    @property
    def _softmax_scale(self) -> float | None:
        # qk_norm: the per-head temperature is already folded into q.
        return 1.0 if self.qk_norm else None

    def _output_gate(self, x: Tensor) -> Tensor | None:
        """(B, T, dim) -> the output gate (B, T, H, D), or None without one."""
        if self.gate_proj is None:
            return None
        b, t_len, _ = x.shape
        return torch.sigmoid(self.gate_proj(x)).view(b, t_len, self.heads, self.head_dim)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """(B, H, T, D) attention output -> (B, T, dim)."""
        return self._gated_output(o, self._output_gate(x))

    def _gated_output(self, o: Tensor, gate: Tensor | None) -> Tensor:
        """(B, H, T, D) attention output and the gate of `_output_gate` -> (B, T, dim)."""
        b, _, t_len, _ = o.shape
        o = o.transpose(1, 2)  # (B, T, H, D)
        if gate is not None:
            o = F.rms_norm(o, (self.head_dim,)) * gate
        return self.o_proj(o.reshape(b, t_len, self.heads * self.head_dim))

    def _check_cache(self, name: str, t: Tensor, x: Tensor, length: int, like: Tensor) -> None:
        expected = (x.shape[0], self.heads, length, self.head_dim)
        if tuple(t.shape) != expected:
            raise ValueError(
                f"state.{name} has shape {tuple(t.shape)}, expected {expected} for this input "
                "and state.position"
            )
        if t.dtype != like.dtype or t.device != like.device:
            raise TypeError(
                f"state.{name} is {t.dtype} on {t.device} but this call computes {like.dtype} on "
                f"{like.device}; stream with the same dtype/autocast and device"
            )


class SelfAttention(_ProjectedAttention):
    """Causal multi-head self-attention, full or sliding-window, with persistent tokens and a KV cache.

    q, k, v are bias-free projections of x; with ``silu_qkv`` they pass through SiLU and with ``qk_norm``
    q and k are l2-normalised (Titans §4.4) and scaled by a learnable per-head temperature. RoPE is
    applied to q and k at absolute positions. ``persistent_tokens`` learned vectors (P, dim) go through the
    same k/v projections (no RoPE) and are visible to every query.

    ``persistent_rope``: how a query scores the persistent keys. "absolute": the query rotated at its
    absolute position, as it scores the sequence's keys; the persistent keys have no rotation, so a
    query's scores for them change with its position, and a model trained on short windows meets
    unseen ones past its training length. "none": the unrotated query, so those scores are the same at
    every position and the layer's output depends only on the last ``window`` tokens.

    ``forward(x, state)`` with x: (B, T, dim) returns y: (B, T, dim) and the new state; feeding a sequence
    in pieces, threading the state, gives the outputs of one call on the whole sequence.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        *,
        window: int | None,
        persistent_tokens: int = 0,
        rope_base: float = 10000.0,
        qk_norm: bool = True,
        silu_qkv: bool = True,
        output_gate: bool = False,
        block_size: int | None = None,
        persistent_rope: str = "absolute",
    ):
        super().__init__(
            dim,
            heads,
            head_dim,
            persistent_tokens=persistent_tokens,
            rope_base=rope_base,
            qk_norm=qk_norm,
            silu_qkv=silu_qkv,
            output_gate=output_gate,
        )
        check_int("window", window, none_ok=True)
        check_int("block_size", block_size, none_ok=True)
        if persistent_rope not in PERSISTENT_ROPE:
            raise ValueError(f"persistent_rope must be one of {PERSISTENT_ROPE}, got {persistent_rope!r}")
        self.window = window
        self.block_size = block_size
        self.persistent_rope = persistent_rope

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, window={self.window}, "
            f"persistent_tokens={self.persistent_tokens}, qk_norm={self.qk_norm}, silu_qkv={self.silu_qkv}"
            + ("" if self.persistent_rope == "absolute" else f", persistent_rope={self.persistent_rope}")
        )

    def _cache_len(self, position: int) -> int:
        return position if self.window is None else min(position, self.window - 1)

    def forward(self, x: Tensor, state: AttentionState | None = None) -> tuple[Tensor, AttentionState]:
        """x: (B, T, dim) -> y: (B, T, dim), new state. ``state`` is not modified."""
        self._check_x(x)
        b, t_len, _ = x.shape
        start = _check_position(state)
        positions = torch.arange(start, start + t_len, device=x.device)
        q_heads = self._query_heads(x)
        q = self.rotary(q_heads, positions, start + t_len)
        k, v = self._keys_values(x, positions, start + t_len)
        if state is not None:
            n = self._cache_len(start)
            self._check_cache("k", state.k, x, n, k)
            self._check_cache("v", state.v, x, n, v)
            k = torch.cat([state.k, k], dim=2)
            v = torch.cat([state.v, v], dim=2)
        if t_len == 0:
            y = x.new_zeros(b, 0, self.dim)
        else:
            pk, pv = self._persistent_kv()
            o = causal_attention(
                q,
                k,
                v,
                window=self.window,
                persistent_k=pk,
                persistent_v=pv,
                block_size=self.block_size,
                scale=self._softmax_scale,
                persistent_q=q_heads if self.persistent_rope == "none" and pk is not None else None,
            )
            y = self._output(o, x)
        keep = self._cache_len(start + t_len)
        return y, AttentionState(_take_last(k, keep), _take_last(v, keep), start + t_len)


class SegmentAttention(_ProjectedAttention):
    """Segment attention for Titans MAC (memory as context, §4.1).

    The sequence is cut into segments of ``segment_len``. The token at position i attends to the persistent
    tokens, to the memory tokens h_j (``ctx``) and to the tokens x_j of its own segment with j <= i, and to
    nothing in other segments (the long-term memory carries that). Keys/values of h and x come from the same
    projections; queries come from x only. RoPE uses segment-local positions: h_j and x_j both sit at the
    local index of j.

    ``forward(x, ctx, state)`` with x, ctx: (B, T, dim) returns y: (B, T, dim) and the new state (the
    current segment's keys/values); streaming in pieces equals one call.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        *,
        segment_len: int,
        persistent_tokens: int = 0,
        rope_base: float = 10000.0,
        qk_norm: bool = True,
        silu_qkv: bool = True,
        output_gate: bool = False,
    ):
        super().__init__(
            dim,
            heads,
            head_dim,
            persistent_tokens=persistent_tokens,
            rope_base=rope_base,
            qk_norm=qk_norm,
            silu_qkv=silu_qkv,
            output_gate=output_gate,
        )
        check_int("segment_len", segment_len)
        self.segment_len = segment_len

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, segment_len={self.segment_len}, "
            f"persistent_tokens={self.persistent_tokens}, qk_norm={self.qk_norm}, silu_qkv={self.silu_qkv}"
        )

    def forward(
        self, x: Tensor, ctx: Tensor, state: SegmentAttentionState | None = None
    ) -> tuple[Tensor, SegmentAttentionState]:
        """x, ctx: (B, T, dim) -> y: (B, T, dim), new state. ``state`` is not modified."""
        self._check_x(x)
        return self.attend(self.project_tokens(x, _check_position(state)), ctx, state)

    def _local_positions(self, start: int, t_len: int, device: torch.device) -> tuple[Tensor, int]:
        """RoPE positions of tokens start .. start + t_len - 1 in their segments, and a bound on them (lets
        RoPE use its cache)."""
        c = self.segment_len
        return torch.arange(start, start + t_len, device=device) % c, min(c, start % c + t_len)

    def project_tokens(self, x: Tensor, position: int) -> SegmentTokens:
        """What the attention takes from x's own tokens (B, T, dim), x starting at absolute `position`: one
        pass for a piece of any number of segments, which `SegmentTokens.split` cuts for `attend`."""
        self._check_x(x)
        local, max_local = self._local_positions(position, x.shape[1], x.device)
        k, v = self._keys_values(x, local, max_local)
        pk, pv = self._persistent_kv()
        return SegmentTokens(self._queries(x, local, max_local), k, v, self._output_gate(x), pk, pv, position)

    def attend(
        self, tokens: SegmentTokens, ctx: Tensor, state: SegmentAttentionState | None = None
    ) -> tuple[Tensor, SegmentAttentionState]:
        """The attention of `project_tokens`' tokens over the memory tokens ctx (B, T, dim) and the state's
        cache -> y (B, T, dim), new state."""
        self._check_x(ctx, "ctx")
        b, _, t_len, _ = tokens.q.shape
        if ctx.shape != (b, t_len, self.dim):
            raise ValueError(
                f"ctx must have the shape of x (one memory token per position), got "
                f"{tuple(ctx.shape)} and {(b, t_len, self.dim)}"
            )
        c = self.segment_len
        start = _check_position(state)
        if tokens.position != start:
            raise ValueError(f"tokens start at position {tokens.position}, the state at {start}")
        ctx_k, ctx_v = self._keys_values(ctx, *self._local_positions(start, t_len, ctx.device))
        k, v = tokens.k, tokens.v
        if state is not None:
            n = start % c
            for name, cached, new in (
                ("k", state.k, k),
                ("v", state.v, v),
                ("ctx_k", state.ctx_k, ctx_k),
                ("ctx_v", state.ctx_v, ctx_v),
            ):
                self._check_cache(name, cached, ctx, n, new)
            k, v = torch.cat([state.k, k], dim=2), torch.cat([state.v, v], dim=2)
            ctx_k, ctx_v = torch.cat([state.ctx_k, ctx_k], dim=2), torch.cat([state.ctx_v, ctx_v], dim=2)
        if t_len == 0:
            y = ctx.new_zeros(b, 0, self.dim)
        else:
            # The keys start at the current segment's first position, as segment_attention requires.
            o = segment_attention(
                tokens.q,
                k,
                v,
                ctx_k,
                ctx_v,
                segment_len=c,
                persistent_k=tokens.persistent_k,
                persistent_v=tokens.persistent_v,
                scale=self._softmax_scale,
            )
            y = self._gated_output(o, tokens.gate)
        keep = (start + t_len) % c
        new_state = SegmentAttentionState(
            _take_last(k, keep),
            _take_last(v, keep),
            _take_last(ctx_k, keep),
            _take_last(ctx_v, keep),
            start + t_len,
        )
        return y, new_state
