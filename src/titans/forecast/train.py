"""Training and evaluation of forecasters under the long-horizon protocol (``titans.data.series``).

    result = train_forecaster(split, ForecastRun(model="lmm", horizon=96, steps=150))
    result.metrics      # {"test_mse", "test_mae", "val_mse", ...} on the standardised test part

Training draws random windows of the training part (a seeded generator: every model of a study sees the
same batches), minimises the MSE with Adam (gradient norm clipped to 1) on the package's training loop
(``titans.training.loop.TrainLoop``: a NaN or inf loss stops it, naming the step). The same convergence
rules hold for every model, Titans or baseline: the validation MSE is checked every ``eval_every`` steps
and at the end; with ``patience`` training stops once that many checks in a row did not improve on the
best (early stopping); ``steps`` and ``time_budget`` (seconds of training) cap the run; the weights of the
best check are restored at the end. The metrics say at which step (``best_step``) and after how many
seconds of training, validation excluded (``best_seconds``), the best weights were reached, and why
training ended (``stopped_by``: early stopping, the time budget, a signal; absent when all ``steps`` ran).
A model without parameters (seasonal-naive) is not trained. Test metrics average over every test window
(stride 1) and every predicted value, as the literature does.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from titans.data.series import ForecastWindows, SeriesSplit, StandardScaler
from titans.forecast.model import FORECAST_MODELS, build_forecaster
from titans.training.early_stopping import EarlyStopping
from titans.training.loop import TrainLoop
from titans.training.metrics import save_plot
from titans.validation import check_int


@dataclass
class ForecastRun:
    """One model at one horizon. ``dim``/``depth``/``heads`` size the Titans backbones and PatchTST (the
    linear models have none); at most ``steps`` Adam steps of ``batch_size`` windows at learning rate
    ``lr``; ``patience`` validation checks without improvement stop training early (None: never);
    ``time_budget`` seconds stop it too (None: no limit); ``period``: the seasonal-naive period."""

    model: str = "lmm"
    horizon: int = 96
    steps: int = 150
    batch_size: int = 32
    lr: float = 1e-3
    eval_every: int = 50
    dim: int = 32
    depth: int = 2
    heads: int = 4
    revin: bool = True
    seed: int = 0
    patience: int | None = None
    time_budget: float | None = None
    period: int = 24

    def __post_init__(self) -> None:
        if self.model not in FORECAST_MODELS:
            raise ValueError(f"unknown forecasting model {self.model!r}; expected one of {FORECAST_MODELS}")
        # ints, not numbers an int() would truncate (2.5 steps ran 3 while the result said 2.5) or bools
        for name in ("horizon", "steps", "batch_size", "eval_every", "dim", "depth", "heads", "period"):
            if isinstance(getattr(self, name), np.integer):  # from a numpy array of sizes: as an int
                setattr(self, name, int(getattr(self, name)))
            check_int(f"ForecastRun.{name}", getattr(self, name))
        check_int("ForecastRun.patience", self.patience, none_ok=True)
        if not self.lr >= 0 or not math.isfinite(self.lr):  # NaN reached AdamW: "Invalid learning rate: nan"
            raise ValueError(f"ForecastRun.lr must be a finite number >= 0, got {self.lr!r}")
        if self.time_budget is not None and not 0 < self.time_budget < math.inf:  # inf: not strict JSON
            raise ValueError(
                f"ForecastRun.time_budget must be finite seconds > 0 or None, got {self.time_budget}"
            )


@dataclass
class ForecastResult:
    run: ForecastRun
    model: nn.Module
    metrics: dict


@torch.no_grad()
def evaluate(model: nn.Module, windows: ForecastWindows, batch_size: int = 256) -> dict:
    """MSE and MAE over every window of ``windows`` (standardised values)."""
    model.eval()
    se = ae = 0.0
    count = 0
    for start in range(0, len(windows), batch_size):
        idx = np.arange(start, min(start + batch_size, len(windows)))
        x, y = windows.batch(idx)
        pred = model(torch.from_numpy(x)).double()
        err = pred - torch.from_numpy(y).double()
        se += float((err**2).sum())
        ae += float(err.abs().sum())
        count += err.numel()
    return {"mse": se / count, "mae": ae / count, "windows": len(windows)}


@torch.no_grad()
def predict(
    model: nn.Module, windows: ForecastWindows, index: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lookback (L, C), truth (H, C) and prediction (H, C) of window ``index``."""
    model.eval()
    x, y = windows.batch(np.array([index]))
    return x[0], y[0], model(torch.from_numpy(x))[0].numpy()


def forecaster_for(split: SeriesSplit, run: ForecastRun) -> nn.Module:
    """The untrained model of ``run`` for ``split``. A study builds each once before any trains, so options
    a model refuses end it at once."""
    return build_forecaster(
        run.model,
        lookback=split.lookback,
        horizon=run.horizon,
        channels=split.series.values.shape[1],
        dim=run.dim,
        depth=run.depth,
        heads=run.heads,
        revin=run.revin,
        period=run.period,
        seed=run.seed,
    )


def train_forecaster(
    split: SeriesSplit, run: ForecastRun, progress: bool = False, *, handle_signals: bool = False
) -> ForecastResult:
    """Train ``run.model`` on ``split`` at ``run.horizon`` and measure it (see the module docstring).

    ``handle_signals`` (main thread only): a SIGTERM / SIGINT stops training after the current step, the
    best weights so far are measured and the metrics say ``stopped_by``; without it a signal has its usual
    effect (KeyboardInterrupt), which ends a study of many runs as a whole."""
    train, val, test = split.windows(run.horizon)
    torch.manual_seed(run.seed)
    rng = np.random.default_rng(run.seed)
    model = forecaster_for(split, run)
    params = [p for p in model.parameters() if p.requires_grad]
    # built before the clock starts: the first optimiser of a process imports torch._dynamo (seconds), which
    # would otherwise be charged to the first model's training time and time budget
    optimizer = torch.optim.Adam(params, lr=run.lr) if params else None
    stopper = EarlyStopping(model, lambda: evaluate(model, val)["mse"], run.patience)
    losses: list[float] = []

    def loss_fn(model: nn.Module, batch: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))

    stopped_by, steps_done = None, 0
    stopper.check(0)  # the untrained model: the reference the first improvement is measured against
    if params:
        stopper.loop = TrainLoop(
            model,
            optimizer,
            total_steps=run.steps,
            batches=lambda step: train.batch(rng.integers(0, len(train), run.batch_size)),
            loss_fn=loss_fn,
            grad_clip=1.0,
            eval_every=run.eval_every,
            evaluate=stopper.check,
            on_step=lambda step, loss, grad_norm, aux: losses.append(loss.item()),
            time_budget_s=run.time_budget,
            handle_signals=handle_signals,
            progress=progress,
            progress_desc=f"{split.series.name} {run.model} H={run.horizon}",
            progress_leave=False,
            failure_hint=lambda: f"forecaster {run.model} at horizon {run.horizon} (try a lower lr)",
        )
        done = stopper.loop.run()
        stopped_by = stopper.finish(done)
        steps_done = done.step
    train_s = stopper.train_seconds
    model.load_state_dict(stopper.best_state)
    m = evaluate(model, test)
    metrics = {
        "test_mse": m["mse"],
        "test_mae": m["mae"],
        "test_windows": m["windows"],
        "val_mse": stopper.best,
        "best_step": stopper.best_step,
        "best_seconds": stopper.best_seconds,
        "steps_done": steps_done,
        "improving_at_end": bool(params) and stopper.best_step == steps_done,
        "final_train_loss": float(np.mean(losses[-10:])) if losses else None,
        "train_seconds": train_s,
        "parameters": sum(p.numel() for p in params),
    }
    if stopped_by is not None:
        metrics["stopped_by"] = stopped_by
    return ForecastResult(run, model, metrics)


def series_digest(values: np.ndarray) -> str:
    """SHA-256 of a series' values (T, C) as float64: `forecast eval` compares it with the training run's."""
    return hashlib.sha256(np.ascontiguousarray(values, dtype=np.float64).tobytes()).hexdigest()


def run_record(split: SeriesSplit, result: ForecastResult) -> dict:
    """The JSON record of one trained forecaster."""
    return {
        "series": split.series.name,
        "source": split.series.source,
        "channels": list(split.series.channels),
        "steps_total": len(split.series.values),
        "values_sha256": series_digest(split.series.values),
        "protocol": split.protocol,
        "lookback": split.lookback,
        "borders": [list(b) for b in split.borders],
        "run": asdict(result.run),
        **result.metrics,
    }


def plot_forecasts(
    path,
    windows: ForecastWindows,
    models: dict[str, nn.Module],
    title: str,
    index: int | None = None,
    channels: tuple[str, ...] = (),
    show: int = 3,
    scaler: StandardScaler | None = None,
) -> None:
    """A PNG of one test window: the lookback, the truth and each model's forecast, for ``show`` channels.

    With the split's ``scaler`` the values are drawn in the series' own units (the channel names carry
    them, e.g. "GHI (W/m^2)"); without, they stay standardised and the labels say so, without units."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = len(windows) // 2 if index is None else index
    n = min(show, windows.part.shape[1])
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.4 * n), sharex=True, squeeze=False)
    preds = {name: predict(m, windows, index) for name, m in models.items()}
    if scaler is not None:
        preds = {name: tuple(scaler.inverse(v) for v in xyp) for name, xyp in preds.items()}
    x, y, _ = next(iter(preds.values()))
    L, H = len(x), len(y)
    for c in range(n):
        ax = axes[c, 0]
        ylabel = channels[c] if c < len(channels) else f"channel {c}"
        if scaler is None:  # a unit in the name would be false for standardised values
            ylabel = re.sub(r"\s*\([^)]*\)\s*$", "", ylabel) + " (standardised)"
        ax.plot(range(L), x[:, c], color="black", lw=1, label="lookback")
        ax.plot(range(L, L + H), y[:, c], color="black", lw=1, ls="--", label="truth")
        for name, (_, _, p) in preds.items():
            ax.plot(range(L, L + H), p[:, c], lw=1, label=name)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlabel("time step (lookback, then forecast)", fontsize=8)
        ax.axvline(L - 0.5, color="grey", lw=0.5)
    axes[0, 0].legend(fontsize=7, ncol=len(preds) + 2)
    axes[0, 0].set_title(title, fontsize=9)
    save_plot(fig, path, dpi=90)
    plt.close(fig)


__all__ = [
    "ForecastResult",
    "ForecastRun",
    "evaluate",
    "plot_forecasts",
    "predict",
    "run_record",
    "series_digest",
    "train_forecaster",
]
