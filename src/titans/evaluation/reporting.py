"""Where the evaluation commands write their results, and what they write.

``output_paths`` names the JSON and PNG (``--out``, default ``results/evals/<task>``; ``--name``);
``command_line`` records the run's options; ``report_table`` ends an accuracy-table evaluation (JSON,
heat map, table on stdout), ``write_study`` a study that trains one model per row (``eval ablate``,
``eval depth``). Without matplotlib (an optional extra) the results and JSON are still written; the figure
is skipped with one line saying why.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from titans.evaluation.scoring import AccuracyTable, format_table, plot_heatmap, write_json, write_results
from titans.training.metrics import plot_or_skip


def output_paths(args: argparse.Namespace, task: str, default_name: str) -> tuple[Path, Path]:
    out = Path(args.out or f"results/evals/{task}")
    name = args.name or default_name
    return out / f"{name}.json", out / f"{name}.png"


# options that only shape a fresh model: a checkpoint brings its own, so they are left out of its record
_FRESH_MODEL_OPTIONS = ("variant", "preset", "set", "tokenizer", "memory_alpha_init", "memory_eta_init")


def command_line(args: argparse.Namespace) -> dict:
    """The options of this run, for its result file (without defaults that did not apply)."""
    skip = {"func", "check", "argv"}
    if getattr(args, "checkpoint", None):
        skip.update(_FRESH_MODEL_OPTIONS)
    return {k: v for k, v in vars(args).items() if k not in skip}


def _wrote(json_path: Path, png_path: Path, drawn: bool) -> str:
    return f"wrote {json_path} and {png_path}" if drawn else f"wrote {json_path}"


def report_table(json_path: Path, png_path: Path, table: AccuracyTable, title: str, **metadata) -> None:
    """Every evaluation's ending: the JSON (table + metadata), the heat map, and the table on stdout."""
    write_results(json_path, table, **metadata)
    print(title)
    print(format_table(table))
    drawn = plot_or_skip(lambda: plot_heatmap(table, png_path, title=title), png_path)
    print(_wrote(json_path, png_path, drawn))


def write_study(
    args: argparse.Namespace,
    task: str,
    default_name: str,
    rows: list[dict],
    title: str,
    plot: Callable[[list[dict], Path, str], Path],
    table: str,
) -> None:
    """A study's ending: the JSON (rows + command line), the figure, and the table on stdout."""
    json_path, png_path = output_paths(args, task, default_name)
    write_json(json_path, {"rows": rows, "command": command_line(args)})
    print(title)
    print(table)
    drawn = plot_or_skip(lambda: plot(rows, png_path, title), png_path)
    print(_wrote(json_path, png_path, drawn))
