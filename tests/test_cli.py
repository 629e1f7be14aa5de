"""The commands as a user meets them: `--set` values parsed against the field types, bad options refused
before any work, help for every option, streamed generation, defaults that agree, the training report and
ordinary file permissions."""

from __future__ import annotations

import argparse
import json
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from micro_train import MICRO_MODEL, micro_config
from titans.cli import build_parser
from titans.cli import main as titans_main
from titans.models.config import TitansConfig
from titans.training.config import TrainConfig, parse_set
from titans.training.trainer import Trainer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


def small_run(run_dir: Path, cache_dir: Path) -> list[str]:
    """`titans train` options of a run that takes a second, should a bad value get through to training."""
    return ["--run-dir", str(run_dir), "--steps", "1", "--data", "builtin:prose", "--seq-len", "32",
            "--batch-size", "2", "--no-progress", "--device", "cpu", "--set", f"cache_dir={cache_dir}",
            "--set", "eval_windows=1", "--set", "tensorboard=false", "--set", "plot=false"]  # fmt: skip


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------------------------- --set value types
def test_set_values_take_the_field_types():
    got = parse_set(
        [
            "lr=2",  # an int for a float field is fine, and becomes a float
            "steps=1e3",  # a whole number written as a float is an int
            "grad_clip=null",
            "time_budget_min=1.5",
            "fsdp=True",
            "data=a b.txt",
            "sample_prompt=123",  # a str field keeps the text
            'run_dir="runs/x"',  # a JSON string
            "cache_dir=null",
            "sample_top_k=null",
            "model.memory_layers=[0, 1]",
            "model.memory_depth=3",
            "model.memory_surprise_clip=null",
            "model.memory_momentum=false",
        ]
    )
    assert got == {
        "lr": 2.0,
        "steps": 1000,
        "grad_clip": None,
        "time_budget_min": 1.5,
        "fsdp": True,
        "data": "a b.txt",
        "sample_prompt": "123",
        "run_dir": "runs/x",
        "cache_dir": None,
        "sample_top_k": None,
        "model.memory_layers": [0, 1],
        "model.memory_depth": 3,
        "model.memory_surprise_clip": None,
        "model.memory_momentum": False,
    }
    assert type(got["lr"]) is float and type(got["steps"]) is int
    cfg = TrainConfig.from_file(None, got)
    assert cfg.lr == 2.0 and cfg.model["memory_layers"] == [0, 1]


@pytest.mark.parametrize(
    "item, field, type_name",
    [
        ("lr=abc", "lr", "float"),
        ("warmup_steps=abc", "warmup_steps", "int"),
        ("min_lr_ratio=abc", "min_lr_ratio", "float"),
        ("grad_clip=abc", "grad_clip", "float"),
        ("sample_tokens=abc", "sample_tokens", "int"),
        ("time_budget_min=abc", "time_budget_min", "float"),
        ("heldout_fraction=abc", "heldout_fraction", "float"),
        ("seed=abc", "seed", "int"),
        ("lr=true", "lr", "float"),  # a bool is not a number
        ("steps=false", "steps", "int"),
        ("steps=2.5", "steps", "int"),
        ("lr=nan", "lr", "float"),
        ("lr=null", "lr", "float"),  # not optional
        ("fsdp=1", "fsdp", "bool"),
        ("model.memory_depth=two", "model.memory_depth", "int"),
        ("model.memory_momentum=maybe", "model.memory_momentum", "bool"),
        ("model.memory_layers=[0, x]", "model.memory_layers", "list[int]"),
        ("model.dim=null", "model.dim", "int"),
    ],
)
def test_set_refuses_a_value_of_the_wrong_type(tmp_path, cache_dir, capsys, item, field, type_name):
    run_dir = tmp_path / "run"
    assert titans_main(["train", "--set", item, *small_run(run_dir, cache_dir)]) == 2
    err = one_error_line(capsys)
    value = item.split("=", 1)[1]
    assert field in err and type_name in err and repr(value) in err, err
    assert not run_dir.exists()


def test_json_config_values_are_type_checked_too(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"lr": "abc"}))
    with pytest.raises(ValueError, match=r"TrainConfig\.lr\b.*float.*'abc'"):
        TrainConfig.from_file(path)
    with pytest.raises(ValueError, match=r"model\.memory_depth\b.*int.*'2'"):
        TrainConfig(model={"memory_depth": "2"})
    with pytest.raises(ValueError, match=r"TrainConfig\.fsdp\b.*bool"):
        TrainConfig(fsdp=1)


def test_a_steps_override_replaces_a_config_files_token_budget(tmp_path):
    """ "defaults < --config < flags < --set": a file's "tokens" had set the steps whatever --steps said."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"tokens": 40960, "seq_len": 64, "batch_size": 2}))
    assert TrainConfig.from_file(path).total_steps == 320
    assert TrainConfig.from_file(path, {"steps": 2}).total_steps == 2
    assert TrainConfig.from_file(path, {"steps": 2, "tokens": 1280}).total_steps == 10  # the budget wins


def test_a_model_name_in_a_config_is_refused_by_name():
    """It raised "TitansConfig.preset() got multiple values for argument 'name'" after tokenizing."""
    with pytest.raises(ValueError, match="'name' is the preset's name"):
        TrainConfig(model={"name": "mine"})


def test_eval_set_uses_the_same_parser(tmp_path, capsys):
    import titans.evaluation.cli as eval_cli

    assert not hasattr(eval_cli, "parse_overrides")  # one --set parser, in titans.training.config
    args = ["eval", "niah", "--train-recipe", "--set", "memory_depth=two", "--out", str(tmp_path)]
    assert titans_main(args) == 2
    err = one_error_line(capsys)
    assert "memory_depth" in err and "int" in err and "'two'" in err
    assert titans_main(["eval", "niah", "--train-recipe", "--set", "bogus=1", "--out", str(tmp_path)]) == 2
    assert "bogus" in one_error_line(capsys)


def test_resume_compares_the_resulting_configs(tmp_path, cache_dir):
    cfg = micro_config(tmp_path, cache_dir, batch_size=2, steps=1, eval_windows=1)
    Trainer(cfg).train()
    preset_value = TitansConfig().memory_depth  # the tiny preset keeps the default
    assert "memory_depth" not in cfg.model
    # the same model, spelled out: resumable
    same = micro_config(
        tmp_path, cache_dir, batch_size=2, steps=2, eval_windows=1,
        model={**MICRO_MODEL, "memory_depth": preset_value},
    )  # fmt: skip
    assert Trainer(same, resume=True).step == 1
    other = micro_config(
        tmp_path, cache_dir, batch_size=2, steps=2, eval_windows=1, model={**MICRO_MODEL, "memory_depth": 3}
    )
    with pytest.raises(ValueError, match=r"model\.memory_depth: checkpoint 2, now 3"):
        Trainer(other, resume=True)


# ---------------------------------------------------------------------------------- refused at once
@pytest.mark.parametrize(
    "item, field",
    [("sample_top_k=0", "sample_top_k"), ("sample_temperature=-1", "sample_temperature")],
)
def test_bad_sampling_options_are_refused_before_training(tmp_path, cache_dir, capsys, item, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig.from_file(None, parse_set([item]))
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    assert titans_main(["train", "--set", item, *small_run(run_dir, cache_dir)]) == 2
    assert time.perf_counter() - t0 < 5  # no data loaded, no model built
    assert field in one_error_line(capsys)
    assert not run_dir.exists()  # nothing trained, nothing written


def test_generate_refuses_save_state_with_several_samples_at_once(tmp_path, capsys):
    missing = tmp_path / "no-checkpoint"  # never opened: the options are refused first
    args = ["generate", "--checkpoint", str(missing), "--prompt", "a", "--num-samples", "2"]
    assert titans_main([*args, "--save-state", str(tmp_path / "s.safetensors")]) == 2
    err = one_error_line(capsys)
    assert "--save-state" in err and "--num-samples" in err and "no-checkpoint" not in err
    assert titans_main([*args[:-2], "--top-k", "0"]) == 2
    assert "--top-k" in one_error_line(capsys)


# ---------------------------------------------------------------------------------- help and defaults
def all_parsers(parser: argparse.ArgumentParser, name: str = "titans"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from all_parsers(sub, f"{name} {sub_name}")


def test_every_option_has_help_and_shows_its_default():
    parsers = dict(all_parsers(build_parser()))
    assert {"titans train", "titans generate", "titans read", "titans eval niah", "titans eval ppl"} <= set(
        parsers
    )
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, p in parsers.items()
        for a in p._actions
        if not isinstance(a, argparse._SubParsersAction)
        and not (a.help and a.help != argparse.SUPPRESS and a.help.strip())
    ]
    assert missing == []
    text = parsers["titans generate"].format_help()
    assert "(default: 200)" in text  # --max-new-tokens
    train_help = parsers["titans train"].format_help()
    assert "--list-fields" in train_help


def test_list_fields_describes_every_field(capsys):
    assert titans_main(["train", "--list-fields"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    for f in TrainConfig.__dataclass_fields__:
        if f != "model":
            assert f in lines, f
    for f in TitansConfig.__dataclass_fields__:
        if f not in ("variant", "name"):
            assert f"model.{f}" in lines, f
    assert "float" in lines["lr"] and "0.0004" in lines["lr"]
    assert "int" in lines["model.memory_depth"] and "2" in lines["model.memory_depth"]
    assert "momentum" in out.split("model.memory_depth", 1)[1]  # descriptions, not just names
    # every line has a description
    assert all(len(line.split(None, 3)) == 4 for line in lines.values())


def test_defaults_agree_between_commands():
    parsers = dict(all_parsers(build_parser()))
    gen = parsers["titans generate"]
    cfg = TrainConfig()
    assert gen.get_default("temperature") == cfg.sample_temperature
    assert gen.get_default("top_k") == cfg.sample_top_k
    assert cfg.device == "auto"
    with_device = {name: p for name, p in parsers.items() if any(a.dest == "device" for a in p._actions)}
    assert {"titans train", "titans generate", "titans read", "titans eval niah"} <= set(with_device)
    for name, p in with_device.items():
        # train's flag overrides the config's device only when given; the config's default is auto
        want = None if name == "titans train" else "auto"
        assert p.get_default("device") == want, name


# ---------------------------------------------------------------------------------- streaming
def test_incremental_decoder_emits_complete_characters():
    from titans.data.tokenizers import ByteTokenizer
    from titans.inference.generation import IncrementalDecoder

    text = "héllo wörld € 😀 end"
    data = list(text.encode())
    decoder = IncrementalDecoder(ByteTokenizer())
    pieces = [decoder.push(b) for b in data] + [decoder.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # a character is only printed once it is complete
    assert pieces.count("") == len(data) - len(text) + 1  # empty while a character is incomplete
    broken = IncrementalDecoder(ByteTokenizer())  # an incomplete character at the end still comes out
    assert "".join([broken.push(b) for b in [104, 0xE2, 0x82]] + [broken.finish()]) == "h\ufffd"


def test_a_continuation_keeps_the_space_a_sentencepiece_word_carries():
    """Decoded alone, a SentencePiece continuation drops the space its first word's "▁" stands for:
    `titans generate` printed "Call medetailed" and the server answered "detailed" after "Call me"."""
    pytest.importorskip("mistral_common", reason="the tokenizers extra is not installed")
    from titans.data.tokenizers import ByteTokenizer, load_tokenizer
    from titans.inference.generation import IncrementalDecoder, continuation_text

    for tok in (load_tokenizer("mistral-32k"), ByteTokenizer()):
        prompt, rest = (
            tok.encode("Call me"),
            tok.encode("Call me Ishmael, said he.")[len(tok.encode("Call me")) :],
        )
        want = tok.decode(prompt + rest)[len(tok.decode(prompt)) :]
        assert want.startswith(" Ishmael")
        assert continuation_text(tok, prompt, rest) == want
        decoder = IncrementalDecoder(tok, context=prompt)
        assert "".join(decoder.push(t) for t in rest) + decoder.finish() == want
    assert not load_tokenizer("mistral-32k").decode(rest).startswith(" ")  # what it was before
    # a context that ends mid-character: as continuation_text, the text decoded alone (it waited forever)
    ids = list("hé wörld".encode())
    decoder = IncrementalDecoder(ByteTokenizer(), context=ids[:2])
    pieces = [decoder.push(i) for i in ids[2:]] + [decoder.finish()]
    assert "".join(pieces) == continuation_text(ByteTokenizer(), ids[:2], ids[2:]) == "\ufffd wörld"
    assert pieces[1] == "\ufffd "


def test_generate_streams_pieces_as_they_are_generated(monkeypatch):
    from tiny_lm import tiny_model
    from titans.data.tokenizers import ByteTokenizer
    from titans.inference.generation import IncrementalDecoder, generate

    model = tiny_model("mac", dtype=torch.float32, vocab_size=256, segment_len=16, chunk_size=8)
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    decoder = IncrementalDecoder(ByteTokenizer())
    arrivals = []

    def on_token(token: torch.Tensor) -> None:
        arrivals.append((len(calls), decoder.push(int(token[0]))))

    prompt = torch.tensor([list(b"The ")])
    out = generate(model, prompt, 10, greedy=True, on_token=on_token)
    tail = decoder.finish()
    # one piece per token, each handed over before the next model call (not all at the end)
    assert [n for n, _ in arrivals] == list(range(1, 11))
    assert "".join(p for _, p in arrivals) + tail == ByteTokenizer().decode(out[0, 4:].tolist())


def test_cli_generate_prints_as_it_goes(tmp_path, capsys, monkeypatch):
    from tiny_lm import save_tiny_run, tiny_model

    model = tiny_model("mac", dtype=torch.float32, vocab_size=256, segment_len=16, chunk_size=8)
    save_tiny_run(tmp_path / "run", model)
    writes = []
    import sys

    real_write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or real_write(s))
    args = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "ab", "--max-new-tokens", "6"]
    assert titans_main([*args, "--greedy", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert len([w for w in writes if w and w != "\n"]) >= 6  # the prompt, then piece by piece
    from titans.inference.generation import generate

    want = generate(model, torch.tensor([list(b"ab")]), 6, greedy=True)[0, 2:].tolist()
    assert out == "ab" + bytes(want).decode("utf-8", errors="replace") + "\n"


# ---------------------------------------------------------------------------------- what a run writes
def test_train_report_names_its_files_and_they_have_ordinary_modes(tmp_path, capsys):
    cache_dir = tmp_path / "cache"  # written under this test's umask
    old = os.umask(0o027)
    try:
        run_dir = tmp_path / "run"
        cfg = micro_config(
            run_dir, cache_dir, batch_size=2, steps=50, eval_windows=1, time_budget_min=1e-4, plot=True,
            tensorboard=True, warmup_steps=1, ckpt_every=1000, eval_every=1000,
        )  # fmt: skip
        cfg_file = tmp_path / "c.json"
        cfg.save(cfg_file)
        assert titans_main(["train", "--config", str(cfg_file), "--no-progress"]) == 0
    finally:
        os.umask(old)
    out = capsys.readouterr().out
    report = out[out.index("== ") :]
    for name in ("report.json", "metrics.jsonl", "loss.png", "tb", "checkpoints", "config.json"):
        assert name in report, (name, report)
    assert "time budget" in report and "--resume" in report

    file_mode, dir_mode = 0o666 & ~0o027, 0o777 & ~0o027
    ckpt = next((run_dir / "checkpoints").iterdir())
    files = [run_dir / n for n in ("report.json", "metrics.jsonl", "loss.png", "config.json")]
    files += list(ckpt.iterdir())
    assert len(files) >= 7
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == file_mode, path
    for path in (run_dir, run_dir / "checkpoints", ckpt):
        assert stat.S_IMODE(path.stat().st_mode) == dir_mode, path
    cached = list(cache_dir.rglob("*"))
    assert any(p.is_dir() for p in cached)
    for path in cached:
        assert stat.S_IMODE(path.stat().st_mode) == (dir_mode if path.is_dir() else file_mode), path


def test_saved_state_file_has_an_ordinary_mode(tmp_path):
    from tiny_lm import tiny_model
    from titans.inference import prefill
    from titans.models.state import save_state

    model = tiny_model("mac", dtype=torch.float32)
    _, state = prefill(model, torch.zeros(1, 5, dtype=torch.int64))
    old = os.umask(0o022)
    try:
        path = save_state(state, tmp_path / "s.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_the_commands_without_the_serve_extra():
    """`titans train` (and `titans serve --help`) on an install without the `serve` extra: no module of the
    command line imports the HTTP stack (fastapi, pydantic, uvicorn, redis) until the server starts."""
    import subprocess
    import sys

    blocked = ("fastapi", "pydantic", "pydantic_core", "starlette", "uvicorn", "redis")
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        "from titans.cli import build_parser\n"
        "parser = build_parser()\n"
        "args = parser.parse_args(['train', '--compile', '--steps', '1'])\n"
        "assert args.compile and args.steps == 1\n"
        "parser.parse_args(['serve', '--checkpoint', 'runs/x'])\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_commands_run_float32_matmuls_in_tf32_and_restore_the_flags(monkeypatch):
    """Every command runs with torch's TF32 flags on (the memory's Triton kernels follow them on CUDA: in
    exact float32 they run without tensor cores), and the flags are back as they were afterwards."""
    import titans.inference.cli as inference_cli

    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    seen = []
    monkeypatch.setattr(inference_cli, "run_read", lambda args: seen.append(flags()) or 0)
    before = flags()
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert titans_main(["read", "--checkpoint", "c", "--input", "i", "--save-state", "s"]) == 0
        assert seen == [(True, True)] and flags() == (False, False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_state_continued_with_other_weights_of_the_config_is_warned_about(tmp_path, capsys):
    """`titans read` records which weights wrote a state (the checkpoint's model.safetensors SHA-256);
    continuing it with another checkpoint of the same config (which `load_state` cannot tell apart) warns,
    and with its own checkpoint does not. A state file without the record loads as before."""
    from tiny_lm import save_tiny_run, tiny_model
    from titans.cli import main as titans_main
    from titans.models.state import read_state_header

    mine = save_tiny_run(tmp_path / "a", tiny_model("mac", seed=0, dtype=torch.float32))
    other = save_tiny_run(tmp_path / "b", tiny_model("mac", seed=1, dtype=torch.float32))
    (tmp_path / "doc.txt").write_text("12 3+4, 56.\n" * 4)  # bytes inside the tiny vocabulary
    state = tmp_path / "s.safetensors"
    read = ["read", "--input", str(tmp_path / "doc.txt"), "--no-progress"]
    assert titans_main([*read, "--checkpoint", str(mine), "--save-state", str(state)]) == 0
    assert len(read_state_header(state)["weights"]) == 64
    capsys.readouterr()

    generate = ["generate", "--state", str(state), "--prompt", "1", "--max-new-tokens", "2", "--greedy"]
    assert titans_main([*generate, "--checkpoint", str(mine)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert titans_main([*generate, "--checkpoint", str(other)]) == 0
    err = capsys.readouterr().err
    assert "written by other weights of this config" in err and "Traceback" not in err
    again = tmp_path / "s2.safetensors"
    assert (
        titans_main([*read, "--checkpoint", str(other), "--state", str(state), "--save-state", str(again)])
        == 0
    )
    assert "written by other weights" in capsys.readouterr().err


def test_a_command_refused_after_its_output_check_leaves_no_folder(tmp_path, capsys):
    """The output checks made the output's folders (`check_writable`), so `titans read` refused for a
    missing checkpoint had left an empty folder behind; the folders made for the check are removed."""
    from titans._fs import check_writable

    (tmp_path / "doc.txt").write_text("12 3\n")
    out = tmp_path / "states" / "deeper" / "s.safetensors"
    args = ["read", "--checkpoint", str(tmp_path / "nowhere"), "--input", str(tmp_path / "doc.txt")]
    assert titans_main([*args, "--save-state", str(out), "--no-progress"]) != 0
    assert "nowhere" in one_error_line(capsys)
    assert not (tmp_path / "states").exists()
    (tmp_path / "kept").mkdir()
    check_writable(tmp_path / "kept" / "new" / "r.json")
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["kept"] and not (
        tmp_path / "kept" / "new"
    ).exists()


def test_read_refuses_to_save_its_state_over_its_input(tmp_path, capsys):
    """`titans read --input d.txt --save-state d.txt` replaced the text with the state file, exit 0."""
    doc = tmp_path / "d.txt"
    doc.write_text("12 3\n")
    argv = ["read", "--checkpoint", str(tmp_path / "nowhere"), "--input", str(doc), "--save-state", str(doc)]
    assert titans_main(argv) == 2
    assert "is the --input file" in one_error_line(capsys) and doc.read_text() == "12 3\n"


def test_presets_reads_a_variant_list_with_spaces(capsys):
    """`titans presets --variants 'mac, swa'` was refused ("got ' swa'"); every other list strips blanks."""
    assert titans_main(["presets", "--variants", "mac, swa"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header == ["preset", "mac", "swa"]
