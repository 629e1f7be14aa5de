"""Text sources on awkward inputs, and the checks that keep a run on its own data: globs of .jsonl shards,
empty documents, symlinked folders, damaged .gz files, names with glob characters, an unwritable token
cache, data changed under a finished run (eval ppl) or a resumed one, lone surrogates, OS errors that name
their file."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from micro_train import micro_config
from titans.cli import _message
from titans.cli import main as titans_main
from titans.data.loader import TokenBatches
from titans.data.sources import FileSource, InMemorySource, JsonlSource, load_source, open_text
from titans.data.split import heldout_score
from titans.data.stream import load_token_streams, token_digest
from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.perplexity import heldout_stream
from titans.inference.cli import read_text_blocks
from titans.training.config import TrainConfig
from titans.training.metrics import MetricsLogger, read_metrics, truncate_metrics
from titans.training.trainer import Trainer

TOK = ByteTokenizer()


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def records(n: int, start: int = 0) -> list[str]:
    return [f"record {i}: café, naïve, 日本語 " * 4 for i in range(start, start + n)]


# ------------------------------------------------------------------------------- globs read by kind
def test_a_glob_reads_jsonl_shards_and_gz_files_by_their_kind(tmp_path):
    write_jsonl(tmp_path / "part-0.jsonl", ["first", "", "second"])  # an empty text is no document
    write_jsonl(tmp_path / "part-1.jsonl", ["third"])
    with gzip.open(tmp_path / "part-2.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "fourth, gzipped"}) + "\n\n")
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(b"plain text, gzipped\n"))
    src = load_source(str(tmp_path / "*"))
    docs = [(d.id, d.text) for d in src.documents()]
    assert docs == [
        ("notes.txt.gz", "plain text, gzipped\n"),
        ("part-0.jsonl:line-1", "first"),
        ("part-0.jsonl:line-3", "second"),
        ("part-1.jsonl:line-1", "third"),
        ("part-2.jsonl.gz:line-1", "fourth, gzipped"),
    ]
    assert src.document_ids() == [i for i, _ in docs]
    # a .jsonl.gz named alone is parsed as its .jsonl would be
    alone = load_source(str(tmp_path / "part-2.jsonl.gz"))
    assert isinstance(alone, JsonlSource) and [d.text for d in alone.documents()] == ["fourth, gzipped"]
    # the field read is part of the fingerprint (it keys the token cache)
    assert src.fingerprint() != load_source(str(tmp_path / "*"), text_field="body").fingerprint()


# ------------------------------------------------------------------------------------ empty documents
def test_an_empty_document_is_never_the_held_out_one(tmp_path):
    ids = [f"line-{i}" for i in range(1, 21)]
    lowest = int(min(ids, key=heldout_score).split("-")[1])  # the fallback would hold this one out
    texts = ["" if i == lowest else f"record {i} " * 30 for i in range(1, 21)]
    path = write_jsonl(tmp_path / "data.jsonl", texts)
    streams = load_token_streams(str(path), TOK, heldout_fraction=0.01, cache=False)
    assert streams.heldout.n_tokens > 1 and f"line-{lowest}" not in streams.heldout.document_ids
    assert f"line-{lowest}" not in load_source(str(path)).document_ids()

    # a glob leaves empty files out, as a folder does
    names = [f"d{i:02d}.txt" for i in range(20)]
    empty = min(names, key=heldout_score)
    for name in names:
        (tmp_path / name).write_text("" if name == empty else "text " * 50)
    for spec in (str(tmp_path / "*.txt"), str(tmp_path)):
        assert empty not in load_source(spec).document_ids()
        assert load_token_streams(spec, TOK, heldout_fraction=0.01, cache=False).heldout.n_tokens > 1
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e.txt").write_text("")
    with pytest.raises(ValueError, match="only empty files"):
        load_source(str(tmp_path / "sub" / "*.txt"))


# ------------------------------------------------------------------------------ folders and symlinks
def test_a_folder_follows_symlinked_folders_and_skips_broken_links(tmp_path, caplog):
    outside = tmp_path / "outside" / "books"
    outside.mkdir(parents=True)
    for i in (1, 2):
        (outside / f"b{i}.txt").write_text(f"book {i} " * 20)
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "local.txt").write_text("local text " * 20)
    (data / "sub" / "deep.md").write_text("# deep\n" * 20)
    (data / "books").symlink_to(outside, target_is_directory=True)
    (data / "sub" / "up").symlink_to(data, target_is_directory=True)  # a loop: not walked again
    (data / ".#local.txt").symlink_to(data / "nowhere.txt")  # an editor lock file: a broken link
    (data / "dangling.txt").symlink_to(data / "gone.txt")
    (data / ".hidden.txt").write_text("an editor's swap or backup file")
    with caplog.at_level(logging.WARNING, logger="titans.data.sources"):
        ids = load_source(str(data)).document_ids()
    assert ids == ["books/b1.txt", "books/b2.txt", "local.txt", "sub/deep.md"]
    assert "dangling.txt" in caplog.text and "broken symlink" in caplog.text
    assert load_source(str(data / "**" / "*.txt")).document_ids() == [
        "books/b1.txt",
        "books/b2.txt",
        "local.txt",
    ]


def test_a_folder_reads_a_symlinked_file_once(tmp_path):
    # a symlink to a file in the same folder is the same text: read twice, it could be held out and trained on
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for i in range(30):
        (data / f"f{i:02d}.txt").write_text(f"document number {i} with some text")
    (data / "sub" / "x.txt").write_text("THIS TEXT IS IN BOTH SPLITS")
    (data / "copy20.txt").symlink_to(Path("sub") / "x.txt")
    ids = load_source(str(data)).document_ids()
    assert "copy20.txt" in ids and "sub/x.txt" not in ids and len(ids) == 31
    assert ids == load_source(str(data / "**" / "*.txt")).document_ids()
    texts = [d.text for d in load_source(str(data)).documents()]
    assert texts.count("THIS TEXT IS IN BOTH SPLITS") == 1


def test_an_existing_path_with_glob_characters_is_a_path(tmp_path):
    notes = tmp_path / "notes [v2].txt"
    notes.write_text("plain text line\n" * 10)
    folder = tmp_path / "books[2024]"
    folder.mkdir()
    (folder / "a.txt").write_text("a " * 10)
    (folder / "b.txt").write_text("b " * 10)
    odd = tmp_path / "what?*.jsonl"
    write_jsonl(odd, ["one", "two"])
    assert load_source(str(notes)).document_ids() == ["notes [v2].txt"]
    assert load_source(str(folder)).document_ids() == ["a.txt", "b.txt"]
    assert [d.text for d in load_source(str(odd)).documents()] == ["one", "two"]
    # a glob is still a glob when no such path exists
    assert load_source(str(tmp_path / "books[[]2024]" / "*.txt")).document_ids() == [
        "books[2024]/a.txt",
        "books[2024]/b.txt",
    ]


# ---------------------------------------------------------------------------------- damaged .gz files
def test_a_damaged_gz_file_is_one_error_naming_it(tmp_path, capsys):
    good = gzip.compress(("words " * 2000).encode())
    for i in range(4):
        (tmp_path / f"p{i}.txt.gz").write_bytes(good)
    (tmp_path / "p2.txt.gz").write_bytes(good[: len(good) // 2])  # an interrupted download
    spec = str(tmp_path / "*.gz")
    with pytest.raises(ValueError, match=r"p2\.txt\.gz.*not a readable gzip file"):
        load_token_streams(spec, TOK, heldout_fraction=0.1, cache=False)
    (tmp_path / "p2.txt.gz").write_text("not gzip")
    with pytest.raises(ValueError, match=r"p2\.txt\.gz.*not a readable gzip file"):
        load_token_streams(spec, TOK, heldout_fraction=0.1, cache=False)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"record {i} " * 50}) + "\n" for i in range(50))
    (tmp_path / "t.jsonl.gz").write_bytes((tmp_path / "d.jsonl.gz").read_bytes()[:-30])
    with pytest.raises(ValueError, match=r"t\.jsonl\.gz.*not a readable gzip file"):
        load_source(str(tmp_path / "t.jsonl.gz")).document_ids()
    # the command line: one line, no traceback
    args = ["train", "--data", spec, "--run-dir", str(tmp_path / "run"), "--steps", "1", "--device", "cpu"]
    assert titans_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "p2.txt.gz" in err, err


# -------------------------------------------------------------------------------- lone surrogates
def test_a_lone_surrogate_in_a_jsonl_record_becomes_the_replacement_character(tmp_path):
    path = tmp_path / "sur.jsonl"
    with open(path, "w") as f:  # json.dumps escapes it: "\ud83d", valid JSON, no valid UTF-8
        for i in range(10):
            f.write(json.dumps({"text": f"text {i} " * 10 + ("\ud83d!" if i == 7 else "")}) + "\n")
    texts = [d.text for d in load_source(str(path)).documents()]
    assert texts[7].endswith("\ufffd!") and all(t.isprintable() for t in texts)
    streams = load_token_streams(str(path), TOK, heldout_fraction=0.2, cache=False)
    assert streams.train.n_tokens + streams.heldout.n_tokens == sum(len(t.encode()) + 1 for t in texts)
    memory = InMemorySource.from_texts(["half an emoji \ud83d", "", "whole"])
    assert [(d.id, d.text) for d in memory.documents()] == [
        ("doc-000000", "half an emoji \ufffd"),
        ("doc-000002", "whole"),
    ]


# ----------------------------------------------------------------------------------- token cache
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-8-sig"])
def test_a_text_file_with_a_byte_order_mark_reads_as_its_text(tmp_path, encoding):
    """UTF-16 read as UTF-8: every other byte was a NUL, the byte tokenizer's document separator. UTF-8's
    mark was read as a character (U+FEFF) before the text, a JSONL file starting with it was refused as
    invalid JSON, and a file holding the mark alone was a document. `titans read` and `titans inspect` read
    a file as training does."""
    text = "Call me Ishmael. Ça va? \u2603\n"
    mark = b"" if encoding in ("utf-16", "utf-8-sig") else "\ufeff".encode(encoding)  # these write their own
    (tmp_path / "a.txt").write_bytes(mark + text.encode(encoding))
    (tmp_path / "b.txt").write_text(text, encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes("".encode(encoding))  # a byte-order mark alone: no text
    (tmp_path / "c.jsonl").write_bytes(mark + (json.dumps({"text": text}) + "\n").encode(encoding))
    source = load_source(str(tmp_path))
    docs = {d.id: d.text for d in source.documents()}
    assert docs["a.txt"] == docs["b.txt"] == text
    assert [d.text for d in load_source(str(tmp_path / "c.jsonl")).documents()] == [text]
    assert "empty.txt" not in source.document_ids()  # it could have been the only held-out document
    assert "".join(read_text_blocks(str(tmp_path / "a.txt"), block_chars=8)) == text
    with open_text(tmp_path / "a.txt") as f:
        assert f.read() == text
    # compressed, as training reads it (its compressed bytes were read as text)
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(mark + text.encode(encoding)))
    assert "".join(read_text_blocks(str(tmp_path / "d.txt.gz"), block_chars=8)) == text


def test_an_unusable_cache_folder_is_warned_about_and_skipped(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("some text\n" * 50)
    (tmp_path / "b.txt").write_text("more text\n" * 50)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="titans.data.stream"):
        streams = load_token_streams(
            str(tmp_path / "*.txt"), TOK, heldout_fraction=0.5, cache_dir=blocker / "cache"
        )
    assert streams.train.n_tokens + streams.heldout.n_tokens == 1002
    assert "continuing without it" in caplog.text


def test_cache_entries_record_the_token_digests(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(6):
        (tmp_path / "d" / f"{i}.txt").write_text(f"document {i}\n" * 30)
    built = load_token_streams(str(tmp_path / "d"), TOK, heldout_fraction=0.3, cache_dir=tmp_path / "c")
    cached = load_token_streams(str(tmp_path / "d"), TOK, heldout_fraction=0.3, cache_dir=tmp_path / "c")
    for a, b in zip(built, cached):
        assert (
            a.digest == b.digest == token_digest(np.asarray(b.tokens)) and a.split_digests == b.split_digests
        )
    assert built.train.split_digests == (built.train.digest, built.heldout.digest)


# ------------------------------------------------------------------------------- data changed since
def corpus(folder: Path, upper: bool = False) -> Path:
    folder.mkdir(exist_ok=True)
    for i in range(8):
        text = f"document {i}: the quick brown fox jumps over the lazy dog\n" * 20
        (folder / f"{i}.txt").write_text(text.upper() if upper else text)
    return folder


def test_resume_refuses_changed_text_with_the_same_token_count(tmp_path):
    data = corpus(tmp_path / "data")
    settings = dict(batch_size=4, seq_len=16, seed=1)
    streams = load_token_streams(str(data), TOK, heldout_fraction=0.25, cache=False)
    first = TokenBatches(streams.train, **settings)
    next(first)
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    TokenBatches(streams.train, **settings).load_state_dict(state)  # the same text resumes
    corpus(data, upper=True)  # every document rewritten, as many bytes
    changed = load_token_streams(str(data), TOK, heldout_fraction=0.25, cache=False)
    assert changed.train.n_tokens == streams.train.n_tokens
    with pytest.raises(ValueError, match="training text is not the checkpoint's"):
        TokenBatches(changed.train, **settings).load_state_dict(state)
    # a checkpoint from before digests were recorded is checked by its token count, as it was
    old = {k: v for k, v in state.items() if k not in ("stream", "heldout")}
    TokenBatches(changed.train, **settings).load_state_dict(old)
    with pytest.raises(ValueError, match="n_tokens"):
        TokenBatches(changed.train.tokens[:-1], **settings).load_state_dict(old)
    # only a held-out document changed: the training text is the same, the run's evaluations would not be
    corpus(data)
    heldout_doc = streams.heldout.document_ids[0]
    (data / heldout_doc).write_text((data / heldout_doc).read_text().upper())
    again = load_token_streams(str(data), TOK, heldout_fraction=0.25, cache=False)
    assert again.train.digest == streams.train.digest
    with pytest.raises(ValueError, match="held-out text is not the checkpoint's"):
        TokenBatches(again.train, **settings).load_state_dict(state)


def test_heldout_stream_refuses_data_changed_since_the_run(tmp_path, caplog):
    path = write_jsonl(tmp_path / "data.jsonl", records(60))
    cfg = SimpleNamespace(
        data=str(path), heldout_fraction=0.1, cache_dir=str(tmp_path / "c"), text_field="text"
    )
    streams = load_token_streams(str(path), TOK, heldout_fraction=0.1, cache_dir=tmp_path / "c")
    state = TokenBatches(streams.train, batch_size=2, seq_len=8).state_dict()
    assert heldout_stream(cfg, TOK, state).digest == streams.heldout.digest
    # a training record edited: the held-out text, and so its score, is the run's own
    edited = records(60)
    edited[int(streams.train.document_ids[0].split("-")[1]) - 1] = "an edited training record"
    write_jsonl(path, edited)
    assert heldout_stream(cfg, TOK, state).digest == streams.heldout.digest
    write_jsonl(path, ["a new first record"] + records(60))  # every line number moves
    with pytest.raises(ValueError, match="changed since the run.*--allow-changed-data"):
        heldout_stream(cfg, TOK, state)
    old = {k: v for k, v in state.items() if k not in ("stream", "heldout")}  # an older checkpoint
    with pytest.raises(ValueError, match="training split has"):
        heldout_stream(cfg, TOK, old)
    with caplog.at_level(logging.WARNING, logger="titans.evaluation.perplexity"):
        assert heldout_stream(cfg, TOK, state, allow_changed=True).n_tokens > 0
    assert "scoring it anyway" in caplog.text


def test_eval_ppl_context_and_resume_refuse_a_run_whose_data_changed(tmp_path, capsys):
    path = write_jsonl(tmp_path / "data.jsonl", records(40))
    run = tmp_path / "run"
    cfg = micro_config(run, tmp_path / "cache", data=str(path), heldout_fraction=0.2, batch_size=2, steps=1,
                       seq_len=16, eval_windows=1, warmup_steps=1)  # fmt: skip
    Trainer(cfg).train()
    ppl = ["eval", "ppl", "--checkpoint", str(run), "--windows", "1", "--device", "cpu"]
    assert titans_main(ppl) == 0
    capsys.readouterr()
    write_jsonl(path, ["a new first record"] + records(40))
    assert titans_main(ppl) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "changed since the run" in err and "data.jsonl" in err, err
    assert titans_main([*ppl, "--allow-changed-data"]) == 0
    capsys.readouterr()
    # the result file says what it scored: the data changed, the precision and the command
    result = json.loads((run / "eval_ppl.json").read_text())
    assert "(held-out split; changed since the run: the held-out tokens differ" in result["data"]
    assert result["dtype"] == "float32" and result["device"] == "cpu"
    assert result["command"]["allow_changed_data"] is True and result["command"]["windows"] == 1
    # eval context scores the same held-out split: refused alike
    context = ["eval", "context", "--checkpoint", str(run), "--length", "16", "--windows", "1", "--no-frozen",
               "--device", "cpu", "--out", str(tmp_path / "ctx.json")]  # fmt: skip
    for per_document in ([], ["--per-document"]):
        assert titans_main([*context, *per_document]) == 2
        assert "changed since the run" in capsys.readouterr().err
    # resuming it on the changed data is refused too
    with pytest.raises(ValueError, match="training text is not the checkpoint's"):
        Trainer(TrainConfig(**{**cfg.to_dict(), "steps": 2}), resume=True)


# ----------------------------------------------------------------------------- OS errors, FSDP
def test_os_errors_name_their_file(tmp_path):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "run/metrics.jsonl")
    assert _message(full) == "no space left on device: 'run/metrics.jsonl'"
    assert _message(FileNotFoundError(errno.ENOENT, "No such file or directory", "x.txt")) == (
        "no such file or directory: 'x.txt'"
    )
    assert _message(OSError("no file here")) == "no file here"
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger._file.close()
    logger._file = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 (closed by the logger)
    with pytest.raises(OSError) as caught:
        logger.log("train", 1, loss=1.0)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "metrics.jsonl")
    logger._file = None


def test_file_source_reads_its_files(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "e.txt").write_text("")
    src = FileSource("x", tmp_path, [tmp_path / "a.txt", tmp_path / "e.txt"])
    assert [(d.id, d.text) for d in src.documents()] == [("a.txt", "alpha")]
    with pytest.raises(ValueError, match="no files with text"):
        FileSource("x", tmp_path, [tmp_path / "e.txt"])


def test_a_torn_last_metrics_row_is_skipped_and_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # the disk filled up in the middle of the second row
    path.write_text('{"split": "train", "step": 1, "loss": 2.0}\n{"split": "train", "step": 2, "lo')
    assert read_metrics(path) == [{"split": "train", "step": 1, "loss": 2.0}]
    truncate_metrics(path, last_step=1)
    assert path.read_text() == '{"split": "train", "step": 1, "loss": 2.0}\n'


def test_dataset_rows_without_text_are_no_documents(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "ds").mkdir()
    rows = [{"text": f"row {i}" if i % 3 else ("" if i % 2 else None)} for i in range(20)]
    (tmp_path / "ds" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = load_source(f"hf:{tmp_path / 'ds'}")
    docs = list(src.documents())
    assert src.document_ids() == [d.id for d in docs] and len(docs) == 13
    assert all(d.text for d in docs) and "row-3" not in src.document_ids()
