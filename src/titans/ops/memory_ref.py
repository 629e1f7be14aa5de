"""Reference neural-memory recurrence: SPEC §1-2 written literally, one token at a time.

This is the ground truth the fast chunked path (`titans.ops.memory`) is tested against. It is slow on
purpose: a Python loop over tokens, inner gradients by autograd, no algebra. Use it in float64.

Per token t inside a chunk that starts after position t' (all tensors per batch element and head):

    u_t = grad_W || M(k_t; W_{t'}) - v_t ||^2           surprise, taken at the chunk-start weights
    S_t = eta_t * S_{t-1} - theta_t * u_t                momentum
    W_t = (1 - alpha_t) * W_{t-1} + S_t                  forgetting
    y_t = M(q_t; W_{t'})                                 read-before-write at chunk granularity

Only complete chunks are written; a trailing partial chunk is read (and its surprise reported) but its
update is left for the caller to apply once the chunk completes (see `NeuralMemory`'s pending tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titans.ops.memory import clip_scale, memory_forward


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
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Same contract as `titans.ops.memory.neural_memory_chunked`; see there for shapes."""
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
            ys.append(memory_forward(q[:, :, t : t + 1], w_chunk, activation, residual)[:, :, 0])
            pred = memory_forward(k[:, :, t : t + 1], w_chunk, activation, residual)
            loss = (pred - v[:, :, t : t + 1]).pow(2).sum()
            # Each (batch, head) owns its weights, so the gradient of the sum is the per-head gradient.
            u = torch.autograd.grad(loss, w_chunk, create_graph=True)
            norm = torch.stack([g.pow(2).sum((-1, -2)) for g in u]).sum(0).sqrt()  # (B, H)
            surprises.append(norm)
            if surprise_clip is not None:
                u = [g * clip_scale(norm, surprise_clip)[..., None, None] for g in u]
            if complete:
                th, et, kp = (x[:, :, t, None, None] for x in (theta, eta, keep))
                s = [et * s_l - th * u_l for s_l, u_l in zip(s, u)]
                w = [kp * w_l + s_l for w_l, s_l in zip(w, s)]
    return torch.stack(ys, 2), tuple(w), tuple(s), torch.stack(surprises, 2)
