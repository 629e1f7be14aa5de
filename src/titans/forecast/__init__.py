"""Long-horizon time-series forecasting with Titans backbones (docs/domains.md)."""

from titans.forecast.model import FORECAST_MODELS, DLinear, RevIN, TitansForecaster, build_forecaster
from titans.forecast.train import ForecastResult, ForecastRun, evaluate, train_forecaster

__all__ = [
    "FORECAST_MODELS",
    "DLinear",
    "ForecastResult",
    "ForecastRun",
    "RevIN",
    "TitansForecaster",
    "build_forecaster",
    "evaluate",
    "train_forecaster",
]
