"""Causal depthwise convolution along time, followed by SiLU (the memory's q/k/v conv, Titans §4.4).

Layout is (B, T, C) throughout: the input arrives with its K - 1 causal context rows already prepended,
``padded: (B, T + K - 1, C)``, and ``weight: (C, 1, K)`` is an ``nn.Conv1d(C, C, K, groups=C)`` weight.

`causal_conv_silu` is the fast path: K shifted multiply-adds on contiguous rows (no transposed (B, C, T)
copies), with a hand-written backward that keeps only the input and recomputes the pre-activation, so
training holds one (B, T, C) tensor for this layer instead of three. `causal_conv_silu_ref` is the plain
``F.conv1d`` formulation it is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_depthwise_conv(padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """padded (B, T + K - 1, C), weight (C, 1, K), bias (C,) or None -> (B, T, C), without activation."""
    k = weight.shape[-1]
    t = padded.shape[1] - k + 1
    w = weight.view(-1, k).t().to(padded.dtype)  # (K, C)
    if bias is None:
        out = padded[:, :t] * w[0]
    else:
        out = torch.addcmul(bias.to(padded.dtype), padded[:, :t], w[0])
    for j in range(1, k):
        out = out.addcmul(padded[:, j : j + t], w[j])
    return out


class _CausalConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(padded, weight, bias)
        return F.silu(causal_depthwise_conv(padded, weight, bias), inplace=True)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        padded, weight, bias = ctx.saved_tensors
        # recompute the pre-activation x (cheaper than keeping it), then, in place to hold at most two
        # (B, T, C) temporaries: silu'(x) = s + silu(x) (1 - s), s = sigmoid(x)
        g_pre = causal_depthwise_conv(padded, weight, bias)
        s = torch.sigmoid(g_pre)
        g_pre.mul_(s)  # silu(x)
        g_pre.addcmul_(g_pre, s, value=-1).add_(s).mul_(g)
        del s
        k, t = weight.shape[-1], g_pre.shape[1]
        w = weight.view(-1, k).t().to(g_pre.dtype)
        g_padded = g_weight = g_bias = None
        if ctx.needs_input_grad[0]:
            g_padded = padded.new_zeros(padded.shape)
            for j in range(k):
                g_padded[:, j : j + t].addcmul_(g_pre, w[j])
        if ctx.needs_input_grad[1]:
            # sums over B x T in at least float32 (bf16 would lose the small taps)
            acc = torch.promote_types(g_pre.dtype, torch.float32)
            taps = [(g_pre * padded[:, j : j + t]).sum((0, 1), dtype=acc) for j in range(k)]
            g_weight = torch.stack(taps, -1).view_as(weight).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            g_bias = g_pre.sum((0, 1), dtype=torch.promote_types(g_pre.dtype, torch.float32)).to(bias.dtype)
        return g_padded, g_weight, g_bias


def causal_conv_silu(padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """silu(causal depthwise conv): padded (B, T + K - 1, C) -> (B, T, C)."""
    return _CausalConvSiLU.apply(padded, weight, bias)


def causal_conv_silu_ref(padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The reference: ``F.conv1d`` with groups = C on the transposed input, then SiLU."""
    b = None if bias is None else bias.to(padded.dtype)
    out = F.conv1d(padded.transpose(1, 2), weight.to(padded.dtype), b, groups=weight.shape[0])
    return F.silu(out.transpose(1, 2))


__all__ = ["causal_conv_silu", "causal_conv_silu_ref", "causal_depthwise_conv"]
