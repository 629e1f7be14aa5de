"""Convergence rules shared by the forecasting and DNA trainings: validation checks on the training loop,
the best weights kept, early stopping after ``patience`` checks without improvement.

    stopper = EarlyStopping(model, lambda: validation_loss(model), patience=5)
    stopper.check(0)  # the untrained model: what the first improvement is measured against
    loop = TrainLoop(..., eval_every=25, evaluate=stopper.check, time_budget_s=150)
    stopper.loop = loop  # so that a check can ask the loop to stop
    stopper.finish(loop.run())  # checks the last step if the loop did not; restores the best weights

The value is "lower is better" (a validation loss or MSE). ``best_seconds`` is the training time, checks
excluded, when the best check was made.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

from torch import nn

from titans.training.loop import LoopResult, TrainLoop


class EarlyStopping:
    """Keeps ``model``'s weights at its lowest ``measure()``; asks ``loop`` to stop once ``patience`` checks
    in a row did not improve on it (``patience`` None: never)."""

    def __init__(self, model: nn.Module, measure: Callable[[], float], patience: int | None = None) -> None:
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be >= 1 or None, got {patience}")
        self.model, self.measure, self.patience = model, measure, patience
        self.loop: TrainLoop | None = None
        self.best = math.inf
        self.best_state = copy.deepcopy(model.state_dict())
        self.best_step, self.best_seconds = 0, 0.0
        self.since_best = 0
        self.eval_seconds = 0.0
        self.checked: set[int] = set()
        self.history: list[tuple[int, float]] = []  # (step, value) of every check
        self.t0 = time.perf_counter()

    def check(self, step: int) -> None:
        t = time.perf_counter()
        self.checked.add(step)
        value = float(self.measure())
        self.history.append((step, value))
        if value < self.best:
            self.best, self.best_state = value, copy.deepcopy(self.model.state_dict())
            self.best_step, self.best_seconds = step, t - self.t0 - self.eval_seconds
            self.since_best = 0
        else:
            self.since_best += 1
        self.eval_seconds += time.perf_counter() - t
        if self.loop is not None and self.patience is not None and self.since_best >= self.patience:
            self.loop.request_stop("early stopping")

    def finish(self, done: LoopResult) -> str | None:
        """After ``loop.run()``: check the last step (the loop checks the steps before it), restore the best
        weights; the reason training ended early (``stopped_by``), None when every step ran."""
        if done.step not in self.checked:
            self.check(done.step)
        self.model.load_state_dict(self.best_state)
        return done.stopped_by or ("time budget" if done.stopped_early else None)

    @property
    def train_seconds(self) -> float:
        """Seconds since construction, checks excluded."""
        return time.perf_counter() - self.t0 - self.eval_seconds


__all__ = ["EarlyStopping"]
