"""Forecasting: series loaders on fixtures in the published formats, the split and the scaler (no test data),
model shapes and causality, training end to end, and clear errors on bad series."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from titans.data.series import Series, load_series, read_series_csv, split_series
from titans.forecast.model import FORECAST_MODELS, build_forecaster
from titans.forecast.train import ForecastRun, evaluate, train_forecaster

pd = pytest.importorskip("pandas")


def _write_csv(path, n: int, channels: list[str], freq: str = "h", date: str = "date", seed: int = 0):
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    data = {date: pd.date_range("2016-07-01", periods=n, freq=freq).strftime("%Y-%m-%d %H:%M:%S")}
    for i, c in enumerate(channels):
        data[c] = np.round(np.sin(2 * np.pi * t / 24 + i) + 0.1 * rng.standard_normal(n) + i, 3)
    pd.DataFrame(data).to_csv(path, index=False)
    return path


ETT = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]


def test_ett_csv_and_the_12_4_4_month_split(tmp_path):
    # ETTh1's published form: date, six load columns, OT; 20 months of hours (the protocol's borders)
    n = 20 * 30 * 24 + 5
    s = read_series_csv(_write_csv(tmp_path / "ETTh1.csv", n, ETT))
    assert s.channels == tuple(ETT) and s.values.shape == (n, 7)
    sp = split_series(s, lookback=96)
    month = 30 * 24
    assert sp.protocol == "ett-hour"
    assert sp.borders == ((0, 12 * month), (12 * month - 96, 16 * month), (16 * month - 96, 20 * month))
    # ETTm: 15-minute steps, four times the months' steps
    m = read_series_csv(_write_csv(tmp_path / "ETTm2.csv", 4 * n, ETT, freq="15min"))
    assert split_series(m, lookback=96).borders[0] == (0, 4 * 12 * month)


def test_weather_style_csv_ratio_split_and_column_choice(tmp_path):
    # Weather / ECL / Traffic: any date column name, many channels, 7:1:2 split
    path = _write_csv(tmp_path / "weather.csv", 1001, ["p (mbar)", "T (degC)", "rh (%)", "OT"])
    s = load_series(str(path), columns=["T (degC)", "OT"])
    assert s.channels == ("T (degC)", "OT")
    sp = split_series(s, lookback=24)
    assert sp.protocol == "ratio"
    n_train, n_test = int(1001 * 0.7), int(1001 * 0.2)
    assert sp.borders == ((0, n_train), (n_train - 24, 1001 - n_test), (1001 - n_test - 24, 1001))
    train, val, test = sp.windows(horizon=12)
    # the first test window predicts the first step after the val/test border
    x, y = test.batch(np.array([0]))
    raw_first_target = sp.scaler.transform(s.values[1001 - n_test : 1001 - n_test + 12])
    np.testing.assert_allclose(y[0], raw_first_target, rtol=1e-5, atol=1e-5)
    assert len(test) == n_test - 12 + 1


def test_scaler_sees_training_data_only():
    # the test part is extreme (1e6): a scaler fitted on it would give the train part a huge std
    n = 1000
    values = np.random.default_rng(1).standard_normal((n, 3))
    values[int(n * 0.8) :] = 1e6
    sp = split_series(Series("x", values, ("a", "b", "c"), "memory"), lookback=10)
    np.testing.assert_allclose(sp.scaler.mean, values[:700].mean(0))
    np.testing.assert_allclose(sp.scaler.std, values[:700].std(0))
    train = sp.part("train")
    assert abs(train.mean()) < 1e-6 and abs(train.std() - 1) < 1e-4
    assert sp.part("test").max() > 1e5  # the extreme part, standardised by the training statistics


@pytest.mark.parametrize("name", FORECAST_MODELS)
def test_model_shapes_and_causality(name):
    # awkward sizes: lookback 48, horizon 7, 5 channels
    torch.manual_seed(0)
    model = build_forecaster(name, lookback=48, horizon=7, channels=5, dim=16, depth=1, heads=2)
    model.eval()
    series = torch.randn(1, 48 + 30, 5)
    y = model(series[:, :48])
    assert y.shape == (1, 7, 5)
    # whatever follows the lookback cannot change a prediction
    future = series.clone()
    future[:, 48:] += 100.0
    torch.testing.assert_close(model(future[:, :48]), y, rtol=0, atol=0)
    # ... and a change inside the lookback does change it
    inside = series.clone()
    inside[:, 40, 2] += 3.0
    assert not torch.allclose(model(inside[:, :48]), y)
    with pytest.raises(ValueError, match=r"expected \(batch, 48, 5\)"):
        model(series[:, :47])


def test_windows_do_not_reach_past_the_lookback():
    # ForecastWindows' x for window i is part[i : i + L]; perturbing part[i + L :] leaves x unchanged
    values = np.random.default_rng(2).standard_normal((400, 2))
    sp = split_series(Series("w", values, ("a", "b"), "m"), lookback=20)
    train, _, _ = sp.windows(horizon=5)
    x0, y0 = train.batch(np.array([10]))
    part = train.part.copy()
    part[30:] += 50.0
    x1, y1 = type(train)(part, 20, 5).batch(np.array([10]))
    np.testing.assert_array_equal(x0, x1)
    assert not np.array_equal(y0, y1)


def test_bad_series_errors(tmp_path):
    path = _write_csv(tmp_path / "ETTh2.csv", 200, ["a", "b"])
    frame = pd.read_csv(path)
    frame.loc[17, "b"] = np.nan
    frame.to_csv(tmp_path / "nan.csv", index=False)
    with pytest.raises(ValueError, match=r"step 17, channel 'b'"):
        read_series_csv(tmp_path / "nan.csv")
    frame.loc[17, "b"] = 1.0
    frame["b"] = frame["b"].astype(object)
    frame.loc[23, "b"] = "n/a?"
    frame.to_csv(tmp_path / "text.csv", index=False)
    with pytest.raises(ValueError, match=r"non-numeric value 'n/a\?' in column 'b' at data row 23"):
        read_series_csv(tmp_path / "text.csv")
    # too short for the ETT protocol, and too short for a lookback + horizon
    with pytest.raises(ValueError, match="needs 14400 steps"):
        split_series(read_series_csv(path), lookback=96)
    sp = split_series(read_series_csv(path), lookback=24, protocol="ratio")
    with pytest.raises(ValueError, match=r"val part .* too short for lookback 24 \+ horizon 96"):
        sp.windows(horizon=96)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_series_csv(tmp_path / "missing.csv")


def test_train_eval_and_cli(tmp_path):
    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 700, ["MT_001", "MT_002", "MT_003"])
    sp = split_series(read_series_csv(path), lookback=32)
    res = train_forecaster(
        sp, ForecastRun(model="lmm", horizon=8, steps=3, eval_every=2, dim=16, depth=1, heads=2)
    )
    again = evaluate(res.model, sp.windows(8)[2])
    assert res.metrics["test_mse"] == pytest.approx(again["mse"]) and np.isfinite(again["mae"])
    out = tmp_path / "run"
    argv = [
        "forecast",
        "train",
        "--series",
        str(path),
        "--model",
        "linear",
        "--lookback",
        "32",
        "--horizon",
        "8",
        "--steps",
        "5",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    rec = json.loads((out / "result.json").read_text())
    assert rec["run"]["model"] == "linear" and (out / "forecast.png").stat().st_size > 0
    assert main(["forecast", "eval", "--run", str(out)]) == 0


def test_tmy3_from_pvlib():
    pytest.importorskip("pvlib")
    s = load_series("tmy3:greensboro")
    assert s.values.shape == (8760, 8) and np.isfinite(s.values).all()
    # Sand Point's pressure never changes in the file: dropped rather than standardised by a zero std
    assert "Pressure (mbar)" not in load_series("tmy3:sand-point").channels
