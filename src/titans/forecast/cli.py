"""`titans forecast train | eval | study | aggregate`: long-horizon forecasting (docs/domains.md).

- ``train``: one model at one horizon on one series; writes ``result.json``, ``model.pt`` and
  ``forecast.png`` (a test window: lookback, truth, forecast) into ``--out``.
- ``eval``: re-measure a trained ``model.pt`` on its series' test part; prints the JSON.
- ``study``: models x horizons on each series side by side, the same budget for every model; writes
  ``<series>.json`` and ``<series>-H<h>.png`` per series and horizon into ``--out``. With ``--seeds``
  it runs the study once per seed into ``--out/seed<N>/`` and aggregates them (as ``aggregate`` does).
- ``aggregate``: mean, spread and "best or within one SE" counts over per-seed study JSONs
  (``titans.forecast.seeds``); writes ``<series>-seeds.json`` and ``<series>-seeds.png``, prints a table.
"""

from __future__ import annotations

import glob
import io
import json
import shlex
import signal
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from titans._fs import check_writable, lock_folder, write_bytes_atomic, write_text_atomic
from titans.data.series import is_bundled, load_series, split_series
from titans.forecast.model import FORECAST_MODELS
from titans.forecast.seeds import aggregate_studies, aggregate_table, plot_aggregate
from titans.forecast.train import (
    ForecastRun,
    evaluate,
    forecaster_for,
    plot_forecasts,
    run_record,
    series_digest,
    train_forecaster,
)
from titans.models.state import tensors_digest
from titans.runtime.device import set_cpu_threads
from titans.training.signals import exit_status
from titans.validation import check_distinct, did_you_mean, path_arg, seed_arg, seed_list

HORIZONS = (96, 192, 336, 720)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from e
    if not values:  # an empty list ran nothing and reported files it never wrote
        raise ValueError(f"expected at least one comma-separated integer, got {text!r}")
    return values


def _models(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError(f"expected at least one forecasting model, got {text!r}")
    bad = [m for m in names if m not in FORECAST_MODELS]
    if bad:
        raise ValueError(
            f"unknown forecasting model(s) {bad}; expected from {', '.join(FORECAST_MODELS)}"
            + did_you_mean(bad[0], FORECAST_MODELS)
        )
    return names


def _run(args, model: str, horizon: int) -> ForecastRun:
    return ForecastRun(
        model=model,
        horizon=horizon,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        eval_every=args.eval_every,
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
        revin=not args.no_revin,
        seed=ForecastRun.seed if args.seed is None else args.seed,
        patience=args.patience,
        time_budget=args.time_budget,
        period=args.period,
    )


def _stopped_by_signal(result) -> int | None:
    """The signal (SIGTERM / SIGINT) that stopped ``result``'s training, or None."""
    name = result.metrics.get("stopped_by")
    return int(signal.Signals[name]) if name in ("SIGTERM", "SIGINT") else None


def _split(args):
    set_cpu_threads(args.threads)
    series = load_series(args.series, date_column=args.date_column)
    return split_series(series, lookback=args.lookback, protocol=args.protocol)


def cmd_train(args) -> int:
    run = _run(args, args.model, args.horizon)  # its options checked before the series is read
    split = _split(args)
    out = Path(args.out)
    for name in ("model.pt", "result.json", "forecast.png"):  # before training: a failed write loses it
        check_writable(out / name)
    # one writer: two trains into one folder could leave one's weights beside the other's result
    in_use = f"--out {str(out)!r} is in use: another forecast train writes it; wait, or give another --out"
    out.mkdir(parents=True, exist_ok=True)
    with lock_folder(out, in_use):
        return _train(args, run, split, out)


def _train(args, run: ForecastRun, split, out: Path) -> int:
    # a SIGTERM / SIGINT stops training after the current step: the best weights so far are measured and
    # written as usual, then the command exits 128 + the signal's number
    result = train_forecaster(split, run, progress=not args.no_progress, handle_signals=True)
    record = {**run_record(split, result), "series_spec": args.series, "date_column": args.date_column}
    model = io.BytesIO()
    weights = result.model.state_dict()  # with their digest: torch's zip reader checks no CRC
    torch.save({"record": record, "state_dict": weights, "sha256": tensors_digest(weights)}, model)
    write_bytes_atomic(out / "model.pt", model.getvalue())  # each file whole or not at all
    write_text_atomic(out / "result.json", json.dumps(record, indent=2, allow_nan=False) + "\n")
    _, _, test = split.windows(args.horizon)
    plot_forecasts(
        out / "forecast.png",
        test,
        {args.model: result.model},
        f"{split.series.name} H={args.horizon}",
        channels=split.series.channels,
        scaler=split.scaler,
    )
    print(json.dumps({k: record[k] for k in ("series", "test_mse", "test_mae", "val_mse")}, indent=2))
    print(f"wrote {out / 'result.json'}, {out / 'model.pt'} and {out / 'forecast.png'}")
    signum = _stopped_by_signal(result)
    return 0 if signum is None else exit_status(signum)


def cmd_eval(args) -> int:
    set_cpu_threads(args.threads)
    path = Path(args.run) / "model.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"--run {args.run!r}: no model.pt there (give a folder written by `titans forecast train`)"
        )
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        rec = saved["record"]
        # flipped bytes in a tensor load as other weights (torch checks no CRC): the digest finds them
        if "sha256" in saved and tensors_digest(saved["state_dict"]) != saved["sha256"]:
            raise ValueError("its weights do not match the digest it records")
    except Exception as e:  # torch.load raises many types for a damaged file (OSError, pickle errors, ...)
        raise ValueError(
            f"--run {args.run!r}: model.pt is damaged or not a `titans forecast train` file"
        ) from e
    run = ForecastRun(**{k: v for k, v in rec["run"].items() if k in ForecastRun.__dataclass_fields__})
    # a bundled series has no date column (runs from before that was refused may record one)
    date_column = None if is_bundled(rec["series_spec"]) else rec.get("date_column")
    series = load_series(rec["series_spec"], date_column=date_column)
    split = split_series(series, lookback=rec["lookback"], protocol=rec["protocol"])
    changed = _series_changes(rec, split)
    if changed:  # its numbers would be another test set's, printed as this run's
        raise ValueError(
            f"--run {args.run!r}: the series {rec['series_spec']!r} is not the one this model was trained on "
            f"({'; '.join(changed)}); its test scores are in result.json"
        )
    model = forecaster_for(split, run)
    model.load_state_dict(saved["state_dict"])
    m = evaluate(model, split.windows(run.horizon)[2])
    print(json.dumps({"series": series.name, "model": run.model, "horizon": run.horizon, **m}, indent=2))
    return 0


def _series_changes(rec: dict, split) -> list[str]:
    """How the series `forecast eval` read differs from the one the run `rec` trained on (empty: the same
    channels, length, split borders and, where the run recorded them, values)."""
    series, changes = split.series, []
    if list(series.channels) != rec["channels"]:
        changes.append(f"channels {list(series.channels)} where training had {rec['channels']}")
    if len(series.values) != rec["steps_total"]:
        changes.append(f"{len(series.values)} steps where training had {rec['steps_total']}")
    elif (borders := [list(b) for b in split.borders]) != rec["borders"]:
        changes.append(f"split borders {borders} where training had {rec['borders']}")
    if not changes and rec.get("values_sha256") not in (None, series_digest(series.values)):
        changes.append("its values changed since training")
    return changes


def _study_splits(args) -> list:
    """Every ``--series`` entry (comma-separated, blanks around each stripped) loaded and split before any
    training, so a bad one fails at once; two entries whose series share a name (the files' stem: the
    name of ``<series>.json`` and the PNGs) are refused, not written over each other."""
    specs = [s.strip() for s in args.series.split(",") if s.strip()]
    if not specs:
        raise ValueError(f"--series {args.series!r}: no series given")
    set_cpu_threads(args.threads)
    splits, by_name = [], {}
    only_bundled = all(map(is_bundled, specs))
    for spec in specs:  # --date-column is for the CSVs (with bundled series alone, load_series refuses it)
        date_column = args.date_column if only_bundled or not is_bundled(spec) else None
        series = load_series(spec, date_column=date_column)
        if series.name in by_name:
            raise ValueError(
                f"--series: {by_name[series.name]!r} and {spec!r} are both series {series.name!r}, and their "
                f"results would be written to the same {series.name}.json; give one a copy with another name"
            )
        by_name[series.name] = spec
        splits.append(split_series(series, lookback=args.lookback, protocol=args.protocol))
    return splits


def _seed_command(argv: list[str], seed: int, out: Path) -> list[str]:
    """One seed's part of a ``--seeds`` study as a command of its own: `argv` with ``--seed N --out
    OUT/seedN`` for ``--seeds`` and ``--out`` (what its result file records, to be run again alone)."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ("--seeds", "--out"):
            skip = True
        elif not word.startswith(("--seeds=", "--out=")):
            words.append(word)
    return [*words, "--seed", str(seed), "--out", str(out)]


def _study(args, out: Path, splits: list, command: list[str]) -> tuple[list[Path], int | None]:
    """One seed of the study into ``out``: the JSON and PNGs written, per series (``splits``), and the
    signal that stopped it (None when every run was done). A SIGTERM / SIGINT during a model's training
    stops that model after the current step, measures its best weights, writes the series' JSON and PNG
    with the runs done so far and ends the study."""
    out.mkdir(parents=True, exist_ok=True)
    models, horizons = _models(args.models), _ints(args.horizons)
    written: list[Path] = []
    signum = None
    for split in splits:
        rows = []
        # an earlier study's plots of this series: those this one does not draw again are removed with
        # its JSON replaced (a study stopped, or of other horizons, left them beside a JSON without them)
        earlier = set(out.glob(f"{glob.escape(split.series.name)}-H*.png"))
        for h in horizons:
            trained = {}
            for m in models:
                result = train_forecaster(
                    split, _run(args, m, h), progress=not args.no_progress, handle_signals=True
                )
                rows.append(run_record(split, result))
                trained[m] = result.model
                r = result.metrics
                print(
                    f"{split.series.name} H={h} {m:14s} mse {r['test_mse']:.4f} mae {r['test_mae']:.4f} "
                    f"(best at step {r['best_step']} after {r['best_seconds']:.0f}s of "
                    f"{r['steps_done']} steps, {r['train_seconds']:.0f}s; "
                    f"{r.get('stopped_by', 'all steps ran' if r['parameters'] else 'not trained')})",
                    flush=True,
                )
                signum = _stopped_by_signal(result)
                if signum is not None:
                    break
            png = out / f"{split.series.name}-H{h}.png"
            plot_forecasts(
                png,
                split.windows(h)[2],
                trained,
                f"{split.series.name}, test window, horizon {h}",
                channels=split.series.channels,
                scaler=split.scaler,
            )
            written.append(png)
            doc = {
                "command": shlex.join(["titans", *command]),
                "series": split.series.name,
                "source": split.series.source,
                "budget": {
                    k: v for k, v in asdict(_run(args, "linear", 1)).items() if k not in ("model", "horizon")
                },
                "runs": rows,
            }
            write_text_atomic(out / f"{split.series.name}.json", json.dumps(doc, indent=2) + "\n")
            if signum is not None:
                break
        written.append(out / f"{split.series.name}.json")
        for stale in earlier - set(written):
            stale.unlink(missing_ok=True)
        if signum is not None:
            break
    return written, signum


def _aggregate(paths: list[Path], out: Path) -> list[Path]:
    """Aggregate per-seed study JSONs, grouped by series, into ``out``; print each table."""
    docs: dict[str, list[tuple[str, dict]]] = {}
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable study JSON ({type(e).__name__})") from e
        if not isinstance(doc, dict) or "runs" not in doc:
            raise ValueError(f"{path}: not a `titans forecast study` JSON (no 'runs')")
        docs.setdefault(doc.get("series", "?"), []).append((str(path), doc))
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for series, group in docs.items():
        agg = aggregate_studies([d for _, d in group], names=[n for n, _ in group])
        path = out / f"{series}-seeds.json"
        write_text_atomic(path, json.dumps(agg, indent=2) + "\n")
        plot_aggregate(out / f"{series}-seeds.png", agg)
        print(aggregate_table(agg))
        written += [path, out / f"{series}-seeds.png"]
    return written


def _check_models(args, splits: list, models: list[str], horizons: list[int]) -> None:
    """Every model built once for every series and horizon before any trains: options a model refuses (a
    seasonal period past the lookback, heads that do not divide dim) end the study at once, not after the
    models before it trained."""
    for split in splits:
        for h in horizons:
            for m in models:
                forecaster_for(split, _run(args, m, h))


def cmd_study(args) -> int:
    out = Path(args.out)
    models, horizons = _models(args.models), _ints(args.horizons)  # refused before any series is read
    check_distinct("--models", models)  # a run given twice trained twice, then the aggregate refused it
    check_distinct("--horizons", horizons)
    if args.seeds is not None and args.seed is not None:
        raise ValueError("give --seed or --seeds, not both")
    splits = _study_splits(args)
    _check_models(args, splits, models, horizons)
    out.mkdir(parents=True, exist_ok=True)
    # one study writes a folder: a second into it ran too, each replacing the other's files
    in_use = f"--out {str(out)!r} is in use: another forecast study writes it; wait, or give another --out"
    with lock_folder(out, in_use):
        return _study_all(args, out, splits)


def _study_all(args, out: Path, splits: list) -> int:
    argv = getattr(args, "argv", sys.argv[1:])  # `titans.cli.main` keeps the command line it parsed
    if args.seeds is None:
        written, signum = _study(args, out, splits, argv)
    else:
        seeds, written = args.seeds, []
        for seed in seeds:
            args.seed = seed
            # its result file records the command that runs this seed alone
            command = _seed_command(argv, seed, out / f"seed{seed}")
            files, signum = _study(args, out / f"seed{seed}", splits, command)
            written += files
            if signum is not None:
                break
        else:  # the aggregate only over a study that ran to the end
            written += _aggregate([p for p in written if p.suffix == ".json"], out)
    print("wrote " + ", ".join(map(str, written)))
    if signum is not None:
        print(
            f"titans forecast study: stopped by {signal.Signals(signum).name}; the runs done so far are "
            "written (a partial study)",
            file=sys.stderr,
        )
        return exit_status(signum)
    return 0


def cmd_aggregate(args) -> int:
    paths: list[Path] = []
    for spec in args.inputs:
        p = Path(spec)
        if p.is_dir():
            found = [q for q in sorted(p.glob("*.json")) if not q.name.endswith("-seeds.json")]
            if not found:
                raise FileNotFoundError(f"{spec}: a folder without study JSONs")
            paths += found
        elif p.is_file():
            paths.append(p)
        else:
            raise FileNotFoundError(f"{spec}: no such study JSON or folder")
    out = Path(args.out) if args.out else paths[0].parent
    print("wrote " + ", ".join(map(str, _aggregate(paths, out))))
    return 0


def _common(p, study: bool = False) -> None:
    d = ForecastRun  # its defaults, written once
    p.add_argument(
        "--series",
        default="tmy3:greensboro",
        help="a bundled series (tmy3:greensboro, tmy3:sand-point, tmy2:miami, soiling:imperial-county) or "
        "an ETT/ECL/Traffic/Weather CSV path or URL" + (" (comma-separated for several)" if study else ""),
    )
    p.add_argument("--date-column", default=None, help="the CSV's date column (default: the first column)")
    p.add_argument(
        "--protocol",
        default="auto",
        choices=("auto", "ratio", "ett-hour", "ett-minute"),
        help="split: 7:1:2 ratio, or ETT's 12/4/4 months (auto: from the file name)",
    )
    p.add_argument("--lookback", type=int, default=96, help="input steps")
    p.add_argument(
        "--steps", "--max-steps", dest="steps", type=int, default=d.steps, help="Adam steps at most"
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
    p.add_argument(
        "--eval-every",
        "--val-every",
        dest="eval_every",
        type=int,
        default=d.eval_every,
        help="validate every this many steps (the best weights are restored at the end)",
    )
    p.add_argument(
        "--patience",
        type=int,
        default=d.patience,
        help="early stopping: stop after this many validations without improvement (default: never)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=d.time_budget,
        help="wall seconds per model, validation included, at most (default: none)",
    )
    p.add_argument(
        "--period", type=int, default=d.period, help="seasonal-naive period in steps (24: hourly data)"
    )
    p.add_argument("--dim", type=int, default=d.dim, help="Titans backbone width")
    p.add_argument("--depth", type=int, default=d.depth, help="Titans backbone blocks")
    p.add_argument("--heads", type=int, default=d.heads, help="attention / memory heads")
    p.add_argument("--no-revin", action="store_true", help="no instance normalisation in Titans backbones")
    p.add_argument(
        "--seed", type=seed_arg, default=None, help=f"initialisation and batch-order seed (default {d.seed})"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def register(commands, evals) -> None:
    forecast = commands.add_parser(
        "forecast", help="long-horizon time-series forecasting (train, eval, study, aggregate)"
    )
    sub = forecast.add_subparsers(dest="forecast_command", metavar="SUBCOMMAND")
    sub.required = True
    p = sub.add_parser("train", help="train one model at one horizon; JSON, weights and a PNG into --out")
    _common(p)
    d = ForecastRun
    p.add_argument("--model", default=d.model, choices=FORECAST_MODELS, help="model")
    p.add_argument("--horizon", type=int, default=d.horizon, help="predicted steps")
    p.add_argument("--out", type=path_arg, default="runs/forecast", help="output folder")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("eval", help="re-measure a trained model.pt on its test part (JSON on stdout)")
    p.add_argument("--run", type=path_arg, required=True, help="folder written by `titans forecast train`")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("study", help="models x horizons side by side at equal budget; JSON and PNGs")
    _common(p, study=True)
    p.add_argument("--models", default="linear,lmm,mac,transformer", help="comma-separated models")
    p.add_argument("--horizons", default=",".join(map(str, HORIZONS)), help="comma-separated horizons")
    p.add_argument("--out", type=path_arg, default="results/forecast", help="output folder")
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=None,
        help="comma-separated seeds: the study once per seed into OUT/seed<N>/, then the aggregate over them",
    )
    p.set_defaults(func=cmd_study)
    p = sub.add_parser(
        "aggregate", help="mean, spread and best-or-within-one-SE counts over per-seed study JSONs"
    )
    p.add_argument("inputs", nargs="+", help="study JSONs or folders of them, one seed each")
    p.add_argument(
        "--out", type=path_arg, default=None, help="output folder (default: the first input's folder)"
    )
    p.set_defaults(func=cmd_aggregate)


__all__ = ["HORIZONS", "register"]
