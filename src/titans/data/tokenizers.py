"""Tokenizers: a byte-level default and file-based BPE / SentencePiece / tiktoken models.

Every tokenizer exposes the same small interface (the ``Tokenizer`` protocol): ``name``, ``vocab_size``,
``eos_id`` (or ``None``), ``encode(text) -> list[int]`` and ``decode(ids) -> str``. The classes here also
have ``encode_batch(texts) -> list[list[int]]`` (parallel in the Rust/C++ libraries) and ``fingerprint``
(a string that changes when the vocabulary changes; used as a cache key for tokenized corpora).

Public API (names are stable):

- ``Tokenizer``: the protocol.
- ``ByteTokenizer()``: UTF-8 bytes, 256 symbols, no eos.
- ``HFTokenizer(path)``: a Hugging Face ``tokenizers`` JSON file.
- ``SentencePieceTokenizer(path)``: a SentencePiece ``.model`` file.
- ``TiktokenTokenizer(path, pattern=GPT2_PATTERN)``: a tiktoken ranks file (``base64-token rank`` per line);
  ``<|endoftext|>`` is appended as the eos token with id ``len(ranks)`` unless the file already has it.
- ``load_tokenizer(spec)``: ``"bytes"``, a path to one of the files above (chosen by suffix: ``.json``,
  ``.model``, ``.tiktoken``), or a named shortcut: ``"mistral-32k"`` (the 32K SentencePiece model shipped in
  the PyPI package ``mistral-common``), ``"gpt2"`` (the GPT-2 BPE ranks shipped in ``openai-whisper``) or
  ``"dna"`` (one token per nucleotide, ``titans.data.dna.DNATokenizer``).
- ``train_bpe(texts, vocab_size, path)``: train a byte-level BPE with the ``tokenizers`` library, save it
  to ``path`` (JSON) and return it loaded; lossless on any text, eos ``<|endoftext|>`` has id 0.

The libraries (``tokenizers``, ``sentencepiece``, ``tiktoken``; extra ``titans[tokenizers]``) are imported
only when a tokenizer that needs them is built.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from titans.validation import did_you_mean, utf8

# The GPT-2 pre-tokenization regex (contractions, letters, numbers, other symbols, whitespace runs). Used
# for tiktoken ranks files, which carry no pattern of their own.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
# Tokens we recognise as "end of document" in tokenizer files, most specific first.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
_NAMED_TOKENIZERS = ("bytes", "gpt2", "mistral-32k", "dna")
# what a tokenizer option takes (`load_tokenizer`), as its help says it
TOKENIZER_HELP = f"{', '.join(_NAMED_TOKENIZERS)}, or a tokenizer file (.json, .model, .tiktoken)"


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _require(module: str, package: str, what: str):
    """Import ``module`` or raise an ImportError that names the PyPI package to install."""
    try:
        return __import__(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the Python package {package!r}: pip install {package} "
            "(or pip install 'titans[tokenizers]')"
        ) from e


def _existing_file(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{what} file not found: {str(p)!r}")
    return p


CONTEXT_TOKENS = 4  # the context's last tokens a continuation is decoded after


def continuation_text(tokenizer: Tokenizer, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``context`` (the prompt): decoded after the context's last tokens. Decoded
    alone, a SentencePiece continuation loses the space before its first word (its "▁" starts the text)."""
    tail = [int(i) for i in list(context)[-CONTEXT_TOKENS:]]
    before = tokenizer.decode(tail)
    after = tokenizer.decode(tail + [int(i) for i in ids])
    return after[len(before) :] if after.startswith(before) else tokenizer.decode([int(i) for i in ids])


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 symbols, nothing to download, lossless on any text."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None
    fingerprint = "bytes:v1"

    def encode(self, text: str) -> list[int]:
        return list(utf8(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (e.g. one written by ``train_bpe``)."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        tokenizers = _require("tokenizers", "tokenizers", "a tokenizer JSON file")
        self.path = _existing_file(path, "tokenizer JSON")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ValueError(f"cannot read tokenizer JSON {str(self.path)!r}: {e}") from e
        # Raw text that spells a special token ("<|endoftext|>") is encoded as ordinary text: only the
        # data pipeline inserts special tokens.
        if hasattr(self._tok, "encode_special_tokens"):  # tokenizers >= 0.15
            self._tok.encode_special_tokens = True
        self.name = self.path.name
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = _find_eos(self._tok.token_to_id, eos_token, self.path)
        self.fingerprint = f"hf:{_file_sha256(self.path)}"

    def encode(self, text: str) -> list[int]:
        utf8(text)  # the library's own error for a lone surrogate is a TypeError that names no text
        # add_special_tokens=False: no BOS/EOS from a post-processor; the data pipeline adds separators.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file (e.g. the Mistral / Llama 32K vocabularies)."""

    def __init__(self, path: str | Path, name: str | None = None):
        spm = _require("sentencepiece", "sentencepiece", "a SentencePiece model")
        self.path = _existing_file(path, "SentencePiece model")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"cannot read SentencePiece model {str(self.path)!r}: {e}") from e
        self.name = name or self.path.name
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        self.eos_id = eos if eos >= 0 else None
        self.fingerprint = f"spm:{_file_sha256(self.path)}"

    def encode(self, text: str) -> list[int]:
        utf8(text)  # the library's own error for a lone surrogate names no text
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one ``base64(token) rank`` pair per line."""
    p = _existing_file(path, "tiktoken ranks")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(p.read_text(encoding="ascii", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 2 fields")
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{str(p)!r} line {lineno}: not 'base64-token rank' ({e})") from None
    if not ranks:
        raise ValueError(f"tiktoken ranks file {str(p)!r} is empty")
    return ranks


class TiktokenTokenizer:
    """A tiktoken ranks file; ``<|endoftext|>`` is the eos, appended after the ranks.

    Ranks files store no pre-tokenization regex: ``pattern`` defaults to GPT-2's. Text that happens to
    contain the literal string ``<|endoftext|>`` is encoded as ordinary text, never as the eos token.
    """

    def __init__(self, path: str | Path, pattern: str = GPT2_PATTERN, name: str | None = None):
        tiktoken = _require("tiktoken", "tiktoken", "a tiktoken ranks file")
        self.path = _existing_file(path, "tiktoken ranks")  # "~" expanded, as the ranks are read
        ranks = read_tiktoken_ranks(self.path)
        eos = ranks.get(ENDOFTEXT.encode())
        special = {} if eos is not None else {ENDOFTEXT: max(ranks.values()) + 1}
        self._enc = tiktoken.Encoding(
            name=self.path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
        )
        self.name = name or self.path.name
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id = eos if eos is not None else special[ENDOFTEXT]
        digest = hashlib.sha256((_file_sha256(self.path) + pattern).encode()).hexdigest()
        self.fingerprint = f"tiktoken:{digest}"

    def encode(self, text: str) -> list[int]:
        utf8(text)  # the library would encode a lone surrogate as U+FFFD: refused as the others do
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


def _find_eos(token_to_id, eos_token: str | None, path: Path) -> int | None:
    if eos_token is not None:
        eos = token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"eos token {eos_token!r} is not in the vocabulary of {str(path)!r}")
        return int(eos)
    for tok in _EOS_CANDIDATES:
        eos = token_to_id(tok)
        if eos is not None:
            return int(eos)
    return None


def _installed_package_dir(module: str, package: str, shortcut: str) -> Path:
    """The folder of an installed package, found without importing it (imports can be heavy)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"tokenizer {shortcut!r} is read from the PyPI package {package!r}, which is not installed: "
            f"pip install {package}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _mistral_32k_path() -> Path:
    data = _installed_package_dir("mistral_common", "mistral-common", "mistral-32k") / "data"
    # v1 is the original 32,000-piece Mistral-7B vocabulary (Llama-2 sized); later v2/v3 models are 32,768.
    for name in ("tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3"):
        if (data / name).is_file():
            return data / name
    candidates = sorted(data.glob("*.model*"))
    if not candidates:
        raise FileNotFoundError(f"no SentencePiece model found in {str(data)!r} (package mistral-common)")
    return candidates[0]


def _gpt2_ranks_path() -> Path:
    path = _installed_package_dir("whisper", "openai-whisper", "gpt2") / "assets" / "gpt2.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"GPT-2 ranks file not found at {str(path)!r} (package openai-whisper)")
    return path


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """Build a tokenizer from ``spec``: ``"bytes"``, ``"mistral-32k"``, ``"gpt2"``, ``"dna"`` or a file path.

    Files are recognised by suffix: ``.json`` (Hugging Face tokenizers), ``.model`` (SentencePiece),
    ``.tiktoken`` (tiktoken ranks).
    """
    s = str(spec)
    if s == "bytes":
        return ByteTokenizer()
    if s == "mistral-32k":
        return SentencePieceTokenizer(_mistral_32k_path(), name="mistral-32k")
    if s == "gpt2":
        return TiktokenTokenizer(_gpt2_ranks_path(), name="gpt2")
    if s == "dna":
        from titans.data.dna import DNATokenizer  # dna imports sources, which is independent of this module

        return DNATokenizer()
    path = Path(s).expanduser()
    suffix = path.suffix.lower()
    if suffix not in (".json", ".model", ".tiktoken"):
        raise ValueError(
            f"unknown tokenizer {s!r}: expected one of {', '.join(_NAMED_TOKENIZERS)} or a path to a "
            ".json (Hugging Face tokenizers), .model (SentencePiece) or .tiktoken (ranks) file"
            + did_you_mean(s, _NAMED_TOKENIZERS)
        )
    if suffix == ".json":
        return HFTokenizer(path)
    if suffix == ".model":
        return SentencePieceTokenizer(path)
    return TiktokenTokenizer(path)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | Path) -> HFTokenizer:
    """Train a byte-level BPE on ``texts``, save it as JSON at ``path`` and return it loaded.

    The 256 byte symbols are always in the vocabulary, so any text round-trips exactly; ``<|endoftext|>``
    (id 0) is the eos. ``vocab_size`` counts all of these (minimum 257).
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + eos), got {vocab_size}")
    tokenizers = _require("tokenizers", "tokenizers", "train_bpe")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return HFTokenizer(out)
