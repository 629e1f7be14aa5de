"""The chunked memory's hand-written backward and its opt-in activation checkpointing.

The fast path (`titans.ops.memory.chunk._ChunkStep`) computes its gradients by hand, so every output (reads,
surprise, final weights and momentum) is differentiated against the float64 reference here, under each
option. `checkpoint_every` must change memory use only: outputs and gradients stay the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_memory import assert_close_rel, random_problem
from titans import NeuralMemory
from titans.ops import cpu_kernels
from titans.ops.conv import causal_conv_silu
from titans.ops.conv_ref import causal_conv_silu_ref
from titans.ops.memory import HuberBias, neural_memory_chunked, neural_memory_ref
from titans.ops.memory import chunk as ops_memory

F64 = torch.float64


def outputs_and_grads(fn, args, w, s, **kw):
    """Run fn on fresh leaves; return its outputs and the gradient of a random weighting of ALL of them
    with respect to every input (q, k, v, theta, log_eta, log_keep, weights, momentum)."""
    args = [a.clone().requires_grad_(bool(torch.isfinite(a).all())) for a in args]
    w = tuple(x.clone().requires_grad_() for x in w)
    s = tuple(x.clone().requires_grad_() for x in s)
    y, w_end, s_end, surprise = fn(*args, w, s, **kw)
    outs = [y, surprise, *w_end, *s_end]
    g = torch.Generator().manual_seed(123)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype)).sum() for o in outs)
    leaves = [a for a in args if a.requires_grad] + [*w, *s]
    return outs, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "depth,options",
    [
        (1, {}),
        (2, {"activation": "gelu"}),
        (2, {"activation": "relu", "surprise_clip": 0.5}),
        (2, {"residual": True, "surprise_clip": 0.3}),
        (3, {"activation": "silu", "surprise_clip": 0.3}),
    ],
)
@pytest.mark.parametrize("momentum,forgetting", [(True, True), (False, True), (True, False)])
def test_backward_matches_reference(depth, options, momentum, forgetting):
    """Gradients of reads, surprise, final weights and momentum, w.r.t. every input, vs float64 autograd
    through the literal per-token loop (19 tokens, chunks of 6: a partial chunk at the end)."""
    # hidden width 16: a relu memory whose hidden units are all off at a key has surprise exactly 0, where
    # the reference's sqrt has an infinite derivative (ours clamps); wide enough that this never happens
    args, w, s = random_problem(
        2, 2, 19, 4, depth, expansion=4, seed=depth, momentum=momentum, forgetting=forgetting
    )
    fast_out, fast_grads = outputs_and_grads(neural_memory_chunked, args, w, s, chunk_size=6, **options)
    ref_out, ref_grads = outputs_and_grads(neural_memory_ref, args, w, s, chunk_size=6, **options)
    for a, b in zip(fast_out, ref_out):
        assert_close_rel(a, b, 1e-10)
    for a, b in zip(fast_grads, ref_grads):
        assert torch.isfinite(a).all()
        assert_close_rel(a, b, 1e-9)


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_backward_float32_matches_float64(activation):
    """The float32 kernels (vectorised, some from oneDNN) in the hand-written backward, against the same
    computation in float64 (checked against the reference above). Caught torch's float32 `gelu.out`
    ignoring a strided `out` and writing rows past it."""
    args, w, s = random_problem(2, 3, 40, 8, 2, expansion=4, seed=5)
    kw = {"chunk_size": 8, "activation": activation}
    out64, grads64 = outputs_and_grads(neural_memory_chunked, args, w, s, **kw)
    f32 = [a.float() for a in args], tuple(x.float() for x in w), tuple(x.float() for x in s)
    out32, grads32 = outputs_and_grads(neural_memory_chunked, *f32, **kw)
    for a, b in zip(out32 + list(grads32), out64 + list(grads64)):
        assert torch.isfinite(a).all()
        assert_close_rel(a.double(), b, 1e-4)


def built_kernels():
    kernel = cpu_kernels.kernels()
    if kernel is None:
        pytest.skip("the CPU kernels could not be built here")
    return kernel


def kernel_tolerance(dtype) -> dict:
    """Against float64 bmms, for the kernels' elementwise outputs (one rounding each)."""
    return {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("want", ["both", "g_x", "g_mix"])
def test_state_mix_backward_kernel_equals_bmms(dtype, want):
    """The fused CPU kernel for the state mixing's backward == the two bmms it replaces, in float64 (rows
    longer than one of its tasks, and shorter)."""
    kernel = built_kernels()
    torch.manual_seed(0)
    for p in (70_000, 37):
        g, x = torch.randn(3, 2, p, dtype=dtype), torch.randn(3, 2, p, dtype=dtype)
        mix = torch.randn(3, 2, 2, dtype=dtype)
        start = torch.randn(3, 2, 2, dtype=dtype)
        g_x = torch.full_like(g, float("nan")) if want != "g_mix" else None
        g_mix = start.clone() if want != "g_x" else None
        kernel.state_mix_backward(g, x, mix, g_x, g_mix)
        g64, x64, mix64 = g.double(), x.double(), mix.double()
        tol = kernel_tolerance(dtype)
        if g_x is not None:
            torch.testing.assert_close(g_x.double(), torch.bmm(mix64.transpose(1, 2), g64), **tol)
        if g_mix is not None:
            ref = start.double().baddbmm(g64, x64.transpose(1, 2))
            # a sum of p products in the kernel's dtype: its rounding error scales with the sum of their
            # magnitudes (float32 sums each task's piece in float32, like a float32 bmm; float64 throughout)
            mass = torch.bmm(g64.abs(), x64.abs().transpose(1, 2)) + start.double().abs()
            eps = 1e-7 if dtype == torch.float32 else 1e-15
            assert ((g_mix.double() - ref).abs() <= eps * mass).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_state_mix_forward_kernel_equals_bmms(dtype):
    """The fused CPU kernel for X' = mix @ X + U (U in `out` on entry, X' there on exit) == a bmm and an
    added U, in float64."""
    kernel = built_kernels()
    torch.manual_seed(0)
    for p in (70_000, 37):
        x, u = torch.randn(3, 2, p, dtype=dtype), torch.randn(3, 2, p, dtype=dtype)
        mix = torch.randn(3, 2, 2, dtype=dtype)
        out = u.clone()
        kernel.state_mix_forward(x, mix, out)
        ref = torch.bmm(mix.double(), x.double()) + u.double()
        torch.testing.assert_close(out.double(), ref, **kernel_tolerance(dtype))


def test_cpu_kernels_propagate_non_finite_inputs():
    """The kernels are built with -ffast-math, which lets the compiler assume finite values: a NaN or inf
    in the input must still come out where the torch ops put it (nothing silently made finite), and the
    finite entries must still match. Conv + SiLU forward and backward, state update forward and backward."""
    kernel = built_kernels()
    torch.manual_seed(0)
    x = torch.randn(2, 9, 6)
    x[0, 3, 1], x[1, 5, 2], x[1, 6, 4] = float("nan"), float("inf"), -float("inf")
    w, b = torch.randn(6, 1, 4), torch.randn(6)
    pairs = [(causal_conv_silu(x, w, b), causal_conv_silu_ref(F.pad(x, (0, 0, 3, 0)), w, b))]
    # the conv's backward kernel: the gradients of x, the taps and the bias against autograd's
    g = torch.randn(2, 9, 6)
    conv_grads = []
    for conv in (causal_conv_silu, lambda x, w, b: causal_conv_silu_ref(F.pad(x, (0, 0, 3, 0)), w, b)):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        conv(*leaves).backward(g)
        conv_grads.append([t.grad for t in leaves])
    pairs += list(zip(*conv_grads))
    state, u, mix = torch.randn(3, 2, 50), torch.randn(3, 2, 50), torch.randn(3, 2, 2)
    state[0, 1, 7], state[2, 0, 30], u[1, 0, 4] = float("nan"), float("inf"), -float("inf")
    out = u.clone()
    kernel.state_mix_forward(state, mix, out)
    pairs.append((out, torch.bmm(mix, state) + u))
    g_x, g_mix = torch.empty_like(u), torch.zeros_like(mix)
    kernel.state_mix_backward(u, state, mix, g_x, g_mix)
    pairs += [(g_x, torch.bmm(mix.transpose(1, 2), u)), (g_mix, torch.bmm(u, state.transpose(1, 2)))]
    for got, ref in pairs:
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
        finite = torch.isfinite(ref)
        assert finite.any() and (~finite).any()
        torch.testing.assert_close(got[finite], ref[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu"])
def test_the_fused_chunk_step_keeps_an_infinite_value_where_the_torch_ops_do(monkeypatch, activation):
    """An inf value through the fused no-grad chunk step (depth 2, clipped): for relu act' multiplied the
    inf by 0 (a NaN) where torch's threshold_backward selects 0; the NaN reached the clip's scale and every
    weight of the new state (35 NaN entries where the torch ops give 20)."""
    built_kernels()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 2, 5, generator=g) for _ in range(3))
    v[0, 0, 1, 2] = float("inf")
    gates = (torch.full((1, 1, 2), 0.1), torch.full((1, 1, 2), -0.1), torch.full((1, 1, 2), -0.01))
    weights = (torch.randn(1, 1, 5, 7, generator=g) * 0.5, torch.randn(1, 1, 7, 5, generator=g) * 0.5)
    momentum = tuple(torch.zeros_like(w) for w in weights)
    results = []
    for fused in (True, False):
        calls = fused_steps(monkeypatch)
        if not fused:
            monkeypatch.setattr(ops_memory, "kernels", lambda: None)
        with torch.no_grad():
            out = neural_memory_chunked(
                q, k, v, *gates, weights, momentum, chunk_size=2, activation=activation, surprise_clip=1.0
            )
        assert calls == ([2] if fused else [])
        results.append(listed(out))
    for got, ref in zip(*results, strict=True):
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
        finite = torch.isfinite(ref)
        torch.testing.assert_close(got[finite], ref[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "torch-ops"])
def test_the_conv_takes_an_empty_time_axis_on_both_paths(monkeypatch, fused):
    """x of shape (B, 0, C) with a tail: the torch-op backward raised ("max() arg is an empty sequence")
    where the kernel gives zero gradients."""
    import titans.ops.conv as conv

    if fused:
        built_kernels()
    else:
        monkeypatch.setattr(conv, "kernels", lambda: None)
    x, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((2, 0, 6), (6, 1, 4), (6,)))
    tail = torch.randn(2, 3, 6, requires_grad=True)
    y = conv.causal_conv_silu(x, w, b, tail)
    assert y.shape == (2, 0, 6)
    y.sum().backward()
    assert not tail.grad.any() and not w.grad.any() and not b.grad.any()


def listed(out) -> list:
    """The op's (y, weights, momentum, surprise) as one list of tensors."""
    return [out[0], *out[1], *out[2], out[3]]


def fused_steps(monkeypatch) -> list[int]:
    """Record each call of the fused no-grad chunk step (`chunk_step_forward`): the list of their depths."""
    kernel = built_kernels()
    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(kernel, name)

        def chunk_step_forward(self, *args):
            calls.append(len(args[5]))
            return kernel.chunk_step_forward(*args)

    monkeypatch.setattr(ops_memory, "kernels", lambda: Recording())
    return calls


@pytest.mark.parametrize(
    "depth,options",
    [
        (1, {}),
        (1, {"residual": True, "surprise_clip": 0.3, "surprise_threshold": 0.2}),
        (2, {}),
        (2, {"activation": "gelu", "surprise_clip": 0.5}),
        (2, {"activation": "relu", "surprise_threshold": 0.3}),
        (2, {"residual": True, "max_norm": 0.9}),
        (2, {"activation": "gelu", "anchor": True, "surprise_clip": 0.4}),
    ],
)
@pytest.mark.parametrize("momentum,forgetting", [(True, True), (False, False)])
def test_fused_no_grad_chunk_step_matches_reference(monkeypatch, depth, options, momentum, forgetting):
    """Without autograd, on CPU, the memory's chunk steps run as one C++ call each (`chunk_step_forward`):
    reads, surprise, final weights and momentum against the float64 reference under each option, and
    against the torch-op step (kernels off) to float64 rounding. 45 tokens in chunks of 8 (a partial
    chunk at the end), head dim 5, hidden 15, q/k/v views of wider tensors."""
    args, w, s = random_problem(
        2, 3, 45, 5, depth, expansion=3, seed=depth, momentum=momentum, forgetting=forgetting
    )
    q, k, v = (torch.cat([x, torch.randn_like(x)], -2)[..., :45, :] for x in args[:3])  # strided views
    args = (q, k, v, *args[3:])
    kw = {"chunk_size": 8, **options}
    if kw.pop("anchor", False):
        kw["anchor"] = tuple(0.5 * x for x in w)
    calls = fused_steps(monkeypatch)
    with torch.no_grad():
        fused = listed(neural_memory_chunked(*args, w, s, **kw))
    assert calls == [depth] * 5  # every complete chunk
    for a, b in zip(fused, listed(neural_memory_ref(*args, w, s, **kw))):
        assert_close_rel(a, b, 1e-10)
    monkeypatch.setattr(ops_memory, "kernels", lambda: None)
    with torch.no_grad():
        torch_step = listed(neural_memory_chunked(*args, w, s, **kw))
    for a, b in zip(fused, torch_step):
        assert_close_rel(a, b, 1e-13)


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_fused_no_grad_chunk_step_float32_matches_float64(monkeypatch, activation):
    """The fused step in float32 (ATen's float32 bmms, the loops' float32 sums) against the float64 run."""
    args, w, s = random_problem(2, 3, 70, 12, 2, expansion=2, seed=9)
    kw = {"chunk_size": 16, "activation": activation, "surprise_clip": 1.0}
    calls = fused_steps(monkeypatch)
    with torch.no_grad():
        out64 = neural_memory_chunked(*args, w, s, **kw)
        out32 = neural_memory_chunked(
            *(a.float() for a in args), tuple(x.float() for x in w), tuple(x.float() for x in s), **kw
        )
    assert calls == [2] * 8
    for a, b in zip(listed(out32), listed(out64)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert_close_rel(a.double(), b, 1e-5)


def test_fused_no_grad_chunk_step_only_where_it_applies(monkeypatch):
    """The fused step runs without autograd for the l2 loss at depth 1 and 2 only: with autograd, at depth
    3 and with another inner loss (the rules' error maps) the torch-op step runs."""
    calls = fused_steps(monkeypatch)
    args, w, s = random_problem(1, 2, 24, 4, 2, seed=1)
    neural_memory_chunked(*args, w, s, chunk_size=8)  # autograd records
    with torch.no_grad():
        args3, w3, s3 = random_problem(1, 2, 24, 4, 3, seed=1)
        neural_memory_chunked(*args3, w3, s3, chunk_size=8)
        huber = {"error": HuberBias(), "error_aux": torch.ones(1, 2, 24, dtype=F64)}
        neural_memory_chunked(*args, w, s, chunk_size=8, **huber)
        assert calls == []
        neural_memory_chunked(*args, w, s, chunk_size=8)
    assert calls == [2] * 3


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_fused_no_grad_chunk_step_propagates_non_finite_inputs(monkeypatch, activation):
    """Built with -ffast-math like the other kernels: a NaN or inf in a key, a value or a query must give
    NaN and inf where the torch-op step gives them (the memory spreads one to everything it writes after),
    and the same finite values elsewhere."""
    args, w, s = random_problem(1, 2, 32, 4, 2, dtype=torch.float32, seed=4)
    q, k, v = (x.clone() for x in args[:3])
    k[0, 0, 11, 2], v[0, 1, 20, 1], q[0, 1, 3, 0] = float("nan"), float("inf"), float("nan")
    args = (q, k, v, *args[3:])
    calls = fused_steps(monkeypatch)
    with torch.no_grad():
        fused = neural_memory_chunked(*args, w, s, chunk_size=8, activation=activation, surprise_clip=0.5)
        assert calls
        monkeypatch.setattr(ops_memory, "kernels", lambda: None)
        plain = neural_memory_chunked(*args, w, s, chunk_size=8, activation=activation, surprise_clip=0.5)
    for got, ref in zip(listed(fused), listed(plain)):
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
        finite = torch.isfinite(ref)
        torch.testing.assert_close(got[finite], ref[finite], rtol=1e-5, atol=1e-5)
    assert not torch.isfinite(fused[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_fused_no_grad_chunk_step_extreme_pre_activations(monkeypatch, dtype, activation):
    """Hidden pre-activations in the thousands, past where exp(-z) overflows (-88.7 in float32,
    -709.8 in float64): the fused step (built with -ffast-math, under which 1 / (1 + exp(-z)) is NaN there)
    is finite and equals the torch-op step."""
    args, w, s = random_problem(2, 2, 24, 16, 2, dtype=dtype, seed=11)
    w = (w[0] * 3000, w[1] * 1e-3)
    kw = {"chunk_size": 8, "activation": activation, "surprise_clip": 1.0}
    calls = fused_steps(monkeypatch)
    with torch.no_grad():
        fused = listed(neural_memory_chunked(*args, w, s, **kw))
        assert calls
        monkeypatch.setattr(ops_memory, "kernels", lambda: None)
        plain = listed(neural_memory_chunked(*args, w, s, **kw))
    z = torch.einsum("bhtd,bhdk->bhtk", args[1], w[0]).abs().max()
    assert z > 1e3  # past both overflow points
    for got, ref in zip(fused, plain):
        assert torch.isfinite(ref).all() and torch.isfinite(got).all()
        assert_close_rel(got, ref, 1e-5 if dtype == torch.float32 else 1e-12)


def test_fused_no_grad_chunk_step_refuses_mismatched_shapes():
    """The C++ step indexes its inputs by their shapes: a mismatch is refused by name, never read past."""
    kernel = built_kernels()
    n_seq, n, d, h = 3, 4, 5, 7
    good = {
        "kq": torch.randn(n_seq, 2 * n, d),
        "v": torch.randn(n_seq, n, d),
        "gamma": torch.rand(n_seq, n),
        "beta": torch.rand(n_seq, n),
        "mix": torch.randn(n_seq, 2, 2),
        "states": [torch.randn(n_seq, 2, d, h), torch.randn(n_seq, 2, h, d)],
        "outs": [torch.empty(n_seq, 2, d, h), torch.empty(n_seq, 2, h, d)],
        "anchors": [torch.randn(n_seq, d, h), torch.randn(n_seq, h, d)],
    }

    def call(**change):
        args = {**good, **change}
        return kernel.chunk_step_forward(*args.values(), 0, False, -1.0, -1.0)

    y, norm = call()
    assert y.shape == (n_seq, n, d) and norm.shape == (n_seq, n)
    bad = [
        {"v": torch.randn(n_seq, n + 1, d)},
        {"gamma": torch.rand(n_seq, n - 1)},
        {"mix": torch.randn(n_seq - 1, 2, 2)},
        {"states": [torch.randn(n_seq, 2, d, h), torch.randn(n_seq, 2, h + 1, d)]},
        {"outs": [torch.empty(n_seq, 2, d, h), torch.empty(n_seq, 2, d, h)]},
        {"anchors": [torch.randn(n_seq, d, h), torch.randn(n_seq, h, d - 1)]},
        {"states": [torch.randn(n_seq, 2, d, d)] * 3, "outs": [torch.empty(n_seq, 2, d, d)] * 3},  # depth 3
    ]
    for change in bad:
        with pytest.raises(RuntimeError, match="chunk_step_forward"):
            call(**change)


def test_backward_matches_reference_without_cpu_kernels(monkeypatch):
    """The torch-op paths (off CPU, or where the kernels cannot be built) against the reference too."""
    monkeypatch.setattr("titans.ops.memory.chunk.kernels", lambda: None)
    args, w, s = random_problem(2, 2, 19, 4, 2, expansion=4, seed=2)
    fast_out, fast_grads = outputs_and_grads(neural_memory_chunked, args, w, s, chunk_size=6)
    ref_out, ref_grads = outputs_and_grads(neural_memory_ref, args, w, s, chunk_size=6)
    for a, b in zip(fast_out + list(fast_grads), ref_out + list(ref_grads)):
        assert_close_rel(a, b, 1e-9)


def test_gate_gradients_finite_without_momentum():
    """eta = 0 exactly (log_eta = -inf): the chunk coefficients' exps of -inf must backpropagate zeros,
    not NaN (a logsumexp over all -inf terms would)."""
    args, w, s = random_problem(1, 2, 16, 4, 2, momentum=False)
    _, grads = outputs_and_grads(neural_memory_chunked, args, w, s, chunk_size=8)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("every,seq,chunk", [(1, 40, 5), (3, 43, 5), (2, 37, 4), (5, 27, 4), (4, 35, 4)])
@pytest.mark.parametrize("depth", [1, 2])
def test_checkpointed_equals_plain(every, seq, chunk, depth):
    """Groups that do (1 of 8, 4 of 8) and do not (3 of 8, 2 of 9, 5 of 6: a last group of one chunk)
    divide the number of complete chunks, mostly with a trailing partial chunk."""
    assert every < seq // chunk  # more than one group: checkpointing really runs (one group is plain)
    args, w, s = random_problem(2, 2, seq, 4, depth, seed=every + seq)
    kw = {"chunk_size": chunk, "surprise_clip": 0.5}
    plain_out, plain_grads = outputs_and_grads(neural_memory_chunked, args, w, s, **kw)
    ckpt_out, ckpt_grads = outputs_and_grads(neural_memory_chunked, args, w, s, checkpoint_every=every, **kw)
    for a, b in zip(ckpt_out + list(ckpt_grads), plain_out + list(plain_grads)):
        assert_close_rel(a, b, 1e-12)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of fn()."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_checkpointing_keeps_only_group_boundaries():
    """32 chunks in groups of 8 keep about 4 states instead of 32 (the memory bound, not just equal
    outputs: a 'checkpoint' that saved everything would pass the equality test)."""
    args, w, s = random_problem(1, 2, 32 * 4, 16, 2, dtype=torch.float32)
    w = tuple(x.requires_grad_() for x in w)

    def run(every):
        return lambda: neural_memory_chunked(*args, w, s, chunk_size=4, checkpoint_every=every)

    plain, ckpt = saved_bytes(run(None)), saved_bytes(run(8))
    state_bytes = sum(2 * x.numel() * 4 for x in w)  # weights + momentum
    assert plain > 32 * state_bytes
    assert ckpt < 8 * state_bytes, (plain, ckpt, state_bytes)


def test_module_checkpointing_matches_and_continues_state():
    torch.manual_seed(0)
    plain = NeuralMemory(16, heads=2, depth=2, chunk_size=4).double()
    ckpt = NeuralMemory(16, heads=2, depth=2, chunk_size=4, checkpoint_every=3).double()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 30, 16, dtype=F64)
    results = []
    for mem in (plain, ckpt):
        y1, state = mem(x[:, :13])
        y2, state = mem(x[:, 13:], state)
        loss = (y1.sin().sum() + y2.cos().sum()) + state.weights[1].sum()
        grads = torch.autograd.grad(loss, list(mem.parameters()))
        results.append([y1, y2, *state.weights, *state.momentum, *grads])
    for a, b in zip(*results):
        assert_close_rel(a, b, 1e-12)


def test_checkpointing_is_a_no_op_without_grad(monkeypatch):
    """Under no_grad a checkpointing memory takes the plain path: no checkpointed group runs, and the
    outputs and state equal those of a memory without checkpointing, bit for bit."""
    groups = []
    checkpointed = ops_memory._CheckpointedChunks.apply

    def counting_apply(*args):
        groups.append(args)
        return checkpointed(*args)

    monkeypatch.setattr(ops_memory._CheckpointedChunks, "apply", counting_apply)
    torch.manual_seed(0)
    plain = NeuralMemory(16, heads=2, depth=2, chunk_size=4).double()
    ckpt = NeuralMemory(16, heads=2, depth=2, chunk_size=4, checkpoint_every=2).double()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 26, 16, dtype=F64)  # 6 chunks in groups of 2, and a partial chunk
    with torch.no_grad():
        y_plain, s_plain = plain(x)
        y_ckpt, s_ckpt = ckpt(x)
    assert not groups and y_ckpt.grad_fn is None
    assert torch.equal(y_ckpt, y_plain)
    assert all(
        torch.equal(a, b)
        for a, b in zip(s_ckpt.weights + s_ckpt.momentum, s_plain.weights + s_plain.momentum)
    )
    # the counter works: with gradients the same call runs its 3 groups checkpointed
    y_grad, _ = ckpt(x)
    assert len(groups) == 3
    assert_close_rel(y_grad, y_plain, 1e-12)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4"])
def test_bad_checkpoint_every_names_it(bad):
    args, w, s = random_problem(1, 1, 8, 4, 1)
    with pytest.raises(ValueError, match="checkpoint_every"):
        neural_memory_chunked(*args, w, s, chunk_size=4, checkpoint_every=bad)
    with pytest.raises(ValueError, match="checkpoint_every"):
        NeuralMemory(16, heads=2, checkpoint_every=bad)


@pytest.mark.parametrize("variant", ["mac", "lmm"])
def test_model_with_memory_checkpointing_matches(variant):
    """TitansConfig.memory_checkpoint_every reaches every memory layer and changes neither the logits nor
    any gradient (float64; a length that is not a multiple of the segment or the chunk)."""
    from titans import TitansConfig, TitansLM

    sizes = dict(variant=variant, vocab_size=40, dim=16, depth=2, heads=2, segment_len=16, window=8,
                 chunk_size=4, persistent_tokens=2)  # fmt: skip
    torch.manual_seed(0)
    plain = TitansLM(TitansConfig(**sizes)).double()
    ckpt = TitansLM(TitansConfig(**sizes, memory_checkpoint_every=2)).double()
    ckpt.load_state_dict(plain.state_dict())
    assert all(m.memory.checkpoint_every == 2 for m in ckpt.blocks)
    tokens = torch.randint(0, 40, (2, 45))
    results = []
    for model in (plain, ckpt):
        logits, _ = model(tokens)
        logits.logsumexp(-1).mean().backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (y_plain, g_plain), (y_ckpt, g_ckpt) = results
    assert_close_rel(y_ckpt, y_plain, 1e-12)
    assert g_plain.keys() == g_ckpt.keys()
    for name in g_plain:
        assert_close_rel(g_ckpt[name], g_plain[name], 1e-10)


@pytest.mark.parametrize("rule", ["moneta", "memora", "atlas"])
def test_checkpointing_a_rule_off_the_fast_path_is_refused(rule):
    """It was ignored without a word: these rules saved all their chunks' states (3-10x the Titans
    rule's), as if checkpoint_every were unset."""
    with pytest.raises(ValueError, match=f"not to the rule '{rule}': leave it unset"):
        NeuralMemory(dim=16, heads=2, rule=rule, checkpoint_every=2)
    NeuralMemory(dim=16, heads=2, rule=rule)  # without it, as before
    NeuralMemory(dim=16, heads=2, rule="yaad", checkpoint_every=2)  # on the fast path: checkpointed
