"""One evaluation over several training seeds: per-seed tables in, mean and range per cell out.

``titans eval babilong --seeds 0,1,2`` trains and evaluates one model per seed, each written
as its own result file (``<name>_seed<k>.json``), then ``aggregate_tables`` summarises them in
``<name>_seeds.json``: for every (length, task) cell the mean accuracy over seeds, its min and max, and
each seed's accuracy. All seeds are evaluated on the same samples (drawn with ``--seed``), so the spread is
the training's, not the samples'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from titans.evaluation.scoring import AccuracyTable, render_table


def aggregate_tables(seeds: Sequence[int], tables: Sequence[AccuracyTable]) -> dict:
    """Mean, min and max accuracy over seeds, per cell, per row (all columns pooled) and overall.

    A cell missing from some seed's table (a skipped length) is summarised over the seeds that have it.
    """
    if len(seeds) != len(tables) or not tables:
        raise ValueError(f"aggregate_tables: {len(seeds)} seeds for {len(tables)} tables")
    first = tables[0]
    keys = sorted({k for t in tables for k in t.counts}, key=lambda k: (_order(k[0]), _order(k[1])))

    def summary(values: list[tuple[int, float]]) -> dict:
        accs = [a for _, a in values if not math.isnan(a)]
        return {
            "mean": sum(accs) / len(accs) if accs else None,
            "min": min(accs) if accs else None,
            "max": max(accs) if accs else None,
            "per_seed": {str(s): (None if math.isnan(a) else a) for s, a in values},
        }

    cells = []
    for row, col in keys:
        cell = summary([(s, t.accuracy(row, col)) for s, t in zip(seeds, tables)])
        cell["samples_per_seed"] = max(t.counts.get((row, col), (0, 0))[1] for t in tables)
        cells.append({first.row_name: row, (first.col_name or "col"): col, **cell})
    rows = [
        {first.row_name: r, **summary([(s, t.row_accuracy(r)) for s, t in zip(seeds, tables)])}
        for r in sorted({r for r, _ in keys}, key=_order)
    ]
    return {
        "row_name": first.row_name,
        "col_name": first.col_name,
        "seeds": list(seeds),
        "cells": cells,
        "rows": rows,
        "overall": summary([(s, t.overall) for s, t in zip(seeds, tables)]),
    }


def format_seed_table(summary: dict) -> str:
    """The aggregate as text: one line per column value (task or depth), one column per row value (length),
    each cell ``mean [min-max]`` in percent."""
    row_key, col_key = summary["row_name"], summary["col_name"] or "col"
    rows = sorted({c[row_key] for c in summary["cells"]}, key=_order)
    cols = sorted({c[col_key] for c in summary["cells"]}, key=_order)
    by_key = {(c[row_key], c[col_key]): c for c in summary["cells"]}
    lines = [[col_key, *(str(r) for r in rows)]]
    for col in cols:
        lines.append([str(col), *(_cell(by_key.get((r, col))) for r in rows)])
    lines.append(["all", *(_cell(r) for r in summary["rows"])])
    return render_table(lines)


def _cell(summary: dict | None) -> str:
    if summary is None or summary["mean"] is None:
        return "-"
    return f"{100 * summary['mean']:.1f} [{100 * summary['min']:.0f}-{100 * summary['max']:.0f}]"


def _order(value):
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


__all__ = ["aggregate_tables", "format_seed_table"]
