"""Surprise-gated writes: a token whose surprise is below `surprise_threshold` adds nothing to the momentum.

Checked exactly: threshold 0 is the ungated memory bit for bit; a threshold above every surprise leaves
only the momentum decay and the forgetting (against a direct loop); the chunked path equals the float64
reference (outputs, state, surprise, gradients) with the threshold in the middle of the distribution, at
awkward sizes; streaming equals one pass.
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_memory import assert_close_rel, random_problem
from titans import NeuralMemory
from titans.models import TitansConfig, TitansLM
from titans.ops.memory import neural_memory_chunked, neural_memory_ref

F64 = torch.float64


def _flat(out):
    y, w, s, surprise = out
    return [y, *w, *s, surprise]


def _median_threshold(args, w, s, chunk, **kw) -> float:
    """A threshold in the middle of the ungated run's surprises, halfway between two of them (so no
    surprise sits on it)."""
    surprise = neural_memory_chunked(*args, w, s, chunk_size=chunk, **kw)[3].flatten().sort().values
    mid = surprise.numel() // 2
    return float((surprise[mid - 1] + surprise[mid]) / 2)


@pytest.mark.parametrize("depth,chunk,seq", [(1, 7, 30), (2, 5, 23), (3, 16, 40)])
def test_threshold_zero_is_the_ungated_memory_bitwise(depth, chunk, seq):
    args, w, s = random_problem(2, 3, seq, 5, depth, seed=seq)
    args = [a.requires_grad_() for a in args]
    off = neural_memory_chunked(*args, w, s, chunk_size=chunk, surprise_clip=0.5)
    zero = neural_memory_chunked(*args, w, s, chunk_size=chunk, surprise_clip=0.5, surprise_threshold=0.0)
    for a, b in zip(_flat(off), _flat(zero)):
        assert torch.equal(a, b)
    loss_off = sum((t * (i + 1)).sum() for i, t in enumerate(_flat(off)[:-1]))
    loss_zero = sum((t * (i + 1)).sum() for i, t in enumerate(_flat(zero)[:-1]))
    for a, b in zip(torch.autograd.grad(loss_off, args), torch.autograd.grad(loss_zero, args)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_threshold_above_every_surprise_leaves_decay_and_forgetting_only(impl):
    """No token written: per token S_t = eta_t S_{t-1}, W_t = (1 - alpha_t) W_{t-1} + S_t (complete chunks
    only), written out as a plain loop."""
    chunk, seq = 6, 27
    args, w, s = random_problem(2, 2, seq, 4, 2, seed=11)
    fn = neural_memory_chunked if impl == "chunked" else neural_memory_ref
    y, w_end, s_end, surprise = fn(*args, w, s, chunk_size=chunk, surprise_threshold=1e6)
    assert surprise.max() < 1e6
    _, _, _, _, log_eta, log_keep = args
    eta, keep = log_eta.exp(), log_keep.exp()
    w_ref, s_ref = [x.clone() for x in w], [x.clone() for x in s]
    for t in range(seq // chunk * chunk):
        e, k = eta[:, :, t, None, None], keep[:, :, t, None, None]
        s_ref = [e * x for x in s_ref]
        w_ref = [k * a + b for a, b in zip(w_ref, s_ref)]
    for a, b in zip(w_end + s_end, w_ref + s_ref):
        assert_close_rel(a, b, 1e-12)
    # and the reads: every chunk reads its start weights, which the decay alone produced
    ungated_reads = fn(*args, w, s, chunk_size=chunk)[0]
    assert torch.equal(y[:, :, :chunk], ungated_reads[:, :, :chunk])  # the first chunk reads W_0 either way
    assert not torch.allclose(y[:, :, chunk:], ungated_reads[:, :, chunk:])


@pytest.mark.parametrize(
    "depth,chunk,seq,options",
    [(1, 7, 31, {}), (2, 5, 23, {"surprise_clip": 0.4}), (3, 16, 37, {"residual": True}), (2, 1, 9, {})],
)
def test_chunked_equals_reference_with_threshold_mid_distribution(depth, chunk, seq, options):
    args, w, s = random_problem(2, 3, seq, 4, depth, seed=depth * 10 + chunk)
    tau = _median_threshold(args, w, s, chunk, **options)
    fast = neural_memory_chunked(*args, w, s, chunk_size=chunk, surprise_threshold=tau, **options)
    ref = neural_memory_ref(*args, w, s, chunk_size=chunk, surprise_threshold=tau, **options)
    for a, b in zip(_flat(fast), _flat(ref)):
        assert_close_rel(a, b, 1e-10)
    written = (fast[3] >= tau).double().mean()
    assert 0.2 < written < 0.8  # the gate really splits the tokens
    ungated = neural_memory_chunked(*args, w, s, chunk_size=chunk, **options)
    assert not torch.allclose(fast[1][0], ungated[1][0])


@pytest.mark.parametrize("depth,chunk,seq", [(1, 7, 15), (2, 5, 23), (2, 16, 37)])
def test_module_gradients_match_reference_with_threshold(depth, chunk, seq):
    torch.manual_seed(depth + chunk)
    fast = NeuralMemory(12, heads=2, head_dim=5, depth=depth, expansion=2, chunk_size=chunk, max_lr=0.3)
    fast = fast.double()
    with torch.no_grad():
        fast.to_gates.weight.normal_(0, 0.3)
    x = torch.randn(2, seq, 12, dtype=F64, requires_grad=True)
    with torch.no_grad():
        surprise = fast.forward_with_stats(x).stats.surprise.flatten().sort().values
    mid = surprise.numel() // 2
    fast.surprise_threshold = float((surprise[mid - 1] + surprise[mid]) / 2)
    # some written tokens are clipped too; midway between two tokens' surprise, as the threshold: a clip
    # equal to a token's norm sits on the kink of min(clip / norm, 1), whose side the last bit decides
    high = int(surprise.numel() * 0.8)
    fast.surprise_clip = float((surprise[high - 1] + surprise[high]) / 2)
    ref = copy.deepcopy(fast)
    ref.impl = "reference"
    out_f, out_r = fast.forward_with_stats(x), ref.forward_with_stats(x)
    assert 0 < out_f.write_rate < 1
    assert torch.equal(out_f.stats.written, out_r.stats.written)
    assert_close_rel(out_f.output, out_r.output, 1e-10)
    for a, b in zip(out_f.state.weights + out_f.state.momentum, out_r.state.weights + out_r.state.momentum):
        assert_close_rel(a, b, 1e-10)
    g = torch.randn_like(out_f.output)
    params_f, params_r = [x, *fast.parameters()], [x, *ref.parameters()]
    grads_f = torch.autograd.grad((out_f.output * g).sum() + out_f.state.weights[0].sum(), params_f)
    grads_r = torch.autograd.grad((out_r.output * g).sum() + out_r.state.weights[0].sum(), params_r)
    for a, b in zip(grads_f, grads_r):
        assert a.abs().sum() > 0
        assert_close_rel(a, b, 1e-9)


@pytest.mark.parametrize("splits", [[3, 10, 22], [8, 16], [1, 2, 30]])
def test_streaming_with_threshold_equals_one_pass(splits):
    torch.manual_seed(5)
    mem = NeuralMemory(16, heads=2, depth=2, chunk_size=8, surprise_threshold=None).double()
    x = torch.randn(2, 37, 16, dtype=F64)
    with torch.no_grad():
        surprise = mem.forward_with_stats(x).stats.surprise.flatten().sort().values
    mid = surprise.numel() // 2
    mem.surprise_threshold = float((surprise[mid - 1] + surprise[mid]) / 2)
    whole = mem.forward_with_stats(x)
    ys, written, state = [], [], None
    for a, b in zip([0, *splits], [*splits, 37]):
        out = mem.forward_with_stats(x[:, a:b], state)
        ys.append(out.output)
        written.append(out.stats.written)
        state = out.state
    assert_close_rel(torch.cat(ys, 1), whole.output, 1e-12)
    assert torch.equal(torch.cat(written, 2), whole.stats.written)
    for a, b in zip(state.weights + state.momentum, whole.state.weights + whole.state.momentum):
        assert_close_rel(a, b, 1e-12)


def test_lm_reports_write_rate_and_frozen_memory_writes_nothing():
    cfg = TitansConfig.preset("tiny", variant="mag", vocab_size=64, dim=32, heads=2, window=16, chunk_size=4)
    tokens = torch.randint(0, 64, (2, 21))
    torch.manual_seed(0)
    model = TitansLM(cfg).eval()
    assert model.forward_with_stats(tokens).write_rate == 1.0
    for block in model.blocks:
        block.memory.surprise_threshold = 1e9
    assert model.forward_with_stats(tokens).write_rate == 0.0
    for block in model.blocks:
        block.memory.surprise_threshold = None
        block.memory.write = False
    assert model.forward_with_stats(tokens).write_rate == 0.0
    gated = TitansLM(TitansConfig(**{**cfg.to_dict(), "memory_surprise_threshold": 0.25}))
    assert all(b.memory.surprise_threshold == 0.25 for b in gated.blocks)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "1", True])
def test_bad_threshold_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="surprise_threshold"):
        NeuralMemory(8, heads=2, surprise_threshold=bad)
    with pytest.raises(ValueError, match="memory_surprise_threshold"):
        TitansConfig(memory_surprise_threshold=bad)


def test_checkpointed_chunks_keep_the_write_decisions():
    """Activation checkpointing recomputes each group's forward: the same decisions, outputs, gradients."""
    args, w, s = random_problem(2, 2, 37, 4, 2, seed=21)
    tau = _median_threshold(args, w, s, 5)
    results = []
    for every in (None, 2):
        leaves = [a.clone().requires_grad_() for a in args]
        out = neural_memory_chunked(
            *leaves, w, s, chunk_size=5, surprise_threshold=tau, checkpoint_every=every
        )
        loss = sum((t * (i + 1)).sum() for i, t in enumerate(_flat(out)[:-1]))
        results.append((_flat(out), torch.autograd.grad(loss, leaves)))
    for a, b in zip(results[0][0] + list(results[0][1]), results[1][0] + list(results[1][1])):
        assert_close_rel(a, b, 1e-12)
