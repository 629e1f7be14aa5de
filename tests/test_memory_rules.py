"""Memory rules (MIRAS / ATLAS presets): the chunked op vs the float64 per-token reference, streaming,
every variant, the Titans path unchanged, bad input."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tiny_lm import random_tokens, tiny_model
from titans import NeuralMemory, TitansConfig
from titans.ops.memory import (
    RULE_PRESETS,
    Bias,
    HuberBias,
    KLRetention,
    LpBias,
    LqRetention,
    MemoryRule,
    MomentumSGD,
    Muon,
    Window,
    fits_fast_path,
    memory_rule_chunked,
    memory_rule_chunked_autograd,
    memory_rule_ref,
    neural_memory,
    neural_memory_chunked,
    neural_memory_ref,
    newton_schulz,
    resolve_rule,
)

F64 = torch.float64
PRESETS = list(RULE_PRESETS)


def rule_problem(rule: MemoryRule, seq: int, depth: int, d: int = 5, seed: int = 0):
    """Random q/k/v, gates (with the rule's extra channels), initial state and momentum (non-zero)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, seq, d, generator=g, dtype=F64) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    theta = 0.2 * torch.rand(2, 3, seq, generator=g, dtype=F64)
    log_eta = F.logsigmoid(2 * torch.randn(2, 3, seq, generator=g, dtype=F64))
    log_keep = F.logsigmoid(2 * torch.randn(2, 3, seq, generator=g, dtype=F64) + 3)
    extra = [
        torch.rand(2, 3, seq, generator=g, dtype=F64)
        if name == "omega"
        else 0.05 + 0.3 * torch.rand(2, 3, seq, generator=g, dtype=F64)
        for name in rule.extra_gates
    ]
    gates = torch.stack([theta, log_eta, log_keep, *extra], -1)
    sizes = [d] + [2 * d] * (depth - 1) + [d]
    w = tuple(
        torch.randn(2, 3, sizes[i], sizes[i + 1], generator=g, dtype=F64) / math.sqrt(sizes[i])
        for i in range(depth)
    )
    s = tuple(0.1 * torch.randn(x.shape, generator=g, dtype=F64) for x in w)
    return q, k, v, gates, w, s


def run_with_grads(fn, inputs, depth, **kw):
    """fn's outputs and the gradients of a loss touching all of them w.r.t. every input."""
    inputs = [x.clone().requires_grad_() for x in inputs]
    y, w, s, norm = fn(*inputs[:4], tuple(inputs[4 : 4 + depth]), tuple(inputs[4 + depth :]), **kw)
    probe = torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)
    loss = (y * probe).sum() + sum(x.square().sum() for x in w) + sum(x.sin().sum() for x in s) + norm.sum()
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return (y, *w, *s, norm), grads


OPS = {"dispatch": memory_rule_chunked, "autograd": memory_rule_chunked_autograd}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    "depth, chunk, seq, history, clip, act",
    [(1, 1, 6, 0, None, "silu"), (2, 3, 11, 2, 0.5, "gelu"), (2, 5, 13, 0, 0.3, "silu")],
)
def test_rule_op_matches_float64_reference(op, preset, depth, chunk, seq, history, clip, act):
    """Outputs, final state, surprise and every input's gradient: chunked op == per-token reference, on
    the generic autograd op and on `memory_rule_chunked` (the fast path where the rule fits it)."""
    rule = RULE_PRESETS[preset]
    q, k, v, gates, w, s = rule_problem(rule, seq, depth, seed=depth * 10 + chunk)
    kw = dict(
        rule=rule,
        chunk_size=chunk,
        history=min(history, rule.window.size - 1),
        activation=act,
        surprise_clip=clip,
    )
    fast, g_fast = run_with_grads(OPS[op], [q, k, v, gates, *w, *s], depth, **kw)
    ref, g_ref = run_with_grads(memory_rule_ref, [q, k, v, gates, *w, *s], depth, **kw)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    for a, b in zip(g_fast, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("depth", [1, 2])
def test_titans_rule_on_the_rules_op_equals_the_fast_path(depth):
    """The generic op with Titans's parts is the custom-autograd fast path (outputs and gradients)."""
    rule = RULE_PRESETS["titans"]
    q, k, v, gates, w, s = rule_problem(rule, 14, depth, seed=3)

    def titans(q, k, v, gates, w, s, **kw):
        return neural_memory_chunked(q, k, v, *gates.unbind(-1), w, s, chunk_size=4, surprise_clip=0.4)

    fast, g_fast = run_with_grads(titans, [q, k, v, gates, *w, *s], depth)
    generic, g_gen = run_with_grads(
        memory_rule_chunked_autograd,
        [q, k, v, gates, *w, *s],
        depth,
        rule=rule,
        chunk_size=4,
        surprise_clip=0.4,
    )
    for a, b in zip(fast + g_fast, generic + g_gen):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_titans_rule_is_todays_code_path_bit_for_bit():
    """rule="titans" (the default) adds no parameter and its output is that of the Titans op itself."""
    torch.manual_seed(0)
    default = NeuralMemory(16, heads=2, chunk_size=4)
    torch.manual_seed(0)
    named = NeuralMemory(16, heads=2, chunk_size=4, rule=MemoryRule())
    assert named.to_rule_gates is None and default.state_dict().keys() == named.state_dict().keys()
    for a, b in zip(default.state_dict().values(), named.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(2, 19, 16)
    y, state = named(x)
    # the layer's pieces by hand, through the Titans op
    st = default.initial_state(2)
    q, k, v, _ = default.project(x, st.conv_tail)
    g = default.gates(x)
    y_op, w, _, _ = neural_memory_chunked(
        q, k, v, *g.unbind(-1), st.weights, st.momentum, chunk_size=4, surprise_clip=1.0
    )
    assert torch.equal(y, default.combine_heads(y_op, x))
    assert all(torch.equal(a, b) for a, b in zip(state.weights, w))
    assert state.pending_gates.shape[-1] == 3


@pytest.mark.parametrize("preset", PRESETS)
def test_layer_streaming_pieces_equal_one_pass_and_match_the_reference(preset):
    """Pieces (single tokens, across chunk and window boundaries) == one pass == the reference layer,
    outputs, state and the gradients of every parameter (rule gate projections included)."""
    torch.manual_seed(1)
    mem = NeuralMemory(12, heads=2, depth=2, chunk_size=4, rule=preset).double()
    ref = NeuralMemory(12, heads=2, depth=2, chunk_size=4, rule=preset, impl="reference").double()
    ref.load_state_dict(mem.state_dict())
    x = torch.randn(2, 21, 12, dtype=F64)
    y, state = mem(x)
    outs, piece_state = [], None
    for a, b in ((0, 1), (1, 3), (3, 9), (9, 10), (10, 21)):
        out, piece_state = mem(x[:, a:b], piece_state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), y, rtol=0, atol=1e-12)
    for a, b in zip(state.weights + state.momentum, piece_state.weights + piece_state.momentum):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.equal(state.pending_k, piece_state.pending_k)
    y_ref, state_ref = ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-10)
    for a, b in zip(state.weights, state_ref.weights):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    g = torch.autograd.grad(y.sin().sum(), list(mem.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad(ref(x)[0].sin().sum(), list(ref.parameters()), allow_unused=True)
    for (name, _), a, b in zip(mem.named_parameters(), g, g_ref):
        assert a is not None, name
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    if mem.to_rule_gates is not None:  # the extra gates are learned: their projection gets a gradient
        assert g[[n for n, _ in mem.named_parameters()].index("to_rule_gates.weight")].abs().sum() > 0


@pytest.mark.parametrize("variant", ["mac", "mag", "mal", "lmm"])
@pytest.mark.parametrize("preset", ["atlas", "moneta"])
def test_every_variant_takes_a_rule_and_streams(variant, preset):
    model = tiny_model(variant, memory_rule=preset)
    assert all(m.rule == RULE_PRESETS[preset] for m in model.modules() if isinstance(m, NeuralMemory))
    x = random_tokens(2, 29, vocab=61)
    with torch.no_grad():
        full, _ = model(x)
        outs, state = [], None
        for a, b in ((0, 5), (5, 6), (6, 17), (17, 29)):
            logits, state = model(x[:, a:b], state)
            outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-10)
    assert torch.isfinite(full).all()


def test_config_round_trip_and_bad_rules():
    rule = MemoryRule(LpBias(2.5), LqRetention(3.0), Window(3), Muon(steps=4))
    cfg = TitansConfig(memory_rule=rule)
    assert isinstance(cfg.memory_rule, dict) and resolve_rule(cfg.memory_rule) == rule
    assert TitansConfig.from_dict(cfg.to_dict()) == cfg
    assert TitansConfig(memory_rule=RULE_PRESETS["yaad"]).memory_rule == "yaad"
    assert TitansConfig().memory_rule == "titans"
    with pytest.raises(ValueError, match="unknown preset 'lamda'"):
        TitansConfig(memory_rule="lamda")
    with pytest.raises(ValueError, match="bias kind"):
        TitansConfig(memory_rule={"bias": {"kind": "l7"}})
    with pytest.raises(ValueError, match="p must be a number >= 1"):
        LpBias(0.5)
    with pytest.raises(ValueError, match="q must be"):
        LqRetention(1.0)
    with pytest.raises(TypeError, match="bias must be one of"):
        MemoryRule(bias=KLRetention())
    with pytest.raises(ValueError, match="gates must be"):
        q, k, v, gates, w, s = rule_problem(RULE_PRESETS["atlas"], 6, 1)
        memory_rule_chunked(q, k, v, gates[..., :3], w, s, rule=RULE_PRESETS["atlas"], chunk_size=2)
    # a state from another rule is refused, naming why
    atlas = NeuralMemory(12, heads=2, chunk_size=4, rule="atlas")
    titans = NeuralMemory(12, heads=2, chunk_size=4)
    _, state = titans(torch.randn(1, 5, 12))
    with pytest.raises(ValueError, match="rule"):
        atlas(torch.randn(1, 3, 12), state)


@pytest.mark.parametrize("p", [1.5, 2.0, 2.5, 3.0])
def test_lp_error_map_and_its_derivative(p):
    """phi(e) = p sign(e) |e|^(p-1) (smoothed below p = 2), its derivative finite everywhere (at 0 too)."""
    bias = LpBias(p)
    e = torch.tensor([-1.3, -0.2, 0.0, 1e-9, 0.4, 2.0], dtype=F64, requires_grad=True)
    phi = bias.error_map(e, None)
    if p >= 2:
        torch.testing.assert_close(phi, p * e.sign() * e.abs() ** (p - 1))
    (d,) = torch.autograd.grad(phi.sum(), e)
    assert torch.isfinite(d).all()
    if p == 2.0:
        torch.testing.assert_close(d, torch.full_like(d, 2.0))
    x = torch.tensor([-0.7, 0.3, 1.1], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: bias.error_map(t, None), (x,))


def test_huber_error_map_clamps_per_coordinate_with_the_token_delta():
    e = torch.tensor([[[-2.0, 0.1, 0.5]]], dtype=F64)
    delta = torch.tensor([[0.3]], dtype=F64, requires_grad=True)
    phi = HuberBias().error_map(e, delta)
    torch.testing.assert_close(phi, torch.tensor([[[-0.6, 0.2, 0.6]]], dtype=F64))
    (g,) = torch.autograd.grad(phi.sum(), delta)  # -2 (clamped below) + 2 (clamped above)
    torch.testing.assert_close(g, torch.zeros_like(g))


def test_newton_schulz_flattens_the_spectrum():
    # singular values 1 .. 10^-1.5 (set, not drawn: with a drawn spectrum the smallest value, and whether 5
    # steps lift it into the band, depended on the random state the test found), random singular vectors
    gen = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(4, 6, 6, dtype=F64, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(4, 9, 9, dtype=F64, generator=gen))[0]
    x = u @ torch.diag_embed(torch.logspace(0, -1.5, 6, dtype=F64)) @ v[..., :6, :]
    s = torch.linalg.svdvals(newton_schulz(x, 5))
    assert s.min() > 0.6 and s.max() < 1.25  # the quintic's band around 1, not exact orthogonality
    s_tall = torch.linalg.svdvals(newton_schulz(x.transpose(-1, -2), 5))
    torch.testing.assert_close(s_tall, s)


def test_a_frozen_rule_memory_writes_nothing():
    mem = NeuralMemory(12, heads=2, chunk_size=4, rule="atlas", write=False)
    state = mem.initial_state(1)
    _, new = mem(torch.randn(1, 11, 12), state)
    assert all(a is b for a, b in zip(new.weights, state.weights)) and new.position == 11


@pytest.mark.parametrize(
    "bias", [LpBias(1.5), LpBias(2.0), LpBias(2.5), HuberBias()], ids=["p1.5", "p2", "p2.5", "huber"]
)
def test_biases_on_the_fast_path_equal_autograd_with_checkpointing(bias):
    """A bias with Titans's other parts runs on the custom-autograd fast path (its error map threaded into
    the chunk step's forward and backward), with momentum, clipping and activation checkpointing, and
    equals the generic autograd op: outputs, state, surprise, every input's gradient (delta's too)."""
    rule = MemoryRule(bias=bias, optimizer=MomentumSGD(momentum=True))
    assert fits_fast_path(rule)
    q, k, v, gates, w, s = rule_problem(rule, 19, 2, seed=7)
    kw = dict(rule=rule, chunk_size=3, surprise_clip=0.6)
    auto, g_auto = run_with_grads(memory_rule_chunked_autograd, [q, k, v, gates, *w, *s], 2, **kw)
    for every in (None, 2):
        fast, g_fast = run_with_grads(
            memory_rule_chunked, [q, k, v, gates, *w, *s], 2, checkpoint_every=every, **kw
        )
        for a, b in zip(fast + g_fast, auto + g_auto):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    if isinstance(bias, HuberBias):  # the threshold gets its gradient through the fast path's backward
        assert g_fast[3][..., 3].abs().sum() > 0


def test_a_rule_state_saves_loads_and_continues(tmp_path):
    """A windowed rule's state (history rows, extra gate channels) round-trips through a state file; the
    file names its rule, and a model with another rule refuses it."""
    from titans import TitansState
    from titans.inference import load_state, prefill, save_state

    model = tiny_model("mag", memory_rule="atlas")
    x = random_tokens(2, 30, vocab=61)
    _, state = prefill(model, x[:, :17], piece_len=5)
    loaded = TitansState.load(save_state(state, tmp_path / "s.safetensors"))
    with torch.no_grad():
        want, _ = model(x[:, 17:], state)
        got, _ = model(x[:, 17:], loaded)
    # equal to rounding: the loaded tensors are contiguous copies of the state's views (other BLAS paths)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="memory_rule"):
        load_state(tmp_path / "s.safetensors", model=tiny_model("mag"))


# ------------------------------------------------------------------------------- parts as classes


@pytest.fixture
def toy_kinds():
    """Kinds a test registers, unregistered after it (the registries are process-wide)."""
    added: list[tuple[type, str]] = []
    yield added
    for slot, kind in added:
        slot.registry.pop(kind, None)


def test_a_new_bias_is_one_class_and_runs_on_both_paths(toy_kinds):
    """A bias written as one class (its error map and its backward) runs on the fast path and the autograd
    path alike, and c ||e||^2 with c = 1 is the l_2 bias exactly."""

    @dataclass(frozen=True)
    class ScaledL2(Bias, kind="toy_scaled_l2"):
        c: float = 1.0

        def error_map(self, e, aux):
            return 2 * self.c * e

        def grad(self, g, e, aux):
            return 2 * self.c * g, None

    toy_kinds.append((Bias, "toy_scaled_l2"))
    rule = MemoryRule(bias=ScaledL2(0.5))
    assert fits_fast_path(rule) and rule.extra_gates == ()
    assert MemoryRule.from_dict(rule.to_dict()) == rule
    q, k, v, gates, w, s = rule_problem(rule, 11, 2, seed=3)
    kw = dict(rule=rule, chunk_size=3, surprise_clip=0.6)
    fast, g_fast = run_with_grads(memory_rule_chunked, [q, k, v, gates, *w, *s], 2, **kw)
    auto, g_auto = run_with_grads(memory_rule_chunked_autograd, [q, k, v, gates, *w, *s], 2, **kw)
    for a, b in zip(fast + g_fast, auto + g_auto):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    one = memory_rule_chunked_autograd(q, k, v, gates, w, s, rule=MemoryRule(ScaledL2(1.0)), chunk_size=3)
    l2 = memory_rule_chunked_autograd(q, k, v, gates, w, s, rule=MemoryRule(), chunk_size=3)
    for a, b in zip(torch.utils._pytree.tree_leaves(one), torch.utils._pytree.tree_leaves(l2)):
        assert torch.equal(a, b)
    # the reference is written from the equations: a kind it has no equation for is an error
    with pytest.raises(NotImplementedError, match="no reference bias for kind 'toy_scaled_l2'"):
        memory_rule_ref(q, k, v, gates, w, s, rule=rule, chunk_size=3)


def test_entry_point_runs_every_path_with_one_call_shape():
    """`neural_memory(q, k, v, gates, ...)` runs what the backend and rule name: the same numbers as the
    path called directly; options a path does not cover are refused."""
    for preset in PRESETS:
        rule = RULE_PRESETS[preset]
        q, k, v, gates, w, s = rule_problem(rule, 9, 2)
        got = neural_memory(q, k, v, gates, w, s, chunk_size=3, rule=preset, surprise_clip=0.5)
        if rule.is_titans:
            want = neural_memory_chunked(q, k, v, *gates.unbind(-1), w, s, chunk_size=3, surprise_clip=0.5)
            ref = neural_memory_ref(q, k, v, *gates.unbind(-1), w, s, chunk_size=3, surprise_clip=0.5)
        else:
            want = memory_rule_chunked(q, k, v, gates, w, s, rule=rule, chunk_size=3, surprise_clip=0.5)
            ref = memory_rule_ref(q, k, v, gates, w, s, rule=rule, chunk_size=3, surprise_clip=0.5)
        got_ref = neural_memory(
            q, k, v, gates, w, s, chunk_size=3, rule=preset, surprise_clip=0.5, backend="reference"
        )
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert torch.equal(a, b)
        for a, b in zip(torch.utils._pytree.tree_leaves(got_ref), torch.utils._pytree.tree_leaves(ref)):
            assert torch.equal(a, b)
    q, k, v, gates, w, s = rule_problem(RULE_PRESETS["titans"], 6, 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        neural_memory(q, k, v, gates, w, s, chunk_size=3, backend="cuda")
    with pytest.raises(ValueError, match="max_norm runs rule='titans' only"):
        neural_memory(q, k, v, gates, w, s, chunk_size=3, rule="yaad", max_norm=1.0)
    with pytest.raises(ValueError, match="backend='triton' runs rule='titans' only"):
        neural_memory(q, k, v, gates, w, s, chunk_size=3, rule="moneta", backend="triton")
    with pytest.raises(ValueError, match="surprise_threshold not covered by the kernels"):
        neural_memory(q, k, v, gates, w, s, chunk_size=3, backend="triton", surprise_threshold=0.1)
    with pytest.raises(ValueError, match="history rows are for a windowed rule"):
        neural_memory(q, k, v, gates, w, s, chunk_size=3, history=2)
    with pytest.raises(ValueError, match="rule 'titans' takes 3 gates per token"):
        neural_memory(q, k, v, torch.cat([gates, gates[..., :1]], -1), w, s, chunk_size=3)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("preset", ["titans", "atlas"])
def test_a_state_that_does_not_fit_is_refused_by_name(backend, preset):
    """Weights, momentum and anchors that do not fit q, k, v or each other raised from inside torch (a
    matmul, a stack, an index) or, in the reference, broadcast a momentum of batch 1 silently."""
    q, k, v, gates, w, s = rule_problem(RULE_PRESETS[preset], 7, 2)
    run = functools.partial(neural_memory, chunk_size=3, rule=preset, backend=backend)
    cases = [
        ((q, k, v, gates, w, s[:1]), re.escape("momentum must hold one tensor per memory layer (2), got 1")),
        ((q, k, v, gates, (), ()), re.escape("weights must hold one tensor per memory layer, got none")),
        ((q, k, v, gates, (w[0][:1], w[1]), s), r"weights\[0\] must be \(B, H, d_in, d_out\) = \(2, 3, 5"),
        ((q, k, v, gates, (w[0], w[1][:, :, :4]), s), r"weights\[1\] must be .* = \(2, 3, 10, \.\.\.\)"),
        ((q, k, v, gates, w, (s[0][:1], s[1])), r"momentum\[0\] must be of weights\[0\]'s shape"),
        ((q, k, v[..., :4], gates, w, s), re.escape("the last layer's output width 5 must be v's, 4")),
        ((q[..., :4], k, v, gates, w, s), re.escape("q and k must be of one width, got 4 and 5")),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            run(*args)
    if preset == "titans":
        with pytest.raises(ValueError, match="anchor must hold one tensor per memory layer"):
            run(q, k, v, gates, w, s, anchor=(w[0][0],))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_gates_run_as_their_float32_values(half):
    """float16 / bfloat16 gates with a float32 state give exactly what the same gates upcast to float32
    give, on every rule's path: no chunk coefficient (sums of log-gates, their exps) is computed in the
    gates' dtype (the fast path's, yaad's, were: 7e-4 off the float64 reference in bf16)."""
    for preset in PRESETS:
        rule = RULE_PRESETS[preset]
        q, k, v, gates, w, s = rule_problem(rule, 10, 2)
        q, k, v = (x.float() for x in (q, k, v))
        w, s = tuple(x.float() for x in w), tuple(x.float() for x in s)
        rounded = gates.to(half)
        got = neural_memory(q, k, v, rounded, w, s, chunk_size=4, rule=preset)
        want = neural_memory(q, k, v, rounded.float(), w, s, chunk_size=4, rule=preset)
        direct = memory_rule_chunked(q, k, v, rounded, w, s, rule=rule, chunk_size=4)
        for a, b, c in zip(*(torch.utils._pytree.tree_leaves(x) for x in (got, want, direct))):
            assert a.dtype == torch.float32
            assert torch.equal(a, b), preset
            assert torch.equal(c, b), preset


@pytest.mark.parametrize("rule", ["titans", "yaad", "moneta", "memora", "atlas"])
def test_the_reference_layer_runs_under_no_grad_as_the_fast_path(rule):
    """Under no_grad the layer's initial weights are views of its parameters that say they require grad
    but belong to no graph: the reference took its inner gradients with respect to them and raised
    ("appears to not have been used in the graph") for the rules whose retention is plain decay."""
    torch.manual_seed(0)
    ref = NeuralMemory(8, heads=2, depth=2, chunk_size=4, impl="reference", rule=rule).double()
    fast = NeuralMemory(8, heads=2, depth=2, chunk_size=4, rule=rule).double()
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    with torch.no_grad():
        (y_ref, _), (y_fast, _) = ref(x), fast(x)
    assert not y_ref.requires_grad
    torch.testing.assert_close(y_ref, y_fast, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize(
    "options",
    [dict(activation="relu", surprise_clip=1.0), dict(rule="yaad", activation="relu"), dict(rule="atlas")],
    ids=["relu-clip", "yaad-relu", "atlas-nothing-written"],
)
def test_the_reference_has_finite_gradients_where_a_surprise_is_exactly_zero(options):
    """A token whose inner gradient is exactly zero (a dead relu layer; Muon's input with nothing written):
    the reference differentiated sqrt at 0 and gave NaN gradients where the fast path gives finite ones."""
    threshold = 1e9 if options.get("rule") == "atlas" else None
    torch.manual_seed(0)
    kw = dict(heads=3, depth=2, chunk_size=5, expansion=2.0, surprise_threshold=threshold, **options)
    ref = NeuralMemory(6, impl="reference", **kw).double()
    fast = NeuralMemory(6, **kw).double()
    fast.load_state_dict(ref.state_dict())
    torch.manual_seed(1)
    x = torch.randn(3, 13, 6, dtype=torch.float64)
    grads = []
    for layer in (ref, fast):
        xx = x.clone().requires_grad_()
        layer(xx)[0].square().sum().backward()
        grads.append([xx.grad, *(p.grad for p in layer.parameters() if p.grad is not None)])
    if options.get("activation") == "relu":
        with torch.no_grad():
            assert (ref.forward_with_stats(x).stats.surprise < 1e-10).any()  # the case is met
    for g_ref, g_fast in zip(*grads, strict=True):
        assert torch.isfinite(g_ref).all()
        torch.testing.assert_close(g_ref, g_fast, rtol=1e-6, atol=1e-9)
