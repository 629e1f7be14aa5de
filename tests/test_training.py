"""Training: exact resume, damaged checkpoints, config errors, the CLI, optimizer groups, learning."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from micro_train import MICRO_MODEL
from micro_train import micro_config as shared_micro_config
from titans.cli import main as titans_main
from titans.data.tokenizers import load_tokenizer, train_bpe
from titans.models.lm import TitansLM
from titans.runtime.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint
from titans.runtime.loading import TOKENIZER_DIR, load_trained
from titans.training.config import RESUMABLE_CHANGES, TrainConfig, parse_set
from titans.training.metrics import read_metrics, truncate_metrics
from titans.training.model_io import load_model
from titans.training.optim import lr_factor, parameter_groups
from titans.training.trainer import Trainer

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {
    **os.environ,
    "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "OMP_NUM_THREADS": "1",
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


def micro_config(run_dir: Path, cache_dir: Path, **overrides) -> TrainConfig:
    base = dict(batch_size=4, steps=6, warmup_steps=2, eval_every=1000, eval_windows=2, ckpt_every=1000)
    return shared_micro_config(run_dir, cache_dir, **{**base, **overrides})


def max_weight_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


# ------------------------------------------------------------------------------------------- resume
def test_resume_matches_uninterrupted_run(tmp_path, cache_dir):
    straight = Trainer(micro_config(tmp_path / "straight", cache_dir))
    ref = straight.train()

    first = Trainer(micro_config(tmp_path / "split", cache_dir))
    part = first.train(stop_at=3)
    assert part.step == 3 and part.stopped_early
    del first
    torch.manual_seed(1234)  # disturb the global RNG: the resume must restore it
    second = Trainer(micro_config(tmp_path / "split", cache_dir), resume=True)
    assert second.step == 3
    rest = second.train()

    assert rest.step == 6 and not rest.stopped_early
    assert part.step_losses + rest.step_losses == pytest.approx(ref.step_losses, abs=1e-6)
    assert max_weight_diff(straight.model, second.model) <= 1e-6
    # the resumed run's metrics log each step once
    steps = [
        r["step"]
        for r in map(json.loads, (tmp_path / "split" / "metrics.jsonl").open())
        if r["split"] == "train"
    ]
    assert steps == list(range(1, 7))


def test_a_checkpoint_between_log_steps_logs_its_steps_first(tmp_path, cache_dir):
    """A checkpoint at a step that is not a log step (ckpt_every 4, log_every 3): the losses of the steps
    since the last row were not logged yet, and a run that died after it and resumed from it never logged
    them; its next row averaged fewer steps than the uninterrupted run's row there. Rows are the same."""
    import shutil

    def rows(run):
        lines = map(json.loads, (run / "metrics.jsonl").open())
        return [(r["step"], r["loss"]) for r in lines if r["split"] == "train"]

    cfg = dict(steps=8, log_every=3, ckpt_every=4)
    Trainer(micro_config(tmp_path / "straight", cache_dir, **cfg)).train()
    Trainer(micro_config(tmp_path / "split", cache_dir, **cfg)).train(stop_at=6)
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step_00000006")  # died after step 6: last is 4
    Trainer(micro_config(tmp_path / "split", cache_dir, **cfg), resume=True).train()
    straight, split = rows(tmp_path / "straight"), rows(tmp_path / "split")
    assert [s for s, _ in straight] == [3, 4, 6, 8]
    assert [s for s, _ in split] == [s for s, _ in straight]
    assert [x for _, x in split] == pytest.approx([x for _, x in straight], abs=1e-6)


def test_resuming_a_finished_run_keeps_its_time_and_throughput(tmp_path, cache_dir):
    """`--resume` of a finished run trains nothing and rewrote report.json with train_time_s 0.0 and the
    last row's throughput: the time the run took was lost. Its report keeps them."""
    run = tmp_path / "run"
    Trainer(micro_config(run, cache_dir, steps=3)).train()
    before = json.loads((run / "report.json").read_text())
    assert before["train_time_s"] > 0
    again = Trainer(micro_config(run, cache_dir, steps=3), resume=True).train()
    after = json.loads((run / "report.json").read_text())
    assert again.step == 3 and after["step"] == 3
    assert (after["train_time_s"], after["tokens_per_s"]) == (before["train_time_s"], before["tokens_per_s"])


def test_resume_refuses_a_config_that_matters(tmp_path, cache_dir):
    Trainer(micro_config(tmp_path, cache_dir, steps=1)).train()
    with pytest.raises(ValueError, match="seq_len"):
        Trainer(micro_config(tmp_path, cache_dir, steps=1, seq_len=16), resume=True)
    with pytest.raises(ValueError, match=r"model\.dim"):
        Trainer(micro_config(tmp_path, cache_dir, steps=1, model={**MICRO_MODEL, "dim": 32}), resume=True)
    # logging, budgets and a longer run are fine
    t = Trainer(micro_config(tmp_path, cache_dir, steps=2, log_every=5, eval_windows=1), resume=True)
    assert t.step == 1
    # a fresh start over an existing run is refused rather than mixing checkpoints, unless asked for
    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(micro_config(tmp_path, cache_dir, steps=1))
    # --overwrite with an option that fails (a mistyped data path) keeps the earlier run: it was cleared
    # before the data was read
    with pytest.raises((FileNotFoundError, ValueError), match="typo"):
        Trainer(micro_config(tmp_path, cache_dir, steps=1, data=str(tmp_path / "typo.txt")), overwrite=True)
    assert list_checkpoints(tmp_path)
    fresh = Trainer(micro_config(tmp_path, cache_dir, steps=1), overwrite=True)
    assert fresh.step == 0 and list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("mode", [{}, {"overwrite": True}, {"resume": True}])
def test_a_folder_no_run_wrote_keeps_its_files(tmp_path, cache_dir, mode):
    """A run folder whose config.json and tokenizer/ a project holds (no run wrote them) is refused:
    --overwrite had deleted tokenizer/ and the other names a run writes, and a fresh run or --resume (no
    checkpoint: from scratch) had replaced config.json. A folder an earlier run wrote is still reused."""
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "bpe.py").write_text("# mine\n")
    (tmp_path / "config.json").write_text('{"a": 1}\n')
    with pytest.raises(FileExistsError, match="config.json, which no training run wrote"):
        Trainer(micro_config(tmp_path, cache_dir, steps=1), **mode)
    assert (tmp_path / "tokenizer" / "bpe.py").read_text() == "# mine\n"
    assert (tmp_path / "config.json").read_text() == '{"a": 1}\n'
    run = tmp_path / "run"  # a run stopped before its first checkpoint left config.json: a run may go there
    Trainer(micro_config(run, cache_dir, steps=1))
    assert not list_checkpoints(run) and (run / "config.json").is_file()
    Trainer(micro_config(run, cache_dir, steps=1), **mode)


def test_resume_refuses_fewer_steps_than_done(tmp_path, cache_dir):
    """A resume whose steps end before the checkpoint's step is refused (it rewrote config.json with the
    smaller count beside weights of the later step); the same count, a finished run resumed, is fine."""
    Trainer(micro_config(tmp_path, cache_dir, steps=2)).train()
    with pytest.raises(ValueError, match="at step 2, past this config's 1 steps"):
        Trainer(micro_config(tmp_path, cache_dir, steps=1), resume=True)
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 2
    assert Trainer(micro_config(tmp_path, cache_dir, steps=2), resume=True).step == 2
    # resumed, the finished run evaluates again but logs its evaluation at step 2 once (it was logged twice)
    Trainer(micro_config(tmp_path, cache_dir, steps=2, tensorboard=True), resume=True).train()
    evals = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "eval"]
    assert evals == [2]


def test_a_changed_tokenizer_file_is_refused_on_resume_and_replaced_by_the_copy_on_load(tmp_path, cache_dir):
    """The tokenizer file a run was trained with, rewritten in place (same path, same vocabulary size):
    resuming names the tokenizer (it failed on the data position instead), and loading the run for
    evaluation takes the run's copy of the original (it scored with the rewritten one after a warning);
    with no copy either, loading is refused."""
    spec = tmp_path / "bpe.json"
    train_bpe(["the quick brown fox jumps over the lazy dog. " * 50], 300, spec)
    run, data = tmp_path / "run", tmp_path / "fox.txt"
    data.write_text("the quick brown fox jumps over the lazy dog.\n" * 2000)  # builtin:prose took 23 s
    Trainer(micro_config(run, cache_dir, steps=1, tokenizer=str(spec), data=str(data))).train()
    _, original = load_trained(run)
    train_bpe(["def f(x):\n    return x + 1\n" * 80], 300, spec)  # another text, the same vocabulary size
    assert load_tokenizer(spec).fingerprint != original.fingerprint
    with pytest.raises(ValueError, match=r"tokenizer: .*bpe\.json' is not the tokenizer the checkpoint"):
        Trainer(micro_config(run, cache_dir, steps=2, tokenizer=str(spec), data=str(data)), resume=True)
    _, loaded = load_trained(run)
    assert loaded.fingerprint == original.fingerprint
    text = "def quick(fox): return the dog"
    assert loaded.encode(text) == original.encode(text)
    for copy in (run / TOKENIZER_DIR).iterdir():
        copy.unlink()
    with pytest.raises(ValueError, match="is not the one the checkpoint was trained with"):
        load_trained(run)


def test_a_warmup_longer_than_the_run_is_warned_about(tmp_path, cache_dir, caplog):
    with caplog.at_level("WARNING", logger="titans.training.trainer"):
        Trainer(micro_config(tmp_path / "a", cache_dir, steps=3, warmup_steps=2))
    assert "warmup_steps" not in caplog.text
    with caplog.at_level("WARNING", logger="titans.training.trainer"):
        Trainer(micro_config(tmp_path / "b", cache_dir, steps=3, warmup_steps=10))
    assert "warmup_steps=10 is longer than the run's 3 steps" in caplog.text


def test_time_budget_stops_cleanly_with_a_checkpoint(tmp_path, cache_dir):
    result = Trainer(micro_config(tmp_path, cache_dir, steps=50, time_budget_min=1e-4)).train()
    assert result.stopped_early and 1 <= result.step < 50
    assert latest_checkpoint(tmp_path).name == f"step_{result.step:08d}"
    assert result.eval is not None and result.eval.bpb > 0
    assert Trainer(micro_config(tmp_path, cache_dir, steps=50), resume=True).step == result.step


def _record_calls(trainer: Trainer, calls: list[str]) -> None:
    """Record each evaluation and checkpoint of ``trainer`` as ``evaluate@STEP`` / ``checkpoint@STEP``."""
    evaluate, save = trainer.evaluate, trainer.save_checkpoint
    trainer.evaluate = lambda: calls.append(f"evaluate@{trainer.step}") or evaluate()
    trainer.save_checkpoint = lambda: calls.append(f"checkpoint@{trainer.step}") or save()


@pytest.mark.parametrize("stop", ["signal", "budget"])
def test_a_stop_at_an_eval_step_checkpoints_first_and_evaluates_once(tmp_path, cache_dir, stop):
    """A signal or the time budget that stops a run after an `eval_every` step: the checkpoint of that step
    comes first, then one evaluation of it (one eval row in metrics.jsonl), not the periodic one before
    the checkpoint and the final one after it."""
    cfg = micro_config(
        tmp_path,
        cache_dir,
        steps=10,
        eval_every=2 if stop == "signal" else 1,
        time_budget_min=1e-9 if stop == "budget" else None,
    )
    trainer = Trainer(cfg)
    calls: list[str] = []
    _record_calls(trainer, calls)
    train_step = trainer.train_step

    def step(s: int):
        if stop == "signal" and s == 1:
            os.kill(os.getpid(), signal.SIGINT)  # recorded by the trainer's handler; step 2 finishes
        return train_step(s)

    trainer.train_step = step
    result = trainer.train()
    last = 2 if stop == "signal" else 1
    assert result.step == last and result.stopped_early
    assert result.stopped_by == ("SIGINT" if stop == "signal" else None)
    assert calls == [f"checkpoint@{last}", f"evaluate@{last}"]
    evals = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "eval"]
    assert evals == [last]


@pytest.mark.parametrize("during", ["checkpoint", "evaluate"])
def test_a_signal_after_the_last_step_stops_the_run_without_a_sample(tmp_path, cache_dir, during):
    """A signal during the final checkpoint or evaluation (after the last step, where the loop no longer
    looks for one) stops the run as one during training does: `stopped_by` in the result and the report,
    no sample."""
    trainer = Trainer(micro_config(tmp_path, cache_dir, steps=2, sample_tokens=8))
    real = getattr(trainer, "save_checkpoint" if during == "checkpoint" else "evaluate")

    def signalled():
        os.kill(os.getpid(), signal.SIGINT)
        return real()

    setattr(trainer, "save_checkpoint" if during == "checkpoint" else "evaluate", signalled)
    result = trainer.train()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    assert result.step == 2 and not result.stopped_early
    assert result.stopped_by == "SIGINT" and result.sample is None
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stopped_by"] == "SIGINT" and report["sample"] is None and report["eval"]["bpb"] > 0
    # the config's threads may be null (one per core): the report says how many ran
    assert report["torch_threads"] == torch.get_num_threads()
    assert latest_checkpoint(tmp_path).name == "step_00000002"


def test_a_sigterm_during_the_sample_ends_the_compare_with_status_143(tmp_path, cache_dir):
    """`titans train --compare A B`, SIGTERM while A writes its end-of-training sample (a long one): the
    sample is abandoned, A's report says stopped_by SIGTERM, the command exits 143 at once and B is not
    trained."""
    paths = []
    for variant in ("mac", "swa"):
        cfg = micro_config(tmp_path / variant, cache_dir, variant=variant, steps=2, sample_tokens=200_000)
        cfg.save(tmp_path / f"{variant}.json")
        paths.append(str(tmp_path / f"{variant}.json"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "titans", "train", "--compare", *paths, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    metrics = tmp_path / "mac" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    # the final evaluation's row: the run is past its last step, in the sample (or just before it)
    while not any(r["split"] == "eval" for r in read_metrics(metrics)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the run did not reach its final evaluation:\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("still running 60 s after the SIGTERM (the sample went on)")
    assert proc.returncode == 143, err[-3000:]
    report = json.loads((tmp_path / "mac" / "report.json").read_text())
    assert report["stopped_by"] == "SIGTERM" and report["step"] == 2 and report["sample"] is None
    last = err.strip().splitlines()[-1]
    assert last.startswith("titans: stopped by SIGTERM at step 2; checkpoint saved")
    assert last.endswith(
        "training is done: the same command with --resume trains no more, it evaluates and samples"
    )
    assert "Traceback" not in err and "sample:" not in out
    assert "training swa" not in out and not (tmp_path / "swa").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_checkpoint_is_refused_and_resume_falls_back(tmp_path, cache_dir, damage):
    cfg = micro_config(tmp_path, cache_dir, steps=4, ckpt_every=2)
    ref = Trainer(cfg).train()
    good, bad = list_checkpoints(tmp_path)
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))

    expected = "truncated" if damage == "truncate" else "corrupted"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(bad)
    assert latest_checkpoint(tmp_path) == good
    model, loaded_cfg, _ = load_model(tmp_path)  # the run folder -> the newest good checkpoint
    assert loaded_cfg.steps == 4

    resumed = Trainer(micro_config(tmp_path, cache_dir, steps=4, ckpt_every=2), resume=True)
    assert resumed.step == 2
    assert max_weight_diff(resumed.model, model) == 0.0
    rest = resumed.train()
    assert rest.step_losses == pytest.approx(ref.step_losses[2:], abs=1e-6)


# ------------------------------------------------------------------------------------------- configs
def test_config_errors_name_the_problem(tmp_path, cache_dir):
    bad_file = tmp_path / "bad.json"
    bad_file.write_text(json.dumps({"steps": 3, "stepz": 4}))
    with pytest.raises(ValueError, match="stepz"):
        TrainConfig.from_file(bad_file)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        TrainConfig.from_file(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="'lrr'"):
        TrainConfig.from_file(None, {"lrr": 1.0})
    with pytest.raises(ValueError, match="bogus"):
        TrainConfig.from_file(None, {"model.bogus": 1})
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig.from_file(None, {"seq_len": 0})
    with pytest.raises(ValueError, match="grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4)
    with pytest.raises(ValueError, match="preset"):
        TrainConfig(preset="huge")
    with pytest.raises(ValueError, match="chunk_size"):  # the model config's own checks still apply
        micro_config(tmp_path, cache_dir, model={**MICRO_MODEL, "chunk_size": 5}).model_config(256)
    assert parse_set(["steps=5", "model.dim=64", "data=a b.txt", "grad_clip=null"]) == {
        "steps": 5,
        "model.dim": 64,
        "data": "a b.txt",
        "grad_clip": None,
    }
    missing = tmp_path / "no-such-corpus.txt"
    with pytest.raises(FileNotFoundError, match="no-such-corpus.txt"):
        Trainer(micro_config(tmp_path / "run", cache_dir, data=str(missing)))


def test_a_list_field_takes_a_single_value_on_the_command_line():
    """`--set curriculum_steps=600` (one number for a list field, as docs/training.md writes it) is the
    list [600], as `600,` and `[600]` are; a value that is no item of the list is still refused."""
    sets = parse_set(["curriculum_steps=600", "curriculum_seq_lens=512", "model.memory_layers=1"])
    assert sets == {"curriculum_steps": [600], "curriculum_seq_lens": [512], "model.memory_layers": [1]}
    assert (
        parse_set(["curriculum_steps=600,"])
        == parse_set(["curriculum_steps=[600]"])
        == {"curriculum_steps": [600]}
    )
    cfg = TrainConfig.from_file(None, {**sets, "seq_len": 256, "batch_size": 16})
    assert (cfg.curriculum_steps, cfg.curriculum_seq_lens, cfg.model["memory_layers"]) == ([600], [512], [1])
    for bad in ("curriculum_steps=true", "curriculum_steps=1.5", "curriculum_steps=x"):
        with pytest.raises(ValueError, match=r"--set curriculum_steps: expected a list\[int\]"):
            parse_set([bad])


def test_adamw_settings_out_of_range_are_refused_naming_the_field(tmp_path, capsys):
    """beta1 / beta2 in [0, 1) and eps > 0 are checked with the config, naming the field, before any data
    is read or any run folder made."""
    for field, value, bound in (
        ("beta1", 1.5, r"in \[0, 1\)"),
        ("beta1", 1.0, r"in \[0, 1\)"),
        ("beta2", -0.5, r"in \[0, 1\)"),
        ("eps", -1.0, "> 0"),
        ("eps", 0.0, "> 0"),
    ):
        with pytest.raises(ValueError, match=rf"TrainConfig\.{field} must be a number {bound}, got {value}"):
            TrainConfig(**{field: value})
    assert TrainConfig(beta1=0.0, beta2=0.999, eps=1e-12).beta2 == 0.999
    run_dir = tmp_path / "run"
    data = tmp_path / "missing.txt"  # never opened: the config is refused first
    assert titans_main(["train", "--set", "beta2=1.2", "--data", str(data), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.beta2 must be a number in [0, 1), got 1.2" in err and "missing.txt" not in err
    assert not run_dir.exists()


def test_truncating_the_metrics_on_resume_never_loses_them(tmp_path):
    """`truncate_metrics` (a resume drops the rows after its checkpoint) writes a new file and renames it
    over the old: a write that fails part-way (a full disk; here a file size limit) leaves every row."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"split": "train", "step": s, "loss": 5.0 - s / 100, "lr": 1e-3} for s in range(1, 201)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = path.read_bytes()
    script = (
        "import resource, signal, sys\n"
        "from titans.training.metrics import truncate_metrics\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    truncate_metrics(sys.argv[1], 150)\n"
        "except OSError as e:\n"
        "    print('refused', e.errno, e.filename)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert path.read_bytes() == before  # all 200 rows
    assert proc.stdout.split() == ["refused", str(errno.EFBIG), str(path)]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
    truncate_metrics(path, 150)
    assert [r["step"] for r in read_metrics(path)] == list(range(1, 151))
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.json")), ids=str)
def test_shipped_configs_build_their_model(path):
    """Every config in configs/ loads, and the model it names builds: the main job (MAL) and the MAC recipe
    beside it differ in the variant, the MAC block's options and the attention window only (the main job's
    is 16: its memory carries more of the context, docs/long_context.md)."""
    cfg = TrainConfig.from_file(path)
    model = TitansLM(cfg.model_config(256))
    assert sum(p.numel() for p in model.parameters()) > 0
    if path.name == "main.json":
        mac = TrainConfig.from_file(path.with_name("mac.json"))
        assert (cfg.variant, mac.variant) == ("mal", "mac")
        same = {k: v for k, v in cfg.to_dict().items() if k not in ("variant", "model", "run_dir")}
        assert same == {k: v for k, v in mac.to_dict().items() if k in same}
        assert cfg.model_config(256).memory_forget_to == mac.model_config(256).memory_forget_to == "init"
        assert (cfg.model_config(256).window, mac.model_config(256).window) == (16, 64)


def test_cli_errors_are_reported_not_raised(tmp_path, capsys):
    code = titans_main(["train", "--set", "stepz=3", "--run-dir", str(tmp_path)])
    assert code == 2
    assert "stepz" in capsys.readouterr().err
    code = titans_main(["train", "--data", str(tmp_path / "missing.txt"), "--run-dir", str(tmp_path)])
    assert code == 2
    assert "missing.txt" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- CLI
def test_cli_train_then_eval_ppl(tmp_path, cache_dir, capsys):
    run_dir = tmp_path / "run"
    cfg = micro_config(run_dir, cache_dir, steps=3, plot=True, sample_tokens=8, sample_prompt="The ")
    cfg_file = tmp_path / "tiny.json"
    cfg.save(cfg_file)
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "titans", "train", "--config", str(cfg_file), "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bpb" in proc.stdout and "sample:" in proc.stdout
    assert (run_dir / "checkpoints" / "step_00000003" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3]
    assert any(r["split"] == "eval" and r["bpb"] > 0 for r in rows)
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["step"] == 3 and report["eval"]["bpb"] > 0

    # on the CPU, where it trained (the command's default, auto, would take a GPU and bf16 where there is one)
    ppl_args = ["eval", "ppl", "--checkpoint", str(run_dir), "--windows", "2", "--device", "cpu"]
    assert titans_main(ppl_args) == 0
    out = capsys.readouterr().out
    assert "bpb" in out
    result = json.loads((run_dir / "eval_ppl.json").read_text())
    assert result["data"].endswith("(held-out split)") and result["dtype"] == "float32"
    # the checkpoint's own held-out split with the training windows: the trainer's final evaluation
    assert result["loss"] == pytest.approx(report["eval"]["loss"], rel=1e-5)
    assert result["bpb"] == pytest.approx(
        result["loss"] / 0.6931471805599453, rel=1e-6
    )  # bytes: 1 byte/token

    # eval on a file the model never saw
    text = tmp_path / "other.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    assert (
        titans_main(["eval", "ppl", "--checkpoint", str(run_dir), "--data", str(text), "--seq-len", "16"])
        == 0
    )
    assert "other.txt" in capsys.readouterr().out
    # a window of 0 tokens is refused (it meant the training length)
    assert titans_main([*ppl_args, "--seq-len", "0"]) == 2
    assert "seq_len and batch_size must be >= 1, got 0" in capsys.readouterr().err


def test_compare_refuses_configs_whose_models_differ(tmp_path, capsys):
    """`--compare` runs must differ in variant and run_dir only: model overrides set the size (a 5M MAC
    was compared with a 20K SWA)."""
    paths = []
    for name, model in (("a", {"dim": 64, "depth": 2}), ("b", {"dim": 32, "depth": 1})):
        config = {"variant": "mac" if name == "a" else "swa", "model": model, "run_dir": str(tmp_path / name)}
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
        paths.append(str(tmp_path / f"{name}.json"))
    assert titans_main(["train", "--compare", *paths]) == 2
    err = capsys.readouterr().err
    assert "differs from" in err and "['model']" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_compare_refuses_a_later_configs_used_run_dir_before_training(tmp_path, capsys):
    """Only the config whose turn came was checked: the ones before it trained to the end first."""
    paths = []
    for name in ("a", "b"):
        config = {"variant": "mac" if name == "a" else "swa", "run_dir": str(tmp_path / name), "steps": 1}
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
        paths.append(str(tmp_path / f"{name}.json"))
    (tmp_path / "b" / "checkpoints" / "step_00000001").mkdir(parents=True)
    assert titans_main(["train", "--compare", *paths]) == 2
    assert f"run_dir {str(tmp_path / 'b')!r} already holds checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_load_model_reproduces_the_trained_model(tmp_path, cache_dir):
    trainer = Trainer(micro_config(tmp_path, cache_dir, steps=2))
    trainer.train()
    model, cfg, tokenizer = load_model(tmp_path)
    assert not model.training and cfg.steps == 2 and tokenizer.vocab_size == 256
    x = torch.randint(0, 256, (2, 40))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(x)[0], trainer.model(x)[0])
    assert model.head.weight is model.embed.weight  # the tie survives the round trip


# ------------------------------------------------------------------------------------------- optimizer
def test_weight_decay_only_on_weight_matrices(tmp_path, cache_dir):
    cfg = micro_config(tmp_path, cache_dir)
    from titans.models.lm import TitansLM

    model = TitansLM(cfg.model_config(256))
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert not decayed & plain
    assert "embed.weight" in plain  # also the tied head
    assert all(n.endswith(".weight") for n in decayed)
    for n in plain:
        assert (
            n == "embed.weight"
            or model.get_parameter(n).dim() == 1
            or "persistent" in n
            or "init_weights" in n
        )
    assert any("q_proj" in n for n in decayed) and any("down_proj" in n for n in decayed)


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55) and f[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # non-increasing after warmup
    assert f[119] == pytest.approx(0.1)


# ------------------------------------------------------------------------------------------- learning
def test_loss_goes_down_on_real_text(tmp_path, cache_dir):
    cfg = micro_config(
        tmp_path, cache_dir, steps=60, batch_size=8, warmup_steps=5, eval_windows=8, eval_every=60
    )
    trainer = Trainer(cfg)
    before = trainer.evaluate()
    result = trainer.train()
    losses = result.step_losses
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < sum(losses[:5]) / 5 - 1.0
    assert result.eval.loss < before.loss - 1.0  # held-out text: it learned the language, not the batches
    assert result.eval.bpb < 5.0  # bytes of English prose; chance is 8 bits


def test_compile_trains_like_eager_and_samples(tmp_path, cache_dir, monkeypatch):
    """`TrainConfig.compile`: the trainer compiles the blocks (traced by dynamo; the "eager" backend here,
    inductor where a run compiles for real), trains with the eager run's losses and weights, and the sample
    at the end decodes (uncompiled: its shapes would each compile again)."""
    compiled_calls = []
    real = TitansLM.compile_blocks

    def compile_blocks(self, **options):
        compiled_calls.append(1)
        real(self, **{"backend": "eager", **options})

    monkeypatch.setattr(TitansLM, "compile_blocks", compile_blocks)
    # the wiring, on the quickest variant to trace (tests/test_memory_triton.py compiles a MAC)
    eager = Trainer(micro_config(tmp_path / "eager", cache_dir, steps=3, variant="swa"))
    ref = eager.train()
    with pytest.raises(ValueError, match="TrainConfig.compile: expected a bool"):
        micro_config(tmp_path, cache_dir, compile="yes")
    compiled = Trainer(
        micro_config(tmp_path / "compiled", cache_dir, steps=3, variant="swa", compile=True, sample_tokens=8)
    )
    result = compiled.train()
    assert compiled_calls == [1]
    assert result.step_losses == pytest.approx(ref.step_losses, abs=1e-5)
    assert max_weight_diff(eager.model, compiled.model) <= 1e-5
    assert result.sample


def test_gradient_checkpointing_trains_like_the_plain_run(tmp_path, cache_dir, monkeypatch):
    """`TrainConfig.gradient_checkpointing`: the model recomputes its blocks in the backward pass (the
    recomputation is seen to run) and trains with the plain run's losses and weights; the option may change
    on resume (it changes no gradient)."""
    plain = Trainer(micro_config(tmp_path / "plain", cache_dir, steps=3))
    ref = plain.train()
    calls = []
    real = TitansLM._checkpointed
    monkeypatch.setattr(TitansLM, "_checkpointed", lambda self, *a: calls.append(1) or real(self, *a))
    cfg = micro_config(tmp_path / "recomputed", cache_dir, steps=3, gradient_checkpointing=True)
    recomputed = Trainer(cfg)
    result = recomputed.train()
    assert recomputed.model.gradient_checkpointing and calls
    assert result.step_losses == pytest.approx(ref.step_losses, abs=1e-6)
    assert max_weight_diff(plain.model, recomputed.model) <= 1e-6
    assert "gradient_checkpointing" in RESUMABLE_CHANGES


@pytest.mark.parametrize("variant", ["mac", "mal"])
def test_compiled_blocks_compile_once_with_evaluation_and_monitoring(
    variant, tmp_path, cache_dir, monkeypatch
):
    """With `TrainConfig.compile`, the held-out evaluation, the memory monitor (a forward of one window
    per log) and the sample run the blocks uncompiled: their batch sizes and modes differ from the training
    step's, and compiled blocks would compile again for each (minutes on a GPU; and a 170M MAC's blocks,
    recompiled with a dynamic batch, failed to find a CUDA attention kernel for the mask's layout). Only
    the training step compiles: a second compile raises here."""
    real = TitansLM.compile_blocks
    monkeypatch.setattr(
        TitansLM, "compile_blocks", lambda self, **options: real(self, **{"backend": "eager", **options})
    )
    torch._dynamo.reset()
    cfg = micro_config(
        tmp_path, cache_dir, steps=3, variant=variant, compile=True, eval_every=2, sample_tokens=4
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        result = Trainer(cfg).train()
    assert result.step == 3 and result.sample
    memory_rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").open()) if r["split"] == "memory"]
    assert len(memory_rows) == 3


@pytest.mark.parametrize("enabled", [True, False])
def test_training_runs_float32_matmuls_in_tf32_as_configured_and_restores_the_flags(
    enabled, tmp_path, cache_dir, monkeypatch
):
    """`TrainConfig.tf32` (on by default): while `train` runs, torch's TF32 flags (which the memory's Triton
    kernels follow: exact float32 dots run without tensor cores) are as configured, in the steps, the
    evaluation and the sample; afterwards they are what they were."""
    seen = []
    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    for name in ("train_step", "evaluate", "sample"):
        real = getattr(Trainer, name)
        monkeypatch.setattr(Trainer, name, lambda self, *a, real=real: seen.append(flags()) or real(self, *a))
    before = flags()
    assert TrainConfig().tf32 and parse_set(["tf32=false"]) == {"tf32": False}
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not enabled
        Trainer(micro_config(tmp_path, cache_dir, steps=2, tf32=enabled, sample_tokens=4)).train()
        assert seen == [(enabled, enabled)] * 4  # 2 steps, the final evaluation, the sample
        assert flags() == (not enabled, not enabled)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_data_path_with_a_dollar_or_undecodable_bytes_keeps_the_plot_and_report(
    tmp_path, cache_dir, capsys, caplog
):
    """The plot's title names the data: a ``$`` in it started a matplotlib formula that failed to parse, and a
    folder name's undecodable byte (a lone surrogate) failed in the font renderer, both after the last step,
    losing the plot, the report and the sample."""
    # the log lines name the path: pytest-xdist cannot send a lone surrogate back from its worker
    caplog.set_level(logging.WARNING, logger="titans")
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400))
    for name in ("m$^$x", os.fsdecode(b"d\xff3")):
        data = tmp_path / name
        data.mkdir()
        for i in range(3):
            (data / f"{i}.txt").write_text(text)
        run = tmp_path / f"run{len(name)}"
        Trainer(micro_config(run, cache_dir, data=str(data), steps=1, plot=True)).train()
        assert (run / "loss.png").stat().st_size > 0 and (run / "report.json").is_file()
    capsys.readouterr()  # as the printed lines


def test_the_end_of_training_sample_stops_at_end_of_text_and_continues_the_prompt(
    tmp_path, cache_dir, monkeypatch
):
    """The sample is what `titans generate` prints: it stopped at no end-of-text token (printing it and what
    came after). Its text continues the prompt as `generate`'s does (`continuation_text`: decoded alone, a
    SentencePiece continuation lost its first space)."""
    spec = tmp_path / "bpe.json"
    train_bpe(["the quick brown fox jumps over the lazy dog. " * 50], 300, spec)
    data = tmp_path / "fox.txt"
    data.write_text("the quick brown fox jumps over the lazy dog.\n" * 2000)
    cfg = micro_config(tmp_path / "run", cache_dir, steps=1, tokenizer=str(spec), data=str(data))
    trainer = Trainer(dataclasses.replace(cfg, sample_tokens=6, sample_prompt="the quick"))
    tok = trainer.tokenizer
    new = tok.encode(" brown fox") + [tok.eos_id] + tok.encode(" jumps")
    seen = {}

    def fake_generate(model, prompt, n, **kw):
        seen.update(kw)
        return torch.cat([prompt, torch.tensor([new[:n]], device=prompt.device)], 1)

    monkeypatch.setattr("titans.training.trainer.generate", fake_generate)
    assert seen.get("stop_tokens") is None and trainer.sample() == "the quick brown fox"
    assert seen["stop_tokens"] == tok.eos_id


def test_a_run_folder_another_trainer_writes_is_refused(tmp_path, cache_dir):
    """Two trainers into one run folder (a second command started while the first trains, or a requeued
    --resume while the old job lives): both ran and exited 0, the second replacing the first's metrics,
    config and report and removing its checkpoint staging. The writer holds a lock on the folder."""
    import fcntl

    run = tmp_path / "run"
    Trainer(micro_config(run, cache_dir, steps=1)).train()
    trainer = Trainer(micro_config(run, cache_dir, steps=2), resume=True)  # built: holds nothing yet
    with open(run / ".lock", "ab") as other:  # another process training in the folder
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for mode in ({"resume": True}, {"overwrite": True}):
            with pytest.raises(FileExistsError, match="is in use: another training process writes it"):
                Trainer(micro_config(run, cache_dir, steps=2), **mode)
        with pytest.raises(FileExistsError, match="is in use"):
            trainer.train()
        fresh = tmp_path / "fresh"  # no checkpoint yet: the window before a first checkpoint
        fresh.mkdir()
        with open(fresh / ".lock", "ab") as first:
            fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(FileExistsError, match="is in use"):
                Trainer(micro_config(fresh, cache_dir, steps=1))
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001"]  # --overwrite cleared nothing
    assert trainer.train().step == 2  # the other one ended


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP"])
def test_a_run_folder_on_a_filesystem_without_locks_trains_with_a_warning(
    tmp_path, cache_dir, monkeypatch, code
):
    """Some network mounts have no file locks: flock answers ENOLCK or EOPNOTSUPP. Every run there was
    refused with that OS error; it now trains, warning that a second writer would go undetected. Any
    other error from flock still ends the run."""
    import errno

    def no_locks(f, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr("titans._fs.fcntl.flock", no_locks)
    with pytest.warns(UserWarning, match="the filesystem has no file locks"):
        assert Trainer(micro_config(tmp_path / "run", cache_dir, steps=1)).train().step == 1

    def broken(f, op):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("titans._fs.fcntl.flock", broken)
    with pytest.raises(OSError, match="Input/output error"):
        Trainer(micro_config(tmp_path / "other", cache_dir, steps=1))


def test_two_trainers_built_for_one_run_folder_do_not_mix_their_runs(tmp_path, cache_dir):
    """Two Trainers built in one process for one folder (a notebook cell run twice): the second's config
    and emptied metrics replaced the first's before either trained; the first then trained under the
    second's config.json, and the second trained next over the first's finished run."""
    run = tmp_path / "run"
    a = Trainer(micro_config(run, cache_dir, steps=2, seed=0))
    b = Trainer(micro_config(run, cache_dir, steps=1, seed=7))
    with pytest.raises(FileExistsError, match="written by another trainer since this one was built"):
        a.train()
    assert b.train().step == 1
    assert json.loads((run / "config.json").read_text())["seed"] == 7
    with pytest.raises(FileExistsError, match="written by another trainer"):
        a.train()
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001"]


def test_save_plot_replaces_an_image_whole_or_not_at_all(tmp_path, monkeypatch):
    """A plot was drawn straight into its file: a full disk (or a kill) mid-write left a truncated PNG in
    place of the good one before it. It is drawn in memory and written to a temporary file, renamed."""
    from matplotlib.figure import Figure

    from titans.training.metrics import save_plot

    fig = Figure()
    fig.add_subplot().plot([1, 2, 3], [3, 1, 2])
    path = save_plot(fig, tmp_path / "p.png")
    good = path.read_bytes()
    assert good.startswith(b"\x89PNG")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full_disk)
        with pytest.raises(OSError, match="No space left"):
            save_plot(fig, path)
    assert path.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["p.png"]
    assert save_plot(fig, tmp_path / "p.pdf").read_bytes().startswith(b"%PDF")  # the format by suffix


def test_save_plot_draws_user_text_as_written_and_keeps_log_axis_ticks(tmp_path):
    """A title's ``$`` is drawn as a dollar (it started a formula), while a log axis's tick labels, which
    its formatter writes as formulas (10^k), are still drawn as such (they were printed as
    ``$\\mathdefault{10^{0}}$``)."""
    from matplotlib.figure import Figure

    from titans.training.metrics import save_plot

    fig = Figure()
    ax = fig.add_subplot()
    ax.plot([1, 10, 100], [1, 2, 3], label="m$^$x")
    ax.set_xscale("log")
    ax.set_title("data m$^$x " + os.fsdecode(b"d\xff3"))
    ax.legend()
    save_plot(fig, tmp_path / "p.png")
    assert ax.get_title() == "data m\\$^\\$x d\\udcff3"
    ticks = [t for t in ax.get_xticklabels() if t.get_text()]
    assert ticks and all(t.get_text().startswith("$\\mathdefault{10^{") and t.get_parse_math() for t in ticks)
