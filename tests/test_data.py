"""Data pipeline: tokenizers, real text sources, held-out split, token cache, deterministic loaders."""

from __future__ import annotations

import base64
import gzip
import importlib.util
import json
import logging
import math
import os
import sys
import sysconfig

import numpy as np
import pytest
import torch

from titans.data import tokenizers as tokmod
from titans.data.corpus import prose_documents, prose_text
from titans.data.loader import EvalWindows, TokenBatches, bits_per_byte
from titans.data.sources import FileSource, InMemorySource, JsonlSource, load_source
from titans.data.split import heldout_score, split_documents, split_tail
from titans.data.stream import BYTE_SEPARATOR, load_token_streams, separator_ids, token_dtype
from titans.data.tokenizers import ByteTokenizer, load_tokenizer, train_bpe

AWKWARD = "Call me Ishmael — naïve café, 日本語, 🐳!\n\n  two  spaces\ttab\r\nend <|endoftext|> x"


# ----------------------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    text = prose_text("moby-dick")[:300_000]
    path = tmp_path_factory.mktemp("bpe") / "bpe.json"
    train_bpe((text[i : i + 10_000] for i in range(0, len(text), 10_000)), 600, path)
    return path


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    ids = tok.encode(AWKWARD)
    assert ids == list(AWKWARD.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == AWKWARD
    assert isinstance(tok, tokmod.Tokenizer)


def test_trained_bpe_file_round_trips(bpe_path):
    tok = load_tokenizer(str(bpe_path))
    assert isinstance(tok, tokmod.Tokenizer)
    assert tok.vocab_size == 600 and tok.eos_id == 0
    ids = tok.encode(AWKWARD)
    assert len(ids) < len(AWKWARD.encode())  # merges actually compress
    assert tok.decode(ids) == AWKWARD
    assert tok.eos_id not in ids  # the literal "<|endoftext|>" in text is not the eos token
    text = prose_text("sotu")[:20_000]
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, AWKWARD]) == [tok.encode(text), tok.encode(AWKWARD)]


def _gpt2_byte_chars() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: each of the 256 printable stand-ins -> its byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return {(chr(b) if b in printable else chr(next(extra))): b for b in range(256)}


def test_tiktoken_ranks_file_round_trips(bpe_path, tmp_path, monkeypatch):
    # Convert the trained byte-level BPE into a tiktoken ranks file (rank = merge order).
    vocab = json.loads(bpe_path.read_text())["model"]["vocab"]
    inv = _gpt2_byte_chars()
    pieces = [p for p, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if p != "<|endoftext|>"]
    lines = [
        f"{base64.b64encode(bytes(inv[c] for c in piece)).decode()} {rank}"
        for rank, piece in enumerate(pieces)
    ]
    path = tmp_path / "small.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    tok = load_tokenizer(path)
    assert tok.vocab_size == 600 and tok.eos_id == 599
    ids = tok.encode(AWKWARD)
    assert tok.decode(ids) == AWKWARD and tok.eos_id not in ids
    assert len(ids) < len(AWKWARD.encode())
    # a "~" path, as load_tokenizer and the other tokenizer classes take it (its fingerprint raised)
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tokmod.TiktokenTokenizer("~/small.tiktoken")
    assert home.path == path and home.fingerprint == tok.fingerprint


@pytest.mark.parametrize("kind", ["bytes", "bpe", "mistral-32k"])
def test_text_that_is_not_utf8_is_refused_by_name(kind, bpe_path):
    """A command-line argument's byte that is not UTF-8 reaches Python as a lone surrogate: the BPE and
    SentencePiece libraries failed on it with a TypeError / RuntimeError naming no text."""
    if kind == "mistral-32k":
        pytest.importorskip("mistral_common")
    tok = ByteTokenizer() if kind == "bytes" else load_tokenizer(str(bpe_path) if kind == "bpe" else kind)
    with pytest.raises(ValueError, match=r"not valid UTF-8 \(byte 0xff at character 3\)"):
        tok.encode(os.fsdecode(b"caf\xff tea"))
    with pytest.raises(ValueError, match=r"not valid UTF-8 \(lone surrogate U\+D800 at character 1\)"):
        tok.encode("a\ud800")
    assert tok.decode(tok.encode("café")) == "café"


def test_tiktoken_ranks_file_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken.*line 2"):
        load_tokenizer(bad)


def test_sentencepiece_round_trips(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    text = prose_text("moby-dick")[:200_000]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,  # unseen characters (CJK, emoji) become byte pieces: lossless
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    tok = load_tokenizer(tmp_path / "sp.model")
    assert tok.vocab_size == 400 and tok.eos_id is not None
    ids = tok.encode(AWKWARD)
    assert tok.decode(ids) == AWKWARD


@pytest.mark.parametrize(
    ("spec", "module", "package"),
    [("mistral-32k", "mistral_common", "mistral-common"), ("gpt2", "whisper", "openai-whisper")],
)
def test_named_tokenizers(spec, module, package, monkeypatch):
    if importlib.util.find_spec(module) is not None:  # installed: check real, known token ids
        tok = load_tokenizer(spec)
        assert tok.decode(tok.encode(AWKWARD)) == AWKWARD
        expected = {"mistral-32k": (32000, [22557, 1526]), "gpt2": (50257, [15496, 995])}[spec]
        assert (tok.vocab_size, tok.encode("Hello world")) == expected
    monkeypatch.setattr(tokmod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=package):
        load_tokenizer(spec)


def test_load_tokenizer_bad_specs(tmp_path):
    with pytest.raises(ValueError, match="'nope'"):
        load_tokenizer("nope")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="junk.json"):
        load_tokenizer(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="257"):
        train_bpe(["abc"], 100, tmp_path / "x.json")


# ----------------------------------------------------------------------------------------- sources
def test_prose_corpus_documents():
    moby, sotu = prose_documents("moby-dick"), prose_documents("sotu")
    assert len(moby) == 135 and len(sotu) == 233
    assert moby[0].id == "moby-dick/chapter-001" and moby[0].text.startswith("CHAPTER 1. Loomings.")
    assert "Call me Ishmael" in moby[0].text and "CHAPTER 2." not in moby[0].text
    assert sotu[0].id == "sotu/1790_george_washington_n" and not sotu[0].text.startswith("===")
    docs = prose_documents()
    assert len({d.id for d in docs}) == len(docs) == 368 and all(d.text for d in docs)
    assert prose_text().count("\n\n=== ") == 0 and len(prose_text()) > 10_000_000
    with pytest.raises(ValueError, match="'poems'"):
        prose_documents("poems")


def test_stdlib_source_is_real_sorted_python():
    src = load_source("builtin:stdlib")
    ids = src.document_ids()
    assert len(ids) > 500 and ids == sorted(ids)
    assert "os.py" in ids and not any("site-packages" in i for i in ids)
    assert all(i.endswith(".py") for i in ids)
    assert src.spec == "builtin:stdlib" and sysconfig.get_paths()["stdlib"] == str(src.root)


def test_directory_glob_file_and_jsonl_sources(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.md").write_text("ay")
    (tmp_path / "sub" / "c.py").write_text("print('c')")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden" / "h.txt").write_text("hidden")
    src = load_source(str(tmp_path))
    assert src.document_ids() == ["a.md", "b.txt", "sub/c.py"]
    assert [d.text for d in src.documents()] == ["ay", "bee", "print('c')"]
    assert load_source(str(tmp_path / "**" / "*.py")).document_ids() == ["sub/c.py"]
    one = load_source(str(tmp_path / "b.txt"))
    assert isinstance(one, FileSource) and [d.id for d in one.documents()] == ["b.txt"]
    (tmp_path / "z.txt.gz").write_bytes(gzip.compress(b"zipped"))
    assert next(load_source(str(tmp_path / "z.txt.gz")).documents()).text == "zipped"

    jl = tmp_path / "rows.jsonl"
    jl.write_text('{"body": "first"}\n\n{"body": "second", "x": 1}\n')
    src = load_source(str(jl), text_field="body")
    assert isinstance(src, JsonlSource)
    assert [(d.id, d.text) for d in src.documents()] == [("line-1", "first"), ("line-3", "second")]
    with pytest.raises(ValueError, match=r"rows\.jsonl.*line 1.*'text'"):
        list(load_source(str(jl)).documents())
    jl.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match="line 2"):
        list(load_source(str(jl)).documents())


def test_bad_source_specs_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        load_source(str(tmp_path / "no-such-dir"))
    with pytest.raises(ValueError, match="builtin:nope"):
        load_source("builtin:nope")
    with pytest.raises(FileNotFoundError, match=r"\*\.rst"):
        load_source(str(tmp_path / "*.rst"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_source(str(tmp_path / "empty"))
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="blank.txt"):
        load_token_streams(str(tmp_path / "blank.txt"), ByteTokenizer(), cache=False)
    with pytest.raises(ValueError, match="hf:"):
        load_source("hf:")


def test_hf_source(tmp_path, monkeypatch):
    if importlib.util.find_spec("datasets") is None:
        monkeypatch.setitem(sys.modules, "datasets", None)  # make the import fail like a missing package
        with pytest.raises(ImportError, match="datasets"):
            load_source("hf:anything")
        return
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "data.jsonl").write_text(
        "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20))
    )
    src = load_source(f"hf:{tmp_path / 'ds'}")
    docs = list(src.documents())
    assert len(docs) == 20 and docs[3].id == "row-3" and docs[3].text == "row 3"
    with pytest.raises(ValueError, match="'body'"):
        load_source(f"hf:{tmp_path / 'ds'}", text_field="body")
    # a column of numbers (or bytes) is no text: every row was skipped, "has no documents"
    (tmp_path / "ds" / "data.jsonl").write_text(
        "".join(json.dumps({"text": "x", "n": i}) + "\n" for i in range(3))
    )
    with pytest.raises(ValueError, match=r"column 'n' holds Value\('int64'.*not strings"):
        load_source(f"hf:{tmp_path / 'ds'}", text_field="n")


# ----------------------------------------------------------------------------------------- split
def test_split_is_deterministic_disjoint_and_non_empty():
    ids = [f"doc-{i}" for i in range(1000)]
    a = split_documents(ids, 0.1)
    assert a == split_documents(list(ids), 0.1)
    assert not set(a.train_ids) & set(a.heldout_ids)
    assert sorted(a.train_ids + a.heldout_ids) == sorted(ids)
    assert 60 < len(a.heldout_ids) < 140  # about 10%
    # adding documents never moves an existing one across the split
    b = split_documents([*ids, "new-1", "new-2"], 0.1)
    assert set(a.heldout_ids) <= set(b.heldout_ids)
    for fraction in (1e-6, 1 - 1e-6):  # hashing would put everything on one side: both stay non-empty
        s = split_documents(["x", "y", "z"], fraction)
        assert s.train_ids and s.heldout_ids
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_documents(ids, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        split_documents(["a", "a"], 0.5)


def test_hash_is_stable_across_releases():
    # A changed hash silently moves documents between train and held-out across versions: pin it.
    assert heldout_score("os.py") == pytest.approx(0.7026108369, abs=1e-9)


def test_single_document_uses_contiguous_tail(tmp_path, caplog):
    text = "".join(f"line {i} of the only document\n" for i in range(500))
    head, tail = split_tail(text, 0.1)
    assert head + tail == text and head.endswith("\n")
    assert 0.05 < len(tail) / len(text) <= 0.1
    path = tmp_path / "one.txt"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        streams = load_token_streams(str(path), ByteTokenizer(), heldout_fraction=0.1, cache=False)
    assert "single document" in caplog.text
    train = np.asarray(streams.train.tokens, np.uint8).tobytes()
    held = np.asarray(streams.heldout.tokens, np.uint8).tobytes()
    assert train[:-1].decode() + held[:-1].decode() == text  # minus the separators


# ----------------------------------------------------------------------------------------- streams
@pytest.fixture(scope="module")
def prose_bytes(tmp_path_factory):
    return load_token_streams("builtin:prose", ByteTokenizer(), cache_dir=tmp_path_factory.mktemp("cache"))


def test_heldout_text_never_in_training_stream(prose_bytes):
    train, held = prose_bytes
    all_ids = {d.id for d in prose_documents()}
    assert not set(train.document_ids) & set(held.document_ids)
    assert set(train.document_ids) | set(held.document_ids) == all_ids
    train_bytes = np.asarray(train.tokens, np.uint8).tobytes()
    held_bytes = np.asarray(held.tokens, np.uint8).tobytes()
    by_id = {d.id: d.text for d in prose_documents()}
    docs = prose_documents()
    for doc_id in held.document_ids:
        # A passage found in no other document (a president quoting an earlier address of his would be
        # the same text under two ids: that is the corpus, not a leak).
        text = by_id[doc_id]
        candidates = (text[k : k + 200] for k in range(len(text) // 3, len(text) - 200, 997))
        passage = next(p for p in candidates if sum(p in d.text for d in docs) == 1).encode()
        assert passage in held_bytes and passage not in train_bytes
    for doc_id in train.document_ids[:20]:
        text = by_id[doc_id]
        assert text[len(text) // 2 : len(text) // 2 + 200].encode() in train_bytes
    # training batches are windows of the training stream only
    x, _ = TokenBatches(train, batch_size=16, seq_len=256, seed=3).get_batch(7)
    for row in x.numpy().astype(np.uint8):
        assert row.tobytes() in train_bytes


def test_byte_stream_layout(prose_bytes):
    train, held = prose_bytes
    assert train.tokens.dtype == np.uint16 and token_dtype(70_000) == np.int32
    assert separator_ids(ByteTokenizer()) == [BYTE_SEPARATOR]
    by_id = {d.id: d.text for d in prose_documents()}
    expected = b"".join(by_id[i].encode() + b"\0" for i in held.document_ids)
    assert np.asarray(held.tokens, np.uint8).tobytes() == expected
    assert held.n_bytes == held.n_tokens and held.bytes_per_token == 1.0
    assert int((np.asarray(train.tokens) == BYTE_SEPARATOR).sum()) == len(train.document_ids)


def test_token_cache_is_reused_keyed_and_repaired(tmp_path, bpe_path, caplog):
    src = InMemorySource("sample", prose_documents()[:40])
    tok = load_tokenizer(bpe_path)
    first = load_token_streams(src, tok, cache_dir=tmp_path, heldout_fraction=0.1)
    entries = list((tmp_path / "tokens").iterdir())
    assert len(entries) == 1 and not any(p.name.startswith(".tmp") for p in entries)
    second = load_token_streams(src, tok, cache_dir=tmp_path, heldout_fraction=0.1)
    assert isinstance(second.train.tokens, np.memmap)  # read back, not rebuilt
    np.testing.assert_array_equal(first.train.tokens, second.train.tokens)
    assert second.heldout.document_ids == first.heldout.document_ids
    assert second.heldout.n_bytes == first.heldout.n_bytes
    # sub-word stream: eos after every document, byte count = text bytes + one per separator
    held_text = {d.id: d.text for d in src.documents()}
    assert first.heldout.n_bytes == sum(len(held_text[i].encode()) + 1 for i in first.heldout.document_ids)
    assert 2.0 < first.heldout.bytes_per_token < 5.0
    assert int((np.asarray(first.train.tokens) == tok.eos_id).sum()) == len(first.train.document_ids)
    # another tokenizer or split setting is another cache entry
    load_token_streams(src, ByteTokenizer(), cache_dir=tmp_path, heldout_fraction=0.1)
    load_token_streams(src, tok, cache_dir=tmp_path, heldout_fraction=0.2)
    assert len(list((tmp_path / "tokens").iterdir())) == 3
    # a damaged entry is detected and rebuilt
    npy = entries[0] / "train.npy"
    npy.write_bytes(npy.read_bytes()[: npy.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        third = load_token_streams(src, tok, cache_dir=tmp_path, heldout_fraction=0.1)
    assert "damaged" in caplog.text
    np.testing.assert_array_equal(first.train.tokens, third.train.tokens)
    # an empty array file (EOFError) or a garbled .npy header (tokenize.TokenError) had failed every load
    for damage in (lambda b: b"", lambda b: b[:10] + b"(((((((" + b[17:]):
        npy = entries[0] / "heldout.npy"
        npy.write_bytes(damage(npy.read_bytes()))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            again = load_token_streams(src, tok, cache_dir=tmp_path, heldout_fraction=0.1)
        assert "damaged" in caplog.text
        np.testing.assert_array_equal(first.heldout.tokens, again.heldout.tokens)


def test_token_cache_sees_edits_that_keep_size_and_mtime_and_flipped_bytes(tmp_path, caplog):
    """The cache key knew a file by its size and mtime only: text edited with both kept (``cp -p``,
    ``rsync -a``, a coarse-mtime file system) was served stale, and ``--resume``'s digest check compared
    stale with stale. A byte flipped in a cached array was served under the digest of the tokens it had."""
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(6):
        (folder / f"d{i}.txt").write_text(f"document {i}: " + "abcdefgh " * 50)
    first = load_token_streams(str(folder), ByteTokenizer(), cache_dir=tmp_path / "c", heldout_fraction=0.3)
    for f in folder.iterdir():  # the same size, the mtime set back
        st = f.stat()
        f.write_text(f.read_text().replace("abcdefgh", "ZYXWVUTS"))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = load_token_streams(str(folder), ByteTokenizer(), cache_dir=tmp_path / "c", heldout_fraction=0.3)
    assert b"ZYXWVUTS" in np.asarray(edited.train.tokens, np.uint8).tobytes()
    assert edited.train.digest != first.train.digest

    entry = max((tmp_path / "c" / "tokens").iterdir(), key=lambda e: e.stat().st_mtime_ns)
    array = np.load(entry / "train.npy", mmap_mode="r+")
    array[len(array) // 2] ^= 1
    array.flush()
    del array
    with caplog.at_level(logging.WARNING):
        again = load_token_streams(
            str(folder), ByteTokenizer(), cache_dir=tmp_path / "c", heldout_fraction=0.3
        )
    assert "does not match the digest" in caplog.text
    np.testing.assert_array_equal(again.train.tokens, edited.train.tokens)


def test_a_tokenizer_with_no_eos_and_no_blank_line_is_refused():
    """Its documents were joined with no boundary between them (a WordPiece tokenizer drops whitespace)."""

    class NoBoundary:
        name, vocab_size, eos_id = "wordpiece-like", 100, None

        def encode(self, text: str) -> list[int]:
            return [ord(c) % 100 for c in text if not c.isspace()]

    with pytest.raises(ValueError, match="encodes a blank line as nothing"):
        separator_ids(NoBoundary())


# ----------------------------------------------------------------------------------------- loaders
def test_batches_deterministic_from_seed_and_step():
    tokens = np.arange(10_007, dtype=np.int32)  # a token's value is its position
    a = TokenBatches(tokens, batch_size=6, seq_len=33, seed=5)
    b = TokenBatches(tokens, batch_size=6, seq_len=33, seed=5)
    for step in (0, 1, 17, 400):
        xa, ya = a.get_batch(step)
        xb, yb = b.get_batch(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (6, 33) and xa.dtype == torch.int64
        assert torch.equal(xa[:, 1:], ya[:, :-1]) and torch.equal(ya[:, -1], xa[:, -1] + 1)
        assert torch.equal(xa, xa[:, :1] + torch.arange(33))  # contiguous windows of the stream
    assert not torch.equal(a.get_batch(0)[0], a.get_batch(1)[0])
    assert not torch.equal(
        a.get_batch(0)[0], TokenBatches(tokens, batch_size=6, seq_len=33, seed=6).get_batch(0)[0]
    )


def test_resume_reproduces_uninterrupted_run():
    tokens = np.arange(5_000, dtype=np.int32)
    run = TokenBatches(tokens, batch_size=4, seq_len=16, seed=1)
    straight = [next(run)[0] for _ in range(12)]
    first = TokenBatches(tokens, batch_size=4, seq_len=16, seed=1)
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # plain data, survives any checkpoint format
    resumed = TokenBatches(tokens, batch_size=4, seq_len=16, seed=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(next(resumed)[0], straight[i]) for i in range(5, 12))
    for key, other in (("seed", 2), ("batch_size", 8), ("seq_len", 8)):
        kwargs = {"batch_size": 4, "seq_len": 16, "seed": 1, key: other}
        with pytest.raises(ValueError, match=key):
            TokenBatches(tokens, **kwargs).load_state_dict(state)
    with pytest.raises(ValueError, match="n_tokens"):
        TokenBatches(tokens[:-1], batch_size=4, seq_len=16, seed=1).load_state_dict(state)


def test_epochs_visit_every_window_once():
    n, seq, batch = 1_000, 7, 5
    loader = TokenBatches(np.arange(n, dtype=np.int32), batch_size=batch, seq_len=seq, seed=9)
    per_epoch = loader.windows_per_epoch
    assert per_epoch == (n - 1) // seq
    starts = torch.cat([loader.get_batch(s)[0][:, 0] for s in range(3 * per_epoch // batch + 1)])
    for e in range(2):
        epoch = starts[e * per_epoch : (e + 1) * per_epoch]
        assert len(set(epoch.tolist())) == per_epoch  # no repeats inside an epoch
        assert len(set((epoch % seq).tolist())) == 1  # one grid per epoch, shifted
        assert int(epoch.max()) + seq + 1 <= n


@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_union_is_the_global_batch(world_size):
    tokens = np.arange(20_000, dtype=np.int32)
    full = TokenBatches(tokens, batch_size=12, seq_len=50, seed=0)
    shards = [
        TokenBatches(tokens, batch_size=12, seq_len=50, seed=0, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for step in (0, 3, 99):
        gx, gy = full.get_batch(step)
        for r, shard in enumerate(shards):
            x, y = shard.get_batch(step)
            assert x.shape == (12 // world_size, 50)
            assert torch.equal(x, gx[r::world_size]) and torch.equal(y, gy[r::world_size])
    with pytest.raises(ValueError, match="multiple of world_size"):
        TokenBatches(tokens, batch_size=10, seq_len=50, world_size=3, rank=0)
    with pytest.raises(ValueError, match="rank"):
        TokenBatches(tokens, batch_size=12, seq_len=50, world_size=2, rank=2)
    with pytest.raises(ValueError, match="needs at least 51"):
        TokenBatches(tokens[:50], batch_size=12, seq_len=50)


def test_eval_windows_fixed_non_overlapping_and_sharded(caplog):
    tokens = np.arange(10_000, dtype=np.int32)
    ev = EvalWindows(tokens, seq_len=64, num_windows=20, batch_size=6, bytes_per_token=1.0)
    batches = list(ev)
    assert len(batches) == len(ev) == 4 and ev.num_windows == 20 and ev.n_target_tokens == 20 * 64
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x, torch.cat([b[0] for b in EvalWindows(tokens, seq_len=64, num_windows=20)]))
    starts = x[:, 0]
    assert torch.all(starts % 64 == 0) and torch.all(starts[1:] - starts[:-1] >= 64)  # aligned, disjoint
    assert int(starts[-1]) > 10_000 * 0.9  # spread over the whole stream
    assert torch.equal(y, x + 1)
    sharded = [EvalWindows(tokens, seq_len=64, num_windows=20, rank=r, world_size=3) for r in range(3)]
    got = sorted(int(b[0][i, 0]) for s in sharded for b in s for i in range(b[0].shape[0]))
    assert got == sorted(starts.tolist())
    with caplog.at_level(logging.WARNING):
        capped = EvalWindows(tokens[:300], seq_len=64, num_windows=50)
    assert capped.num_windows == (300 - 1) // 64 and "evaluating 4, not 50" in caplog.text
    with pytest.raises(ValueError, match="needs 65"):
        EvalWindows(tokens[:64], seq_len=64)


def test_bits_per_byte(prose_bytes):
    ev = EvalWindows(prose_bytes.heldout, seq_len=128, num_windows=4)
    assert ev.bits_per_byte(math.log(2)) == pytest.approx(1.0)  # byte stream: 1 byte per token
    assert bits_per_byte(math.log(256), 2.0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="bytes_per_token"):
        EvalWindows(np.arange(1000), seq_len=10).bits_per_byte(1.0)
