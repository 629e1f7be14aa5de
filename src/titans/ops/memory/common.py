"""What the memory op's paths share (`chunk`, `triton_chunk`, `rules`): the memory MLP and its inner
backprop, the activations and their derivatives, the chunk's closed-form coefficients (segment sums of
log-gates), the surprise norm, the clip, the write mask and the weight bound, and the option checks.

Shapes as in `titans.ops.memory.chunk`: q, k, v (B, H, T, d); gates (B, H, T); weights and momentum per
memory layer (B, H, d_in, d_out).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = ("silu", "gelu", "relu")


def activate(x: Tensor, name: str, out: Tensor | None = None) -> Tensor:
    """act(x), written into `out` if given (a view is fine)."""
    if out is not None and torch.compiler.is_compiling():
        # torch.compile cannot trace an op's `out=` into a strided view (a graph break, and in an
        # autograd.Function's backward the whole Function falls back to eager): the same values, copied in
        return out.copy_(activate(x, name))
    if out is not None:
        if name == "silu":
            return torch.ops.aten.silu.out(x, out=out)
        if name == "gelu":
            # gelu.out only into contiguous memory: in torch 2.13 its float32 CPU kernel ignores a strided
            # out's strides and writes contiguously from its first element (tests/test_memory_checkpointing.py
            # catches this). A (N, rows, d) slice of a longer buffer is contiguous per sequence.
            if out.dim() == 3 and out[0].is_contiguous() and x[0].is_contiguous():
                for x_i, out_i in zip(x, out):
                    torch.ops.aten.gelu.out(x_i, out=out_i)
                return out
            return out.copy_(F.gelu(x))
        return torch.clamp(x, min=0, out=out)
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    return F.relu(x)


def act_backward(g: Tensor, x: Tensor, name: str, out: Tensor | None = None) -> Tensor:
    """g * act'(x) as one fused kernel (act' is never materialised), written into `out` if given (for use
    without autograd). Differentiable where the fused kernel has a derivative (gelu, relu); for silu, whose
    fused kernel has none, the formula is used when autograd records."""
    if out is not None and torch.compiler.is_compiling():  # no `out=` into a view under torch.compile
        return out.copy_(act_backward(g, x, name))
    if out is not None:
        if name == "gelu":
            return torch.ops.aten.gelu_backward.grad_input(g, x, grad_input=out)
        if name == "relu":
            return torch.ops.aten.threshold_backward.grad_input(g, x, 0, grad_input=out)
        return torch.ops.aten.silu_backward.grad_input(g, x, grad_input=out)
    if name == "gelu":
        return torch.ops.aten.gelu_backward(g, x)
    if name == "relu":
        return torch.ops.aten.threshold_backward(g, x, 0)
    if torch.is_grad_enabled() and (g.requires_grad or x.requires_grad):
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))
    return torch.ops.aten.silu_backward(g, x)


def act_second(x: Tensor, name: str) -> Tensor | None:
    """act''(x) (None for relu, where it is 0): it carries the outer gradient through the inner one."""
    if name == "silu":
        s = torch.sigmoid(x)
        return (s * (1 - s)).mul_(x * (1 - 2 * s) + 2)
    if name == "gelu":
        x2 = x.square()
        # pdf(x) (2 - x^2), pdf(x) = exp(-x^2 / 2) / sqrt(2 pi)
        return torch.mul(x2, -0.3989422804014327).add_(0.7978845608028654).mul_(x2.mul_(-0.5).exp_())
    return None


def memory_forward(
    x: Tensor, weights: tuple[Tensor, ...] | list[Tensor], activation: str, residual: bool
) -> Tensor:
    """M(x; W): x (B, H, n, d) -> (B, H, n, d). Depth 1 is a matrix; depth L an L-layer MLP."""
    return layers_forward(x, weights, activation, residual)[0]


def layers_forward(
    x: Tensor, ws, activation: str, residual: bool
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """The memory MLP on rows x (..., m, d): its output M(x), each layer's input hs[l] and each hidden
    layer's pre-activation zs[l]."""
    hs, zs = [x], []
    for i, w in enumerate(ws):
        z = torch.matmul(hs[-1], w)
        if i < len(ws) - 1:
            zs.append(z)
            hs.append(activate(z, activation))
    return (z + x if residual else z), hs, zs


def inner_errors(
    delta: Tensor, ws, key_zs: list[Tensor], activation: str
) -> tuple[list[Tensor], list[Tensor]]:
    """Backprop of the inner loss's output error through the MLP, at the key rows: per layer the error
    delta_l after its activation (grad_{W_l} = a_l^T delta_l) and, for the layers after the first,
    e_l = delta_{l+1} W_{l+1}^T before it. key_zs: the hidden pre-activations at the key rows."""
    deltas, es = [delta], []
    for i in range(len(ws) - 1, 0, -1):
        e = torch.matmul(delta, ws[i].transpose(-1, -2))
        delta = act_backward(e, key_zs[i - 1], activation)
        es.append(e)
        deltas.append(delta)
    return deltas[::-1], es[::-1]


def write_mask(norm: Tensor, threshold: float) -> Tensor:
    """Which tokens a surprise-gated memory writes: those whose surprise ||u_t|| (taken at the chunk-start
    weights, before any clipping) is at least `threshold`. norm (...) -> bool (...)."""
    return norm >= threshold


def check_threshold(name: str, value: float | None) -> None:
    """Refuse a surprise threshold that is not None or a finite number >= 0, naming the option."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}")


def check_max_norm(name: str, value: float | None) -> float | None:
    """A bound (on the weights' norm, on a token's surprise) as a float: None, or a finite real number > 0
    (numpy's too; not a bool), else a ValueError naming the option."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
    return float(value)


def bound_scale(w: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / ||W||_F) per matrix: w (..., d_in, d_out) -> (...).

    Written max_norm / max(||W||, max_norm): it never divides by a norm near 0, it is exactly 1 where the
    bound does not bind (so a bounded W is a fixed point), and its gradient reaches ||W|| only where it
    binds."""
    norm = torch.linalg.vector_norm(w, dim=(-2, -1))
    # a true division: `max_norm / tensor` is max_norm * (1 / tensor), which can round m / m to 1 - ulp
    return torch.full_like(norm, max_norm) / norm.clamp_min(max_norm)


def bound_weights(w: Tensor, max_norm: float) -> Tensor:
    """W rescaled to Frobenius norm at most max_norm, per matrix: w (..., d_in, d_out) -> the same shape."""
    return w * bound_scale(w, max_norm)[..., None, None]


def clip_scale(norm: Tensor, max_norm: float) -> Tensor:
    """Factor that rescales a surprise of norm `norm` to at most `max_norm` (1 where already below)."""
    return (max_norm / norm.clamp_min(1e-12)).clamp(max=1.0)


def segsum(log_x: Tensor) -> Tensor:
    """seg[..., m, j] = sum_{l=j+1..m} log_x[..., l-1] for m >= j, -inf above the diagonal.

    log_x: (..., n) -> (..., n + 1, n + 1); index 0 stands for "before the chunk". Built by a masked
    cumsum rather than differences of cumulative sums, so -inf entries (eta = 0) never meet inf - inf.
    """
    n = log_x.shape[-1]
    x = F.pad(log_x, (1, 0)).unsqueeze(-1).expand(*log_x.shape[:-1], n + 1, n + 1)
    strictly_lower = torch.ones(n + 1, n + 1, dtype=torch.bool, device=log_x.device).tril(-1)
    seg = x.masked_fill(~strictly_lower, 0).cumsum(-2)
    lower = torch.ones(n + 1, n + 1, dtype=torch.bool, device=log_x.device).tril()
    return seg.masked_fill(~lower, float("-inf"))


def suffix_sum(log_x: Tensor) -> Tensor:
    """The last row of `segsum`, in O(n): out[..., j] = sum_{l=j..n-1} log_x[..., l], out[..., n] = 0.

    log_x: (..., n) -> (..., n + 1). A plain sum of terms <= 0, so -inf entries stay -inf (no inf - inf).
    """
    return F.pad(log_x.flip(-1).cumsum(-1).flip(-1), (0, 1))


def chunk_coefficients(theta: Tensor, log_eta: Tensor, log_keep: Tensor) -> tuple[Tensor, ...]:
    """Scalar coefficients of the closed-form chunk update.

    theta, log_eta, log_keep: (..., b) for the b tokens of each chunk. Returns
    gamma (..., b), beta (..., b), A_b (...), c (...), E_b (...) such that
    W_b = A_b W_0 + c S_0 - sum_j gamma_j u_j and S_b = E_b S_0 - sum_j beta_j u_j.
    Every exponent is a sum of log-gates (<= 0), so nothing can overflow.
    """
    seg_e = segsum(log_eta)  # (..., b+1, b+1): log E_m / E_j
    seg_a_end = suffix_sum(log_keep)  # (..., b+1): log A_b / A_m
    # sum over m = max(j, 1) .. b of (A_b / A_m) (E_m / E_j), for j = 0 (the S_0 term) .. b. Every term is
    # exp(<= 0) <= 1, so a plain sum of exps cannot overflow; unlike logsumexp its backward stays finite
    # when all terms are exp(-inf) = 0 (momentum off: eta = 0).
    w = (seg_a_end[..., 1:].unsqueeze(-1) + seg_e[..., 1:, :]).exp().sum(-2)
    c, gamma = w[..., 0], theta * w[..., 1:]
    beta = theta * seg_e[..., -1, 1:].exp()
    return gamma, beta, seg_a_end[..., 0].exp(), c, seg_e[..., -1, 0].exp()


def coefficient_dtype(dtype: torch.dtype, *gates: Tensor) -> torch.dtype:
    """The dtype the chunk coefficients are computed in for a state of `dtype`: the widest of `dtype`, the
    gates' dtypes and float32."""
    out = torch.promote_types(dtype, torch.float32)
    for g in gates:
        out = torch.promote_types(out, g.dtype)
    return out


def chunk_mix(
    theta: Tensor, log_eta: Tensor, log_keep: Tensor, chunk_size: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk steps' coefficients for the complete chunks of gates (B, H, T): gamma, beta (N, m, b)
    and mix (N, m, 2, 2) = [[A_b, c], [0, E_b]] per chunk (X' = mix @ [W; S] + U), N = B * H, m = T // b,
    in `dtype`.

    Computed in the widest of the gates' dtype, `dtype` and float32 (`coefficient_dtype`): sums of log-gates
    and their exps lose too much in float16 / bfloat16."""
    batch, heads, seq = theta.shape
    n_full, b = seq // chunk_size, chunk_size
    shape = (batch, heads, n_full, b)
    work = coefficient_dtype(dtype, theta, log_eta, log_keep)
    gamma, beta, decay, carry, mom_decay = chunk_coefficients(
        *(x[..., : n_full * b].to(work).reshape(shape) for x in (theta, log_eta, log_keep))
    )
    mix = torch.stack([decay, carry, torch.zeros_like(decay), mom_decay], -1)
    n_seq = batch * heads
    mix = mix.to(dtype).reshape(n_seq, n_full, 2, 2)
    gamma, beta = (x.to(dtype).reshape(n_seq, n_full, b) for x in (gamma, beta))
    return gamma, beta, mix


def stack_states(weights: tuple[Tensor, ...], momentum: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Each layer's W and S (B, H, r, c) stacked as one (B * H, 2, r, c) state, as the chunk steps take it."""
    return tuple(torch.stack([w, s], 2).reshape(-1, 2, *w.shape[-2:]) for w, s in zip(weights, momentum))


def unstack_states(states, batch: int, heads: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """`stack_states` undone: views of the W and S halves, (B, H, r, c) each."""
    weights = tuple(x[:, 0].view(batch, heads, *x.shape[2:]) for x in states)
    momentum = tuple(x[:, 1].view(batch, heads, *x.shape[2:]) for x in states)
    return weights, momentum


def surprise_parts(inputs: list[Tensor], deltas: list[Tensor]) -> Tensor:
    """Per layer ||a_l||^2 and ||delta_l||^2 of each token, interleaved: (..., n, 2 depth). Each is one
    fused reduction (no squared temporary)."""
    return torch.stack(
        [torch.linalg.vector_norm(t, dim=-1).square() for a, d in zip(inputs, deltas) for t in (a, d)], -1
    )


def surprise_norm(sq_parts: Tensor) -> tuple[Tensor, Tensor]:
    """sq = sum_l ||a_l||^2 ||delta_l||^2 and the surprise ||u_t|| = sqrt(max(sq, 1e-30)), each (..., n)."""
    sq = sq_parts[..., 0::2].mul(sq_parts[..., 1::2]).sum(-1)
    return sq, sq.clamp_min(1e-30).sqrt()


def without_autocast(backward):
    """Run a Function's backward with autocast off, as its forward ran (`neural_memory_chunked` turns it
    off): a backward called inside an autocast region would otherwise run its matmuls in bf16 and meet the
    float32 state gradients in in-place ops."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        tensors = [g for g in grads if g is not None] or list(ctx.saved_tensors)
        with torch.autocast(tensors[0].device.type, enabled=False):
            return backward(ctx, *grads)

    return wrapper
