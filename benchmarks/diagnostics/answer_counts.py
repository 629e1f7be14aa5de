"""What a model answered, not only how often it was right: for each result file of ``titans eval niah`` or
``titans eval babilong``, per (length, task or depth) cell, the accuracy, the share of answer characters
right, how many different answers the model gave, its most frequent answers and the cell's most frequent
gold answer.

    python benchmarks/diagnostics/answer_counts.py results/evals/babilong/babilong_qa1_qa5_mac_seed0.json
    python benchmarks/diagnostics/answer_counts.py --top 2 results/evals/babilong/babilong_qa1_qa5_mag_s*.json

A model that reads the prompt gives as many different answers as the prompts have; a model that learned
only the answer prior gives one or two, and then its accuracy is the share of prompts whose answer is that
word (the "most frequent gold" column is what always giving that answer scores). Predictions are
truncated to the gold answer's own number of tokens, so "officen" is "office" followed by a stray byte.
The characters column counts a gold character right when the prediction has it at the same place: a key
read with one digit blurred scores 0 in accuracy and 0.8 there (5 digits), one not read at all about
chance.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def char_accuracy(answer: str, prediction: str) -> float:
    """The share of ``answer``'s characters that ``prediction`` has at the same position (both stripped)."""
    answer, prediction = answer.strip(), prediction.strip()
    if not answer:
        return float(prediction == answer)
    return sum(a == b for a, b in zip(answer, prediction)) / len(answer)


def answer_counts(samples: list[dict], top: int = 3) -> list[dict]:
    """One row per (length, task or depth) cell of a result file's ``metadata.samples``."""
    by = "task" if samples and "task" in samples[0] else "depth"
    cells: dict[tuple, list[dict]] = {}
    for s in samples:
        cells.setdefault((int(s["length"]), s[by]), []).append(s)
    rows = []
    for (length, col), cell in sorted(cells.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        predictions = Counter(str(s["prediction"]).strip() for s in cell)
        gold = Counter(str(s["answer"]).strip() for s in cell)
        gold_word, gold_n = gold.most_common(1)[0]
        rows.append(
            {
                "length": length,
                by: col,
                "n": len(cell),
                "accuracy": sum(bool(s["correct"]) for s in cell) / len(cell),
                "char_accuracy": sum(char_accuracy(str(s["answer"]), str(s["prediction"])) for s in cell)
                / len(cell),
                "distinct_answers": len(predictions),
                "top_answers": predictions.most_common(top),
                "most_frequent_gold": [gold_word, gold_n / len(cell)],
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="result JSON files (with metadata.samples)")
    p.add_argument("--top", type=int, default=3, help="most frequent answers shown per cell")
    args = p.parse_args()
    for path in args.files:
        data = json.loads(path.read_text())
        samples = data.get("metadata", {}).get("samples")
        if not samples:
            raise SystemExit(f"{path}: no metadata.samples (not a per-model result file of titans eval)")
        rows = answer_counts(samples, args.top)
        by = "task" if "task" in rows[0] else "depth"
        print(f"== {path}")
        head = f"{'length':>7} {by:>6} {'n':>3} {'acc':>5} {'chars':>5} {'kinds':>5}"
        print(f"{head}  most frequent answers | gold")
        for r in rows:
            answers = ", ".join(f"{a!r} x{n}" for a, n in r["top_answers"])
            word, share = r["most_frequent_gold"]
            print(
                f"{r['length']:>7} {str(r[by]):>6} {r['n']:>3} {100 * r['accuracy']:>4.0f}% "
                f"{100 * r['char_accuracy']:>4.0f}% {r['distinct_answers']:>5}  "
                f"{answers} | {word!r} {100 * share:.0f}%"
            )


if __name__ == "__main__":
    main()
