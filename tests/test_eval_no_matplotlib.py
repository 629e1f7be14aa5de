"""Without matplotlib (a plain `pip install titans`), the evaluation commands still finish: the results and
their JSON first, then one line saying the plot was skipped, and exit status 0."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.recipe import save_task_model
from titans.evaluation.reporting import write_study
from titans.models.config import TitansConfig
from titans.models.lm import TitansLM
from titans.training.metrics import plot_losses

SRC = Path(__file__).resolve().parents[1] / "src"
# matplotlib made unimportable the way a missing package is: `import matplotlib` raises ImportError
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from titans.cli import main; sys.exit(main())"


def test_titans_eval_niah_without_matplotlib_writes_json_and_exits_0(tmp_path):
    cfg = TitansConfig.preset("tiny", variant="lmm", dim=32, depth=1, heads=2, chunk_size=4)
    torch.manual_seed(0)
    run = tmp_path / "run"
    args = argparse.Namespace(tokenizer="bytes", lr=1e-3, seed=0)
    save_task_model(
        run, TitansLM(cfg), ByteTokenizer(), args, {"steps_done": 1, "recipe": {"train_length": 64}}
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", NO_MATPLOTLIB, "eval", "niah", "--checkpoint", str(run), "--lengths", "300"]
    cmd += ["--depths", "0.5", "--samples", "1", "--threads", "1", "--out", str(out), "--name", "n"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "n.json").read_text())
    assert result["cells"][0]["total"] == 1
    assert not (out / "n.png").exists()
    skipped = [line for line in done.stdout.splitlines() if "matplotlib is not installed" in line]
    assert len(skipped) == 1 and "n.png" in skipped[0]
    assert f"wrote {out / 'n.json'}" in done.stdout


def test_studies_and_training_plots_skip_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    def plot(rows, png_path, title):  # the studies' figures import matplotlib when drawn
        import matplotlib  # noqa: F401

        raise AssertionError("not reached")

    args = argparse.Namespace(out=str(tmp_path), name="study")
    write_study(args, "ablate", "ablate_x", [{"row": "full", "loss": 1.5}], "title", plot, "the table")
    assert json.loads((tmp_path / "study.json").read_text())["rows"] == [{"row": "full", "loss": 1.5}]
    out = capsys.readouterr().out
    assert out.count("matplotlib is not installed") == 1 and "the table" in out
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"split": "train", "step": 1, "loss": 2.0}) + "\n")
    assert plot_losses(metrics, tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()
