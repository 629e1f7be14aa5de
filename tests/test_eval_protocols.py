"""Regressions of the evaluation package's fifth audit: the runner's model protocol, `eval ppl`'s precision
and messages, `eval babilong --seeds` file names, and `eval depth --lm-steps`."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch

from micro_train import micro_config
from tiny_lm import save_tiny_run
from titans import TitansConfig, TitansLM
from titans.cli import main as titans_main
from titans.data.loader import EvalWindows
from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.niah import niah_grid
from titans.evaluation.runner import evaluate, greedy_generate
from titans.training.trainer import Trainer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("token_cache")


# ------------------------------------------------------------------ 1. the runner's StreamingModel protocol
class Bigram(torch.nn.Module):
    """A model that follows the runner's documented protocol, ``model(tokens, state=None)``, and no more."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        self.calls = 0

    def forward(self, tokens, state=None):
        self.calls += 1
        return self.emb(tokens), state


def test_runner_evaluates_a_model_that_only_follows_the_protocol():
    torch.manual_seed(0)
    model = Bigram(TOK.vocab_size)
    samples = niah_grid(TOK, [300], [0.5])
    result = evaluate(model, TOK, samples, prefill_chunk=128)
    assert 0.0 <= result.table.overall <= 1.0 and model.calls > 0
    # a plain function (no module) following the protocol works too, and decodes what the module does
    prompt = torch.tensor([samples[0].prompt_ids])
    assert torch.equal(
        greedy_generate(lambda tokens, state=None: model(tokens, state), prompt, 3, prefill_chunk=100),
        greedy_generate(model, prompt, 3, prefill_chunk=100),
    )


def test_runner_still_asks_titans_lm_for_the_last_position_only(monkeypatch):
    torch.manual_seed(0)
    config = TitansConfig.preset(
        "tiny", variant="mac", vocab_size=TOK.vocab_size, dim=32, depth=1, heads=2, segment_len=16,
        window=16, chunk_size=4, persistent_tokens=2,
    )  # fmt: skip
    model = TitansLM(config).eval()
    seen = []
    forward = TitansLM.forward

    def spy(self, tokens, state=None, last_only=False):
        logits, state = forward(self, tokens, state, last_only)
        seen.append((tokens.shape[1], last_only, logits.shape[1]))
        return logits, state

    monkeypatch.setattr(TitansLM, "forward", spy)
    prompt = torch.randint(0, TOK.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    greedy_generate(model, prompt, 2, prefill_chunk=16)
    assert seen[:3] == [(16, True, 1), (16, True, 1), (8, True, 1)]  # the prompt: last position only
    assert seen[3] == (1, False, 1)  # decoding


# ------------------------------------------------------------------ 2. eval ppl scores as the trainer did
def test_autocast_follows_the_trainers_rule():
    from titans.training.config import autocast_dtype_for

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert autocast_dtype_for("bfloat16", cpu) is torch.bfloat16
    assert autocast_dtype_for("bfloat16", cuda) is torch.bfloat16
    assert autocast_dtype_for("auto", cuda) is torch.bfloat16
    assert autocast_dtype_for("auto", cpu) is None
    assert autocast_dtype_for("float32", cuda) is None
    assert autocast_dtype_for("float32", cpu) is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        autocast_dtype_for("fp16", cpu)


def test_eval_ppl_reproduces_a_bf16_runs_held_out_score_on_cpu(tmp_path, cache_dir, capsys):
    run_dir = tmp_path / "run"
    cfg = micro_config(run_dir, cache_dir, steps=2, eval_windows=2, dtype="bfloat16")
    result = Trainer(cfg).train()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["eval"]["loss"] == pytest.approx(result.eval.loss, rel=1e-7)
    # the run's seq_len and eval_windows by default (64 windows had scored another loss)
    argv = ["eval", "ppl", "--checkpoint", str(run_dir), "--batch-size", "2"]
    argv += ["--device", "cpu", "--out", str(tmp_path / "ppl.json")]
    assert titans_main(argv) == 0
    scored = json.loads((tmp_path / "ppl.json").read_text())["loss"]
    assert scored == pytest.approx(report["eval"]["loss"], rel=1e-6)  # the run's dtype: bf16 autocast
    # --dtype overrides the run's: float32 scores differently
    assert titans_main([*argv[:-1], str(tmp_path / "f32.json"), "--dtype", "float32"]) == 0
    f32 = json.loads((tmp_path / "f32.json").read_text())["loss"]
    assert f32 != pytest.approx(scored, rel=1e-6)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        titans_main([*argv, "--dtype", "half"])
    assert "--dtype: invalid choice: 'half'" in capsys.readouterr().err


# ------------------------------------------------------------------ 5. eval ppl names the user's text
def test_eval_windows_name_the_text_they_were_given(caplog):
    with pytest.raises(ValueError, match=r"^text source 'mine.txt' has 13 tokens; seq_len=20 needs 21$"):
        EvalWindows(np.arange(13), seq_len=20, what="text source 'mine.txt'")
    with pytest.raises(ValueError, match=r"^held-out stream has 13 tokens"):  # the trainer's default
        EvalWindows(np.arange(13), seq_len=20)
    with caplog.at_level(logging.WARNING, logger="titans.data.loader"):
        EvalWindows(np.arange(13), seq_len=4, num_windows=9, what="text source 'mine.txt'")
    assert "text source 'mine.txt' has room for 3 windows" in caplog.text


def test_eval_ppl_on_a_short_file_names_the_file(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    config = TitansConfig.preset(
        "tiny", variant="swa", vocab_size=TOK.vocab_size, dim=32, depth=1, heads=2, window=16
    )
    run = save_tiny_run(tmp_path / "run", TitansLM(config))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.txt").write_text("hello world\n")
    argv = ["eval", "ppl", "--checkpoint", str(run), "--data", "tiny.txt", "--seq-len", "5000"]
    assert titans_main([*argv, "--device", "cpu", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "text source 'tiny.txt' has 13 tokens; seq_len=5000 needs 5001" in err
    assert "held-out" not in err


def test_eval_ppl_of_a_run_with_relative_data_from_another_folder_says_so(tmp_path, capsys, monkeypatch):
    """A run trained on `--data mydata` (a relative path) and scored from another folder: "no such file",
    or, where that folder has a `mydata` of its own, "the data changed since the run". Both now say the
    run's data is a relative path read from the current folder."""
    (tmp_path / "a" / "mydata").mkdir(parents=True)
    (tmp_path / "a" / "mydata" / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    monkeypatch.chdir(tmp_path / "a")
    cfg = micro_config(tmp_path / "a" / "run", tmp_path / "cache", steps=1, batch_size=2, eval_windows=1)
    Trainer(dataclasses.replace(cfg, data="mydata")).train()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    argv = ["eval", "ppl", "--checkpoint", str(tmp_path / "a" / "run"), "--windows", "1"]
    for other in (None, "other text entirely, not the run's. " * 400):
        if other is not None:
            (tmp_path / "b" / "mydata").mkdir()
            (tmp_path / "b" / "mydata" / "t.txt").write_text(other)
        assert titans_main(argv) == 2
        err = capsys.readouterr().err
        assert "the run's data is a relative path, read from the current folder" in err, err
        assert "if the run was trained in another folder, run this from there" in err
    monkeypatch.chdir(tmp_path / "a")
    assert titans_main(argv) == 0


# ------------------------------------------------------------------ 3. babilong --seeds: the model's variant
def test_babilong_seeds_names_files_after_the_checkpoints_variant(tmp_path):
    torch.manual_seed(0)
    config = TitansConfig.preset(
        "tiny", variant="lmm", vocab_size=TOK.vocab_size, dim=32, depth=1, heads=2, chunk_size=4
    )
    run = save_tiny_run(tmp_path / "run", TitansLM(config))
    out = tmp_path / "out"
    argv = ["eval", "babilong", "--checkpoint", str(run), "--train-recipe", "--tasks", "qa1"]
    argv += ["--num-facts", "1", "--lengths", "400", "--train-length", "400", "--start-length", "400"]
    argv += ["--steps", "1", "--batch-size", "1", "--warmup-steps", "1", "--samples", "1"]
    argv += ["--seeds", "0,1", "--threads", "1", "--out", str(out)]  # --variant left at its default, mac
    assert titans_main(argv) == 0
    names = sorted(p.name for p in out.glob("*.json"))
    assert names == [
        "babilong_qa1_lmm_seed0.json",
        "babilong_qa1_lmm_seed1.json",
        "babilong_qa1_lmm_seeds.json",
    ]
    for seed in (0, 1):
        metadata = json.loads((out / f"babilong_qa1_lmm_seed{seed}.json").read_text())["metadata"]
        assert metadata["variant"] == "lmm"
        command = metadata["command"]  # the name the seed's file got, and its training seed
        assert (command["name"], command["seed"]) == (f"babilong_qa1_lmm_seed{seed}", seed)
    summary = json.loads((out / "babilong_qa1_lmm_seeds.json").read_text())
    assert summary["variant"] == "lmm"
    assert summary["per_seed_files"] == [str(out / f"babilong_qa1_lmm_seed{s}.json") for s in (0, 1)]


# ------------------------------------------------------------------ 4. eval depth / ablate --lm-steps
def test_depth_and_ablate_each_say_what_lm_steps_0_means(tmp_path, capsys):
    with pytest.raises(SystemExit):
        titans_main(["eval", "depth", "--help"])
    depth_help = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        titans_main(["eval", "ablate", "--help"])
    ablate_help = " ".join(capsys.readouterr().out.split())
    assert "skip the LM stage" in ablate_help and "skip the LM stage" not in depth_help
    assert "LM steps per depth (>= 1" in depth_help


@pytest.mark.parametrize(
    "steps, want",
    [
        ("0", "--lm-steps must be >= 1 (every depth is trained as a language model), got 0"),
        ("-3", "argument --lm-steps: expected an integer >= 0, got '-3'"),
    ],
)
def test_depth_refuses_lm_steps_below_1_naming_the_flag(tmp_path, capsys, steps, want):
    argv = ["eval", "depth", "--lm-steps", steps, "--depths", "1", "--eval-lengths", "64"]
    argv += ["--throughput-lengths", "64", "--run-root", str(tmp_path / "runs"), "--out", str(tmp_path / "o")]
    try:
        code = titans_main(argv)
    except SystemExit as e:  # argparse's refusal
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert want in err
    assert "TrainConfig" not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "o").exists()


def _study_folders(tmp_path) -> list[str]:
    """One LM step, and the study's run root and output under ``tmp_path`` (neither may be made)."""
    return ["--lm-steps", "1", "--run-root", str(tmp_path / "runs"), "--out", str(tmp_path / "o")]


@pytest.mark.parametrize(
    "argv, want",
    [
        (
            ["depth", "--throughput-repeats", "0"],
            "argument --throughput-repeats: expected a positive integer",
        ),
        (["depth", "--throughput-batch", "0"], "argument --throughput-batch: expected a positive integer"),
        (
            ["depth", "--throughput-lengths", "64,0"],
            "argument --throughput-lengths: expected comma-separated",
        ),
        (
            ["depth", "--eval-lengths", "-5"],
            "argument --eval-lengths: expected comma-separated integers >= 1",
        ),
        (
            ["ablate", "--eval-lengths", "0"],
            "argument --eval-lengths: expected comma-separated integers >= 1",
        ),
        (["depth", "--depths", "1,1"], "--depths has duplicates: [1, 1]"),
        (["ablate", "--rows", "full,full"], "--rows has duplicates: ['full', 'full']"),
        (["depth", "--variant", "transformer"], "--variant transformer has no memory, so no memory depth"),
        (["ablate", "--variant", "swa"], "--variant swa has no memory, so the rows ['linear_memory',"),
        (["ablate", "--task-steps", "-1"], "argument --task-steps: expected an integer >= 0"),
        (["ablate", "--lm-lr", "nan"], "argument --lm-lr: expected a finite number > 0"),
        # the NIAH stage's options, which the rows reach only after their LM stage
        (["ablate", "--task-steps", "1", "--depths", "1.5"], "depth must be a number in [0, 1], got 1.5"),
        (["ablate", "--task-steps", "1", "--eval-lengths", "8"], "length=8 is too short: the preamble"),
        (["ablate", "--task-steps", "1", "--train-length", "100"], "train_length=100 is shorter than"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_depth_and_ablate_refuse_what_would_waste_or_mislabel_a_study(tmp_path, capsys, argv, want):
    """Found only after training, or never: 0 timed repeats wrote 0 tokens/s as a result, a batch of 0
    raised a reshape traceback, a repeated depth or row trained into the first one's folder and failed, and
    a variant without memory gave identical rows labelled as different memory settings."""
    argv = ["eval", *argv, *_study_folders(tmp_path)]
    try:
        code = titans_main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    assert code == 2
    assert want in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "o").exists()


def test_ablate_skips_rows_that_remove_what_the_base_model_lacks(tmp_path, capsys, monkeypatch):
    """With a rule without momentum (yaad) the no_momentum row trained `full`'s model again, and with
    --set memory_conv_kernel=0 no_conv did: both were reported as removals with full's numbers."""
    from titans.evaluation import ablation

    trained = []
    monkeypatch.setattr(ablation, "run_row", lambda args, name, *rest: trained.append(name) or {"name": name})
    monkeypatch.setattr(ablation, "write_study", lambda *a, **k: None)
    monkeypatch.setattr(ablation, "format_rows", lambda *a: "")
    argv = ["eval", "ablate", "--rows", "full,no_momentum,no_conv,linear_memory", *_study_folders(tmp_path)]
    argv += ["--set", "memory_rule=yaad", "--set", "memory_conv_kernel=0", "--lm-steps", "1"]
    assert titans_main(argv) == 0
    assert trained == ["full", "linear_memory"]
    assert (
        "skipping no_momentum, no_conv: the base model has nothing there to remove" in capsys.readouterr().out
    )
    trained.clear()  # a MAL without memory layers: every memory row is full's model
    argv = [
        "eval",
        "ablate",
        "--variant",
        "mal",
        "--rows",
        "full,no_momentum,no_conv",
        *_study_folders(tmp_path),
    ]
    assert titans_main([*argv, "--set", "memory_layers=[]", "--lm-steps", "1"]) == 0
    assert trained == ["full"]
    trained.clear()  # a frozen memory: momentum is part of the write; the conv still shapes its reads
    assert titans_main([*argv, "--set", "memory_write=false", "--lm-steps", "1"]) == 0
    assert trained == ["full", "no_conv"]


@pytest.mark.parametrize("study, rows", [("ablate", ["full", "no_conv"]), ("depth", ["depth1", "depth2"])])
def test_a_run_root_holding_a_later_rows_run_is_refused_before_the_first_row_trains(
    tmp_path, capsys, study, rows
):
    """Only the row whose folder was taken failed, after the rows before it had trained."""
    (tmp_path / "runs" / rows[1] / "checkpoints" / "step_00000002").mkdir(parents=True)
    argv = ["eval", study, *_study_folders(tmp_path)]
    argv += ["--rows", ",".join(rows)] if study == "ablate" else ["--depths", "1,2"]
    assert titans_main(argv) == 2
    assert f"already holds runs of ['{rows[1]}']: give an empty or new folder" in capsys.readouterr().err
    assert not (tmp_path / "runs" / rows[0]).exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, want",
    [
        (["niah", "--depths", "1.5", "--lengths", "512"], "depth must be a number in [0, 1], got 1.5"),
        (["niah", "--lengths", "8"], "length=8 is too short: the preamble"),
        (["niah", "--lengths", "512", "--train-length", "100"], "train_length=100 is shorter than"),
        (["babilong", "--lengths", "100"], "length=100 is too short: the preamble, facts"),
        # a value given twice scored its cells twice, counted as twice the samples
        (["niah", "--lengths", "512,512"], "lengths has duplicates: [512, 512]"),
        (["niah", "--lengths", "512", "--depths", "0.5,0.5"], "depths has duplicates: [0.5, 0.5]"),
        (["babilong", "--lengths", "1024", "--tasks", "qa1,qa1"], "tasks has duplicates: ['qa1', 'qa1']"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_niah_and_babilong_refuse_bad_lengths_and_depths_before_training(tmp_path, capsys, argv, want):
    """The evaluation samples were drawn only after the recipe had trained the model."""
    argv = ["eval", *argv, "--train-recipe", "--steps", "2", "--save-model", str(tmp_path / "m")]
    assert titans_main([*argv, "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    assert want in captured.err
    assert "loss" not in captured.out and not (tmp_path / "m").exists()


def test_save_model_without_the_recipe_is_refused(tmp_path, capsys):
    """Nothing is trained then, and nothing was saved: the flag was ignored without a word."""
    argv = ["eval", "niah", "--checkpoint", str(tmp_path / "run"), "--save-model", str(tmp_path / "m")]
    assert titans_main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "--save-model saves the model the recipe trains: give --train-recipe" in capsys.readouterr().err
