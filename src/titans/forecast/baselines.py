"""Forecasting baselines from outside this package, behind the package's forecaster interface.

Every model here maps the same input as the Titans forecasters, a lookback window x (B, L, C) of the
standardised series (``titans.data.series``: the same windows, split borders and training-part scaler),
to a forecast (B, H, C), and is trained by the same loop (``titans.forecast.train``): only the model
differs.

- ``SeasonalNaive`` (``"seasonal-naive"``): repeats the last ``period`` steps of the lookback (24 for hourly
  data); no parameters, no training. The floor every model has to clear.
- ``PatchTSTAdapter`` (``"patchtst"``): transformers' ``PatchTSTForPrediction`` (Nie et al., 2023; patches
  of 16 steps, stride 8, channel-independent, its own per-window standardisation); needs the ``hf`` extra.
- ``NeuralForecastAdapter``: modules of Nixtla's neuralforecast (the ``forecast`` extra) at their default
  sizes. The univariate ones (``"nf-dlinear"``, ``"nf-nlinear"``, ``"nf-nhits"``) are called channel by
  channel on the windows (each channel one series, as in their own training); the multivariate ones
  (``"nf-itransformer"``, ``"nf-tsmixer"``) get all the channels at once, as their ``n_series``.
  neuralforecast's trainer, data loaders and scalers are not used.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

NEURALFORECAST_MODELS = {
    "nf-dlinear": "DLinear",
    "nf-nlinear": "NLinear",
    "nf-nhits": "NHITS",
    "nf-itransformer": "iTransformer",
    "nf-tsmixer": "TSMixer",
}
EXTERNAL_BASELINES = ("seasonal-naive", "patchtst", *NEURALFORECAST_MODELS)


def check_window(x: Tensor, lookback: int, channels: int, who: str) -> None:
    """Refuse an input that is not (batch, lookback, channels)."""
    if x.dim() != 3 or x.shape[1] != lookback or x.shape[2] != channels:
        raise ValueError(f"{who}: expected (batch, {lookback}, {channels}), got {tuple(x.shape)}")


class SeasonalNaive(nn.Module):
    """x (B, L, C) -> (B, H, C): step t of the forecast is x[L - period + (t mod period)]."""

    def __init__(self, lookback: int, horizon: int, channels: int, period: int = 24):
        super().__init__()
        if not 1 <= period <= lookback:
            raise ValueError(f"seasonal-naive: period must be in 1..lookback ({lookback}), got {period}")
        self.lookback, self.horizon, self.channels, self.period = lookback, horizon, channels, period
        self.register_buffer("index", lookback - period + torch.arange(horizon) % period, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        check_window(x, self.lookback, self.channels, "SeasonalNaive")
        return x[:, self.index]


class PatchTSTAdapter(nn.Module):
    """x (B, L, C) -> (B, H, C) through ``transformers.PatchTSTForPrediction`` (width ``dim``, ``depth``
    encoder layers, ``heads`` heads, feed-forward 4 * ``dim``)."""

    def __init__(self, lookback: int, horizon: int, channels: int, dim: int, depth: int, heads: int):
        super().__init__()
        try:
            from transformers import PatchTSTConfig, PatchTSTForPrediction
        except ImportError as e:
            raise ImportError("the patchtst baseline needs transformers: pip install 'titans[hf]'") from e
        if dim % heads:
            raise ValueError(f"patchtst: dim ({dim}) must be divisible by heads ({heads})")
        if lookback < 2:
            raise ValueError(
                f"patchtst: --lookback must be >= 2 (a patch shorter than the window), got {lookback}"
            )
        self.lookback, self.horizon, self.channels = lookback, horizon, channels
        patch = min(16, lookback - 1)  # PatchTST needs a patch shorter than the window (two patches at least)
        config = PatchTSTConfig(
            num_input_channels=channels,
            context_length=lookback,
            prediction_length=horizon,
            patch_length=patch,
            patch_stride=max(1, patch // 2),
            d_model=dim,
            num_hidden_layers=depth,
            num_attention_heads=heads,
            ffn_dim=4 * dim,
        )
        self.model = PatchTSTForPrediction(config)

    def forward(self, x: Tensor) -> Tensor:
        check_window(x, self.lookback, self.channels, "PatchTSTAdapter")
        return self.model(past_values=x).prediction_outputs


class NeuralForecastAdapter(nn.Module):
    """x (B, L, C) -> (B, H, C) through one of neuralforecast's models (``NEURALFORECAST_MODELS``): a
    univariate one applied to each of the C channels as a series of its own, (B * C, L, 1) ->
    (B * C, H, 1); a multivariate one to the C channels together, (B, L, C) -> (B, H, C)."""

    def __init__(self, name: str, lookback: int, horizon: int, channels: int, seed: int = 0):
        super().__init__()
        try:
            import neuralforecast.models as nf

            # its constructors announce the seed they set on every call
            logging.getLogger("lightning_fabric.utilities.seed").setLevel(logging.WARNING)
        except ImportError as e:
            raise ImportError(
                f"the {name} baseline needs neuralforecast: pip install 'titans[forecast]'"
            ) from e
        self.lookback, self.horizon, self.channels = lookback, horizon, channels
        cls = getattr(nf, NEURALFORECAST_MODELS[name])
        self.multivariate = bool(getattr(cls, "MULTIVARIATE", False))
        extra = {"n_series": channels} if self.multivariate else {}
        # max_steps etc. only configure neuralforecast's own trainer, which is not used here
        self.model = cls(
            h=horizon, input_size=lookback, random_seed=seed, max_steps=1, enable_progress_bar=False, **extra
        )

    def forward(self, x: Tensor) -> Tensor:
        check_window(x, self.lookback, self.channels, "NeuralForecastAdapter")
        b, length, c = x.shape
        series = x if self.multivariate else x.transpose(1, 2).reshape(b * c, length, 1)
        batch = {
            "insample_y": series,
            "insample_mask": torch.ones_like(series),
            "futr_exog": None,
            "hist_exog": None,
            "stat_exog": None,
        }
        y = self.model(batch)  # (B, H, C), or (B * C, H, 1)
        return y if self.multivariate else y.reshape(b, c, self.horizon).transpose(1, 2)


def build_baseline(
    name: str,
    *,
    lookback: int,
    horizon: int,
    channels: int,
    dim: int,
    depth: int,
    heads: int,
    period: int,
    seed: int = 0,
) -> nn.Module:
    """An external baseline by name (``EXTERNAL_BASELINES``)."""
    if name == "seasonal-naive":
        return SeasonalNaive(lookback, horizon, channels, period)
    if name == "patchtst":
        return PatchTSTAdapter(lookback, horizon, channels, dim, depth, heads)
    if name in NEURALFORECAST_MODELS:
        return NeuralForecastAdapter(name, lookback, horizon, channels, seed)
    raise ValueError(f"unknown baseline {name!r}; expected one of {', '.join(EXTERNAL_BASELINES)}")


__all__ = [
    "EXTERNAL_BASELINES",
    "NEURALFORECAST_MODELS",
    "NeuralForecastAdapter",
    "PatchTSTAdapter",
    "SeasonalNaive",
    "build_baseline",
    "check_window",
]
