"""Forecasting: series loaders on fixtures in the published formats, the split and the scaler (no test data),
model shapes and causality, training end to end, and clear errors on bad series."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from titans.data.series import BUNDLED_SERIES, Series, load_series, read_series_csv, split_series
from titans.forecast.baselines import NEURALFORECAST_MODELS
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


def _needs(name: str) -> None:
    """Skip a test of an external baseline whose library is not installed."""
    if name == "patchtst":
        pytest.importorskip("transformers")
    if name.startswith("nf-"):
        pytest.importorskip("neuralforecast")


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
    _needs(name)
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
    inside[:, 30, 2] += 3.0  # a step seasonal-naive (period 24, horizon 7) repeats
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
        "--max-steps",
        "5",
        "--val-every",
        "2",
        "--patience",
        "1",
        "--time-budget",
        "60",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    rec = json.loads((out / "result.json").read_text())
    assert rec["run"]["model"] == "linear" and (out / "forecast.png").stat().st_size > 0
    assert rec["run"]["patience"] == 1 and rec["run"]["eval_every"] == 2 and rec["run"]["time_budget"] == 60
    assert rec["run"]["steps"] == 5 and rec["steps_done"] <= 5 and rec["best_step"] <= rec["steps_done"]
    assert main(["forecast", "eval", "--run", str(out)]) == 0


def test_eval_rebuilds_the_trained_model_and_names_a_damaged_file(tmp_path, capsys):
    """`forecast eval` re-measures what `forecast train` measured: the seasonal-naive forecaster with its
    trained period (eval built it with the default period of 24, silently); a damaged model.pt is named."""
    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 700, ["MT_001", "MT_002"])
    out = tmp_path / "run"
    common = ["--series", str(path), "--lookback", "32", "--horizon", "8", "--no-progress"]
    assert (
        main(["forecast", "train", *common, "--model", "seasonal-naive", "--period", "12", "--out", str(out)])
        == 0
    )
    trained = json.loads((out / "result.json").read_text())
    capsys.readouterr()
    assert main(["forecast", "eval", "--run", str(out)]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["mse"] == pytest.approx(trained["test_mse"], rel=1e-9)
    assert again["mae"] == pytest.approx(trained["test_mae"], rel=1e-9)
    (out / "model.pt").write_bytes((out / "model.pt").read_bytes()[:200])
    assert main(["forecast", "eval", "--run", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("titans forecast eval: error: ") and "model.pt is damaged" in err


def test_a_second_writer_into_one_out_folder_is_refused(tmp_path, capsys):
    """Two `forecast train` into one --out both ran: each file is written whole, but the last to finish
    could leave one run's weights beside the other's result. A train and a study hold a lock on --out."""
    from titans._fs import lock_folder
    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 700, ["MT_001", "MT_002"])
    out = tmp_path / "new" / "run"  # not made yet: the lock makes it
    common = ["--series", str(path), "--lookback", "32", "--horizon", "8", "--no-progress"]
    train = ["forecast", "train", *common, "--model", "linear", "--steps", "2", "--out", str(out)]
    assert main(train) == 0
    before = (out / "model.pt").read_bytes()
    study = ["forecast", "study", "--series", str(path), "--models", "linear", "--horizons", "8"]
    study += ["--lookback", "32", "--steps", "2", "--no-progress", "--out", str(out)]
    with lock_folder(out, "held"):
        assert main([*train[:-4], "--steps", "3", "--out", str(out)]) == 2
        assert "is in use: another forecast train writes it" in capsys.readouterr().err
        assert main(study) == 2
        assert "is in use: another forecast study writes it" in capsys.readouterr().err
    assert (out / "model.pt").read_bytes() == before
    assert main(train) == 0  # released


def test_eval_refuses_a_model_whose_weights_were_flipped(tmp_path, capsys):
    """Bytes flipped inside a tensor of model.pt loaded (torch's zip reader checks no CRC) and were scored
    as the trained model; the weights' digest saved beside them finds it."""
    import zipfile

    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 700, ["MT_001", "MT_002"])
    out, model = tmp_path / "run", tmp_path / "run" / "model.pt"
    common = ["--series", str(path), "--lookback", "32", "--horizon", "8", "--no-progress"]
    assert main(["forecast", "train", *common, "--model", "linear", "--steps", "2", "--out", str(out)]) == 0
    with zipfile.ZipFile(model) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(model.read_bytes())
    at = info.header_offset  # the local header: 30 bytes, then the name and extra field, then the data
    start = (
        at
        + 30
        + int.from_bytes(raw[at + 26 : at + 28], "little")
        + int.from_bytes(raw[at + 28 : at + 30], "little")
    )
    raw[start + info.file_size // 2] ^= 0x40
    model.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["forecast", "eval", "--run", str(out)]) == 2
    assert "model.pt is damaged" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, want",
    [
        (dict(n=700, channels=["MT_001", "MT_003"]), "channels ['MT_001', 'MT_003'] where training had"),
        (dict(n=760, channels=["MT_001", "MT_002"]), "760 steps where training had 700"),
        (dict(n=700, channels=["MT_001", "MT_002"], seed=1), "its values changed since training"),
        (dict(n=700, channels=["MT_001", "MT_002", "MT_003"]), "channels"),  # the LMM raised a traceback
    ],
    ids=["renamed", "longer", "values", "more-channels"],
)
def test_eval_refuses_a_series_changed_since_training(tmp_path, capsys, change, want):
    """`forecast eval` reads the series again from the path training recorded: a CSV rewritten since then
    was scored as if it were the trained-on test set (other numbers under this run's name)."""
    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 700, ["MT_001", "MT_002"])
    out = tmp_path / "run"
    common = ["--series", str(path), "--lookback", "32", "--horizon", "8", "--no-progress"]
    tiny = ["--max-steps", "1", "--dim", "16", "--depth", "1", "--heads", "2"]
    assert main(["forecast", "train", *common, "--model", "lmm", *tiny, "--out", str(out)]) == 0
    _write_csv(path, change.pop("n"), change.pop("channels"), **change)
    capsys.readouterr()
    assert main(["forecast", "eval", "--run", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err.startswith("titans forecast eval: error: ") and "is not the one this model was trained on" in err
    )
    assert want in err, err


def test_a_csv_whose_dates_go_back_in_time_is_refused(tmp_path):
    """A CSV sorted by value or shuffled was read in file order: windows mixed times, and the chronological
    split tested on the past. Dates that do not parse (an index, labels) are not checked."""
    path = _write_csv(tmp_path / "ecl.csv", 60, ["a", "b"])
    frame = pd.read_csv(path)
    frame.iloc[[20, 21]] = frame.iloc[[21, 20]].to_numpy()
    frame.to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"goes back in time at data row 21 \('2016-07-01 20:00:00' after"):
        read_series_csv(path)
    frame["date"] = [f"t{i}" for i in range(60)]
    frame.to_csv(path, index=False)
    assert read_series_csv(path).values.shape == (60, 2)


def test_tmy3_from_pvlib():
    pytest.importorskip("pvlib")
    s = load_series("tmy3:greensboro")
    assert s.values.shape == (8760, 8) and np.isfinite(s.values).all()
    # Sand Point's pressure never changes in the file: dropped rather than standardised by a zero std
    assert "Pressure (mbar)" not in load_series("tmy3:sand-point").channels


def test_every_bundled_series_loads_and_splits():
    # the real files inside the installed pvlib: shape, channels, units and the 7:1:2 split at horizon 720
    pytest.importorskip("pvlib")
    assert BUNDLED_SERIES == ("tmy3:greensboro", "tmy3:sand-point", "tmy2:miami", "soiling:imperial-county")
    for spec in BUNDLED_SERIES:
        s = load_series(spec)
        assert len(s.values) == 8760 and np.isfinite(s.values).all(), spec
        assert (s.values.std(axis=0) > 0).all(), spec  # no constant channel
        train, val, test = split_series(s, lookback=96).windows(720)
        assert (len(train), len(val), len(test)) == (5317, 157, 1033), spec
    miami = load_series("tmy2:miami")
    assert miami.channels == load_series("tmy3:greensboro").channels
    t = dict(zip(miami.channels, miami.values.T))
    # the file's tenths of a degree / of a m/s are converted: Miami's air is 3-34 C, its wind under 14 m/s
    assert t["Dry-bulb (C)"].min() >= 3 and t["Dry-bulb (C)"].max() <= 34 and t["Wspd (m/s)"].max() < 14
    assert t["Dew-point (C)"].max() < t["Dry-bulb (C)"].max() and 1000 < t["Pressure (mbar)"].mean() < 1030
    soil = load_series("soiling:imperial-county")
    assert soil.channels == ("rain (mm)", "PM2.5 (g/m^3)", "PM10 (g/m^3)")
    assert int((soil.values[:, 0] > 0).sum()) == 80 and soil.values[:, 1].mean() < soil.values[:, 2].mean()
    with pytest.raises(ValueError, match="unknown tmy2 site 'paris'; expected one of miami"):
        load_series("tmy2:paris")


def test_external_baselines_receive_exactly_the_titans_windows(monkeypatch):
    # Every model is wrapped so that it records its inputs; all of them must see the same training batches,
    # the whole validation part and the whole test part, cut at the protocol's borders and standardised
    # by the training part's statistics. The test part is shifted by 50: a scaler fitted on anything but
    # the training part would give other values.
    import titans.forecast.train as train_module

    n, lookback, horizon, batch = 600, 32, 8, 16
    values = np.random.default_rng(3).standard_normal((n, 3)).cumsum(0)
    values[int(n * 0.8) :] += 50.0
    sp = split_series(Series("w", values, ("a", "b", "c"), "memory"), lookback=lookback, protocol="ratio")
    n_train, n_test = int(n * 0.7), int(n * 0.2)
    mean, std = values[:n_train].mean(0), values[:n_train].std(0)

    def windows(lo: int, hi: int) -> np.ndarray:  # every lookback window of values[lo:hi], by hand
        part = (values[lo:hi] - mean) / std
        return np.stack([part[i : i + lookback] for i in range(hi - lo - lookback - horizon + 1)])

    expected_val = windows(n_train - lookback, n - n_test)
    expected_test = windows(n - n_test - lookback, n)
    draws = np.random.default_rng(0)  # the batch order of seed 0
    train_windows = windows(0, n_train)
    expected_train = [train_windows[draws.integers(0, len(train_windows), batch)] for _ in range(4)]

    class Recorder(nn.Module):
        def __init__(self, inner: nn.Module, log: list):
            super().__init__()
            self.inner, self.log = inner, log

        def forward(self, x):
            self.log.append((self.training, x.detach().clone().numpy()))
            return self.inner(x)

    seen: dict[str, list] = {}
    build = train_module.build_forecaster
    monkeypatch.setattr(
        train_module,
        "build_forecaster",
        lambda name, **kw: Recorder(build(name, **kw), seen.setdefault(name, [])),
    )
    names = ("lmm", "linear", "patchtst", *NEURALFORECAST_MODELS, "seasonal-naive")
    for name in names:
        _needs(name)
    for name in names:
        run = ForecastRun(
            name, horizon=horizon, steps=4, batch_size=batch, eval_every=2, dim=16, depth=1, heads=2
        )
        train_forecaster(sp, run)
    for name in names:
        trained = [x for training, x in seen[name] if training]
        # evaluation passes: one batch each here (fewer than 256 windows); val at 0, 2, 4, then the test
        passes = [x for training, x in seen[name] if not training]
        if name == "seasonal-naive":  # no parameters: not trained, validated once
            assert trained == [] and len(passes) == 2
        else:
            assert len(trained) == 4 and len(passes) == 4
            for got, want in zip(trained, expected_train):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        for got in passes[:-1]:
            np.testing.assert_allclose(got, expected_val, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(passes[-1], expected_test, rtol=1e-6, atol=1e-6)
        # identical, not merely close, to what the Titans model got
        titans_trained = [x for training, x in seen["lmm"] if training]
        titans_passes = [x for training, x in seen["lmm"] if not training]
        for x0, x1 in [
            *zip(titans_trained, trained),
            (titans_passes[0], passes[0]),
            (titans_passes[-1], passes[-1]),
        ]:
            np.testing.assert_array_equal(x0, x1)


def test_early_stopping_budgets_and_the_best_weights():
    values = np.random.default_rng(4).standard_normal((500, 2))
    sp = split_series(Series("w", values, ("a", "b"), "memory"), lookback=24, protocol="ratio")
    small = dict(horizon=6, dim=16, depth=1, heads=2, eval_every=1)
    # lr 0: the validation loss never improves on the untrained model; patience 3 stops at step 3
    res = train_forecaster(sp, ForecastRun("linear", steps=50, lr=0.0, patience=3, **small))
    assert res.metrics["stopped_by"] == "early stopping" and res.metrics["steps_done"] == 3
    assert res.metrics["best_step"] == 0 and not res.metrics["improving_at_end"]
    # the weights returned are those of the best validation check
    res = train_forecaster(sp, ForecastRun("linear", steps=20, lr=0.3, patience=2, **small))
    val = sp.windows(6)[1]
    assert evaluate(res.model, val)["mse"] == pytest.approx(res.metrics["val_mse"], rel=1e-9)
    assert 0 <= res.metrics["best_step"] <= res.metrics["steps_done"] and res.metrics["best_seconds"] >= 0
    # a time budget stops after the step it runs out in
    res = train_forecaster(sp, ForecastRun("lmm", steps=50, time_budget=1e-9, **small))
    assert res.metrics["stopped_by"] == "time budget" and res.metrics["steps_done"] == 1
    # the same rules for the external baselines
    _needs("patchtst")
    res = train_forecaster(sp, ForecastRun("patchtst", steps=50, lr=0.0, patience=2, **small))
    assert res.metrics["stopped_by"] == "early stopping" and res.metrics["steps_done"] == 2
    with pytest.raises(ValueError, match="patience must be a positive integer or None, got 0"):
        ForecastRun("lmm", patience=0)
    with pytest.raises(ValueError, match="period must be in 1..lookback"):
        train_forecaster(sp, ForecastRun("seasonal-naive", period=30, **small))


@pytest.mark.parametrize(
    "field, value", [("steps", 2.5), ("horizon", 24.7), ("steps", True), ("batch_size", 0), ("patience", 1.5)]
)
def test_forecast_run_sizes_are_integers(field, value):
    """2.5 steps ran 3 while the result recorded 2.5; a horizon of 24.7 failed in the windowing with a bare
    TypeError; True counted as one step. A numpy integer is an int."""
    with pytest.raises(ValueError, match=rf"ForecastRun\.{field} must be a positive integer"):
        ForecastRun("linear", **{field: value})
    run = ForecastRun("linear", horizon=np.arange(100)[96], steps=np.int32(5))
    assert (run.horizon, run.steps) == (96, 5) and type(run.horizon) is int


def test_a_study_again_into_its_folder_leaves_no_plot_of_the_earlier_one(tmp_path):
    """A study of horizons 7 and 5 run again into its folder for horizon 7 alone (or stopped after it):
    the JSON then held horizon 7, and horizon 5's PNG of the earlier study stayed beside it."""
    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 400, ["MT_001", "MT_002"])
    out = tmp_path / "study"
    argv = ["forecast", "study", "--series", str(path), "--models", "seasonal-naive", "--lookback", "24"]
    argv += ["--no-progress", "--out", str(out)]
    (out / "notes.png").parent.mkdir(parents=True)
    (out / "notes.png").write_bytes(b"not the study's")
    assert main([*argv, "--horizons", "7,5"]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["ecl-H5.png", "ecl-H7.png", "notes.png"]
    assert main([*argv, "--horizons", "7"]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["ecl-H7.png", "notes.png"]
    assert {r["run"]["horizon"] for r in json.loads((out / "ecl.json").read_text())["runs"]} == {7}


def test_study_over_seeds_aggregates_as_numpy_does(tmp_path):
    import shlex

    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 400, ["MT_001", "MT_002"])
    out = tmp_path / "study"
    argv = ["forecast", "study", "--series", str(path), "--models", "seasonal-naive,linear,lmm"]
    argv += ["--horizons", "7,5", "--lookback", "24", "--max-steps", "3", "--val-every", "2", "--dim", "8"]
    argv += ["--depth", "1", "--heads", "2", "--no-progress", "--out", str(out)]
    assert main([*argv, "--seeds", "5,0,3"]) == 0  # main records its own argv (not the process's)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["seed0", "seed3", "seed5"]
    per_seed = {s: json.loads((out / f"seed{s}" / "ecl.json").read_text()) for s in (0, 3, 5)}
    for s, doc in per_seed.items():
        assert {r["run"]["seed"] for r in doc["runs"]} == {s} and doc["budget"]["seed"] == s
        # the command that makes this file alone (the whole study's ran every seed into OUT, not OUT/seedN)
        recorded = shlex.split(doc["command"])
        assert recorded[:3] == ["titans", "forecast", "study"] and "--seeds" not in recorded
        assert recorded[recorded.index("--seed") + 1] == str(s)
        assert recorded[recorded.index("--out") + 1] == str(out / f"seed{s}")
    agg = json.loads((out / "ecl-seeds.json").read_text())
    assert agg["seeds"] == [0, 3, 5] and (out / "ecl-seeds.png").stat().st_size > 0
    assert len(agg["rows"]) == 6  # 2 horizons x 3 models
    for row in agg["rows"]:
        for m in ("mse", "mae"):
            v = np.array(
                [
                    next(
                        r[f"test_{m}"]
                        for r in per_seed[s]["runs"]
                        if (r["run"]["model"], r["run"]["horizon"]) == (row["model"], row["horizon"])
                    )
                    for s in (0, 3, 5)
                ]
            )
            assert row[m]["values"] == pytest.approx(v.tolist(), rel=0, abs=0)
            assert row[m]["mean"] == pytest.approx(v.mean(), rel=1e-12)
            assert row[m]["std"] == pytest.approx(v.std(ddof=1), rel=1e-12, abs=1e-15)
            assert row[m]["se"] == pytest.approx(v.std(ddof=1) / np.sqrt(3), rel=1e-12, abs=1e-15)
            assert (row[m]["min"], row[m]["max"]) == (v.min(), v.max())
        if row["model"] == "linear":  # the seeds were honoured: different initial weights, different results
            assert row["mse"]["std"] > 0 and len(row["best_step"]["values"]) == 3
        if row["model"] == "seasonal-naive":  # nothing to seed
            assert row["mse"]["std"] == pytest.approx(0, abs=1e-12) and "best_step" not in row
    # `aggregate` over the per-seed folders gives the same aggregate, however the inputs are ordered
    again = tmp_path / "again"
    assert (
        main(
            ["forecast", "aggregate", str(out / "seed3"), str(out / "seed5"), str(out / "seed0")]
            + ["--out", str(again)]
        )
        == 0
    )
    agg2 = json.loads((again / "ecl-seeds.json").read_text())
    assert agg2["rows"] == agg["rows"] and agg2["counts"] == agg["counts"]
    # the same seed twice, or --seed with --seeds, is refused
    assert main(["forecast", "aggregate", str(out / "seed3"), str(out / "seed3"), "--out", str(again)]) == 2
    assert main([*argv, "--seeds", "1,2", "--seed", "4"]) == 2
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--seeds", "1,1"])
    assert exit_.value.code == 2


def test_study_refuses_two_series_of_one_name_before_training(tmp_path, capsys, monkeypatch):
    from titans.cli import main
    from titans.forecast import cli as forecast_cli

    def no_training(*a, **k):
        raise AssertionError("trained before every series was checked")

    monkeypatch.setattr(forecast_cli, "train_forecaster", no_training)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _write_csv(tmp_path / "a" / "ecl.csv", 300, ["x"])
    two = _write_csv(tmp_path / "b" / "ecl.csv", 300, ["x"], seed=1)
    argv = ["forecast", "study", "--models", "linear", "--horizons", "5", "--lookback", "24"]
    argv += ["--no-progress", "--out", str(tmp_path / "out")]
    assert main([*argv, "--series", f"{one},{two}"]) == 2
    err = capsys.readouterr().err
    assert str(one) in err and str(two) in err and "ecl" in err
    assert not (tmp_path / "out").exists()


def test_study_strips_series_entries_and_checks_them_all_before_training(tmp_path, capsys, monkeypatch):
    from titans.cli import main
    from titans.forecast import cli as forecast_cli

    def no_training(*a, **k):
        raise AssertionError("trained before every series was checked")

    one = _write_csv(tmp_path / "ecl.csv", 300, ["x"])
    argv = ["forecast", "study", "--models", "linear", "--horizons", "5", "--lookback", "24"]
    argv += ["--no-progress", "--out", str(tmp_path / "out")]
    with monkeypatch.context() as m:
        m.setattr(forecast_cli, "train_forecaster", no_training)
        assert main([*argv, "--series", f"{one}, {tmp_path / 'missing.csv'}"]) == 2
        assert "missing.csv" in capsys.readouterr().err
    # a blank after the comma is stripped: the spec is the file, not ' <path>'
    argv[-1] = str(tmp_path / "out2")
    assert main([*argv, "--max-steps", "2", "--val-every", "1", "--series", f" {one} ,"]) == 0
    assert json.loads((tmp_path / "out2" / "ecl.json").read_text())["source"] == str(one)


@pytest.mark.parametrize(
    "options, want",
    [
        (["--models", "linear,linear"], "--models has duplicates: ['linear', 'linear']"),
        (["--horizons", "5,5"], "--horizons has duplicates: [5, 5]"),
        (["--models", "linear,seasonal-naive", "--lookback", "12"], "period must be in 1..lookback (12)"),
        (["--models", "linear,patchtst", "--dim", "30"], "dim (30) must be divisible by heads"),
    ],
)
def test_study_refuses_repeats_and_bad_model_options_before_training(
    tmp_path, capsys, monkeypatch, options, want
):
    """A repeat trained twice and then failed the aggregate; a model's bad option was found when its turn
    came, after the models before it had trained, and no JSON was written."""
    from titans.cli import main
    from titans.forecast import cli as forecast_cli

    def no_training(*a, **k):
        raise AssertionError("trained before every model was checked")

    monkeypatch.setattr(forecast_cli, "train_forecaster", no_training)
    series = _write_csv(tmp_path / "ecl.csv", 300, ["x"])
    argv = ["forecast", "study", "--series", str(series), "--models", "linear", "--horizons", "5"]
    argv += ["--lookback", "24", "--no-progress", "--out", str(tmp_path / "out"), *options]
    assert main(argv) == 2
    assert want in capsys.readouterr().err


def _sigterm_at_step(monkeypatch, at: int) -> list[int]:
    """Make every forecaster's training send this process a SIGTERM after step ``at`` (inside the loop,
    where train_forecaster(handle_signals=True) has the handler installed); the steps seen."""
    import os
    import signal

    from titans.forecast import train as forecast_train
    from titans.training.loop import TrainLoop

    seen: list[int] = []

    class Loop(TrainLoop):
        def __init__(self, *a, on_step=None, **k):
            def step(n, *rest):
                seen.append(n)
                if on_step is not None:
                    on_step(n, *rest)
                if n == at:
                    os.kill(os.getpid(), signal.SIGTERM)

            super().__init__(*a, on_step=step, **k)

    monkeypatch.setattr(forecast_train, "TrainLoop", Loop)
    return seen


def test_sigterm_keeps_the_best_weights_of_forecast_train_and_study(tmp_path, capsys, monkeypatch):
    from titans.cli import main

    path = _write_csv(tmp_path / "ecl.csv", 300, ["x"])
    common = ["--lookback", "24", "--max-steps", "100000", "--val-every", "2", "--dim", "8", "--depth", "1"]
    common += ["--heads", "2", "--no-progress", "--series", str(path)]
    seen = _sigterm_at_step(monkeypatch, 3)
    out = tmp_path / "run"
    argv = ["forecast", "train", "--model", "linear", "--horizon", "5", "--out", str(out), *common]
    assert main(argv) == 143
    rec = json.loads((out / "result.json").read_text())
    assert rec["stopped_by"] == "SIGTERM" and rec["steps_done"] <= 4 and max(seen) <= 4
    assert (out / "model.pt").is_file() and np.isfinite(rec["test_mse"])
    # a study stops at the model the signal reached; the runs done so far are written, no more are trained
    seen.clear()
    out = tmp_path / "study"
    argv = ["forecast", "study", "--models", "seasonal-naive,linear,lmm", "--horizons", "5,7"]
    assert main([*argv, "--out", str(out), *common]) == 143
    doc = json.loads((out / "ecl.json").read_text())
    assert [(r["run"]["model"], r["run"]["horizon"]) for r in doc["runs"]] == [
        ("seasonal-naive", 5),
        ("linear", 5),
    ]
    assert doc["runs"][1]["stopped_by"] == "SIGTERM" and (out / "ecl-H5.png").is_file()
    assert "stopped by SIGTERM" in capsys.readouterr().err


def test_seed_aggregate_counts_best_and_within_one_se_and_refuses_mixed_studies():
    from titans.forecast.seeds import aggregate_studies

    def doc(seed: int, mse: dict, lr: float = 1e-3, lookback: int = 96) -> dict:
        runs = [
            {
                "series": "s",
                "lookback": lookback,
                "run": {"model": m, "horizon": h, "seed": seed},
                "test_mse": v,
                "test_mae": v / 2,
                "parameters": 0 if m == "naive" else 10,
                "best_step": 25 * (seed + 1),
                "best_seconds": 1.5 * (seed + 1),
            }
            for (m, h), v in mse.items()
        ]
        return {"series": "s", "budget": {"lr": lr, "seed": seed}, "runs": runs}

    # H 96: a 0.50 +- se 0.0577 (std 0.1), b 0.52 (within), c 0.60 (not); H 720: c best, a and b far off
    seeds = {
        0: {
            ("a", 96): 0.4,
            ("b", 96): 0.52,
            ("c", 96): 0.6,
            ("a", 720): 0.9,
            ("b", 720): 0.9,
            ("c", 720): 0.7,
        },
        1: {
            ("a", 96): 0.5,
            ("b", 96): 0.52,
            ("c", 96): 0.6,
            ("a", 720): 0.9,
            ("b", 720): 0.9,
            ("c", 720): 0.7,
        },
        2: {
            ("a", 96): 0.6,
            ("b", 96): 0.52,
            ("c", 96): 0.6,
            ("a", 720): 0.9,
            ("b", 720): 0.9,
            ("c", 720): 0.7,
        },
    }
    agg = aggregate_studies([doc(s, v) for s, v in seeds.items()])
    assert agg["counts"]["mse"] == {
        "a": {"best": 1, "best_or_within_1se": 1, "cells": 2},
        "b": {"best": 0, "best_or_within_1se": 1, "cells": 2},
        "c": {"best": 1, "best_or_within_1se": 1, "cells": 2},
    }
    a96 = agg["rows"][0]
    assert a96["mse"]["se"] == pytest.approx(0.1 / np.sqrt(3)) and a96["best_step"]["mean"] == 50
    # one seed: no spread, only the best counts
    one = aggregate_studies([doc(0, seeds[0])])
    assert one["rows"][0]["mse"]["std"] is None and one["counts"]["mse"]["b"]["best_or_within_1se"] == 0
    with pytest.raises(ValueError, match=r"lr: 0.001 vs 0.01"):
        aggregate_studies([doc(0, seeds[0]), doc(1, seeds[1], lr=1e-2)])
    with pytest.raises(ValueError, match="in one only"):
        aggregate_studies([doc(0, seeds[0]), doc(1, seeds[1], lookback=336)])
    with pytest.raises(ValueError, match=r"seed 1: a at horizon 96 appears in both study 0 and study 1"):
        aggregate_studies([doc(1, seeds[0]), doc(1, seeds[1])])
    with pytest.raises(ValueError, match="both seed 1 but not the same budget"):
        aggregate_studies([doc(1, {("a", 96): 0.5}), doc(1, {("a", 192): 0.5}, lr=1e-2)])
    # one seed's runs split over several inputs (horizons run apart) are merged: the same aggregate
    split = [
        doc(s, {k: v for k, v in mse.items() if k[1] == h}) for s, mse in seeds.items() for h in (720, 96)
    ]
    merged = aggregate_studies(split)
    assert merged["counts"] == agg["counts"] and merged["seeds"] == [0, 1, 2]
    assert sorted(map(str, merged["rows"])) == sorted(map(str, agg["rows"]))
    with pytest.raises(ValueError, match="no study JSONs"):
        aggregate_studies([])
    broken = doc(2, seeds[2])
    del broken["runs"][1]["test_mae"]
    with pytest.raises(ValueError, match="run 1 lacks test_mae"):
        aggregate_studies([doc(0, seeds[0]), broken], names=["a.json", "b.json"])
    twice = doc(2, seeds[2])
    twice["runs"].append(twice["runs"][0])
    with pytest.raises(ValueError, match="a at horizon 96 appears twice"):
        aggregate_studies([twice])


def test_seed_aggregate_refuses_runs_on_other_data_or_splits():
    """Seeds of one study share the data: the same file, channels, length, split protocol and borders."""
    from titans.forecast.seeds import aggregate_studies

    def doc(seed: int, **data) -> dict:
        base = {
            "source": "data/ETTh1.csv",
            "channels": ["a", "b"],
            "steps_total": 14400,
            "protocol": "ett-hour",
            "borders": [[0, 8640], [8544, 11520], [11424, 14400]],
        }
        runs = [
            {
                "series": "ETTh1",
                "lookback": 96,
                **base,
                **data,
                "run": {"model": m, "horizon": 24, "seed": seed},
                "test_mse": 0.5 + seed / 10,
                "test_mae": 0.4,
                "parameters": 10,
                "best_step": 3,
                "best_seconds": 1.0,
            }
            for m in ("linear", "lmm")
        ]
        return {"series": "ETTh1", "budget": {"lr": 1e-3, "seed": seed}, "runs": runs}

    assert aggregate_studies([doc(0), doc(1)])["seeds"] == [0, 1]
    other = {
        "source": ("data/other/ETTh1.csv", r"source: 'data/ETTh1.csv' vs 'data/other/ETTh1.csv'"),
        "protocol": ("ratio", r"protocol: 'ett-hour' vs 'ratio'"),
        "borders": ([[0, 10080], [9984, 11520], [11424, 14400]], r"borders: \[\[0, 8640\]"),
        "steps_total": (14000, "steps_total: 14400 vs 14000"),
        "channels": (["a"], r"channels: \['a', 'b'\] vs \['a'\]"),
        # the same file, shape and borders, other values: it was averaged without a word
        "values_sha256": ("f" * 64, "values_sha256: None vs 'fff"),
    }
    for field, (value, want) in other.items():
        with pytest.raises(
            ValueError, match=r"study 1 is not the same study as study 0 but for the seed: .*" + want
        ):
            aggregate_studies([doc(0), doc(1, **{field: value})])
    # one seed's inputs merged (horizons run apart) must be on the same data too
    mixed = doc(1)
    mixed["runs"][1]["protocol"] = "ratio"
    with pytest.raises(ValueError, match="the runs of ETTh1 lookback 96 are not on the same data: protocol"):
        aggregate_studies([doc(0), mixed])


def test_patchtst_takes_a_lookback_of_16_or_less():
    """The patch is shorter than the window (PatchTST needs two patches); a lookback of 1 is refused."""
    _needs("patchtst")
    from titans.forecast.baselines import PatchTSTAdapter

    for lookback in (2, 8, 16, 17):
        model = PatchTSTAdapter(lookback, 4, 2, dim=16, depth=1, heads=2)
        assert model(torch.randn(3, lookback, 2)).shape == (3, 4, 2)
    with pytest.raises(ValueError, match="patchtst: --lookback must be >= 2"):
        PatchTSTAdapter(1, 4, 2, dim=16, depth=1, heads=2)


def test_eval_scores_a_bundled_series_run_that_recorded_a_date_column(tmp_path, capsys):
    """`forecast train --date-column X` on a bundled series was accepted (and X recorded) before that was
    refused; `forecast eval` of such a run passed X back and was refused. It is scored."""
    from titans.cli import main

    out = tmp_path / "run"
    argv = ["forecast", "train", "--series", "tmy3:greensboro", "--model", "linear", "--steps", "2"]
    assert main([*argv, "--lookback", "32", "--horizon", "8", "--no-progress", "--out", str(out)]) == 0
    saved = torch.load(out / "model.pt", weights_only=True)
    saved["record"]["date_column"] = "Date"  # as such a run recorded it
    torch.save(saved, out / "model.pt")
    capsys.readouterr()
    assert main(["forecast", "eval", "--run", str(out)]) == 0
    assert "mse" in json.loads(capsys.readouterr().out)
