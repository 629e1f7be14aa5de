"""Memory rules with surprise-gated writes, and the Triton backend's refusal of both.

Every rule composes with `surprise_threshold` (the rule's own surprise decides, the 0/1 factor goes into the
per-token write scale): the chunked op equals the float64 per-token reference with the threshold in the
middle of the surprises, on the fast path and on the autograd op; the layer's `written` stats are the
comparison on its surprise and streaming equals one pass. The Triton kernels run only the "titans" rule
without a threshold: "triton" with either is refused naming both options, "auto" falls back to torch.
"""

from __future__ import annotations

import pytest
import torch

from test_memory_rules import PRESETS, rule_problem, run_with_grads
from titans import NeuralMemory, TitansConfig
from titans.ops.memory import RULE_PRESETS, memory_rule_chunked, memory_rule_chunked_autograd, memory_rule_ref

F64 = torch.float64
OPS = {"dispatch": memory_rule_chunked, "autograd": memory_rule_chunked_autograd}


def _median(surprise: torch.Tensor) -> float:
    """Halfway between the two middle surprises: no surprise sits on the threshold."""
    s = surprise.detach().flatten().sort().values
    mid = s.numel() // 2
    return float((s[mid - 1] + s[mid]) / 2)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("preset", PRESETS)
def test_rule_with_threshold_matches_float64_reference(op, preset):
    """About half the tokens skipped: outputs, final state, surprise and every input's gradient equal the
    reference, and differ from the ungated run (the gate acts)."""
    rule = RULE_PRESETS[preset]
    q, k, v, gates, w, s = rule_problem(rule, 13, 2, seed=5)
    kw = dict(rule=rule, chunk_size=3, history=min(2, rule.window.size - 1), surprise_clip=0.5)
    ungated = OPS[op](q, k, v, gates, w, s, **kw)
    kw["surprise_threshold"] = _median(ungated[3])
    out, grads = run_with_grads(OPS[op], [q, k, v, gates, *w, *s], 2, **kw)
    ref, g_ref = run_with_grads(memory_rule_ref, [q, k, v, gates, *w, *s], 2, **kw)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    for a, b in zip(grads, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)
    assert not torch.allclose(out[1], ungated[1][0])  # the final state of layer 1 moved


@pytest.mark.parametrize("preset", ["yaad", "atlas"])
def test_layer_with_rule_and_threshold_streams_and_reports_written(preset):
    """A fast-path rule (yaad) and a windowed one (atlas, history rows in the pending state): pieces ==
    one pass == the reference layer, and `written` is surprise >= threshold for the call's tokens."""
    torch.manual_seed(2)
    x = torch.randn(2, 17, 12, dtype=F64)
    probe = NeuralMemory(12, heads=2, depth=2, chunk_size=4, rule=preset).double()
    threshold = _median(probe.forward_with_stats(x).stats.surprise)
    mem = NeuralMemory(12, heads=2, depth=2, chunk_size=4, rule=preset, surprise_threshold=threshold).double()
    mem.load_state_dict(probe.state_dict())
    ref = NeuralMemory(
        12, heads=2, depth=2, chunk_size=4, rule=preset, surprise_threshold=threshold, impl="reference"
    ).double()
    ref.load_state_dict(probe.state_dict())
    out = mem.forward_with_stats(x)
    assert torch.equal(out.stats.written, out.stats.surprise >= threshold)
    assert 0 < out.write_rate < 1
    pieces, state = [], None
    for a, b in ((0, 3), (3, 4), (4, 11), (11, 17)):
        piece = mem.forward_with_stats(x[:, a:b], state)
        pieces.append(piece)
        state = piece.state
    torch.testing.assert_close(torch.cat([p.output for p in pieces], 1), out.output, rtol=0, atol=1e-12)
    assert torch.equal(torch.cat([p.stats.written for p in pieces], 2), out.stats.written)
    for a, b in zip(state.weights, out.state.weights):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    y_ref, state_ref = ref(x)
    torch.testing.assert_close(out.output, y_ref, rtol=1e-9, atol=1e-10)
    for a, b in zip(out.state.weights, state_ref.weights):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_triton_backend_refuses_a_rule_or_a_threshold():
    """backend="triton" runs the default rule without a threshold only: either option is refused when the
    layer or the config is built, naming both; "auto" takes the torch path for them."""
    with pytest.raises(ValueError, match=r"backend='triton'.*rule=.*moneta.*'auto' or 'torch'"):
        NeuralMemory(12, heads=2, rule="moneta", backend="triton")
    with pytest.raises(ValueError, match=r"backend='triton'.*surprise_threshold"):
        NeuralMemory(12, heads=2, surprise_threshold=0.1, backend="triton")
    with pytest.raises(ValueError, match=r"memory_backend='triton'.*memory_rule='titans'.*atlas"):
        TitansConfig(memory_backend="triton", memory_rule="atlas")
    with pytest.raises(ValueError, match=r"memory_backend='triton'.*memory_surprise_threshold"):
        TitansConfig(memory_backend="triton", memory_surprise_threshold=0.5)
    assert TitansConfig(memory_backend="triton").memory_rule == "titans"
    for kw in ({"rule": "yaad"}, {"surprise_threshold": 0.2}):
        mem = NeuralMemory(12, heads=2, chunk_size=4, **kw)  # backend "auto"
        assert mem._triton_config_reason() is not None
        assert not mem._use_triton(torch.zeros(1, 2, 3, 6))
        y, _ = mem(torch.randn(1, 9, 12))
        assert torch.isfinite(y).all()
    assert NeuralMemory(12, heads=2)._triton_config_reason() is None


def test_rule_ops_refuse_a_bad_threshold():
    for preset in ("yaad", "atlas"):  # the fast path and the autograd op
        rule = RULE_PRESETS[preset]
        q, k, v, gates, w, s = rule_problem(rule, 6, 1)
        with pytest.raises(ValueError, match="surprise_threshold"):
            memory_rule_chunked(q, k, v, gates, w, s, rule=rule, chunk_size=2, surprise_threshold=-1.0)


def test_monitor_reports_a_rule_memory_with_a_threshold():
    """The memory report of a model with a windowed rule (extra gates, history rows) and a threshold:
    streamed in pieces it counts every token once, its write rate is the share written, its numbers are
    finite, and the report of one call equals the streamed one's write rate."""
    from tiny_lm import random_tokens, tiny_model
    from titans.models.monitor import memory_report, prefill_with_report

    model = tiny_model("mag", memory_rule="atlas", memory_surprise_threshold=2.0)
    x = random_tokens(2, 23, vocab=61)
    with torch.no_grad():
        out = model.forward_with_stats(x)
        report = memory_report(model, out.stats, out.state)
        _, _, streamed = prefill_with_report(model, x, piece_len=5)
    for one, many in zip(report.layers, streamed.layers):
        assert one.tokens == many.tokens == 23
        assert all(0 < r < 1 for r in one.write_rate)  # some tokens skipped, some written
        torch.testing.assert_close(torch.tensor(one.write_rate), torch.tensor(many.write_rate))
        assert all(torch.isfinite(torch.tensor(v)).all() for v in one.summary().values())
