"""Causal depthwise convolution along time, followed by SiLU (the memory's q/k/v conv, Titans §4.4).

Layout is (B, T, C) throughout: the input arrives with its K - 1 causal context rows already prepended,
``padded: (B, T + K - 1, C)``, and ``weight: (C, 1, K)`` is an ``nn.Conv1d(C, C, K, groups=C)`` weight.

`causal_conv_silu` is the fast path: K shifted multiply-adds on contiguous rows (no transposed (B, C, T)
copies), in cache-sized blocks of time rows, with a hand-written backward that keeps only the input and
recomputes the pre-activation, so training holds one (B, T, C) tensor for this layer instead of three.
`causal_conv_silu_ref` is the plain ``F.conv1d`` formulation it is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# On CPU, time rows per block of the fused passes: a block of (B, rows, C) holds about this many elements
# (1 MiB in float32), so its temporaries stay in cache and each (B, T, C) tensor is read or written about
# once: fwd+bwd at (2, 2048, 3072) 1.7x faster than one whole-tensor block (benchmarks/memory_profile.py).
# On GPUs one block: kernel launches cost more there than memory passes.
_BLOCK_ELEMENTS = 1 << 18


def _blocks(padded: Tensor, t: int) -> list[tuple[int, int]]:
    """(start, end) output rows of each block: one block on GPUs, cache-sized blocks on CPU."""
    if padded.device.type != "cpu":
        rows = max(1, t)
    else:
        rows = max(1, _BLOCK_ELEMENTS // max(1, padded.shape[0] * padded.shape[2]))
    return [(t0, min(t, t0 + rows)) for t0 in range(0, t, rows)]


def causal_depthwise_conv(
    padded: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None
) -> Tensor:
    """padded (B, T + K - 1, C), weight (C, 1, K), bias (C,) or None -> (B, T, C), without activation.

    out: (B, T, C) to write into (a view is fine), e.g. one block of a larger output."""
    k = weight.shape[-1]
    t = padded.shape[1] - k + 1
    w = weight.view(-1, k).t().to(padded.dtype)  # (K, C)
    if out is None:
        out = torch.empty(padded.shape[0], t, padded.shape[2], dtype=padded.dtype, device=padded.device)
    if bias is None:
        torch.mul(padded[:, :t], w[0], out=out)
    else:
        torch.addcmul(bias.to(padded.dtype), padded[:, :t], w[0], out=out)
    for j in range(1, k):
        out.addcmul_(padded[:, j : j + t], w[j])
    return out


class _CausalConvSiLU(torch.autograd.Function):
    """Forward and backward in blocks of time rows (`_blocks`): each block's pre-activation, SiLU and
    gradients are computed while it is in cache, instead of a dozen passes over (B, T, C) tensors."""

    @staticmethod
    def forward(ctx, padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(padded, weight, bias)
        k = weight.shape[-1]
        b, t, c = padded.shape[0], padded.shape[1] - k + 1, padded.shape[2]
        out = torch.empty(b, t, c, dtype=padded.dtype, device=padded.device)
        for t0, t1 in _blocks(padded, t):
            block = causal_depthwise_conv(padded[:, t0 : t1 + k - 1], weight, bias, out=out[:, t0:t1])
            F.silu(block, inplace=True)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        padded, weight, bias = ctx.saved_tensors
        k = weight.shape[-1]
        t = padded.shape[1] - k + 1
        w = weight.view(-1, k).t().to(padded.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        # weight and bias sums over B x T in at least float32 (bf16 would lose the small taps)
        acc = torch.promote_types(padded.dtype, torch.float32)
        g_padded = padded.new_zeros(padded.shape) if need_x else None
        g_taps = torch.zeros(k, padded.shape[2], dtype=acc, device=padded.device) if need_w else None
        g_bias = torch.zeros(padded.shape[2], dtype=acc, device=padded.device) if need_b else None
        for t0, t1 in _blocks(padded, t):
            window = padded[:, t0 : t1 + k - 1]
            # recompute the pre-activation x (cheaper than keeping it); silu'(x) = s + silu(x) (1 - s)
            g_pre = causal_depthwise_conv(window, weight, bias)
            s = torch.sigmoid(g_pre)
            g_pre.mul_(s)  # silu(x)
            g_pre.addcmul_(g_pre, s, value=-1).add_(s).mul_(g[:, t0:t1])
            n = t1 - t0
            for j in range(k):
                if need_x:
                    g_padded[:, t0 + j : t1 + j].addcmul_(g_pre, w[j])
                if need_w:
                    g_taps[j] += (g_pre * window[:, j : j + n]).sum((0, 1), dtype=acc)
            if need_b:
                g_bias += g_pre.sum((0, 1), dtype=acc)
        g_weight = g_taps.t().reshape(weight.shape).to(weight.dtype) if need_w else None
        return g_padded, g_weight, g_bias.to(bias.dtype) if need_b else None


def causal_conv_silu(padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """silu(causal depthwise conv): padded (B, T + K - 1, C) -> (B, T, C)."""
    return _CausalConvSiLU.apply(padded, weight, bias)


def causal_conv_silu_ref(padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The reference: ``F.conv1d`` with groups = C on the transposed input, then SiLU."""
    b = None if bias is None else bias.to(padded.dtype)
    out = F.conv1d(padded.transpose(1, 2), weight.to(padded.dtype), b, groups=weight.shape[0])
    return F.silu(out.transpose(1, 2))


__all__ = ["causal_conv_silu", "causal_conv_silu_ref", "causal_depthwise_conv"]
