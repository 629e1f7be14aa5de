"""Forecasting models: (batch, lookback, channels) -> (batch, horizon, channels).

- ``TitansForecaster``: a Titans backbone (any variant of the registry: lmm, mac, mag, mal, or the baselines
  transformer and swa) over the lookback. Each time step is one token: its C channel values are mixed by a
  linear input projection to ``dim`` (channel-mixing, no positional embedding: the memory is recurrent and
  the attention has rotary positions). The blocks run causally over the lookback; a linear map back to C
  channels gives a representation r (B, L, C), and one linear map along time, shared by the channels,
  takes r's L steps to the H predicted ones (the DLinear-style head, on learned features instead of raw
  values). Optional RevIN-style instance normalisation: each window is standardised by its own lookback
  mean and std per channel, and predictions are mapped back (Kim et al., 2022).
- ``DLinear``: the linear baseline (Zeng et al., 2023): a moving-average trend / remainder split of the
  lookback and one linear map along time for each, shared by the channels.

The external baselines (PatchTST, neuralforecast's models, seasonal-naive) are in
``titans.forecast.baselines``; ``build_forecaster`` builds any of them by name.

No model sees anything after its lookback: the input is the lookback window alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titans.forecast.baselines import EXTERNAL_BASELINES, build_baseline, check_window
from titans.layers.norm import RMSNorm
from titans.models.blocks import IdentityInitGate
from titans.models.config import VARIANTS, TitansConfig
from titans.models.variants import make_block

FORECAST_MODELS = ("linear", *VARIANTS, *EXTERNAL_BASELINES)


class RevIN(nn.Module):
    """Instance normalisation per window and channel, with a learned affine map (and its inverse)."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def normalize(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (B, L, C) -> normalised x, (mean, std) each (B, 1, C)."""
        mean = x.mean(dim=1, keepdim=True).detach()
        std = (x.var(dim=1, keepdim=True, unbiased=False) + self.eps).sqrt().detach()
        return (x - mean) / std * self.weight + self.bias, (mean, std)

    def denormalize(self, y: Tensor, stats: tuple[Tensor, Tensor]) -> Tensor:
        """y (B, H, C) -> y in the scale of the input window."""
        mean, std = stats
        return (y - self.bias) / (self.weight + self.eps * self.eps) * std + mean


class DLinear(nn.Module):
    """x (B, L, C) -> (B, H, C): trend (moving average, kernel ``kernel``) and remainder, one Linear(L, H)
    each, shared by the channels."""

    def __init__(self, lookback: int, horizon: int, channels: int, kernel: int = 25):
        super().__init__()
        self.lookback, self.horizon, self.channels, self.kernel = lookback, horizon, channels, kernel
        self.trend = nn.Linear(lookback, horizon)
        self.seasonal = nn.Linear(lookback, horizon)

    def forward(self, x: Tensor) -> Tensor:
        check_window(x, self.lookback, self.channels, "DLinear")
        k = self.kernel
        xt = x.transpose(1, 2)  # (B, C, L)
        # replicate padding keeps the average length L and uses lookback values only
        padded = F.pad(xt, ((k - 1) // 2, k // 2), mode="replicate")
        trend = F.avg_pool1d(padded, k, stride=1)
        return (self.trend(trend) + self.seasonal(xt - trend)).transpose(1, 2)


class TitansForecaster(nn.Module):
    """x (B, L, C) -> (B, H, C) through a Titans backbone (see the module docstring)."""

    def __init__(self, config: TitansConfig, lookback: int, horizon: int, channels: int, revin: bool = True):
        super().__init__()
        self.config, self.lookback, self.horizon, self.channels = config, lookback, horizon, channels
        self.revin = RevIN(channels) if revin else None
        self.embed = nn.Linear(channels, config.dim)
        self.blocks = nn.ModuleList(make_block(config, i) for i in range(config.depth))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.to_channels = nn.Linear(config.dim, channels)
        self.time_head = nn.Linear(lookback, horizon)
        for module in self.modules():  # MAC's output gate starts as the identity
            if isinstance(module, IdentityInitGate):
                module.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        check_window(x, self.lookback, self.channels, "TitansForecaster")
        stats = None
        if self.revin is not None:
            x, stats = self.revin.normalize(x)
        h = self.embed(x)
        for block in self.blocks:
            h, _ = block(h, None, None)
        r = self.to_channels(self.norm(h))  # (B, L, C)
        y = self.time_head(r.transpose(1, 2)).transpose(1, 2)  # (B, H, C)
        return self.revin.denormalize(y, stats) if self.revin is not None else y


def build_forecaster(
    model: str,
    *,
    lookback: int,
    horizon: int,
    channels: int,
    dim: int = 32,
    depth: int = 2,
    heads: int = 4,
    chunk_size: int = 16,
    segment_len: int = 32,
    window: int = 32,
    revin: bool = True,
    period: int = 24,
    seed: int = 0,
) -> nn.Module:
    """A forecaster by name (``FORECAST_MODELS``): ``"linear"`` (DLinear), a Titans variant, or an external
    baseline (``titans.forecast.baselines``: ``dim``/``depth``/``heads`` size PatchTST too, ``period`` is
    the seasonal-naive period, ``seed`` neuralforecast's model seed)."""
    if model not in FORECAST_MODELS:
        raise ValueError(f"unknown forecasting model {model!r}; expected one of {', '.join(FORECAST_MODELS)}")
    if lookback < 1 or horizon < 1 or channels < 1:
        raise ValueError(
            f"lookback, horizon and channels must be >= 1, got {lookback}, {horizon}, {channels}"
        )
    if model == "linear":
        return DLinear(lookback, horizon, channels)
    if model in EXTERNAL_BASELINES:
        return build_baseline(
            model,
            lookback=lookback,
            horizon=horizon,
            channels=channels,
            dim=dim,
            depth=depth,
            heads=heads,
            period=period,
            seed=seed,
        )
    cfg = TitansConfig(
        variant=model,
        vocab_size=1,
        dim=dim,
        depth=depth,
        heads=heads,
        chunk_size=chunk_size,
        segment_len=segment_len,
        window=window,
        persistent_tokens=4,
        name=f"forecast-{model}",
    )
    return TitansForecaster(cfg, lookback, horizon, channels, revin=revin)


__all__ = ["FORECAST_MODELS", "DLinear", "RevIN", "TitansForecaster", "build_forecaster"]
