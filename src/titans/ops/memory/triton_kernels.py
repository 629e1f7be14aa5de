"""Triton kernels of the neural memory's chunk loop (imported lazily by `titans.ops.memory.triton_chunk`).

Importing this module imports triton and compiles nothing yet. `TRITON_INTERPRET=1` must be set before
this module is first imported for the kernels to run on CPU tensors (Triton's interpreter).

One program per sequence (batch x head): the memory state of that sequence stays in registers for the
whole loop over chunks, so a call is ONE launch whatever the length. Per chunk of `CHUNK` tokens it
computes, at the chunk-start state, the reads of the queries, the keys' inner gradient factors (inputs a_l
and errors delta_l per layer), the surprise norms and the closed-form write

    W' = A W + c S + sum_j (-gamma_j s_j) a_j^T delta_j      S' = E S + sum_j (-beta_j s_j) a_j^T delta_j

(s_j the clip scale) as one (d_in, chunk) x (chunk, d_out) `tl.dot` per layer and half. The maths is that
of `titans.ops.memory.chunk._chunk_forward`. The scalar coefficients (gamma, beta, A, c, E) are computed
here too, per chunk, from the raw per-token gates theta, log(eta), log(1 - alpha) (`_coef_terms`, the
maths of `titans.ops.memory.common.chunk_coefficients`), and the backward kernel returns the gates'
gradients (`_coef_grads`). A trailing partial chunk is read (and its surprise reported) with a write that
leaves the state as it is (coefficients 0, mix the identity): no branch in the loop.

Depth 1 and 2 only: each layer's [W; S] is a pair of named register tensors (`DEPTH` a constexpr).

Block sizes are powers of two >= 16 (`tl.dot`'s minimum); head dims, hidden width and chunk are padded
to them with masked loads (zeros), which the maths keeps at zero: act(0) = 0 for silu / gelu / relu, and a
zero key row has a zero error.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources  # noqa: F401 (triton_chunk catches it)

SILU, GELU, RELU = 0, 1, 2


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


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
        # 1 where not x <= 0, NaN included, as torch's threshold_backward passes the gradient there
        return tl.where(x <= 0.0, 0.0, 1.0)


@triton.jit
def _act_second(x, ACT: tl.constexpr):
    """act''(x) (0 for relu)."""
    if ACT == 0:
        s = tl.sigmoid(x)
        return s * (1.0 - s) * (x * (1.0 - 2.0 * s) + 2.0)
    elif ACT == 1:
        return 0.3989422804014327 * tl.exp(-0.5 * x * x) * (2.0 - x * x)
    else:
        return x * 0.0


@triton.jit
def _coef_terms(TH, LE, LK, st, c, n_full, rj, CHUNK: tl.constexpr, BC: tl.constexpr):
    """Chunk c's write coefficients from its per-token gates (the maths of
    `titans.ops.memory.common.chunk_coefficients`), at the chunk's rows rj (R,).

    TH, LE, LK: this sequence's theta, log(eta), log(1 - alpha), token stride `st`. Returns theta_j (R,);
    T1 (BC, R) = [j <= m] (A_b / A_m) (E_m / E_j), so gamma_j = theta_j sum_m T1[m, j]; eb_j = E_b / E_j
    (R,), so beta_j = theta_j eb_j; T0 (BC,) = (A_b / A_m) (E_m / E_0), so c = sum_m T0[m]; log A_b and
    log E_b. An incomplete chunk (c >= n_full) gets theta 0, T0 0 and log A_b = log E_b = 0: the write is
    the identity. Every exponent is a masked sum of log-gates (<= 0), never a difference of cumulative
    sums, so -inf gates (momentum or forgetting off) give exp(-inf) = 0, never inf - inf."""
    rm = tl.arange(0, BC)
    mm = (rm < CHUNK) & ((rm * 0 + c) < n_full)
    le = tl.load(LE + (c * CHUNK + rm) * st, mask=mm, other=0.0).to(tl.float32)
    lk = tl.load(LK + (c * CHUNK + rm) * st, mask=mm, other=0.0).to(tl.float32)
    mj = (rj < CHUNK) & ((rj * 0 + c) < n_full)
    theta = tl.load(TH + (c * CHUNK + rj) * st, mask=mj, other=0.0).to(tl.float32)
    # log A_b / A_m = sum_{l > m} log_keep_l
    la = tl.sum(tl.where(rm[None, :] > rm[:, None], lk[None, :], 0.0), 1)
    # log E_m / E_j = sum_{j < l <= m} log_eta_l (m >= j)
    seg = tl.cumsum(tl.where(rm[:, None] > rj[None, :], le[:, None], 0.0), 0)
    lower = (rm[:, None] >= rj[None, :]) & (rm[:, None] < CHUNK)
    t1 = tl.where(lower, tl.exp(la[:, None] + seg), 0.0)
    eb = tl.exp(tl.sum(tl.where(rm[:, None] == CHUNK - 1, seg, 0.0), 0))
    t0 = tl.where(mm, tl.exp(la + tl.cumsum(le, 0)), 0.0)
    return theta, t1, eb, t0, tl.sum(lk, 0), tl.sum(le, 0)


@triton.jit
def _coef_grads(theta, t1, eb, g_gam, g_bet, rj, CHUNK: tl.constexpr, BC: tl.constexpr):
    """`_coef_terms` backward for rows rj: from dL/dgamma_j and dL/dbeta_j (R,), dL/dtheta_j (R,) and
    these rows' parts of dL/dlog_eta and dL/dlog_keep over the chunk's tokens (BC,)."""
    rm = tl.arange(0, BC)
    g_theta = g_gam * tl.sum(t1, 0) + g_bet * eb
    # gamma_j = theta_j sum_m T1[m, j]: T1[m, j] holds log_eta_l for j < l <= m, log_keep_l for l > m
    part = (g_gam * theta)[None, :] * t1
    after = rm[:, None] > rj[None, :]
    g_le = tl.sum(tl.where(after, tl.cumsum(part, 0, reverse=True), 0.0), 1)
    row_sums = tl.sum(part, 1)
    g_lk = tl.sum(tl.where(rm[None, :] < rm[:, None], row_sums[None, :], 0.0), 1)
    # beta_j = theta_j E_b / E_j holds log_eta_l for j < l < CHUNK
    g_le += tl.sum(tl.where(after & (rm[:, None] < CHUNK), (g_bet * theta * eb)[None, :], 0.0), 1)
    return g_theta, g_le, g_lk


@triton.jit
def memory_chunks_fwd(
    Q,  # (N, T, D) any float dtype
    K,
    V,
    TH,  # (N, T) per-token gates: theta, strides (g_sn, g_st)
    LE,  # (N, T) log(eta), the same strides
    LK,  # (N, T) log(1 - alpha), the same strides
    ST1,  # (N, 2, D, H1): layer 1's [W; S] in
    ST2,  # (N, 2, H1, D): layer 2's (depth 2; else unused)
    OUT1,  # like ST1: the state after the last complete chunk
    OUT2,
    SAVE1,  # (N, n_saved, 2, D, H1): the state at the start of every SAVE_EVERY-th chunk before save_until
    SAVE2,
    Y,  # (N, T, D) the reads
    NORM,  # (N, T) the surprise norms
    T,
    sn_in,  # tokens from one sequence's first row to the next's in Q, K, V (rows of D, dense)
    sn_out,  # the same in Y and NORM
    g_sn,
    g_st,
    n_full,
    n_chunks,
    n_saved,
    save_until,
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
        off = pid * sn_in * D + rows[:, None] * D + rd[None, :]
        k = tl.load(K + off, mask=mrd, other=0.0).to(tl.float32)
        q = tl.load(Q + off, mask=mrd, other=0.0).to(tl.float32)
        v = tl.load(V + off, mask=mrd, other=0.0).to(tl.float32)
        if SAVE_EVERY > 0:
            keep = ((off1 * 0 + c) < save_until) & (c % SAVE_EVERY == 0)
            base = (pid * n_saved + c // SAVE_EVERY) * 2 * size1
            tl.store(SAVE1 + base + off1, w1, mask=m1 & keep)
            tl.store(SAVE1 + base + size1 + off1, s1, mask=m1 & keep)
            if DEPTH == 2:
                keep2 = ((off2 * 0 + c) < save_until) & (c % SAVE_EVERY == 0)
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
        norm = tl.sqrt(tl.maximum(sq, 1e-30, propagate_nan=tl.PropagateNan.ALL))
        tl.store(Y + pid * sn_out * D + rows[:, None] * D + rd[None, :], y, mask=mrd)
        tl.store(NORM + pid * sn_out + rows, norm, mask=mr)

        # the write (the identity for the trailing partial chunk)
        if CLIP:
            # float32 whatever type the launcher gave the scalar (inductor passes a Python float as fp64)
            nc = tl.maximum(norm, 1e-12, propagate_nan=tl.PropagateNan.ALL)
            scale = tl.minimum(clip / nc, 1.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float32)
        else:
            scale = tl.full([BC], 1.0, tl.float32)
        # the coefficients from the chunk's gates (the identity write for the partial chunk)
        gates = pid * g_sn
        theta, t1, eb, t0, log_a, log_e = _coef_terms(
            TH + gates, LE + gates, LK + gates, g_st, c, n_full, rc, CHUNK, BC
        )
        c_w = -theta * tl.sum(t1, 0) * scale
        c_s = -theta * eb * scale
        a = tl.exp(log_a)
        carry = tl.sum(t0, 0)
        decay_s = tl.exp(log_e)
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


@triton.jit
def memory_chunks_bwd(
    Q,  # (N, T, D) as in the forward
    K,
    V,
    TH,  # (N, T) per-token gates, strides (g_sn, g_st)
    LE,
    LK,
    SAVE1,  # (N, n_chunks, 2, D, H1): every chunk's start state (the forward's, save_until = n_chunks)
    SAVE2,
    GY,  # (N, T, D) dL/dy
    GNORM,  # (N, T) dL/dnorm
    G1,  # (N, 2, D, H1): dL/d(final state) in, dL/d(initial state) out (overwritten)
    G2,
    GQ,  # (N, T, D) float32 out
    GK,
    GV,
    GTH,  # (N, T) float32 out: dL/dtheta (the trailing partial chunk's left as given: zeros)
    GLE,  # dL/dlog(eta)
    GLK,  # dL/dlog(1 - alpha)
    T,
    sn_in,  # tokens from one sequence's first row to the next's in Q, K, V, GY, GNORM (rows dense)
    sn_out,  # the same in GQ, GK, GV, GTH, GLE, GLK
    g_sn,
    g_st,
    n_full,
    n_chunks,
    clip,
    D: tl.constexpr,
    H1: tl.constexpr,
    BD: tl.constexpr,
    BH: tl.constexpr,
    BC: tl.constexpr,
    RB: tl.constexpr,
    CHUNK: tl.constexpr,
    DEPTH: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    CLIP: tl.constexpr,
    PREC: tl.constexpr,
):
    """The chunks in reverse: each chunk's forward recomputed from its saved start state, then its
    backward (the maths of `titans.ops.memory.chunk._ChunkStep.backward`), the state gradient carried in
    registers from chunk to chunk. A chunk's rows go RB at a time (fewer rows per matmul: less shared
    memory to stage the operands in)."""
    pid = tl.program_id(0).to(tl.int64)
    rd = tl.arange(0, BD)
    rh = tl.arange(0, BH)
    rr = tl.arange(0, RB)
    md = rd < D
    mh = rh < H1
    off1 = rd[:, None] * H1 + rh[None, :]
    m1 = md[:, None] & mh[None, :]
    size1 = D * H1
    g_w1 = tl.load(G1 + pid * 2 * size1 + off1, mask=m1, other=0.0).to(tl.float32)
    g_s1 = tl.load(G1 + pid * 2 * size1 + size1 + off1, mask=m1, other=0.0).to(tl.float32)
    if DEPTH == 2:
        off2 = rh[:, None] * D + rd[None, :]
        m2 = mh[:, None] & md[None, :]
        g_w2 = tl.load(G2 + pid * 2 * size1 + off2, mask=m2, other=0.0).to(tl.float32)
        g_s2 = tl.load(G2 + pid * 2 * size1 + size1 + off2, mask=m2, other=0.0).to(tl.float32)
    rm = tl.arange(0, BC)
    gates = pid * g_sn

    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        base = (pid * n_chunks + c) * 2 * size1
        w1 = tl.load(SAVE1 + base + off1, mask=m1, other=0.0).to(tl.float32)
        s1 = tl.load(SAVE1 + base + size1 + off1, mask=m1, other=0.0).to(tl.float32)
        if DEPTH == 2:
            w2 = tl.load(SAVE2 + base + off2, mask=m2, other=0.0).to(tl.float32)
            s2 = tl.load(SAVE2 + base + size1 + off2, mask=m2, other=0.0).to(tl.float32)
        # (no `_` for the unused returns: rebound to another type in the row loop below, it would be a
        # loop-carried variable whose type changes, which Triton's compiler refuses)
        theta_c, t1_c, eb_c, t0, log_a, log_e = _coef_terms(
            TH + gates, LE + gates, LK + gates, g_st, c, n_full, rm, CHUNK, BC
        )
        a = tl.exp(log_a)
        carry = tl.sum(t0, 0)
        decay_s = tl.exp(log_e)

        # 1. X' = mix @ X + U, mix = [[A, c], [0, E]]: the mix's gradient, and the state gradient passed
        # through the mix
        g_a = tl.sum(tl.sum(g_w1 * w1, 1), 0)
        g_carry = tl.sum(tl.sum(g_w1 * s1, 1), 0)
        g_decay = tl.sum(tl.sum(g_s1 * s1, 1), 0)
        if DEPTH == 2:
            g_a += tl.sum(tl.sum(g_w2 * w2, 1), 0)
            g_carry += tl.sum(tl.sum(g_w2 * s2, 1), 0)
            g_decay += tl.sum(tl.sum(g_s2 * s2, 1), 0)
        # A = exp(sum log_keep), E = exp(sum log_eta), c = sum_m T0[m] (`_coef_terms`)
        in_chunk = rm < CHUNK
        g_le = tl.where(in_chunk, g_decay * decay_s + g_carry * tl.cumsum(t0, 0, reverse=True), 0.0)
        g_lk = tl.where(in_chunk, g_a * a, 0.0)
        g_lk += g_carry * tl.sum(tl.where(rm[None, :] < rm[:, None], t0[None, :], 0.0), 1)

        # the state gradient before this chunk's write: through the mix here, the writes' terms below
        n_w1 = a * g_w1
        n_s1 = carry * g_w1 + decay_s * g_s1
        if DEPTH == 2:
            n_w2 = a * g_w2
            n_s2 = carry * g_w2 + decay_s * g_s2
        # the dots' state operands: at depth 2 each is read from memory (the saved start state, and the
        # carried gradient put into G1 / G2 for it) just before the dots that use it, in every row block,
        # rather than held in registers. A dot stages its operands in shared memory; loop-invariant ones
        # are staged once for the whole row loop, and the twelve 64 x 128 float32 ones of the presets'
        # size would need 384 KB, more than a Hopper SM has (227 KB); read where used, two at a time
        # are live
        if DEPTH == 2:
            tl.debug_barrier()  # every thread done reading the last chunk's gradient from G1 / G2
            tl.store(G1 + pid * 2 * size1 + off1, g_w1, mask=m1)
            tl.store(G1 + pid * 2 * size1 + size1 + off1, g_s1, mask=m1)
            tl.store(G2 + pid * 2 * size1 + off2, g_w2, mask=m2)
            tl.store(G2 + pid * 2 * size1 + size1 + off2, g_s2, mask=m2)
            tl.debug_barrier()  # visible to every thread of the program
        else:
            w1_d, gw1_d, gs1_d = w1, g_w1, g_s1
        # the chunk's rows, RB at a time: each row's terms depend on the chunk-start state alone
        for rb in range(0, BC // RB):
            rc = rb * RB + rr
            rows = c * CHUNK + rc
            mr = (rc < CHUNK) & (rows < T)
            mrd = mr[:, None] & md[None, :]
            off = pid * sn_in * D + rows[:, None] * D + rd[None, :]
            k = tl.load(K + off, mask=mrd, other=0.0).to(tl.float32)
            q = tl.load(Q + off, mask=mrd, other=0.0).to(tl.float32)
            v = tl.load(V + off, mask=mrd, other=0.0).to(tl.float32)
            gy = tl.load(GY + off, mask=mrd, other=0.0).to(tl.float32)
            g_norm = tl.load(GNORM + pid * sn_in + rows, mask=mr, other=0.0).to(tl.float32)
            theta, t1, eb, t0_r, log_a_r, log_e_r = _coef_terms(
                TH + gates, LE + gates, LK + gates, g_st, c, n_full, rc, CHUNK, BC
            )
            gam = theta * tl.sum(t1, 0)
            bet = theta * eb
            # the chunk's forward, recomputed
            if DEPTH == 2:
                w1_d = tl.load(SAVE1 + base + off1, mask=m1, other=0.0).to(tl.float32)
            zk = tl.dot(k, w1_d, input_precision=PREC)
            if DEPTH == 1:
                out_k = zk
            else:
                hk = _act(zk, ACT)
                w2_d = tl.load(SAVE2 + base + off2, mask=m2, other=0.0).to(tl.float32)
                out_k = tl.dot(hk, w2_d, input_precision=PREC)
            if RESIDUAL:
                out_k += k
            d_out = 2.0 * (out_k - v)
            kk = tl.sum(k * k, 1)
            if DEPTH == 1:
                dd = tl.sum(d_out * d_out, 1)
                sq = kk * dd
            else:
                e = tl.dot(d_out, tl.trans(w2_d), input_precision=PREC)
                p = _act_grad(zk, ACT)
                d_hid = e * p
                hh = tl.sum(hk * hk, 1)
                dh = tl.sum(d_hid * d_hid, 1)
                do = tl.sum(d_out * d_out, 1)
                sq = kk * dh + hh * do
            norm = tl.sqrt(tl.maximum(sq, 1e-30, propagate_nan=tl.PropagateNan.ALL))
            if CLIP:
                nc = tl.maximum(norm, 1e-12, propagate_nan=tl.PropagateNan.ALL)
                ratio = (clip / nc).to(tl.float32)  # as in the forward: whatever the scalar's type
                scale = tl.minimum(ratio, 1.0, propagate_nan=tl.PropagateNan.ALL)
            else:
                scale = tl.full([RB], 1.0, tl.float32)
            c_w = -gam * scale
            c_s = -bet * scale

            # 2. U = a^T (c_w d) and a^T (c_s d) per layer: gradients of the inputs, errors and coefficients
            if DEPTH == 1:
                pw = tl.dot(k, gw1_d, input_precision=PREC)
                ps = tl.dot(k, gs1_d, input_precision=PREC)
                g_dout = c_w[:, None] * pw + c_s[:, None] * ps
                g_cw = tl.sum(pw * d_out, 1)
                g_cs = tl.sum(ps * d_out, 1)
                g_k = tl.dot(c_w[:, None] * d_out, tl.trans(gw1_d), input_precision=PREC)
                g_k += tl.dot(c_s[:, None] * d_out, tl.trans(gs1_d), input_precision=PREC)
            else:
                gw1_d = tl.load(G1 + pid * 2 * size1 + off1, mask=m1, other=0.0)
                gs1_d = tl.load(G1 + pid * 2 * size1 + size1 + off1, mask=m1, other=0.0)
                pw = tl.dot(k, gw1_d, input_precision=PREC)
                ps = tl.dot(k, gs1_d, input_precision=PREC)
                g_dhid = c_w[:, None] * pw + c_s[:, None] * ps
                g_cw = tl.sum(pw * d_hid, 1)
                g_cs = tl.sum(ps * d_hid, 1)
                g_k = tl.dot(c_w[:, None] * d_hid, tl.trans(gw1_d), input_precision=PREC)
                g_k += tl.dot(c_s[:, None] * d_hid, tl.trans(gs1_d), input_precision=PREC)
                gw2_d = tl.load(G2 + pid * 2 * size1 + off2, mask=m2, other=0.0)
                gs2_d = tl.load(G2 + pid * 2 * size1 + size1 + off2, mask=m2, other=0.0)
                pw2 = tl.dot(hk, gw2_d, input_precision=PREC)
                ps2 = tl.dot(hk, gs2_d, input_precision=PREC)
                g_dout = c_w[:, None] * pw2 + c_s[:, None] * ps2
                g_cw += tl.sum(pw2 * d_out, 1)
                g_cs += tl.sum(ps2 * d_out, 1)
                g_hk = tl.dot(c_w[:, None] * d_out, tl.trans(gw2_d), input_precision=PREC)
                g_hk += tl.dot(c_s[:, None] * d_out, tl.trans(gs2_d), input_precision=PREC)

            # 3. c = -(gamma, beta) * scale, and gamma, beta from the gates
            g_theta, g_le_rows, g_lk_rows = _coef_grads(
                theta, t1, eb, -g_cw * scale, -g_cs * scale, rc, CHUNK, BC
            )
            g_le += g_le_rows
            g_lk += g_lk_rows
            full = (rc * 0 + c) < n_full
            tl.store(GTH + pid * sn_out + rows, g_theta, mask=mr & full)
            g_n = g_norm
            if CLIP:
                active = (ratio <= 1.0) & (norm >= 1e-12)
                g_scale = -(g_cw * gam + g_cs * bet)
                g_n += tl.where(active, -g_scale * ratio / nc, 0.0)
            # 4. norm = sqrt(max(sq, 1e-30)), sq = sum_l ||a_l||^2 ||delta_l||^2
            g_sq = tl.where(sq >= 1e-30, g_n * 0.5 / norm, 0.0)
            if DEPTH == 1:
                g_k += (2.0 * g_sq * dd)[:, None] * k
                g_dout += (2.0 * g_sq * kk)[:, None] * d_out
            else:
                g_k += (2.0 * g_sq * dh)[:, None] * k
                g_dhid += (2.0 * g_sq * kk)[:, None] * d_hid
                g_hk += (2.0 * g_sq * do)[:, None] * hk
                g_dout += (2.0 * g_sq * hh)[:, None] * d_out

            if DEPTH == 2:
                # 5. the inner backprop: d_hid = e * act'(zk), e = d_out W2^T
                g_e = g_dhid * p
                g_zk = g_dhid * e * _act_second(zk, ACT)
                w2_d = tl.load(SAVE2 + base + off2, mask=m2, other=0.0).to(tl.float32)
                g_dout += tl.dot(g_e, w2_d, input_precision=PREC)
                n_w2 += tl.dot(tl.trans(g_e), d_out, input_precision=PREC)
            # 6. d_out = 2 (M(k) - v), and the read y = M(q)
            g_v = -2.0 * g_dout
            g_ok = 2.0 * g_dout
            if RESIDUAL:
                g_k += g_ok
                g_q = gy
            else:
                g_q = gy * 0.0
            if DEPTH == 1:
                n_w1 += tl.dot(tl.trans(k), g_ok, input_precision=PREC)
                n_w1 += tl.dot(tl.trans(q), gy, input_precision=PREC)
                g_k += tl.dot(g_ok, tl.trans(w1_d), input_precision=PREC)
                g_q += tl.dot(gy, tl.trans(w1_d), input_precision=PREC)
            else:
                g_hk += tl.dot(g_ok, tl.trans(w2_d), input_precision=PREC)
                n_w2 += tl.dot(tl.trans(hk), g_ok, input_precision=PREC)
                g_zk += g_hk * p
                w1_d = tl.load(SAVE1 + base + off1, mask=m1, other=0.0).to(tl.float32)
                zq = tl.dot(q, w1_d, input_precision=PREC)
                hq = _act(zq, ACT)
                n_w2 += tl.dot(tl.trans(hq), gy, input_precision=PREC)
                g_zq = tl.dot(gy, tl.trans(w2_d), input_precision=PREC) * _act_grad(zq, ACT)
                n_w1 += tl.dot(tl.trans(k), g_zk, input_precision=PREC)
                n_w1 += tl.dot(tl.trans(q), g_zq, input_precision=PREC)
                g_k += tl.dot(g_zk, tl.trans(w1_d), input_precision=PREC)
                g_q += tl.dot(g_zq, tl.trans(w1_d), input_precision=PREC)
            off_out = pid * sn_out * D + rows[:, None] * D + rd[None, :]
            tl.store(GQ + off_out, g_q, mask=mrd)
            tl.store(GK + off_out, g_k, mask=mrd)
            tl.store(GV + off_out, g_v, mask=mrd)
        g_w1 = n_w1
        g_s1 = n_s1
        if DEPTH == 2:
            g_w2 = n_w2
            g_s2 = n_s2
        tokens = c * CHUNK + rm
        done = in_chunk & ((rm * 0 + c) < n_full)
        tl.store(GLE + pid * sn_out + tokens, g_le, mask=done)
        tl.store(GLK + pid * sn_out + tokens, g_lk, mask=done)

    if DEPTH == 2:
        tl.debug_barrier()  # every thread done reading the first chunk's gradient from G1 / G2
    tl.store(G1 + pid * 2 * size1 + off1, g_w1, mask=m1)
    tl.store(G1 + pid * 2 * size1 + size1 + off1, g_s1, mask=m1)
    if DEPTH == 2:
        tl.store(G2 + pid * 2 * size1 + off2, g_w2, mask=m2)
        tl.store(G2 + pid * 2 * size1 + size1 + off2, g_s2, mask=m2)
