"""`titans eval babilong --seeds`: one model per seed, all on the same samples, and a summary whose mean /
min / max per cell are those of the per-seed result files."""

from __future__ import annotations

import json

import pytest

from titans.cli import main as titans_main
from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.babilong import babilong_grid
from titans.evaluation.scoring import AccuracyTable
from titans.evaluation.seeds import aggregate_tables, format_seed_table


def test_aggregate_tables_mean_and_range_per_cell():
    tables = []
    for hits in ([1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]):  # qa1 at 1024: 2/2, 1/2, 2/2; qa2: 0/2, 0/2, 1/2
        t = AccuracyTable(row_name="length", col_name="task")
        for i, ok in enumerate(hits):
            t.add(1024, "qa1" if i < 2 else "qa2", bool(ok))
        t.add(4096, "qa1", True)
        tables.append(t)
    tables[1].counts.pop((4096, "qa1"))  # a length skipped by one seed
    s = aggregate_tables([0, 1, 2], tables)
    cells = {(c["length"], c["task"]): c for c in s["cells"]}
    assert cells[1024, "qa1"]["mean"] == pytest.approx(5 / 6)
    assert (cells[1024, "qa1"]["min"], cells[1024, "qa1"]["max"]) == (0.5, 1.0)
    assert cells[1024, "qa2"]["per_seed"] == {"0": 0.0, "1": 0.0, "2": 0.5}
    assert cells[4096, "qa1"]["per_seed"]["1"] is None and cells[4096, "qa1"]["mean"] == 1.0
    assert s["overall"]["per_seed"]["1"] == pytest.approx(1 / 4)
    text = format_seed_table(s)
    assert "83.3 [50-100]" in text and "16.7 [0-50]" in text
    with pytest.raises(ValueError, match="2 seeds for 1 tables"):
        aggregate_tables([0, 1], tables[:1])


def test_babilong_seeds_trains_one_model_per_seed_on_the_same_samples(tmp_path, capsys):
    argv = ["eval", "babilong", "--train-recipe", "--variant", "lmm", "--tasks", "qa1", "--num-facts", "2"]
    argv += ["--set", "dim=32", "--set", "depth=1", "--set", "heads=2", "--set", "chunk_size=4"]
    argv += ["--train-length", "400", "--start-length", "400", "--steps", "2", "--batch-size", "2"]
    argv += ["--lengths", "400,430", "--samples", "3", "--threads", "1", "--seeds", "3,1"]
    argv += ["--out", str(tmp_path), "--name", "bl"]
    assert titans_main(argv) == 0
    runs = {s: json.loads((tmp_path / f"bl_seed{s}.json").read_text()) for s in (3, 1)}
    assert [r["metadata"]["model"]["training"]["recipe"]["seed"] for r in runs.values()] == [3, 1]
    # each seed's file names the seed its stories were drawn with (--seed, 0), not its training seed
    assert [r["metadata"]["sample_seed"] for r in runs.values()] == [0, 0]
    answers = [[(x["length"], x["answer"]) for x in r["metadata"]["samples"]] for r in runs.values()]
    assert answers[0] == answers[1]  # the same stories for every seed: those of --seed (0), not seed 3's
    drawn = babilong_grid(ByteTokenizer(), [400, 430], ["qa1"], samples_per_cell=3, seed=0, num_facts=2)
    assert answers[0] == [(s.length, s.answer) for s in drawn]
    assert answers[0] != [
        (s.length, s.answer)
        for s in babilong_grid(ByteTokenizer(), [400, 430], ["qa1"], samples_per_cell=3, seed=3, num_facts=2)
    ]
    summary = json.loads((tmp_path / "bl_seeds.json").read_text())
    assert summary["seeds"] == [3, 1]
    for cell in summary["cells"]:
        accs = [
            next(
                c["accuracy"]
                for c in r["cells"]
                if (c["length"], c["task"]) == (cell["length"], cell["task"])
            )
            for r in runs.values()
        ]
        assert cell["mean"] == pytest.approx(sum(accs) / 2)
        assert (cell["min"], cell["max"]) == (min(accs), max(accs))
    assert "BABILong over seeds [3, 1]" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        titans_main([*argv[:-2], "--out", str(tmp_path), "--name", "dup", "--seeds", "1,1"])
    assert exit_.value.code == 2
