"""The one training loop of the package: ``TrainLoop(model, optimizer, ...).run()`` -> ``LoopResult``.

Every trainer of the package runs its optimizer steps here: the LM ``Trainer`` (``titans train``), the
long-context task recipe (``titans.evaluation.task_training``), forecasting (``titans.forecast.train``) and
DNA pre-training and fine-tuning (``titans.dna.study``). What differs between them is injected:

- the batch source ``batches(step) -> batch`` and the loss ``loss_fn(model, batch) -> loss`` (or
  ``(loss, aux)``, ``aux`` a dict handed on to ``on_step``); or, for a step that is more than one forward
  and backward (the LM trainer's micro-batches, DDP, carried state, CUDA graphs), ``step_fn(step) ->
  (loss, grad_norm)``, which ends with ``optimizer_step`` like the default step does;
- ``evaluate(step)`` every ``eval_every`` steps and ``checkpoint(step)`` every ``ckpt_every`` steps (and
  once more after the last step, or the step a stop came after, unless that step was just saved);
- ``on_step(step, loss, grad_norm, aux)`` after every step (a recipe's curriculum, a history) and
  ``after_log(step)`` after every logged interval.

What the loop does for all of them:

- ``optimizer_step``: clip the gradient norm to ``grad_clip`` (None: measure it only), step the optimizer
  and the schedule, clear the gradients;
- every ``log_every`` steps (and after the last): the per-step losses of the interval (averaged over ranks
  under torchrun, one collective), their mean refused with ``TrainingDiverged`` (a ``FloatingPointError``
  and a ``ValueError``) naming the step when it is NaN or inf, logged to ``metrics`` (loss, lr, tokens
  and tokens/s when ``tokens_per_step`` is given, the gradient norm) and to the progress bar;
- a time budget and SIGTERM / SIGINT (``titans.training.signals``): stop after the current step, the same
  step on every rank, then write the checkpoint; ``LoopResult.stopped_by`` names the signal. The stop is
  decided right after the step, so a step the loop stops after gets no periodic ``evaluate`` (nor
  ``checkpoint``) from the loop: the checkpoint comes first, and a caller that evaluates after ``run``
  (the LM trainer, ``EarlyStopping.finish``) evaluates that step once;
- a stop requested by a callback (``loop.request_stop(reason)``, e.g. early stopping from ``evaluate``):
  the same, after the current step; ``LoopResult.stopped_by`` is the reason;
- on CUDA, float32 matrix products in TF32 while it runs (``tf32``, default on; torch's flags come back
  afterwards): the memory's Triton kernels follow the flag, and without it run without tensor cores.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from titans.runtime.device import tf32
from titans.training import distributed as D
from titans.training.metrics import MetricsLogger
from titans.training.signals import StopSignals, signal_name

# a gradient norm past this is reported once a run (verbose): clipped, the update then follows its largest
# components alone. A language model's is 1-100 at initialisation; a memory's backward over a long window
# can grow it geometrically with the chunks (docs/training.md, "Long windows")
LARGE_GRAD_NORM = 1e3

LossFn = Callable[[nn.Module, Any], "Tensor | tuple[Tensor, dict[str, Any]]"]
StepFn = Callable[[int], "tuple[Tensor, Tensor | None]"]
OnStep = Callable[[int, Tensor, "Tensor | None", dict[str, Any]], None]


def optimizer_step(
    parameters: Iterable[Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    grad_clip: float | None = None,
    *,
    set_to_none: bool = True,
) -> Tensor:
    """Clip the gradient norm of ``parameters`` to ``grad_clip`` (None: no clipping), step the optimizer and
    the schedule, clear the gradients (``set_to_none=False`` zeroes them in place, for a CUDA graph that
    adds into them). Returns the gradient norm before clipping (a 0-dim tensor)."""
    max_norm = grad_clip if grad_clip is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return grad_norm.detach()


class TrainingDiverged(FloatingPointError, ValueError):
    """The training loss became NaN or inf. A FloatingPointError (what callers catch), and a ValueError,
    so that the command line reports it as one line naming the step, as it does bad settings (the usual
    cause: a learning rate or loss weight too large), not as a traceback."""


@dataclass
class LoopResult:
    """What ``TrainLoop.run`` did: ``step`` reached, ``stopped_early`` (a budget, a signal or ``end`` short
    of ``total_steps``), ``stopped_by`` (the signal's name), ``train_time_s`` (steps only: evaluation and
    checkpoints excluded), ``last_logged`` (mean loss of the last logged interval) and the per-step losses
    of this run (global under torchrun)."""

    step: int
    start_step: int
    stopped_early: bool
    stopped_by: str | None
    train_time_s: float
    last_logged: float | None
    step_losses: list[float] = field(default_factory=list)


class TrainLoop:
    """The step loop with its parts injected (see the module docstring).

    ``total_steps``: the length of the schedule (the progress bar's total; a run that ends before it is
    ``stopped_early``). ``start_step``: the step to continue from (a resumed run). ``checkpointed_at``: the
    step the newest checkpoint holds (None: none), so that a run with nothing left to do writes no
    duplicate. ``info``: the ranks under torchrun (None: one process, no collectives). ``progress``: show a
    progress bar (the main rank only). ``verbose``: write the loop's own lines (a time budget reached) and
    announce a stop signal (the main rank only). ``failure_hint``: appended to the non-finite loss error
    (the last good checkpoint, what to try). ``step_losses``: a list the logged per-step losses are
    appended to as they are gathered (the caller keeps it across runs).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        batches: Callable[[int], Any] | None = None,
        loss_fn: LossFn | None = None,
        step_fn: StepFn | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        grad_clip: float | None = None,
        start_step: int = 0,
        log_every: int = 1,
        eval_every: int | None = None,
        evaluate: Callable[[int], Any] | None = None,
        ckpt_every: int | None = None,
        checkpoint: Callable[[int], Any] | None = None,
        checkpointed_at: int | None = None,
        on_step: OnStep | None = None,
        after_log: Callable[[int], None] | None = None,
        time_budget_s: float | None = None,
        handle_signals: bool = True,
        metrics: MetricsLogger | None = None,
        tokens_per_step: int | None = None,
        progress: bool = False,
        progress_desc: str | None = None,
        progress_leave: bool = True,
        verbose: bool = False,
        info: D.DistInfo | None = None,
        device: torch.device | None = None,
        failure_hint: Callable[[], str] | None = None,
        step_losses: list[float] | None = None,
        tf32: bool = True,
    ):
        if step_fn is None and (batches is None or loss_fn is None):
            raise ValueError("TrainLoop needs batches and loss_fn, or a step_fn")
        if step_fn is not None and (batches is not None or loss_fn is not None):
            raise ValueError("TrainLoop takes batches and loss_fn, or a step_fn, not both")
        for name, every in (("log_every", log_every), ("eval_every", eval_every), ("ckpt_every", ckpt_every)):
            if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
                raise ValueError(f"TrainLoop.{name} must be a positive integer or None, got {every!r}")
        if (eval_every is None) != (evaluate is None) or (ckpt_every is not None and checkpoint is None):
            raise ValueError("TrainLoop: eval_every goes with evaluate, and ckpt_every needs checkpoint")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.total_steps = total_steps
        self.batches, self.loss_fn, self.step_fn = batches, loss_fn, step_fn
        self.grad_clip = grad_clip
        self.step = start_step
        self.log_every, self.eval_every, self.ckpt_every = log_every, eval_every, ckpt_every
        self.evaluate, self.checkpoint, self.checkpointed_at = evaluate, checkpoint, checkpointed_at
        self.on_step, self.after_log = on_step, after_log
        self.time_budget_s, self.handle_signals = time_budget_s, handle_signals
        self.metrics, self.tokens_per_step = metrics, tokens_per_step
        self.progress, self.progress_desc, self.progress_leave = progress, progress_desc, progress_leave
        self.verbose, self.info, self.failure_hint = verbose, info, failure_hint
        self.device = device if device is not None else _device_of(model)
        self.step_losses = step_losses if step_losses is not None else []
        self.tf32 = tf32
        self.bar: Any = None
        self.stop_reason: str | None = None
        self.warned_grad_norm = False
        self.step_lr: float | None = None  # the lr the current step uses (the scheduler moves on in it)

    def request_stop(self, reason: str) -> None:
        """Stop after the current step (call it from ``evaluate``, ``on_step`` or ``after_log``), as a time
        budget does: the checkpoint is written and ``LoopResult.stopped_by`` is ``reason``. Under torchrun
        every rank must request it at the same step (e.g. from a validation loss they share)."""
        self.stop_reason = reason

    # ---------------------------------------------------------------------------------------- steps
    def default_step(self, step: int) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """``loss_fn(model, batches(step))``, backward, ``optimizer_step``: (loss, gradient norm, aux)."""
        batch = self.batches(step)
        self.model.train()
        out = self.loss_fn(self.model, batch)
        loss, aux = out if isinstance(out, tuple) else (out, {})
        loss.backward()
        grad_norm = optimizer_step(self.model.parameters(), self.optimizer, self.scheduler, self.grad_clip)
        return loss.detach(), grad_norm, aux

    def write(self, line: str) -> None:
        """A line to the terminal that leaves the progress bar intact."""
        if self.bar is not None and not self.bar.disable:
            self.bar.write(line)
        else:
            print(line, flush=True)

    # ---------------------------------------------------------------------------------------- loop
    def run(self, end: int | None = None, *, signals: StopSignals | None = None) -> LoopResult:
        """Steps from ``self.step`` to ``end`` (default ``total_steps``), then the last checkpoint.
        ``signals``: a ``StopSignals`` the caller has entered (its stop requests end the loop); None: the
        loop handles SIGTERM / SIGINT itself while it runs (``handle_signals``)."""
        with tf32(self.tf32):
            if signals is None:
                with StopSignals(enabled=self.handle_signals, announce=self.verbose) as own:
                    return self._run(end, own)
            return self._run(end, signals)

    def _run(self, end: int | None, signals: StopSignals) -> LoopResult:
        total = self.total_steps
        end = total if end is None else min(end, total)
        self.bar = _progress(self.progress, total, self.step, self.progress_desc, self.progress_leave)
        bar = self.bar
        if self.step_fn is None:  # a model handed in may hold gradients from elsewhere
            self.optimizer.zero_grad(set_to_none=True)
        session_start = time.perf_counter()
        train_time = interval_time = 0.0
        pending: list[Tensor] = []
        last_logged: float | None = None
        stopped_early = False
        stopped_by: str | None = None
        saved_step = self.checkpointed_at if self.checkpointed_at is not None else -1
        start_step = self.step
        first_loss = len(self.step_losses)
        lr = self.optimizer.param_groups[0]["lr"]
        self.stop_reason = None
        try:
            while self.step < end:
                t0 = time.perf_counter()
                lr = self.step_lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses
                if self.step_fn is not None:
                    loss, grad_norm = self.step_fn(self.step)
                    aux: dict[str, Any] = {}
                else:
                    loss, grad_norm, aux = self.default_step(self.step)
                if self.on_step is not None:
                    self.on_step(self.step, loss, grad_norm, aux)
                self.step += 1
                pending.append(loss)
                if self.device.type == "cuda" and self.step % self.log_every == 0:
                    torch.cuda.synchronize(self.device)  # honest timing at log points
                dt = time.perf_counter() - t0
                train_time += dt
                interval_time += dt
                bar.update(1)
                if self.step % self.log_every == 0 or self.step == end:
                    last_logged = self._log(pending, lr, grad_norm, interval_time)
                    pending, interval_time = [], 0.0
                # A budget or a signal is decided right after the step, before its periodic evaluation:
                # a stop skips it, writes the checkpoint first (below, after the loop) and leaves the
                # evaluation of that step to the caller (one, after the checkpoint). Every rank, every
                # step: all stop after the same step (a signal reaches them at different moments).
                budget = self.time_budget_s
                over = budget is not None and time.perf_counter() - session_start >= budget
                if self.info is not None:
                    over, signum = D.agree_to_stop(over, signals.signum, self.info)
                else:
                    signum = signals.signum
                stopping = bool(over or signum) and self.step < end
                if not stopping:
                    if self.eval_every is not None and self.step % self.eval_every == 0 and self.step < end:
                        self.evaluate(self.step)
                    if self.ckpt_every is not None and self.step % self.ckpt_every == 0 and self.step < end:
                        if pending:  # logged first: a run resumed from this checkpoint logs none of them
                            last_logged = self._log(pending, lr, grad_norm, interval_time)
                            pending, interval_time = [], 0.0
                        self.checkpoint(self.step)
                        saved_step = self.checkpointed_at = self.step
                requested = self.stop_reason  # from on_step, after_log or this step's evaluate
                if (stopping or requested) and self.step < end:
                    stopped_early = True
                    if signum:
                        stopped_by = signal_name(signum)
                    elif requested:
                        stopped_by = requested
                    elif self.verbose:
                        self.write(f"time budget of {budget / 60:g} min reached at step {self.step}")
                    break
            if pending:
                last_logged = self._log(pending, lr, None, interval_time)
            stopped_early = stopped_early or self.step < total
        finally:
            bar.close()
            self.bar = None
        if self.checkpoint is not None and saved_step != self.step:  # first: what a stop must not lose
            self.checkpoint(self.step)
            self.checkpointed_at = self.step
        return LoopResult(
            step=self.step,
            start_step=start_step,
            stopped_early=stopped_early,
            stopped_by=stopped_by,
            train_time_s=train_time,
            last_logged=last_logged,
            step_losses=self.step_losses[first_loss:],
        )

    def _log(self, pending: list[Tensor], lr: float, grad_norm: Tensor | None, interval_time: float) -> float:
        """Gather the global per-step losses of the interval (one collective), check and log their mean."""
        local = torch.stack(pending).float()
        if self.info is not None:
            local = D.all_reduce_sum(local, self.info) / self.info.world_size
        losses = local.tolist()
        self.step_losses.extend(losses)
        mean = sum(losses) / len(losses)
        if not math.isfinite(mean):
            hint = f"; {self.failure_hint()}" if self.failure_hint is not None else ""
            raise TrainingDiverged(f"training loss became {mean} by step {self.step}{hint}")
        values: dict[str, float] = {"loss": mean, "lr": lr}
        postfix = {"loss": f"{mean:.4f}"}
        if self.tokens_per_step is not None:
            tok_s = len(losses) * self.tokens_per_step / max(interval_time, 1e-9)
            values["tokens"] = self.step * self.tokens_per_step
            values["tokens_per_s"] = tok_s
            postfix["tok_s"] = f"{tok_s:,.0f}"
        if grad_norm is not None:
            values["grad_norm"] = float(grad_norm)
            if values["grad_norm"] > LARGE_GRAD_NORM and self.verbose and not self.warned_grad_norm:
                self.warned_grad_norm = True
                self.write(
                    f"warning: gradient norm {values['grad_norm']:.3g} at step {self.step}: with "
                    "a neural memory, a norm that grows with the window length is its backward exploding "
                    'through the writes (docs/training.md, "Long windows": try model.memory_eta_init=0.5)'
                )
        if self.metrics is not None:
            self.metrics.log("train", self.step, **values)
        if self.after_log is not None:
            self.after_log(self.step)
        if self.bar is not None:
            self.bar.set_postfix(**postfix, refresh=False)
        return mean


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _progress(enabled: bool, total: int, initial: int, desc: str | None = None, leave: bool = True):
    """A tqdm bar (loss, tokens/s in the postfix; tqdm shows the ETA), or a silent stand-in."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        unit="step",
        dynamic_ncols=True,
        smoothing=0.1,
        desc=desc,
        leave=leave,
    )


__all__ = ["LoopResult", "TrainLoop", "TrainingDiverged", "optimizer_step"]
