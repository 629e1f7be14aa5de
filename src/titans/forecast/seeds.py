"""Forecasting studies over several seeds: mean, spread and "best or within one standard error" counts.

    agg = aggregate_studies([json.load(open(p)) for p in per_seed_jsons])
    print(aggregate_table(agg))

Each input is the JSON ``titans forecast study`` writes for one series and one seed. Every seed must be
the same study but for the seed (same series, lookback, models, horizons and budget, and the same data:
source, channels, length, split protocol, borders and values, ``DATA_FIELDS``) and no run may
appear twice, so a mean never mixes settings or counts one run twice; the inputs of one seed with
disjoint runs (horizons 96 and 720 in one study, 192 and 336 in another) are merged into one study.
Per (series, lookback, horizon, model) the aggregate holds, for the test MSE and MAE, the per-seed
values in seed order, their mean, the sample standard deviation (``ddof=1``), the standard error of the
mean (``std / sqrt(n)``) and the min-max; and the mean and min-max of the best checkpoint's step and
training seconds. With a single seed ``std`` and ``se`` are None (no spread can be measured).

A *cell* is one (series, lookback, horizon). In each cell and for each metric the best model has the
lowest mean; a model is *within one SE* of it when its mean exceeds the best mean by at most the best
model's standard error (the one-standard-error rule; with one seed only the best counts). ``counts``
tallies per model the cells where it is best and where it is best or within one SE.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from titans.training.metrics import save_plot

METRICS = ("mse", "mae")


def _stats(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    std = float(a.std(ddof=1)) if len(a) > 1 else None
    return {
        "values": [float(v) for v in a],
        "mean": float(a.mean()),
        "std": std,
        "se": std / math.sqrt(len(a)) if std is not None else None,
        "min": float(a.min()),
        "max": float(a.max()),
    }


def _key(run: dict) -> tuple:
    return (run["series"], run["lookback"], run["run"]["horizon"], run["run"]["model"])


def _check(doc: object, where: str) -> None:
    """Refuse, naming the input, what is not a study JSON or lacks a field the aggregate reads."""
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list) or not doc["runs"]:
        raise ValueError(f"{where}: not a `titans forecast study` JSON (no 'runs')")
    keys = set()
    for i, r in enumerate(doc["runs"]):
        run = r.get("run") if isinstance(r, dict) else None
        missing = [
            k for k in ("series", "lookback", "test_mse", "test_mae", "parameters") if k not in (r or {})
        ]
        missing += [
            f"run.{k}" for k in ("model", "horizon", "seed") if not isinstance(run, dict) or k not in run
        ]
        if missing:
            raise ValueError(f"{where}: run {i} lacks {', '.join(missing)}")
        key = _key(r)
        if key in keys:
            raise ValueError(f"{where}: {key[3]} at horizon {key[2]} appears twice")
        keys.add(key)


# a run's data and split (a record from before `values_sha256` has None there)
DATA_FIELDS = ("source", "channels", "steps_total", "protocol", "borders", "values_sha256")


def _data_of(doc: dict, where: str) -> dict:
    """Per (series, lookback): the data a study's runs were measured on (``DATA_FIELDS``); refuses runs of
    one (series, lookback) on different data."""
    data: dict = {}
    for r in doc["runs"]:
        key = f"{r['series']} lookback {r['lookback']}"
        fields = {k: r.get(k) for k in DATA_FIELDS}
        if data.setdefault(key, fields) != fields:
            diff = [
                f"{k}: {data[key][k]!r} vs {fields[k]!r}" for k in DATA_FIELDS if data[key][k] != fields[k]
            ]
            raise ValueError(f"{where}: the runs of {key} are not on the same data: {'; '.join(diff)}")
    return data


def _seed_of(doc: dict, where: str) -> int:
    seeds = {r["run"]["seed"] for r in doc["runs"]}
    if len(seeds) != 1:
        raise ValueError(f"{where}: runs of several seeds {sorted(seeds)} in one study JSON")
    return seeds.pop()


def _merge_seeds(docs: list[dict], names: list[str]) -> tuple[list[dict], list[str]]:
    """One study per seed: the inputs of one seed (e.g. horizons 96 and 720 in one study, 192 and 336 in
    another) merged into one, if their budgets agree and no run appears in two of them."""
    by_seed: dict[int, list[int]] = {}
    for i, (doc, where) in enumerate(zip(docs, names)):
        by_seed.setdefault(_seed_of(doc, where), []).append(i)
    merged_docs, merged_names = [], []
    for seed, idx in by_seed.items():
        first = docs[idx[0]]
        seen: dict[tuple, str] = {}
        for i in idx:
            if docs[i].get("budget") != first.get("budget"):
                raise ValueError(
                    f"{names[i]} and {names[idx[0]]} are both seed {seed} but not the same budget"
                )
            for r in docs[i]["runs"]:
                if _key(r) in seen:
                    raise ValueError(
                        f"seed {seed}: {_key(r)[3]} at horizon {_key(r)[2]} appears in both "
                        f"{seen[_key(r)]} and {names[i]}: each seed's runs must be given once"
                    )
                seen[_key(r)] = names[i]
        merged_docs.append(
            {
                **first,
                "command": " ; ".join(str(docs[i].get("command")) for i in idx),
                "runs": [r for i in idx for r in docs[i]["runs"]],
            }
        )
        merged_names.append(" + ".join(names[i] for i in idx))
    return merged_docs, merged_names


def aggregate_studies(docs: list[dict], names: list[str] | None = None) -> dict:
    """Aggregate per-seed study JSONs (``titans forecast study`` output, one series each) over seeds.

    ``names`` label the inputs in error messages (file paths; default ``study 0``, ``study 1``, ...)."""
    if not docs:
        raise ValueError("no study JSONs to aggregate")
    names = names or [f"study {i}" for i in range(len(docs))]
    for doc, where in zip(docs, names):
        _check(doc, where)
    docs, names = _merge_seeds(docs, names)
    seeds = [_seed_of(d, w) for d, w in zip(docs, names)]

    def setting(doc: dict, where: str) -> dict:
        budget = {k: v for k, v in doc.get("budget", {}).items() if k != "seed"}
        cells = sorted(_key(r) for r in doc["runs"])
        return {"budget": budget, "cells": cells, "data": _data_of(doc, where)}

    ref = setting(docs[0], names[0])
    for doc, where in zip(docs[1:], names[1:]):
        other = setting(doc, where)
        diff = [
            f"{k}: {ref['budget'].get(k)!r} vs {other['budget'].get(k)!r}"
            for k in sorted(set(ref["budget"]) | set(other["budget"]))
            if ref["budget"].get(k) != other["budget"].get(k)
        ]
        diff += [
            f"{key} {k}: {ref['data'][key][k]!r} vs {other['data'][key][k]!r}"
            for key in sorted(set(ref["data"]) & set(other["data"]))
            for k in DATA_FIELDS
            if ref["data"][key][k] != other["data"][key][k]
        ]
        diff += [
            f"run {c} in one only"
            for c in sorted(set(map(tuple, ref["cells"])) ^ set(map(tuple, other["cells"])))
        ]
        if diff:
            raise ValueError(
                f"{where} is not the same study as {names[0]} but for the seed: {'; '.join(diff[:4])}"
            )

    order = sorted(range(len(docs)), key=lambda i: seeds[i])
    rows: list[dict] = []
    # cells in order of series, lookback and horizon (a merged seed's inputs may hold them in any order),
    # the models of a cell in the order they ran
    keys = sorted(dict.fromkeys(_key(r) for r in docs[0]["runs"]), key=lambda k: k[:3])
    for series, lookback, horizon, model in keys:
        per_seed = []
        for i in order:
            (rec,) = [r for r in docs[i]["runs"] if _key(r) == (series, lookback, horizon, model)]
            per_seed.append(rec)
        row = {
            "series": series,
            "lookback": lookback,
            "horizon": horizon,
            "model": model,
            "parameters": per_seed[0]["parameters"],
            **{m: _stats([r[f"test_{m}"] for r in per_seed]) for m in METRICS},
        }
        if per_seed[0]["parameters"]:
            for key in ("best_step", "best_seconds"):
                s = _stats([r[key] for r in per_seed])
                row[key] = {k: s[k] for k in ("values", "mean", "min", "max")}
            row["stopped_by"] = [r.get("stopped_by", "all steps ran") for r in per_seed]
        rows.append(row)

    counts = {m: {} for m in METRICS}
    for row in rows:
        for m in METRICS:
            counts[m].setdefault(row["model"], {"best": 0, "best_or_within_1se": 0, "cells": 0})
    for cell in dict.fromkeys((r["series"], r["lookback"], r["horizon"]) for r in rows):
        in_cell = [r for r in rows if (r["series"], r["lookback"], r["horizon"]) == cell]
        for m in METRICS:
            best = min(in_cell, key=lambda r: r[m]["mean"])
            bar = best[m]["mean"] + (best[m]["se"] or 0.0)
            for r in in_cell:
                c = counts[m][r["model"]]
                c["cells"] += 1
                c["best"] += r is best
                c["best_or_within_1se"] += r[m]["mean"] <= bar
                r[m]["best"] = r is best
                r[m]["within_1se"] = r[m]["mean"] <= bar
    return {
        "seeds": [seeds[i] for i in order],
        "inputs": [names[i] for i in order],
        "commands": [docs[i].get("command") for i in order],
        "budget": ref["budget"],
        "within_1se_rule": "mean <= best mean + the best model's standard error of the mean (std/sqrt(n))",
        "rows": rows,
        "counts": counts,
    }


def aggregate_table(agg: dict) -> str:
    """A Markdown table of an aggregate: MSE and MAE mean ± std [min-max] per horizon, best mean in bold,
    a star on the means within one SE of the best, then the best checkpoint's step and seconds (means)."""
    n = len(agg["seeds"])
    lines = [
        f"seeds {', '.join(map(str, agg['seeds']))} (n = {n}): mean ± std [min-max]; **bold**: best mean; "
        "*: within one SE of the best",
        "",
        "| series | lookback | H | model | MSE | MAE | best at (step, s) |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(s: dict) -> str:
        mean = f"**{s['mean']:.3f}**" if s["best"] else f"{s['mean']:.3f}" + ("*" if s["within_1se"] else "")
        spread = f" ± {s['std']:.3f}" if s["std"] is not None else ""
        return f"{mean}{spread} [{s['min']:.3f}-{s['max']:.3f}]"

    for r in agg["rows"]:
        best_at = (
            f"{r['best_step']['mean']:.0f}, {r['best_seconds']['mean']:.0f}" if "best_step" in r else "-"
        )
        lines.append(
            f"| {r['series']} | {r['lookback']} | {r['horizon']} | {r['model']} | {cell(r['mse'])} | "
            f"{cell(r['mae'])} | {best_at} |"
        )
    lines += ["", "| model | MSE: best / best or within 1 SE | MAE: best / best or within 1 SE | cells |"]
    lines.append("|---|---|---|---|")
    for model, c in agg["counts"]["mse"].items():
        a = agg["counts"]["mae"][model]
        lines.append(
            f"| {model} | {c['best']} / {c['best_or_within_1se']} | {a['best']} / {a['best_or_within_1se']} "
            f"| {c['cells']} |"
        )
    return "\n".join(lines)


def plot_aggregate(path: str | Path, agg: dict, metric: str = "mse") -> None:
    """A PNG per aggregate: for each (series, lookback, horizon) a panel of the models' test ``metric``,
    the mean as a bar with ± std whiskers and each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((r["series"], r["lookback"], r["horizon"]) for r in agg["rows"]))
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.6), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        rows = [r for r in agg["rows"] if (r["series"], r["lookback"], r["horizon"]) == cell]
        x = np.arange(len(rows))
        means = [r[metric]["mean"] for r in rows]
        stds = [r[metric]["std"] or 0.0 for r in rows]
        ax.bar(x, means, yerr=stds, capsize=3, color="lightsteelblue", edgecolor="black", lw=0.5)
        for i, r in enumerate(rows):
            ax.plot([i] * len(r[metric]["values"]), r[metric]["values"], "k.", ms=4)
        ax.set_xticks(x, [r["model"] for r in rows], rotation=35, ha="right", fontsize=7)
        lo = min(min(r[metric]["values"]) for r in rows)
        ax.set_ylim(max(0.0, lo - 0.15), None)
        ax.set_title(f"{cell[0]}, lookback {cell[1]}, H {cell[2]}", fontsize=8)
        ax.set_ylabel(f"test {metric.upper()} (standardised)", fontsize=8)
    fig.suptitle(f"seeds {', '.join(map(str, agg['seeds']))}: mean ± std, dots per seed", fontsize=9)
    save_plot(fig, path, dpi=90)
    plt.close(fig)


__all__ = ["DATA_FIELDS", "METRICS", "aggregate_studies", "aggregate_table", "plot_aggregate"]
