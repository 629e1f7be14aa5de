"""Reference memory rules: the MIRAS / ATLAS update equations written literally, one token at a time.

The ground truth `titans.ops.memory.rules.memory_rule_chunked` is tested against: a Python loop over tokens,
inner gradients by autograd of the inner loss itself (not of an error map), float64. It shares no code
with the fast path (its own MLP, losses, retention maps and Newton-Schulz).

Per token t in a chunk starting after position t' (per batch element and head), with W(A) the rule's
retention map (identity; A / ||A||_q^(q-2); scale * softmax over each row, scale 1 by default):

    loss_i(W)  = ||M(k_i; W) - v_i||^2 | sum |M(k_i; W) - v_i|^p | Huber_{delta_i}(M(k_i; W) - v_i)
    u_t        = grad_W sum_{i = t-c+1..t} omega_i loss_i(W) at W = W(A_{t'})   (omega = 1 for c = 1)
    clip:        u_t <- u_t * min(1, clip / ||u_t||)
    threshold:   u_t <- 0 where ||u_t|| (before clipping) < threshold (a surprise-gated write)
    momentum SGD: S_t = eta_t S_{t-1} - theta_t u_t,   A_t = keep_t A_{t-1} + S_t
    Muon:         S_t = eta_t S_{t-1} - u_t,           A_t = keep_t A_{t-1} + theta_t NS(S_b)
                  (S_b the momentum at the chunk's end: one orthogonalisation per chunk)
    y_t = M(q_t; W(A_{t'}))

Window terms i before the chunk (at most c - 1 of them, the sequence's earlier tokens or the `history`
rows) are evaluated at the current chunk's weights like the others. Only complete chunks are written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _mlp(x: Tensor, ws: list[Tensor], activation: str, residual: bool) -> Tensor:
    """M(x; W) for one token per (batch, head): x (B, H, d), W_l (B, H, d_l, d_{l+1}) -> (B, H, d)."""
    h = x.unsqueeze(-2)
    for i, w in enumerate(ws):
        if i:
            h = _ACT[activation](h)
        h = h @ w
    h = h.squeeze(-2)
    return h + x if residual else h


def _decay(retention, a: Tensor) -> Tensor:
    return a


def _lq(retention, a: Tensor) -> Tensor:
    q = float(retention.q)
    return a / ((a.abs() ** q).sum((-1, -2), keepdim=True) ** (1.0 / q)) ** (q - 2)


def _kl(retention, a: Tensor) -> Tensor:
    e = torch.exp(a - a.amax(-1, keepdim=True))
    return retention.scale * e / e.sum(-1, keepdim=True)


# W(A) per retention kind
_WEIGHTS = {"decay": _decay, "lq": _lq, "kl": _kl}


def _l2(bias, e: Tensor, delta: Tensor | None) -> Tensor:
    return (e * e).sum(-1)


def _lp(bias, e: Tensor, delta: Tensor | None) -> Tensor:
    p = float(bias.p)
    if p >= 2:
        return (e.abs() ** p).sum(-1)
    return ((e * e + bias.eps**2) ** (p / 2)).sum(-1)


def _huber(bias, e: Tensor, delta: Tensor) -> Tensor:
    d = delta.unsqueeze(-1)
    inside = e.abs() <= d
    return torch.where(inside, e * e, 2 * d * e.abs() - d * d).sum(-1)


# the per (batch, head) inner loss of the error e (B, H, d), delta (B, H), per bias kind
_LOSSES = {"l2": _l2, "lp": _lp, "huber": _huber}
_OPTIMIZERS = ("sgd", "muon")


def _written_here(table, part, what: str):
    """The reference's equation for `part`'s kind: a kind it has none for is an error, never another's."""
    if part.kind not in table:
        raise NotImplementedError(f"memory_rule_ref: no reference {what} for kind {part.kind!r}")
    return table[part.kind]


def _orthogonalise(x: Tensor, steps: int) -> Tensor:
    """Quintic Newton-Schulz on each (m, n) matrix of x: X / ||X||_F, then X <- aX + bAX + cA^2X, A = XX^T."""
    flip = x.shape[-2] > x.shape[-1]
    if flip:
        x = x.transpose(-1, -2)
    # ||X|| floored at 1e-7, through its square: sqrt's derivative at an exact 0 would be a NaN gradient
    norm = torch.sqrt(torch.clamp((x * x).sum((-1, -2), keepdim=True), min=1e-14))
    x = x / norm
    for _ in range(steps):
        gram = x @ x.transpose(-1, -2)
        x = 3.4445 * x - 4.7750 * (gram @ x) + 2.0315 * (gram @ (gram @ x))
    return x.transpose(-1, -2) if flip else x


def memory_rule_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Tensor,
    weights: tuple[Tensor, ...],
    momentum: tuple[Tensor, ...],
    *,
    rule,
    chunk_size: int,
    history: int = 0,
    activation: str = "silu",
    residual: bool = False,
    surprise_clip: float | None = None,
    surprise_threshold: float | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Same contract as `titans.ops.memory.rules.memory_rule_chunked`."""
    total = q.shape[2]
    c = rule.window.size
    channels = rule.extra_gates
    if rule.optimizer.kind not in _OPTIMIZERS:
        raise NotImplementedError(f"memory_rule_ref: no reference optimizer for kind {rule.optimizer.kind!r}")
    muon = rule.optimizer.kind == "muon"
    weights_of = _written_here(_WEIGHTS, rule.retention, "retention")
    loss_of = _written_here(_LOSSES, rule.bias, "bias")
    theta, eta, keep = gates[..., 0], gates[..., 1].exp(), gates[..., 2].exp()
    omega = gates[..., 3 + channels.index("omega")] if "omega" in channels else None
    delta = gates[..., 3 + channels.index("delta")] if "delta" in channels else None
    a_state, s_state = list(weights), list(momentum)
    ys, surprises = [], []
    for start in range(history, total, chunk_size):
        end = min(start + chunk_size, total)
        complete = end - start == chunk_size
        a_leaf = [a if a.requires_grad else a.detach().requires_grad_(True) for a in a_state]
        w = [weights_of(rule.retention, a) for a in a_leaf]
        us = []
        for t in range(start, end):
            ys.append(_mlp(q[:, :, t], w, activation, residual))
            objective = 0
            for i in range(max(0, t - c + 1), t + 1):
                e = _mlp(k[:, :, i], w, activation, residual) - v[:, :, i]
                li = loss_of(rule.bias, e, None if delta is None else delta[:, :, i])
                objective = objective + (li if omega is None else omega[:, :, i] * li)
            u = torch.autograd.grad(objective.sum(), w, create_graph=True)
            # floored as the fast path floors it (an exact 0 would give a NaN gradient through sqrt)
            norm = torch.sqrt(torch.clamp(sum((g * g).sum((-1, -2)) for g in u), min=1e-30))
            surprises.append(norm)
            if surprise_clip is not None:
                factor = torch.clamp(surprise_clip / torch.clamp(norm, min=1e-300), max=1.0)
                u = [g * factor[..., None, None] for g in u]
            if surprise_threshold is not None:
                written = (norm.detach() >= surprise_threshold).to(norm.dtype)
                u = [g * written[..., None, None] for g in u]
            us.append(u)
        if not complete:
            continue
        for j, t in enumerate(range(start, end)):
            th, et = theta[:, :, t, None, None], eta[:, :, t, None, None]
            if muon:
                s_state = [et * s - g for s, g in zip(s_state, us[j])]
            else:
                s_state = [et * s - th * g for s, g in zip(s_state, us[j])]
                a_state = [keep[:, :, t, None, None] * a + s for a, s in zip(a_state, s_state)]
        if muon:
            steps = [_orthogonalise(s, rule.optimizer.steps) for s in s_state]
            for t in range(start, end):
                kp, th = keep[:, :, t, None, None], theta[:, :, t, None, None]
                a_state = [kp * a + th * o for a, o in zip(a_state, steps)]
    if not ys:
        return q[:, :, :0], tuple(a_state), tuple(s_state), q[:, :, :0, 0]
    return torch.stack(ys, 2), tuple(a_state), tuple(s_state), torch.stack(surprises, 2)
