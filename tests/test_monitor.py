"""Memory monitoring: the report's numbers against a direct computation from the stats and state tensors,
a streamed report equal to one pass, and the training log's memory rows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from micro_train import micro_config
from titans import NeuralMemory
from titans.models import TitansConfig, TitansLM
from titans.models.monitor import (
    MemoryMonitor,
    find_memory_state,
    memory_report,
    prefill_with_report,
    stats_by_layer,
)
from titans.training.trainer import Trainer


def tiny(variant: str = "mac", **kw) -> TitansLM:
    cfg = dict(
        variant=variant,
        vocab_size=50,
        dim=32,
        depth=3,
        heads=2,
        segment_len=8,
        window=8,
        chunk_size=4,
        persistent_tokens=2,
        memory_layers=[0, 2],
        memory_monitor_max_norm=7.5,
    )
    torch.manual_seed(0)
    return TitansLM(TitansConfig(**{**cfg, **kw})).eval()


@pytest.mark.parametrize("variant", ["mac", "mag", "lmm"])
def test_report_numbers_match_a_direct_computation(variant):
    model = tiny(variant, memory_surprise_threshold=0.6 if variant != "lmm" else None)
    tokens = torch.randint(0, 50, (2, 27))
    with torch.no_grad():
        out = model.forward_with_stats(tokens)
    report = memory_report(model, out.stats, out.state)
    assert [layer.layer for layer in report.layers] == [0, 2]
    # the raw stats, gathered by hand: the calls of block 0 come before block 2's, each covering the tokens
    pieces = len(out.stats) // 2
    for index, layer in enumerate(report.layers):
        calls = out.stats[index * pieces : (index + 1) * pieces]
        surprise = torch.cat([s.surprise for s in calls], 2).double()
        written = torch.cat([s.written for s in calls], 2).double()
        assert surprise.shape == (2, 2, 27) and layer.tokens == 27
        block = model.blocks[layer.layer]
        for h in range(2):
            values = surprise[:, h].flatten()
            assert layer.surprise_mean[h] == pytest.approx(values.sum().item() / values.numel(), rel=1e-12)
            assert layer.surprise_p50[h] == pytest.approx(torch.quantile(values, 0.5).item(), rel=1e-12)
            assert layer.surprise_p95[h] == pytest.approx(torch.quantile(values, 0.95).item(), rel=1e-12)
            assert layer.write_rate[h] == pytest.approx(written[:, h].mean().item(), rel=1e-12)
            for name in ("theta", "eta", "alpha"):
                direct = torch.cat([getattr(s, name) for s in calls], 2)[:, h].double().mean().item()
                assert getattr(layer, name)[h] == pytest.approx(direct, rel=1e-9)
        state = find_memory_state(out.state.layers[layer.layer])
        assert len(layer.weight_norm) == block.memory.depth
        for lw, (w, s) in enumerate(zip(state.weights, state.momentum)):
            for h in range(2):
                w_norm = sum(math.sqrt(float((w[b, h].double() ** 2).sum())) for b in range(2)) / 2
                s_norm = sum(math.sqrt(float((s[b, h].double() ** 2).sum())) for b in range(2)) / 2
                assert layer.weight_norm[lw][h] == pytest.approx(w_norm, rel=1e-12)
                assert layer.momentum_norm[lw][h] == pytest.approx(s_norm, rel=1e-12)
                assert layer.utilisation[lw][h] == pytest.approx(w_norm / 7.5, rel=1e-12)
    written_all = torch.cat([s.written.flatten() for s in out.stats]).double()
    assert report.write_rate == pytest.approx(written_all.mean().item(), rel=1e-12)
    assert out.write_rate == pytest.approx(report.write_rate, rel=1e-12)
    if variant != "lmm":
        assert 0 < report.write_rate < 1  # the threshold splits the tokens
    json.dumps(report.to_dict())  # JSON-ready
    summary = report.summary("memory/")
    assert summary["memory/L2/weight_norm"] == max(sum(r) / 2 for r in report.layers[1].weight_norm)
    assert report.max_utilisation == max(u for la in report.layers for row in la.utilisation for u in row)


def test_streamed_report_equals_one_pass():
    model = tiny("mac", memory_surprise_threshold=0.6)
    tokens = torch.randint(0, 50, (1, 45))
    with torch.no_grad():
        whole = model.forward_with_stats(tokens)
    one = memory_report(model, whole.stats, whole.state)
    _, state, streamed = prefill_with_report(model, tokens, piece_len=8)
    assert state.position == 45
    for a, b in zip(one.layers, streamed.layers):
        assert a.tokens == b.tokens == 45
        for name in ("surprise_mean", "surprise_p50", "surprise_p95", "theta", "eta", "alpha"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-5)
        assert a.write_rate == b.write_rate
        for x, y in zip(a.weight_norm + a.momentum_norm, b.weight_norm + b.momentum_norm):
            assert x == pytest.approx(y, rel=1e-5)
    # a monitor fed call by call joins the calls in order
    monitor = MemoryMonitor(model)
    with torch.no_grad():
        st = None
        for a, b in ((0, 20), (20, 45)):
            out = model.forward_with_stats(tokens[:, a:b], st)
            st = out.state
            monitor.update(out.stats)
    joined = monitor.layer_stats()
    reference = stats_by_layer(model, whole.stats)
    for layer in (0, 2):
        torch.testing.assert_close(joined[layer].surprise, reference[layer].surprise, rtol=1e-5, atol=1e-7)


def test_report_without_max_norm_or_tokens():
    model = tiny("mag", memory_monitor_max_norm=None)
    _, state, report = prefill_with_report(model, torch.zeros(1, 0, dtype=torch.long))
    assert state is None and report.max_utilisation is None
    assert all(layer.tokens == 0 and layer.utilisation is None for layer in report.layers)
    assert all(math.isnan(v) for layer in report.layers for v in layer.surprise_mean)
    init = model.blocks[0].memory.init_weights[0].detach().double()
    assert report.layers[0].weight_norm[0] == pytest.approx(torch.linalg.norm(init, dim=(-2, -1)).tolist())
    with pytest.raises(ValueError, match="max_norm"):
        memory_report(
            model, None, TitansLM.forward_with_stats(model, torch.zeros(1, 3, dtype=torch.long)).state, -1
        )


def test_training_logs_memory_rows(tmp_path):
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = micro_config(
        tmp_path / "run", tmp_path / "cache", steps=2, batch_size=2, eval_windows=1, tensorboard=True
    )
    Trainer(cfg).train(handle_signals=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    memory = [r for r in rows if r["split"] == "memory"]
    assert [r["step"] for r in memory] == [1, 2]
    assert memory[0]["L0/surprise_mean"] > 0 and memory[0]["write_rate"] == 1.0
    assert 0 < memory[0]["L0/theta"] < 1 and memory[0]["L0/weight_norm"] > 0
    events = tb.EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    logged = events.Scalars("memory/L0/surprise_mean")
    assert [e.step for e in logged] == [1, 2]
    assert logged[1].value == pytest.approx(memory[1]["L0/surprise_mean"], rel=1e-6)


@pytest.mark.parametrize("variant", ["mac", "mag", "lmm"])
def test_one_definition_of_the_weight_norm(variant):
    """||W|| has one home (`weight_norms`): the report's numbers, the inspection plot's largest layer and
    the server's all-weights norm are each that definition, and each equals its direct computation."""
    from titans.inference.inspection import trace_text
    from titans.models.monitor import total_weight_norm, weight_norms
    from titans.serving.session import memory_norms

    model = tiny(variant)
    tokens = torch.randint(0, 50, (1, 27))
    with torch.no_grad():
        state = model.forward_with_stats(tokens).state
    report = memory_report(model, None, state)
    memories = [find_memory_state(state.layers[layer.layer]) for layer in report.layers]
    for layer, memory in zip(report.layers, memories):
        direct = [[w[0, h].double().norm().item() for h in range(w.shape[1])] for w in memory.weights]
        assert layer.weight_norm == weight_norms(memory.weights)
        for got, want in zip(layer.weight_norm, direct):
            assert got == pytest.approx(want, rel=1e-12)
        assert layer.max_weight_norm == pytest.approx(max(sum(r) / len(r) for r in direct), rel=1e-12)
    # the server's ||W||: all of a memory's weights together, of its one row; every memory layer (lmm too)
    by_hand = [math.sqrt(sum(float(w[0].double().pow(2).sum()) for w in m.weights)) for m in memories]
    assert memory_norms(state) == pytest.approx(by_hand, rel=1e-12)
    assert [total_weight_norm(m) for m in memories] == memory_norms(state) and len(by_hand) == 2
    # the inspection plot's last point: its report of the whole text, largest memory-MLP layer
    trace = trace_text(model, tokens[0])
    assert trace.weight_norm[:, -1].tolist() == [layer.max_weight_norm for layer in trace.report.layers]
    assert trace.weight_norm[:, -1] == pytest.approx(
        [layer.max_weight_norm for layer in report.layers], rel=1e-6
    )


BAD_MAX_NORMS = [-1.0, 0, float("nan"), float("inf"), True, "7.5", torch.tensor(2.0)]


@pytest.mark.parametrize("bad", BAD_MAX_NORMS, ids=repr)
def test_max_norm_is_checked_before_any_token_is_read(bad):
    """A max_norm that is no finite number > 0 (a bool is no number: True was taken as 1) is refused where
    it is given: MemoryMonitor at construction, prefill_with_report before it reads the first piece (it
    read the whole stream first), memory_report as before."""
    model = tiny("mag")

    def reader():
        raise AssertionError("read a piece")
        yield

    with pytest.raises(ValueError, match=r"MemoryMonitor: max_norm must be None or a finite number > 0"):
        MemoryMonitor(model, max_norm=bad)
    with pytest.raises(ValueError, match=r"prefill_with_report: max_norm must be None or a finite number"):
        prefill_with_report(model, reader(), max_norm=bad)
    with torch.no_grad():
        out = model.forward_with_stats(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"memory_report: max_norm must be None or a finite number > 0"):
        memory_report(model, out.stats, out.state, max_norm=bad)


def test_max_norm_may_be_any_real_number():
    import numpy as np

    model = tiny("mag")
    with torch.no_grad():
        out = model.forward_with_stats(torch.zeros(1, 3, dtype=torch.long))
    for good in (3, 3.0, np.float32(3.0), np.int64(3)):
        assert MemoryMonitor(model, max_norm=good).max_norm == 3.0
        assert memory_report(model, out.stats, out.state, max_norm=good).max_norm == 3.0
        # and a memory's bounds alike (one check for both: NeuralMemory refused numpy's numbers)
        memory = NeuralMemory(8, heads=2, chunk_size=4, max_norm=good, surprise_clip=good)
        assert (memory.max_norm, memory.surprise_clip) == (3.0, 3.0) and type(memory.max_norm) is float


def test_tensorboard_shows_each_step_once_after_a_restart_from_scratch(tmp_path):
    """An attempt killed before its first checkpoint, then started again from step 0: the JSONL was cleared
    but TensorBoard kept the old attempt's events (140 loss points up to step 120 after a 20-step rerun)."""
    from titans.training.metrics import MetricsLogger

    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    for steps, resume_step in ((range(1, 8), 0), (range(1, 4), 0), (range(4, 6), 3)):
        logger = MetricsLogger(tmp_path, resume_step=resume_step)
        for step in steps:
            logger.log("train", step, loss=float(step))
        logger.close()
    events = tb.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]
