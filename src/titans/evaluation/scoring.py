"""Scoring for the long-context tasks: answer matching, accuracy tables, JSON, heat maps, text tables.

Matching works on *normalised* text (``normalize_answer``): Unicode NFKC, lower case, every punctuation or
symbol character replaced by a space, the articles "a", "an", "the" dropped, whitespace collapsed. So
" 52259." matches "52259", "The Kitchen" matches "kitchen", and a UUID matches itself (its hyphens become
spaces on both sides). Three rules on top of it:

- ``score_exact``: the whole prediction equals the answer. Use it on exactly ``sample.max_new_tokens``
  generated tokens (the answer's own length), the standard setting of our evaluations.
- ``score_prefix``: the prediction *starts with* the answer's words (for longer, free generations).
- ``score_contains``: the answer's words appear anywhere in the prediction (RULER's string match).
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titans._fs import write_text_atomic
from titans.training.metrics import save_plot

_ARTICLES = {"a", "an", "the"}


def normalize_answer(text: str) -> str:
    """NFKC, lower case, punctuation and symbols -> spaces, articles dropped, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch)[0] in "PS" else ch for ch in text)
    return " ".join(word for word in text.split() if word not in _ARTICLES)


def exact_match(prediction: str, answer: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(answer)


def prefix_match(prediction: str, answer: str) -> bool:
    want = normalize_answer(answer).split()
    return normalize_answer(prediction).split()[: len(want)] == want


def contains_match(prediction: str, answer: str) -> bool:
    # Word-aligned containment: "1234" is not found inside "12345".
    return f" {normalize_answer(answer)} " in f" {normalize_answer(prediction)} "


def _score(predictions: Sequence[str], answers: Sequence[str], match: Callable[[str, str], bool]) -> float:
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers")
    if not answers:
        raise ValueError("nothing to score: no answers")
    return sum(match(p, a) for p, a in zip(predictions, answers)) / len(answers)


def score_exact(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """Accuracy in [0, 1]: the share of predictions equal to their answer after normalisation."""
    return _score(predictions, answers, exact_match)


def score_prefix(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """Accuracy in [0, 1]: the share of predictions that begin with their answer."""
    return _score(predictions, answers, prefix_match)


def score_contains(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """Accuracy in [0, 1]: the share of predictions that contain their answer (RULER's string match)."""
    return _score(predictions, answers, contains_match)


MATCHERS: dict[str, Callable[[str, str], bool]] = {
    "exact": exact_match,
    "prefix": prefix_match,
    "contains": contains_match,
}


# ---------------------------------------------------------------------------------------------------------
# Accuracy tables.


def _order(value: Any) -> tuple:
    """Sort key for row/column labels: None first, then numbers, then text."""
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, (int, float)):
        return (1, float(value), "")
    return (2, 0.0, str(value))


@dataclass
class AccuracyTable:
    """Correct/total counts per (row, column) cell, e.g. context length x needle depth (or x task).

    ``col_name`` None makes a one-dimensional table (one column labelled None).
    """

    row_name: str = "length"
    col_name: str | None = "depth"
    counts: dict[tuple[Any, Any], list[int]] = field(default_factory=dict)  # (row, col) -> [correct, total]

    def add(self, row: Any, col: Any, correct: bool) -> None:
        cell = self.counts.setdefault((row, col), [0, 0])
        cell[0] += bool(correct)
        cell[1] += 1

    @property
    def rows(self) -> list:
        return sorted({r for r, _ in self.counts}, key=_order)

    @property
    def cols(self) -> list:
        return sorted({c for _, c in self.counts}, key=_order)

    def accuracy(self, row: Any, col: Any = None) -> float:
        """Accuracy of one cell; NaN where the cell has no samples."""
        correct, total = self.counts.get((row, col), (0, 0))
        return correct / total if total else math.nan

    def _pooled(self, keep: Callable[[Any, Any], bool]) -> float:
        cells = [v for (r, c), v in self.counts.items() if keep(r, c)]
        total = sum(t for _, t in cells)
        return sum(c for c, _ in cells) / total if total else math.nan

    def row_accuracy(self, row: Any) -> float:
        """Accuracy over all samples of one row (e.g. one context length, every depth)."""
        return self._pooled(lambda r, _: r == row)

    def col_accuracy(self, col: Any) -> float:
        return self._pooled(lambda _, c: c == col)

    @property
    def overall(self) -> float:
        return self._pooled(lambda r, c: True)

    def to_dict(self) -> dict:
        cells = [
            {
                self.row_name: r,
                (self.col_name or "col"): c,
                "correct": v[0],
                "total": v[1],
                "accuracy": v[0] / v[1],
            }
            for (r, c), v in sorted(self.counts.items(), key=lambda kv: (_order(kv[0][0]), _order(kv[0][1])))
        ]
        return {"row_name": self.row_name, "col_name": self.col_name, "overall": self.overall, "cells": cells}

    @classmethod
    def from_dict(cls, data: dict) -> AccuracyTable:
        table = cls(row_name=data["row_name"], col_name=data["col_name"])
        col_key = data["col_name"] or "col"
        for cell in data["cells"]:
            table.counts[(cell[data["row_name"]], cell[col_key])] = [int(cell["correct"]), int(cell["total"])]
        return table


def accuracy_table(
    rows: Iterable[Any],
    cols: Iterable[Any] | None,
    correct: Iterable[bool],
    *,
    row_name: str = "length",
    col_name: str | None = "depth",
) -> AccuracyTable:
    """Aggregate per-sample results (parallel sequences) into a table; ``cols`` None for a 1-D table."""
    rows, correct = list(rows), list(correct)
    table = AccuracyTable(row_name=row_name, col_name=None if cols is None else col_name)
    cols = [None] * len(rows) if cols is None else list(cols)
    if not len(rows) == len(cols) == len(correct):
        raise ValueError(f"rows, cols and correct differ in length: {len(rows)}, {len(cols)}, {len(correct)}")
    for r, c, ok in zip(rows, cols, correct):
        table.add(r, c, ok)
    return table


def table_from_samples(
    samples: Sequence[Any], predictions: Sequence[str], *, by: str | None = "depth", match: str = "exact"
) -> AccuracyTable:
    """Score NIAH/BABILong samples against decoded predictions into a ``length x by`` table.

    ``by``: a sample attribute for the columns ("depth" for NIAH, "task" for BABILong) or None.
    ``match``: "exact", "prefix" or "contains" (see the module docstring).
    """
    if match not in MATCHERS:
        raise ValueError(f"unknown match rule {match!r}: use one of {tuple(MATCHERS)}")
    if len(samples) != len(predictions):
        raise ValueError(f"{len(predictions)} predictions for {len(samples)} samples")
    correct = [MATCHERS[match](p, s.answer) for s, p in zip(samples, predictions)]
    cols = None if by is None else [getattr(s, by) for s in samples]
    return accuracy_table([s.length for s in samples], cols, correct, col_name=by)


# ---------------------------------------------------------------------------------------------------------
# Output: JSON, text, heat map.


def _non_finite(value: Any, where: str = "") -> str | None:
    """Where the first NaN or infinite number in a JSON-able value is ("models.mac.bucket_loss[3]")."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "the value"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def write_json(json_path: str | Path, payload: Any) -> Path:
    """Write ``payload`` as strict JSON (what any JSON reader parses: no NaN or Infinity; other objects as
    their ``str``), atomically (``write_text_atomic``: a failed write leaves the previous file whole). A
    NaN or infinite number is refused, naming where it is: a result file holds numbers, not NaN."""
    path = Path(json_path)
    try:
        text = json.dumps(payload, indent=2, default=str, allow_nan=False)
    except ValueError:
        where = _non_finite(json.loads(json.dumps(payload, default=str)))
        raise ValueError(f"{path} not written: {where or 'a number'} is not finite (NaN or inf)") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, text + "\n")


def write_results(json_path: str | Path, table: AccuracyTable, **metadata: Any) -> Path:
    """Write the table (and any JSON-able metadata: model, task, seed...) to ``json_path``."""
    return write_json(json_path, {**table.to_dict(), "metadata": metadata})


def read_results(json_path: str | Path) -> tuple[AccuracyTable, dict]:
    """The table and metadata written by ``write_results``."""
    data = json.loads(Path(json_path).read_text())
    return AccuracyTable.from_dict(data), data.get("metadata", {})


def _label(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_table(table: AccuracyTable) -> str:
    """A plain-text table of accuracies in percent: one line per row, a column per label, then the mean."""
    cols = [] if table.col_name is None else table.cols
    head = [table.row_name] + [f"{table.col_name}={_label(c)}" for c in cols] + ["all"]
    lines = [head]
    for r in table.rows:
        accuracies = [table.accuracy(r, c) for c in cols] + [table.row_accuracy(r)]
        lines.append([_label(r)] + [_percent(a) for a in accuracies])
    lines.append(["all"] + [_percent(table.col_accuracy(c)) for c in cols] + [_percent(table.overall)])
    return render_table(lines)


def render_table(lines: list[list[str]]) -> str:
    """Rows of cells (the first one a header) as right-aligned plain-text columns."""
    widths = [max(len(cell) for cell in column) for column in zip(*lines)]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def _percent(accuracy: float) -> str:
    return "-" if math.isnan(accuracy) else f"{100 * accuracy:.1f}"


def new_figure(figsize: tuple[float, float]):
    """A matplotlib Figure without pyplot (no global state, no display backend). Needs matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # matplotlib is in the "train" extra
        raise ImportError("the evaluation plots need matplotlib: pip install titans[train]") from e
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, png_path: str | Path) -> Path:
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    return save_plot(fig, png_path, dpi=120)


def plot_heatmap(table: AccuracyTable, png_path: str | Path, *, title: str | None = None) -> Path:
    """Save a heat map: ``row_name`` (context length) on x, ``col_name`` (depth or task) on y, accuracy as
    colour (red 0% .. green 100%), each cell annotated; empty cells are left blank. Needs matplotlib."""
    rows, cols = table.rows, table.cols
    grid = [[table.accuracy(r, c) for r in rows] for c in cols]  # (n_cols, n_rows): y = column label
    fig = new_figure((1.0 + 0.9 * len(rows), 1.2 + 0.45 * len(cols)))
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for y, line in enumerate(grid):
        for x, value in enumerate(line):
            if not math.isnan(value):
                ax.text(x, y, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows])
    ax.set_yticks(range(len(cols)), ["" if c is None else _label(c) for c in cols])
    ax.set_xlabel(table.row_name)
    if table.col_name is not None:
        ax.set_ylabel(table.col_name)
    ax.set_title(title or f"accuracy {100 * table.overall:.1f}%")
    fig.colorbar(image, ax=ax, label="accuracy")
    return save_figure(fig, png_path)
