"""Multivariate time series for long-horizon forecasting: loaders, the chronological split and the scaler.

    series = load_series("tmy3:greensboro")  # or an ETT/ECL/Traffic/Weather CSV path / URL
    split = split_series(series, lookback=96, protocol="auto")
    train, val, test = split.windows(horizon=96)  # ForecastWindows: x (N, lookback, C), y (N, horizon, C)

Series specs understood by ``load_series``:

- a CSV path or ``http(s)://`` URL in the published form of ETT, ECL (electricity), Traffic and Weather: a
  ``date`` column (any name given by ``date_column``; the first column by default) then one numeric column
  per channel. ``columns`` selects and orders channels (default: every column but the date).
- ``tmy3:greensboro`` / ``tmy3:sand-point``: typical-meteorological-year hourly weather (8,760 steps, 8
  channels; a channel constant over the year is dropped) from the TMY3 files shipped inside the PyPI
  package ``pvlib`` (``pvlib/data/723170TYA.CSV``, ``703165TY.csv``; US public-domain data of NREL's
  National Solar Radiation Database). Read from the installed package, nothing is copied. Each TMY month
  comes from a different real year, so the series has a seam at every month boundary.
- ``tmy2:miami``: the older TMY2 format of the same data base (``pvlib/data/12839.tm2``, Miami, FL, WBAN
  12839; 8,760 hourly steps, the same 8 channels in the same units as TMY3: the file's tenths of a degree
  and of a metre per second are converted).
- ``soiling:imperial-county``: hourly rain (mm; Imperial County, CA, TMY3) with PM2.5 and PM10
  concentrations (g/m^3; US EPA) for 2015 (``pvlib/data/soiling_hsu_example_inputs.csv``; 8,760 steps, 3
  channels), pvlib's example input of its soiling model.

``BUNDLED_SERIES`` lists every bundled spec. Every other file in pvlib's data folder is not a time series
(module and inverter libraries, a solar spectrum, gridded climatologies).

The protocol of the long-horizon literature (Informer / Autoformer / DLinear code): ``"ett-hour"`` and
``"ett-minute"`` split 12/4/4 months (of 30 days) of hourly / 15-minute data into train/val/test; ``"ratio"``
splits 7:1:2 in time order (ECL, Traffic, Weather). The validation and test parts start ``lookback`` steps
before their border so that their first window predicts the first step after it. ``"auto"`` picks
``ett-minute`` or ``ett-hour`` when the spec names ETTm / ETTh, else ``ratio``. The per-channel scaler is
fitted on the training part only; metrics are on the standardised values.

Public API (names are stable): ``Series``, ``SeriesSplit``, ``StandardScaler``, ``ForecastWindows``,
``load_series``, ``read_series_csv``, ``split_series``, ``TMY3_SITES``, ``BUNDLED_SERIES``, ``PROTOCOLS``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

PROTOCOLS = ("auto", "ratio", "ett-hour", "ett-minute")
# site -> (file inside pvlib/data, location)
TMY3_SITES = {
    "greensboro": ("723170TYA.CSV", "Greensboro Piedmont Triad Intl, NC (USAF 723170)"),
    "sand-point": ("703165TY.csv", "Sand Point, AK (USAF 703165)"),
}
TMY3_COLUMNS = (
    "GHI (W/m^2)",
    "DNI (W/m^2)",
    "DHI (W/m^2)",
    "Dry-bulb (C)",
    "Dew-point (C)",
    "RHum (%)",
    "Pressure (mbar)",
    "Wspd (m/s)",
)
# TMY2 column -> (TMY3 channel name, factor to TMY3's units)
TMY2_COLUMNS = {
    "GHI": ("GHI (W/m^2)", 1.0),
    "DNI": ("DNI (W/m^2)", 1.0),
    "DHI": ("DHI (W/m^2)", 1.0),
    "DryBulb": ("Dry-bulb (C)", 0.1),
    "DewPoint": ("Dew-point (C)", 0.1),
    "RHum": ("RHum (%)", 1.0),
    "Pressure": ("Pressure (mbar)", 1.0),
    "Wspd": ("Wspd (m/s)", 0.1),
}
TMY2_SITES = {"miami": ("12839.tm2", "Miami, FL (WBAN 12839)")}
SOILING_SITES = {"imperial-county": ("soiling_hsu_example_inputs.csv", "Imperial County, CA (2015)")}
SOILING_COLUMNS = {"rain": "rain (mm)", "PM2_5": "PM2.5 (g/m^3)", "PM10": "PM10 (g/m^3)"}
# every series spec that reads a file shipped inside an installed package
BUNDLED_SERIES = (
    *(f"tmy3:{k}" for k in ("greensboro", "sand-point")),
    *(f"tmy2:{k}" for k in TMY2_SITES),
    *(f"soiling:{k}" for k in SOILING_SITES),
)


@dataclass(frozen=True)
class Series:
    """A multivariate series: values (T, C) float64 in time order, channel names, and where it came from."""

    name: str
    values: np.ndarray
    channels: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        check_series(self.values, self.channels, self.name)


def check_series(values: np.ndarray, channels: tuple[str, ...], name: str) -> None:
    """Raise on a series that is not (T, C) with C == len(channels), or holds NaN / inf (naming where)."""
    if values.ndim != 2 or values.shape[1] != len(channels):
        raise ValueError(
            f"series {name!r}: values must be (time, {len(channels)} channels), got {tuple(values.shape)}"
        )
    bad = ~np.isfinite(values)
    if bad.any():
        t, c = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"series {name!r}: {int(bad.sum())} missing or non-finite value(s); the first is at step {t}, "
            f"channel {channels[c]!r} ({values[t, c]}). Fill or drop them before forecasting"
        )


def read_series_csv(
    path_or_url: str | Path, *, date_column: str | None = None, columns: list[str] | None = None
) -> Series:
    """A CSV in the ETT / ECL / Traffic / Weather form: a date column, then numeric channel columns."""
    import pandas as pd  # pandas is needed for CSV series only

    spec = str(path_or_url)
    if not re.match(r"^https?://", spec) and not Path(spec).expanduser().is_file():
        raise FileNotFoundError(f"series CSV {spec!r}: no such file")
    frame = pd.read_csv(spec)
    if frame.shape[1] < 2:
        raise ValueError(f"series CSV {spec!r}: expected a date column and at least one value column")
    date = date_column or frame.columns[0]
    if date not in frame.columns:
        raise ValueError(f"series CSV {spec!r}: no date column {date!r} (columns: {list(frame.columns)})")
    chosen = columns or [c for c in frame.columns if c != date]
    missing = [c for c in chosen if c not in frame.columns]
    if missing:
        raise ValueError(f"series CSV {spec!r}: no column(s) {missing} (columns: {list(frame.columns)})")
    numeric = frame[chosen].apply(pd.to_numeric, errors="coerce")
    text = frame[chosen].astype(str)
    bad = numeric.isna() & ~frame[chosen].isna()
    if bad.to_numpy().any():
        row, col = (int(i) for i in np.argwhere(bad.to_numpy())[0])
        raise ValueError(
            f"series CSV {spec!r}: non-numeric value {text.iat[row, col]!r} in column {chosen[col]!r} at "
            f"data row {row}"
        )
    _check_time_order(frame[date], spec)
    return Series(Path(spec).stem, numeric.to_numpy(np.float64), tuple(chosen), spec)


def _check_time_order(dates, spec: str) -> None:
    """Refuse a date column that goes back in time (a sorted or shuffled export): the windows would mix
    times and the chronological split would test on the past. A column that is not all dates is not
    checked."""
    import warnings

    import pandas as pd

    try:
        with warnings.catch_warnings():  # "could not infer format": mixed formats are parsed one by one
            warnings.simplefilter("ignore")
            times = pd.DatetimeIndex(pd.to_datetime(dates, errors="coerce"))
    except (ValueError, TypeError):  # e.g. mixed time zones: not dates this check can order
        return
    if times.isna().any():
        return
    back = np.flatnonzero(np.diff(times.asi8) < 0)  # nanoseconds (UTC where zoned)
    if len(back):
        i = int(back[0]) + 1
        raise ValueError(
            f"series CSV {spec!r}: the date column {dates.name!r} goes back in time at data row {i} "
            f"({dates.iat[i]!r} after {dates.iat[i - 1]!r}); sort the file by time"
        )


def _pvlib_file(kind: str, sites: dict, site: str) -> tuple[str, str]:
    """(path of the site's file in the installed pvlib's data folder, the site's description)."""
    if site not in sites:
        raise ValueError(f"unknown {kind} site {site!r}; expected one of {', '.join(sites)}")
    file, where = sites[site]
    try:
        path = resources.files("pvlib") / "data" / file
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"the {kind}: series are read from the PyPI package pvlib: pip install 'titans[domains]'"
        ) from e
    return str(path), where


def read_tmy3(site: str) -> Series:
    """Hourly TMY3 weather of one site (``TMY3_SITES``) from the installed ``pvlib`` package."""
    path, where = _pvlib_file("tmy3", TMY3_SITES, site)
    import pandas as pd

    frame = pd.read_csv(path, header=1)  # line 1: site metadata; line 2: the header
    # a channel that never changes carries no signal (Sand Point's pressure is one filled-in value)
    kept = [c for c in TMY3_COLUMNS if frame[c].nunique() > 1]
    return Series(f"tmy3-{site}", frame[kept].to_numpy(np.float64), tuple(kept), where)


def read_tmy2(site: str) -> Series:
    """Hourly TMY2 weather of one site (``TMY2_SITES``) from pvlib's data folder, in TMY3's channels and
    units."""
    path, where = _pvlib_file("tmy2", TMY2_SITES, site)
    from pvlib.iotools import read_tmy2 as pvlib_read_tmy2

    frame, _ = pvlib_read_tmy2(path)
    values = np.stack([frame[c].to_numpy(np.float64) * f for c, (_, f) in TMY2_COLUMNS.items()], axis=1)
    return Series(f"tmy2-{site}", values, tuple(name for name, _ in TMY2_COLUMNS.values()), where)


def read_soiling(site: str) -> Series:
    """Hourly rain, PM2.5 and PM10 of one site (``SOILING_SITES``) from pvlib's data folder."""
    path, where = _pvlib_file("soiling", SOILING_SITES, site)
    import pandas as pd

    frame = pd.read_csv(path)
    values = frame[list(SOILING_COLUMNS)].to_numpy(np.float64)
    return Series(f"soiling-{site}", values, tuple(SOILING_COLUMNS.values()), where)


_BUNDLED_READERS = {"tmy3": read_tmy3, "tmy2": read_tmy2, "soiling": read_soiling}


def is_bundled(spec: str) -> bool:
    """Whether ``spec`` names a bundled series (``tmy3:SITE``, ...) rather than a CSV."""
    return spec.partition(":")[0] in _BUNDLED_READERS


def load_series(spec: str, *, date_column: str | None = None, columns: list[str] | None = None) -> Series:
    """A bundled series (``BUNDLED_SERIES``: ``tmy3:SITE``, ``tmy2:SITE``, ``soiling:SITE``) or a CSV path /
    URL (see the module docstring)."""
    kind, _, site = spec.partition(":")
    if is_bundled(spec):
        given = [name for name, value in (("date_column", date_column), ("columns", columns)) if value]
        if given:  # they had been ignored, and recorded in the result as used
            raise ValueError(f"{' and '.join(given)}: for a CSV series, not for the bundled {spec!r}")
        return _BUNDLED_READERS[kind](site)
    return read_series_csv(spec, date_column=date_column, columns=columns)


class StandardScaler:
    """Per-channel standardisation: ``fit`` on (T, C) training values, then ``transform`` anything."""

    def __init__(self) -> None:
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None

    def fit(self, values: np.ndarray) -> StandardScaler:
        self.mean = values.mean(axis=0)
        std = values.std(axis=0)
        self.std = np.where(std > 0, std, 1.0)  # a constant training channel is centred, not divided by 0
        return self

    def transform(self, values: np.ndarray) -> np.ndarray:
        if self.mean is None or self.std is None:
            raise RuntimeError("StandardScaler: call fit() before transform()")
        return (values - self.mean) / self.std

    def inverse(self, values: np.ndarray) -> np.ndarray:
        if self.mean is None or self.std is None:
            raise RuntimeError("StandardScaler: call fit() before inverse()")
        return values * self.std + self.mean


@dataclass(frozen=True)
class ForecastWindows:
    """Every window of one split part: x[i] = part[i : i + lookback], y[i] = the next ``horizon`` steps.

    ``part`` is (T, C) float32, standardised; windows are built on demand (``batch``) rather than stored.
    """

    part: np.ndarray
    lookback: int
    horizon: int

    def __len__(self) -> int:
        return max(0, len(self.part) - self.lookback - self.horizon + 1)

    def batch(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """index (N,) -> x (N, lookback, C), y (N, horizon, C)."""
        span = np.asarray(index)[:, None] + np.arange(self.lookback + self.horizon)[None, :]
        w = self.part[span]
        return w[:, : self.lookback], w[:, self.lookback :]


@dataclass(frozen=True)
class SeriesSplit:
    """The three parts of a series (standardised by a scaler fitted on ``train`` only) and their borders.

    borders: ((start, end) of train, of val, of test) in steps of the original series; val and test start
    ``lookback`` steps before their first predicted step.
    """

    series: Series
    lookback: int
    protocol: str
    borders: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    scaler: StandardScaler

    def part(self, name: str) -> np.ndarray:
        i = ("train", "val", "test").index(name)
        a, b = self.borders[i]
        return self.scaler.transform(self.series.values[a:b]).astype(np.float32)

    def windows(self, horizon: int) -> tuple[ForecastWindows, ForecastWindows, ForecastWindows]:
        out = []
        for name in ("train", "val", "test"):
            w = ForecastWindows(self.part(name), self.lookback, horizon)
            if len(w) < 1:
                a, b = self.borders[("train", "val", "test").index(name)]
                raise ValueError(
                    f"series {self.series.name!r}: the {name} part (steps {a}-{b}, {b - a} long) is too "
                    f"short for lookback {self.lookback} + horizon {horizon} steps"
                )
            out.append(w)
        return tuple(out)  # type: ignore[return-value]


def _protocol_for(series: Series, protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown split protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")
    if protocol != "auto":
        return protocol
    name = series.name.lower()
    return "ett-minute" if name.startswith("ettm") else "ett-hour" if name.startswith("etth") else "ratio"


def split_series(series: Series, lookback: int = 96, protocol: str = "auto") -> SeriesSplit:
    """Split in time order (see the module docstring) and fit the scaler on the training part only."""
    if lookback < 1:
        raise ValueError(f"lookback must be >= 1, got {lookback}")
    protocol = _protocol_for(series, protocol)
    n = len(series.values)
    if protocol == "ratio":
        n_train, n_test = int(n * 0.7), int(n * 0.2)
        ends = (n_train, n - n_test, n)
    else:
        month = 30 * 24 * (4 if protocol == "ett-minute" else 1)
        ends = (12 * month, 16 * month, 20 * month)
        if n < ends[2]:
            raise ValueError(
                f"series {series.name!r}: the {protocol} protocol needs {ends[2]} steps (20 months), got {n}"
            )
    starts = (0, ends[0] - lookback, ends[1] - lookback)
    if min(ends[0], ends[1] - ends[0], ends[2] - ends[1]) < 1 or starts[1] < 0:
        raise ValueError(
            f"series {series.name!r}: {n} steps are too few to split train/val/test with lookback {lookback}"
        )
    scaler = StandardScaler().fit(series.values[: ends[0]])
    borders = ((starts[0], ends[0]), (starts[1], ends[1]), (starts[2], ends[2]))
    return SeriesSplit(series, lookback, protocol, borders, scaler)


__all__ = [
    "BUNDLED_SERIES",
    "is_bundled",
    "PROTOCOLS",
    "TMY3_SITES",
    "ForecastWindows",
    "Series",
    "SeriesSplit",
    "StandardScaler",
    "load_series",
    "read_series_csv",
    "read_soiling",
    "read_tmy2",
    "read_tmy3",
    "split_series",
]
