"""Attention ops and layers: fast paths vs dense references, causality, streaming == parallel, scale."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from titans.layers.attention import AttentionState, SegmentAttention, SegmentAttentionState, SelfAttention
from titans.layers.mlp import SwiGLU
from titans.layers.rotary import RotaryEmbedding
from titans.ops.attention import causal_attention, segment_attention
from titans.ops.attention_ref import causal_attention_ref, segment_attention_ref

F64 = torch.float64


def _randn(*shape: int, seed: int | None = None, dtype: torch.dtype = F64) -> torch.Tensor:
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _split_sizes(total: int, generator: torch.Generator, max_piece: int) -> list[int]:
    sizes = []
    while total > 0:
        n = min(total, int(torch.randint(1, max_piece + 1, (1,), generator=generator)))
        sizes.append(n)
        total -= n
    return sizes


# ----------------------------------------------------------------------------------------------------
# ops: fast == reference


@pytest.mark.parametrize("window", [1, 3, 16, None])
@pytest.mark.parametrize("seq_len", [1, 15, 33, 100])
@pytest.mark.parametrize("n_persistent", [0, 4])
def test_causal_attention_matches_reference(window, seq_len, n_persistent):
    torch.manual_seed(seq_len * 31 + n_persistent)
    b, h, d = 2, 3, 7  # odd head dim on purpose
    k, v = _randn(b, h, seq_len, d), _randn(b, h, seq_len, d)
    pk = _randn(h, n_persistent, d) if n_persistent else None
    pv = _randn(h, n_persistent, d) if n_persistent else None
    # Tq == Tk (parallel pass) and Tq < Tk (streaming with a cache); block sizes that don't divide T.
    for tq in sorted({seq_len, max(1, seq_len // 2), 1}):
        q = _randn(b, h, tq, d)
        expected = causal_attention_ref(q, k, v, window=window, persistent_k=pk, persistent_v=pv)
        for block in (None, 1, 7, 64):
            got = causal_attention(q, k, v, window=window, persistent_k=pk, persistent_v=pv, block_size=block)
            torch.testing.assert_close(
                got,
                expected,
                rtol=1e-10,
                atol=1e-10,
                msg=lambda m, tq=tq, block=block: f"tq={tq} block={block}: {m}",
            )


@pytest.mark.parametrize("window", [1, 5, None])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_causal_attention_persistent_queries_match_reference(window, scale):
    """persistent_q scores the persistent keys, q the sequence's: fast paths == the dense reference
    (which scores each key group by its own queries), for a parallel pass and for a cache."""
    b, h, d, p = 2, 3, 7, 4
    k, v = _randn(b, h, 41, d, seed=1), _randn(b, h, 41, d, seed=2)
    pk, pv = _randn(h, p, d, seed=3), _randn(h, p, d, seed=4)
    for tq in (41, 17, 1):
        q, qp = _randn(b, h, tq, d, seed=5), _randn(b, h, tq, d, seed=6)
        kw = dict(window=window, persistent_k=pk, persistent_v=pv, scale=scale)
        expected = causal_attention_ref(q, k, v, persistent_q=qp, **kw)
        for block in (None, 1, 6, 64):
            got = causal_attention(q, k, v, persistent_q=qp, block_size=block, **kw)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        # the persistent queries change the result (the test would pass if they were ignored otherwise)
        assert not torch.allclose(causal_attention(q, k, v, **kw), expected)
        # with no persistent keys, persistent_q has nothing to score
        plain = causal_attention(q, k, v, window=window, scale=scale)
        torch.testing.assert_close(
            causal_attention(q, k, v, window=window, scale=scale, persistent_q=qp), plain
        )
    with pytest.raises(ValueError, match="persistent_q must be q's shape"):
        causal_attention(q, k, v, window=window, persistent_k=pk, persistent_v=pv, persistent_q=qp[:, :, :0])


def test_causal_attention_batched_persistent_and_custom_scale():
    b, h, t, p, d = 3, 2, 29, 5, 6
    q, k, v = _randn(b, h, t, d), _randn(b, h, t, d), _randn(b, h, t, d)
    pk, pv = _randn(b, h, p, d), _randn(b, h, p, d)  # per-batch persistent keys
    for window in (4, None):
        expected = causal_attention_ref(q, k, v, window=window, persistent_k=pk, persistent_v=pv, scale=0.3)
        got = causal_attention(q, k, v, window=window, persistent_k=pk, persistent_v=pv, scale=0.3)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_causal_reference_is_plain_softmax_attention():
    # Guard the reference itself against a shared bug: one query, explicit formula.
    h, d, t, w = 1, 4, 9, 3
    q, k, v = _randn(1, h, 1, d), _randn(1, h, t, d), _randn(1, h, t, d)
    pk, pv = _randn(h, 2, d), _randn(h, 2, d)
    keys = torch.cat([pk[0], k[0, 0, t - w :]])  # the last query sees persistent + the last w keys
    values = torch.cat([pv[0], v[0, 0, t - w :]])
    weights = torch.softmax(keys @ q[0, 0, 0] / d**0.5, dim=0)
    expected = weights @ values
    got = causal_attention_ref(q, k, v, window=w, persistent_k=pk, persistent_v=pv)
    torch.testing.assert_close(got[0, 0, 0], expected)


@pytest.mark.parametrize("segment_len", [1, 5, 16])
@pytest.mark.parametrize("seq_len", [1, 15, 33, 100])
@pytest.mark.parametrize("n_persistent", [0, 4])
def test_segment_attention_matches_reference(segment_len, seq_len, n_persistent):
    torch.manual_seed(seq_len * 17 + segment_len)
    b, h, d = 2, 3, 7
    k, v, ck, cv = (_randn(b, h, seq_len, d) for _ in range(4))
    pk = _randn(h, n_persistent, d) if n_persistent else None
    pv = _randn(h, n_persistent, d) if n_persistent else None
    # Queries: all positions, or the last few (streaming: inside the last segment or spanning several).
    for tq in sorted({seq_len, 1, min(seq_len, 3), min(seq_len, segment_len + 2)}):
        q = _randn(b, h, tq, d)
        kwargs = dict(segment_len=segment_len, persistent_k=pk, persistent_v=pv)
        expected = segment_attention_ref(q, k, v, ck, cv, **kwargs)
        got = segment_attention(q, k, v, ck, cv, **kwargs)
        torch.testing.assert_close(
            got, expected, rtol=1e-10, atol=1e-10, msg=lambda m, tq=tq: f"tq={tq}: {m}"
        )


def test_segment_reference_is_plain_softmax_attention():
    # Position 6 with segment_len 4 is local index 2 of segment 1: it sees ctx/keys at positions 4..6.
    d = 5
    q, k, v, ck, cv = _randn(1, 1, 1, d), *(_randn(1, 1, 7, d) for _ in range(4))
    pk, pv = _randn(1, 3, d), _randn(1, 3, d)
    keys = torch.cat([pk[0], ck[0, 0, 4:7], k[0, 0, 4:7]])
    values = torch.cat([pv[0], cv[0, 0, 4:7], v[0, 0, 4:7]])
    expected = torch.softmax(keys @ q[0, 0, 0] / d**0.5, dim=0) @ values
    got = segment_attention_ref(q, k, v, ck, cv, segment_len=4, persistent_k=pk, persistent_v=pv)
    torch.testing.assert_close(got[0, 0, 0], expected)


def test_ops_gradcheck():
    b, h, t, d, p = 1, 2, 6, 3, 2
    args = [_randn(b, h, t, d).requires_grad_() for _ in range(3)]
    pers = [_randn(h, p, d).requires_grad_() for _ in range(2)]

    def causal(q, k, v, pk, pv):
        return causal_attention(q, k, v, window=3, persistent_k=pk, persistent_v=pv, block_size=4)

    def causal_full(q, k, v, pk, pv):
        return causal_attention(q, k, v, window=None, persistent_k=pk, persistent_v=pv)

    # fast_mode: checks random projections of the Jacobian (one backward each), enough to catch a wrong
    # gradient while keeping the test quick.
    assert torch.autograd.gradcheck(causal, (*args, *pers), fast_mode=True)
    assert torch.autograd.gradcheck(causal_full, (*args, *pers), fast_mode=True)
    ctx = [_randn(b, h, t, d).requires_grad_() for _ in range(2)]

    def segment(q, k, v, ck, cv, pk, pv):
        return segment_attention(q, k, v, ck, cv, segment_len=4, persistent_k=pk, persistent_v=pv)

    assert torch.autograd.gradcheck(segment, (*args, *ctx, *pers), fast_mode=True)


def test_ops_reject_bad_input():
    q, k = _randn(1, 2, 4, 3), _randn(1, 2, 5, 3)
    with pytest.raises(ValueError, match="batch, heads, seq, head_dim"):
        causal_attention(q[0], k, k, window=2)
    with pytest.raises(ValueError, match="at least as many keys"):
        causal_attention(k, q, q, window=2)
    with pytest.raises(ValueError, match="head_dim"):
        causal_attention(q, k[..., :2], k[..., :2], window=2)
    with pytest.raises(ValueError, match="window"):
        causal_attention(q, k, k, window=0)
    with pytest.raises(ValueError, match="block_size"):
        causal_attention(q, k, k, window=2, block_size=0)
    with pytest.raises(ValueError, match="together"):
        causal_attention(q, k, k, window=2, persistent_k=_randn(2, 1, 3))
    with pytest.raises(ValueError, match="persistent keys must be"):
        causal_attention(q, k, k, window=2, persistent_k=_randn(3, 1, 3), persistent_v=_randn(3, 1, 3))
    with pytest.raises(TypeError, match="dtype"):
        causal_attention(q, k.float(), k.float(), window=2)
    with pytest.raises(ValueError, match="segment_len"):
        segment_attention(q, k, k, k, k, segment_len=0)
    with pytest.raises(ValueError, match="ctx_k"):
        segment_attention(q, k, k, k[:, :, :4], k[:, :, :4], segment_len=2)


# ----------------------------------------------------------------------------------------------------
# rotary, MLP


def test_rotary_properties():
    rope = RotaryEmbedding(7, max_cached_positions=64)  # odd: the last channel is not rotated
    x = _randn(2, 3, 5, 7)
    positions = torch.tensor([0, 3, 9, 100, 2000])  # beyond the cache too
    y = rope(x, positions)
    torch.testing.assert_close(y[..., 6], x[..., 6])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0], rtol=1e-6, atol=1e-6)  # position 0 is the identity

    # Scores depend on relative position only: <R_m q, R_n k> == <R_{m+s} q, R_{n+s} k>.
    q, k = _randn(1, 1, 1, 7), _randn(1, 1, 1, 7)

    def score(m: int, n: int) -> torch.Tensor:
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()

    torch.testing.assert_close(score(5, 2), score(5 + 40, 2 + 40), rtol=1e-5, atol=1e-5)  # cached
    torch.testing.assert_close(score(5, 2), score(5 + 9000, 2 + 9000), rtol=1e-5, atol=1e-5)  # on the fly
    assert not torch.allclose(score(5, 2), score(5, 3))

    # Cached table and on-the-fly computation agree; bf16 in, bf16 out.
    x8, pos = _randn(1, 1, 3, 8), torch.tensor([1, 2, 3])
    torch.testing.assert_close(
        RotaryEmbedding(8)(x8, pos), RotaryEmbedding(8, max_cached_positions=0)(x8, pos)
    )
    xb = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    yb = RotaryEmbedding(8)(xb, torch.arange(4))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(
        yb.float(), RotaryEmbedding(8)(xb.float(), torch.arange(4)), rtol=1e-2, atol=1e-2
    )
    with pytest.raises(ValueError, match="positions"):
        rope(x, torch.arange(4))
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(0)


def test_swiglu():
    mlp = SwiGLU(6, 10).double()
    x = _randn(2, 3, 6)
    expected = mlp.down_proj(F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T))
    torch.testing.assert_close(mlp(x), expected)
    assert all(m.bias is None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    with pytest.raises(ValueError, match="last dim"):
        mlp(_randn(2, 3, 5))
    with pytest.raises(ValueError, match="hidden_dim"):
        SwiGLU(6, 0)


# ----------------------------------------------------------------------------------------------------
# layers: causality, streaming, state


def _self_attention(window: int | None, persistent: int, **kwargs) -> SelfAttention:
    torch.manual_seed(0)
    return SelfAttention(12, 3, 5, window=window, persistent_tokens=persistent, **kwargs).double()


def _segment_attention(segment_len: int, persistent: int, **kwargs) -> SegmentAttention:
    torch.manual_seed(0)
    return SegmentAttention(
        12, 3, 5, segment_len=segment_len, persistent_tokens=persistent, **kwargs
    ).double()


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("persistent", [0, 3])
def test_self_attention_is_causal(window, persistent):
    layer = _self_attention(window, persistent)
    x = _randn(2, 23, 12, seed=1)
    y, _ = layer(x)
    for j in (0, 7, 22):
        x2 = x.clone()
        x2[:, j] += _randn(2, 12, seed=j)
        y2, _ = layer(x2)
        torch.testing.assert_close(y2[:, :j], y[:, :j], rtol=0, atol=1e-12)
        assert (y2[:, j] - y[:, j]).abs().max() > 1e-6  # token j does reach its own output
        if window is not None:  # and no further than the window
            torch.testing.assert_close(y2[:, j + window :], y[:, j + window :], rtol=0, atol=1e-12)
            if j + window - 1 < 23:
                assert (y2[:, j + window - 1] - y[:, j + window - 1]).abs().max() > 1e-6


@pytest.mark.parametrize("persistent", [0, 3])
def test_segment_attention_is_causal_and_segment_local(persistent):
    c = 5
    layer = _segment_attention(c, persistent)
    x, ctx = _randn(2, 23, 12, seed=1), _randn(2, 23, 12, seed=2)
    y, _ = layer(x, ctx)
    for j in (0, 6, 9, 22):
        seg_end = (j // c + 1) * c
        for which in ("x", "ctx"):
            x2, ctx2 = x.clone(), ctx.clone()
            (x2 if which == "x" else ctx2)[:, j] += _randn(2, 12, seed=j)
            y2, _ = layer(x2, ctx2)
            torch.testing.assert_close(y2[:, :j], y[:, :j], rtol=0, atol=1e-12, msg=f"{which}_{j} leaks back")
            torch.testing.assert_close(
                y2[:, seg_end:],
                y[:, seg_end:],
                rtol=0,
                atol=1e-12,
                msg=f"{which}_{j} leaks to a later segment",
            )
            assert (y2[:, j] - y[:, j]).abs().max() > 1e-6


def test_segments_are_independent_with_local_positions():
    # A segment's outputs equal a fresh call on that segment alone: nothing crosses segment boundaries and
    # RoPE positions restart at every segment.
    c = 5
    layer = _segment_attention(c, 2)
    x, ctx = _randn(1, 17, 12, seed=6), _randn(1, 17, 12, seed=7)
    y, _ = layer(x, ctx)
    for s0 in (0, 5, 15):
        y_alone, _ = layer(x[:, s0 : s0 + c], ctx[:, s0 : s0 + c])
        torch.testing.assert_close(y[:, s0 : s0 + c], y_alone, rtol=1e-10, atol=1e-10)


def _tensors_of(state) -> list[torch.Tensor]:
    return [t for t in vars(state).values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize(("window", "persistent", "gate"), [(None, 0, False), (1, 2, False), (6, 3, True)])
def test_self_attention_streaming_equals_parallel(window, persistent, gate):
    layer = _self_attention(window, persistent, output_gate=gate)
    t = 37
    x = _randn(2, t, 12, seed=3)
    y_full, state_full = layer(x)
    for pieces in (_split_sizes(t, torch.Generator().manual_seed(window or 0), 9), [1] * t):
        state, outs, i = None, [], 0
        for n in pieces:
            before = None if state is None else [s.clone() for s in _tensors_of(state)]
            y, new_state = layer(x[:, i : i + n], state)
            if state is not None:  # the state passed in is not modified
                for a, b in zip(before, _tensors_of(state)):
                    assert torch.equal(a, b)
            state, i = new_state, i + n
            outs.append(y)
            cache = t if window is None else window - 1
            assert state.k.shape[2] == min(i, cache)
        torch.testing.assert_close(torch.cat(outs, dim=1), y_full, rtol=1e-10, atol=1e-10)
        assert state.position == state_full.position == t
        torch.testing.assert_close(state.k, state_full.k)


def test_self_attention_persistent_rope_none_is_shift_invariant():
    """With persistent_rope="none" the output at a token depends only on the last `window` tokens, not
    on where they sit in the stream; "absolute" (queries rotated at their absolute position scoring
    unrotated persistent keys) depends on the position, which is what degraded models past their training
    length."""
    torch.manual_seed(0)
    window, n = 5, 300
    x = _randn(2, n, 12, seed=7)
    shift = 211  # the same tokens, scored from position 0 and from position 211
    for rope, invariant in (("none", True), ("absolute", False)):
        torch.manual_seed(0)
        layer = SelfAttention(12, 3, 4, window=window, persistent_tokens=3, persistent_rope=rope).double()
        with torch.no_grad():
            layer.persistent.mul_(4.0)  # sharp scores for the persistent keys, as a trained layer has
            full, _ = layer(x)
            late, _ = layer(x[:, shift:])
        gap = (full[:, shift + window :] - late[:, window:]).abs().max().item()
        # RoPE's tables are float32: relative positions agree to float32 rounding, not float64's
        assert (gap < 1e-5) if invariant else (gap > 1e-2), (rope, gap)
    with pytest.raises(ValueError, match="persistent_rope must be one of"):
        SelfAttention(12, 3, 4, window=window, persistent_tokens=3, persistent_rope="relative")


@pytest.mark.parametrize("window", [None, 6])
def test_self_attention_persistent_rope_none_streams_and_is_causal(window):
    layer = SelfAttention(12, 3, 4, window=window, persistent_tokens=2, persistent_rope="none").double()
    x = _randn(2, 29, 12, seed=8)
    y_full, _ = layer(x)
    state, outs, i = None, [], 0
    for n in (1, 7, 3, 11, 7):
        y, state = layer(x[:, i : i + n], state)
        outs.append(y)
        i += n
    torch.testing.assert_close(torch.cat(outs, dim=1), y_full, rtol=1e-10, atol=1e-10)
    x2 = x.clone()
    x2[:, 15:] += 1.0
    y2, _ = layer(x2)
    torch.testing.assert_close(y2[:, :15], y_full[:, :15], rtol=0, atol=0)
    assert not torch.allclose(y2[:, 15:], y_full[:, 15:])


@pytest.mark.parametrize(("segment_len", "persistent"), [(1, 0), (5, 2), (16, 3)])
def test_segment_attention_streaming_equals_parallel(segment_len, persistent):
    layer = _segment_attention(segment_len, persistent, output_gate=persistent == 2)
    t = 37
    x, ctx = _randn(2, t, 12, seed=4), _randn(2, t, 12, seed=5)
    y_full, state_full = layer(x, ctx)
    assert state_full.k.shape[2] == t % segment_len
    for pieces in (_split_sizes(t, torch.Generator().manual_seed(segment_len), 2 * segment_len + 3), [1] * t):
        state, outs, i = None, [], 0
        for n in pieces:
            before = None if state is None else [s.clone() for s in _tensors_of(state)]
            y, new_state = layer(x[:, i : i + n], ctx[:, i : i + n], state)
            if state is not None:
                for a, b in zip(before, _tensors_of(state)):
                    assert torch.equal(a, b)
            state, i = new_state, i + n
            outs.append(y)
            assert state.k.shape[2] == state.ctx_k.shape[2] == i % segment_len  # resets at boundaries
        torch.testing.assert_close(torch.cat(outs, dim=1), y_full, rtol=1e-10, atol=1e-10)
        assert state.position == t


def test_states_detach_and_are_flat():
    layer = SelfAttention(8, 2, 4, window=3)
    _, state = layer(torch.randn(1, 5, 8))
    assert state.k.requires_grad
    detached = state.detach()
    assert isinstance(detached, AttentionState) and not detached.k.requires_grad
    assert detached.position == 5
    seg = SegmentAttention(8, 2, 4, segment_len=4)
    _, sstate = seg(torch.randn(1, 6, 8), torch.randn(1, 6, 8))
    sd = sstate.detach()
    assert isinstance(sd, SegmentAttentionState) and not any(t.requires_grad for t in _tensors_of(sd))
    for s in (detached, sd):  # tensors and ints only: ready for safetensors
        assert all(isinstance(val, (torch.Tensor, int)) for val in vars(s).values())


def test_layers_reject_bad_input():
    layer = SelfAttention(8, 2, 4, window=3)
    with pytest.raises(ValueError, match="batch, seq, dim=8"):
        layer(torch.randn(5, 8))
    with pytest.raises(ValueError, match="batch, seq, dim=8"):
        layer(torch.randn(1, 5, 7))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(1, 5, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="window"):
        SelfAttention(8, 2, 4, window=0)
    with pytest.raises(ValueError, match="heads"):
        SelfAttention(8, 0, 4, window=None)
    with pytest.raises(ValueError, match="segment_len"):
        SegmentAttention(8, 2, 4, segment_len=0)
    _, state = layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="state.k"):
        layer(torch.randn(1, 1, 8), state)  # batch mismatch
    with pytest.raises(ValueError, match="state.position"):
        layer(torch.randn(2, 1, 8), AttentionState(state.k, state.v, -1))
    seg = SegmentAttention(8, 2, 4, segment_len=4)
    with pytest.raises(ValueError, match="ctx"):
        seg(torch.randn(1, 5, 8), torch.randn(1, 4, 8))


def test_layers_run_in_bfloat16():
    x = torch.randn(2, 19, 16)
    for layer in (
        SelfAttention(16, 2, 8, window=5, persistent_tokens=2),
        SegmentAttention(16, 2, 8, segment_len=6, persistent_tokens=2),
    ):
        args = (x,) if isinstance(layer, SelfAttention) else (x, x.flip(1))
        y32, _ = layer(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_auto, _ = layer(*args)
        y_bf16, _ = layer.to(torch.bfloat16)(*(a.bfloat16() for a in args))
        for y in (y_auto, y_bf16):
            assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
            torch.testing.assert_close(y.float(), y32, rtol=0.1, atol=0.05)


def test_long_sliding_window_forward_is_blockwise(monkeypatch):
    """32K tokens, window 512: finishes quickly and no SDPA call ever holds anything near T x T scores."""
    t, window = 32768, 512
    layer = SelfAttention(32, 2, 16, window=window, persistent_tokens=4)
    x = torch.randn(1, t, 32)
    largest = 0
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        nonlocal largest
        largest = max(largest, q.shape[:-1].numel() * k.shape[-2])  # scores this call computes
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    start = time.perf_counter()
    with torch.no_grad():
        y, state = layer(x)
    elapsed = time.perf_counter() - start
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert state.k.shape[2] == window - 1
    # batch x heads x T x (window + block + persistent) at most, split further into bounded calls
    assert largest <= 2 * t * (window + 1024 + 4)
    assert largest < t * t / 8
    assert elapsed < 20, f"32K-token windowed forward took {elapsed:.1f}s"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_autocast_matches_float32():
    torch.manual_seed(0)
    device = "cuda"
    x = torch.randn(2, 300, 64, device=device)
    ctx = torch.randn(2, 300, 64, device=device)
    for layer in (
        SelfAttention(64, 4, 16, window=37, persistent_tokens=4),
        SelfAttention(64, 4, 16, window=None, persistent_tokens=4),
        SelfAttention(64, 4, 16, window=None),
        SegmentAttention(64, 4, 16, segment_len=48, persistent_tokens=4),
    ):
        layer = layer.to(device)
        args = (x,) if isinstance(layer, SelfAttention) else (x, ctx)
        y32, _ = layer(*args)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = layer(*args)
            y.float().square().mean().backward()
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), y32, rtol=0.05, atol=0.03)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
        # streaming on the GPU matches too
        state, outs = None, []
        for i in range(0, 300, 70):
            piece = tuple(a[:, i : i + 70] for a in args)
            y_piece, state = layer(*piece, state)
            outs.append(y_piece)
        torch.testing.assert_close(torch.cat(outs, dim=1), y32, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # inductor's code generation on a CPU: ~50 s cold
def test_inductor_compiled_segment_attention_streams_over_several_segments():
    """`attend` compiled by inductor (as `titans train --compile` compiles MAC's blocks on a CPU), called
    segment after segment: from the third call the position is dynamic and the KV cache leaves with a
    symbolic length. Kept in the projections' (B, T, H, D) memory order, inductor could not lay that cache
    out and crashed (the third segment must be whole: a partial one returns its keys uncut).
    Equal to eager."""
    torch.manual_seed(0)
    attn = SegmentAttention(16, 2, 8, segment_len=8)
    x, ctx = torch.randn(2, 29, 16), torch.randn(2, 29, 16)

    def run(attend) -> torch.Tensor:
        state, ys, at = None, [], 0
        for tok in attn.project_tokens(x, 0).split([8, 8, 8, 5]):
            y, state = attend(tok, ctx[:, at : at + tok.q.shape[2]], state)
            ys.append(y)
            at += tok.q.shape[2]
        return torch.cat(ys, 1)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = run(torch.compile(attn.attend))
            torch.testing.assert_close(got, run(attn.attend), atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
