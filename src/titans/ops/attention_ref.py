"""Dense references for the attention kernels of `titans.ops.attention`, written to be obviously right.

Each builds the full (Tq, Tk) visibility mask over the whole sequence and runs a textbook masked softmax;
the tests compare the blockwise fast paths against them. They share no code with the fast paths, so a bug
there cannot hide on both sides of a test. Same arguments and shapes as the fast functions: q (B, H, Tq,
D) are the last Tq positions of the Tk-long keys k, v (B, H, Tk, D); persistent keys/values are (H, P, D)
or (B, H, P, D). Arguments are not validated here: the fast paths do that.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _softmax_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], masks: list[Tensor], scale, queries=None
):
    """softmax(q k^T * scale, masked) v over the key groups side by side; masks (Tq, Tk_i) bool.
    ``queries``: one query tensor per key group (default: q for every group)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    queries = [q] * len(keys) if queries is None else queries
    v, visible = torch.cat(values, dim=2), torch.cat(masks, dim=1)
    scores = torch.cat([torch.einsum("bhqd,bhkd->bhqk", qi, ki) for qi, ki in zip(queries, keys)], dim=3)
    scores = scores * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v)


def _with_persistent(
    q: Tensor, keys, values, masks, persistent_k: Tensor | None, persistent_v: Tensor | None
):
    """Prepend the persistent keys/values, visible to every query."""
    if persistent_k is None or persistent_k.shape[-2] == 0:
        return keys, values, masks
    b, h, tq, d = q.shape
    p = persistent_k.shape[-2]
    keys = [persistent_k.expand(b, h, p, d), *keys]
    values = [persistent_v.expand(b, h, p, d), *values]
    return keys, values, [torch.ones(tq, p, dtype=torch.bool, device=q.device), *masks]


def causal_attention_ref(
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
    """Dense reference for `causal_attention` (``block_size`` is ignored): query i sees key j iff
    j <= i and (no window, or j > i - window), and every persistent key (scored by ``persistent_q``
    where given, else by q)."""
    tq, tk = q.shape[2], k.shape[2]
    i = torch.arange(tk - tq, tk, device=q.device)[:, None]  # absolute query positions
    j = torch.arange(tk, device=q.device)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    keys, values, masks = _with_persistent(q, [k], [v], [visible], persistent_k, persistent_v)
    queries = None
    if persistent_q is not None and len(keys) == 2:
        queries = [persistent_q, q]
    return _softmax_attention(q, keys, values, masks, scale, queries)


def segment_attention_ref(
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
    """Dense reference for `segment_attention`: query i sees ctx_k[j] and k[j] iff j <= i and j lies in
    i's segment (j // segment_len == i // segment_len), and every persistent key."""
    tq, tk = q.shape[2], k.shape[2]
    i = torch.arange(tk - tq, tk, device=q.device)[:, None]
    j = torch.arange(tk, device=q.device)[None, :]
    visible = (j <= i) & (j // segment_len == i // segment_len)
    keys, values, masks = _with_persistent(
        q, [ctx_k, k], [ctx_v, v], [visible, visible], persistent_k, persistent_v
    )
    return _softmax_attention(q, keys, values, masks, scale)


__all__ = ["causal_attention_ref", "segment_attention_ref"]
