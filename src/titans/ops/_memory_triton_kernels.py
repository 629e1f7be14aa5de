"""Triton kernels of the neural memory's chunk loop (imported lazily by `titans.ops.memory_triton`).

Importing this module imports triton and compiles nothing yet. `TRITON_INTERPRET=1` must be set before
this module is first imported for the kernels to run on CPU tensors (Triton's interpreter).

One program per sequence (batch x head): the memory state of that sequence stays in registers for the
whole loop over chunks, so a call is ONE launch whatever the length. Per chunk of `CHUNK` tokens it
computes, at the chunk-start state, the reads of the queries, the keys' inner gradient factors (inputs a_l
and errors delta_l per layer), the surprise norms and the closed-form write

    W' = A W + c S + sum_j (-gamma_j s_j) a_j^T delta_j      S' = E S + sum_j (-beta_j s_j) a_j^T delta_j

(s_j the clip scale) as one (d_in, chunk) x (chunk, d_out) `tl.dot` per layer and half. The maths is that
of `titans.ops.memory._chunk_forward`; the scalar coefficients (gamma, beta, A, c, E) come in computed.
A trailing partial chunk is read (and its surprise reported) with a write that leaves the state as it is
(coefficients 0, mix the identity): no branch in the loop.

Block sizes are powers of two >= 16 (`tl.dot`'s minimum); head dims, hidden width and chunk are padded
to them with masked loads (zeros), which the maths keeps at zero: act(0) = 0 for silu / gelu / relu, and a
zero key row has a zero error.
"""

from __future__ import annotations

import triton
import triton.language as tl

SILU, GELU, RELU = 0, 1, 2


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    """act'(x)."""
    if ACT == 0:
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    elif ACT == 1:
        return 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(
            -0.5 * x * x
        )
    else:
        return (x > 0.0).to(tl.float32)


@triton.jit
def memory_chunks_fwd(
    Q,  # (N, T, D) any float dtype
    K,
    V,
    GAMMA,  # (N, n_full, CHUNK) write coefficients of W
    BETA,  # (N, n_full, CHUNK) of S
    MIX,  # (N, n_full, 4): A, c, 0, E
    ST1,  # (N, 2, D, H1): layer 1's [W; S] in
    ST2,  # (N, 2, H1, D): layer 2's (depth 2; else unused)
    OUT1,  # like ST1: the state after the last complete chunk
    OUT2,
    SAVE1,  # (N, n_saved, 2, D, H1): the state at the start of every SAVE_EVERY-th chunk
    SAVE2,
    Y,  # (N, T, D) the reads
    NORM,  # (N, T) the surprise norms
    T,
    n_full,
    n_chunks,
    n_saved,
    clip,
    D: tl.constexpr,
    H1: tl.constexpr,
    BD: tl.constexpr,
    BH: tl.constexpr,
    BC: tl.constexpr,
    CHUNK: tl.constexpr,
    DEPTH: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    CLIP: tl.constexpr,
    SAVE_EVERY: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rd = tl.arange(0, BD)
    rh = tl.arange(0, BH)
    rc = tl.arange(0, BC)
    md = rd < D
    mh = rh < H1
    off1 = rd[:, None] * H1 + rh[None, :]
    m1 = md[:, None] & mh[None, :]
    size1 = D * H1
    w1 = tl.load(ST1 + pid * 2 * size1 + off1, mask=m1, other=0.0).to(tl.float32)
    s1 = tl.load(ST1 + pid * 2 * size1 + size1 + off1, mask=m1, other=0.0).to(tl.float32)
    if DEPTH == 2:
        off2 = rh[:, None] * D + rd[None, :]
        m2 = mh[:, None] & md[None, :]
        w2 = tl.load(ST2 + pid * 2 * size1 + off2, mask=m2, other=0.0).to(tl.float32)
        s2 = tl.load(ST2 + pid * 2 * size1 + size1 + off2, mask=m2, other=0.0).to(tl.float32)

    for c in range(0, n_chunks):
        rows = c * CHUNK + rc
        mr = (rc < CHUNK) & (rows < T)
        mrd = mr[:, None] & md[None, :]
        off = pid * T * D + rows[:, None] * D + rd[None, :]
        k = tl.load(K + off, mask=mrd, other=0.0).to(tl.float32)
        q = tl.load(Q + off, mask=mrd, other=0.0).to(tl.float32)
        v = tl.load(V + off, mask=mrd, other=0.0).to(tl.float32)
        # "this chunk is complete" as a tensor (the interpreter refuses a scalar bool in a mask)
        full = (rc * 0 + c) < n_full
        if SAVE_EVERY > 0:
            keep = ((off1 * 0 + c) < n_full) & (c % SAVE_EVERY == 0)
            base = (pid * n_saved + c // SAVE_EVERY) * 2 * size1
            tl.store(SAVE1 + base + off1, w1, mask=m1 & keep)
            tl.store(SAVE1 + base + size1 + off1, s1, mask=m1 & keep)
            if DEPTH == 2:
                keep2 = ((off2 * 0 + c) < n_full) & (c % SAVE_EVERY == 0)
                tl.store(SAVE2 + base + off2, w2, mask=m2 & keep2)
                tl.store(SAVE2 + base + size1 + off2, s2, mask=m2 & keep2)

        # the read and the keys' inner gradient factors at the chunk-start state
        zk = tl.dot(k, w1, input_precision=PREC)
        zq = tl.dot(q, w1, input_precision=PREC)
        if DEPTH == 1:
            out_k = zk
            y = zq
        else:
            hk = _act(zk, ACT)
            out_k = tl.dot(hk, w2, input_precision=PREC)
            y = tl.dot(_act(zq, ACT), w2, input_precision=PREC)
        if RESIDUAL:
            out_k += k
            y += q
        d_out = 2.0 * (out_k - v)
        if DEPTH == 1:
            sq = tl.sum(k * k, 1) * tl.sum(d_out * d_out, 1)
        else:
            e = tl.dot(d_out, tl.trans(w2), input_precision=PREC)
            d_hid = e * _act_grad(zk, ACT)
            sq = tl.sum(k * k, 1) * tl.sum(d_hid * d_hid, 1) + tl.sum(hk * hk, 1) * tl.sum(d_out * d_out, 1)
        norm = tl.sqrt(tl.maximum(sq, 1e-30))
        tl.store(Y + off, y, mask=mrd)
        tl.store(NORM + pid * T + rows, norm, mask=mr)

        # the write (the identity for the trailing partial chunk)
        if CLIP:
            scale = tl.minimum(clip / tl.maximum(norm, 1e-12), 1.0)
        else:
            scale = tl.full([BC], 1.0, tl.float32)
        coef = (pid * n_full + c) * CHUNK + rc
        gam = tl.load(GAMMA + coef, mask=mr & full, other=0.0).to(tl.float32)
        bet = tl.load(BETA + coef, mask=mr & full, other=0.0).to(tl.float32)
        c_w = -gam * scale
        c_s = -bet * scale
        # mix = [A, c, 0, E], the identity [1, 0, 0, 1] for the partial chunk
        r4 = tl.arange(0, 4)
        identity = tl.where((r4 == 0) | (r4 == 3), 1.0, 0.0)
        mix = tl.load(MIX + (pid * n_full + c) * 4 + r4, mask=(r4 * 0 + c) < n_full, other=identity)
        mix = mix.to(tl.float32)
        a = tl.sum(tl.where(r4 == 0, mix, 0.0), 0)
        carry = tl.sum(tl.where(r4 == 1, mix, 0.0), 0)
        decay_s = tl.sum(tl.where(r4 == 3, mix, 0.0), 0)
        if DEPTH == 1:
            u_w = tl.dot(tl.trans(k * c_w[:, None]), d_out, input_precision=PREC)
            u_s = tl.dot(tl.trans(k * c_s[:, None]), d_out, input_precision=PREC)
        else:
            u_w = tl.dot(tl.trans(k * c_w[:, None]), d_hid, input_precision=PREC)
            u_s = tl.dot(tl.trans(k * c_s[:, None]), d_hid, input_precision=PREC)
            u2_w = tl.dot(tl.trans(hk * c_w[:, None]), d_out, input_precision=PREC)
            u2_s = tl.dot(tl.trans(hk * c_s[:, None]), d_out, input_precision=PREC)
            w2_new = a * w2 + carry * s2 + u2_w
            s2 = decay_s * s2 + u2_s
            w2 = w2_new
        w1_new = a * w1 + carry * s1 + u_w
        s1 = decay_s * s1 + u_s
        w1 = w1_new

    tl.store(OUT1 + pid * 2 * size1 + off1, w1, mask=m1)
    tl.store(OUT1 + pid * 2 * size1 + size1 + off1, s1, mask=m1)
    if DEPTH == 2:
        tl.store(OUT2 + pid * 2 * size1 + off2, w2, mask=m2)
        tl.store(OUT2 + pid * 2 * size1 + size1 + off2, s2, mask=m2)
