"""The weight bound (`NeuralMemory.max_norm`, `TitansConfig.memory_max_norm`): at every chunk boundary each
memory layer's W is rescaled to Frobenius norm <= max_norm.

Checked with the bound binding on most chunks, at awkward sizes (T = 37, chunks of 8, head dim 6): the
chunked op equals the float64 reference (outputs, state, surprise and every gradient), with and without
activation checkpointing; ||W_l|| stays within the bound at every chunk boundary of a 2,000-token stream
that leaves it far behind without one; outputs stay causal; any split into calls equals one pass; None is
today's memory bit for bit, and so is a bound that never binds; bad values, other rules and the Triton
kernels are refused by name; MAC and MAL models stream with it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_memory import assert_close_rel, causality_check, random_problem
from titans import NeuralMemory
from titans.models import TitansConfig, TitansLM
from titans.models.monitor import find_memory_state, memory_report
from titans.models.state import TitansState
from titans.ops.memory import bound_weights, neural_memory_chunked, neural_memory_ref

F64 = torch.float64
EPS = 1e-12  # rounding of a rescaled norm, relative


def _flat(out) -> list[torch.Tensor]:
    y, w, s, surprise = out
    return [y, *w, *s, surprise]


def _norms(weights) -> torch.Tensor:
    """(layers, B, H) Frobenius norms of each layer's (B, H, d_in, d_out) weights."""
    return torch.stack([torch.linalg.vector_norm(w, dim=(-2, -1)) for w in weights])


def _binding_share(args, w, s, chunk: int, max_norm: float, **options) -> float:
    """The share of (chunk, layer, row, head) where the unbounded update of a complete chunk, from the
    bounded state at its start, ends above max_norm: where the bound really acts."""
    seq = args[0].shape[2]
    over = []
    for start in range(0, seq - chunk + 1, chunk):
        piece = [a[:, :, start : start + chunk] for a in args]
        _, w_free, _, _ = neural_memory_chunked(*piece, w, s, chunk_size=chunk, **options)
        over.append(_norms(w_free) > max_norm)
        _, w, s, _ = neural_memory_chunked(*piece, w, s, chunk_size=chunk, max_norm=max_norm, **options)
    return torch.stack(over).double().mean().item()


def _loss(out, seed: int = 0) -> torch.Tensor:
    """A random linear function of the outputs and the final state."""
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in _flat(out)[:-1])


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(
    "options",
    [{}, {"surprise_clip": 0.5, "checkpoint_every": 2}, {"residual": True, "activation": "gelu"}],
)
def test_chunked_equals_reference_with_the_bound_binding(depth, options):
    args, w, s = random_problem(2, 2, 37, 6, depth, seed=depth)
    q, k, v, theta, log_eta, log_keep = args
    args = (q, k, v, 3 * theta, log_eta, 0.1 * log_keep)  # larger writes, less forgetting: W grows
    max_norm = 0.3 * _norms(w).min().item()
    ref_options = {k: v for k, v in options.items() if k != "checkpoint_every"}
    assert _binding_share(args, w, s, 8, max_norm, **ref_options) > 0.5
    leaves_f = [a.clone().requires_grad_() for a in (*args, *w, *s)]
    leaves_r = [a.clone().requires_grad_() for a in (*args, *w, *s)]
    n = len(args)

    def call(fn, leaves, **kw):
        return fn(*leaves[:n], tuple(leaves[n : n + depth]), tuple(leaves[n + depth :]), chunk_size=8, **kw)

    fast = call(neural_memory_chunked, leaves_f, max_norm=max_norm, **options)
    ref = call(neural_memory_ref, leaves_r, max_norm=max_norm, **ref_options)
    for a, b in zip(_flat(fast), _flat(ref)):
        assert_close_rel(a, b, 1e-10)
    # the state after the last complete chunk (32 of 37 tokens) sits on the bound where it binds
    assert (_norms(fast[1]) <= max_norm * (1 + EPS)).all()
    assert torch.isclose(_norms(fast[1]), torch.tensor(max_norm, dtype=F64), rtol=1e-12).any()
    grads_f = torch.autograd.grad(_loss(fast), leaves_f)
    grads_r = torch.autograd.grad(_loss(ref), leaves_r)
    for a, b in zip(grads_f, grads_r):
        assert a.abs().sum() > 0
        assert_close_rel(a, b, 1e-9)
    # and the bound changes the result
    free = neural_memory_chunked(*args, w, s, chunk_size=8, **options)
    assert not torch.allclose(free[0], fast[0])


@pytest.mark.parametrize("depth", [1, 2])
def test_module_outputs_and_gradients_match_reference(depth):
    torch.manual_seed(depth)
    fast = NeuralMemory(
        12, heads=2, head_dim=6, depth=depth, expansion=2, chunk_size=8, max_lr=1.0, theta_init=0.3
    ).double()
    with torch.no_grad():  # gates that differ per token and head
        fast.to_gates.weight.normal_(0, 0.3)
    # below every initial norm: W_0 is rescaled, and the writes push against the bound
    fast.max_norm = 0.5 * _norms(fast.initial_state(1).weights).min().item()
    ref = copy.deepcopy(fast)
    ref.impl = "reference"
    x = torch.randn(2, 37, 12, dtype=F64, requires_grad=True)
    out_f, out_r = fast.forward_with_stats(x), ref.forward_with_stats(x)
    assert_close_rel(out_f.output, out_r.output, 1e-10)
    assert_close_rel(out_f.stats.surprise, out_r.stats.surprise, 1e-10)
    for a, b in zip(out_f.state.weights + out_f.state.momentum, out_r.state.weights + out_r.state.momentum):
        assert_close_rel(a, b, 1e-10)
    assert torch.isclose(_norms(out_f.state.weights), torch.tensor(fast.max_norm, dtype=F64)).any()
    g = torch.randn_like(out_f.output)
    params_f, params_r = [x, *fast.parameters()], [x, *ref.parameters()]
    grads_f = torch.autograd.grad((out_f.output * g).sum() + out_f.state.weights[-1].sum(), params_f)
    grads_r = torch.autograd.grad((out_r.output * g).sum() + out_r.state.weights[-1].sum(), params_r)
    names = ["input"] + [n for n, _ in fast.named_parameters()]
    for name, a, b in zip(names, grads_f, grads_r):
        assert a.abs().sum() > 0, f"zero gradient for {name}"
        assert_close_rel(a, b, 1e-9)


def test_initial_state_is_bounded_and_differentiable():
    mem = NeuralMemory(12, heads=2, head_dim=6, depth=2, chunk_size=8, max_norm=1.5)
    init = _norms(mem.initial_state(3).weights)
    assert init.shape == (2, 3, 2)
    assert torch.allclose(init, torch.tensor(1.5))  # every init norm (about sqrt(d_out)) is above 1.5
    free = NeuralMemory(12, heads=2, head_dim=6, depth=2, chunk_size=8)
    free.load_state_dict(mem.state_dict())
    for a, b in zip(mem.initial_state(1).weights, free.initial_state(1).weights):
        assert torch.allclose(a, b * (1.5 / torch.linalg.vector_norm(b, dim=(-2, -1)))[..., None, None])
    mem.initial_state(1).weights[0].sum().backward()
    assert mem.init_weights[0].grad.abs().sum() > 0


def test_bound_holds_at_every_boundary_of_a_long_stream():
    """2,000 tokens with theta 0.5 and almost no forgetting: without the bound ||W|| grows far past it;
    with it, every chunk boundary's ||W_l|| is within max_norm (up to rounding)."""
    chunk, seq, max_norm = 8, 2000, 3.0
    results = {}
    for bound in (None, max_norm):
        torch.manual_seed(0)
        mem = NeuralMemory(
            16,
            heads=2,
            head_dim=6,
            chunk_size=chunk,
            max_lr=1.0,
            theta_init=0.5,
            alpha_init=1e-4,
            max_norm=bound,
        ).double()
        x = torch.randn(1, seq, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            state = mem.initial_state(1)
            q, k, v, _ = mem.project(x, state.conv_tail)
            gates = mem.gates(x)
            w, s = state.weights, state.momentum
            norms = [_norms(w)]
            for a in range(0, seq, chunk):
                piece = [t[:, :, a : a + chunk] for t in (q, k, v, *gates.unbind(-1))]
                _, w, s, _ = neural_memory_chunked(
                    *piece, w, s, chunk_size=chunk, surprise_clip=mem.surprise_clip, max_norm=bound
                )
                norms.append(_norms(w))
            # the chunk-by-chunk op is the layer's one pass
            _, whole = mem(x)
        for a, b in zip(w, whole.weights):
            assert_close_rel(a, b, 1e-10)
        results[bound] = torch.stack(norms)
    assert results[None].max() > 10 * max_norm
    assert results[max_norm].max() <= max_norm * (1 + EPS)
    assert (results[max_norm][1:] > max_norm * (1 - 1e-9)).double().mean() > 0.9  # on the bound, mostly


@pytest.mark.parametrize("j", [0, 5, 8, 13, 20, 36])
def test_causality_with_the_bound(j):
    torch.manual_seed(1)
    mem = NeuralMemory(12, heads=2, head_dim=6, depth=2, chunk_size=8, max_lr=0.3, max_norm=1.5).double()
    x = torch.randn(2, 37, 12, dtype=F64)
    before, after = causality_check(lambda x: mem(x)[0], x, j)
    assert before < 1e-12
    assert after > 1e-6


@pytest.mark.parametrize("impl", ["chunked", "reference"])
@pytest.mark.parametrize("lengths", [[5, 13, 19], [1, 2, 30, 4], [8, 16, 13]])
def test_streaming_equals_one_pass(impl, lengths):
    torch.manual_seed(2)
    mem = NeuralMemory(
        12, heads=2, head_dim=6, depth=2, chunk_size=8, max_lr=0.3, max_norm=1.5, impl=impl
    ).double()
    x = torch.randn(2, 37, 12, dtype=F64)
    whole = mem.forward_with_stats(x)
    ys, state, start = [], None, 0
    for n in lengths:
        out = mem.forward_with_stats(x[:, start : start + n], state)
        ys.append(out.output)
        state, start = out.state, start + n
        # a call ending inside a chunk returns the bounded state of the last boundary
        assert (_norms(state.weights) <= 1.5 * (1 + EPS)).all()
    assert_close_rel(torch.cat(ys, 1), whole.output, 1e-12)
    assert state.position == whole.state.position == 37
    for a, b in zip(state.weights + state.momentum, whole.state.weights + whole.state.momentum):
        assert_close_rel(a, b, 1e-12)
    assert_close_rel(state.pending_k, whole.state.pending_k, 1e-12)


def test_none_is_todays_memory_bit_for_bit():
    x = torch.randn(2, 37, 12, requires_grad=True)
    outs = []
    for kw in ({}, {"max_norm": None}):
        torch.manual_seed(3)
        mem = NeuralMemory(12, heads=2, head_dim=6, depth=2, chunk_size=8, **kw)
        y, state = mem(x)
        params = [x, *mem.parameters()]
        grads = torch.autograd.grad((y * y).sum() + state.weights[0].sum(), params)
        outs.append([y, *state.weights, *state.momentum, *grads])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("checkpoint_every", [None, 2])
def test_a_bound_that_never_binds_changes_nothing_bit_for_bit(checkpoint_every):
    """The rescale factor is exactly 1 below the bound: outputs, state and gradients are bitwise those of
    no bound, with and without autograd and checkpointing."""
    args, w, s = random_problem(2, 2, 37, 6, 2, seed=4)
    results = []
    for bound in (None, 1e6):
        leaves = [a.clone().requires_grad_() for a in (*args, *w, *s)]
        out = neural_memory_chunked(
            *leaves[:6],
            tuple(leaves[6:8]),
            tuple(leaves[8:]),
            chunk_size=8,
            max_norm=bound,
            checkpoint_every=checkpoint_every,
        )
        with torch.no_grad():
            plain = neural_memory_chunked(*args, w, s, chunk_size=8, max_norm=bound)
        results.append(_flat(out) + _flat(plain) + list(torch.autograd.grad(_loss(out), leaves)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_checkpointing_keeps_outputs_and_gradients():
    args, w, s = random_problem(2, 2, 37, 6, 2, seed=5)
    max_norm = 0.8 * _norms(w).min().item()
    results = []
    for every in (None, 1, 3):
        leaves = [a.clone().requires_grad_() for a in args]
        out = neural_memory_chunked(*leaves, w, s, chunk_size=8, max_norm=max_norm, checkpoint_every=every)
        results.append(_flat(out) + list(torch.autograd.grad(_loss(out), leaves)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_close_rel(a, b, 1e-12)


@pytest.mark.parametrize("checkpoint_every", [None, 1])
def test_gradcheck_with_the_bound(checkpoint_every):
    """The hand-written backward of the in-place rescale, by finite differences (state and momentum too)."""
    args, w, s = random_problem(1, 2, 10, 3, 2, expansion=1, seed=6)
    max_norm = 0.5 * _norms(w).min().item()
    leaves = [a.clone().requires_grad_() for a in (args[0], args[1], args[2], args[3], *w, *s)]

    def fn(q, k, v, theta, w0, w1, s0, s1):
        y, wn, sn, _ = neural_memory_chunked(
            q,
            k,
            v,
            theta,
            args[4],
            args[5],
            (w0, w1),
            (s0, s1),
            chunk_size=3,
            max_norm=max_norm,
            checkpoint_every=checkpoint_every,
        )
        return y, *wn, *sn

    assert torch.autograd.gradcheck(fn, leaves)


def test_bound_weights_is_the_projection_onto_the_ball():
    w = torch.randn(3, 2, 4, 5, dtype=F64)
    w[0, 0] *= 0  # a zero matrix stays zero, with a finite gradient
    w.requires_grad_()
    bounded = bound_weights(w, 1.0)
    norms = torch.linalg.vector_norm(w, dim=(-2, -1))
    expected = torch.where((norms > 1)[..., None, None], w / norms[..., None, None], w)
    assert_close_rel(bounded, expected, 1e-15)
    assert torch.equal(bounded[0, 0], w[0, 0])
    bounded.sum().backward()
    assert torch.isfinite(w.grad).all()


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_max_norm_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="NeuralMemory: max_norm"):
        NeuralMemory(8, heads=2, max_norm=bad)
    with pytest.raises(ValueError, match="TitansConfig.memory_max_norm"):
        TitansConfig(memory_max_norm=bad)
    args, w, s = random_problem(1, 1, 4, 3, 1)
    with pytest.raises(ValueError, match="neural_memory_chunked: max_norm"):
        neural_memory_chunked(*args, w, s, chunk_size=2, max_norm=bad)


def test_other_rules_and_the_triton_kernels_are_refused():
    with pytest.raises(ValueError, match=r"max_norm=1.0 is not covered by rule='atlas'"):
        NeuralMemory(8, heads=2, rule="atlas", max_norm=1.0)
    with pytest.raises(ValueError, match=r"memory_max_norm=1.0 is not covered by memory_rule='yaad'"):
        TitansConfig(variant="mal", memory_rule="yaad", memory_max_norm=1.0)
    with pytest.raises(ValueError, match=r"backend='triton'.*max_norm is not covered by the kernels"):
        NeuralMemory(8, heads=2, backend="triton", max_norm=1.0)
    with pytest.raises(ValueError, match=r"memory_backend='triton'.*memory_max_norm"):
        TitansConfig(memory_backend="triton", memory_max_norm=1.0)
    # "auto" falls back to the torch loop, whatever the device
    mem = NeuralMemory(8, heads=2, backend="auto", max_norm=1.0)
    assert mem._triton_config_reason() == "max_norm is not covered by the kernels"
    assert not mem._use_triton(torch.zeros(1, 2, 3, 4))
    # a bound assigned later to a memory with another rule is refused when it runs
    rule_mem = NeuralMemory(8, heads=2, rule="yaad", chunk_size=2)
    rule_mem.max_norm = 1.0
    with pytest.raises(ValueError, match="max_norm=1.0 is not covered by rule='yaad'"):
        rule_mem(torch.randn(1, 4, 8))


def small_lm(variant: str, **memory_options) -> TitansLM:
    """A float64 tiny-preset LM of width 32 with the given memory options (seeded)."""
    cfg = TitansConfig.preset(
        "tiny", variant=variant, vocab_size=64, dim=32, heads=2, segment_len=16, window=16, chunk_size=4,
        **memory_options,
    )  # fmt: skip
    torch.manual_seed(0)
    return TitansLM(cfg).double().eval()


def assert_lm_streams(model: TitansLM, tokens: torch.Tensor, lengths=(5, 13, 19, 8)):
    """Calls of `lengths` tokens give one pass's logits and memory states; returns (logits, state)."""
    with torch.no_grad():
        full, full_state = model(tokens)
        parts, state, start = [], None, 0
        for n in lengths:
            logits, state = model(tokens[:, start : start + n], state)
            parts.append(logits)
            start += n
    assert torch.isfinite(full).all()
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)
    for a, b in zip(state.layers, full_state.layers):
        mem_a, mem_b = find_memory_state(a), find_memory_state(b)
        for x, y in zip(mem_a.weights + mem_a.momentum, mem_b.weights + mem_b.momentum):
            torch.testing.assert_close(x, y, atol=1e-10, rtol=0)
    return full, full_state


@pytest.mark.parametrize("variant", ["mac", "mal"])
def test_lm_with_the_bound_streams_and_reports_utilisation(variant):
    model = small_lm(variant, memory_max_norm=2.0)
    cfg = model.config
    memories = [b.memory for b in model.blocks if getattr(b, "memory", None) is not None]
    assert memories and all(m.max_norm == 2.0 for m in memories)
    tokens = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(1))
    _, full_state = assert_lm_streams(model, tokens)
    for layer in full_state.layers:
        assert (_norms(find_memory_state(layer).weights) <= 2.0 * (1 + EPS)).all()
    # utilisation is ||W|| / memory_max_norm when no monitoring max_norm is set, and at most 1
    report = memory_report(model, None, full_state)
    assert report.max_norm == 2.0 and 0 < report.max_utilisation <= 1 + 1e-9
    # the initial weights (norms about 4 and 5.7) are bounded too: at utilisation 1
    initial = memory_report(model, None, TitansState([], 0, model.config_dict))
    for layer in initial.layers:
        assert all(u == pytest.approx(1.0, rel=1e-12) for row in layer.utilisation for u in row)
    monitored = TitansConfig(**{**cfg.to_dict(), "memory_monitor_max_norm": 8.0})
    assert monitored.utilisation_max_norm == 8.0 and cfg.utilisation_max_norm == 2.0
    assert TitansConfig().utilisation_max_norm is None
