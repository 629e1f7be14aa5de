"""`titans eval context` results over seeds: per position bucket, each model's mean loss, its range over the
seeds, and the writing model's margin under its frozen twin and under a compared baseline, seed by seed.

Each file is one seed's `titans eval context --checkpoint RUN --compare BASELINE` JSON; models are matched
by role (the writing model is the first curve, its twin the frozen one, the baseline the next), so the runs'
own labels may differ between seeds.

    python benchmarks/context_seeds.py results/long_context/mac_init_s{0,1,2}_8k.json --out summary.json

`--baseline-from` takes the baseline from other files instead, one per seed in the same order, read on the
same windows (checked): a model scored beside one SWA compared with another scored elsewhere.

    python benchmarks/context_seeds.py results/long_context/lmm_init_s{0,1,2}_8k.json \
        --baseline-from results/long_context/mal_w16_s{0,1,2}_8k.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench_utils import save_json


def roles(result: dict) -> dict[str, dict]:
    """{"writing": curve, "frozen": curve or absent, "baseline": curve or absent} of one result file."""
    models = list(result["models"].values())
    out = {"writing": models[0]}
    rest = models[1:]
    frozen = [m for m in rest if m["frozen"]]
    if frozen:
        out["frozen"] = frozen[0]
    others = [m for m in rest if not m["frozen"]]
    if others:
        out["baseline"] = others[0]
    return out


def summarise(results: list[dict], baselines: list[dict] | None = None) -> dict:
    """Per bucket and role: mean and (min, max) over the files; and per bucket the margins writing - frozen
    and writing - baseline for every file. ``baselines``: files (one per result, same windows) whose
    baseline replaces the results' own."""
    labels = results[0]["bucket_labels"]
    if any(r["bucket_labels"] != labels for r in results):
        raise ValueError("the files have different position buckets (another --length?)")
    per = [roles(r) for r in results]
    if baselines is not None:
        if len(baselines) != len(results):
            raise ValueError(f"{len(baselines)} baseline files for {len(results)} files: give one per file")
        for k, (r, b) in enumerate(zip(results, baselines)):
            if (b["window_origins"], b["bucket_labels"]) != (r["window_origins"], labels):
                raise ValueError(f"baseline file {k} was read on other windows or buckets than file {k}")
            baseline = roles(b).get("baseline")
            if baseline is None:
                raise ValueError(f"baseline file {k} holds no compared (non-frozen) model")
            per[k]["baseline"] = baseline
    out: dict = {"buckets": labels, "files": len(results), "roles": {}, "margins": {}}
    for role in ("writing", "frozen", "baseline"):
        if all(role in p for p in per):
            losses = np.array([p[role]["bucket_loss"] for p in per])  # (seeds, buckets)
            out["roles"][role] = {
                "variant": per[0][role]["variant"],
                "mean": losses.mean(0).tolist(),
                "min": losses.min(0).tolist(),
                "max": losses.max(0).tolist(),
            }
    for other in ("frozen", "baseline"):
        if other in out["roles"]:
            diff = np.array([np.subtract(p["writing"]["bucket_loss"], p[other]["bucket_loss"]) for p in per])
            out["margins"][f"writing - {other}"] = {"per_seed": diff.tolist(), "max": diff.max(0).tolist()}
    return out


def table(summary: dict) -> str:
    roles_ = summary["roles"]
    head = ["positions"] + [f"{r} ({v['variant']})" for r, v in roles_.items()]
    head += [f"{m} (worst seed)" for m in summary["margins"]]
    rows = [head]
    for k, label in enumerate(summary["buckets"]):
        row = [label]
        for v in roles_.values():
            row.append(f"{v['mean'][k]:.3f} [{v['min'][k]:.3f}-{v['max'][k]:.3f}]")
        for m in summary["margins"].values():
            row.append(f"{m['max'][k]:+.3f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="titans eval context JSON files, one per seed")
    p.add_argument(
        "--baseline-from",
        nargs="+",
        default=None,
        metavar="FILE",
        help="files (one per seed, same order, same windows) whose compared model is the baseline",
    )
    p.add_argument("--out", default=None, help="summary JSON (a path, or a name in benchmarks/results/)")
    args = p.parse_args()
    results = [json.loads(Path(f).read_text()) for f in args.files]
    baselines = (
        None if args.baseline_from is None else [json.loads(Path(f).read_text()) for f in args.baseline_from]
    )
    for files, loaded in ((args.files, results), (args.baseline_from, baselines or [])):
        # one checkpoint is one seed: a file given twice would count as two seeds in the means and ranges
        seen: dict[str, str] = {}
        for f, result in zip(files or [], loaded):
            model = result.get("checkpoint")
            if model is None:  # not recorded: nothing to compare
                continue
            if model in seen:
                p.error(f"{f} and {seen[model]} are results of one checkpoint ({model}): one file per seed")
            seen[model] = f
    summary = summarise(results, baselines)
    summary["sources"] = args.files
    if args.baseline_from:
        summary["baseline_sources"] = args.baseline_from
    print(f"{len(results)} files, mean [lowest-highest] nats/token; margins: the largest over the files")
    print(table(summary))
    if args.out:
        print(f"wrote {save_json(args.out, summary)}")


if __name__ == "__main__":
    main()
