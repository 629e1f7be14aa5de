"""The neural memory: fast chunked path vs the literal float64 reference, causality, state, memorization."""

from __future__ import annotations

import copy
import math
import os
import shutil
import types
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titans import MemoryState, NeuralMemory
from titans.ops import cpu_kernels
from titans.ops.conv import causal_conv_silu
from titans.ops.conv_ref import causal_conv_silu_ref
from titans.ops.memory import (
    memory_forward,
    memory_rule_chunked,
    neural_memory,
    neural_memory_chunked,
    neural_memory_ref,
    neural_memory_triton,
    resolve_rule,
    segsum,
    suffix_sum,
)

F64 = torch.float64


def random_problem(
    batch, heads, seq, d, depth, expansion=2, dtype=F64, seed=0, momentum=True, forgetting=True
):
    """Random q/k/v, random gates and random initial weights/momentum (not just zeros)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, d, generator=g, dtype=dtype) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    theta = 0.2 * torch.rand(batch, heads, seq, generator=g, dtype=dtype)
    log_eta = F.logsigmoid(2 * torch.randn(batch, heads, seq, generator=g, dtype=dtype))
    log_keep = F.logsigmoid(2 * torch.randn(batch, heads, seq, generator=g, dtype=dtype) + 3)
    if not momentum:
        log_eta = torch.full_like(log_eta, float("-inf"))
    if not forgetting:
        log_keep = torch.zeros_like(log_keep)
    sizes = [d] + [d * expansion] * (depth - 1) + [d]
    w = tuple(
        torch.randn(batch, heads, sizes[i], sizes[i + 1], generator=g, dtype=dtype) / math.sqrt(sizes[i])
        for i in range(depth)
    )
    s = tuple(0.1 * torch.randn(x.shape, generator=g, dtype=dtype) for x in w)
    return (q, k, v, theta, log_eta, log_keep), w, s


def assert_close_rel(a, b, rtol):
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max() <= rtol * scale, (
        f"max diff {(a - b).abs().max().item():.3e} (scale {scale:.3e})"
    )


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("chunk", [1, 7, 16])
@pytest.mark.parametrize("seq", [1, 15, 33, 100])
def test_chunked_equals_reference_float64(depth, chunk, seq):
    args, w, s = random_problem(2, 2, seq, 5, depth, seed=depth * 100 + chunk + seq)
    fast = neural_memory_chunked(*args, w, s, chunk_size=chunk)
    ref = neural_memory_ref(*args, w, s, chunk_size=chunk)
    for a, b in zip([fast[0], *fast[1], *fast[2], fast[3]], [ref[0], *ref[1], *ref[2], ref[3]]):
        assert_close_rel(a, b, 1e-10)


@pytest.mark.parametrize("momentum,forgetting", [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("options", [{}, {"residual": True, "activation": "gelu"}, {"surprise_clip": 0.3}])
def test_ablations_and_options_match_reference(momentum, forgetting, options):
    args, w, s = random_problem(2, 3, 29, 4, 2, seed=7, momentum=momentum, forgetting=forgetting)
    fast = neural_memory_chunked(*args, w, s, chunk_size=8, **options)
    ref = neural_memory_ref(*args, w, s, chunk_size=8, **options)
    for a, b in zip([fast[0], *fast[1], *fast[2], fast[3]], [ref[0], *ref[1], *ref[2], ref[3]]):
        assert_close_rel(a, b, 1e-10)


def test_no_momentum_is_plain_gradient_step():
    """eta = 0, alpha = 0, chunk 1: W_t = W_{t-1} - theta_t u_t (the delta rule for a linear memory)."""
    args, w, s = random_problem(1, 1, 5, 3, 1, momentum=False, forgetting=False)
    q, k, v, theta, _, _ = args
    _, w_end, _, _ = neural_memory_chunked(*args, w, tuple(torch.zeros_like(x) for x in s), chunk_size=1)
    W = w[0][0, 0].clone()
    for t in range(5):
        kt, vt = k[0, 0, t], v[0, 0, t]
        W = W - theta[0, 0, t] * 2 * torch.outer(kt, kt @ W - vt)
    torch.testing.assert_close(w_end[0][0, 0], W)


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_equals_reference_float32(depth):
    args, w, s = random_problem(2, 2, 45, 8, depth, dtype=torch.float32, seed=3)
    fast = neural_memory_chunked(*args, w, s, chunk_size=16)
    args64 = [a.double() for a in args]
    ref = neural_memory_ref(
        *args64, tuple(x.double() for x in w), tuple(x.double() for x in s), chunk_size=16
    )
    for a, b in zip([fast[0], *fast[1], *fast[2]], [ref[0], *ref[1], *ref[2]]):
        assert_close_rel(a.double(), b, 1e-4)


def with_stats(out):
    """A `MemoryOutput` as (output, state, stats)."""
    return out.output, out.state, out.stats


def make_pair(**kw):
    torch.manual_seed(0)
    fast = NeuralMemory(max_lr=0.3, **kw).double()
    with torch.no_grad():  # random gate weights so gates differ per token and head
        fast.to_gates.weight.normal_(0, 0.3)
    ref = copy.deepcopy(fast)
    ref.impl = "reference"
    return fast, ref


@pytest.mark.parametrize("depth,chunk,seq", [(1, 7, 15), (2, 7, 33), (3, 16, 33), (2, 1, 9), (2, 16, 100)])
def test_module_outputs_and_gradients_match_reference(depth, chunk, seq):
    fast, ref = make_pair(dim=12, heads=2, head_dim=5, depth=depth, expansion=2, chunk_size=chunk)
    x = torch.randn(2, seq, 12, dtype=F64, requires_grad=True)
    y1, s1, st1 = with_stats(fast.forward_with_stats(x))
    y2, s2, st2 = with_stats(ref.forward_with_stats(x))
    assert torch.isfinite(y1).all()
    assert_close_rel(y1, y2, 1e-10)
    assert_close_rel(st1.surprise, st2.surprise, 1e-10)
    for a, b in zip(s1.weights + s1.momentum, s2.weights + s2.momentum):
        assert_close_rel(a, b, 1e-10)
    params_f, params_r = list(fast.parameters()), list(ref.parameters())
    loss_w = torch.randn_like(y1)
    g1 = torch.autograd.grad((y1 * loss_w).sum() + s1.weights[0].sum(), [x, *params_f], allow_unused=True)
    g2 = torch.autograd.grad((y2 * loss_w).sum() + s2.weights[0].sum(), [x, *params_r], allow_unused=True)
    names = ["input"] + [n for n, _ in fast.named_parameters()]
    for name, a, b in zip(names, g1, g2):
        assert a is not None and b is not None, f"no gradient for {name}"
        assert a.abs().sum() > 0, f"zero gradient for {name}"
        assert_close_rel(a, b, 1e-9)


def test_backward_twice_with_retained_graph_and_two_calls_in_one_graph():
    """The chunk steps reuse two state-gradient buffers during backward; reuse must not leak between the
    two backward passes of a retained graph, nor between two memory calls inside one graph."""
    torch.manual_seed(3)
    mem = NeuralMemory(12, heads=2, head_dim=5, depth=2, expansion=2, chunk_size=4).double()
    x = torch.randn(2, 23, 12, dtype=F64, requires_grad=True)
    w = torch.randn(2, 23, 12, dtype=F64)

    def loss():
        y, state = mem(x[:, :10])  # two calls threaded through the state: one graph
        y2, state = mem(x[:, 10:], state)
        return (torch.cat([y, y2], 1) * w).sum() + state.weights[1].sum()

    params = [x, *mem.parameters()]
    once = torch.autograd.grad(loss(), params)
    out = loss()
    first = torch.autograd.grad(out, params, retain_graph=True)
    second = torch.autograd.grad(out, params)
    for a, b, c in zip(once, first, second):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-12)


def test_suffix_sum_is_the_last_row_of_segsum():
    log_x = -torch.rand(3, 4, 9, dtype=torch.float64)
    log_x[0, 1, 4] = float("-inf")  # a gate of exactly 0 stays -inf in every sum that includes it
    full, fast = segsum(log_x)[..., -1, :], suffix_sum(log_x)
    assert torch.equal(full.isinf(), fast.isinf())
    torch.testing.assert_close(fast[~fast.isinf()], full[~full.isinf()], rtol=0, atol=1e-14)


def test_gradcheck_chunked_op():
    args, w, s = random_problem(1, 1, 6, 3, 2, expansion=1, seed=11)
    args = [a.requires_grad_() if a.dtype.is_floating_point and i != 4 else a for i, a in enumerate(args)]
    w = tuple(x.requires_grad_() for x in w)

    def fn(q, k, v, theta, log_keep, w0, w1):
        y, wn, _, _ = neural_memory_chunked(q, k, v, theta, args[4], log_keep, (w0, w1), s, chunk_size=4)
        return y, wn[0]

    assert torch.autograd.gradcheck(fn, (args[0], args[1], args[2], args[3], args[5], *w))


@pytest.fixture(params=["cpu kernel", "torch ops"])
def conv_path(request, monkeypatch):
    """Run a test on the compiled CPU kernel and on the torch-op path (its fallback)."""
    if request.param == "torch ops":
        monkeypatch.setattr("titans.ops.conv.kernels", lambda: None)
    elif cpu_kernels.kernels() is None:
        pytest.skip("the CPU conv kernel could not be built here")
    return request.param


def test_cpu_kernels_build_where_a_compiler_is():
    if os.environ.get("TITANS_CPU_KERNELS") == "0" or not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler (or kernels turned off): the torch-op path is used")
    assert cpu_kernels.kernels() is not None
    # cached under the name of these sources, where another version's would not find it
    assert cpu_kernels.is_built(cpu_kernels.extension_name())
    assert not cpu_kernels.is_built(cpu_kernels.extension_name() + "0")


def test_cpu_kernel_build_name_follows_sources_flags_cpu_torch_and_compiler(tmp_path, monkeypatch, capsys):
    """The build's name is keyed by everything the build depends on, so versions with other sources keep
    a build each in one extensions folder instead of rebuilding each other's; a missing build is built
    (saying so on stderr first), a finished one imported without torch's build machinery."""
    sources, flags = [b"int a;", b"int b;", b"int c;"], cpu_kernels.CFLAGS + cpu_kernels.LDFLAGS
    args = ("cpu0", "2.13.0", "c++ 12", "abi0")
    key = cpu_kernels.build_key(sources, flags, *args)
    assert key == cpu_kernels.build_key(list(sources), flags, *args)
    others = [
        cpu_kernels.build_key([b"int a;", b"int b;", b"int c; "], flags, *args),
        # the same bytes, cut apart differently
        cpu_kernels.build_key([b"int a;int b;", b"", b"int c;"], flags, *args),
        cpu_kernels.build_key(sources, flags[:-1], *args),
        cpu_kernels.build_key(sources, flags, "cpu1", "2.13.0", "c++ 12", "abi0"),
        cpu_kernels.build_key(sources, flags, "cpu0", "2.14.0", "c++ 12", "abi0"),
        cpu_kernels.build_key(sources, flags, "cpu0", "2.13.0", "c++ 13", "abi0"),
        cpu_kernels.build_key(sources, flags, "cpu0", "2.13.0", "c++ 12", "abi1"),
    ]
    assert len({key, *others}) == 1 + len(others)
    # this version's name, and the name after one source file changes
    name = cpu_kernels.extension_name()
    edited = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.SOURCE_DIR, edited)
    (edited / "state_mix.cpp").write_text((edited / "state_mix.cpp").read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", edited)
    other = cpu_kernels.extension_name()
    assert other != name and other.startswith("titans_cpu_kernels_")
    # a header the sources include is part of the key too
    header, text = edited / cpu_kernels.HEADERS[0], (edited / cpu_kernels.HEADERS[0]).read_text()
    header.write_text(text + "\n// edited\n")
    assert cpu_kernels.extension_name() not in (name, other)
    header.write_text(text)
    assert cpu_kernels.extension_name() == other
    # two versions in one extensions folder: each finds its own build, and only a missing one is built; a
    # stand-in for torch's build writes an (empty) library where torch would, and one for the import
    # takes its place
    root = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.delenv("TITANS_CPU_KERNELS", raising=False)
    built, imported = [], []

    def fake_build(ext, name, folder):
        built.append(name)
        (folder / f"{name}{cpu_kernels.LIB_SUFFIX}").write_bytes(b"")
        return types.SimpleNamespace()

    def fake_import(name, path):
        imported.append(name)
        return name

    monkeypatch.setattr(cpu_kernels, "torch_build", fake_build)
    monkeypatch.setattr(cpu_kernels, "import_library", fake_import)
    capsys.readouterr()
    assert cpu_kernels.kernels.__wrapped__() is not None  # the edited sources: built
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", Path(cpu_kernels.__file__).with_name("csrc"))
    assert cpu_kernels.kernels.__wrapped__() is not None  # this version's: built beside it
    assert cpu_kernels.kernels.__wrapped__() == name  # found: imported, no build, no message
    messages = [line.split(" into ")[0] for line in capsys.readouterr().err.splitlines()]
    assert messages == [cpu_kernels.BUILD_MESSAGE] * 2
    assert built == [other, name] and imported == [name]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted([name, other])
    assert cpu_kernels.is_built(name, root) and cpu_kernels.is_built(other, root)


@pytest.mark.parametrize("kernel, seq, bias", [(4, 13, True), (1, 5, True), (3, 1, False), (4, 2, True)])
@pytest.mark.parametrize("block_rows", [None, 3, 1])
@pytest.mark.parametrize("split", [None, (2, 3)])
def test_causal_conv_silu_matches_conv1d(kernel, seq, bias, block_rows, split, conv_path, monkeypatch):
    """The (B, T, C) conv + SiLU with its recomputing backward == F.conv1d on (B, C, T) over [tail; x],
    values and grads (of x, the tail, weight and bias), on both paths: in one block of time rows and in
    blocks of 3 and 1 rows (torch ops: a last partial block, taps across block edges and into the tail;
    the kernel's backward: tasks of as many padded rows), sequences shorter than the tail, in the plain
    layout and written into the split (P, B, H, T, d) layout."""
    if block_rows is not None:
        monkeypatch.setattr("titans.ops.conv._BLOCK_ELEMENTS", block_rows * 2 * 12)  # batch 2 x 12 channels
        monkeypatch.setattr("titans.ops.conv._KERNEL_ROWS", block_rows)
    torch.manual_seed(0)
    channels = 12
    conv = torch.nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias).double()
    x = torch.randn(2, seq, channels, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(2, kernel - 1, channels, dtype=torch.float64, requires_grad=True)

    def fast(x, tail, w, b=None):
        out = causal_conv_silu(x, w, b, tail, split=split)
        if split is None:
            return out
        p, h = split
        assert out.shape == (p, 2, h, seq, channels // (p * h)) and out.is_contiguous()
        return out.permute(1, 3, 0, 2, 4).reshape(2, seq, channels)

    def ref(x, tail, w, b=None):
        return causal_conv_silu_ref(torch.cat([tail, x], 1), w, b)

    args = (x, tail, conv.weight, conv.bias)
    torch.testing.assert_close(fast(*args), ref(*args), rtol=1e-12, atol=1e-12)
    inputs = args if bias else args[:3]
    assert torch.autograd.gradcheck(fast, inputs)
    # no tail: a sequence start, the same as zeros before it
    torch.testing.assert_close(
        causal_conv_silu(x, conv.weight, conv.bias), ref(x, torch.zeros_like(tail), conv.weight, conv.bias)
    )


def test_causal_conv_silu_float32_paths_agree(conv_path):
    """float32 at the layer's shape class (many channels, rows across several tasks and blocks): each
    path against the float64 reference."""
    torch.manual_seed(1)
    x, tail = torch.randn(2, 150, 96, requires_grad=True), torch.randn(2, 3, 96, requires_grad=True)
    weight, bias = torch.randn(96, 1, 4, requires_grad=True), torch.randn(96, requires_grad=True)
    g = torch.randn(3, 2, 4, 150, 8)
    out = causal_conv_silu(x, weight, bias, tail, split=(3, 4))
    grads = torch.autograd.grad(out, (x, tail, weight, bias), g)
    leaves = [t.detach().double().requires_grad_() for t in (x, tail, weight, bias)]
    ref = causal_conv_silu_ref(torch.cat([leaves[1], leaves[0]], 1), leaves[2], leaves[3])
    ref_grads = torch.autograd.grad(ref, leaves, g.double().permute(1, 3, 0, 2, 4).reshape(2, 150, 96))
    torch.testing.assert_close(
        out.double().permute(1, 3, 0, 2, 4).reshape(2, 150, 96), ref, rtol=1e-5, atol=1e-5
    )
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_conv_kernel_weight_gradients_repeat_bit_for_bit_on_many_threads():
    """The kernel's backward sums the taps' and bias's gradients over tasks run on several threads: the
    per-thread sums are added in a fixed order, so a run repeats bit for bit (added as threads finished,
    3 or more threads gave other bits on most calls, and training runs with `--threads 4` drifted apart)."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU conv kernel could not be built here")
    torch.manual_seed(0)
    x, g = torch.randn(16, 250, 128), torch.randn(16, 250, 128)
    weight, bias = torch.randn(128, 1, 4, requires_grad=True), torch.randn(128, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        runs = [torch.autograd.grad(causal_conv_silu(x, weight, bias), (weight, bias), g) for _ in range(12)]
    finally:
        torch.set_num_threads(threads)
    for gw, gb in runs[1:]:
        assert torch.equal(gw, runs[0][0]) and torch.equal(gb, runs[0][1])


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv_silu_traces_to_one_graph(bias, monkeypatch):
    """Under torch.compile the conv traces whole (fullgraph) into the split layout at batch 3, where the
    layout's view is strided (an `out=` there is a graph break), in blocks of 2 rows, and equals F.conv1d."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, tail, weight = torch.randn(3, 5, 12), torch.randn(3, 3, 12), torch.randn(12, 1, 4)
    b = torch.randn(12) if bias else None
    monkeypatch.setattr("titans.ops.conv._BLOCK_ELEMENTS", 2 * 3 * 12)
    out = torch.compile(causal_conv_silu, backend="eager", fullgraph=True)(x, weight, b, tail, split=(3, 2))
    assert out.shape == (3, 3, 2, 5, 2) and out.is_contiguous()
    ref = causal_conv_silu_ref(torch.cat([tail, x], 1), weight, b)
    torch.testing.assert_close(out.permute(1, 3, 0, 2, 4).reshape(3, 5, 12), ref)


def test_causal_conv_silu_refuses_bad_tail_and_split():
    x, weight = torch.randn(2, 5, 12), torch.randn(12, 1, 4)
    with pytest.raises(ValueError, match="tail must be"):
        causal_conv_silu(x, weight, None, torch.zeros(2, 2, 12))
    with pytest.raises(ValueError, match="does not divide"):
        causal_conv_silu(x, weight, None, split=(3, 5))


def causality_check(fn, x: torch.Tensor, j: int) -> tuple[float, float]:
    """Perturb token j of x; return the largest change of fn's outputs before j (must be 0 for a causal
    fn) and from j on (must not be, or the perturbation did nothing)."""
    x2 = x.clone()
    x2[:, j] += torch.randn(x.shape[0], x.shape[2], generator=torch.Generator().manual_seed(j), dtype=x.dtype)
    y, y2 = fn(x), fn(x2)
    before = (y[:, :j] - y2[:, :j]).abs().max().item() if j else 0.0
    return before, (y[:, j:] - y2[:, j:]).abs().max().item()


def causal_memory() -> tuple[NeuralMemory, torch.Tensor]:
    torch.manual_seed(1)
    return NeuralMemory(16, heads=2, depth=2, chunk_size=8).double(), torch.randn(2, 32, 16, dtype=F64)


@pytest.mark.parametrize("j", [0, 5, 8, 13, 20, 31])
def test_causality(j):
    """Changing token j leaves every output before j unchanged (j at and inside chunks of 8)."""
    mem, x = causal_memory()
    before, after = causality_check(lambda x: mem(x)[0], x, j)
    assert before < 1e-12
    assert after > 1e-6  # the change does reach token j onwards


def read_chunk_by_chunk(mem: NeuralMemory, x: torch.Tensor, end_of_chunk: bool) -> torch.Tensor:
    """The memory's forward written out one chunk at a time (x: whole chunks, fresh state). Each chunk's
    tokens read the weights from before its write, as they must, or with `end_of_chunk` from after it:
    the classic leak, where a token sees the later tokens of its own chunk."""
    state = mem.initial_state(x.shape[0], dtype=x.dtype)
    q, k, v, _ = mem.project(x, state.conv_tail)
    theta, log_eta, log_keep = mem.gates(x).unbind(-1)
    w, s = state.weights, state.momentum
    opts = dict(activation=mem.activation, residual=mem.residual, surprise_clip=mem.surprise_clip)
    ys = []
    for start in range(0, x.shape[1], mem.chunk_size):
        c = slice(start, start + mem.chunk_size)
        w_start = w
        chunk = (t[:, :, c] for t in (q, k, v, theta, log_eta, log_keep))
        _, w, s, _ = neural_memory_chunked(*chunk, w, s, chunk_size=mem.chunk_size, **opts)
        ys.append(mem.read(q[:, :, c], w if end_of_chunk else w_start))
    return mem.combine_heads(torch.cat(ys, dim=2), x)


@pytest.mark.parametrize("j", [5, 13, 31])
def test_reading_end_of_chunk_weights_would_be_caught(j):
    """The causality check above must be able to fail: a memory that reads the weights at the END of its
    chunk lets an early token see later ones of the same chunk, and the check reports it; the same code
    reading chunk-start weights is the real memory, and passes."""
    mem, x = causal_memory()
    with torch.no_grad():
        right = partial(read_chunk_by_chunk, mem, end_of_chunk=False)
        assert_close_rel(right(x), mem(x)[0], 1e-12)  # the variant differs from ours in the read only
        leaky_before, _ = causality_check(partial(read_chunk_by_chunk, mem, end_of_chunk=True), x, j)
        real_before, real_after = causality_check(lambda x: mem(x)[0], x, j)
    assert leaky_before > 1e-6  # the leak shows
    assert real_before < 1e-12 and real_after > 1e-6


@pytest.mark.parametrize("splits", [[10, 21], [8, 16], [1, 2, 3], [5], [16, 17, 30]])
def test_state_continues_exactly(splits):
    torch.manual_seed(2)
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=8).double()
    x = torch.randn(2, 37, 16, dtype=F64)
    y_full, s_full = mem(x)
    ys, state = [], None
    for a, b in zip([0, *splits], [*splits, 37]):
        y, state = mem(x[:, a:b], state)
        ys.append(y)
    assert_close_rel(torch.cat(ys, 1), y_full, 1e-12)
    assert state.position == s_full.position == 37
    for a, b in zip(state.weights + state.momentum, s_full.weights + s_full.momentum):
        assert_close_rel(a, b, 1e-12)
    # not bit-equal: MKL's float64 matmul rounds a row differently with the number of rows in the call
    assert_close_rel(state.pending_k, s_full.pending_k, 1e-12)
    assert torch.allclose(state.conv_tail, s_full.conv_tail)


def test_state_detach_and_map():
    mem = NeuralMemory(8, heads=2, depth=2, chunk_size=4)
    x = torch.randn(1, 6, 8, requires_grad=True)
    _, state = mem(x)
    assert state.weights[0].requires_grad
    d = state.detach()
    assert not any(t.requires_grad for t in d.weights + d.momentum)
    assert d.position == 6 and isinstance(d, MemoryState)


def write_and_recall(keys, values, depth, expansion, epochs=4, theta=0.5, chunk=1, seed=0):
    """Write k_i -> v_i into a fresh memory (no outer training); return recall MSE before and after."""
    torch.manual_seed(seed)
    n, d = keys.shape
    sizes = [d] + [max(1, int(d * expansion))] * (depth - 1) + [d]
    w = tuple(
        torch.randn(1, 1, sizes[i], sizes[i + 1], dtype=F64) / math.sqrt(sizes[i]) for i in range(depth)
    )
    s = tuple(torch.zeros_like(x) for x in w)
    k = keys[None, None].repeat(1, 1, epochs, 1)
    v = values[None, None].repeat(1, 1, epochs, 1)
    total = k.shape[2]
    gates = (
        torch.full((1, 1, total), theta, dtype=F64),
        torch.full((1, 1, total), math.log(0.5), dtype=F64),
        torch.zeros(1, 1, total, dtype=F64),
    )
    before = (memory_forward(keys[None, None], w, "silu", False) - values).pow(2).sum(-1).mean()
    _, w_end, _, _ = neural_memory_chunked(k, k, v, *gates, w, s, chunk_size=chunk)
    after = (memory_forward(keys[None, None], w_end, "silu", False) - values).pow(2).sum(-1).mean()
    return before.item(), after.item()


@pytest.mark.parametrize("depth", [1, 2])
def test_memory_memorizes_at_test_time(depth):
    """With no outer training, written random associations are recalled far better than by an empty memory."""
    g = torch.Generator().manual_seed(0)
    d, n = 32, 16
    keys = F.normalize(torch.randn(n, d, generator=g, dtype=F64), dim=-1)
    values = torch.randn(n, d, generator=g, dtype=F64)
    before, after = write_and_recall(
        keys, values, depth, expansion=4, epochs=8, theta=0.05 if depth > 1 else 0.25
    )
    assert after < 0.05 * before, (before, after)


def test_long_stream_stays_finite():
    torch.manual_seed(0)
    mem = NeuralMemory(32, heads=2, depth=2, chunk_size=64)
    with torch.no_grad():
        y, state = mem(torch.randn(1, 8192, 32) * 3)
    assert torch.isfinite(y).all() and all(torch.isfinite(w).all() for w in state.weights)


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_raise_clear_errors():
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=8)
    with pytest.raises(ValueError, match="last dim is 12"):
        mem(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r"\(batch, seq, dim\)"):
        mem(torch.randn(5, 16))
    with pytest.raises(TypeError, match="floating point"):
        mem(torch.ones(2, 5, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one sequence"):  # a reshape error deep in the op
        mem(torch.randn(0, 5, 16))
    other = NeuralMemory(16, heads=4, depth=2, chunk_size=8)
    _, state = other(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="does not match this memory"):
        mem(torch.randn(2, 5, 16), state)
    _, state = mem(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="does not match"):
        mem(torch.randn(3, 5, 16), state)
    small_chunk = NeuralMemory(16, heads=2, depth=2, chunk_size=4)
    with pytest.raises(ValueError, match="chunk size"):
        small_chunk(torch.randn(2, 5, 16), state)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_input_of_another_dtype_is_refused_by_name(dtype):
    """A float32 memory fed float64 / bf16 / half input (outside autocast): a TypeError naming both dtypes,
    not a matmul's 'expected m1 and m2 to have the same dtype'. Autocast still takes any of them."""
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=4)
    x = torch.randn(2, 9, 16).to(dtype)
    with pytest.raises(TypeError, match=rf"input dtype {dtype} does not match .*torch.float32.*autocast"):
        mem(x)
    if dtype != torch.float64:  # autocast leaves float64 alone (its matmuls would meet float32 weights)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, state = mem(x)
        assert torch.isfinite(y).all() and state.weights[0].dtype == torch.float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused_with_its_place(bad):
    """One NaN or inf in the input would make the memory's weights, and every later output, non-finite:
    refused with the batch row and the absolute position (the state's position counted)."""
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=4)
    _, state = mem(torch.randn(2, 7, 16))
    x = torch.randn(2, 9, 16)
    x[1, 6, 3] = bad
    with pytest.raises(ValueError, match=r"non-finite value \((nan|inf|-inf)\) at batch 1, position 13"):
        mem(x, state)


def test_empty_input_gives_empty_output_and_the_state_unchanged():
    """Zero tokens: an empty (B, 0, dim) output; no state in, the initial state out; a state in, the same
    state out (pending tokens and conv tail included); stats of zero length."""
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=4)
    y, state, stats = with_stats(mem.forward_with_stats(torch.randn(3, 0, 16)))
    assert y.shape == (3, 0, 16) and stats.surprise.shape == (3, 2, 0)
    fresh = mem.initial_state(3)
    assert state.position == 0 and all(torch.equal(a, b) for a, b in zip(state.weights, fresh.weights))
    _, state = mem(torch.randn(3, 6, 16))
    y, after = mem(torch.randn(3, 0, 16), state)
    assert y.shape == (3, 0, 16) and after is state


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"depth": 0}, "depth"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"activation": "tanh"}, "activation"),
        ({"eta_init": 1.5}, "eta_init"),
        ({"impl": "cuda"}, "impl"),
        ({"heads": -1}, "heads"),
        ({"heads": 0}, "heads"),  # dim // heads: a ZeroDivisionError
        ({"head_dim": 0}, "head_dim"),  # read as null: the width dim / heads
        ({"surprise_clip": -1.0}, "surprise_clip"),  # the memory raised its own loss
        ({"surprise_clip": float("nan")}, "surprise_clip"),  # NaN weights
        ({"max_lr": 0.0}, "max_lr"),  # a ZeroDivisionError
        ({"expansion": float("nan")}, "expansion"),
        ({"expansion": "2"}, "expansion"),  # a TypeError comparing str and int
        ({"conv_kernel": 2.5}, "conv_kernel"),  # a TypeError inside torch.empty
        ({"conv_kernel": "4"}, "conv_kernel"),
        # a string "false" is truthy: the switch was silently on (an ablation that was not one)
        ({"write": "false"}, "write"),
        ({"momentum": "false"}, "momentum"),
        ({"forgetting": "false"}, "forgetting"),
        ({"residual": "false"}, "residual"),
        ({"qk_norm": "false"}, "qk_norm"),
        ({"output_gate": "false"}, "output_gate"),
        ({"learned_init": "false"}, "learned_init"),
    ],
)
def test_bad_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NeuralMemory(16, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [  # it reported theta_init / max_lr and the theta rule for all three
        ({"theta_init": 0.05}, r"theta_init must lie in \(0, max_lr=0.03\), got 0.05"),
        ({"eta_init": 1.0}, r"eta_init must lie in \(0, 1\), got 1.0$"),
        ({"alpha_init": 0.0}, r"alpha_init must lie in \(0, 1\), got 0.0$"),
    ],
)
def test_a_gate_start_out_of_range_is_reported_as_given(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NeuralMemory(16, heads=2, **kwargs)


def test_project_without_a_conv_tail_starts_from_zeros():
    """`project(x, None)` (its type allows it) failed on `None.to`: it reads x after zero rows, as the
    start of a sequence does."""
    mem = NeuralMemory(16, heads=2).double()
    x = torch.randn(2, 5, 16, dtype=F64)
    zeros = mem.initial_state(2, dtype=F64).conv_tail
    for a, b in zip(mem.project(x, None), mem.project(x, zeros)):
        assert torch.equal(a, b)


def test_a_state_of_another_dtype_is_refused_by_name():
    """A float32 memory's state given to the same memory in float64 (and back): a TypeError naming both, not
    a matmul's "expected scalar type Float but found Double" from inside the op."""
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=4)
    _, state = mem(torch.randn(2, 7, 16))
    mem.double()
    with pytest.raises(TypeError, match=r"state weights are torch.float32 .* this memory's torch.float64"):
        mem(torch.randn(2, 5, 16, dtype=torch.float64), state)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation": "tanh"}, "activation must be one of"),  # ran relu forward, silu' backward
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),  # a ZeroDivisionError
        ({"chunk_size": 2.0}, "chunk_size must be a positive integer"),
        ({"surprise_clip": -1.0}, "surprise_clip must be None or a finite number > 0"),
        ({"k": 5}, r"q, k, v and gates must agree on \(B, H, T\)"),
    ],
)
@pytest.mark.parametrize("rule", ["titans", "moneta"])
def test_the_op_entry_point_refuses_bad_arguments(change, message, rule):
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    change = dict(change)  # shared by both rules' cases
    if "k" in change:
        k = k[:, :, : change.pop("k")]
    gates = torch.rand(1, 2, 8, 3 + len(resolve_rule(rule).extra_gates))
    weights = tuple(torch.zeros(1, 2, 4, 4) for _ in range(1))
    options = {"chunk_size": 4, "rule": rule, **change}
    with pytest.raises(ValueError, match=message):
        neural_memory(q, k, v, gates, weights, weights, **options)


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_cpu_bf16_autocast_matches_float32(activation):
    """Under bf16 autocast the projections run in bf16 and the memory in its float32 state dtype (mixed
    dtypes once broke the chunk step's in-place updates, forward and backward)."""
    torch.manual_seed(0)
    mem = NeuralMemory(64, heads=2, depth=2, chunk_size=16, activation=activation)
    x = torch.randn(2, 100, 64, requires_grad=True)
    y32, _ = mem(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16, state = mem(x)
        y16.float().sum().backward()
    assert state.weights[0].dtype == torch.float32
    assert torch.isfinite(y16).all() and torch.isfinite(x.grad).all()
    assert (y16.float() - y32).abs().max() < 0.1 * y32.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_matches_float32():
    torch.manual_seed(0)
    mem = NeuralMemory(64, heads=2, depth=2, chunk_size=16).cuda()
    x = torch.randn(2, 100, 64, device="cuda")
    y32, _ = mem(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y16, _ = mem(x)
    assert torch.isfinite(y16).all()
    assert (y16.float() - y32).abs().max() < 0.1 * y32.abs().max()


# ------------------------------------------------------------------- float64 layer from the equations
def layer_from_equations(mem: NeuralMemory, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The whole `NeuralMemory` layer (depth 2, silu, conv, qk norm, momentum, forgetting, surprise clip,
    output gate) computed token by token from its equations, in x's dtype, with none of the library's
    helpers: projection, causal depthwise conv + silu, l2 norm, gates, the chunk-start-weights recurrence,
    output norm, gate and projection. x: (B, T, dim) -> (y (B, T, dim), final weights [W1, W2], each
    (B, H, d_in, d_out))."""
    b, t, _ = x.shape
    h, d, size = mem.heads, mem.head_dim, mem.chunk_size
    kern = mem.conv_kernel
    qkv = x @ mem.to_qkv.weight.T  # (B, T, 3 H d)
    padded = torch.cat([qkv.new_zeros(b, kern - 1, qkv.shape[-1]), qkv], 1)
    taps = mem.conv.weight[:, 0]  # (C, K): tap j reads row t - (K - 1) + j
    pre = mem.conv.bias + sum(padded[:, j : j + t] * taps[:, j] for j in range(kern))
    act = pre * torch.sigmoid(pre)
    q, k, v = act.view(b, t, 3, h, d).unbind(2)  # (B, T, H, d) each
    q = q / q.pow(2).sum(-1, keepdim=True).sqrt()
    k = k / k.pow(2).sum(-1, keepdim=True).sqrt()
    logits = (x @ mem.to_gates.weight.T + mem.to_gates.bias).view(b, t, 3, h)
    theta = mem.max_lr * torch.sigmoid(logits[:, :, 0])  # (B, T, H)
    eta = torch.sigmoid(logits[:, :, 1])
    keep = 1 - torch.sigmoid(logits[:, :, 2])

    def mlp(inp, w1, w2):  # inp (B, H, d) -> output, hidden pre-activation, hidden activation
        z = torch.einsum("bhi,bhij->bhj", inp, w1)
        a = z * torch.sigmoid(z)
        return torch.einsum("bhi,bhij->bhj", a, w2), z, a

    w1, w2 = (w.unsqueeze(0).expand(b, *w.shape) for w in mem.init_weights)
    s1, s2 = torch.zeros_like(w1), torch.zeros_like(w2)
    reads = []
    for start in range(0, t, size):
        c1, c2 = w1, w2  # every token of a chunk reads, and takes its surprise at, the chunk-start weights
        for i in range(start, min(start + size, t)):
            reads.append(mlp(q[:, i], c1, c2)[0])
            out, z, a = mlp(k[:, i], c1, c2)
            err = 2 * (out - v[:, i])  # d ||M(k) - v||^2 / d M(k)
            sig = torch.sigmoid(z)
            back = torch.einsum("bhj,bhij->bhi", err, c2) * sig * (1 + z * (1 - sig))  # through silu
            u1 = torch.einsum("bhi,bhj->bhij", k[:, i], back)
            u2 = torch.einsum("bhi,bhj->bhij", a, err)
            norm = (u1.pow(2).sum((-1, -2)) + u2.pow(2).sum((-1, -2))).sqrt()
            scale = torch.clamp(mem.surprise_clip / norm, max=1.0)[..., None, None]
            if start + size <= t:  # only complete chunks are written
                th, et, kp = (g[:, i, :, None, None] for g in (theta, eta, keep))
                s1, s2 = et * s1 - th * scale * u1, et * s2 - th * scale * u2
                w1, w2 = kp * w1 + s1, kp * w2 + s2
    y = torch.stack(reads, 2)  # (B, H, T, d)
    y = y / (y.pow(2).mean(-1, keepdim=True) + torch.finfo(y.dtype).eps).sqrt() * mem.norm.weight
    y = y.transpose(1, 2).reshape(b, t, h * d) * torch.sigmoid(x @ mem.to_gate.weight.T)
    return y @ mem.to_out.weight.T, [w1, w2]


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_float64_layer_matches_its_equations(impl):
    """A float64 `NeuralMemory` (gates included: they once ran in float32 whatever the module's dtype) against
    the layer computed from its equations token by token in float64: outputs, final weights and gradients
    of the input and every parameter, to 1e-10. Awkward sizes: 37 tokens in chunks of 8, 3 heads of 8."""
    torch.manual_seed(0)
    mem = NeuralMemory(24, heads=3, chunk_size=8, max_lr=0.3, surprise_clip=0.5, impl=impl).double()
    with torch.no_grad():  # gates that differ per token and head; a conv bias that is not ~0
        mem.to_gates.weight.normal_(0, 0.3)
        mem.conv.bias.normal_(0, 0.3)
    x = torch.randn(2, 37, 24, dtype=F64, requires_grad=True)
    y, state = mem(x)
    y_ref, w_ref = layer_from_equations(mem, x)
    assert_close_rel(y, y_ref, 1e-10)
    for a, b in zip(state.weights, w_ref):
        assert_close_rel(a, b, 1e-10)
    probe = torch.randn_like(y)
    params = [x, *mem.parameters()]
    grads = torch.autograd.grad((y * probe).sum() + state.weights[1].sum(), params)
    ref_grads = torch.autograd.grad((y_ref * probe).sum() + w_ref[1].sum(), params)
    names = ["input"] + [n for n, _ in mem.named_parameters()]
    for name, a, b in zip(names, grads, ref_grads):
        assert b.abs().sum() > 0, f"zero gradient for {name}"
        assert (a - b).abs().max() <= 1e-10 * b.abs().max().clamp_min(1.0), name


# ------------------------------------------------------------------------ large inputs: no NaN, no inf
EXTREMES = [-1e4, -1e3, -710.0, -1e2, -88.8, -88.7, -88.0, -20.0, 0.0, 20.0, 88.8, 1e2, 710.0, 1e4]


def conv_on_both_paths(monkeypatch, fn):
    """fn() on the compiled kernel, then on the torch-op path: (kernel result, torch-op result)."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU conv kernel could not be built here")
    kernel = fn()
    with monkeypatch.context() as m:
        m.setattr("titans.ops.conv.kernels", lambda: None)
        return kernel, fn()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_conv_silu_extreme_pre_activations_are_finite_on_both_paths(dtype, monkeypatch):
    """Pre-activations far below the point where exp(-z) overflows (about -88.7 in float32, -709.8 in
    float64) and far above it, across enough channels for the kernel's vectorised loops: both paths finite
    and equal, forward and backward (the kernel, built with -ffast-math, once gave NaN there, and its
    backward spread the NaN to the K - 1 rows before)."""
    torch.manual_seed(0)
    values = torch.tensor(EXTREMES, dtype=dtype)
    channels = 96  # in the (3, 2) split: heads of 16 channels, the kernel's vectorised inner loop
    # the last tap 1, the others small: the pre-activation is the extreme value plus a little of the rows
    # before, so every row's gradient gathers from rows with extreme pre-activations
    x = values.repeat_interleave(3).view(1, -1, 1).expand(2, -1, channels).contiguous()
    x = x * (1 + 0.01 * torch.rand(x.shape, dtype=dtype))
    weight = torch.ones(channels, 1, 4, dtype=dtype)
    weight[..., :3] = 0.01 * torch.randn(channels, 1, 3, dtype=dtype)
    bias = torch.zeros(channels, dtype=dtype)
    g = torch.randn(3, 2, 2, x.shape[1], 16, dtype=dtype)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        out = causal_conv_silu(*leaves, split=(3, 2))
        return [out.detach(), *torch.autograd.grad(out, leaves, g)]

    kernel, torch_ops = conv_on_both_paths(monkeypatch, run)
    leaves = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = causal_conv_silu_ref(F.pad(leaves[0], (0, 0, 3, 0)), leaves[1], leaves[2])
    g_ref = g.double().permute(1, 3, 0, 2, 4).reshape(ref.shape)
    ref = [
        ref.detach().view(2, -1, 3, 2, 16).permute(2, 0, 3, 1, 4),
        *torch.autograd.grad(ref, leaves, g_ref),
    ]
    for name, a, b, r in zip(["output", "input grad", "weight grad", "bias grad"], kernel, torch_ops, ref):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        # outputs elementwise (down to the float32 underflow); gradients are sums of products of mixed sizes,
        # their rounding scales with the largest
        atol = 1e-30 if name == "output" else 1e-6 * r.abs().max().item()
        for got, want in ((a, b), (a.double(), r)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=partial("{}: {}".format, name))


def test_memory_at_large_input_scale_is_finite_on_both_conv_paths(monkeypatch):
    """A `NeuralMemory` fed inputs at 100x scale (conv pre-activations of several hundred): finite outputs,
    state and gradients, the same with the kernel and with the torch ops."""
    torch.manual_seed(0)
    mem = NeuralMemory(32, heads=2, chunk_size=8)
    x = 100 * torch.randn(2, 29, 32)

    def run():
        y, state = mem(x)
        return [y.detach(), *state.weights, *torch.autograd.grad(y.square().mean(), list(mem.parameters()))]

    kernel, torch_ops = conv_on_both_paths(monkeypatch, run)
    for a, b in zip(kernel, torch_ops):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- frozen memory (write=False)
@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_frozen_memory_state_is_bit_identical_after_any_input(impl):
    """write=False: weights and momentum come back bit-identical whatever the input, from a fresh state and
    from one a writing memory left (non-zero momentum, pending tokens), over a long stream in pieces and
    at large input scale. (The switch once only zeroed theta: the
    forgetting still decayed the weights, to 1e-9 of their start over 2,000 tokens.)"""
    torch.manual_seed(0)
    writer = NeuralMemory(24, heads=3, chunk_size=8, max_lr=0.3, impl=impl)
    frozen = copy.deepcopy(writer)
    frozen.write = False
    _, written = writer(torch.randn(2, 21, 24))  # 2 chunks written, 5 tokens pending
    assert written.momentum[0].abs().sum() > 0 and written.pending_k.shape[2] == 5
    lengths = [1, 7, 37] if impl == "reference" else [1, 7, 37, 500, 1455]
    for start in (None, written):
        state = start
        for i, n in enumerate(lengths):
            x = torch.randn(2, n, 24) * (100 if i % 2 else 1)
            y, state, stats = with_stats(frozen.forward_with_stats(x, state))
            assert torch.isfinite(y).all()
        before = start or frozen.initial_state(2)
        for a, b in zip(state.weights + state.momentum, before.weights + before.momentum):
            assert torch.equal(a, b)
        assert state.position == before.position + sum(lengths)
        assert (stats.theta == 0).all() and (stats.alpha == 0).all() and (stats.eta == 1).all()


def test_frozen_memory_reads_the_state_weights():
    """A frozen memory's output at every position is the read of the starting weights: the same as a
    writing memory's over its first chunk (which reads the chunk-start weights), for a chunk as long as
    the sequence."""
    torch.manual_seed(1)
    frozen = NeuralMemory(24, heads=3, chunk_size=4, write=False).double()
    one_chunk = copy.deepcopy(frozen)
    one_chunk.write, one_chunk.chunk_size = True, 64
    x = torch.randn(2, 40, 24, dtype=F64)
    torch.testing.assert_close(frozen(x)[0], one_chunk(x)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("entry", ["neural_memory", "neural_memory_chunked"])
def test_half_gates_give_float32_coefficients(half, entry):
    """float16 / bfloat16 gates with a float32 state: the chunk coefficients (cumulative sums of log-gates
    and their exps) are computed in float32, not in the gates' dtype, so the outputs agree with the
    float64 reference on the same rounded gates to float32 accuracy (in bf16 they were 2e-3 off), and the
    gates' gradients come back in their dtype."""
    args, w, s = random_problem(1, 2, 34, 6, 2, seed=5)
    gates = torch.stack(args[3:], -1).to(half)
    ref = neural_memory_ref(*args[:3], *gates.double().unbind(-1), w, s, chunk_size=16)
    q, k, v = (x.float() for x in args[:3])
    w32, s32 = tuple(x.float() for x in w), tuple(x.float() for x in s)
    leaf = gates.clone().requires_grad_(True)
    if entry == "neural_memory":
        out = neural_memory(q, k, v, leaf, w32, s32, chunk_size=16)
    else:
        out = neural_memory_chunked(q, k, v, *leaf.unbind(-1), w32, s32, chunk_size=16)
    for a, b in zip([out[0], *out[1], *out[2], out[3]], [ref[0], *ref[1], *ref[2], ref[3]]):
        assert a.dtype == torch.float32
        assert_close_rel(a.double(), b, 1e-5)
    (out[0].sum() + out[1][0].sum()).backward()
    assert leaf.grad.dtype == half and torch.isfinite(leaf.grad).all()


def test_float32_gates_with_a_float64_state_compute_in_float64():
    """The torch path computes in its state's dtype: with float32 gates and a float64 state the chunk
    coefficients are float64 too (they were float32, 1e-7 off the reference)."""
    args, w, s = random_problem(1, 2, 21, 5, 2, seed=2)
    gates = [x.float() for x in args[3:]]
    fast = neural_memory_chunked(*args[:3], *gates, w, s, chunk_size=4)
    ref = neural_memory_ref(*args[:3], *(g.double() for g in gates), w, s, chunk_size=4)
    for a, b in zip([fast[0], *fast[1], *fast[2], fast[3]], [ref[0], *ref[1], *ref[2], ref[3]]):
        assert a.dtype == F64
        assert_close_rel(a, b, 1e-10)


def test_float32_inputs_with_a_float64_state_run_in_float64():
    """neural_memory_chunked casts q, k, v to the state's dtype (as neural_memory and the Triton path take
    them): float32 q, k, v with a float64 state run in float64 (they raised "expected scalar type Float but
    found Double"), the gradients coming back in float32."""
    args, w, s = random_problem(1, 2, 11, 5, 2, seed=4)
    qkv = [x.float().requires_grad_(True) for x in args[:3]]
    for options in ({}, {"checkpoint_every": 1}):
        out = neural_memory_chunked(*qkv, *args[3:], w, s, chunk_size=4, **options)
        ref = neural_memory_chunked(*(x.detach().double() for x in qkv), *args[3:], w, s, chunk_size=4)
        for a, b in zip([out[0], *out[1], *out[2], out[3]], [ref[0], *ref[1], *ref[2], ref[3]]):
            assert a.dtype == F64
            assert_close_rel(a, b, 1e-12)
        grads = torch.autograd.grad(out[0].sum() + out[3].sum(), qkv)
        assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_every_entry_point_names_a_bad_chunk_size(bad):
    """chunk_size is checked by every entry point, naming the function (neural_memory_chunked raised a bare
    ZeroDivisionError for 0)."""
    args, w, s = random_problem(1, 1, 4, 5, 1)
    gates = torch.stack(args[3:], -1)
    calls = {
        "neural_memory_chunked": lambda: neural_memory_chunked(*args, w, s, chunk_size=bad),
        "neural_memory_triton": lambda: neural_memory_triton(*args, w, s, chunk_size=bad),
        "memory_rule_chunked": lambda: memory_rule_chunked(
            *args[:3], gates, w, s, rule=resolve_rule("titans"), chunk_size=bad
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name}: chunk_size must be a positive integer"):
            call()


@pytest.mark.parametrize("rule", ["titans", "moneta"])
def test_the_op_entry_point_names_a_state_of_two_dtypes(rule):
    """float64 weights with float32 momentum failed inside a matmul of the chunk step."""
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    gates = torch.rand(1, 2, 8, 3 + len(resolve_rule(rule).extra_gates), dtype=torch.float64)
    weights = (torch.zeros(1, 2, 4, 4, dtype=torch.float64),)
    with pytest.raises(TypeError, match=r"share one dtype.*momentum\[0\] torch.float32"):
        neural_memory(q, k, v, gates, weights, (weights[0].float(),), chunk_size=4, rule=rule)
