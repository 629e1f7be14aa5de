"""Causal attention kernels for the Titans architectures (dense references beside them: `attention_ref.py`).

All functions take tensors shaped (batch, heads, seq, head_dim). Queries are the LAST ``Tq`` positions of
the ``Tk``-long key sequence, so one function serves a parallel pass (``Tq == Tk``) and streaming with a
key/value cache (``Tq < Tk``).

- :func:`causal_attention`: full or sliding-window causal attention, plus optional persistent keys that
  every query sees (Titans §3.3). Sliding windows are computed blockwise: the query blocks are folded into
  the batch, each block paired with the ``block + window - 1`` keys it can reach, so time and memory grow as
  ``T x (window + block)`` and no ``T x T`` mask or score tensor is ever built.
- :func:`segment_attention`: Titans MAC (memory as context, §4.1): attention inside fixed segments over
  ``[persistent || retrieved memory tokens h || segment tokens]`` with a causal rule on both ``h`` and the
  segment, computed by folding segments into the batch.

The references in `titans.ops.attention_ref` build the dense mask over the whole sequence and run a
textbook softmax; they exist to be obviously right, and the tests compare these fast paths against them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from titans.validation import check_int

__all__ = ["causal_attention", "segment_attention"]

# Each SDPA call handles at most this many (query, key) score entries; larger problems are split into
# groups of blocks along the folded dimension. Bounds peak memory independently of the sequence length.
_MAX_SCORES_PER_CALL = 1 << 24
_DEFAULT_FULL_BLOCK = 512


# ----------------------------------------------------------------------------------------------------
# input checks


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, names: tuple[str, str, str] = ("q", "k", "v")) -> None:
    for name, t in zip(names, (q, k, v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(
            f"{names[1]} and {names[2]} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    b, h, tq, d = q.shape
    if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(
            f"{names[1]} {tuple(k.shape)} does not match {names[0]} {tuple(q.shape)} in "
            "batch, heads or head_dim"
        )
    if k.shape[2] < tq:
        raise ValueError(
            f"need at least as many keys as queries (queries are the last Tq of the keys), "
            f"got Tq={tq} and Tk={k.shape[2]}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _persistent_kv(
    persistent_k: Tensor | None, persistent_v: Tensor | None, q: Tensor
) -> tuple[Tensor, Tensor] | None:
    """Validate persistent keys/values and broadcast them to (batch, heads, P, head_dim)."""
    if persistent_k is None and persistent_v is None:
        return None
    if persistent_k is None or persistent_v is None:
        raise ValueError("persistent_k and persistent_v must be given together")
    if persistent_k.shape != persistent_v.shape:
        raise ValueError(
            f"persistent_k {tuple(persistent_k.shape)} and persistent_v "
            f"{tuple(persistent_v.shape)} must have the same shape"
        )
    b, h, _, d = q.shape
    if persistent_k.dim() == 3:
        persistent_k, persistent_v = persistent_k.unsqueeze(0), persistent_v.unsqueeze(0)
    if (
        persistent_k.dim() != 4
        or persistent_k.shape[1] != h
        or persistent_k.shape[3] != d
        or (persistent_k.shape[0] not in (1, b))
    ):
        raise ValueError(
            f"persistent keys must be (heads={h}, P, head_dim={d}) or (batch={b}, {h}, P, {d}), "
            f"got {tuple(persistent_k.shape)}"
        )
    if persistent_k.dtype != q.dtype or persistent_v.dtype != q.dtype:
        raise TypeError(
            f"persistent keys/values must have the dtype of q ({q.dtype}), "
            f"got {persistent_k.dtype} and {persistent_v.dtype}"
        )
    if persistent_k.shape[2] == 0:
        return None
    p = persistent_k.shape[2]
    return persistent_k.expand(b, h, p, d), persistent_v.expand(b, h, p, d)


# ----------------------------------------------------------------------------------------------------
# shared helpers


def _sdpa_grouped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """SDPA over folded blocks, a few blocks at a time.

    q: (N, G, Lq, D); k, v: (N, G, Lk, D) (may be strided views); mask: (G, Lq, Lk) bool, True = attend.
    Returns (N, G, Lq, D). Groups of blocks are sized so one call never holds more than
    ``_MAX_SCORES_PER_CALL`` scores.
    """
    n, g, lq, _ = q.shape
    lk = k.shape[2]
    per_block = max(1, n * lq * lk)
    step = max(1, _MAX_SCORES_PER_CALL // per_block)
    if step >= g:
        return F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask, scale=scale)
    # split(), not slices: each slice's gradient would be a zero-filled tensor of q's (k's, v's) full size
    outs = [
        F.scaled_dot_product_attention(q_g, k_g.contiguous(), v_g.contiguous(), attn_mask=m_g, scale=scale)
        for q_g, k_g, v_g, m_g in zip(q.split(step, 1), k.split(step, 1), v.split(step, 1), mask.split(step))
    ]
    return torch.cat(outs, dim=1)


# ----------------------------------------------------------------------------------------------------
# causal (full / sliding-window) attention


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int | None,
    persistent_k: Tensor | None = None,
    persistent_v: Tensor | None = None,
    block_size: int | None = None,
    scale: float | None = None,
    persistent_q: Tensor | None = None,
) -> Tensor:
    """Causal (optionally sliding-window) softmax attention with optional persistent keys.

    Args:
        q: (B, H, Tq, D) queries, the last Tq positions of the key sequence.
        k, v: (B, H, Tk, D), Tk >= Tq.
        window: a query at absolute position i sees keys j with i - window < j <= i (so ``window=1`` is
            "itself only"); None means all j <= i.
        persistent_k, persistent_v: (H, P, D) or (B, H, P, D); visible to every query.
        block_size: query block size of the blockwise computation (any value >= 1; it need not divide T).
            Default: the window clamped to [64, 1024] (and to Tq) for sliding windows. Full attention with
            Tq == Tk and no block_size is one fused ``is_causal`` SDPA call (flash kernels, O(T) memory);
            otherwise it loops over query blocks (default 512), O(block x Tk) memory per step.
        scale: softmax scale; default 1/sqrt(D).
        persistent_q: (B, H, Tq, D) queries that score the persistent keys in place of q (the rest of the
            keys are scored by q). With q rotated by RoPE at absolute positions and the persistent keys
            unrotated, q . p changes with the query's position; the unrotated queries here keep those
            scores the same at every position. None: q scores every key.

    Returns:
        (B, H, Tq, D).
    """
    _check_qkv(q, k, v)
    check_int("window", window, none_ok=True)
    check_int("block_size", block_size, none_ok=True)
    persistent = _persistent_kv(persistent_k, persistent_v, q)
    tq, tk = q.shape[2], k.shape[2]
    if tq == 0:
        return q.clone()
    if persistent_q is not None:
        if persistent_q.shape != q.shape or persistent_q.dtype != q.dtype:
            raise ValueError(
                f"persistent_q must be q's shape {tuple(q.shape)} and dtype {q.dtype}, got "
                f"{tuple(persistent_q.shape)} {persistent_q.dtype}"
            )
        if persistent is not None:
            # Two score blocks in one softmax as one dot product over doubled channels: [q | q_p] against
            # [k | 0] for the sequence's keys and [0 | p] for the persistent ones.
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            pk, pv = persistent
            q = torch.cat([q, persistent_q], dim=-1)
            k = torch.cat([k, torch.zeros_like(k)], dim=-1)
            persistent = (torch.cat([torch.zeros_like(pk), pk], dim=-1), pv)
    if window is not None and window < tk:
        return _sliding_window_attention(q, k, v, window, persistent, block_size, scale)
    # The window reaches back past the first key for every query: this is full causal attention.
    return _full_causal_attention(q, k, v, persistent, block_size, scale)


def _full_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    persistent: tuple[Tensor, Tensor] | None,
    block_size: int | None,
    scale: float | None,
) -> Tensor:
    b, h, tq, d = q.shape  # d: the scores' channels (v's, or twice them with persistent_q)
    tk = k.shape[2]
    p = 0 if persistent is None else persistent[0].shape[2]
    if tq == tk and block_size is None:
        # One fused call (flash kernel on CPU and GPU: O(T) memory). SDPA's is_causal mask is aligned
        # top-left (query r sees keys <= r), so with P persistent keys in front we prepend P dummy queries:
        # real query r then sits at row P + r and sees all P persistent keys and keys 0..r.
        if persistent is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        pk, pv = persistent
        qp = torch.cat([q.new_zeros(b, h, p, d), q], dim=2)
        out = F.scaled_dot_product_attention(
            qp, torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), is_causal=True, scale=scale
        )
        return out[:, :, p:]

    # Blockwise over queries: each block of queries sees the keys up to its last position. Memory is
    # O(block x Tk) per call.
    block = block_size or _DEFAULT_FULL_BLOCK
    offset = tk - tq
    outs = []
    for r0 in range(0, tq, block):
        r1 = min(tq, r0 + block)
        end = offset + r1  # keys [0, end) are the only ones these queries can see
        rows = torch.arange(offset + r0, offset + r1, device=q.device)
        visible = torch.arange(end, device=q.device)[None, :] <= rows[:, None]
        kb, vb = k[:, :, :end], v[:, :, :end]
        if persistent is not None:
            kb = torch.cat([persistent[0], kb], dim=2)
            vb = torch.cat([persistent[1], vb], dim=2)
            visible = torch.cat([visible.new_ones(r1 - r0, p), visible], dim=1)
        outs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], kb, vb, attn_mask=visible, scale=scale))
    return torch.cat(outs, dim=2)


def _sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    persistent: tuple[Tensor, Tensor] | None,
    block_size: int | None,
    scale: float | None,
) -> Tensor:
    b, h, tq, d = q.shape  # d: the scores' channels (v's, or twice them with persistent_q)
    dv = v.shape[-1]
    tk = k.shape[2]
    offset = tk - tq
    block = min(tq, block_size or min(max(window, 64), 1024))  # a block longer than Tq is only padding

    # Keep only keys some query can see, then left-pad with zeros so that query r's own key sits at index
    # r + window - 1: every query block then needs the same relative span of keys.
    first = max(0, offset - window + 1)
    lead = offset - first  # real keys before the first query's own key (<= window - 1)
    pad_left = window - 1 - lead
    n_blocks = -(-tq // block)
    pad_right = n_blocks * block - tq
    k = F.pad(k[:, :, first:], (0, 0, pad_left, pad_right))
    v = F.pad(v[:, :, first:], (0, 0, pad_left, pad_right))
    q = F.pad(q, (0, 0, 0, pad_right))

    # Block i holds queries r in [i*block, (i+1)*block) and keys [i*block, i*block + span): overlapping
    # windows of the padded key sequence, as a strided view (no copy until a group is materialised).
    span = block + window - 1
    k_blocks = k.unfold(2, span, block).transpose(-1, -2)  # (B, H, n_blocks, span, D)
    v_blocks = v.unfold(2, span, block).transpose(-1, -2)

    # Band mask, identical for every block: key c of a block is visible to row r iff r <= c <= r+window-1
    # (that is exactly i - window < j <= i). Plus: left padding is never visible. Right padding is visible
    # only to padded query rows, which are dropped; every row sees its own (real or padded) key, so no row
    # is fully masked.
    rows = torch.arange(block, device=q.device)[:, None]
    cols = torch.arange(span, device=q.device)[None, :]
    band = (cols >= rows) & (cols <= rows + window - 1)
    key_index = torch.arange(n_blocks, device=q.device)[:, None] * block + cols  # (n_blocks, span)
    mask = band[None] & (key_index >= pad_left)[:, None, :]  # (n_blocks, block, span)

    if persistent is not None:
        p = persistent[0].shape[2]
        pk = persistent[0][:, :, None].expand(b, h, n_blocks, p, d)
        pv = persistent[1][:, :, None].expand(b, h, n_blocks, p, dv)
        k_blocks = torch.cat([pk, k_blocks], dim=3)
        v_blocks = torch.cat([pv, v_blocks], dim=3)
        mask = torch.cat([mask.new_ones(n_blocks, block, p), mask], dim=2)

    # Fold (batch, heads) into one leading dim and let the blocks play the role of SDPA's head dim.
    q_blocks = q.reshape(b * h, n_blocks, block, d)
    k_blocks, v_blocks = k_blocks.flatten(0, 1), v_blocks.flatten(0, 1)  # views where possible
    out = _sdpa_grouped(q_blocks, k_blocks, v_blocks, mask, scale)
    return out.reshape(b, h, n_blocks * block, dv)[:, :, :tq]


# ----------------------------------------------------------------------------------------------------
# segment attention (Titans MAC)


def _check_segment_inputs(q: Tensor, k: Tensor, v: Tensor, ctx_k: Tensor, ctx_v: Tensor, segment_len: int):
    _check_qkv(q, k, v)
    _check_qkv(q, ctx_k, ctx_v, names=("q", "ctx_k", "ctx_v"))
    if ctx_k.shape != k.shape:
        raise ValueError(
            f"ctx_k {tuple(ctx_k.shape)} must have the shape of k {tuple(k.shape)} "
            "(one retrieved memory token per position)"
        )
    check_int("segment_len", segment_len)


def segment_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx_k: Tensor,
    ctx_v: Tensor,
    *,
    segment_len: int,
    persistent_k: Tensor | None = None,
    persistent_v: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Segment-local causal attention over ``[persistent || ctx || segment]`` (Titans MAC).

    The key sequence (length Tk) starts at a segment boundary and is cut into segments of ``segment_len``
    (the last may be shorter). Queries are the last Tq positions of it; the query at position i attends to
    every persistent key, to ``ctx_k[j]`` and ``k[j]`` for j in i's segment with j <= i, and to nothing in
    other segments. ``ctx_k[j]`` is the memory's retrieved token h_j, computed from token j, so the j <= i
    rule on it is what keeps MAC causal.

    Streaming: pass the current segment's keys so far plus the new ones (keys starting at the segment's
    first position) and the new queries; Tk may span several segments.

    Args:
        q: (B, H, Tq, D).
        k, v, ctx_k, ctx_v: (B, H, Tk, D), Tk >= Tq, position 0 at a segment boundary.
        segment_len: C >= 1.
        persistent_k, persistent_v: (H, P, D) or (B, H, P, D).
        scale: softmax scale; default 1/sqrt(D).

    Returns:
        (B, H, Tq, D).
    """
    _check_segment_inputs(q, k, v, ctx_k, ctx_v, segment_len)
    persistent = _persistent_kv(persistent_k, persistent_v, q)
    b, h, tq, d = q.shape
    tk = k.shape[2]
    if tq == 0:
        return q.clone()
    c = segment_len

    # Drop whole segments before the first query's segment, then align queries with their keys by
    # left-padding them (the padded rows are computed and dropped: at most C - 1 of them).
    offset = tk - tq
    first = (offset // c) * c
    lead = offset - first
    k, v, ctx_k, ctx_v = (t[:, :, first:] for t in (k, v, ctx_k, ctx_v))
    n_seg = -(-(tk - first) // c)
    pad_right = n_seg * c - (tk - first)
    q = F.pad(q, (0, 0, lead, pad_right))
    k, v, ctx_k, ctx_v = (F.pad(t, (0, 0, 0, pad_right)) for t in (k, v, ctx_k, ctx_v))

    # Fold segments into the batch: (B*H, n_seg, C, D). Keys per segment: [persistent || ctx || segment].
    def fold(t: Tensor) -> Tensor:
        return t.reshape(b * h, n_seg, c, d)

    keys = [fold(ctx_k), fold(k)]
    values = [fold(ctx_v), fold(v)]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    masks = [causal, causal]
    if persistent is not None:
        p = persistent[0].shape[2]
        keys.insert(0, persistent[0].reshape(b * h, 1, p, d).expand(b * h, n_seg, p, d))
        values.insert(0, persistent[1].reshape(b * h, 1, p, d).expand(b * h, n_seg, p, d))
        masks.insert(0, causal.new_ones(c, p))
    # Every row sees its own segment key (the diagonal), so no row is fully masked, padded rows included.
    mask = torch.cat(masks, dim=1).expand(n_seg, c, -1)
    out = _sdpa_grouped(fold(q), torch.cat(keys, dim=2), torch.cat(values, dim=2), mask, scale)
    return out.reshape(b, h, n_seg * c, d)[:, :, lead : lead + tq]
