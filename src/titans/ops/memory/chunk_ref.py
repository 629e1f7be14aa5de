"""Reference neural-memory recurrence: the equations of docs/design.md ("The memory") written literally,
one token at a time.

This is the ground truth the fast chunked path (`titans.ops.memory.chunk`) is tested against. It is slow on
purpose: a Python loop over tokens, inner gradients by autograd, no algebra. Use it in float64. It shares
no code with the fast path (its own memory MLP and clipping), so a bug there cannot hide on both sides of
a test.

Per token t inside a chunk that starts after position t' (all tensors per batch element and head):

    u_t = grad_W || M(k_t; W_{t'}) - v_t ||^2           surprise, taken at the chunk-start weights
    S_t = eta_t * S_{t-1} - theta_t * u_t                momentum
    W_t = (1 - alpha_t) * W_{t-1} + S_t                  forgetting
    y_t = M(q_t; W_{t'})                                 read-before-write at chunk granularity

M(x; W) = x W_1 for depth 1, act(... act(x W_1) ...) W_L for depth L (+ x with `residual`). With
`surprise_clip` c, u_t is scaled by min(1, c / ||u_t||) (||.|| over all of the token's layers). With
`surprise_threshold` tau, a token whose surprise ||u_t|| (at the chunk-start weights, before clipping) is
below tau is not written: u_t is replaced by 0 in the momentum step, while eta_t and alpha_t still act.
With `max_norm` m, at the end of every complete chunk (after its last token's momentum and forgetting
step) each layer's weights are rescaled, W_l <- W_l * min(1, m / ||W_l||_F) per batch element and head;
the momentum S is left as it is. With an `anchor` W_init, forgetting pulls W toward it instead of toward
zero: W_t = (1 - alpha_t) * W_{t-1} + alpha_t * W_init + S_t.

Only complete chunks are written; a trailing partial chunk is read (and its surprise reported) but its
update is left for the caller to apply once the chunk completes (see `NeuralMemory`'s pending tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _mlp(x: Tensor, weights: list[Tensor], activation: str, residual: bool) -> Tensor:
    """M(x; W): x (B, H, n, d) through the layers W_l (B, H, d_l, d_{l+1}), the activation between them."""
    h = x
    for i, w in enumerate(weights):
        if i:
            h = _ACTIVATIONS[activation](h)
        h = h @ w
    return h + x if residual else h


def _norm_bound(w: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / ||w||_F) for w (B, H, d_in, d_out) -> (B, H)."""
    norm = torch.linalg.matrix_norm(w)  # Frobenius
    return torch.clamp(max_norm / norm.clamp_min(torch.finfo(norm.dtype).tiny), max=1.0)


def neural_memory_ref(
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
    surprise_threshold: float | None = None,
    max_norm: float | None = None,
    anchor: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Same contract as `titans.ops.memory.chunk.neural_memory_chunked`; see there for shapes."""
    _, _, seq, _ = q.shape
    eta, keep = log_eta.exp(), log_keep.exp()
    w = list(weights)
    s = list(momentum)
    ys, surprises = [], []
    for start in range(0, seq, chunk_size):
        end = min(start + chunk_size, seq)
        complete = end - start == chunk_size
        w_chunk = [p if p.requires_grad else p.detach().requires_grad_(True) for p in w]
        for t in range(start, end):
            ys.append(_mlp(q[:, :, t : t + 1], w_chunk, activation, residual)[:, :, 0])
            pred = _mlp(k[:, :, t : t + 1], w_chunk, activation, residual)
            loss = (pred - v[:, :, t : t + 1]).pow(2).sum()
            # Each (batch, head) owns its weights, so the gradient of the sum is the per-head gradient.
            u = torch.autograd.grad(loss, w_chunk, create_graph=True)
            # (B, H); floored as the fast path floors it: sqrt's derivative at an exact 0 (a dead relu
            # layer) is infinite, and times 0 a NaN gradient
            norm = torch.stack([g.pow(2).sum((-1, -2)) for g in u]).sum(0).clamp_min(1e-30).sqrt()
            surprises.append(norm)
            if surprise_clip is not None:  # min(1, c / ||u||); a zero surprise stays zero
                scale = torch.clamp(surprise_clip / norm.clamp_min(torch.finfo(norm.dtype).tiny), max=1.0)
                u = [g * scale[..., None, None] for g in u]
            if surprise_threshold is not None:  # below the threshold: no gradient enters S
                keep_u = (norm.detach() >= surprise_threshold).to(norm.dtype)
                u = [g * keep_u[..., None, None] for g in u]
            if complete:
                th, et, kp = (x[:, :, t, None, None] for x in (theta, eta, keep))
                s = [et * s_l - th * u_l for s_l, u_l in zip(s, u)]
                if anchor is None:
                    w = [kp * w_l + s_l for w_l, s_l in zip(w, s)]
                else:
                    w = [kp * w_l + (1 - kp) * a_l + s_l for w_l, a_l, s_l in zip(w, anchor, s)]
        if complete and max_norm is not None:  # the chunk boundary: ||W_l|| <= max_norm
            w = [w_l * _norm_bound(w_l, max_norm)[..., None, None] for w_l in w]
    return torch.stack(ys, 2), tuple(w), tuple(s), torch.stack(surprises, 2)
