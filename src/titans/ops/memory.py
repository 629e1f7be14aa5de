"""Chunked parallel neural-memory update (SPEC §2): the fast path.

Inside a chunk of `b` tokens every surprise is taken at the chunk-start weights `W_0`, so with
per-token gates the end-of-chunk state is a *weighted sum* of per-token gradients:

    W_b = A_b W_0 + c S_0 - sum_j gamma_j u_j          S_b = E_b S_0 - sum_j beta_j u_j

with scalar (per batch, head, token) coefficients built from segment sums of log(eta) and log(1-alpha).
For an MLP layer the gradient of token j is an outer product `u_j = a_j^T delta_j` (input activation x
backpropagated error), so `sum_j gamma_j u_j = a^T (gamma * delta)`: ONE matmul per layer per chunk.
No per-token weight or gradient tensor ever exists. The loop runs over chunks only; the outer gradient
flows through it by ordinary autograd.

Shapes: q, k, v (B, H, T, d); theta, log_eta, log_keep (B, H, T); weights/momentum: one tensor per
memory layer, (B, H, d_in, d_out). `log_keep = log(1 - alpha)`; both log-gates are <= 0 and may be
-inf (eta = 0 turns momentum off exactly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = ("silu", "gelu", "relu")


def _act(x: Tensor, name: str) -> Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    return F.relu(x)


def _act_grad(x: Tensor, name: str) -> Tensor:
    """d act / dx, written out so the inner gradient needs no autograd (and stays differentiable)."""
    if name == "silu":
        s = torch.sigmoid(x)
        return s * (1 + x * (1 - s))
    if name == "gelu":
        cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
        pdf = torch.exp(-0.5 * x * x) * 0.3989422804014327
        return cdf + x * pdf
    return (x > 0).to(x.dtype)


def memory_forward(
    x: Tensor, weights: tuple[Tensor, ...] | list[Tensor], activation: str, residual: bool
) -> Tensor:
    """M(x; W): x (B, H, n, d) -> (B, H, n, d). Depth 1 is a matrix; depth L an L-layer MLP."""
    h = x
    for i, w in enumerate(weights):
        if i > 0:
            h = _act(h, activation)
        h = h @ w
    return h + x if residual else h


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


def chunk_coefficients(theta: Tensor, log_eta: Tensor, log_keep: Tensor) -> tuple[Tensor, ...]:
    """Scalar coefficients of the closed-form chunk update.

    theta, log_eta, log_keep: (..., b) for the b tokens of each chunk. Returns
    gamma (..., b), beta (..., b), A_b (...), c (...), E_b (...) such that
    W_b = A_b W_0 + c S_0 - sum_j gamma_j u_j and S_b = E_b S_0 - sum_j beta_j u_j.
    Every exponent is a sum of log-gates (<= 0), so nothing can overflow.
    """
    seg_e = segsum(log_eta)  # (..., b+1, b+1): log E_m / E_j
    seg_a_end = segsum(log_keep)[..., -1, :]  # (..., b+1): log A_b / A_m
    # sum over m = max(j, 1) .. b of (A_b / A_m) (E_m / E_j), for j = 0 (the S_0 term) .. b
    w = torch.logsumexp(seg_a_end[..., 1:].unsqueeze(-1) + seg_e[..., 1:, :], dim=-2)
    c, gamma = w[..., 0].exp(), theta * w[..., 1:].exp()
    beta = theta * seg_e[..., -1, 1:].exp()
    return gamma, beta, seg_a_end[..., 0].exp(), c, seg_e[..., -1, 0].exp()


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-(batch, head) Frobenius inner product of (B, H, m, n) tensors -> (B, H, 1, 1), no temporaries.

    (vecdot, not a (1 x N) @ (N x 1) bmm: on CPU the latter is a slow matrix-vector path, ~20x slower.)"""
    return torch.linalg.vecdot(a.flatten(-2), b.flatten(-2))[..., None, None]


class _StateUpdate(torch.autograd.Function):
    """W' = decay * W + carry * S + dW,  S' = mom_decay * S + dS  (decay, carry, mom_decay: (B, H, 1, 1)).

    The per-chunk state update touches every memory weight several times; written out by hand it costs
    3 passes over the weights forward and 6 backward, against twice that through generic autograd.
    """

    @staticmethod
    def forward(ctx, w, s, decay, carry, mom_decay, dw, ds):
        ctx.save_for_backward(w, s, decay, carry, mom_decay)
        new_s = torch.addcmul(ds, s, mom_decay)
        new_w = torch.addcmul(dw, w, decay).addcmul_(s, carry)
        return new_w, new_s

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_w, g_s):
        w, s, decay, carry, mom_decay = ctx.saved_tensors
        if g_w is None:
            g_w = torch.zeros_like(w)
        if g_s is None:
            g_s = torch.zeros_like(s)
        grad_w = g_w * decay
        grad_s = torch.addcmul(g_s * mom_decay, g_w, carry)
        return grad_w, grad_s, _dot(g_w, w), _dot(g_w, s), _dot(g_s, s), g_w, g_s


def _read_and_grads(
    q: Tensor, k: Tensor, v: Tensor, weights: tuple[Tensor, ...], activation: str, residual: bool
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Retrieval M(q) and the per-token factors of the inner gradient, at fixed weights.

    q, k, v: (B, H, n, d). Queries and keys go through the forward matmuls together. Returns y (B, H, n, d),
    and per layer the inputs a_l (B, H, n, d_in) and errors delta_l (B, H, n, d_out) such that
    grad_{W_l} ||M(k_j) - v_j||^2 = a_l[j]^T delta_l[j].
    """
    n = k.shape[2]
    inputs, pre = [], []
    # split(), not slicing: a slice backpropagates as a zero-filled full-size tensor, split as one cat
    h = torch.cat([k, q], dim=2)
    for i, w in enumerate(weights):
        if i > 0:
            pre.append(h.split(n, dim=2)[0])
            h = _act(h, activation)
        inputs.append(h.split(n, dim=2)[0])
        h = h @ w
    if residual:
        h = h + torch.cat([k, q], dim=2)
    out, y = h.split(n, dim=2)
    delta = 2 * (out - v)
    deltas = [delta]
    for i in range(len(weights) - 1, 0, -1):
        delta = (delta @ weights[i].transpose(-1, -2)) * _act_grad(pre[i - 1], activation)
        deltas.append(delta)
    return y, inputs, deltas[::-1]


def neural_memory_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    theta: Tensor,
    log_eta: Tensor,
    log_keep: Tensor,
    weights: tuple[Tensor, ...],
    momentum: tuple[Tensor, ...],
    *,
    chunk_size: int,
    activation: str = "silu",
    residual: bool = False,
    surprise_clip: float | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Read and write the neural memory over a sequence, chunk by chunk.

    Returns:
        y: (B, H, T, d) retrievals, token t reading the weights at the start of its chunk.
        weights, momentum: the state after the last COMPLETE chunk (a trailing partial chunk is read,
            not written: the caller keeps its tokens pending until the chunk completes).
        surprise: (B, H, T) the norm of each token's inner gradient u_t.
    """
    batch, heads, seq, _ = q.shape
    b = chunk_size
    n_full = seq // b
    gamma = beta = decay = carry = mom_decay = None
    if n_full:
        shape = (batch, heads, n_full, b)
        gamma, beta, decay, carry, mom_decay = chunk_coefficients(
            theta[..., : n_full * b].reshape(shape),
            log_eta[..., : n_full * b].reshape(shape),
            log_keep[..., : n_full * b].reshape(shape),
        )
        # per-chunk views made once; indexing inside the loop would backpropagate full-size zeros per chunk
        gamma, beta, decay, carry, mom_decay = (x.unbind(2) for x in (gamma, beta, decay, carry, mom_decay))
    w, s = tuple(weights), tuple(momentum)
    ys, surprises = [], []
    for ci, (q_c, k_c, v_c) in enumerate(zip(q.split(b, dim=2), k.split(b, dim=2), v.split(b, dim=2))):
        n = q_c.shape[2]
        # Read-before-write: queries and keys both see the chunk-start weights.
        y, inputs, deltas = _read_and_grads(q_c, k_c, v_c, w, activation, residual)
        ys.append(y)
        sq = sum(a.pow(2).sum(-1) * d.pow(2).sum(-1) for a, d in zip(inputs, deltas))
        norm = sq.clamp_min(1e-30).sqrt()  # (B, H, n): ||u_t|| = sqrt(sum_l ||a_l||^2 ||delta_l||^2)
        surprises.append(norm)
        if n < b:
            break
        if surprise_clip is not None:
            deltas = [d * clip_scale(norm, surprise_clip).unsqueeze(-1) for d in deltas]
        g, bt = -gamma[ci].unsqueeze(-1), -beta[ci].unsqueeze(-1)
        dc, cc, md = (x[ci][..., None, None] for x in (decay, carry, mom_decay))
        new_w, new_s = [], []
        for w_l, s_l, a, d in zip(w, s, inputs, deltas):
            a_t = a.transpose(-1, -2)
            # the weighted sums of per-token outer products, one matmul each: -a^T (gamma * delta)
            nw, ns = _StateUpdate.apply(w_l, s_l, dc, cc, md, a_t @ (g * d), a_t @ (bt * d))
            new_w.append(nw)
            new_s.append(ns)
        w, s = tuple(new_w), tuple(new_s)
    return torch.cat(ys, 2), w, s, torch.cat(surprises, 2)
