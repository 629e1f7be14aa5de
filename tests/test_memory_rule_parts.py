"""Memory rule parts as data: every field checked where the part is made, a part's declaration checked by
`MemoryRule` (frozen, gates only where they reach the maths), the op's `history` bounds, a size-1 window's
unused gate_init, and the l_q read's scale (docs/design.md, "Memory rules")."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from titans import NeuralMemory, TitansConfig
from titans.ops.memory import (
    RULE_PRESETS,
    Bias,
    GateSpec,
    HuberBias,
    KLRetention,
    LpBias,
    LqRetention,
    MemoryRule,
    MomentumSGD,
    Muon,
    Optimizer,
    Retention,
    Window,
    memory_rule_chunked,
    memory_rule_chunked_autograd,
    neural_memory,
    neural_memory_chunked,
)

F64 = torch.float64
INF, NAN = float("inf"), float("nan")


@pytest.fixture
def toy_kinds():
    """Kinds a test registers, unregistered after it (the registries are process-wide)."""
    added: list[tuple[type, str]] = []
    yield added
    for slot, kind in added:
        slot.registry.pop(kind, None)


# ------------------------------------------------------------------------------------ part fields


@pytest.mark.parametrize(
    "make, message",
    [
        pytest.param(lambda: LpBias(INF), "LpBias: p must be a number >= 1", id="LpBias(inf)"),
        pytest.param(lambda: LpBias(NAN), "LpBias: p must be a number >= 1", id="LpBias(nan)"),
        pytest.param(
            lambda: LpBias(1.5, eps=INF), "LpBias: eps must be a number > 0", id="LpBias(1.5, eps=inf)"
        ),
        pytest.param(
            lambda: LpBias(1.5, eps=True), "LpBias: eps must be a number > 0", id="LpBias(1.5, eps=True)"
        ),
        pytest.param(lambda: LqRetention(INF), "LqRetention: q must be a number >= 2", id="LqRetention(inf)"),
        pytest.param(lambda: LqRetention(NAN), "LqRetention: q must be a number >= 2", id="LqRetention(nan)"),
        pytest.param(
            lambda: KLRetention(INF), "KLRetention: scale must be a number > 0", id="KLRetention(inf)"
        ),
        pytest.param(
            lambda: KLRetention(True), "KLRetention: scale must be a number > 0", id="KLRetention(True)"
        ),
        pytest.param(
            lambda: HuberBias(INF), "HuberBias: delta_init must be a number > 0", id="HuberBias(inf)"
        ),
        pytest.param(
            lambda: HuberBias(True), "HuberBias: delta_init must be a number > 0", id="HuberBias(True)"
        ),
        pytest.param(
            lambda: HuberBias("1.0"), "HuberBias: delta_init must be a number > 0", id='HuberBias("1.0")'
        ),
        pytest.param(
            lambda: Window(2, gate_init="0.5"),
            r"Window: gate_init must be a number in \(0, 1\)",
            id='Window(2, gate_init="0.5")',
        ),
        pytest.param(
            lambda: MomentumSGD(momentum="no"),
            "MomentumSGD: momentum must be a bool",
            id='MomentumSGD(momentum="no")',
        ),
        pytest.param(
            lambda: MomentumSGD(momentum=1),
            "MomentumSGD: momentum must be a bool",
            id="MomentumSGD(momentum=1)",
        ),
        pytest.param(lambda: Muon(True), "Muon: steps must be a positive integer", id="Muon(True)"),
    ],
)
def test_a_part_field_that_is_not_a_finite_number_of_its_type_is_refused(make, message):
    """Non-finite numbers (they gave NaN outputs), bools where a number is meant, and a non-bool momentum
    (a truthy string was momentum on) are refused where the part is made, naming the part and the field."""
    with pytest.raises(ValueError, match=message):
        make()


def test_valid_part_fields_still_work_and_a_large_huber_delta_has_its_gate():
    """The checks let through what worked: ints for floats, the bounds themselves; a large finite
    delta_init (softplus^-1 overflowed in math.expm1) gets a gate that starts at it."""
    assert LpBias(1).p == 1 and LqRetention(2).q == 2 and KLRetention(3).scale == 3
    assert MomentumSGD(False).uses_momentum is False
    for delta in (0.5, 1.0, 25.0, 1e300):
        (spec,) = MemoryRule(bias=HuberBias(delta)).gate_specs
        assert math.isfinite(spec.init)
        assert F.softplus(torch.tensor(spec.init, dtype=F64)).item() == pytest.approx(delta, rel=1e-12)


# ------------------------------------------------------------------------ a part's declaration


def test_a_part_declared_without_frozen_is_refused(toy_kinds):
    """docs/extending.md: a part declared without @dataclass(frozen=True) is refused by MemoryRule (a
    plain dataclass made the rule unhashable)."""

    @dataclass
    class PlainBias(Bias, kind="toy_plain_bias"):
        c: float = 1.0

        def error_map(self, e, aux):
            return 2 * self.c * e

        def grad(self, g, e, aux):
            return 2 * self.c * g, None

    @dataclass(frozen=True)
    class FrozenBias(Bias, kind="toy_frozen_bias"):  # the same maths, frozen
        c: float = 1.0

        def error_map(self, e, aux):
            return 2 * self.c * e

        def grad(self, g, e, aux):
            return 2 * self.c * g, None

    toy_kinds += [(Bias, "toy_plain_bias"), (Bias, "toy_frozen_bias")]
    with pytest.raises(TypeError, match="bias part PlainBias is a dataclass without frozen=True"):
        MemoryRule(bias=PlainBias())
    hash(MemoryRule(bias=FrozenBias()))


def test_a_retention_or_optimizer_gate_is_refused(toy_kinds):
    """Only the window's and the bias's gates reach their part's maths; a gate declared by a retention or
    an optimiser was created and trained with zero gradient. It is refused, naming the part and slot."""

    @dataclass(frozen=True)
    class GatedRetention(Retention, kind="toy_gated_retention"):
        def gates(self):
            return (GateSpec("rgate", torch.sigmoid, 0.0),)

        def read(self, a):
            return a

    @dataclass(frozen=True)
    class GatedSGD(MomentumSGD, kind="toy_gated_sgd"):
        def gates(self):
            return (GateSpec("ogate", torch.sigmoid, 0.0),)

    toy_kinds += [(Retention, "toy_gated_retention"), (Optimizer, "toy_gated_sgd")]
    with pytest.raises(ValueError, match=r"retention part GatedRetention declares a gate \('rgate'\)"):
        MemoryRule(retention=GatedRetention())
    with pytest.raises(ValueError, match=r"optimizer part GatedSGD declares a gate \('ogate'\)"):
        MemoryRule(optimizer=GatedSGD())
    with pytest.raises(ValueError, match="declares a gate"):
        NeuralMemory(
            12, heads=3, head_dim=4, chunk_size=2, rule={"retention": {"kind": "toy_gated_retention"}}
        )


def test_from_dict_refuses_a_part_that_is_not_a_dict():
    with pytest.raises(TypeError, match="from_dict: bias must be a dict of the part's fields"):
        MemoryRule.from_dict({"bias": "lp"})
    with pytest.raises(TypeError, match="from_dict: window must be a dict of the part's fields"):
        MemoryRule.from_dict({"window": 4})
    with pytest.raises(ValueError, match="TitansConfig.memory_rule: .*window must be a dict"):
        TitansConfig(memory_rule={"window": 4})


# ------------------------------------------------------------------------------------ history


def _op_inputs(rule: MemoryRule, rows: int = 4, d: int = 4):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, rows, d, generator=g, dtype=F64) for _ in range(3))
    gates = torch.stack(
        [torch.full((1, 2, rows), 0.1, dtype=F64), torch.full((1, 2, rows), -0.1, dtype=F64)]
        + [torch.full((1, 2, rows), -0.01, dtype=F64)]
        + [torch.full((1, 2, rows), 0.5, dtype=F64) for _ in rule.extra_gates],
        -1,
    )
    w = (torch.randn(1, 2, d, d, generator=g, dtype=F64),)
    s = (torch.zeros(1, 2, d, d, dtype=F64),)
    return q, k, v, gates, w, s


@pytest.mark.parametrize("preset", ["atlas", "yaad"])  # the autograd op and the fast path
@pytest.mark.parametrize("op", [memory_rule_chunked, memory_rule_chunked_autograd, "torch", "reference"])
def test_history_out_of_range_is_refused_by_name(preset, op):
    """history counts context rows at the start of q, k, v: 0 <= history <= rows, an int. Outside, torch
    failed inside the op (or, on the fast path, a negative history silently dropped rows)."""
    rule = RULE_PRESETS[preset]
    args = _op_inputs(rule)
    fn = functools.partial(neural_memory, backend=op) if isinstance(op, str) else op
    for history in (-1, 5, 1.0, True):
        with pytest.raises(ValueError, match=r"history must be an integer in \[0, 4\] \(the rows given\)"):
            fn(*args, rule=rule, chunk_size=2, history=history)
    # every row context: nothing read or written, the state comes back as it went in
    y, w, s, surprise = fn(*args, rule=rule, chunk_size=2, history=4)
    assert y.shape == (1, 2, 0, 4) and surprise.shape == (1, 2, 0)
    assert torch.equal(w[0], args[4][0]) and torch.equal(s[0], args[5][0])


# ------------------------------------------------------------------- a size-1 window's gate_init


def test_a_size_one_window_with_another_gate_init_is_the_titans_rule():
    """Window(1) creates no gate, so its gate_init changes nothing: such a rule is Titans (the fast path,
    Triton, max_norm), stored as the preset's name, and the layer is the default's, bit for bit."""
    rule = MemoryRule(window=Window(1, gate_init=0.5))
    assert rule.window.gates() == () and rule.gate_specs == ()
    assert rule.is_titans and rule.to_config() == "titans"
    assert TitansConfig(memory_rule=rule).memory_rule == "titans"
    moneta = MemoryRule(LpBias(3.0), LqRetention(4.0), Window(1, gate_init=0.2), MomentumSGD(False))
    assert moneta.to_config() == "moneta" and not moneta.is_titans
    assert not MemoryRule(window=Window(2, gate_init=0.5)).is_titans

    x = torch.randn(2, 11, 12, generator=torch.Generator().manual_seed(1))
    for kw in ({}, {"max_norm": 1.0}):
        torch.manual_seed(0)
        want_layer = NeuralMemory(12, heads=3, chunk_size=4, **kw)
        torch.manual_seed(0)
        layer = NeuralMemory(12, heads=3, chunk_size=4, rule=rule, **kw)  # max_norm was refused
        assert layer.to_rule_gates is None and layer.state_dict().keys() == want_layer.state_dict().keys()
        want, want_state = want_layer(x)
        got, state = layer(x)
        assert torch.equal(got, want)
        for a, b in zip(state.weights + state.momentum, want_state.weights + want_state.momentum):
            assert torch.equal(a, b)
    NeuralMemory(12, heads=3, chunk_size=4, rule=rule, backend="triton")  # built (the kernels run it)


# ---------------------------------------------------------------------------- the l_q read's scale


def test_lq_read_grows_as_the_state_shrinks():
    """docs/design.md ("Moneta grows without bound"): W = A / ||A||_q^(q-2) scales as s^(3-q) when A
    scales by s, so at q = 4 forgetting (s < 1) makes the read weights larger, s = 1/2 doubles them."""
    a = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0), dtype=F64)
    read = LqRetention(4.0).read
    torch.testing.assert_close(read(0.5 * a), 2 * read(a), rtol=1e-13, atol=0)
    torch.testing.assert_close(LqRetention(3.0).read(0.5 * a), LqRetention(3.0).read(a), rtol=1e-13, atol=0)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("preset", ["titans", "atlas"])
def test_a_call_with_no_rows_returns_the_state_as_it_came(backend, preset):
    """T = 0 (an empty piece of a stream): empty y and surprise, the state unchanged, on every backend.
    The torch loop failed unpacking its reads, the references stacking no steps."""
    rule = RULE_PRESETS[preset]
    q, k, v, gates, weights, momentum = _op_inputs(rule)
    empty = [x[:, :, :0] for x in (q, k, v, gates)]
    y, w, s, surprise = neural_memory(*empty, weights, momentum, rule=rule, chunk_size=2, backend=backend)
    assert y.shape == (1, 2, 0, 4) and surprise.shape == (1, 2, 0)
    assert y.dtype == surprise.dtype == weights[0].dtype
    assert all(torch.equal(a, b) for a, b in zip(w + s, weights + momentum))
    if preset == "titans":
        theta, log_eta, log_keep = empty[3].unbind(-1)
        y, w, s, _ = neural_memory_chunked(
            *empty[:3], theta, log_eta, log_keep, weights, momentum, chunk_size=2
        )
        assert y.shape == (1, 2, 0, 4) and all(torch.equal(a, b) for a, b in zip(w + s, weights + momentum))
    with pytest.raises(ValueError, match="gates"):  # the gates still checked
        neural_memory(
            *empty[:3], empty[3][..., :2], weights, momentum, rule=rule, chunk_size=2, backend=backend
        )
