"""RULER-style single needle in a haystack (S-NIAH), the paper's Table 2.

Three needle kinds, as in RULER's ``niah_single_*`` tasks:

- ``passkey``: a 5-digit pass key hidden in the repeated-noise haystack ("The grass is green. ...").
- ``number``: a 7-digit "special magic number" for a key word (e.g. "quiet-lantern"), essay haystack.
- ``uuid``: a UUID as the special magic value for a key word, essay haystack.

A sample is ``preamble + haystack (needle inserted at a sentence boundary near depth) + question``; the
question ends so that the answer is its continuation ("... The pass key is" -> " 71432"). Every piece is
encoded separately and the id lists concatenated (see ``haystack.py``), so the needle's token span is exact.

Decoys (``distractors``, numbers per 1,000 haystack tokens): short sentences that each carry a number, half
of them the value with one or two digits changed, inserted at random sentence boundaries. Prose haystacks
hold numbers of their own (years, sums), and a model trained on the number-free noise haystack reads a key
among them badly; decoys put such numbers, and near-misses of the value, into training prompts
(docs/evaluations.md, "Decoy numbers in stages 2-5", measures what they change).

Evaluation: feed ``prompt_ids``, generate ``len(answer_ids)`` tokens greedily, decode, and score with
``scoring.score_exact`` against ``answer``. Training: ``sample.training_example()`` (loss on the answer only).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titans.evaluation.haystack import (
    HaystackSource,
    PromptAnswer,
    TextTokenizer,
    TrainingExample,
    check_length,
    encode_piece,
    get_haystack,
    insert_pieces,
    piece_separator,
    sample_haystack,
)
from titans.validation import check_distinct

# Key words are "adjective-noun" pairs, like RULER's random-word keys.
_ADJECTIVES_TEXT = """
    ancient amber bitter brave bright calm clever cold crimson curious dusty eager early fancy
    fierce gentle golden grand hidden hollow humble icy jolly kind lively lonely loud lucky mellow
    misty modest narrow noble odd pale patient proud quiet rapid rare rough rusty silent silver
    sleepy smooth steady swift tender tidy violet vivid wild wise
"""
_ADJECTIVES = tuple(_ADJECTIVES_TEXT.split())
_NOUNS_TEXT = """
    anchor apple arrow badge barrel basket beacon bell blanket bottle bridge candle canyon castle
    cellar compass copper cottage crystal desert engine feather forest fountain garden harbor
    helmet island jacket kettle ladder lantern meadow mirror needle orchard pebble pillow planet
    pocket quill river saddle shadow signal spindle teapot thunder tower valley window
"""
_NOUNS = tuple(_NOUNS_TEXT.split())


# The decoys' sentences: a number in a frame that is not the needle's.
DISTRACTOR_TEMPLATES = (
    "There were {n} of them.",
    "It cost {n} dollars.",
    "That was in {n}.",
    "The count reached {n}.",
    "Room {n} was empty.",
    "They walked {n} miles.",
)


def _distractor_number(rng: random.Random, value: str) -> str:
    """Half the time the value with one or two of its digits changed (never the value itself), else a
    number of 1 to 5 digits."""
    if value.isdigit() and rng.random() < 0.5:
        digits = list(value)
        for i in rng.sample(range(len(digits)), min(len(digits), rng.choice((1, 2)))):
            first = i == 0 and len(digits) > 1  # no leading zero
            digits[i] = rng.choice([d for d in "0123456789"[first:] if d != digits[i]])
        return "".join(digits)
    return str(rng.randint(0, 10 ** rng.randint(1, 5) - 1))


def distractor_pieces(
    tokenizer: TextTokenizer, sep: str, value: str, per_1k: float, budget: int, rng: random.Random
) -> list[list[int]]:
    """``int(per_1k * budget / 1000)`` decoy sentences, encoded, together at most half of ``budget``."""
    pieces: list[list[int]] = []
    used = 0
    for _ in range(int(per_1k * budget / 1000)):
        text = rng.choice(DISTRACTOR_TEMPLATES).format(n=_distractor_number(rng, value))
        ids = encode_piece(tokenizer, sep + text)
        if 2 * (used + len(ids)) > budget:
            break
        pieces.append(ids)
        used += len(ids)
    return pieces


@dataclass(frozen=True)
class NeedleKind:
    """How one needle kind reads: templates take ``{key}`` and ``{value}``."""

    name: str
    default_haystack: str
    preamble: str
    needle: str
    question: str
    make_value: Callable[[random.Random], str]


def _passkey(rng: random.Random) -> str:
    return str(rng.randint(10_000, 99_999))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _magic(value_kind: str, make_value: Callable[[random.Random], str]) -> NeedleKind:
    return NeedleKind(
        name=value_kind,
        default_haystack="essays",
        preamble=(
            f"Some special magic {value_kind}s are hidden within the following text. Make sure to memorize "
            f"them. I will quiz you about the {value_kind}s afterwards."
        ),
        needle=f"One of the special magic {value_kind}s for {{key}} is: {{value}}.",
        question=(
            f"What is the special magic {value_kind} for {{key}} mentioned in the provided text? "
            f"The special magic {value_kind} for {{key}} mentioned in the provided text is"
        ),
        make_value=make_value,
    )


NEEDLE_KINDS: dict[str, NeedleKind] = {
    "passkey": NeedleKind(
        name="passkey",
        default_haystack="noise",
        preamble=(
            "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the important information there."
        ),
        needle="The pass key is {value}. Remember it. {value} is the pass key.",
        question="What is the pass key? The pass key is",
        make_value=_passkey,
    ),
    "number": _magic("number", _number),
    "uuid": _magic("uuid", _uuid),
}


@dataclass(frozen=True)
class NeedleSample(PromptAnswer):
    """One S-NIAH prompt. ``len(prompt_ids) + len(answer_ids) == length`` exactly.

    ``needle_token_span``: ``(start, end)`` of the needle sentence in ``prompt_ids``.
    ``depth``: the requested depth; ``actual_depth``: where the needle landed, as a fraction of the haystack
    tokens (it sits at the sentence boundary nearest the requested depth). ``haystack_tokens``: how many
    of the ``length`` tokens are haystack (the rest is preamble, needle, decoys, question and answer).
    ``distractors``: how many decoy sentences the haystack holds.
    """

    prompt_ids: list[int]
    answer: str
    answer_ids: list[int]
    needle_token_span: tuple[int, int]
    needle_text: str
    question: str
    depth: float
    actual_depth: float
    length: int
    haystack_tokens: int
    kind: str
    haystack: str
    seed: int
    distractors: int = 0


def _needle_kind(kind: str) -> NeedleKind:
    if kind not in NEEDLE_KINDS:
        raise ValueError(f"unknown needle kind {kind!r}: use one of {tuple(NEEDLE_KINDS)}")
    return NEEDLE_KINDS[kind]


def make_niah_sample(
    tokenizer: TextTokenizer,
    *,
    length: int,
    depth: float,
    kind: str = "passkey",
    haystack: str | HaystackSource | None = None,
    seed: int = 0,
    split: str = "test",
    distractors: float = 0.0,
) -> NeedleSample:
    """Build one needle-in-a-haystack sample of exactly ``length`` tokens (prompt + answer).

    How the length is made exact: the preamble, needle, question and answer are encoded first; the haystack
    gets the remaining ``length - fixed`` tokens, filled with whole sentences from a random point of the
    source (wrapping around) and trimmed, in token space, from the front of its first sentence. The needle
    is then inserted at the haystack sentence boundary nearest ``depth`` (0.0: right after the preamble,
    1.0: right before the question); insertion adds no tokens beyond the needle's own.

    ``haystack``: a built-in name ("noise", "essays", "moby_dick", "sotu"), a ``HaystackSource``, or None
    for the kind's default (noise for passkey, RULER's essays otherwise). Everything random comes from
    ``seed``, and the haystack, key and value do not depend on ``depth``: with one seed, samples at several
    depths differ only in where the needle sits. ``split`` names the random stream: "train" and "test"
    samples with the same seed are unrelated, so fine-tuning data never replays the evaluation set.
    ``distractors``: decoy numbers per 1,000 tokens of haystack budget (see the module doc), drawn from a
    random stream of their own (0, the default: no decoys, and the other draws unchanged); their tokens
    come out of the haystack's budget.
    """
    spec = _needle_kind(kind)
    if isinstance(distractors, bool) or not isinstance(distractors, (int, float)) or not distractors >= 0:
        raise ValueError(f"distractors must be a number >= 0 (decoys per 1,000 tokens), got {distractors!r}")
    if not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    source = get_haystack(spec.default_haystack if haystack is None else haystack)

    rng = random.Random(f"niah-{split}-{kind}-{seed}")
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    value = spec.make_value(rng)

    sep = piece_separator(tokenizer)
    needle_text = spec.needle.format(key=key, value=value)
    question = spec.question.format(key=key)
    preamble_ids = encode_piece(tokenizer, spec.preamble + "\n")
    needle_ids = encode_piece(tokenizer, sep + needle_text)
    question_ids = encode_piece(tokenizer, "\n" + question)
    answer_ids = encode_piece(tokenizer, sep + value)
    fixed = len(preamble_ids) + len(needle_ids) + len(question_ids) + len(answer_ids)
    n_haystack = check_length(length, fixed, "the preamble, needle, question and answer")
    decoys: list[list[int]] = []
    if distractors:
        decoy_rng = random.Random(f"niah-{split}-{kind}-{seed}-distractors")
        decoys = distractor_pieces(tokenizer, sep, value, distractors, n_haystack, decoy_rng)
        n_haystack -= sum(map(len, decoys))

    hay = sample_haystack(source, tokenizer, n_haystack, rng, sep)
    offset = hay.nearest_boundary(depth)
    insertions = [(offset, needle_ids)]
    if decoys:
        insertions += [(decoy_rng.choice(hay.boundaries), ids) for ids in decoys]
        insertions.sort(key=lambda item: item[0])  # stable: the needle goes first at a shared boundary
    prompt_ids, spans = insert_pieces(preamble_ids, hay, insertions, question_ids)
    span = spans[[ids is needle_ids for _, ids in insertions].index(True)]
    return NeedleSample(
        prompt_ids=prompt_ids,
        answer=value,
        answer_ids=answer_ids,
        needle_token_span=span,
        needle_text=needle_text,
        question=question,
        depth=float(depth),
        actual_depth=offset / n_haystack if n_haystack else float(depth),
        length=length,
        haystack_tokens=n_haystack,
        kind=kind,
        haystack=source.name,
        seed=seed,
        distractors=len(decoys),
    )


def niah_grid(
    tokenizer: TextTokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    kind: str = "passkey",
    haystack: str | HaystackSource | None = None,
    samples_per_cell: int = 1,
    seed: int = 0,
) -> list[NeedleSample]:
    """The length x depth evaluation set: ``samples_per_cell`` samples for every (length, depth).

    Sample ``k`` of a length uses the same seed at every depth (so a row of the grid varies only the
    needle's position): a length's ``samples_per_cell * len(depths)`` prompts hold ``samples_per_cell``
    distinct needles. Seeds differ across lengths and ``k`` within one grid; they follow a length's index
    in ``lengths``, not its value, so two grids with the same ``seed`` and different ``lengths`` repeat
    their needles (the first length of each gets the same ones). Cell ``(i, k)`` has seed
    ``(seed * len(lengths) + i) * samples_per_cell + k``: with the same number of lengths and samples, a
    different ``seed`` gives new needles; grids that differ in those can share seeds (``--lengths a,b
    --samples 4 --seed 3`` puts at ``b`` the needles ``--lengths c,d --samples 4 --seed 3`` puts at ``d``).
    """
    if samples_per_cell < 1:
        raise ValueError(f"samples_per_cell must be >= 1, got {samples_per_cell}")
    check_distinct("lengths", lengths)  # a value given twice would score its cells twice
    check_distinct("depths", depths)
    samples = []
    for i, length in enumerate(lengths):
        for k in range(samples_per_cell):
            cell_seed = (seed * len(lengths) + i) * samples_per_cell + k  # distinct per cell and seed
            for depth in depths:
                samples.append(
                    make_niah_sample(
                        tokenizer, length=length, depth=depth, kind=kind, haystack=haystack, seed=cell_seed
                    )
                )
    return samples


def niah_training_example(
    tokenizer: TextTokenizer,
    *,
    length: int,
    kind: str = "passkey",
    haystack: str | HaystackSource | None = None,
    seed: int = 0,
    depth: float | None = None,
    distractors: float = 0.0,
) -> TrainingExample:
    """A fine-tuning sequence of ``length`` tokens from the "train" stream (disjoint from ``niah_grid``'s).

    The depth is drawn uniformly from the seed when not given.
    """
    if depth is None:
        depth = random.Random(f"niah-train-depth-{seed}").random()
    sample = make_niah_sample(
        tokenizer,
        length=length,
        depth=depth,
        kind=kind,
        haystack=haystack,
        seed=seed,
        split="train",
        distractors=distractors,
    )
    return sample.training_example()
