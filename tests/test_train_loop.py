"""The one training loop (``titans.training.loop``): clipping, the non-finite check, signals with a
checkpoint, evaluation and checkpoint cadence; and task training, forecasting and DNA training running
through it."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
from torch import nn

import titans.training.loop as loop_module
from titans.data.dna import dm3_sample_path, read_fasta
from titans.data.tokenizers import ByteTokenizer
from titans.dna.study import DNABudget, finetune, pretrain
from titans.dna.tasks import encode_records, proximal_distal, split_records
from titans.evaluation.task_training import TaskTrainConfig, train_on_task
from titans.models import TitansConfig, TitansLM
from titans.training.early_stopping import EarlyStopping
from titans.training.loop import TrainLoop, optimizer_step

TOK = ByteTokenizer()
DEFAULT_STEP = TrainLoop.default_step


def _linear_loop(**kw) -> tuple[nn.Linear, TrainLoop]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    kw.setdefault("batches", lambda step: (x, y))
    kw.setdefault("loss_fn", lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    return model, TrainLoop(model, opt, **{"total_steps": 6, "handle_signals": False, **kw})


# ------------------------------------------------------------------------------------------------ the loop


def test_optimizer_step_clips_the_update_to_grad_clip():
    model = nn.Linear(4, 1)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.randn(8, 4)).sum() * 100).backward()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    grad_norm = optimizer_step(model.parameters(), opt, grad_clip=0.5)
    step = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert float(grad_norm) > 10  # the norm before clipping
    assert step.norm().item() == pytest.approx(0.5, rel=1e-5)  # SGD at lr 1 moves by the clipped gradient
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("enabled", [True, False])
def test_the_loop_runs_float32_matmuls_in_tf32_as_asked_and_restores_the_flags(enabled):
    """``tf32`` (default on): torch's TF32 flags, which the memory's Triton kernels follow on CUDA, are as
    asked in every step and callback, and what they were once the loop ends."""
    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    before, seen = flags(), []

    def loss_fn(model, batch):
        seen.append(flags())
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not enabled
        kw = {} if enabled else {"tf32": False}  # the default is on
        evaluate = lambda step: seen.append(flags())  # noqa: E731
        _, loop = _linear_loop(loss_fn=loss_fn, eval_every=2, evaluate=evaluate, **kw)
        loop.run()
        assert seen == [(enabled, enabled)] * 8  # 6 steps, evaluations after steps 2 and 4
        assert flags() == (not enabled, not enabled)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_the_loop_logs_evaluates_and_checkpoints_on_its_cadence():
    seen: dict[str, list[int]] = {"eval": [], "ckpt": [], "log": []}
    _, loop = _linear_loop(
        total_steps=7,
        log_every=3,
        eval_every=2,
        evaluate=seen["eval"].append,
        ckpt_every=3,
        checkpoint=seen["ckpt"].append,
        after_log=seen["log"].append,
    )
    done = loop.run()
    assert seen == {"eval": [2, 4, 6], "ckpt": [3, 6, 7], "log": [3, 6, 7]}
    assert done.step == 7 and not done.stopped_early and len(done.step_losses) == 7
    assert done.step_losses[-1] < done.step_losses[0]  # it trains
    again = loop.run()  # nothing left: no step, no duplicate checkpoint
    assert again.step == 7 and again.step_losses == [] and seen["ckpt"] == [3, 6, 7]


def test_a_non_finite_loss_stops_the_loop_naming_the_step():
    x = torch.randn(8, 4)
    bad = lambda step: (x, torch.full((8, 1), float("nan") if step == 3 else 0.0))  # noqa: E731
    _, loop = _linear_loop(batches=bad, failure_hint=lambda: "the hint")
    with pytest.raises(FloatingPointError, match="training loss became nan by step 4; the hint"):
        loop.run()


def test_a_large_gradient_norm_is_reported_once(capsys):
    """A gradient norm past `LARGE_GRAD_NORM` (a memory's backward exploding over a long window) is
    reported once a run, with where to read about it; an ordinary one is not."""
    _, loop = _linear_loop(verbose=True, grad_clip=1.0)
    loop.run()
    assert "warning: gradient norm" not in capsys.readouterr().out
    _, loop = _linear_loop(verbose=True, grad_clip=1.0, loss_fn=lambda m, b: 1e6 * m(b[0]).sum())
    loop.run()
    out = capsys.readouterr().out
    assert out.count("warning: gradient norm") == 1 and "at step 1:" in out and "Long windows" in out


def test_a_signal_stops_the_loop_after_the_step_with_a_checkpoint():
    saved: list[int] = []

    def on_step(step, loss, grad_norm, aux):
        if step == 1:
            signal.raise_signal(signal.SIGINT)  # the loop's handler records it; the step finishes

    _, loop = _linear_loop(on_step=on_step, ckpt_every=100, checkpoint=saved.append, handle_signals=True)
    done = loop.run()
    assert done.stopped_by == "SIGINT" and done.stopped_early and done.step == 2 and saved == [2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_an_evaluation_callback_stops_the_loop_with_request_stop():
    saved: list[int] = []
    evaluated: list[int] = []

    def evaluate(step: int) -> None:
        evaluated.append(step)
        if step == 4:
            loop.request_stop("early stopping")

    _, loop = _linear_loop(eval_every=2, evaluate=evaluate, ckpt_every=100, checkpoint=saved.append)
    done = loop.run()
    assert done.stopped_by == "early stopping" and done.stopped_early
    assert done.step == 4 and evaluated == [2, 4] and saved == [4] and len(done.step_losses) == 4
    loop.total_steps = 8  # a later run starts without the old request
    again = loop.run()
    assert again.step == 8 and again.stopped_by is None and evaluated == [2, 4, 6]


@pytest.mark.parametrize("stop", ["signal", "budget"])
def test_a_stop_at_an_eval_step_skips_that_evaluation_and_checkpoints(stop):
    """A signal or a time budget is decided right after the step, before its periodic evaluation: the
    step the loop stops after gets its checkpoint and no evaluation from the loop (the caller evaluates it
    once, after the checkpoint), also when it is an `eval_every` step."""
    calls: list[str] = []

    def on_step(step, loss, grad_norm, aux):
        if stop == "signal" and step == 1:
            signal.raise_signal(signal.SIGINT)  # recorded by the loop's handler; step 2 finishes

    _, loop = _linear_loop(
        on_step=on_step,
        eval_every=2 if stop == "signal" else 1,
        evaluate=lambda step: calls.append(f"evaluate@{step}"),
        ckpt_every=100,
        checkpoint=lambda step: calls.append(f"checkpoint@{step}"),
        time_budget_s=0.0 if stop == "budget" else None,
        handle_signals=stop == "signal",
    )
    done = loop.run()
    last = 2 if stop == "signal" else 1
    assert done.stopped_early and done.step == last
    assert done.stopped_by == ("SIGINT" if stop == "signal" else None)
    assert calls == [f"checkpoint@{last}"]


def test_early_stopping_checks_the_step_a_time_budget_stopped_at_once():
    """`EarlyStopping.finish` checks the last step when the loop did not: a time budget that stops the
    loop at an `eval_every` step leaves that check to it, made once."""
    model, loop = _linear_loop(eval_every=1, evaluate=lambda step: stopper.check(step), time_budget_s=0.0)
    measured: list[int] = []
    stopper = EarlyStopping(model, lambda: measured.append(loop.step) or float(len(measured)), patience=3)
    stopper.loop = loop
    stopper.check(0)
    done = loop.run()
    assert done.step == 1 and done.stopped_early
    assert stopper.finish(done) == "time budget"
    assert [s for s, _ in stopper.history] == [0, 1] and measured == [0, 1]


def test_the_loop_refuses_a_half_given_set_of_parts():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs batches and loss_fn, or a step_fn"):
        TrainLoop(model, opt, total_steps=1, batches=lambda s: None)
    with pytest.raises(ValueError, match="log_every must be a positive integer"):
        TrainLoop(model, opt, total_steps=1, step_fn=lambda s: None, log_every=0)
    with pytest.raises(ValueError, match="eval_every goes with evaluate"):
        TrainLoop(model, opt, total_steps=1, step_fn=lambda s: None, eval_every=5)


# ------------------------------------------------------------------------------------------------ its users


@pytest.fixture()
def steps_seen(monkeypatch):
    """Every optimizer step the shared loop takes, as (grad_clip, loop) pairs."""
    seen: list[float | None] = []
    real = loop_module.optimizer_step

    def spy(parameters, optimizer, scheduler=None, grad_clip=None, **kw):
        seen.append(grad_clip)
        return real(parameters, optimizer, scheduler, grad_clip, **kw)

    monkeypatch.setattr(loop_module, "optimizer_step", spy)
    return seen


def _poison_at(monkeypatch, at: int) -> None:
    """Make the loss of the loop's step ``at`` NaN (a run that diverges there)."""
    real = DEFAULT_STEP  # a later patch replaces an earlier one

    def step(self, s):
        if s != at:
            return real(self, s)
        loss_fn = self.loss_fn

        def nan_loss(model, batch):
            out = loss_fn(model, batch)
            loss, aux = out if isinstance(out, tuple) else (out, {})
            return loss * float("nan"), aux

        self.loss_fn = nan_loss
        try:
            return real(self, s)
        finally:
            self.loss_fn = loss_fn

    monkeypatch.setattr(TrainLoop, "default_step", step)


def _signal_at(monkeypatch, at: int) -> None:
    """A SIGINT during step ``at`` of the loop."""
    real = DEFAULT_STEP  # a later patch replaces an earlier one

    def step(self, s):
        if s == at:
            signal.raise_signal(signal.SIGINT)
        return real(self, s)

    monkeypatch.setattr(TrainLoop, "default_step", step)


def _task(**kw):
    torch.manual_seed(0)
    base = dict(dim=32, depth=1, heads=2, segment_len=16, window=16, chunk_size=4, persistent_tokens=2)
    model = TitansLM(TitansConfig.preset("tiny", variant="lmm", **base))
    cfg = TaskTrainConfig(
        train_length=304, start_length=288, steps=4, batch_size=2, warmup_steps=1, log_every=10, **kw
    )
    return model, cfg


def _forecast(**kw):
    from test_forecast import _write_csv
    from titans.data.series import read_series_csv, split_series
    from titans.forecast.train import ForecastRun, train_forecaster

    def run(tmp_path):
        sp = split_series(read_series_csv(_write_csv(tmp_path / "s.csv", 700, ["a", "b"])), lookback=32)
        run = ForecastRun(model="lmm", horizon=8, steps=4, eval_every=2, dim=16, depth=1, heads=2, **kw)
        return train_forecaster(sp, run, handle_signals=True)

    return run


def _dna():
    records = read_fasta(dm3_sample_path())
    train, _ = split_records(records)
    budget = DNABudget(
        pretrain_steps=4, finetune_steps=3, batch_size=2, seq_len=48, window_len=48, dim=16, depth=1, heads=2
    )
    return encode_records(train), proximal_distal(train, 48), budget


def test_task_training_steps_through_the_loop(monkeypatch, steps_seen):
    model, cfg = _task(grad_clip=0.25)
    history = train_on_task(model, TOK, cfg, log=None)
    # steps done, counted as the LM trainer and the checkpoints count them (it recorded 0 and 3 here while
    # the checkpoint of those 4 steps was step_00000004)
    assert steps_seen == [0.25] * 4 and [h["step"] for h in history] == [1, 4]
    _signal_at(monkeypatch, 1)
    model, cfg = _task()
    history = train_on_task(model, TOK, cfg, log=None, handle_signals=True)
    assert history[-1]["step"] == 2 and history[-1]["stopped_by"] == "SIGINT" and history[-1]["stopped_early"]
    _poison_at(monkeypatch, 2)
    model, cfg = _task()
    with pytest.raises(FloatingPointError, match="training loss became nan by step 3; task training of niah"):
        train_on_task(model, TOK, cfg, log=None)


def test_forecasting_steps_through_the_loop(monkeypatch, steps_seen, tmp_path):
    pytest.importorskip("pandas")
    res = _forecast()(tmp_path)
    assert steps_seen == [1.0] * 4 and "stopped_by" not in res.metrics
    _signal_at(monkeypatch, 0)
    res = _forecast()(tmp_path)
    assert res.metrics["stopped_by"] == "SIGINT" and res.metrics["steps_done"] == 1
    assert res.metrics["best_step"] in (0, 1) and np.isfinite(res.metrics["test_mse"])
    _poison_at(monkeypatch, 1)
    with pytest.raises(FloatingPointError, match="by step 2; forecaster lmm at horizon 8"):
        _forecast()(tmp_path)


def test_dna_training_steps_through_the_loop(monkeypatch, steps_seen):
    seqs, cls, budget = _dna()
    lm, losses = pretrain("lmm", seqs, budget)
    finetune(lm, cls, budget)
    assert steps_seen == [1.0] * (4 + 3) and len(losses) == 4
    _signal_at(monkeypatch, 1)
    _, losses = pretrain("lmm", seqs, budget, handle_signals=True)
    assert len(losses) == 2  # stopped after the step the signal came in
    with pytest.raises(KeyboardInterrupt):  # without handle_signals: the usual effect, at once
        finetune(lm, cls, budget)
    _poison_at(monkeypatch, 0)
    with pytest.raises(FloatingPointError, match="by step 1; fine-tuning lmm"):
        finetune(lm, cls, budget)
