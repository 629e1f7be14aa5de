"""The Triton kernels of the memory's chunk loop (`titans.ops.memory.triton_chunk`) against the float64
reference, run on CPU by Triton's interpreter: outputs and gradients of every input, awkward shapes,
streaming, the `backend` choice. GPU-only checks are marked `cuda`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

# before anything imports triton's kernels: they are decorated (interpreted or compiled) at import. Where
# a GPU is at hand the kernels are compiled for it (the `cuda` tests), and the interpreted tests skip
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import logging  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import titans.ops.memory  # noqa: E402
from test_memory import random_problem  # noqa: E402
from titans import NeuralMemory, TitansConfig  # noqa: E402
from titans.ops.memory import (  # noqa: E402
    neural_memory,
    neural_memory_chunked,
    neural_memory_ref,
    neural_memory_triton,
)
from titans.ops.memory import triton_chunk as memory_triton  # noqa: E402

F64 = torch.float64
HOPPER_SHARED = 232_448  # bytes of shared memory a block may use on an H100 / H200 (227 KB)
interpreted = pytest.mark.skipif(
    not memory_triton.interpreting(), reason="kernels compiled for the GPU here (TRITON_INTERPRET unset or 0)"
)


def _loss_and_grads(fn, args, w, s, kw, dtype, seed=1):
    """Run fn on (args, w, s) cast to dtype, a random linear loss of every output; return the outputs and
    the gradients of every input (float64)."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (*args, *w, *s)]
    n_args, depth = len(args), len(w)
    y, w_out, s_out, norm = fn(
        *leaves[:n_args], tuple(leaves[n_args : n_args + depth]), tuple(leaves[n_args + depth :]), **kw
    )
    outs = [y, *w_out, *s_out, norm]
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach().double() for o in outs], [None if x is None else x.double() for x in grads]


def assert_close(a, b, tol, what):
    scale = b.abs().max().clamp_min(1.0)
    err = (a - b).abs().max()
    assert err <= tol * scale, f"{what}: max diff {err.item():.3e} (scale {scale.item():.3e})"


NAMES = ["q", "k", "v", "theta", "log_eta", "log_keep"]


def check_against_reference(
    shape, depth, options, *, momentum=True, forgetting=True, dtype=torch.float32, tol=2e-4, device="cpu"
):
    batch, heads, seq, d = shape
    args, w, s = random_problem(
        batch, heads, seq, d, depth, expansion=2, seed=seq + depth, momentum=momentum, forgetting=forgetting
    )

    def on_device(*a, **kw):
        moved = [x.to(device) if torch.is_tensor(x) else tuple(t.to(device) for t in x) for x in a]
        return [
            o.cpu() if torch.is_tensor(o) else tuple(t.cpu() for t in o)
            for o in neural_memory_triton(*moved, **kw)
        ]

    outs, grads = _loss_and_grads(on_device, args, w, s, options, dtype)
    ref_outs, ref_grads = _loss_and_grads(neural_memory_ref, args, w, s, options, F64)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_close(o, r, tol, f"output {i}")
    names = NAMES + [f"w{i}" for i in range(depth)] + [f"s{i}" for i in range(depth)]
    for name, g, r in zip(names, grads, ref_grads):
        if name == "log_eta" and not momentum:
            continue  # eta = 0 exactly: no gradient is defined through log(0)
        if r is None:  # not used (no complete chunk to write)
            assert g is None or not g.any(), name
            continue
        assert g is not None, name
        assert_close(g, r, tol * 10, f"grad {name}")


@interpreted
@pytest.mark.parametrize(
    "depth, shape, options",
    [
        # T not a multiple of the chunk; chunk < 16 (padded); d < 16 (padded); B * H = 3
        (1, (1, 3, 11, 5), {"chunk_size": 4}),
        (1, (2, 1, 9, 6), {"chunk_size": 3, "activation": "gelu", "residual": True, "surprise_clip": 0.3}),
        (2, (1, 3, 10, 5), {"chunk_size": 4, "surprise_clip": 0.3}),
        (2, (2, 1, 9, 4), {"chunk_size": 5, "activation": "gelu", "residual": True}),
        # one chunk exactly, a chunk of 1, and T shorter than a chunk (a read only)
        (2, (1, 2, 4, 5), {"chunk_size": 4, "activation": "relu"}),
        (1, (1, 2, 3, 5), {"chunk_size": 1, "surprise_clip": 0.5}),
        (2, (1, 2, 3, 5), {"chunk_size": 8, "residual": True}),
    ],
)
def test_kernel_matches_reference_outputs_and_gradients(depth, shape, options):
    check_against_reference(shape, depth, options)


@interpreted
@pytest.mark.parametrize("momentum, forgetting", [(False, True), (True, False), (False, False)])
def test_kernel_with_momentum_or_forgetting_off(momentum, forgetting):
    check_against_reference(
        (1, 2, 9, 4), 2, {"chunk_size": 4, "surprise_clip": 0.5}, momentum=momentum, forgetting=forgetting
    )


@interpreted
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_inputs_with_float32_state(half):
    """bf16 / fp16 q, k, v with a float32 state: the kernel computes in float32, so it agrees with the
    torch path on the same (rounded) inputs to float32 accuracy; the gradients come in the inputs' dtype."""
    args, w, s = random_problem(1, 2, 10, 8, 2, seed=3)
    args = [x.float() for x in args]
    qkv = [x.to(half).requires_grad_(True) for x in args[:3]]
    kw = {"chunk_size": 4, "surprise_clip": 0.5}
    ws = tuple(x.float() for x in w)
    ss = tuple(x.float() for x in s)
    y, w_out, _, norm = neural_memory_triton(*qkv, *args[3:], ws, ss, **kw)
    assert y.dtype == torch.float32 and w_out[0].dtype == torch.float32
    ref = neural_memory_chunked(*(x.detach().float() for x in qkv), *args[3:], ws, ss, **kw)
    assert_close(y.detach(), ref[0], 1e-5, "y")
    assert_close(w_out[1].detach(), ref[1][1], 1e-5, "w")
    (y.sum() + norm.sum()).backward()
    assert all(x.grad.dtype == half and torch.isfinite(x.grad).all() for x in qkv)


@interpreted
@pytest.mark.parametrize(
    "depth, seq, chunk, every",
    [
        (2, 23, 4, 2),  # 5 complete chunks + a tail of 3: groups of 2, 2, 1 (the last with the tail)
        (2, 28, 4, 3),  # 7 complete chunks, no tail: groups of 3, 3, 1
        (1, 21, 5, 2),  # depth 1; 4 chunks + a tail of 1: groups of 2, 2 (the last with the tail)
        (2, 13, 4, 8),  # more than the 3 chunks there are: one group of 3 with the tail
    ],
)
def test_checkpoint_every_runs_the_kernels_with_the_same_gradients(depth, seq, chunk, every, monkeypatch):
    """checkpoint_every: only every n-th chunk-start state is saved, and the backward recomputes each group's
    states with the forward kernel before the backward kernel runs over it; no torch chunk step runs. The
    outputs and gradients are those of the one-launch backward (every state saved) to the bit, and the
    float64 reference's."""
    args, w, s = random_problem(1, 3, seq, 5, depth, expansion=2, seed=seq)
    kw = {"chunk_size": chunk, "surprise_clip": 0.4}
    launches = []
    real = memory_triton._launch
    monkeypatch.setattr(memory_triton, "_launch", lambda *a: launches.append(a[-1]) or real(*a))
    monkeypatch.setattr(memory_triton, "_recomputed_backward", lambda *a: pytest.fail("torch chunk step ran"))
    outs, grads = _loss_and_grads(neural_memory_triton, args, w, s, kw, torch.float32)
    assert launches == [1]  # every state saved, one backward launch
    launches.clear()
    outs_c, grads_c = _loss_and_grads(
        neural_memory_triton, args, w, s, {**kw, "checkpoint_every": every}, torch.float32
    )
    n_full = seq // chunk
    group = min(every, n_full)
    n_groups = -(-n_full // group)
    # the forward saving every group-th state, then one recomputing forward per group, each saving all
    assert launches == [group] + [1] * n_groups
    for a, b in zip(outs + grads, outs_c + grads_c):
        assert torch.equal(a, b)
    ref_outs, ref_grads = _loss_and_grads(neural_memory_ref, args, w, s, kw, F64)
    for i, (a, r) in enumerate(zip(outs_c + grads_c, ref_outs + ref_grads)):
        assert_close(a, r, 2e-3, f"checkpointed output / gradient {i}")


@interpreted
@pytest.mark.parametrize("view", ["features", "tokens"])
def test_views_as_q_k_v_give_the_contiguous_copies_outputs_and_gradients(view):
    """q, k, v passed as views: the first d features of wider rows (as a fused projection's slices would
    be), or the last T tokens of longer sequences (read in place by the kernels, one row stride apart).
    The outputs and every gradient are those of contiguous copies of the same values, to the bit."""
    args, w, s = random_problem(2, 2, 13, 4, 2, expansion=2, seed=11)
    g = torch.Generator().manual_seed(0)
    if view == "features":
        wide = [torch.cat([x, torch.randn(x.shape, generator=g)], -1) for x in args[:3]]
        cut = lambda x: x[..., :4]  # noqa: E731
    else:
        wide = [torch.cat([torch.randn(2, 2, 5, 4, generator=g), x], 2) for x in args[:3]]
        cut = lambda x: x[:, :, 5:]  # noqa: E731
    kw = {"chunk_size": 4, "surprise_clip": 0.5}

    def run(make):
        leaves = [x.detach().clone().requires_grad_(True) for x in wide]
        y, w_out, s_out, norm = neural_memory_triton(*(make(x) for x in leaves), *args[3:], w, s, **kw)
        loss = y.square().sum() + norm.sum() + sum(x.square().sum() for x in (*w_out, *s_out))
        loss.backward()
        return [y.detach(), norm.detach(), *(x.grad for x in leaves)]

    for a, b in zip(run(cut), run(lambda x: cut(x).contiguous())):
        assert torch.equal(a, b)


def _memory(**kw) -> NeuralMemory:
    torch.manual_seed(0)
    opts = dict(heads=3, head_dim=4, depth=2, expansion=2.0, chunk_size=4, conv_kernel=2)
    return NeuralMemory(12, **{**opts, **kw})


@interpreted
@pytest.mark.parametrize("splits", [[1, 1, 1, 1, 1, 4, 2], [3, 6, 2], [11]])
def test_layer_streaming_pieces_equal_whole_and_torch(splits):
    """NeuralMemory(backend="triton") fed in pieces (1-token pieces included: the decode step) equals one
    call, and equals the torch backend, output and state."""
    mem = _memory(backend="triton")
    x = torch.randn(2, sum(splits), 12)
    whole, state_whole = mem(x)
    torch_mem = _memory(backend="torch")
    ref, state_ref = torch_mem(x)
    assert_close(whole.detach(), ref.detach(), 1e-5, "triton vs torch")
    state, outs, start = None, [], 0
    for n in splits:
        y, state = mem(x[:, start : start + n], state)
        outs.append(y)
        start += n
    assert_close(torch.cat(outs, 1).detach(), whole.detach(), 1e-5, "pieces vs whole")
    for a, b in zip(state.weights + state.momentum, state_ref.weights + state_ref.momentum):
        assert_close(a.detach(), b.detach(), 1e-5, "state")


@interpreted
def test_layer_parameter_gradients_match_torch_backend():
    x = torch.randn(1, 9, 12)
    grads = []
    for backend in ("triton", "torch"):
        mem = _memory(backend=backend, surprise_clip=0.5)
        y, state = mem(x)
        (y.square().sum() + state.weights[1].sum()).backward()
        grads.append([p.grad for p in mem.parameters()])
    for a, b in zip(*grads):
        assert_close(a, b, 1e-4, "parameter grad")


def test_backend_choices_and_errors(monkeypatch, caplog):
    with pytest.raises(ValueError, match="backend must be one of"):
        NeuralMemory(12, heads=3, backend="cuda")
    with pytest.raises(ValueError, match="memory_backend must be"):
        TitansConfig(memory_backend="fast")
    x = torch.randn(1, 5, 12)
    # auto on CPU: torch, said once in the debug log (on CUDA, where it is news, at INFO)
    from titans.layers import memory as layer

    monkeypatch.setattr(layer, "_logged_choices", set())
    with caplog.at_level(logging.INFO, logger="titans.layers.memory"):
        _memory(backend="auto")(x)
    assert not [r for r in caplog.records if "backend='auto'" in r.getMessage()]
    monkeypatch.setattr(layer, "_logged_choices", set())
    with caplog.at_level(logging.DEBUG, logger="titans.layers.memory"):
        _memory(backend="auto")(x)
        _memory(backend="auto")(x)
    said = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
    assert len(said) == 1 and "torch" in said[0] and "CUDA" in said[0], said
    # triton where the kernels cannot run: a clear error naming why
    with pytest.raises(ValueError, match="depth 3"):
        _memory(backend="triton", depth=3)(x)
    with pytest.raises(ValueError, match="width 512"):
        _memory(backend="triton", head_dim=512, heads=1, expansion=1.0)(torch.randn(1, 2, 12))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="on cpu.*TRITON_INTERPRET"):
        _memory(backend="triton")(x)
    monkeypatch.setattr(memory_triton, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="triton is not installed"):
        _memory(backend="triton")(x)
    # the config reaches the layer
    from titans import TitansLM

    model = TitansLM(
        TitansConfig(vocab_size=16, dim=16, depth=1, heads=2, variant="lmm", memory_backend="torch")
    )
    assert {m.backend for m in model.modules() if isinstance(m, NeuralMemory)} == {"torch"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_kernels_on_cuda_and_matches_torch():
    mem = _memory(backend="auto").cuda()
    x = torch.randn(2, 37, 12, device="cuda")
    assert mem._use_triton(torch.empty(1, device="cuda"))
    y, state = mem(x)
    mem.backend = "torch"
    y_ref, state_ref = mem(x)
    assert_close(y, y_ref, 1e-4, "cuda kernels vs torch")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_auto_on_cuda_warns_once_when_the_kernel_dots_lack_tensor_cores(allow_tf32, monkeypatch, caplog):
    """With torch's TF32 flag off (its default) the kernels' float32 dots run exact, without tensor cores
    (several times slower): "auto" says so once, as a warning."""
    from titans.layers import memory as layer

    monkeypatch.setattr(layer, "_logged_choices", set())
    monkeypatch.delenv("TITANS_MEMORY_TRITON_PREC", raising=False)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        mem = _memory(backend="auto").cuda()
        with caplog.at_level(logging.INFO, logger="titans.layers.memory"):
            for _ in range(2):
                mem(torch.randn(1, 9, 12, device="cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    said = [r for r in caplog.records if "backend='auto'" in r.getMessage()]
    assert len(said) == 1 and "triton" in said[0].getMessage()
    assert ("tensor cores" in said[0].getMessage()) == (not allow_tf32)
    assert said[0].levelno == (logging.INFO if allow_tf32 else logging.WARNING)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or memory_triton.interpreting(), reason="needs CUDA, compiled"
)
@pytest.mark.parametrize(
    "depth, shape, options, must_fit",
    [
        # the presets' sizes (head 64, hidden 128, chunk 64), T not a multiple of the chunk, B * H = 3
        (2, (1, 3, 200, 64), {"chunk_size": 64, "surprise_clip": 1.0}, True),
        (1, (3, 1, 150, 64), {"chunk_size": 64, "activation": "gelu", "residual": True}, True),
        (2, (2, 2, 77, 32), {"chunk_size": 16, "residual": True, "surprise_clip": 0.3}, True),
        # a 128 x 256 state: the backward kernel may not fit; then the fallback's gradients are checked
        (2, (1, 2, 40, 128), {"chunk_size": 32}, False),
        # the presets' sizes, every 2nd chunk-start state saved (the rest recomputed by the forward kernel)
        (2, (1, 3, 200, 64), {"chunk_size": 64, "surprise_clip": 1.0, "checkpoint_every": 2}, True),
    ],
)
def test_compiled_kernel_matches_reference_on_cuda(depth, shape, options, must_fit, monkeypatch):
    """The compiled kernels (not the interpreter) against the float64 reference on CPU, fp32 matmuls
    (`allow_tf32` off, torch's default). At the sizes the presets train with, the backward must run as the
    kernel, not fall back to the torch chunk step for want of shared memory."""
    monkeypatch.setattr(memory_triton, "_UNFIT", set())
    check_against_reference(shape, depth, options, device="cuda", tol=5e-4)
    if must_fit:
        assert not memory_triton._UNFIT, "the backward kernel did not fit in the device's shared memory"


@interpreted
def test_backward_falls_back_where_the_kernel_does_not_fit(monkeypatch):
    """A backward kernel too big for the device's shared memory (simulated): the torch chunk step takes
    over from the same saved states, the same gradients, and later calls of that shape skip the kernel."""
    args, w, s = random_problem(1, 2, 10, 4, 2, seed=7)
    kw = {"chunk_size": 4, "surprise_clip": 0.5}
    outs, grads = _loss_and_grads(neural_memory_triton, args, w, s, kw, torch.float32)
    tried = []

    def too_big(*a):
        tried.append(1)
        raise memory_triton._kernels().OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(memory_triton, "_fused_backward", too_big)
    monkeypatch.setattr(memory_triton, "_UNFIT", set())
    for _ in range(2):
        outs_f, grads_f = _loss_and_grads(neural_memory_triton, args, w, s, kw, torch.float32)
        for a, b in zip(outs + grads, outs_f + grads_f):
            assert_close(a, b, 1e-6, "fallback")
    assert len(tried) == 1 and len(memory_triton._UNFIT) == 1


@interpreted
def test_decode_step_is_one_kernel_launch(monkeypatch):
    """One token at a time (pending tokens prepended, the chunk written when it completes): the memory op is
    one forward-kernel launch per call, and none of the torch chunk loop runs."""
    mem = _memory(backend="triton")
    _, state = mem(torch.randn(1, 6, 12))
    launches = []
    real = memory_triton._launch
    # a[-1]: every how many chunks a start state is kept for a backward (0: none, no autograd node)
    monkeypatch.setattr(memory_triton, "_launch", lambda *a: launches.append(a[-1]) or real(*a))
    for name in ("run_chunks", "read_and_grads"):
        monkeypatch.setattr(memory_triton, name, lambda *a, **k: pytest.fail("torch chunk loop ran"))
    with torch.no_grad():
        for _ in range(3):  # 6 + 2 = 8 completes a chunk of 4 on the second step
            _, state = mem(torch.randn(1, 1, 12), state)
    assert launches == [0, 0, 0] and state.position == 9 and state.pending_k.shape[2] == 1


@interpreted
def test_without_gradients_the_same_values_as_with_them():
    """Where no input needs a gradient the op launches the forward kernel without an autograd node: the same
    outputs as the autograd path, to the bit (the same kernel), and nothing to backpropagate."""
    args, w, s = random_problem(2, 3, 21, 6, 2, expansion=2, seed=5, momentum=True, forgetting=True)
    kw = {"chunk_size": 4, "surprise_clip": 0.3}
    with_grads = neural_memory_triton(*args, tuple(x.requires_grad_() for x in w), s, **kw)
    with torch.no_grad():
        without = neural_memory_triton(*args, tuple(x.detach() for x in w), s, **kw)
    flat = lambda out: [out[0], *out[1], *out[2], out[3]]  # noqa: E731
    assert with_grads[0].grad_fn is not None
    for a, b in zip(flat(with_grads), flat(without)):
        assert b.grad_fn is None and torch.equal(a.detach(), b)


@interpreted
def test_backward_in_row_blocks(monkeypatch):
    """Chunks of 20 (padded to 32) taken 16 rows at a time by the backward kernel: the same gradients as
    the reference."""
    monkeypatch.setattr(memory_triton, "BACKWARD_ROWS", 16)
    check_against_reference((1, 2, 45, 4), 2, {"chunk_size": 20, "surprise_clip": 0.5, "activation": "gelu"})


@interpreted
def test_layer_under_bf16_autocast_matches_torch_backend():
    """bf16 autocast: bf16 q, k, v reach the kernels, the state stays float32, as on the torch path."""
    x = torch.randn(2, 11, 12)
    runs = []
    for backend in ("triton", "torch"):
        mem = _memory(backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, state = mem(x)
        y.float().sum().backward()
        assert state.weights[0].dtype == torch.float32
        runs.append((y.float().detach(), mem.init_weights[0].grad))
    assert_close(runs[0][0], runs[1][0], 1e-3, "y")
    assert_close(runs[0][1], runs[1][1], 1e-3, "grad")


@interpreted
@pytest.mark.parametrize(
    "depth, shape, options, rows",
    [
        # chunks of 5 (padded to 16) over 13 tokens, d = 5, B * H = 3
        (1, (1, 3, 13, 5), {"chunk_size": 5, "surprise_clip": 0.4}, 32),
        # chunks of 20 (padded to 32) taken 16 rows at a time by the backward kernel, d = 3
        (2, (2, 1, 45, 3), {"chunk_size": 20, "activation": "gelu", "residual": True}, 16),
    ],
)
def test_kernels_compute_the_coefficients_from_the_gates(depth, shape, options, rows, monkeypatch):
    """The kernels take the raw per-token gates (the strided views of one (B, H, T, 3) tensor, as
    `neural_memory` passes them) and compute gamma, beta and the chunk mix themselves: no torch coefficient
    code runs, and the outputs, states and the gradient of every input, the gates tensor's above all, match
    the float64 reference to 2e-5 of each one's own largest entry. Per token a zero write rate, strong
    forgetting and momentum near off are mixed in."""
    monkeypatch.setattr(memory_triton, "BACKWARD_ROWS", rows)
    monkeypatch.setattr(memory_triton, "chunk_mix", lambda *a: pytest.fail("torch coefficients computed"))
    args, w, s = random_problem(*shape, depth, seed=11)
    q, k, v, theta, log_eta, log_keep = args
    theta[..., ::4] = 0.0
    log_keep[..., 1::5] = -12.0
    log_eta[..., 2::3] = -30.0
    gates = torch.stack([theta, log_eta, log_keep], -1)
    kw = {**options}

    def triton_op(q, k, v, gates, w, s, **kw):
        return neural_memory(q, k, v, gates, w, s, backend="triton", **kw)

    def reference(q, k, v, gates, w, s, **kw):
        return neural_memory(q, k, v, gates, w, s, backend="reference", **kw)

    outs, grads = _loss_and_grads(triton_op, (q, k, v, gates), w, s, kw, torch.float32)
    ref_outs, ref_grads = _loss_and_grads(reference, (q, k, v, gates), w, s, kw, F64)
    names = ["y"] + [f"w{i}" for i in range(depth)] + [f"s{i}" for i in range(depth)] + ["norm"]
    names += ["grad q", "grad k", "grad v", "grad gates"]
    names += [f"grad w{i}" for i in range(depth)] + [f"grad s{i}" for i in range(depth)]
    for name, a, b in zip(names, outs + grads, ref_outs + ref_grads):
        err = (a - b).abs().max() / b.abs().max()
        assert err <= 2e-5, f"{name}: max diff {err.item():.2e} of its largest entry"
    # each gate's gradient on its own (theta's, eta's, alpha's), each with entries far from zero
    for i, gate in enumerate(("theta", "log_eta", "log_keep")):
        a, b = grads[3][..., i], ref_grads[3][..., i]
        assert b.abs().max() > 1e-3, gate
        err = (a - b).abs().max() / b.abs().max()
        assert err <= 2e-5, f"grad {gate}: max diff {err.item():.2e} of its largest entry"


@pytest.mark.parametrize("depth", [3, 4])
def test_depth_3_and_4_refused_by_name_and_auto_runs_torch(depth, monkeypatch, caplog):
    """The kernels cover memory depth 1 and 2 (each layer's state is held in registers): depth 3 and 4 are
    refused naming the depth and the covered ones, by the op, by the layer when it is built (before any
    input) and by the config; backend="auto" runs them on the torch loop, saying why, even where the kernels
    could run (the device check passed, as on CUDA)."""
    args, w, s = random_problem(1, 2, 9, 4, depth, dtype=torch.float32)
    q, k, v, *gate_list = args
    gates = torch.stack(gate_list, -1)
    refused = rf"memory depth {depth} is not covered by the kernels \(they cover depth 1 and 2\)"
    with pytest.raises(ValueError, match=refused):
        neural_memory(q, k, v, gates, w, s, chunk_size=4, backend="triton")
    with pytest.raises(ValueError, match=rf"NeuralMemory\(backend='triton'\): {refused}"):
        NeuralMemory(12, heads=3, head_dim=4, depth=depth, backend="triton")
    with pytest.raises(ValueError, match=rf"covers memory_depth 1 and 2, got memory_depth={depth}"):
        TitansConfig(memory_backend="triton", memory_depth=depth)
    from titans.layers import memory as layer

    monkeypatch.setattr(titans.ops.memory, "device_reason", lambda device: None)
    monkeypatch.setattr(layer, "_logged_choices", set())
    x = torch.randn(1, 9, 12)
    with caplog.at_level(logging.DEBUG, logger="titans.layers.memory"):
        y, state = _memory(backend="auto", depth=depth)(x)
    said = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
    assert len(said) == 1 and "torch" in said[0] and f"memory depth {depth}" in said[0], said
    y_torch, state_torch = _memory(backend="torch", depth=depth)(x)
    assert torch.equal(y, y_torch) and torch.equal(state.weights[-1], state_torch.weights[-1])


@pytest.mark.slow  # two kernels compiled for a GPU by Triton's own compiler: ~40 s of one CPU core
def test_kernels_build_for_hopper_within_its_shared_memory():
    """The presets' memory (depth 2, head 64, hidden 128, chunk 64; bf16 q, k, v, tf32) compiled here, with
    no GPU, for an H100 / H200 (compute capability 9.0): both kernels build, and each fits in the 227 KB of
    shared memory a block may use there (else the backward runs the torch fallback at torch's speed). The
    interpreter above checks the maths; this checks what only the compiler sees."""
    code = (
        "import json; from titans.ops.memory.triton_chunk import shared_memory; "
        "print(json.dumps(shared_memory(2, 64, 128, 64, capability=90)))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads(run.stdout.strip().splitlines()[-1])
    assert used["forward"] <= HOPPER_SHARED and used["backward"] <= HOPPER_SHARED, used


@interpreted
def test_compiled_blocks_equal_eager_in_one_graph():
    """`TitansLM.compile_blocks` (`titans train --compile`) with the memory on the kernels: each block
    compiles to one graph (fullgraph: the kernels are custom ops the graph calls, the conv and the rotary
    angles traced as plain ops), with the eager model's logits and gradients. MAC over two segments and a
    piece, chunks ending mid-segment."""
    import copy

    from titans import TitansLM

    torch.manual_seed(0)
    cfg = TitansConfig.preset(
        "tiny", variant="mac", depth=2, dim=32, heads=2, segment_len=12, chunk_size=4, memory_backend="triton"
    )
    eager = TitansLM(cfg)
    for module in eager.modules():  # as `titans train` runs it: no host sync per memory call
        if isinstance(module, NeuralMemory):
            module.check_finite = False
    compiled = copy.deepcopy(eager)
    compiled.compile_blocks(fullgraph=True, backend="aot_eager")  # inductor itself: the GPU runs
    tokens = torch.randint(0, cfg.vocab_size, (2, 2 * cfg.segment_len + 7))
    results = []
    for model in (eager, compiled):
        logits, _ = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits_e, grads_e), (logits_c, grads_c) = results
    assert_close(logits_c.double(), logits_e.double(), 1e-5, "logits")
    for name, g in grads_e.items():
        assert g is not None and grads_c[name] is not None, name
        assert_close(grads_c[name].double(), g.double(), 1e-4, name)


def test_the_largest_kernels_are_built_at_ptxas_opt_level_1(monkeypatch):
    """At -O3 (Triton's own) ptxas builds the depth-2 kernels for a GPU below compute capability 9.0, and
    the exact-float32 kernels for any, with 32 registers a thread and most of their state spilled
    (benchmarks/kernel_resources.py); those get `--opt-level 1`, the rest Triton's own, and
    TITANS_MEMORY_TRITON_PTXAS overrides both ways. Under the interpreter no option is passed."""
    monkeypatch.delenv("TITANS_MEMORY_TRITON_PTXAS", raising=False)
    rule = memory_triton.ptxas_options
    assert rule(2, "tf32", 80) == rule(2, "ieee", 90) == rule(1, "ieee", 80) == "--opt-level 1"
    assert rule(2, "tf32", 90) is None and rule(1, "tf32", 80) is None and rule(2, "tf32", 100) is None
    config = ("silu", False, 1.0, 64)
    assert "ptx_options" not in memory_triton._constants(config, 64, 128, 2, "ieee", None)
    assert memory_triton._constants(config, 64, 128, 2, "tf32", 80)["ptx_options"] == "--opt-level 1"
    assert "ptx_options" not in memory_triton._constants(config, 64, 128, 2, "tf32", 90)
    monkeypatch.setenv("TITANS_MEMORY_TRITON_PTXAS", "")
    assert rule(2, "tf32", 80) is None
    monkeypatch.setenv("TITANS_MEMORY_TRITON_PTXAS", "--opt-level 2")
    assert rule(2, "tf32", 90) == "--opt-level 2"


@interpreted
@pytest.mark.parametrize("depth, activation, where", [(1, "silu", "k"), (1, "silu", "v"), (2, "relu", "q")])
def test_a_nan_reaches_the_outputs_and_gradients_as_on_the_torch_path(depth, activation, where):
    """A NaN in one token's q, k or v: the kernels report NaN where the torch path does (a NaN inner
    gradient's surprise, the clip's scale, relu of NaN), never a number (the surprise was 1e-15, the clip
    scale 1, relu 0), in the outputs and in every input's gradient."""
    args, w, s = random_problem(1, 1, 7, 4, depth, seed=1)
    args = [x.float() for x in args]
    args["qkv".index(where)][0, 0, 4, 1] = float("nan")  # a token of the second chunk of 3
    w, s = [x.float() for x in w], [x.float() for x in s]
    kw = {"chunk_size": 3, "surprise_clip": 0.5, "activation": activation}
    outs, grads = {}, {}
    for name, fn in (("torch", neural_memory_chunked), ("triton", neural_memory_triton)):
        outs[name], grads[name] = _loss_and_grads(fn, args, w, s, kw, torch.float32)
    assert any(o.isnan().any() for o in outs["torch"])
    for a, b in zip(outs["triton"] + grads["triton"], outs["torch"] + grads["torch"]):
        assert torch.equal(a.isnan(), b.isnan())
        assert_close(a.nan_to_num(), b.nan_to_num(), 1e-4, "finite values")


@interpreted
def test_a_bfloat16_state_is_carried_in_float32_over_a_call():
    """A bfloat16 state (a bf16 model's) is taken: read into float32, carried in float32 over the call's
    chunks and rounded to bfloat16 when stored, so the results are those of the float32 state run rounded
    once, within one bfloat16 ulp (the interpreter's rounding truncates; the torch path rounds the state
    after every chunk)."""
    args, w, s = random_problem(1, 2, 10, 8, 2, seed=3)
    args = [x.float() for x in args]
    w16, s16 = tuple(x.bfloat16() for x in w), tuple(x.bfloat16() for x in s)
    kw = {"chunk_size": 4, "surprise_clip": 0.5}
    y, w_out, s_out, norm = neural_memory_triton(*args, w16, s16, **kw)
    ref = neural_memory_triton(*args, tuple(x.float() for x in w16), tuple(x.float() for x in s16), **kw)
    for a, b in zip([y, *w_out, *s_out, norm], [ref[0], *ref[1], *ref[2], ref[3]]):
        assert a.dtype == torch.bfloat16
        assert ((a.float() - b).abs() <= b.abs() * 2**-7).all()
