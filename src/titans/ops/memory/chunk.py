"""Chunked parallel neural-memory update (docs/design.md, "The chunked form"): the fast path.

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
from torch import Tensor

from titans.ops.cpu_kernels import kernels
from titans.ops.memory.common import (
    ACTIVATIONS,
    act_backward,
    act_second,
    activate,
    bound_scale,
    check_max_norm,
    check_threshold,
    chunk_mix,
    clip_scale,
    inner_errors,
    layers_forward,
    stack_states,
    surprise_norm,
    surprise_parts,
    unstack_states,
    without_autocast,
    write_mask,
)
from titans.validation import check_int


def _chunk_forward(
    kq, v, gamma, beta, mix, activation, residual, clip, threshold, states, out=None, error=None, aux=None
):
    """The forward math of `_ChunkStep` (shapes there): y, the surprise norms, the new states, and what
    the backward pass needs. `out`: buffers to write the new states into (only where nothing is saved).
    error, aux: the inner loss's error map (None: l2, 2 e) and its per-token input (N, n); with an error
    map the output error e is appended to what the backward pass needs."""
    n = v.shape[1]
    ws = [x[:, 0] for x in states]
    # hs[l]: input of layer l for keys then queries (N, 2n, d_in)
    out_all, hs, zs = layers_forward(kq, ws, activation, residual)
    e_out = out_all[:, :n] - v
    err = 2 * e_out if error is None else error.value(e_out, aux)
    deltas, es = inner_errors(err, ws, [z[:, :n] for z in zs], activation)
    sq_parts = surprise_parts([h[:, :n] for h in hs], deltas)  # kept for the backward pass
    _, norm = surprise_norm(sq_parts)
    scale = clip_scale(norm, clip) if clip is not None else torch.ones_like(norm)
    if threshold is not None:  # surprise-gated write: a 0/1 factor on each token's gradient
        scale = scale * write_mask(norm, threshold).to(scale.dtype)
    coef = _write_coefficients(gamma, beta, scale)
    new_states = []
    for i, (h, d, x) in enumerate(zip(hs, deltas, states)):
        new_states.append(_state_update(x, mix, h[:, :n], d, coef, None if out is None else out[i]))
    # the hidden activations and errors are cheap to recompute from zs and es: not kept
    saved = (sq_parts, norm, scale, hs[0], deltas[-1], *zs, *es) + (() if error is None else (e_out,))
    return out_all[:, n:], norm, new_states, saved


def _state_kernels(t: Tensor):
    """The fused state-update kernels where they apply to `t` (CPU, float32/64, outside torch.compile: a
    pybind kernel would break the graph, where the torch ops fuse), else None."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
        return None
    return None if torch.compiler.is_compiling() else kernels()


def _step_kernel(k: Tensor, error, states) -> object | None:
    """The fused no-grad chunk step (`chunk_step_forward`) where it covers the call: the l2 inner loss,
    memory depth 1 or 2, the state kernels' devices and dtypes, one dtype throughout; else None."""
    if error is not None or len(states) not in (1, 2) or any(x.dtype != k.dtype for x in states):
        return None
    return _state_kernels(k)


def _step_options(activation: str, residual: bool, clip, threshold, anchor) -> tuple:
    """`chunk_step_forward`'s arguments after the chunk's tensors: the anchors ([] for none), the activation's
    index in ACTIVATIONS, residual, and the clip and threshold (-1 for none)."""
    anchors = [] if anchor is None else [a.contiguous() for a in anchor]
    return (
        anchors,
        ACTIVATIONS.index(activation),
        residual,
        -1.0 if clip is None else clip,
        -1.0 if threshold is None else threshold,
    )


def _state_update(x: Tensor, mix: Tensor, a: Tensor, d: Tensor, coef: Tensor, out: Tensor | None) -> Tensor:
    """X' = mix @ X + U per sequence, U = [sum_j c_W,j a_j^T d_j; sum_j c_S,j a_j^T d_j] (both weighted sums
    of the chunk's per-token outer products). x, out: (N, 2, d_in, d_out); mix: (N, 2, 2); a: (N, n, d_in);
    d: (N, n, d_out); coef: (N, n, 2, 1).

    The coefficients scale the smaller factor (`_weighted_sums`). On CPU the matmuls write U into `out` and
    the fused kernel adds mix @ X to it in one pass (no U buffer); otherwise mix @ X is written first and
    U accumulated into it (a second pass over X')."""
    n_seq = x.shape[0]
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel = _state_kernels(x)
    fused = kernel is not None and x.is_contiguous() and out.is_contiguous()
    if not fused:
        torch.bmm(mix, x.flatten(2), out=out.view(n_seq, 2, -1))
    _weighted_sums(a, d, coef, out, accumulate=not fused)
    if fused:
        kernel.state_mix_forward(x.view(n_seq, 2, -1), mix.contiguous(), out.view(n_seq, 2, -1))
    return out


def _scale_inputs(a: Tensor, d: Tensor) -> bool:
    """Whether the weighted sums scale the inputs a (d_in <= d_out) rather than the errors d: the smaller of
    the two scaled copies, written and read in the forward pass and again in the backward pass."""
    return a.shape[-1] <= d.shape[-1]


def _bmm_into(out: Tensor, b1: Tensor, b2: Tensor, accumulate: bool) -> None:
    """out (+)= b1 @ b2 per batch, out (N, m, p) possibly a strided view (a slice of a state's rows).

    CPU baddbmm_ into a view whose rows are not one contiguous batch falls back to one addmm per batch
    (about 6x slower at the memory's sizes); a contiguous product added or copied in is not."""
    if out.is_contiguous() or out.device.type != "cpu":
        out.baddbmm_(b1, b2, beta=1 if accumulate else 0)
    elif accumulate:
        out.add_(torch.bmm(b1, b2))
    else:
        out.copy_(torch.bmm(b1, b2))


def _weighted_sums(a: Tensor, d: Tensor, coef: Tensor, out: Tensor, accumulate: bool) -> None:
    """out (N, 2, d_in, d_out) (+)= U. Scaling the inputs, U is ONE matmul, [c_W a | c_S a]^T d: its
    (2 d_in, d_out) result is the state's layout; scaling the errors, one matmul per half, a^T (c_s d)."""
    n_seq, d_out, beta = a.shape[0], d.shape[-1], 1 if accumulate else 0
    if _scale_inputs(a, d):
        out.view(n_seq, -1, d_out).baddbmm_(_scaled_inputs(a, coef).transpose(1, 2), d, beta=beta)
        return
    scaled = d.unsqueeze(-2) * coef  # (N, n, 2, d_out)
    for half in range(2):
        _bmm_into(out[:, half], a.transpose(1, 2), scaled[:, :, half], accumulate)


def _weighted_sums_backward(
    a: Tensor, d: Tensor, coef: Tensor, g_u: Tensor, g_coef: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients of U = `_weighted_sums(a, d, coef)` given g_u = dL/dU (N, 2, d_in, d_out): returns dL/da
    (N, n, d_in) and dL/dd (N, n, d_out), and adds dL/dcoef to g_coef (N, n, 2)."""
    n_seq, n, d_out = d.shape
    if _scale_inputs(a, d):
        g_flat = g_u.view(n_seq, -1, d_out)  # (N, 2 d_in, d_out)
        g_d = torch.bmm(_scaled_inputs(a, coef), g_flat)
        g_scaled = torch.bmm(d, g_flat.transpose(1, 2)).view(n_seq, n, 2, -1)  # dL/d[c_W a | c_S a]
        g_a = torch.matmul(coef.transpose(-1, -2), g_scaled).squeeze(-2)
        g_coef += (g_scaled * a.unsqueeze(-2)).sum(-1)
        return g_a, g_d
    scaled = d.unsqueeze(-2) * coef
    g_scaled = [torch.bmm(a, g_u[:, half]) for half in range(2)]  # dL/d(c_s d): (N, n, d_out) each
    g_d = torch.addcmul(g_scaled[0] * coef[:, :, 0], g_scaled[1], coef[:, :, 1])
    for half in range(2):
        g_coef[..., half] += torch.linalg.vecdot(g_scaled[half], d)
    g_a = torch.bmm(scaled[:, :, 0], g_u[:, 0].transpose(1, 2))
    g_a.baddbmm_(scaled[:, :, 1], g_u[:, 1].transpose(1, 2))
    return g_a, g_d


def _mix_backward(g: Tensor, x: Tensor, mix: Tensor, g_x: Tensor | None, g_mix: Tensor | None) -> None:
    """For X' = mix @ X per sequence: g_mix += g @ X^T and g_x = mix^T @ g (either may be None).

    g, x, g_x: (N, 2, P); mix, g_mix: (N, 2, 2). On CPU the fused kernel reads g once for both (the two
    bmms below each read all of it); elsewhere, or without the kernel, the two bmms."""
    if g_x is None and g_mix is None:
        return
    kernel = _state_kernels(g)
    if kernel is not None:
        kernel.state_mix_backward(g.contiguous(), x.contiguous(), mix.contiguous(), g_x, g_mix)
        return
    if g_mix is not None:
        g_mix.baddbmm_(g, x.transpose(1, 2))
    if g_x is not None:
        torch.bmm(mix.transpose(1, 2), g, out=g_x)


def _rhs_buffer(like: Tensor, n: int, with_deltas: bool) -> Tensor:
    """An empty (N, 2n, d) or, with the n rows of a delta appended, (N, 3n, d) buffer like `like`."""
    return like.new_empty(like.shape[0], (3 if with_deltas else 2) * n, like.shape[-1])


def _write_coefficients(gamma: Tensor, beta: Tensor, scale: Tensor) -> Tensor:
    """(N, n) gates and clip scale -> (N, n, 2, 1): the signed weights of each token's gradient in W, S."""
    return torch.stack([gamma * scale, beta * scale], -1).neg_().unsqueeze(-1)


def _scaled_inputs(a: Tensor, coef: Tensor) -> Tensor:
    """a (N, n, d_in), coef (N, n, 2, 1) -> [c_W a | c_S a] (N, n, 2 d_in)."""
    return (a.unsqueeze(-2) * coef).flatten(-2)


class _GradBuffers:
    """Two state-gradient buffers per layer that the chunk steps of one `run_chunks` call take turns with
    in the backward pass (chunk c writes slot c % 2).

    A fresh weight-sized gradient per chunk can land on newly faulted pages (`benchmarks/memory_profile.py`
    compares both; docs/benchmarks.md has the numbers). Reuse is safe because the backward pass runs the
    chunks in reverse order and each chunk's state gradient goes only to the chunk before it: when chunk
    c - 2 overwrites slot c % 2, chunk c - 1 has already consumed what chunk c wrote there.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], Tensor] = {}

    @staticmethod
    def get(grad_slot: tuple[_GradBuffers, int] | None, layer: int, like: Tensor) -> Tensor:
        """The state-gradient buffer of `layer` for a chunk step's `grad_slot` ((buffers, slot)), or a fresh
        one where it is None (under torch.compile, which cannot trace the buffers' dict being filled in a
        Function's backward: "HOP: Unsafe side effect", and the Function falls back to eager)."""
        if grad_slot is None:
            return torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return grad_slot[0].take(grad_slot[1], layer, like)

    def take(self, slot: int, layer: int, like: Tensor) -> Tensor:
        buf = self._buffers.get((slot, layer))
        if buf is None:
            buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            self._buffers[(slot, layer)] = buf
        return buf


def _bound_(x: Tensor, max_norm: float) -> Tensor:
    """`_BoundState`'s forward without autograd: W of x (N, 2, d_in, d_out) rescaled in place; returns s
    (N,)."""
    scale = bound_scale(x[:, 0], max_norm)
    x[:, 0].mul_(scale[:, None, None])
    return scale


def _bounded(x: Tensor, max_norm: float) -> Tensor:
    """`_BoundState` out of place, differentiated by autograd: under torch.compile, which cannot trace the
    Function's `mark_dirty` nor its backward's `out=` into a view (graph breaks), and fuses this anyway."""
    w = x[:, 0] * bound_scale(x[:, 0], max_norm)[:, None, None]
    return torch.stack((w, x[:, 1]), 1)


def _anchor_(x: Tensor, keep: Tensor, anchor: Tensor) -> Tensor:
    """`_AnchorState`'s forward without autograd: W of x += (1 - keep) anchor in place; returns x."""
    x[:, 0].addcmul_(anchor, (1 - keep)[:, None, None])
    return x


class _BoundState(torch.autograd.Function):
    """A chunk step's new state X = [W; S] (N, 2, d_in, d_out) with W rescaled in place by
    s = min(1, max_norm / ||W||_F) per sequence, S as it is (`neural_memory_chunked(max_norm=...)`).

    In place, saving only its output and s: the next chunk step saves that output as its input anyway, so
    under autograd the bound keeps no extra state-sized tensor per chunk (a generic `x * s` would keep the
    unbounded X as well). Backward, where the bound binds (s < 1, ||W'|| = max_norm for W' = s W):
    dL/dW = s (g - <g, W'> W' / max_norm^2); elsewhere g.
    """

    @staticmethod
    def forward(ctx, x: Tensor, max_norm: float) -> Tensor:
        scale = _bound_(x, max_norm)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, scale)
        ctx.max_norm = max_norm
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        x, scale = ctx.saved_tensors
        w, g_w = x[:, 0], g[:, 0]
        inner = torch.linalg.vecdot(g_w.flatten(1), w.flatten(1))  # <g, W'> per sequence
        coef = torch.where(scale < 1, inner / ctx.max_norm**2, 0.0)
        g_x = torch.empty_like(g, memory_format=torch.contiguous_format)
        g_x[:, 1] = g[:, 1]
        torch.mul(g_w, scale[:, None, None], out=g_x[:, 0])
        g_x[:, 0].addcmul_(w, (-scale * coef)[:, None, None])
        return g_x, None


class _AnchorState(torch.autograd.Function):
    """A chunk step's new state X = [W; S] (N, 2, d_in, d_out) with (1 - A_b) W_anchor added to W in place,
    A_b (N,) the chunk's product of (1 - alpha): forgetting pulls W toward the anchor (the learned initial
    weights) instead of toward zero (`neural_memory_chunked(anchor=...)`). In place, like `_BoundState`;
    it saves the anchor (N, d_in, d_out) and A_b, never the state."""

    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor, anchor: Tensor) -> Tensor:
        _anchor_(x, keep, anchor)
        ctx.mark_dirty(x)
        ctx.save_for_backward(keep, anchor)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        keep, anchor = ctx.saved_tensors
        g_w = g[:, 0]
        g_keep = -torch.linalg.vecdot(g_w.flatten(1), anchor.flatten(1)) if ctx.needs_input_grad[1] else None
        g_anchor = g_w * (1 - keep)[:, None, None] if ctx.needs_input_grad[2] else None
        return g, g_keep, g_anchor


class _ChunkStep(torch.autograd.Function):
    """One complete chunk: read M(q; W_0), take every key's inner gradient at W_0, write the chunk.

    N = batch * heads. kq: (N, 2n, d) the chunk's keys then its queries; v: (N, n, d); gamma, beta: (N, n);
    mix: (N, 2, 2) = [[A_b, c], [0, E_b]];
    states: per layer X = [W; S] stacked, (N, 2, d_in, d_out). Returns y (N, n, d), the surprise norms
    (N, n) and per layer X' = mix @ X - [a^T (gamma * delta); a^T (beta * delta)].

    Forward and backward are written out by hand so that every weight-sized tensor is touched as few times
    as possible (on CPU they are memory-bound passes, the cost that matters besides the matmuls):
    stacking W and S makes the state update one pass each way (`_state_update`, `_mix_backward`: a fused
    CPU kernel, else bmms), and each layer's weight gradient from its read, its inner-gradient backprop
    and the state update is ONE baddbmm into the state gradient, with no autograd accumulation passes.
    """

    @staticmethod
    def forward(
        ctx, kq, v, gamma, beta, mix, activation, residual, clip, threshold, grad_slot, error, aux, *states
    ):
        ctx.set_materialize_grads(False)
        y, norm, new_states, saved = _chunk_forward(
            kq, v, gamma, beta, mix, activation, residual, clip, threshold, states, error=error, aux=aux
        )
        ctx.activation, ctx.residual, ctx.clip, ctx.depth = activation, residual, clip, len(states)
        ctx.threshold = threshold
        ctx.grad_slot = grad_slot  # (_GradBuffers, slot) for the state gradients this step returns, or None
        ctx.error = error
        # with an error map, its input e (saved's last entry) and aux go last
        core, extra = (saved, ()) if error is None else (saved[:-1], (saved[-1], aux))
        ctx.save_for_backward(gamma, beta, mix, *core, *states, *extra)
        return (y, norm, *new_states)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, g_y, g_norm, *g_new):
        depth, act = ctx.depth, ctx.activation
        saved = list(ctx.saved_tensors)
        if ctx.error is not None:
            e_out, aux = saved[-2:]
            saved = saved[:-2]
        gamma, beta, mix, sq_parts, norm, scale, h0, delta_out = saved[:8]
        zs, es, states = saved[8 : 7 + depth], saved[7 + depth : 6 + 2 * depth], saved[6 + 2 * depth :]
        n_seq, n = gamma.shape
        # layer l >= 1's input act(z) (recomputed) fills the first 2n rows of a (N, 3n, d_in) buffer whose
        # last n rows later take e_l's gradient: the two left factors of W_l's gradient, without a cat
        lhs_bufs = [z.new_empty(n_seq, 3 * n, z.shape[-1]) for z in zs]
        hs = [h0] + [activate(z, act, out=buf[:, : 2 * n]) for z, buf in zip(zs, lhs_bufs)]
        z_keys = [z[:, :n] for z in zs]
        deltas = [act_backward(e, z, act) for e, z in zip(es, z_keys)] + [delta_out]
        ws = [x[:, 0] for x in states]
        needs = ctx.needs_input_grad
        coef = _write_coefficients(gamma, beta, scale)

        # 1. X' = mix @ X + U: grads of mix (all four inner products in one pass), of X and of U (= g_new)
        g_mix = torch.zeros_like(mix) if needs[4] else None
        g_states, g_a, g_delta = [], [], []
        g_coef = torch.zeros(n_seq, n, 2, dtype=gamma.dtype, device=gamma.device)
        for i, (x, gx) in enumerate(zip(states, g_new)):
            h, d = hs[i][:, :n], deltas[i]
            if gx is None:
                g_states.append(None)
                g_a.append(torch.zeros_like(h))
                g_delta.append(torch.zeros_like(d))
                continue
            g_flat = gx.reshape(n_seq, 2, -1)
            g_x = _GradBuffers.get(ctx.grad_slot, i, x) if needs[12 + i] else None
            _mix_backward(g_flat, x.flatten(2), mix, None if g_x is None else g_x.view(n_seq, 2, -1), g_mix)
            g_states.append(g_x)
            # 2. the weighted sums U = [U_W; U_S]: grads of the inputs a, the errors and the coefficients
            g_h, g_d = _weighted_sums_backward(h, d, coef, g_flat.view(x.shape), g_coef)
            g_a.append(g_h)
            g_delta.append(g_d)

        # 3. coef = -(gamma, beta) * scale
        g_gamma = -g_coef[..., 0] * scale if needs[2] else None
        g_beta = -g_coef[..., 1] * scale if needs[3] else None
        if ctx.clip is not None:
            # scale = min(1, clip / max(norm, 1e-12)), with the gradient masks autograd would apply
            nc = norm.clamp_min(1e-12)
            ratio = ctx.clip / nc
            active = (ratio <= 1) & (norm >= 1e-12)
            if ctx.threshold is not None:  # a skipped token's scale is the constant 0
                active &= write_mask(norm, ctx.threshold)
            # else no token is clipped and the scale is the constant 1. Off the CPU the check is skipped:
            # a host sync per chunk stalls the GPU queue for more than the arithmetic it would spare
            # (nor under torch.compile, where the branch on a tensor is a graph break)
            if active.device.type != "cpu" or torch.compiler.is_compiling() or active.any():
                g_scale = -(g_coef[..., 0] * gamma + g_coef[..., 1] * beta)
                g_clip = torch.where(active, -g_scale * ratio / nc, 0.0)
                g_norm = g_clip if g_norm is None else g_norm + g_clip
        if g_norm is not None:
            # 4. norm = sqrt(max(sq, 1e-30)), sq = sum_l ||a_l||^2 ||delta_l||^2
            sq, _ = surprise_norm(sq_parts)
            g_sq = torch.where(sq >= 1e-30, g_norm * 0.5 / norm, 0.0).unsqueeze(-1)
            for i in range(depth):
                h, d = hs[i][:, :n], deltas[i]
                g_a[i].addcmul_(2 * g_sq * sq_parts[..., 2 * i + 1 : 2 * i + 2], h)
                g_delta[i].addcmul_(2 * g_sq * sq_parts[..., 2 * i : 2 * i + 1], d)

        # 5. the inner backprop: delta_l = e_l * act'(p_l), e_l = delta_{l+1} W_{l+1}^T
        g_e, g_pre_keys = [], []
        for i in range(depth - 1):
            g_e.append(act_backward(g_delta[i], z_keys[i], act, out=lhs_bufs[i][:, 2 * n :]))
            second = act_second(z_keys[i], act)
            g_pre_keys.append(None if second is None else second.mul_(g_delta[i]).mul_(es[i]))
            g_delta[i + 1] = g_delta[i + 1].baddbmm(g_e[i], ws[i + 1])
        g_aux = None
        if ctx.error is None:
            g_v = -2 * g_delta[-1]
        else:  # through the error map: dL/de and dL/daux
            g_out, g_aux = ctx.error.grad(g_delta[-1], e_out, aux)
            g_v = -g_out

        # 6. the read (and the keys' forward), last layer first. rhs: (N, 2n, d_out) the gradient g_z of
        # the layer's output (keys' rows, then queries'), for l >= 1 followed by delta_l's n rows
        rhs = _rhs_buffer(g_v, n, depth > 1)
        rhs[:, :n] = g_delta[-1].mul_(2) if ctx.error is None else g_out  # = -g_v: the keys' outputs
        if g_y is None:
            rhs[:, n : 2 * n].zero_()
        else:
            rhs[:, n : 2 * n] = g_y
        g_h0 = rhs[:, : 2 * n] if ctx.residual else None
        for i in range(depth - 1, -1, -1):
            g_z = rhs[:, : 2 * n]
            if needs[12 + i]:
                # the three uses of W_l (read, inner backprop, state update) in one baddbmm
                lhs = hs[i]
                if i > 0:
                    lhs = lhs_bufs[i - 1]
                    rhs[:, 2 * n :] = deltas[i]
                else:
                    rhs = g_z
                if g_states[i] is None:  # no gradient arrived for X': W's is the terms below alone, S's 0
                    g_states[i] = _GradBuffers.get(ctx.grad_slot, i, states[i])
                    g_states[i][:, 1].zero_()
                    _bmm_into(g_states[i][:, 0], lhs.transpose(1, 2), rhs, accumulate=False)
                else:
                    _bmm_into(g_states[i][:, 0], lhs.transpose(1, 2), rhs, accumulate=True)
            g_h = torch.bmm(g_z, ws[i].transpose(1, 2))
            g_h[:, :n] += g_a[i]
            if i > 0:
                rhs = _rhs_buffer(g_h, n, i > 1)
                g_z = act_backward(g_h, zs[i - 1], act, out=rhs[:, : 2 * n])
                if g_pre_keys[i - 1] is not None:
                    g_z[:, :n] += g_pre_keys[i - 1]
        g_h0 = g_h if g_h0 is None else g_h + g_h0
        g_aux = g_aux if needs[11] else None
        return (g_h0, g_v, g_gamma, g_beta, g_mix, None, None, None, None, None, None, g_aux, *g_states)


def read_and_grads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weights: tuple[Tensor, ...],
    activation: str,
    residual: bool,
    error=None,
    aux: Tensor | None = None,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Retrieval M(q) and the per-token factors of the inner gradient, at fixed weights.

    q, k, v: (B, H, n, d). Queries and keys go through the forward matmuls together. Returns y (B, H, n, d),
    and per layer the inputs a_l (B, H, n, d_in) and errors delta_l (B, H, n, d_out) such that
    grad_{W_l} ||M(k_j) - v_j||^2 = a_l[j]^T delta_l[j].
    """
    n = k.shape[-2]
    out_all, hs, zs = layers_forward(torch.cat([k, q], dim=-2), weights, activation, residual)

    def keys(t: Tensor) -> Tensor:
        # split(), not slicing: a slice backpropagates as a zero-filled full-size tensor, split as one cat
        return t.split(n, dim=-2)[0]

    out, y = out_all.split(n, dim=-2)
    err = 2 * (out - v) if error is None else error.value(out - v, aux)
    deltas, _ = inner_errors(err, weights, [keys(z) for z in zs], activation)
    return y, [keys(h) for h in hs], deltas


def run_chunks(
    activation: str,
    residual: bool,
    clip: float | None,
    threshold: float | None,
    chunk_size: int,
    error,
    q,
    k,
    v,
    gamma,
    beta,
    mix,
    aux,
    *states,
    max_norm: float | None = None,
    anchor: tuple[Tensor, ...] | None = None,
):
    """Consecutive complete chunks. q, k, v: (N, m * b, d); gamma, beta: (N, m, b); mix: (N, m, 2, 2);
    error, aux: the error map and its per-token input (N, m * b) (both None for l2); max_norm: each
    chunk's new W is rescaled to Frobenius norm at most this, per layer; anchor: per layer (N, d_in,
    d_out), what forgetting pulls W toward (`neural_memory_chunked`)."""
    ys, norms = [], []
    n_seq, length, dim = k.shape
    # each chunk's keys then its queries, contiguous (the rows that go through the MLP together): one copy
    # here instead of one per chunk
    shape = (n_seq, length // chunk_size, chunk_size, dim)
    kq = torch.stack([k.view(shape), q.view(shape)], 2).flatten(2, 3)
    # Without autograd no state is kept, so two buffers per layer take turns. Besides sparing a fresh
    # weight-sized allocation per chunk, this keeps glibc's heap from fragmenting: freed state-sized holes
    # that small long-lived tensors land in cannot take the next state, and the heap would grow by about
    # a state per chunk (tens of GiB over a long checkpointed sequence).
    buffers = None if torch.is_grad_enabled() else [[torch.empty_like(x) for x in states] for _ in range(2)]
    # (none under torch.compile: each step's backward allocates its own, `_GradBuffers.get`)
    grads = _GradBuffers() if buffers is None and not torch.compiler.is_compiling() else None
    # without autograd on CPU a chunk is one C++ call where it applies (the torch-op step below runs 35
    # small operators, whose per-call cost is most of its time at batch 1)
    fused = None if buffers is None else _step_kernel(k, error, states)
    options = None if fused is None else _step_options(activation, residual, clip, threshold, anchor)
    auxs = [None] * mix.shape[1] if aux is None else aux.split(chunk_size, dim=1)
    for i, (kq_c, v_c, g_c, b_c, m_c, a_c) in enumerate(
        zip(kq.unbind(1), v.split(chunk_size, dim=1), gamma.unbind(1), beta.unbind(1), mix.unbind(1), auxs)
    ):
        args = (kq_c, v_c, g_c, b_c, m_c, activation, residual, clip, threshold)
        if buffers is None:
            slot = None if grads is None else (grads, i % 2)
            y, norm, *states = _ChunkStep.apply(*args, slot, error, a_c, *states)
        elif fused is not None:  # the anchor's pull too
            y, norm = fused.chunk_step_forward(kq_c, v_c, g_c, b_c, m_c, states, buffers[i % 2], *options)
            states = buffers[i % 2]
        else:
            y, norm, states, _ = _chunk_forward(*args, states, out=buffers[i % 2], error=error, aux=a_c)
        # without autograd the in-place forms run as they are (torch.compile cannot trace the Functions'
        # mark_dirty: a graph break per call in a compiled decode step)
        if anchor is not None and fused is None:  # forgetting toward the anchor: W += (1 - A_b) W_anchor
            anchor_fn = _AnchorState.apply if buffers is None else _anchor_
            states = [anchor_fn(x, m_c[:, 0, 0], a) for x, a in zip(states, anchor)]
        if max_norm is not None:  # the bound at the chunk boundary, before the next chunk reads W
            if buffers is None:
                bound = _bounded if torch.compiler.is_compiling() else _BoundState.apply
                states = [bound(x, max_norm) for x in states]
            else:
                for x in states:
                    _bound_(x, max_norm)
        ys.append(y)
        norms.append(norm)
    return (torch.cat(ys, 1), torch.cat(norms, 1), *states)


class _CheckpointedChunks(torch.autograd.Function):
    """A group of chunks that keeps only its inputs for the backward pass (activation checkpointing).

    Forward runs the group without autograd; backward recomputes it with autograd from the saved inputs
    (the state at the group's start) and backpropagates through the recomputation. Works with both
    `.backward()` and `torch.autograd.grad`.
    """

    @staticmethod
    def forward(ctx, config, max_norm, n_anchor, q, k, v, gamma, beta, mix, aux, *tensors):
        """tensors: the states, then the `n_anchor` anchors (None: n_anchor 0)."""
        ctx.set_materialize_grads(False)
        ctx.config, ctx.max_norm, ctx.n_anchor = config, max_norm, n_anchor
        ctx.save_for_backward(q, k, v, gamma, beta, mix, aux, *tensors)
        return _CheckpointedChunks.run(config, max_norm, n_anchor, q, k, v, gamma, beta, mix, aux, *tensors)

    @staticmethod
    def run(config, max_norm, n_anchor, q, k, v, gamma, beta, mix, aux, *tensors):
        states, anchor = tensors[: len(tensors) - n_anchor], tensors[len(tensors) - n_anchor :]
        return run_chunks(
            *config, q, k, v, gamma, beta, mix, aux, *states, max_norm=max_norm, anchor=anchor or None
        )

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[3:]
        inputs = [
            None if t is None else t.detach().requires_grad_(need)
            for t, need in zip(ctx.saved_tensors, needs)
        ]
        with torch.enable_grad():
            outputs = _CheckpointedChunks.run(ctx.config, ctx.max_norm, ctx.n_anchor, *inputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        result = [None] * len(inputs)
        if pairs and wanted:
            outs, grad_outs = zip(*pairs)
            got = iter(torch.autograd.grad(outs, wanted, grad_outs, allow_unused=True))
            result = [next(got) if t is not None and t.requires_grad else None for t in inputs]
        return (None, None, None, *result)


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
    checkpoint_every: int | None = None,
    error=None,
    error_aux: Tensor | None = None,
    surprise_threshold: float | None = None,
    max_norm: float | None = None,
    anchor: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Read and write the neural memory over a sequence, chunk by chunk.

    error, error_aux: the inner loss's error map, dL/dM(k) = error.value(e, aux) for e = M(k) - v, with
        its backward error.grad(g, e, aux) -> (dL/de, dL/daux) (`titans.ops.memory.rules`: the l_p and Huber
        biases), and its per-token input (B, H, T) (Huber's delta). None: l2, 2 e (Titans).

    checkpoint_every: if set (and gradients are being recorded), complete chunks run in groups of this
        many under activation checkpointing: only the state at group boundaries is kept for the backward
        pass, each group's forward is recomputed during it. Outputs and gradients are unchanged; training
        memory drops from O(T) states to O(T / checkpoint_every + checkpoint_every), for about one more
        forward pass of time.
    surprise_threshold: if set, a surprise-gated write: a token whose surprise ||u_t|| (the returned
        `surprise`, taken at its chunk-start weights, before clipping) is below it adds nothing to S (its
        gradient is multiplied by 0); the momentum decay and the forgetting still apply to every token.
        0 writes every token, as None does.
    max_norm: if set, a bound on the weights: after each complete chunk's momentum and forgetting update,
        every layer's W_l (per batch row and head, Frobenius norm over its (d_in, d_out) matrix) is
        multiplied by min(1, max_norm / ||W_l||), so the next chunk reads and differentiates weights of
        norm <= max_norm; the momentum S is not rescaled. The given `weights` are used as they are (the
        caller bounds an initial state). Gradients flow through the rescale.
    anchor: if set, per layer a tensor broadcastable to (B, H, d_in, d_out) (the learned initial weights
        W_init): forgetting pulls W toward it instead of toward zero, W_t = (1 - alpha_t) W_{t-1} +
        alpha_t W_init + S_t, so W - W_init follows the paper's recurrence and a memory that stops being
        written returns to W_init. Per chunk: W_b = A_b W_0 + (1 - A_b) W_init + c S_0 - sum_j gamma_j u_j.
        Applied before the max_norm bound. Gradients flow to the anchor and the gates.

    Returns:
        y: (B, H, T, d) retrievals, token t reading the weights at the start of its chunk.
        weights, momentum: the state after the last COMPLETE chunk (a trailing partial chunk is read,
            not written: the caller keeps its tokens pending until the chunk completes).
        surprise: (B, H, T) the norm of each token's inner gradient u_t.
    """
    check_int("neural_memory_chunked: chunk_size", chunk_size)
    check_int("neural_memory_chunked: checkpoint_every", checkpoint_every, none_ok=True)
    check_threshold("neural_memory_chunked: surprise_threshold", surprise_threshold)
    check_max_norm("neural_memory_chunked: max_norm", max_norm)
    if torch.is_autocast_enabled(q.device.type):
        # The memory runs in its state's dtype, not autocast's: the state's in-place updates need one dtype,
        # and a bf16 state would lose each write's small increments. q, k, v (often bf16 there) are cast.
        with torch.autocast(q.device.type, enabled=False):
            dtype = weights[0].dtype
            return neural_memory_chunked(
                *(x.to(dtype) for x in (q, k, v)),
                theta,
                log_eta,
                log_keep,
                weights,
                momentum,
                chunk_size=chunk_size,
                activation=activation,
                residual=residual,
                surprise_clip=surprise_clip,
                checkpoint_every=checkpoint_every,
                error=error,
                error_aux=error_aux,
                surprise_threshold=surprise_threshold,
                max_norm=max_norm,
                anchor=anchor,
            )
    batch, heads, seq, dim = q.shape
    b = chunk_size
    n_full = seq // b
    weights, momentum = tuple(weights), tuple(momentum)
    # the memory runs in its state's dtype: q, k, v of another (bf16 with a float32 state, float32 with a
    # float64 one) are cast, their gradients coming back in their own dtypes
    q, k, v = (x.to(weights[0].dtype) for x in (q, k, v))
    if error is not None and error_aux is None:  # an error map without a per-token input: zeros
        error_aux = q.new_zeros(q.shape[:3])
    if not seq:  # no rows: nothing read or written
        y, surprise = q.new_empty(batch, heads, 0, v.shape[-1]), q.new_empty(batch, heads, 0)
        return y, weights, momentum, surprise
    if not n_full:  # nothing to write: a read of the current weights
        y, inputs, deltas = read_and_grads(q, k, v, weights, activation, residual, error, error_aux)
        return y, weights, momentum, surprise_norm(surprise_parts(inputs, deltas))[1]

    n_seq, dtype = batch * heads, weights[0].dtype
    gamma, beta, mix = chunk_mix(theta, log_eta, log_keep, b, dtype)
    states = stack_states(weights, momentum)
    if anchor is not None:  # (N, d_in, d_out) per layer, in the state's dtype
        anchor = tuple(
            a.to(dtype).expand(batch, heads, *w.shape[-2:]).reshape(n_seq, *w.shape[-2:])
            for a, w in zip(anchor, weights)
        )
    # (N, T, d) views, cut into the complete chunks and a trailing partial one. split() rather than indexing,
    # whose backward is a full-size zero tensor per piece; and only where there is more than one piece, since
    # split's backward concatenates the pieces' gradients (a full copy, even of a single piece)
    flat = (x.reshape(n_seq, seq, dim) for x in (q, k, v))
    q_full, k_full, v_full = (x.split(n_full * b, dim=1) if seq > n_full * b else (x,) for x in flat)
    config = (activation, residual, surprise_clip, surprise_threshold, b, error)
    aux_flat = None if error is None else error_aux.to(dtype).reshape(n_seq, seq)
    aux_full = None if aux_flat is None else aux_flat[:, : n_full * b]
    group = checkpoint_every if checkpoint_every and torch.is_grad_enabled() else n_full
    ys, norms = [], []
    if group < n_full:
        pieces = (x[0].split(group * b, dim=1) for x in (q_full, k_full, v_full))
        coefs = (x.split(group, dim=1) for x in (gamma, beta, mix))
        auxs = [None] * -(-n_full // group) if aux_full is None else aux_full.split(group * b, dim=1)
    else:
        pieces = ((x[0],) for x in (q_full, k_full, v_full))
        coefs = ((x,) for x in (gamma, beta, mix))
        auxs = (aux_full,)
    for q_g, k_g, v_g, g_g, b_g, m_g, a_g in zip(*pieces, *coefs, auxs):
        if group < n_full:
            anchors = anchor or ()
            # under torch.compile this Function (autograd.grad in its backward) breaks the graph. Traced
            # through torch's checkpoint instead, inductor (torch 2.13) lost the gradient to the block's input
            y, norm, *states = _CheckpointedChunks.apply(
                config, max_norm, len(anchors), q_g, k_g, v_g, g_g, b_g, m_g, a_g, *states, *anchors
            )
        else:
            y, norm, *states = run_chunks(
                *config, q_g, k_g, v_g, g_g, b_g, m_g, a_g, *states, max_norm=max_norm, anchor=anchor
            )
        ys.append(y)
        norms.append(norm)
    # views of the stacked states (W and S halves), not copies: whoever needs them contiguous copies anyway
    weights, momentum = unstack_states(states, batch, heads)
    if seq > n_full * b:  # trailing partial chunk: read (and report surprise), written by a later call
        tail = (x[1].reshape(batch, heads, -1, dim) for x in (q_full, k_full, v_full))
        aux_tail = None if aux_flat is None else aux_flat[:, n_full * b :].reshape(batch, heads, -1)
        y, inputs, deltas = read_and_grads(*tail, weights, activation, residual, error, aux_tail)
        ys.append(y.reshape(n_seq, -1, dim))
        norms.append(surprise_norm(surprise_parts(inputs, deltas))[1].reshape(n_seq, -1))
    y = torch.cat(ys, 1).view(batch, heads, seq, dim)
    return y, weights, momentum, torch.cat(norms, 1).view(batch, heads, seq)
