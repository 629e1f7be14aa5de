"""Normalisations over the last dim with hand-written backward passes.

Autograd's compositions of `F.normalize` and `F.rms_norm` make about ten passes over the tensor in their
backward (a node per elementwise op, each with its own temporaries); these make about four. On CPU, where
such passes are memory-bound, that is most of their cost (`benchmarks/memory_profile.py` compares both).
The plain-PyTorch functions they are tested against are `F.normalize` and `F.rms_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _records_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records this call: only then does a hand-written backward matter (without it, as
    in decoding, `F.*`'s fused forward kernels and no Function overhead are the better choice)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        denom = norm.clamp_min(eps)
        y = x / denom
        ctx.save_for_backward(y, norm)
        ctx.eps = eps
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        y, norm = ctx.saved_tensors
        # d(x / max(|x|, eps)) = (g - y <g, y>) / |x| where |x| > eps; g / eps where the clamp holds it
        dot = (g * y).sum(-1, keepdim=True).masked_fill_(norm <= ctx.eps, 0)
        return torch.addcmul(g, y, dot, value=-1).div_(norm.clamp_min(ctx.eps)), None


class _L2NormalizeInFloat32(torch.autograd.Function):
    """`l2_normalize(x, in_float32=True)` for an x narrower than float32 (bf16 under autocast), keeping x
    and two numbers per row for the backward pass instead of x's float32 copy (autograd's composition keeps
    that copy: twice x's bytes for bf16). The forward and backward are autograd's ops on the composition,
    in its order, so outputs and gradients are the same to the bit (`tests/test_norms.py`)."""

    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        sq = xf.pow(2).sum(-1, keepdim=True)
        r = torch.rsqrt(sq.clamp_min(eps * eps))
        ctx.save_for_backward(x, sq, r)
        ctx.eps = eps
        return (xf * r).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, sq, r = ctx.saved_tensors
        xf, gf = x.to(r.dtype), g.to(r.dtype)
        # y = xf * r, r = rsqrt(max(sq, eps^2)), sq = sum(xf^2): autograd's formulas for mul, rsqrt,
        # clamp_min, sum and pow, the two gradients of xf added last
        g_r = (gf * xf).sum(-1, keepdim=True)
        g_sq = torch.where(sq >= ctx.eps * ctx.eps, -0.5 * g_r * r.pow(3), 0.0)
        return (gf * r + g_sq * (2.0 * xf)).to(x.dtype), None


def l2_normalize(
    x: Tensor, eps: float = 1e-12, *, in_float32: bool = False, fused_backward: bool = True
) -> Tensor:
    """x / max(||x||, eps) over the last dim: `F.normalize(x, dim=-1, eps=eps)`, with a fused backward on
    CPU when autograd records (otherwise, off CPU, or with `fused_backward=False`, `F.normalize` itself).

    Other forms, the same values up to rounding; a caller keeps its form, so that its outputs and gradients
    stay the same to the bit:
    in_float32: compute in at least float32 and return x's dtype, as x * rsqrt(max(||x||^2, eps^2)) (the
        attention's queries and keys, which are bf16 under autocast).
    fused_backward=False: autograd's backward through `F.normalize` (MAC's retrieval queries).

    An eps below x's smallest normal number (1e-12 in float16) is raised to it: rounded to 0 there, a zero
    row gave 0 / 0, and the memory written with that key was NaN from then on.
    """
    if not in_float32 and x.dtype.is_floating_point:
        eps = max(eps, torch.finfo(x.dtype).tiny)
    if in_float32:
        # on every device (not only where `_records_grad` picks the CPU's fused backwards)
        if (
            torch.is_grad_enabled()
            and x.requires_grad
            and torch.promote_types(x.dtype, torch.float32) != x.dtype
        ):
            return _L2NormalizeInFloat32.apply(x, eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True).clamp_min(eps * eps))).to(x.dtype)
    if not fused_backward or x.device.type != "cpu" or not _records_grad(x):
        return F.normalize(x, dim=-1, eps=eps)
    return _L2Normalize.apply(x, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        # in at least float32, as F.rms_norm does
        acc = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)
        rstd = rstd.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        y = x * rstd.to(x.dtype)
        if weight is not None:
            y.mul_(weight.to(x.dtype))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, weight, rstd = ctx.saved_tensors
        r = rstd.to(x.dtype)
        g_w = None
        if weight is not None:
            if ctx.needs_input_grad[1]:  # sum over rows of g * x * rstd
                g_w = (g * x).mul_(r).flatten(0, -2).sum(0, dtype=rstd.dtype).to(weight.dtype)
            g = g * weight.to(x.dtype)
        if not ctx.needs_input_grad[0]:
            return None, g_w, None
        # g_x = rstd (g - x rstd^2 <g, x> / d)
        dot = (g * x).sum(-1, keepdim=True, dtype=rstd.dtype)
        coef = dot * rstd.pow(3) / x.shape[-1]
        if x.dtype != rstd.dtype:  # float16: rstd^3 of a small row overflows before x scales it down
            acc = rstd.dtype
            return (g.to(acc) * rstd - x.to(acc) * coef).to(x.dtype), g_w, None
        return torch.mul(g, r).addcmul_(x, coef, value=-1), g_w, None


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim: `F.rms_norm(x, (d,), weight, eps)`, with a
    fused backward on CPU when autograd records (otherwise, and off CPU, `F.rms_norm` itself).

    eps None: `F.rms_norm`'s default on every path, the machine epsilon of the dtype it computes in (at least
    float32: float32's for a bf16 / fp16 x, not x's own), passed explicitly so that the fused backward's
    forward takes it too: a bf16 model then scores tokens alike with and without autograd recording."""
    if eps is None:
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    if x.device.type != "cpu" or not _records_grad(x, weight):
        if weight is not None and weight.dtype != x.dtype:  # bf16 x: keeps the fused kernel (layers/norm.py)
            weight = weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)


__all__ = ["l2_normalize", "rms_norm"]
