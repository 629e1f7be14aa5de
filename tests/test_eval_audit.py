"""What the evaluation commands promise about the files they write and the numbers they report.

A ``--save-model`` folder holds (and loads) exactly the model that was just trained; a NaN training loss
or NaN model outputs end a command with one line naming what happened, never a score; result files are
strict JSON, written all or nothing; ``eval ablate`` honours the evaluation options ``eval niah`` does;
nonsense recipe numbers are refused by the parser.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import titans.evaluation.recipe as recipe_module
import titans.evaluation.task_training as task_training
from tiny_lm import save_tiny_run
from titans import TitansConfig, TitansLM
from titans._fs import current_umask
from titans.cli import main as titans_main
from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.runner import greedy_generate
from titans.evaluation.task_training import TaskTrainConfig
from titans.runtime.checkpoint import list_checkpoints

TINY_SET = ["--set", "dim=16", "--set", "depth=1", "--set", "heads=1", "--set", "chunk_size=4"]
TINY_SET += ["--set", "segment_len=16", "--set", "window=16", "--threads", "1", "--device", "cpu"]
RECIPE = ["--batch-size", "1", "--train-length", "320", "--start-length", "304", "--warmup-steps", "0"]
NIAH = ["eval", "niah", "--train-recipe", "--variant", "lmm", *TINY_SET, *RECIPE]
NIAH += ["--lengths", "320", "--depths", "0", "--samples", "1"]


# ------------------------------------------------------------------------------------ --save-model


def test_save_model_folder_holds_exactly_the_model_just_trained(tmp_path, capsys):
    folder = tmp_path / "model"
    argv = [*NIAH, "--out", str(tmp_path / "res"), "--save-model", str(folder)]
    assert titans_main([*argv, "--steps", "3"]) == 0
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000003"]
    capsys.readouterr()
    # a shorter run into the same folder replaces the longer one's model (whose higher step would load)
    assert titans_main([*argv, "--steps", "2", "--seed", "1"]) == 0
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000002"]
    assert "holds the model of an earlier run (step_00000003)" in capsys.readouterr().out
    _, _, info = recipe_module.load_task_model(folder, "cpu")
    assert info["training"]["recipe"]["seed"] == 1 and info["training"]["steps_done"] == 2
    # fine-tuned in place: the folder then holds the fine-tuned model
    again = ["eval", "niah", "--train-recipe", "--checkpoint", str(folder), *RECIPE, "--steps", "1"]
    again += ["--lengths", "320", "--depths", "0", "--samples", "1", "--threads", "1", "--device", "cpu"]
    assert titans_main([*again, "--out", str(tmp_path / "res"), "--save-model", str(folder)]) == 0
    _, _, info = recipe_module.load_task_model(folder, "cpu")
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000001"]
    assert (
        info["training"]["fine_tuned_from"] == str(folder) and info["training"]["earlier"]["steps_done"] == 2
    )
    # a folder with checkpoints no recipe saved (a `titans train` run's) is refused before training
    torch.manual_seed(0)
    run = save_tiny_run(tmp_path / "run", TitansLM(TitansConfig(variant="swa", vocab_size=256, dim=16)))
    capsys.readouterr()
    assert titans_main([*NIAH, "--steps", "1", "--out", str(tmp_path), "--save-model", str(run)]) == 2
    out, err = capsys.readouterr()
    assert "holds checkpoints that no recipe run saved (step_00000001" in err and len(err.splitlines()) == 1
    assert "step " not in out and [p.name for p in list_checkpoints(run)] == ["step_00000001"]


def test_save_task_model_keeps_only_the_model_it_saves(tmp_path):
    tokenizer = ByteTokenizer()
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant="swa", vocab_size=256, dim=16, depth=1, heads=1, window=8))
    args = argparse.Namespace(tokenizer="bytes", lr=1e-3, seed=0)
    summary = {"steps_done": 6, "recipe": {"train_length": 320}, "final": None}
    recipe_module.save_task_model(tmp_path, model, tokenizer, args, summary)
    recipe_module.save_task_model(tmp_path, model, tokenizer, args, {**summary, "steps_done": 3})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003"]


def test_tasks_checks_every_model_folder_before_the_first_variant(tmp_path, capsys):
    models = tmp_path / "models"
    (models / "swa" / "checkpoints" / "step_00000001").mkdir(parents=True)
    argv = ["eval", "tasks", "--variants", "lmm,swa", *TINY_SET, *RECIPE, "--steps", "1"]
    argv += ["--eval-lengths", "320", "--depths", "0", "--samples", "1", "--out", str(tmp_path)]
    assert titans_main([*argv, "--save-models", str(models)]) == 2
    out, err = capsys.readouterr()
    assert "--save-models (swa)" in err and "no recipe run saved" in err and "===" not in out
    # --from-models: a variant with no saved model is named before the others are evaluated
    torch.manual_seed(0)
    lmm = TitansLM(TitansConfig(variant="lmm", vocab_size=256, dim=16, depth=1, heads=1, chunk_size=4))
    save_tiny_run(models / "lmm", lmm)
    argv = ["eval", "tasks", "--variants", "lmm,mac", "--from-models", str(models), "--threads", "1"]
    argv += ["--eval-lengths", "320", "--depths", "0", "--samples", "1", "--out", str(tmp_path)]
    assert titans_main([*argv, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "no mac model" in err and "===" not in out


# ------------------------------------------------------------------------------ NaN: an error, one line


def test_a_nan_training_loss_is_one_line_naming_the_step(tmp_path, monkeypatch, capsys):
    real = task_training.masked_loss

    def nan_loss(*a, **kw):
        loss, *rest = real(*a, **kw)
        return (loss * float("nan"), *rest)

    monkeypatch.setattr(task_training, "masked_loss", nan_loss)
    assert titans_main([*NIAH, "--steps", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "error: training loss became nan by step" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--lm-loss-weight", "nan"),
        ("--lm-loss-weight", "-1"),
        ("--lr", "nan"),
        ("--lr", "0"),
        ("--time-budget", "0"),
        ("--time-budget", "-1"),
        ("--time-budget", "nan"),
        ("--curriculum-loss", "inf"),
        ("--prefill-chunk", "0"),
        ("--samples", "0"),
    ],
)
def test_nonsense_numbers_are_refused_by_the_parser(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        titans_main([*NIAH, "--steps", "1", "--out", str(tmp_path), flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_task_config_refuses_nan_weights():
    with pytest.raises(ValueError, match="lm_loss_weight"):
        TaskTrainConfig(lm_loss_weight=math.nan)
    with pytest.raises(ValueError, match="lr"):
        TaskTrainConfig(lr=math.nan)


class NanModel:
    """Streaming stub whose logits are NaN."""

    def __call__(self, tokens, state=None, last_only=False):
        logits = torch.full((tokens.shape[0], 1 if last_only else tokens.shape[1], 256), math.nan)
        return logits, state


def test_nan_logits_are_no_answer():
    with pytest.raises(ValueError, match="not finite"):
        greedy_generate(NanModel(), torch.zeros(2, 5, dtype=torch.long), 3)


def nan_checkpoint(path, variant="swa"):
    """A checkpoint whose output layer is NaN (no memory: nothing else notices)."""
    torch.manual_seed(0)
    cfg = TitansConfig(variant=variant, vocab_size=256, dim=16, depth=1, heads=1, segment_len=16, window=16)
    model = TitansLM(cfg).eval()
    with torch.no_grad():
        list(model.parameters())[-1].fill_(math.nan)
    return save_tiny_run(path, model)


def test_nan_model_outputs_are_an_error_not_a_score(tmp_path, capsys):
    run = nan_checkpoint(tmp_path / "nan")
    argv = ["eval", "niah", "--checkpoint", str(run), "--lengths", "280", "--depths", "0", "--samples", "1"]
    assert titans_main([*argv, "--device", "cpu", "--out", str(tmp_path / "niah")]) == 2
    err = capsys.readouterr().err.strip()
    assert "logits are not finite" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "niah").exists()
    text = tmp_path / "text.txt"
    text.write_text("the memory learns to remember surprising tokens while it reads. " * 8)
    argv = ["eval", "context", "--checkpoint", str(run), "--data", str(text), "--length", "100"]
    argv += ["--windows", "1", "--device", "cpu", "--out", str(tmp_path / "c.json")]
    assert titans_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "next-token loss is nan at position 0 of window 0" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c.json").exists()


def test_result_json_is_strict(tmp_path):
    from titans.evaluation.scoring import write_json

    path = write_json(tmp_path / "r.json", {"rows": [{"loss": 1.5}, {"path": tmp_path}]})
    assert json.loads(path.read_text())["rows"][1]["path"] == str(tmp_path)
    with pytest.raises(ValueError, match=r"r2.json not written: rows\[1\].loss is not finite"):
        write_json(tmp_path / "r2.json", {"rows": [{"loss": 1.5}, {"loss": math.inf}]})
    assert not (tmp_path / "r2.json").exists()


# ------------------------------------------------------------------------------------------ eval ablate


def test_ablate_honours_the_evaluation_options(tmp_path, monkeypatch, capsys):
    seen = []
    real = recipe_module.evaluate

    def spy(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(recipe_module, "evaluate", spy)
    argv = ["eval", "ablate", "--rows", "full", *TINY_SET, "--lm-steps", "0", "--task-steps", "1"]
    argv += [*RECIPE, "--eval-lengths", "320", "--depths", "0", "--samples", "1", "--out", str(tmp_path)]
    assert titans_main([*argv, "--variant", "lmm", "--prefill-chunk", "7", "--eval-batch-size", "3"]) == 0
    assert [(kw["prefill_chunk"], kw["batch_size"]) for kw in seen] == [(7, 3)]
    # full attention past --max-attention-length is skipped, as in `eval niah`, and the row says so
    assert titans_main([*argv, "--variant", "transformer", "--max-attention-length", "100"]) == 0
    assert len(seen) == 1 and "skipping lengths [320]" in capsys.readouterr().out
    [row] = json.loads((tmp_path / "ablate_transformer.json").read_text())["rows"]
    assert row["niah_skipped_lengths"] == [320] and row["niah_accuracy"] is None


# ------------------------------------------------------------------------------------ atomic writes


def test_write_text_atomic_replaces_whole_files_with_ordinary_modes(tmp_path, monkeypatch):
    from titans._fs import write_text_atomic

    path = tmp_path / "r.json"
    write_text_atomic(path, "first\n")
    assert path.read_text() == "first\n" and path.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    write_text_atomic(path, "second\n")
    assert path.read_text() == "second\n"

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left") as e:
        write_text_atomic(path, "third\n")
    assert e.value.filename == str(path)  # the command line names the file
    assert path.read_text() == "second\n" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


# Rewrites a result file on a "disk" that fills after 2 KiB (a file-size limit): the previous file stays.
FULL_DISK = """
import argparse, json, resource, signal, sys
from pathlib import Path
from titans.evaluation.reporting import write_study
from titans.evaluation.scoring import AccuracyTable, write_results

out = Path(sys.argv[1])
table = AccuracyTable()
for length in range(100):
    table.add(1000 + length, 0.5, True)
rows = [{"name": f"row{i}", "loss": 1.0} for i in range(100)]
args = argparse.Namespace(out=str(out), name="study")
write_results(out / "table.json", table)
write_study(args, "ablate", "study", rows, "t", lambda *a: None, "t")
before = {p.name: p.read_text() for p in out.glob("*.json")}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
table.add(5000, 0.5, False)
failed = []
for name, write in [
    ("table.json", lambda: write_results(out / "table.json", table)),
    ("study.json", lambda: write_study(args, "ablate", "study", rows[:99], "t", lambda *a: None, "t")),
]:
    try:
        write()
    except OSError:
        failed.append(name)
after = {p.name: p.read_text() for p in out.iterdir()}
print(json.dumps({"failed": failed, "kept": before == after, "files": sorted(after)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_failed_rewrite_keeps_the_previous_result_file(tmp_path):
    script = textwrap.dedent(FULL_DISK)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "failed": ["table.json", "study.json"],
        "kept": True,
        "files": ["study.json", "table.json"],
    }


# ------------------------------------------------------------------------------------------ signals


@pytest.mark.parametrize("command", ["ablate", "depth"])
def test_a_signal_during_a_study_ends_it_with_the_signal_s_status(tmp_path, monkeypatch, capsys, command):
    """SIGTERM (or Ctrl-C) while `eval ablate` / `eval depth` trained a row stopped that row's training,
    and the study went on: the next rows trained in full and the command exited 0, its JSON reporting the
    cut-short row as trained for all its steps. It ends with 128 + the signal's number, writing nothing."""
    import os
    import signal

    from titans.training.trainer import Trainer

    real = Trainer._optimizer_step
    steps = []

    def step_then_signal(self):
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this process
        return real(self)

    monkeypatch.setattr(Trainer, "_optimizer_step", step_then_signal)
    out = tmp_path / "out"
    if command == "ablate":
        argv = ["eval", "ablate", "--rows", "full,no_conv", *TINY_SET, "--lm-steps", "4", "--task-steps", "0"]
        argv += ["--lm-batch-size", "2", "--seq-len", "32", "--heldout-windows", "1"]
    else:
        argv = ["eval", "depth", "--depths", "1,2", "--lm-steps", "4", "--eval-lengths", "32", *TINY_SET]
        argv += ["--throughput-lengths", "32", "--run-root", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as stopped:
        titans_main([*argv, "--out", str(out)])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM while" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
