"""Every command speaks the same way: errors as one "titans X: error: ..." line (no traceback), "did you
mean" for mistyped commands, options, fields, presets and variants, the files each command wrote listed at
its end, plots whose labels say what they show, and a sample prompt the tokenizer can encode."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from tiny_lm import save_tiny_run, tiny_model
from titans.cli import build_parser
from titans.cli import main as titans_main
from titans.data.tokenizers import TOKENIZER_HELP
from titans.training.config import DATA_HELP, FIELD_HELP, TrainConfig, parse_set


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


# ---------------------------------------------------------------------------------- the error form
def test_read_errors_take_the_command_form(tmp_path, capsys):
    args = ["read", "--checkpoint", str(tmp_path / "ck"), "--save-state", str(tmp_path / "s.safetensors")]
    assert titans_main([*args, "--input", str(tmp_path / "missing.txt")]) == 2
    err = error_line(capsys)
    assert err.startswith("titans read: error: ") and "missing.txt" in err


def test_forecast_eval_without_a_model_names_the_folder(tmp_path, capsys):
    assert titans_main(["forecast", "eval", "--run", str(tmp_path)]) == 2
    err = error_line(capsys)
    assert err.startswith("titans forecast eval: error: ") and "Errno" not in err
    assert "model.pt" in err and "titans forecast train" in err


def test_a_missing_file_reads_as_such(tmp_path, capsys):
    """FileNotFoundError from deep inside a command reads as a sentence, not as Python's "[Errno 2]"."""
    assert titans_main(["eval", "ppl", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    err = error_line(capsys)
    assert err.startswith("titans eval ppl: error: ") and "Errno" not in err and "nowhere" in err


@pytest.mark.parametrize(
    "argv, want",
    [
        (["train", "--device", "gpu", "--steps", "1"], "unknown device 'gpu'; choose auto, cpu, cuda"),
        (["eval", "context", "--checkpoint", "nowhere", "--device", "gpu"], "unknown device 'gpu'"),
        (["generate", "--checkpoint", "nowhere", "--device", "meta", "--prompt", "a"], "'meta' is not"),
        (
            ["generate", "--checkpoint", "nowhere", "--prompt", "a", "--temperature", "nan"],
            "--temperature must be a finite number >= 0 (0: greedy), got nan",
        ),
        (["train", "--data", "", "--steps", "1"], "the spec is empty"),
        (["forecast", "train", "--threads", "0"], "--threads must be >= 1, got 0"),
        (["forecast", "eval", "--run", "nowhere", "--threads", "0"], "--threads must be >= 1, got 0"),
        (["dna", "study", "--threads", "0"], "--threads must be >= 1, got 0"),
        (["dna", "study", "--seq-len", "1"], "DNABudget.seq_len must be an integer >= 2, got 1"),
        (["dna", "study", "--eval-windows", "0"], "DNABudget.eval_windows must be a positive integer"),
        (["dna", "study", "--batch-size", "0"], "DNABudget.batch_size must be a positive integer"),
        (["dna", "study", "--window-len", "0"], "DNABudget.window_len must be a positive integer"),
        (["dna", "study", "--pretrain-steps", "0"], "DNABudget.pretrain_steps must be a positive integer"),
        (["demo", "--depth", "0"], "--depth must be >= 1, got 0"),
        (["forecast", "study", "--models", ""], "expected at least one forecasting model"),
        (["forecast", "study", "--horizons", " , "], "expected at least one comma-separated integer"),
        (["dna", "study", "--variants", ","], "--variants: expected at least one variant"),
        (
            ["forecast", "train", "--series", "x.csv", "--lr", "nan"],
            "ForecastRun.lr must be a finite number >= 0",
        ),
        (
            ["train", "--steps", "2", "--tokens", "640"],
            "steps and tokens (--steps, --tokens, --set) contradict",
        ),
        # through --set the token budget won over --steps (and over a --set steps the flag --tokens)
        (["train", "--steps", "1", "--set", "tokens=640"], "steps and tokens (--steps, --tokens, --set)"),
        (
            ["dna", "study", "--seed", "7", "--seeds", "0"],
            "give --seed or --seeds, not both",
        ),  # --seed dropped
        # ignored, and recorded in the result as used
        (
            ["eval", "ppl", "--checkpoint", "nowhere", "--text-field", "body"],
            "--text-field applies to --data",
        ),
        (
            ["eval", "context", "--checkpoint", "nowhere", "--text-field", "b"],
            "--text-field applies to --data",
        ),
        (
            ["forecast", "train", "--series", "tmy3:greensboro", "--date-column", "Foo"],
            "date_column: for a CSV series, not for the bundled 'tmy3:greensboro'",
        ),
        # accepted, then written into result.json / dna.json as Infinity (not JSON)
        (["forecast", "train", "--time-budget", "inf"], "ForecastRun.time_budget must be finite seconds > 0"),
        (["dna", "study", "--time-budget", "inf"], "DNABudget.time_budget must be finite seconds > 0"),
        (["train", "--tokens", "640", "--set", "steps=2"], "steps and tokens (--steps, --tokens, --set)"),
        # every config had trained as the one variant, into the folders named after the others
        (
            ["train", "--compare", "a.json", "b.json", "--variant", "swa"],
            "--compare varies variant by config",
        ),
        (
            ["train", "--compare", "a.json", "b.json", "--set", "run_dir=r"],
            "--compare varies run_dir by config",
        ),
        (["train", "--config", "nowhere.json", "--compare", "a.json", "b.json"], "--config and --compare"),
        (["train", "--set", "cache_dir= ", "--steps", "1"], "TrainConfig.cache_dir: an empty path"),
        (["demo", "--pairs", "0"], "--pairs must be >= 1, got 0"),  # printed NaN surprises
        # 100,000 threads started, then the next thread the program needed failed with a traceback
        (["train", "--threads", "100000", "--steps", "1"], "TrainConfig.threads 100000 is more threads than"),
        (["dna", "study", "--threads", "100000"], "--threads 100000 is more threads than this machine's"),
        (["serve", "--checkpoint", "nowhere", "--torch-threads", "100000"], "--torch-threads 100000: give"),
        (["serve", "--checkpoint", "nowhere", "--workers", "1000000"], "--workers 1000000: give at most"),
        (["train", "--seed", "-1", "--steps", "1"], "TrainConfig.seed must be an integer in [0, 4294967295]"),
        (
            ["generate", "--checkpoint", "nowhere", "--prompt", "a", "--seed", "-4"],
            "--seed must be in [0, 2**64)",
        ),
        (["generate", "--checkpoint", "nowhere", "--prompt", "a", "--save-state", "."], "is a folder"),
        # found only after the whole text was read (a minute here), naming a file of its path
        (
            [
                "read",
                "--checkpoint",
                "nowhere",
                "--input",
                "-",
                "--save-state",
                "/proc/version/s.safetensors",
            ],
            "not a directory: '/proc/version'",
        ),
        (
            ["generate", "--checkpoint=nowhere", "--prompt=a", "--compile=cuda_graph", "--device=cpu"],
            "--compile cuda_graph needs a CUDA device, this run is on cpu",
        ),
        (
            ["generate", "--checkpoint", "nowhere", "--prompt", "a", "--greedy", "--temperature", "0.3"],
            "--greedy takes the most likely token: give it or --temperature, not both",
        ),
        (
            [
                "generate",
                "--checkpoint",
                "nowhere",
                "--prompt",
                "a",
                "--top-p",
                "0.9",
                "--greedy",
                "--top-k",
                "3",
            ],
            "give it or --top-p, --top-k, not both",
        ),
    ],
)
def test_bad_option_values_are_refused_before_any_work(capsys, monkeypatch, tmp_path, argv, want):
    """A device torch cannot read (or this machine lacks), zero threads, an empty data spec and a DNA budget
    that cannot train get the command's one-line error, before anything is read or trained (they raised
    from inside torch or numpy, divided by zero, or read the current folder as the data)."""
    monkeypatch.chdir(tmp_path)  # an empty data spec read the current folder
    assert titans_main(argv) == 2
    err = error_line(capsys)
    assert err.startswith("titans ") and ": error: " in err and want in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--run-dir", "", "--steps", "1"],
        ["train", "--config", " ", "--steps", "1"],
        ["eval", "ppl", "--checkpoint", ""],
        ["eval", "context", "--checkpoint", "", "--length", "64"],
        ["generate", "--checkpoint", "", "--prompt", "a"],
        ["read", "--checkpoint", "ck", "--input", "a.txt", "--save-state", ""],
        ["export-hf", "--checkpoint", "ck", "--out", ""],
        ["inspect", "--checkpoint", "ck", "--out", ""],
        ["forecast", "eval", "--run", ""],
        ["dna", "study", "--out", ""],
    ],
    ids=lambda a: " ".join(a[:3]),
)
def test_empty_paths_are_refused(capsys, monkeypatch, tmp_path, argv):
    """An empty path meant the current folder: `titans train --run-dir ""` wrote its checkpoints, metrics and
    report among the user's files, and `--checkpoint ""` loaded whatever run was there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        titans_main(argv)
    assert exit_.value.code == 2
    err = error_line(capsys)
    assert "an empty path" in err and err.startswith("titans "), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["dna", "study", "--seed", str(2**70)],
        ["dna", "study", "--seeds", f"0,{2**40}"],
        ["forecast", "study", "--seeds", "1,-2"],
        ["forecast", "train", "--seed", str(2**32)],
        ["eval", "niah", "--seed", "-1", "--train-recipe"],
        ["eval", "babilong", "--seeds", f"{2**64},1", "--train-recipe"],
        ["demo", "--seed", str(2**70)],
    ],
    ids=lambda a: " ".join(a[:3]),
)
def test_seeds_out_of_range_are_refused_before_any_work(capsys, monkeypatch, tmp_path, argv):
    """A seed past 2**63 failed with torch's "Overflow when unpacking long long" after the work before it
    (a whole DNA reference pass) had run; a negative one was taken by some commands and not others."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        titans_main(argv)
    assert exit_.value.code == 2
    err = error_line(capsys)
    assert "a seed must be in [0, 2**32)" in err and err.startswith("titans "), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(
            "Unable to allocate 745. GiB for an array with shape (100000000000,) and data type int64"
        ),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 400000000000 bytes."
        ),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        MemoryError(),  # Python's own, e.g. `read --block-chars 10000000000000`: no text
    ],
    ids=["numpy", "torch-cpu", "torch-cuda", "bare"],
)
def test_running_out_of_memory_is_one_line(capsys, monkeypatch, error):
    """`titans train --batch-size 100000000000` ended in numpy's _ArrayMemoryError traceback; a size the
    machine cannot hold is the command's one-line error."""
    import titans.demo

    def run_demo(*args, **kwargs):
        raise error

    monkeypatch.setattr(titans.demo, "run_demo", run_demo)
    assert titans_main(["demo"]) == 2
    err = error_line(capsys)
    assert err.startswith("titans demo: error: out of memory") and "enforce fail" not in err, err
    assert str(error).split("err == 0. ")[-1].split(":")[0] in err, err


def test_a_run_that_diverges_is_one_line(capsys, monkeypatch):
    """The trainer's FloatingPointError (the weights became NaN, not saved as a checkpoint) was a traceback
    through `eval ablate` / `eval depth` / `train`, where a loss that became NaN was one line."""
    import titans.demo

    def run_demo(*args, **kwargs):
        raise FloatingPointError("the weights or the optimizer state became NaN or inf by step 3")

    monkeypatch.setattr(titans.demo, "run_demo", run_demo)
    assert titans_main(["demo"]) == 2
    assert (
        error_line(capsys)
        == "titans demo: error: the weights or the optimizer state became NaN or inf by step 3"
    )


def test_other_runtime_errors_still_raise(monkeypatch):
    import titans.demo

    def run_demo(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(titans.demo, "run_demo", run_demo)
    with pytest.raises(RuntimeError, match="a bug"):
        titans_main(["demo"])


def test_a_config_whose_model_is_not_an_object_is_refused(tmp_path, capsys):
    """{"model": 5} raised a TypeError traceback (and "abc" an unreadable dict-update message)."""
    for model in (5, [1, 2], "abc", [], False, 0, ""):  # the empty ones were taken as "no overrides"
        (tmp_path / "c.json").write_text(json.dumps({"model": model}))
        argv = [
            "train",
            "--config",
            str(tmp_path / "c.json"),
            "--run-dir",
            str(tmp_path / "r"),
            "--steps",
            "1",
        ]
        assert titans_main(argv) == 2
        assert "TrainConfig.model must be a JSON object" in error_line(capsys)
    assert not (tmp_path / "r").exists()


def test_a_config_with_an_empty_run_dir_is_refused():
    with pytest.raises(ValueError, match="TrainConfig.run_dir: an empty path"):
        TrainConfig(run_dir="")


@pytest.mark.parametrize("sampling", [["--greedy"], ["--temperature", "1", "--top-k", "10"]], ids=str)
def test_generate_prints_no_token_of_non_finite_logits(tmp_path, capsys, sampling):
    """A memory write that diverges while `titans generate` decodes: with --compile eager as without, the
    tokens before it are printed, then the one-line error ("non-finite"); no token drawn from the NaN
    logits (argmax printed NUL bytes, sampling raised multinomial's RuntimeError with a traceback)."""
    # the first chunk write (after "ab" and two new tokens) overflows the memory's weights
    overrides = dict(memory_max_lr=1e30, memory_theta_init=1e29, memory_surprise_clip=None)
    model = tiny_model("lmm", dtype=torch.float32, vocab_size=256, **overrides)
    save_tiny_run(tmp_path / "run", model)
    args = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "ab", "--max-new-tokens", "30"]
    outs = []
    for extra in ([], ["--compile", "eager"]):
        assert titans_main([*args, *sampling, "--no-stop", "--device", "cpu", *extra]) == 2
        out, err = capsys.readouterr()
        assert "Traceback" not in err and "non-finite" in err.strip().splitlines()[-1], err
        outs.append(out)
    assert outs[1] == outs[0] and len(outs[0]) > 2 and "\x00" not in outs[1]  # the prompt, then tokens


# ---------------------------------------------------------------------------------- did you mean
@pytest.mark.parametrize(
    "argv, prog, want",
    [
        (["trian"], "titans", "did you mean 'train'?"),
        (["forecast", "evl"], "titans forecast", "did you mean 'eval'?"),
        (["train", "--treads", "1"], "titans train", "did you mean --threads?"),
        (["forecast", "train", "--horizn", "3"], "titans forecast train", "did you mean --horizon?"),
    ],
)
def test_argparse_errors_name_the_command_and_suggest(capsys, argv, prog, want):
    with pytest.raises(SystemExit) as exit_info:
        titans_main(argv)
    assert exit_info.value.code == 2
    err = error_line(capsys)
    assert err.startswith(f"{prog}: error: ") and want in err, err


@pytest.mark.parametrize(
    "argv, want",
    [
        (["train", "--preset", "tiyn"], "did you mean 'tiny'?"),
        (["train", "--variant", "mca"], "did you mean 'mac'?"),
        (["train", "--set", "lrr=1"], "did you mean 'lr'?"),
        (["train", "--set", "dpth=2"], "did you mean 'model.depth'?"),
        (["train", "--set", "model.dpth=2"], "did you mean 'model.depth'?"),
        (["eval", "niah", "--train-recipe", "--set", "memory_dpth=2"], "did you mean 'memory_depth'?"),
        (["dna", "study", "--variants", "swa,lmn"], "did you mean 'lmm'?"),
        (["forecast", "study", "--models", "linaer"], "did you mean 'linear'?"),
        (["train", "--tokenizer", "byte", "--steps", "1"], "did you mean 'bytes'?"),
        (["train", "--data", "builtin:stdlb", "--steps", "1"], "did you mean 'builtin:stdlib'?"),
    ],
)
def test_unknown_names_get_the_closest_one(capsys, monkeypatch, tmp_path, argv, want):
    monkeypatch.chdir(tmp_path)  # a command past the check would write runs/ here, not in the checkout
    assert titans_main(argv) == 2
    err = error_line(capsys)
    assert err.startswith("titans ") and ": error: " in err and want in err, err


def test_no_suggestion_for_a_name_unlike_any():
    with pytest.raises(ValueError) as info:
        parse_set(["zzzzqqq=1"])
    assert "did you mean" not in str(info.value)


# ---------------------------------------------------------------------------------- train's flags and help
def test_threads_is_a_train_flag():
    from titans.training.cli import overrides_from_args

    args = build_parser().parse_args(["train", "--threads", "1"])
    assert overrides_from_args(args)["threads"] == 1
    cfg = TrainConfig.from_file(None, overrides_from_args(args))
    assert cfg.threads == 1


def _train_help(dest: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return next(a.help for a in sub._actions if a.dest == dest)


def test_help_and_list_fields_describe_data_and_tokenizer_alike(capsys):
    assert titans_main(["train", "--list-fields"]) == 0
    listing = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    for field, text in (("data", DATA_HELP), ("tokenizer", TOKENIZER_HELP)):
        assert FIELD_HELP[field] == text
        assert _train_help(field).startswith(text)
        assert listing[field].endswith(text)
    for word in ("fasta:PATH", "hf:NAME", ".jsonl"):
        assert word in DATA_HELP
    for word in ("bytes", "gpt2", "mistral-32k", "dna", ".json", ".model", ".tiktoken"):
        assert word in TOKENIZER_HELP


def test_every_option_that_names_variants_rules_or_tokenizers_lists_them_all():
    """Lists written out by hand go stale: `eval --tokenizer`'s help named bytes, gpt2 and a file only,
    and `train --variant`'s and `model.memory_rule`'s lists were copies of their registries. Each is
    built from its registry (`VARIANTS`, `RULE_PRESETS`, the named tokenizers)."""
    from titans.data.tokenizers import _NAMED_TOKENIZERS
    from titans.evaluation.args import add_model_args
    from titans.models.config import FIELD_HELP as MODEL_FIELD_HELP
    from titans.models.config import VARIANTS
    from titans.ops.memory import RULE_PRESETS

    p = argparse.ArgumentParser()
    add_model_args(p)
    tokenizer = next(a for a in p._actions if a.dest == "tokenizer")
    assert tokenizer.default == "bytes" and TOKENIZER_HELP in tokenizer.help
    assert all(name in TOKENIZER_HELP for name in _NAMED_TOKENIZERS)
    assert _train_help("variant").startswith(", ".join(VARIANTS) + " ")
    assert MODEL_FIELD_HELP["memory_rule"].startswith(f"memory update rule: {', '.join(RULE_PRESETS)}, ")


# ---------------------------------------------------------------------------------- the sample prompt
def test_default_sample_prompt_follows_the_tokenizer():
    from titans.data.dna import DNATokenizer
    from titans.data.tokenizers import ByteTokenizer
    from titans.training.config import sample_prompt_for

    assert TrainConfig().sample_prompt is None
    assert sample_prompt_for(None, ByteTokenizer()) == "def "
    assert sample_prompt_for(None, DNATokenizer()) == "ACGT"
    assert sample_prompt_for("gattaca", DNATokenizer()) == "gattaca"
    with pytest.raises(ValueError, match=r"sample_prompt 'def '.*'dna'.*unknown letter 'd'"):
        sample_prompt_for("def ", DNATokenizer())


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("token-cache")


def _dna_run(run_dir, cache_dir) -> list[str]:
    return ["train", "--data", "fasta:builtin", "--tokenizer", "dna", "--variant", "lmm", "--steps", "1",
            "--seq-len", "32", "--batch-size", "2", "--run-dir", str(run_dir), "--no-progress",
            "--device", "cpu", "--set", f"cache_dir={cache_dir}", "--set", "eval_windows=1",
            "--set", "tensorboard=false", "--set", "plot=false", "--set", "sample_tokens=8",
            "--set", "model.dim=32", "--set", "model.depth=1"]  # fmt: skip


def test_dna_training_samples_from_a_dna_prompt(tmp_path, cache_dir, capsys):
    """The documented DNA command ends with its sample and report (it used to stop at the sample, on the
    default prompt "def ")."""
    run_dir = tmp_path / "run"
    assert titans_main(_dna_run(run_dir, cache_dir)) == 0
    report = json.loads((run_dir / "report.json").read_text())
    assert report["sample"].startswith("ACGT") and set(report["sample"]) <= set("ACGTN")


def test_a_prompt_the_tokenizer_cannot_encode_is_refused_before_training(tmp_path, cache_dir, capsys):
    run_dir = tmp_path / "run"
    assert titans_main([*_dna_run(run_dir, cache_dir), "--set", "sample_prompt=hello"]) == 2
    err = error_line(capsys)
    assert err.startswith("titans train: error: ") and "sample_prompt 'hello'" in err
    assert not (run_dir / "report.json").exists() and not (run_dir / "checkpoints").exists()


# ---------------------------------------------------------------------------------- files and plots
def test_dna_study_prints_a_table_and_its_files(tmp_path, capsys, monkeypatch):
    import titans.dna.cli as dna_cli

    row = {"parameters": 1234, "test_bits_per_base": 1.95, "train_curve_bits_per_base": [2.0, 1.9],
           "test_accuracy": 0.61}  # fmt: skip
    result = {
        "reference": {"markov0_bits_per_base": 1.99, "markov2_bits_per_base": 1.96,
                      "markov5_bits_per_base": 1.95, "gc_threshold_accuracy": 0.59, "majority_accuracy": 0.5},
        "variants": {"swa": row},
    }  # fmt: skip
    monkeypatch.setattr(dna_cli, "run_study", lambda *a, **k: result)
    out_dir = tmp_path / "out"
    assert titans_main(["dna", "study", "--variants", "swa", "--out", str(out_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "{" not in out  # a table, not a Python dict
    lines = out.strip().splitlines()
    assert lines[-1] == f"wrote {out_dir / 'dna.json'} and {out_dir / 'dna.png'}"
    assert any(line.split()[:3] == ["swa", "1.9500", "0.6100"] for line in lines)
    assert any(line.startswith("order-5 Markov") and "1.9500" in line for line in lines)
    assert (out_dir / "dna.json").is_file() and (out_dir / "dna.png").is_file()


def _labels(monkeypatch) -> list[list[tuple[str, str]]]:
    """(x label, y label) of every axis of every figure saved from now on."""
    import matplotlib.figure

    saved: list[list[tuple[str, str]]] = []
    savefig = matplotlib.figure.Figure.savefig

    def recording(fig, *args, **kwargs):
        saved.append([(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes])
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    return saved


def test_forecast_train_lists_its_files_and_labels_its_plot(tmp_path, capsys, monkeypatch):
    from test_forecast import _write_csv

    saved = _labels(monkeypatch)
    path = _write_csv(tmp_path / "ecl.csv", 700, ["MT_001 (kW)", "MT_002 (kW)"])
    out_dir = tmp_path / "run"
    argv = ["forecast", "train", "--series", str(path), "--model", "linear", "--lookback", "32",
            "--horizon", "8", "--steps", "2", "--out", str(out_dir), "--no-progress"]  # fmt: skip
    assert titans_main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"wrote {out_dir / 'result.json'}, {out_dir / 'model.pt'} and {out_dir / 'forecast.png'}"
    (axes,) = saved
    assert all(x and y for x, y in axes)  # every axis has a title on both sides
    assert [y for _, y in axes] == ["MT_001 (kW)", "MT_002 (kW)"]  # drawn in the series' units


def test_forecast_plot_without_a_scaler_says_standardised(tmp_path, monkeypatch):
    from test_forecast import _write_csv
    from titans.data.series import read_series_csv, split_series
    from titans.forecast.train import ForecastRun, plot_forecasts, train_forecaster

    saved = _labels(monkeypatch)
    split = split_series(read_series_csv(_write_csv(tmp_path / "s.csv", 400, ["GHI (W/m^2)"])), lookback=16)
    res = train_forecaster(split, ForecastRun(model="linear", horizon=4, steps=1, eval_every=1))
    windows = split.windows(4)[2]
    plot_forecasts(tmp_path / "a.png", windows, {"linear": res.model}, "t", channels=split.series.channels)
    plot_forecasts(
        tmp_path / "b.png", windows, {"linear": res.model}, "t", channels=split.series.channels,
        scaler=split.scaler,
    )  # fmt: skip
    assert saved[0][0][1] == "GHI (standardised)" and saved[1][0][1] == "GHI (W/m^2)"


def test_generate_names_the_state_it_wrote(tmp_path, cache_dir, capsys):
    from micro_train import micro_config
    from titans.training.trainer import Trainer

    run = tmp_path / "run"
    Trainer(micro_config(run, cache_dir, steps=1, batch_size=2, eval_windows=1)).train()
    capsys.readouterr()
    state = tmp_path / "after.safetensors"
    argv = ["generate", "--checkpoint", str(run), "--prompt", "The ", "--max-new-tokens", "3", "--device",
            "cpu", "--save-state", str(state)]  # fmt: skip
    assert titans_main(argv) == 0
    captured = capsys.readouterr()
    assert state.is_file() and f"wrote {state}" in captured.err and str(state) not in captured.out


def test_ctrl_c_in_a_command_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C in `generate`, `read`, `forecast train`, ... printed a traceback ending in KeyboardInterrupt
    (`titans train` handles its own signals and saves a checkpoint first)."""
    import titans.demo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(titans.demo, "run_demo", interrupted)
    assert titans_main(["demo"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "titans demo: interrupted" and "Traceback" not in err


def test_atomic_writes_go_through_symlinks_and_refuse_devices(tmp_path):
    """The atomic writes (a temporary file renamed over the path) replaced a symlink by a file, leaving its
    target unwritten, and replaced a device such as /dev/full or /dev/null by a file (as root: the system's
    own node). A symlink is now written through, and a FIFO (a device without root) or folder refused."""
    from tiny_lm import tiny_model
    from titans._fs import write_text_atomic
    from titans.inference import prefill
    from titans.models.state import load_state, save_state

    (tmp_path / "target").mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target" / "out.json")
    write_text_atomic(link, "{}")
    assert link.is_symlink() and (tmp_path / "target" / "out.json").read_text() == "{}"

    model = tiny_model("mac", dtype=torch.float32)
    _, state = prefill(model, torch.zeros(1, 5, dtype=torch.int64))
    state_link = tmp_path / "state.safetensors"
    state_link.symlink_to(tmp_path / "target" / "state.safetensors")
    save_state(state, state_link)
    assert state_link.is_symlink() and load_state(tmp_path / "target" / "state.safetensors").position == 5

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        write_text_atomic(fifo, "{}")
    with pytest.raises(ValueError, match="not a regular file"):
        save_state(state, fifo)
    with pytest.raises(IsADirectoryError):
        write_text_atomic(tmp_path / "target", "{}")
    assert fifo.exists() and not fifo.is_file()


@pytest.mark.parametrize("name", ["../../escaped", "", "a/b"])
def test_an_eval_name_is_a_file_name(monkeypatch, tmp_path, capsys, name):
    """`--name ../../escaped` wrote the results outside --out; "" silently meant the default name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        titans_main(["eval", "niah", "--name", name])
    assert exit_.value.code == 2
    assert "expected a file name without a folder" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "command", [["ppl", "--windows", "1"], ["context", "--length", "8", "--windows", "1"]]
)
def test_an_eval_output_that_cannot_be_written_is_refused_before_scoring(tmp_path, capsys, command):
    """`eval context --out /proc/x.json` scored every model first, then failed naming a hidden temporary
    file ('/proc/.x.json.idii85dr.tmp'): the work was lost."""
    run = save_tiny_run(tmp_path / "run", tiny_model("mac"))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "result.json"
    argv = ["eval", *command, "--checkpoint", str(run), "--data", "nowhere.txt", "--out", str(out)]
    assert titans_main(argv) == 2
    err = error_line(capsys)
    assert err == f"titans eval {command[0]}: error: not a directory: {str(blocker)!r}", err


def test_forecast_train_checks_its_output_folder_before_training(tmp_path, capsys, monkeypatch):
    """`forecast train --out FILE` trained every step, then failed to make the folder (the work lost)."""
    import titans.forecast.cli as forecast_cli

    monkeypatch.setattr(forecast_cli, "train_forecaster", lambda *a, **k: pytest.fail("trained first"))
    (tmp_path / "afile").write_text("")
    argv = ["forecast", "train", "--model", "linear", "--steps", "3", "--out", str(tmp_path / "afile")]
    assert titans_main(argv) == 2
    assert "afile" in error_line(capsys)


@pytest.mark.parametrize("command", ["generate", "inspect"])
@pytest.mark.parametrize(
    "prompt, want",
    [
        (
            os.fsdecode(b"caf\xff"),
            "(byte 0xff at character 3)",
        ),  # as the shell passes a byte that is not UTF-8
        ("a\ud800", "(lone surrogate U+D800 at character 1)"),
    ],
)
def test_a_prompt_that_is_not_utf8_is_refused_by_the_parser(command, prompt, want, capsys):
    """The BPE and SentencePiece libraries failed on such a prompt with a TypeError / RuntimeError."""
    with pytest.raises(SystemExit) as exit_:
        titans_main([command, "--checkpoint", "nowhere", "--prompt", prompt])
    assert exit_.value.code == 2
    assert (
        error_line(capsys)
        == f"titans {command}: error: argument --prompt: the text is not valid UTF-8 {want}"
    )


def test_a_path_that_is_not_utf8_is_printed_on_a_strict_console(tmp_path):
    """A file name's bytes that are not UTF-8 reach Python as lone surrogates: a console whose encoder is
    strict (PYTHONIOENCODING=utf-8:strict, or a UTF-8 locale other than C) failed to print the line naming
    the file, with a traceback, after the work was done."""
    import subprocess
    import sys

    save_tiny_run(tmp_path / "run", tiny_model(vocab_size=256, dtype=torch.float32))
    (tmp_path / "in.txt").write_text("some text to read\n")
    out = os.fsdecode(bytes(tmp_path / "s") + b"\xff.safetensors")
    cmd = [sys.executable, "-m", "titans", "read", "--checkpoint", str(tmp_path / "run")]
    cmd += ["--input", str(tmp_path / "in.txt"), "--save-state", out, "--device", "cpu"]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    assert b"saved to " + bytes(tmp_path / "s") + b"\\udcff.safetensors" in proc.stdout  # escaped
    assert os.path.exists(out)


def test_command_defaults_are_their_dataclasses_defaults():
    """`forecast train` and `serve` take their defaults from `ForecastRun` and `Limits` (written once):
    each option's default is the field's."""
    from dataclasses import fields

    from titans.forecast.train import ForecastRun
    from titans.serving.limits import Limits

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    forecast = next(a for a in sub["forecast"]._actions if isinstance(a, argparse._SubParsersAction))
    train = {a.dest: a.default for a in forecast.choices["train"]._actions}
    serve = {a.dest: a.default for a in sub["serve"]._actions}
    for f in fields(ForecastRun):
        if f.name in train and f.name != "seed":  # --seed: None, the field's default when not given
            assert train[f.name] == f.default, f.name
    assert not train["no_revin"] and ForecastRun.revin
    for f in fields(Limits):
        if f.name in serve:
            assert serve[f.name] == f.default, f.name
    assert {"max_body_bytes", "max_tokens", "max_new_tokens", "max_import_bytes"} <= serve.keys()
