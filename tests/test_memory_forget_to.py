"""Forgetting toward the learned initial weights (`NeuralMemory.forget_to="init"`,
`TitansConfig.memory_forget_to`): W_t = (1 - alpha_t) W_{t-1} + alpha_t W_init + S_t.

At awkward sizes (T = 37, chunks of 8, head dim 6), with strong forgetting so the anchor term matters: the
chunked op equals the float64 reference (outputs, state, surprise and every gradient, the anchor's
included), with activation checkpointing and with the weight bound; a memory that is no longer written
returns to W_init (and to zero with the paper's forgetting); outputs stay causal; any split into calls
equals one pass; "zero" is today's memory bit for bit; bad values, other rules and the Triton kernels are
refused by name; MAC and MAL models stream with it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_memory import assert_close_rel, causality_check, random_problem
from test_memory_max_norm import assert_lm_streams, small_lm
from titans import NeuralMemory
from titans.models import TitansConfig, TitansLM
from titans.ops.memory import neural_memory_chunked, neural_memory_ref

F64 = torch.float64


def _flat(out) -> list[torch.Tensor]:
    y, w, s, surprise = out
    return [y, *w, *s, surprise]


def _loss(out, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in _flat(out)[:-1])


def _anchor(w, seed: int) -> tuple[torch.Tensor, ...]:
    """Per layer (1, H, d_in, d_out): broadcast over the batch, as the layer passes its W_0."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, *x.shape[1:], generator=g, dtype=x.dtype) for x in w)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(
    "options",
    [{}, {"checkpoint_every": 2}, {"max_norm": 1.5, "surprise_clip": 0.5}, {"residual": True}],
)
def test_chunked_equals_reference(depth, options):
    args, w, s = random_problem(2, 2, 37, 6, depth, seed=depth + 10)
    q, k, v, theta, log_eta, log_keep = args
    args = (q, k, v, theta, log_eta, 20 * log_keep)  # strong forgetting: the anchor term is large
    anchor = _anchor(w, depth)
    n, d = len(args), depth
    leaves_f = [a.clone().requires_grad_() for a in (*args, *w, *s, *anchor)]
    leaves_r = [a.clone().requires_grad_() for a in (*args, *w, *s, *anchor)]
    ref_options = {k: v for k, v in options.items() if k != "checkpoint_every"}

    def call(fn, leaves, **kw):
        w_, s_, a_ = (tuple(leaves[n + i * d : n + (i + 1) * d]) for i in range(3))
        return fn(*leaves[:n], w_, s_, chunk_size=8, anchor=a_, **kw)

    fast = call(neural_memory_chunked, leaves_f, **options)
    ref = call(neural_memory_ref, leaves_r, **ref_options)
    for a, b in zip(_flat(fast), _flat(ref)):
        assert_close_rel(a, b, 1e-10)
    grads_f = torch.autograd.grad(_loss(fast), leaves_f)
    grads_r = torch.autograd.grad(_loss(ref), leaves_r)
    for a, b in zip(grads_f, grads_r):
        assert a.abs().sum() > 0
        assert_close_rel(a, b, 1e-9)
    # the anchor changes the result
    plain = neural_memory_chunked(*args, w, s, chunk_size=8, **options)
    assert not torch.allclose(plain[1][0], fast[1][0], atol=1e-3)


def test_gradcheck_of_the_anchor_step():
    args, w, s = random_problem(1, 2, 10, 3, 2, expansion=1, seed=6)
    anchor = _anchor(w, 1)
    leaves = [a.clone().requires_grad_() for a in (args[3], args[5], *w, *anchor)]

    def fn(theta, log_keep, w0, w1, a0, a1):
        y, wn, sn, _ = neural_memory_chunked(
            args[0],
            args[1],
            args[2],
            theta,
            args[4],
            5 * log_keep,
            (w0, w1),
            s,
            chunk_size=3,
            anchor=(a0, a1),
        )
        return y, *wn, *sn

    assert torch.autograd.gradcheck(fn, leaves)


def test_an_unwritten_memory_returns_to_its_initial_weights():
    """theta = 0 (nothing written) and momentum off: forgetting alone acts. Toward "init", W relaxes to
    W_init; with the paper's forgetting it fades to zero."""
    args, w, s = random_problem(1, 2, 400, 4, 2, seed=3, momentum=False)
    q, k, v, theta, log_eta, log_keep = args
    args = (q, k, v, torch.zeros_like(theta), log_eta, torch.full_like(log_keep, -0.05))
    start = tuple(x + 3 for x in w)  # a state far from W_init
    _, w_init, _, _ = neural_memory_chunked(*args, start, s, chunk_size=8, anchor=w)
    _, w_zero, _, _ = neural_memory_chunked(*args, start, s, chunk_size=8)
    for a, b, z in zip(w_init, w, w_zero):
        assert (a - b).abs().max() < 1e-6 * b.abs().max()
        assert z.abs().max() < 1e-6


def _memory(**kw) -> NeuralMemory:
    torch.manual_seed(0)
    mem = NeuralMemory(
        12, heads=2, head_dim=6, depth=2, expansion=2, chunk_size=8, alpha_init=0.2, forget_to="init", **kw
    ).double()
    with torch.no_grad():
        mem.to_gates.weight.normal_(0, 0.3)
    return mem


def test_module_matches_reference_with_parameter_gradients():
    fast = _memory()
    ref = copy.deepcopy(fast)
    ref.impl = "reference"
    x = torch.randn(2, 37, 12, dtype=F64, requires_grad=True)
    out_f, out_r = fast.forward_with_stats(x), ref.forward_with_stats(x)
    assert_close_rel(out_f.output, out_r.output, 1e-10)
    for a, b in zip(out_f.state.weights, out_r.state.weights):
        assert_close_rel(a, b, 1e-10)
    g = torch.randn_like(out_f.output)
    grads_f = torch.autograd.grad(
        (out_f.output * g).sum() + out_f.state.weights[-1].sum(), [x, *fast.parameters()]
    )
    grads_r = torch.autograd.grad(
        (out_r.output * g).sum() + out_r.state.weights[-1].sum(), [x, *ref.parameters()]
    )
    names = ["input"] + [n for n, _ in fast.named_parameters()]
    for a, b in zip(grads_f, grads_r):
        assert_close_rel(a, b, 1e-9)
    # W_0 reaches the output through the anchor as well as through the first chunk
    zero = copy.deepcopy(fast)
    zero.forget_to = "zero"
    g_zero = torch.autograd.grad((zero(x)[0] * g).sum(), zero.init_weights[0])[0]
    assert not torch.allclose(g_zero, grads_f[names.index("init_weights.0")])


@pytest.mark.parametrize("j", [0, 5, 8, 13, 36])
def test_causality(j):
    mem = _memory()
    x = torch.randn(2, 37, 12, dtype=F64)
    before, after = causality_check(lambda x: mem(x)[0], x, j)
    assert before < 1e-12 and after > 1e-6


@pytest.mark.parametrize("impl", ["chunked", "reference"])
@pytest.mark.parametrize("lengths", [[5, 13, 19], [1, 2, 30, 4], [8, 16, 13]])
def test_streaming_equals_one_pass(impl, lengths):
    mem = _memory(impl=impl)
    x = torch.randn(2, 37, 12, dtype=F64)
    whole = mem.forward_with_stats(x)
    ys, state, start = [], None, 0
    for n in lengths:
        out = mem.forward_with_stats(x[:, start : start + n], state)
        ys.append(out.output)
        state, start = out.state, start + n
    assert_close_rel(torch.cat(ys, 1), whole.output, 1e-12)
    for a, b in zip(state.weights + state.momentum, whole.state.weights + whole.state.momentum):
        assert_close_rel(a, b, 1e-12)


def test_zero_is_todays_memory_bit_for_bit():
    x = torch.randn(2, 37, 12, requires_grad=True)
    outs = []
    for kw in ({}, {"forget_to": "zero"}):
        torch.manual_seed(3)
        mem = NeuralMemory(12, heads=2, head_dim=6, depth=2, chunk_size=8, **kw)
        y, state = mem(x)
        grads = torch.autograd.grad((y * y).sum() + state.weights[0].sum(), [x, *mem.parameters()])
        outs.append([y, *state.weights, *state.momentum, *grads])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_bad_values_other_rules_and_the_kernels_are_refused():
    with pytest.raises(ValueError, match="NeuralMemory: forget_to must be"):
        NeuralMemory(8, heads=2, forget_to="W0")
    with pytest.raises(ValueError, match="TitansConfig.memory_forget_to must be one of"):
        TitansConfig(memory_forget_to=None)
    with pytest.raises(ValueError, match=r"forget_to='init' is not covered by rule='atlas'"):
        NeuralMemory(8, heads=2, rule="atlas", forget_to="init")
    with pytest.raises(ValueError, match=r"memory_forget_to='init' is not covered by memory_rule='yaad'"):
        TitansConfig(variant="mal", memory_rule="yaad", memory_forget_to="init")
    with pytest.raises(ValueError, match=r"backend='triton'.*forget_to='init' is not covered by the kernels"):
        NeuralMemory(8, heads=2, backend="triton", forget_to="init")
    with pytest.raises(ValueError, match=r"memory_backend='triton'.*memory_forget_to"):
        TitansConfig(memory_backend="triton", memory_forget_to="init")
    assert not NeuralMemory(8, heads=2, forget_to="init")._use_triton(torch.zeros(1, 2, 3, 4))


@pytest.mark.parametrize("variant", ["mac", "mal"])
def test_lm_streams_with_it(variant):
    model = small_lm(variant, memory_forget_to="init", memory_alpha_init=0.3)
    tokens = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(1))
    full, _ = assert_lm_streams(model, tokens)
    plain = TitansLM(TitansConfig(**{**model.config.to_dict(), "memory_forget_to": "zero"})).double().eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        other, _ = plain(tokens)
    assert not torch.allclose(full[:, -8:], other[:, -8:], atol=1e-6)
