"""benchmarks/diagnostics/answer_counts.py: per-cell answer spread of a result file."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "answer_counts.py"
spec = importlib.util.spec_from_file_location("answer_counts", SCRIPT)
answer_counts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(answer_counts)


def _sample(length, task, answer, prediction):
    return {
        "length": length,
        "task": task,
        "answer": answer,
        "prediction": prediction,
        "correct": prediction.strip() == answer,
    }


def test_counts_per_cell():
    samples = [
        _sample(1024, "qa1", "office", " office"),
        _sample(1024, "qa1", "garden", " office"),
        _sample(1024, "qa1", "office", " bathro"),
        _sample(4096, "qa1", "office", " office"),
        _sample(1024, "qa2", "garden", " garden"),
    ]
    rows = answer_counts.answer_counts(samples, top=1)
    assert [(r["length"], r["task"]) for r in rows] == [(1024, "qa1"), (1024, "qa2"), (4096, "qa1")]
    first = rows[0]
    assert first["n"] == 3 and abs(first["accuracy"] - 1 / 3) < 1e-12
    assert first["distinct_answers"] == 2 and first["top_answers"] == [("office", 2)]
    assert first["most_frequent_gold"] == ["office", 2 / 3]


def test_depth_cells_and_cli(tmp_path):
    samples = [
        {"length": 512, "depth": d, "answer": "12345", "prediction": " 12345", "correct": True}
        for d in (0.0, 0.5, 0.5)
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"metadata": {"samples": samples}}))
    rows = answer_counts.answer_counts(samples)
    assert [(r["depth"], r["n"]) for r in rows] == [(0.0, 1), (0.5, 2)]
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=True)
    assert "'12345' x2" in out.stdout
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps({"cells": []}))
    res = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True)
    assert res.returncode != 0 and "no metadata.samples" in res.stderr


def test_char_accuracy_gives_a_blurred_key_partial_credit():
    assert answer_counts.char_accuracy("12345", " 12355") == 0.8
    assert answer_counts.char_accuracy("12345", "12") == 0.4
    assert answer_counts.char_accuracy("12345", "123456") == 1.0
    assert answer_counts.char_accuracy("", " ") == 1.0
    samples = [
        {"length": 64, "depth": 0.0, "answer": "ab-cd", "prediction": " ab-cd", "correct": True},
        {"length": 64, "depth": 0.0, "answer": "ab-cd", "prediction": " xb-cx", "correct": False},
    ]
    (row,) = answer_counts.answer_counts(samples)
    assert row["accuracy"] == 0.5 and abs(row["char_accuracy"] - 0.8) < 1e-12
