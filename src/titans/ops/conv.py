"""Causal depthwise convolution along time, followed by SiLU (the memory's q/k/v conv, Titans §4.4).

Layout is (B, T, C): ``x: (B, T, C)`` are the new rows, ``tail: (B, K - 1, C)`` the K - 1 rows before them
(the causal context a previous call left; zeros at a sequence start), and ``weight: (C, 1, K)`` is an
``nn.Conv1d(C, C, K, groups=C)`` weight.

`causal_conv_silu` is the fast path: K shifted multiply-adds on contiguous rows (no transposed (B, C, T)
copies, no concatenation of tail and rows), in cache-sized blocks of time rows, with a hand-written backward
that keeps only the input and recomputes the pre-activation, so training holds one (B, T, C) tensor for this
layer instead of three. It can write its output straight into the memory's (3, B, H, T, d) q/k/v layout.
On CPU a fused C++ kernel (`csrc/causal_conv.cpp`, one pass per direction; `titans.ops.cpu_kernels`
builds it on first use) does the same work where it can be built; the torch-op path is its fallback.
`titans.ops.conv_ref.causal_conv_silu_ref` is the plain ``F.conv1d`` formulation both are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from titans.ops.cpu_kernels import kernels

# On CPU, time rows per block of the fused passes: a block of (B, rows, C) holds about this many elements
# (1 MiB in float32), so its temporaries stay in cache and each (B, T, C) tensor is read or written about
# once (benchmarks/memory_profile.py compares against one whole-tensor block).
# On GPUs one block: kernel launches cost more there than memory passes.
_BLOCK_ELEMENTS = 1 << 18


def _blocks(x: Tensor) -> list[tuple[int, int]]:
    """(start, end) rows of each block of x (B, T, C): one block on GPUs, cache-sized blocks on CPU."""
    t = x.shape[1]
    if x.device.type != "cpu":
        rows = max(1, t)
    else:
        rows = max(1, _BLOCK_ELEMENTS // max(1, x.shape[0] * x.shape[2]))
    return [(t0, min(t, t0 + rows)) for t0 in range(0, t, rows)]


def _window(x: Tensor, tail: Tensor, t0: int, t1: int) -> Tensor:
    """Rows t0 - (K - 1) .. t1 - 1 of [tail; x], the inputs of output rows t0 .. t1 - 1: (B, t1 - t0 + K - 1,
    C). A view of x, except for a block that reaches into the tail (a small copy)."""
    start = t0 - tail.shape[1]
    if start >= 0:
        return x[:, start:t1]
    return torch.cat([tail[:, t0:], x[:, :t1]], 1)


def causal_depthwise_conv(
    padded: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None
) -> Tensor:
    """padded (B, T + K - 1, C), weight (C, 1, K), bias (C,) or None -> (B, T, C), without activation.

    out: a (B, T, C) tensor to write into, or (B, T, *parts) with parts splitting C (any strides: e.g. one
    block of a larger output in another layout)."""
    k = weight.shape[-1]
    t = padded.shape[1] - k + 1
    parts = tuple(out.shape[2:]) if out is not None else (padded.shape[2],)
    padded = padded.view(*padded.shape[:2], *parts)
    w = weight.view(-1, k).t().to(padded.dtype).reshape(k, *parts)  # (K, *parts)
    if torch.compiler.is_compiling():
        # dynamo refuses an `out=` that is not contiguous (the q/k/v layout's view at batch > 1: a graph break
        # per call); traced out of place, then one copy into `out`, which inductor fuses away
        y = padded[:, :t] * w[0] if bias is None else bias.to(padded.dtype).view(parts) + padded[:, :t] * w[0]
        for j in range(1, k):
            y = y + padded[:, j : j + t] * w[j]
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(padded.shape[0], t, *parts, dtype=padded.dtype, device=padded.device)
    if bias is None:
        torch.mul(padded[:, :t], w[0], out=out)
    else:
        torch.addcmul(bias.to(padded.dtype).view(parts), padded[:, :t], w[0], out=out)
    for j in range(1, k):
        out.addcmul_(padded[:, j : j + t], w[j])
    return out


def _split_layout(x: Tensor, split: tuple[int, int] | None) -> tuple[Tensor, Tensor]:
    """An empty output for x (B, T, C): itself and its (B, T, *parts) view. With split (P, H): the output is
    (P, B, H, T, C // (P H)) contiguous and the view (B, T, P, H, C // (P H))."""
    b, t, c = x.shape
    if split is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, out
    p, h = split
    out = x.new_empty(p, b, h, t, c // (p * h))
    return out, out.permute(1, 3, 0, 2, 4)


class _CausalConvSiLU(torch.autograd.Function):
    """Forward and backward in blocks of time rows (`_blocks`): each block's pre-activation, SiLU and
    gradients are computed while it is in cache, instead of a dozen passes over (B, T, C) tensors."""

    @staticmethod
    def forward(ctx, x: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None, split) -> Tensor:
        ctx.save_for_backward(x, tail, weight, bias)
        ctx.split = split
        out, view = _split_layout(x, split)
        for t0, t1 in _blocks(x):
            block = causal_depthwise_conv(_window(x, tail, t0, t1), weight, bias, out=view[:, t0:t1])
            F.silu(block, inplace=True)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, tail, weight, bias = ctx.saved_tensors
        b, t, c = x.shape
        k = weight.shape[-1]
        w = weight.view(-1, k).t().to(x.dtype)
        need_x, need_tail, need_w = ctx.needs_input_grad[:3]
        need_b = bias is not None and ctx.needs_input_grad[3]
        # the output's gradient as (B, T, *parts), any strides, parts splitting C as the output did
        g = g.permute(1, 3, 0, 2, 4) if ctx.split is not None else g
        parts = g.shape[2:]
        # weight and bias sums over B x T in at least float32 (bf16 would lose the small taps)
        acc = torch.promote_types(x.dtype, torch.float32)
        g_x = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else None
        g_taps = torch.zeros(k, c, dtype=acc, device=x.device) if need_w else None
        g_bias = torch.zeros(c, dtype=acc, device=x.device) if need_b else None
        blocks = _blocks(x)
        rows = max((t1 - t0 for t0, t1 in blocks), default=0)  # T = 0: no block, zero gradients
        # ext: a block's pre-activation gradient g_pre followed by the first K - 1 rows of the next block's
        # (zeros past the end): the rows each input row of the block gathers from. Blocks run last first.
        ext_buf = x.new_empty(b, rows + k - 1, c)
        pre_buf = x.new_empty(b, rows, c)
        carry = x.new_zeros(b, k - 1, c)
        for t0, t1 in reversed(blocks):
            n = t1 - t0
            window = _window(x, tail, t0, t1)
            # recompute the pre-activation (cheaper than keeping it), then g * silu'(pre) in one kernel
            pre = causal_depthwise_conv(window, weight, bias, out=pre_buf[:, :n])
            ext = ext_buf[:, : n + k - 1]
            g_pre = ext[:, :n]
            torch.ops.aten.silu_backward.grad_input(
                g[:, t0:t1], pre.view(b, n, *parts), grad_input=g_pre.view(b, n, *parts)
            )
            ext[:, n:] = carry
            carry = ext[:, : k - 1].clone()
            if need_x:
                # input row t is padded row t + K - 1: it feeds output rows t + K - 1 - j through tap j
                g_block = g_x[:, t0:t1]
                torch.mul(ext[:, k - 1 : k - 1 + n], w[0], out=g_block)
                for j in range(1, k):
                    g_block.addcmul_(ext[:, k - 1 - j : k - 1 - j + n], w[j])
            if need_w:
                for j in range(k):
                    g_taps[j] += (g_pre * window[:, j : j + n]).sum((0, 1), dtype=acc)
            if need_b:
                g_bias += g_pre.sum((0, 1), dtype=acc)
        g_tail = None
        if need_tail:  # tail row p feeds output rows p - j >= 0 (the first K - 1 rows of g_pre: carry)
            g_tail = torch.zeros_like(tail)
            for j in range(k - 1):
                g_tail[:, j:].addcmul_(carry[:, : k - 1 - j], w[j])
        g_weight = g_taps.t().reshape(weight.shape).to(weight.dtype) if need_w else None
        return g_x, g_tail, g_weight, g_bias.to(bias.dtype) if need_b else None, None


class _CausalConvSiLUKernel(torch.autograd.Function):
    """`_CausalConvSiLU` by the fused C++ kernel: x, tail, the transposed taps (K, C) and the bias in x's
    dtype, all contiguous."""

    @staticmethod
    def forward(ctx, x: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None, split) -> Tensor:
        c, k = weight.shape[0], weight.shape[-1]
        taps = weight.detach().view(c, k).t().to(x.dtype).contiguous()
        b = None if bias is None else bias.detach().to(x.dtype).contiguous()
        ctx.save_for_backward(x, tail, weight, bias)
        ctx.split, ctx.taps, ctx.bias = split, taps, b
        p, h = split if split is not None else (0, 0)
        return kernels().causal_conv_silu_forward(x, tail, taps, b, p, h)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, tail, weight, bias = ctx.saved_tensors
        p, h = ctx.split if ctx.split is not None else (0, 0)
        g_x, g_tail, g_taps, g_bias = kernels().causal_conv_silu_backward(
            x, tail, ctx.taps, ctx.bias, g.contiguous(), p, h, _KERNEL_ROWS
        )
        g_weight = g_taps.t().reshape(weight.shape).to(weight.dtype) if ctx.needs_input_grad[2] else None
        g_bias = g_bias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None
        return g_x, g_tail, g_weight, g_bias, None


# padded rows per task of the kernel's backward (each task also recomputes the K - 1 rows before its own)
_KERNEL_ROWS = 64


def causal_conv_silu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tail: Tensor | None = None,
    *,
    split: tuple[int, int] | None = None,
) -> Tensor:
    """silu(causal depthwise conv) of x (B, T, C) after its K - 1 context rows `tail` (B, K - 1, C) (None:
    zeros). Returns (B, T, C); with split=(P, H), the same values as a contiguous (P, B, H, T, C // (P H))
    tensor (the q/k/v heads layout), written there directly rather than permuted by a copy afterwards."""
    k = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(x.shape[0], k - 1, x.shape[2])
    expected = (x.shape[0], k - 1, x.shape[2])
    if tail.shape != expected:
        raise ValueError(
            f"causal_conv_silu: tail must be (batch, kernel - 1, channels) = {expected}, "
            f"got {tuple(tail.shape)}"
        )
    if split is not None and x.shape[2] % (split[0] * split[1]):
        raise ValueError(f"causal_conv_silu: split={split} does not divide the {x.shape[2]} channels")
    tail = tail.to(x.dtype)
    if torch.compiler.is_compiling():
        # plain differentiable ops: inductor fuses them and derives the backward (the hand-written one
        # writes into views of its buffers, which dynamo cannot trace)
        y = F.silu(causal_depthwise_conv(torch.cat([tail, x], 1), weight, bias))
        if split is None:
            return y
        (b, t, c), (p, h) = x.shape, split
        return y.view(b, t, p, h, c // (p * h)).permute(2, 0, 3, 1, 4).contiguous()
    if x.device.type == "cpu" and kernels() is not None:
        return _CausalConvSiLUKernel.apply(x.contiguous(), tail.contiguous(), weight, bias, split)
    return _CausalConvSiLU.apply(x, tail, weight, bias, split)


__all__ = ["causal_conv_silu", "causal_depthwise_conv"]
