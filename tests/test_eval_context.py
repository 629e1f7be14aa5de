"""`titans eval context`: streamed per-token losses equal one forward pass, the frozen twin is the model
with memory_write=False, buckets cover every position once, windows come from where they should, bad input
is refused by name, and the command writes every bucket of every model and a PNG."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from micro_train import micro_config
from tiny_lm import random_tokens, tiny_model
from titans.cli import main as titans_main
from titans.data.dna import DNATokenizer
from titans.data.stream import load_token_streams, separator_ids
from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.context import (
    ContextResult,
    bucket_means,
    context_curve,
    context_windows,
    document_windows,
    evaluate_context,
    format_context_table,
    frozen_twin,
    per_token_losses,
    plot_bins,
    position_buckets,
    source_documents,
)
from titans.models.lm import TitansLM
from titans.runtime.checkpoint import save_checkpoint
from titans.runtime.loading import tokenizer_record
from titans.training.config import TrainConfig
from titans.training.model_io import load_model
from titans.training.trainer import Trainer

VOCAB = 61
tokens = partial(random_tokens, vocab=VOCAB)


def direct_losses(model: TitansLM, inputs: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    """Next-token losses from one forward pass over whole windows (W, L)."""
    with torch.no_grad():
        logits, _ = model(inputs)
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return nll.view(inputs.shape).numpy()


# ------------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("variant", ["mac", "swa", "lmm"])
def test_streamed_losses_equal_one_forward_pass(variant):
    model = tiny_model(variant)  # segments of 8, chunks of 4: piece 37 cuts through both
    seq = tokens(3, 301, seed=2)
    inputs, targets = seq[:, :-1], seq[:, 1:]
    want = direct_losses(model, inputs, targets)
    got = per_token_losses(model, inputs, targets, 37, batch_size=2)  # 2 + 1 windows: a short last batch
    assert got.shape == (3, 300) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # any piece gives the same losses, and the numpy inputs do too
    again = per_token_losses(model, inputs.numpy(), targets.numpy(), 300, batch_size=3)
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=1e-5)


def test_per_token_losses_refuses_bad_input():
    model = tiny_model("swa")
    seq = tokens(2, 20)
    with pytest.raises(ValueError, match="piece"):
        per_token_losses(model, seq[:, :-1], seq[:, 1:], 0)
    with pytest.raises(ValueError, match="differ in shape"):
        per_token_losses(model, seq[:, :-1], seq[:, 2:], 8)
    with pytest.raises(ValueError, match="inputs must be a \\(windows, length\\)"):
        per_token_losses(model, seq[0, :-1], seq[0, 1:], 8)
    with pytest.raises(TypeError, match="integer token ids"):
        per_token_losses(model, seq[:, :-1].double(), seq[:, 1:], 8)


# ------------------------------------------------------------------------------------------- frozen twin
def test_frozen_twin_is_the_model_without_writes():
    model = tiny_model("mac", seed=3)
    rng = torch.random.get_rng_state()
    twin = frozen_twin(model)
    assert torch.equal(torch.random.get_rng_state(), rng)  # building it leaves the caller's RNG alone
    assert twin.config.memory_write is False and model.config.memory_write is True
    assert next(twin.parameters()).dtype == torch.float64 and not twin.training

    direct = tiny_model("mac", seed=0, memory_write=False)
    direct.load_state_dict(model.state_dict())  # the model built read-only from the start
    seq = tokens(2, 201, seed=4)
    inputs, targets = seq[:, :-1], seq[:, 1:]
    frozen = per_token_losses(twin, inputs, targets, 37)
    np.testing.assert_allclose(frozen, direct_losses(direct, inputs, targets), rtol=1e-5, atol=1e-5)
    writing = per_token_losses(model, inputs, targets, 37)
    # the first chunk reads the initial memory either way; later tokens read what was written
    np.testing.assert_allclose(frozen[:, :4], writing[:, :4], rtol=1e-5, atol=1e-5)
    assert np.abs(frozen[:, 8:] - writing[:, 8:]).max() > 1e-4


def test_no_frozen_twin_without_memory():
    assert frozen_twin(tiny_model("swa")) is None
    assert frozen_twin(tiny_model("transformer")) is None
    # a model whose memory never writes, or that has no memory layer, was scored against itself as its
    # "frozen twin": "writing - frozen" 0 by construction, the writing label on a read-only model
    assert frozen_twin(tiny_model("mac", memory_write=False)) is None
    assert frozen_twin(tiny_model("mal", memory_layers=[])) is None
    assert frozen_twin(tiny_model("mal", memory_layers=[1])) is not None


# ------------------------------------------------------------------------------------------- buckets
def test_bucket_edges():
    assert position_buckets(8192) == [(0, 256), (256, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
    assert position_buckets(65536)[-1] == (32768, 65536) and len(position_buckets(65536)) == 8
    assert position_buckets(300) == [(0, 256), (256, 300)]
    assert position_buckets(517) == [(0, 256), (256, 517)]
    assert position_buckets(256) == [(0, 256)]
    assert position_buckets(100) == [(0, 100)]
    assert position_buckets(1) == [(0, 1)]
    assert position_buckets(1024) == [(0, 256), (256, 1024)]
    assert position_buckets(1025) == [(0, 256), (256, 1024), (1024, 1025)]
    assert position_buckets(5000) == [(0, 256), (256, 1024), (1024, 2048), (2048, 4096), (4096, 5000)]
    with pytest.raises(ValueError, match="length"):
        position_buckets(0)


@pytest.mark.parametrize("length", [1, 2, 3, 7, 255, 257, 300, 517, 1000, 3001, 65536, 100_003])
def test_buckets_and_plot_bins_cover_every_position_once(length):
    for bins in (position_buckets(length), plot_bins(length)):
        assert bins[0][0] == 0 and bins[-1][1] == length
        assert all(lo < hi for lo, hi in bins)  # none empty
        assert all(a[1] == b[0] for a, b in zip(bins, bins[1:]))  # contiguous
    fine = plot_bins(length)
    assert len(fine) <= 4 * np.log2(length + 1) + 2  # log-spaced, not one per position


def test_bucket_means_are_the_means_of_the_positions():
    rng = np.random.default_rng(0)
    losses = rng.gamma(2.0, 1.0, size=(3, 517)).astype(np.float32)
    curve = context_curve("m", losses, variant="mac")
    for k, (lo, hi) in enumerate([(0, 256), (256, 517)]):
        assert curve.bucket_loss[k] == pytest.approx(
            float(losses[:, lo:hi].astype(np.float64).mean()), rel=1e-9
        )
        for w in range(3):
            assert curve.window_loss[w][k] == pytest.approx(float(losses[w, lo:hi].mean()), rel=1e-6)
    assert curve.tokens == [3 * 256, 3 * 261]
    assert curve.mean_loss == pytest.approx(float(losses.astype(np.float64).mean()), rel=1e-9)
    fine, _ = bucket_means(losses, plot_bins(517))
    assert curve.curve == pytest.approx(list(fine))
    assert curve.curve[0] == pytest.approx(float(losses[:, :16].mean()), rel=1e-6)  # the first 16 together


# ------------------------------------------------------------------------------------------- windows
def test_stream_windows_spread_evenly():
    stream = np.arange(1000, dtype=np.uint16)
    win = context_windows(stream, 300, 3)
    assert win.origins == ("token 0", "token 300", "token 600") and win.mode == "stream"
    assert win.inputs.dtype == np.int64 and win.inputs.shape == (3, 300)
    for row, start in zip(range(3), (0, 300, 600)):
        np.testing.assert_array_equal(win.inputs[row], np.arange(start, start + 300))
        np.testing.assert_array_equal(win.targets[row], np.arange(start + 1, start + 301))
    assert context_windows(stream, 300, 2).origins == ("token 0", "token 300")
    more = context_windows(stream, 300, 10)  # room for 3: fewer, and it says so
    assert more.count == 3 and more.requested == 10


def test_stream_too_short_says_how_long_it_is():
    with pytest.raises(
        ValueError, match=r"has 300 tokens; --length 300 needs 301.*longest length it allows is 299"
    ):
        context_windows(np.zeros(300, np.int64), 300, 1, what="the text")
    with pytest.raises(ValueError, match="windows"):
        context_windows(np.zeros(300, np.int64), 10, 0)


def test_per_document_windows_take_long_documents_from_their_start():
    rng = np.random.default_rng(1)
    lengths = {"a": 100, "b": 400, "c": 50, "d": 600, "e": 301, "f": 300}
    docs = [(k, rng.integers(0, 256, n)) for k, n in lengths.items()]
    win = document_windows(docs, 300, 2)
    assert win.origins == ("b", "d") and win.mode == "per-document"  # spread over b, d, e
    every = document_windows(docs, 300, 10)
    assert every.origins == ("b", "d", "e") and every.count == 3 and every.requested == 10  # f: 300 < 301
    for row, doc_id in enumerate(every.origins):
        doc = dict(docs)[doc_id]
        np.testing.assert_array_equal(every.inputs[row], doc[:300])
        np.testing.assert_array_equal(every.targets[row], doc[1:301])


def test_no_document_long_enough_names_the_longest():
    docs = [("short", np.zeros(10)), ("longest.txt", np.zeros(250)), ("mid", np.zeros(90))]
    with pytest.raises(ValueError, match=r"'longest.txt', has 250 tokens; --length 300 needs 301.*249"):
        document_windows(docs, 300, 4)


def test_source_documents_are_the_streams_documents(tmp_path):
    for i, n in enumerate([700, 40, 1200, 350, 900, 20, 500, 610]):
        (tmp_path / f"doc{i}.txt").write_text(f"line {i} of a document\n" * (n // 20))
    tok = ByteTokenizer()
    sep = np.asarray(separator_ids(tok))
    streams = load_token_streams(str(tmp_path), tok, heldout_fraction=0.4, cache=False)
    for docs, stream in (
        (source_documents(str(tmp_path), tok, heldout_fraction=0.4), streams.heldout),
        (source_documents(str(tmp_path), tok), None),
    ):
        if stream is not None:  # the held-out documents, as the trainer split them
            assert tuple(i for i, _ in docs) == stream.document_ids
            joined = np.concatenate([part for _, ids in docs for part in (ids, sep)])
            np.testing.assert_array_equal(joined, stream.tokens)
        else:
            assert len(docs) == 8 and all(ids.dtype == np.int64 for _, ids in docs)


# ------------------------------------------------------------------------------------------- results
def test_evaluate_context_scores_every_model_on_the_same_windows():
    mac, swa = tiny_model("mac", seed=5), tiny_model("swa", seed=6)
    seq = tokens(4, 1000, seed=7).flatten().numpy()
    win = context_windows(seq, 300, 3)
    loaded = []

    def load_swa():
        loaded.append(1)
        return swa

    seen = []
    result = evaluate_context(
        {"mac": mac, "swa": load_swa}, win, piece=37, batch_size=2, on_curve=seen.append
    )
    assert [c.label for c in result.curves] == ["mac", "mac frozen twin", "swa"] == [c.label for c in seen]
    assert loaded == [1] and result.twin == ("mac", "mac frozen twin")
    assert [c.frozen for c in result.curves] == [False, True, False]
    want = direct_losses(swa, torch.from_numpy(win.inputs), torch.from_numpy(win.targets))
    assert result.curve("swa").bucket_loss == pytest.approx(
        [want[:, :256].mean(), want[:, 256:].mean()], rel=1e-5
    )
    diff = result.writing_minus_frozen()
    assert diff == pytest.approx(
        [m - f for m, f in zip(result.curve("mac").bucket_loss, result.curve("mac frozen twin").bucket_loss)]
    )
    table = format_context_table(result)
    assert "writing - frozen" in table.splitlines()[0] and "256-300" in table and "all" in table
    d = result.to_dict()
    assert d["buckets"] == [[0, 256], [256, 300]] and d["writing_minus_frozen"]["per_bucket"] == diff
    assert set(d["models"]) == {"mac", "mac frozen twin", "swa"}
    json.dumps(d)

    bare = evaluate_context({"swa": swa}, win, piece=64, frozen=True)  # no memory: no twin, no column
    assert bare.twin is None and "writing - frozen" not in format_context_table(bare)
    with pytest.raises(ValueError, match="no models"):
        evaluate_context({}, win)
    assert isinstance(bare, ContextResult)


# ------------------------------------------------------------------------------------------- the command
def fresh_checkpoint(
    run_dir: Path, variant: str, tokenizer, train: dict | None = None, recipe: bool = False, **model
) -> Path:
    """A freshly initialised tiny model saved as a run folder, as the trainer saves one (``train``: its
    TrainConfig fields besides the variant, the data and the tokenizer)."""
    torch.manual_seed(0)
    m = TitansLM(dataclasses.replace(tiny_model(variant).config, vocab_size=tokenizer.vocab_size, **model))
    config = {
        "train": TrainConfig(
            variant=variant, data="builtin:prose", tokenizer=tokenizer.name, **(train or {})
        ).to_dict(),
        "model": m.config.to_dict(),
        "tokenizer": tokenizer_record(tokenizer.name, tokenizer),
        **({"task_training": {"recipe": {"task": "niah"}}} if recipe else {}),  # as `save_task_model`
    }
    save_checkpoint(run_dir, 1, model_state=m.state_dict(), trainer_state={}, config=config)
    return run_dir


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A MAC trained for two steps on the built-in prose (bytes)."""
    root = tmp_path_factory.mktemp("context")
    cfg = micro_config(root / "mac", root / "cache", steps=2, batch_size=2, eval_windows=1, ckpt_every=1000)
    Trainer(cfg).train()
    return root / "mac"


def test_cli_writes_every_bucket_of_every_model_and_a_png(trained_run, tmp_path, capsys):
    swa_run = fresh_checkpoint(tmp_path / "swa", "swa", ByteTokenizer())
    args = ["eval", "context", "--checkpoint", str(trained_run), "--compare", str(swa_run), "--length", "300",
            "--windows", "2", "--piece", "37", "--batch-size", "1", "--device", "cpu"]  # fmt: skip
    assert titans_main(args) == 0
    out = capsys.readouterr().out
    assert "writing - frozen" in out and "256-300" in out and "eval_context.json" in out
    report = json.loads((trained_run / "eval_context.json").read_text())
    assert (trained_run / "eval_context.png").read_bytes()[:4] == b"\x89PNG"
    labels = [f"mac ({trained_run})", "mac frozen twin", f"swa ({swa_run})"]
    assert list(report["models"]) == labels
    assert report["buckets"] == [[0, 256], [256, 300]] and report["length"] == 300 and report["windows"] == 2
    assert report["mode"] == "stream" and report["piece"] == 37 and "held-out" in report["data"]
    assert report["compare"][0].startswith(str(swa_run)) and "step_" in report["checkpoint"]
    assert report["command"]["compare"] == [str(swa_run)]
    for label in labels:
        m = report["models"][label]
        assert len(m["bucket_loss"]) == 2 and np.shape(m["window_loss"]) == (2, 2)
        assert m["tokens"] == [512, 88] and all(np.isfinite(m["bucket_loss"]))
    assert (
        report["models"]["mac frozen twin"]["frozen"]
        and report["writing_minus_frozen"]["frozen"] == labels[1]
    )

    # the losses are those of the checkpoint's model on its held-out split's windows
    model, cfg, tokenizer = load_model(trained_run)
    stream = load_token_streams(
        cfg.data, tokenizer, heldout_fraction=cfg.heldout_fraction, cache_dir=cfg.cache_dir
    )
    win = context_windows(stream.heldout, 300, 2)
    assert report["window_origins"] == list(win.origins)
    want = direct_losses(model, torch.from_numpy(win.inputs), torch.from_numpy(win.targets))
    assert report["models"][labels[0]]["bucket_loss"] == pytest.approx(
        [want[:, :256].mean(), want[:, 256:].mean()], rel=1e-4
    )


def test_a_compared_run_that_held_out_other_text_is_refused(trained_run, tmp_path, capsys):
    """It was scored on the --checkpoint's held-out split, part of which it may have trained on, and the
    result still said "held-out split"."""
    other = fresh_checkpoint(tmp_path / "swa", "swa", ByteTokenizer(), train={"heldout_fraction": 0.002})
    args = ["eval", "context", "--checkpoint", str(trained_run), "--compare", str(other), "--length", "300",
            "--windows", "1", "--out", str(tmp_path / "c.json")]  # fmt: skip
    assert titans_main(args) == 2
    err = capsys.readouterr().err
    assert f"--compare {str(other)!r} held out other text than --checkpoint (heldout_fraction 0.002" in err
    assert not (tmp_path / "c.json").exists()
    # on other text, every model is scored on the same tokens, none held out from anything
    assert titans_main([*args, "--data", "builtin:prose"]) == 0
    # a model the task recipe trained has no held-out split, as a compared run or as the checkpoint
    recipe = fresh_checkpoint(tmp_path / "recipe", "swa", ByteTokenizer(), recipe=True)
    for pair in ([trained_run, recipe], [recipe, trained_run]):
        argv = ["eval", "context", "--checkpoint", str(pair[0]), "--compare", str(pair[1])]
        assert (
            titans_main([*argv, "--length", "300", "--windows", "1", "--out", str(tmp_path / "r.json")]) == 2
        )
        err = capsys.readouterr().err
        assert f"{str(recipe / 'checkpoints')}" in err and "trained by the task recipe" in err


def test_cli_labels_name_the_models(trained_run, tmp_path, capsys):
    out = tmp_path / "ctx.json"
    args = ["eval", "context", "--checkpoint", str(trained_run), "--compare", str(trained_run),
            "--length", "260", "--windows", "1", "--labels", "MAC (ours),MAC again", "--device", "cpu",
            "--out", str(out)]  # fmt: skip
    assert titans_main(args) == 0
    assert "MAC (ours)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert list(report["models"]) == ["MAC (ours)", "mac frozen twin", "MAC again"]
    assert report["models"]["MAC (ours)"]["bucket_loss"] == report["models"]["MAC again"]["bucket_loss"]


def test_cli_per_document_on_a_source(trained_run, tmp_path, capsys):
    data = tmp_path / "docs"
    data.mkdir()
    (data / "long.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 12)  # 528 bytes
    (data / "short.txt").write_text("too short\n")
    out = tmp_path / "out" / "ctx.json"
    args = ["eval", "context", "--checkpoint", str(trained_run), "--data", str(data), "--per-document",
            "--length", "517", "--windows", "3", "--no-frozen", "--device", "cpu",
            "--out", str(out)]  # fmt: skip
    assert titans_main(args) == 0
    text = capsys.readouterr().out
    assert "room for 1 windows" in text and "writing - frozen" not in text
    report = json.loads(out.read_text())
    assert report["mode"] == "per-document" and report["window_origins"] == ["long.txt"]
    assert report["windows"] == 1 and report["windows_requested"] == 3
    assert list(report["models"]) == [f"mac ({trained_run})"] and "writing_minus_frozen" not in report
    assert report["buckets"] == [[0, 256], [256, 517]]
    assert out.with_suffix(".png").is_file()

    args[args.index("517")] = "600"
    assert titans_main(args) == 2
    err = capsys.readouterr().err
    assert "'long.txt', has 528 tokens" in err and "longest length it allows is 527" in err


def test_cli_refuses_bad_input(trained_run, tmp_path, capsys):
    base = [
        "eval",
        "context",
        "--checkpoint",
        str(trained_run),
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "x.json"),
    ]
    text = tmp_path / "tiny.txt"
    text.write_text("a short text\n")
    assert titans_main([*base, "--data", str(text), "--length", "300"]) == 2
    err = capsys.readouterr().err
    assert "has 14 tokens; --length 300 needs 301" in err and "allows is 13" in err

    dna_run = fresh_checkpoint(tmp_path / "dna", "mac", DNATokenizer())
    assert titans_main([*base, "--compare", str(dna_run), "--length", "300"]) == 2
    err = capsys.readouterr().err
    assert "--compare" in err and "'dna'" in err and "'bytes'" in err and "tokenizer" in err

    assert titans_main([*base, "--piece", "0"]) == 2
    assert "--piece must be a positive integer" in capsys.readouterr().err
    assert titans_main([*base, "--compare", str(trained_run), "--labels", "only one"]) == 2
    assert "1 label(s) for 2 model(s)" in capsys.readouterr().err
    assert titans_main([*base, "--compare", str(trained_run), "--labels", "a,a"]) == 2
    assert "distinct" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_outputs_never_replace_an_input_or_each_other(trained_run, tmp_path, capsys, monkeypatch):
    """`eval ppl --out` / `eval context --out` naming the --data file replaced the text with JSON, and
    `eval context --out X.png` wrote the JSON and then the plot over it; all are refused before scoring.
    A checkpoint folder copied out of its run gets its results in itself, not two folders up (where every
    copied checkpoint beside it wrote the same file)."""
    import shutil

    data = tmp_path / "held.txt"
    data.write_text("held-out text for the scorer. " * 40)
    ppl = ["eval", "ppl", "--checkpoint", str(trained_run), "--windows", "1", "--device", "cpu"]
    context = ["eval", "context", "--checkpoint", str(trained_run), "--length", "64", "--windows", "1"]
    for argv in ([*ppl, "--data", str(data)], [*context, "--data", str(data)]):
        assert titans_main([*argv, "--out", str(data)]) == 2
        assert "is the --data file" in capsys.readouterr().err
    assert data.read_text().startswith("held-out text")
    assert titans_main([*context, "--out", str(tmp_path / "c.png")]) == 2
    assert "ends in .png" in capsys.readouterr().err and not (tmp_path / "c.png").exists()
    monkeypatch.chdir(tmp_path)
    assert titans_main([*context, "--out", "."]) == 2  # "PosixPath('.') has an empty name"
    assert "is a folder" in capsys.readouterr().err

    copied = tmp_path / "models" / "m"
    shutil.copytree(sorted((trained_run / "checkpoints").iterdir())[-1], copied)
    assert titans_main(["eval", "ppl", "--checkpoint", str(copied), "--windows", "1", "--device", "cpu"]) == 0
    assert (copied / "eval_ppl.json").is_file() and not (tmp_path / "eval_ppl.json").exists()


def test_results_record_the_step_and_weights_and_an_overwritten_run_loses_them(tmp_path, capsys):
    """`eval ppl`'s JSON recorded only the checkpoint's path: a copied or renamed checkpoint lost its step,
    and after `titans train --overwrite` the run's eval_ppl.json (and eval_context.json/.png) still named
    the checkpoint path, which then held other weights with another score."""
    import shutil

    from titans.runtime.loading import load_checkpoint_from

    run = tmp_path / "run"
    Trainer(
        micro_config(run, tmp_path / "cache", steps=2, batch_size=2, eval_windows=1, ckpt_every=1000)
    ).train()
    loaded = load_checkpoint_from(run)
    copied = tmp_path / "renamed"
    shutil.copytree(loaded.path, copied)
    for where in (run, copied):
        assert (
            titans_main(["eval", "ppl", "--checkpoint", str(where), "--windows", "1", "--device", "cpu"]) == 0
        )
        ppl = json.loads((where / "eval_ppl.json").read_text())
        assert (ppl["step"], ppl["weights"]) == (2, loaded.weights_id)
    context = ["eval", "context", "--checkpoint", str(run), "--length", "64", "--windows", "1"]
    assert titans_main(context) == 0
    assert json.loads((run / "eval_context.json").read_text())["step"] == 2
    assert (run / "eval_context.png").is_file()
    capsys.readouterr()
    again = micro_config(run, tmp_path / "cache", steps=2, batch_size=2, eval_windows=1, ckpt_every=1000)
    Trainer(dataclasses.replace(again, seed=1), overwrite=True).train()
    assert not any(
        (run / name).exists() for name in ("eval_ppl.json", "eval_context.json", "eval_context.png")
    )
    assert (copied / "eval_ppl.json").is_file()  # outside the run: not the run's to remove
