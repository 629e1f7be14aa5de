"""BABILong-style tasks: bAbI facts (qa1-qa5) scattered through long prose, a question at the end.

The stories come from our own small world simulator, so every fact is consistent with one world state:

- ``qa1`` single supporting fact: people move around. "Where is Mary?"
- ``qa2`` two supporting facts: people also pick up and drop objects. "Where is the football?"
- ``qa3`` three supporting facts: an object's past. "Where was the football before the kitchen?"
- ``qa4`` two-argument relations: rooms on a grid. "What is north of the bedroom?" / "What is the
  kitchen north of?"
- ``qa5`` three-argument relations: people hand objects to each other. "Who gave the apple to Bill?" /
  "Who did Fred give the apple to?" / "What did Fred give to Bill?" / "Who received the apple?" /
  "Who gave the apple?"

Answers are single words. ``solve_babi(facts, question)`` answers from the fact *text* alone, by parsing it,
on a code path independent of the simulator; the tests use it to check that every answer is derivable.
Where several facts match a question, the latest one counts (the preamble says so); the generator only asks
questions whose answer is the same under every matching fact, so the two readings never disagree.

A sample is ``preamble + prose (facts inserted, in order, at random sentence boundaries) + question``, with
exactly ``length`` tokens including the answer (the prose budget is filled and trimmed in token space, as for
the needle task; see ``haystack.py``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

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

TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")
LOCATIONS = ("bathroom", "hallway", "garden", "office", "bedroom", "kitchen")
OBJECTS = ("football", "apple", "milk")
PEOPLE = ("Mary", "John", "Daniel", "Sandra")
PEOPLE_QA5 = ("Fred", "Jeff", "Bill", "Mary")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
_STEP = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}

_MOVE_VERBS = ("moved to", "went to", "journeyed to", "travelled to")
_TAKE_VERBS = ("picked up", "grabbed", "got", "took")
_DROP_VERBS = ("dropped", "discarded", "put down", "left")
_GIVE_VERBS = ("gave", "handed", "passed")

DEFAULT_NUM_FACTS = {"qa1": 8, "qa2": 12, "qa3": 20, "qa4": 2, "qa5": 12}
_MIN_NUM_FACTS = {"qa1": 1, "qa2": 2, "qa3": 3, "qa4": 1, "qa5": 4}
_MAX_NUM_FACTS = {"qa4": len(LOCATIONS) - 1}  # qa4 names one room per grid cell
_MAX_ATTEMPTS = 2000

PREAMBLE = (
    "Below is a long text with some facts about people, objects and places hidden in it, then a question. "
    "Answer the question with one word, using only those facts; when facts disagree, the latest one counts."
)


@dataclass(frozen=True)
class BabiStory:
    """The facts of one story (in order), its question and its one-word answer."""

    task: str
    facts: tuple[str, ...]
    question: str
    answer: str


# ---------------------------------------------------------------------------------------------------------
# The world simulator (generator side).


@dataclass
class _World:
    """True state of people and objects while a qa1/qa2/qa3/qa5 story is told."""

    rng: random.Random
    people: tuple[str, ...]
    room: dict[str, str] = field(default_factory=dict)  # person -> room, once they have moved
    holder: dict[str, str] = field(default_factory=dict)  # object -> person carrying it
    trail: dict[str, list[str]] = field(default_factory=dict)  # object -> rooms it has been in, in order
    gives: list[tuple[str, str, str]] = field(default_factory=list)  # (giver, object, receiver)
    facts: list[str] = field(default_factory=list)

    def _place(self, obj: str, room: str) -> None:
        trail = self.trail.setdefault(obj, [])
        if not trail or trail[-1] != room:
            trail.append(room)

    def where(self, obj: str) -> str | None:
        trail = self.trail.get(obj)
        return trail[-1] if trail else None

    # Each candidate list holds the actions that are possible in the current state.
    def move_options(self, meet_bias: bool) -> list[tuple[str, str]]:
        options = [(p, r) for p in self.people for r in LOCATIONS if r != self.room.get(p)]
        if meet_bias and self.rng.random() < 0.5:
            # Walk into a room where someone else is, so that objects can change hands (qa5).
            occupied = {r: {q for q in self.people if self.room.get(q) == r} for r in LOCATIONS}
            meeting = [(p, r) for p, r in options if occupied[r] - {p}]
            options = meeting or options
        return options

    def take_options(self) -> list[tuple[str, str]]:
        # An object nobody has placed yet is wherever its first taker is; otherwise the taker must be there.
        return [
            (p, o)
            for p in self.people
            if p in self.room
            for o in OBJECTS
            if o not in self.holder and self.where(o) in (None, self.room[p])
        ]

    def drop_options(self) -> list[tuple[str, str]]:
        return [(p, o) for o, p in self.holder.items()]

    def give_options(self) -> list[tuple[str, str, str]]:
        return [
            (p, o, q)
            for o, p in self.holder.items()
            for q in self.people
            if q != p and self.room.get(q) == self.room[p]
        ]

    def move(self, person: str, room: str) -> None:
        self.room[person] = room
        for obj, carrier in self.holder.items():
            if carrier == person:
                self._place(obj, room)
        self.facts.append(f"{person} {self.rng.choice(_MOVE_VERBS)} the {room}.")

    def take(self, person: str, obj: str) -> None:
        self.holder[obj] = person
        self._place(obj, self.room[person])
        there = self.rng.choice(("", " there"))
        self.facts.append(f"{person} {self.rng.choice(_TAKE_VERBS)} the {obj}{there}.")

    def drop(self, person: str, obj: str) -> None:
        del self.holder[obj]
        there = self.rng.choice(("", " there"))
        self.facts.append(f"{person} {self.rng.choice(_DROP_VERBS)} the {obj}{there}.")

    def give(self, giver: str, obj: str, receiver: str) -> None:
        self.holder[obj] = receiver
        self.gives.append((giver, obj, receiver))
        self.facts.append(f"{giver} {self.rng.choice(_GIVE_VERBS)} the {obj} to {receiver}.")

    def step(self, weights: dict[str, float]) -> None:
        """One random possible action, its kind drawn by ``weights`` among the kinds possible now."""
        options = {
            "move": self.move_options(meet_bias="give" in weights),
            "take": self.take_options() if "take" in weights else [],
            "drop": self.drop_options() if "drop" in weights else [],
            "give": self.give_options() if "give" in weights else [],
        }
        kinds = [k for k in weights if options[k]]
        kind = self.rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        getattr(self, kind)(*self.rng.choice(options[kind]))


def _qa1(rng: random.Random, num_facts: int) -> BabiStory | None:
    world = _World(rng, PEOPLE)
    for _ in range(num_facts):
        world.step({"move": 1.0})
    person = rng.choice(sorted(world.room))
    return BabiStory("qa1", tuple(world.facts), f"Where is {person}?", world.room[person])


def _qa2(rng: random.Random, num_facts: int) -> BabiStory | None:
    world = _World(rng, PEOPLE)
    for _ in range(num_facts):
        world.step({"move": 4.0, "take": 3.0, "drop": 1.0})
    placed = sorted(world.trail)
    if not placed:
        return None
    obj = rng.choice(placed)
    return BabiStory("qa2", tuple(world.facts), f"Where is the {obj}?", world.where(obj))


def _qa3(rng: random.Random, num_facts: int) -> BabiStory | None:
    world = _World(rng, PEOPLE)
    for _ in range(num_facts):
        world.step({"move": 5.0, "take": 2.0, "drop": 1.0})
    # Ask only about a room the object entered once, so "before the <room>" names one moment.
    choices = [
        (obj, i)
        for obj, trail in sorted(world.trail.items())
        for i in range(1, len(trail))
        if trail.count(trail[i]) == 1
    ]
    if not choices:
        return None
    obj, i = rng.choice(choices)
    trail = world.trail[obj]
    return BabiStory("qa3", tuple(world.facts), f"Where was the {obj} before the {trail[i]}?", trail[i - 1])


def _qa4(rng: random.Random, num_facts: int) -> BabiStory | None:
    # A self-avoiding walk on a grid, one room per visited cell: facts relate consecutive rooms.
    rooms = rng.sample(LOCATIONS, num_facts + 1)
    cells = {(0, 0): rooms[0]}
    pos = (0, 0)
    relations: list[tuple[str, str, str]] = []  # (a, direction, b): "a is <direction> of b"
    for room in rooms[1:]:
        free = [d for d, (dx, dy) in _STEP.items() if (pos[0] + dx, pos[1] + dy) not in cells]
        if not free:
            return None
        d = rng.choice(sorted(free))
        pos = (pos[0] + _STEP[d][0], pos[1] + _STEP[d][1])
        cells[pos] = room
        prev = relations[-1][0] if relations else rooms[0]
        relations.append((room, d, prev))
    facts = []
    for a, d, b in relations:  # state each relation one way or the other
        if rng.random() < 0.5:
            a, d, b = b, OPPOSITE[d], a
        facts.append(f"The {a} is {d} of the {b}.")
    a, d, b = rng.choice(relations)
    if rng.random() < 0.5:
        a, d, b = b, OPPOSITE[d], a
    if rng.random() < 0.5:
        return BabiStory("qa4", tuple(facts), f"What is {d} of the {b}?", a)
    return BabiStory("qa4", tuple(facts), f"What is the {a} {d} of?", b)


def _qa5(rng: random.Random, num_facts: int) -> BabiStory | None:
    world = _World(rng, PEOPLE_QA5)
    for _ in range(num_facts):
        world.step({"move": 3.0, "take": 2.0, "drop": 1.0, "give": 4.0})
    if not world.gives:
        return None

    def unique(known: dict[int, str], asked: int) -> str | None:
        """The answer (field ``asked`` of a give) if every give matching ``known`` fields agrees on it."""
        answers = {g[asked] for g in world.gives if all(g[i] == v for i, v in known.items())}
        return answers.pop() if len(answers) == 1 else None

    candidates = []
    for giver, obj, receiver in world.gives:  # fields of a give: 0 giver, 1 object, 2 receiver
        forms = [
            (f"Who gave the {obj} to {receiver}?", unique({1: obj, 2: receiver}, 0)),
            (f"Who did {giver} give the {obj} to?", unique({0: giver, 1: obj}, 2)),
            (f"What did {giver} give to {receiver}?", unique({0: giver, 2: receiver}, 1)),
            (f"Who received the {obj}?", unique({1: obj}, 2)),
            (f"Who gave the {obj}?", unique({1: obj}, 0)),
        ]
        candidates.extend((q, a) for q, a in forms if a is not None)
    if not candidates:
        return None
    question, answer = rng.choice(sorted(set(candidates)))
    return BabiStory("qa5", tuple(world.facts), question, answer)


_GENERATORS = {"qa1": _qa1, "qa2": _qa2, "qa3": _qa3, "qa4": _qa4, "qa5": _qa5}


def _check_task(task: str, num_facts: int | None) -> int:
    if task not in _GENERATORS:
        raise ValueError(f"unknown bAbI task {task!r}: use one of {TASKS}")
    n = DEFAULT_NUM_FACTS[task] if num_facts is None else num_facts
    low, high = _MIN_NUM_FACTS[task], _MAX_NUM_FACTS.get(task)
    if isinstance(n, bool) or not isinstance(n, int) or n < low or (high is not None and n > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"num_facts for {task} must be an int {bounds}, got {num_facts!r}")
    return n


def make_babi_story(
    task: str, *, seed: int = 0, num_facts: int | None = None, split: str = "test"
) -> BabiStory:
    """One consistent bAbI story of ``num_facts`` facts (default ``DEFAULT_NUM_FACTS[task]``).

    Deterministic in ``(task, seed, num_facts, split)``; "train" and "test" splits are unrelated streams.
    """
    n = _check_task(task, num_facts)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    rng = random.Random(f"babi-{split}-{task}-{n}-{seed}")
    for _ in range(_MAX_ATTEMPTS):  # a story that admits no question of the task's kind is redrawn
        story = _GENERATORS[task](rng, n)
        if story is not None:
            return story
    raise ValueError(f"could not draw a {task} story with num_facts={n}: use more facts")


# ---------------------------------------------------------------------------------------------------------
# The solver: reads fact sentences, never the simulator's state.

_NAME, _WORD = r"([A-Z][a-z]+)", r"([a-z]+)"
_FACT_PATTERNS = (
    ("move", re.compile(rf"{_NAME} (?:moved|went|journeyed|travelled) to the {_WORD}\.")),
    ("take", re.compile(rf"{_NAME} (?:picked up|grabbed|got|took) the {_WORD}(?: there)?\.")),
    ("drop", re.compile(rf"{_NAME} (?:dropped|discarded|put down|left) the {_WORD}(?: there)?\.")),
    ("give", re.compile(rf"{_NAME} (?:gave|handed|passed) the {_WORD} to {_NAME}\.")),
    ("relation", re.compile(rf"The {_WORD} is (north|south|east|west) of the {_WORD}\.")),
)


def _parse_fact(sentence: str) -> tuple[str, tuple[str, ...]]:
    for kind, pattern in _FACT_PATTERNS:
        m = pattern.fullmatch(sentence.strip())
        if m:
            return kind, m.groups()
    raise ValueError(f"not a bAbI fact: {sentence!r}")


class _Reader:
    """What a careful reader knows after each fact: rooms of people, carriers and paths of objects."""

    def __init__(self) -> None:
        self.person_room: dict[str, str] = {}
        self.carrier: dict[str, str | None] = {}
        self.path: dict[str, list[str]] = {}
        self.handovers: list[tuple[str, str, str]] = []
        self.relations: list[tuple[str, str, str]] = []

    def _object_seen_in(self, obj: str, room: str | None) -> None:
        if room is None:
            return
        path = self.path.setdefault(obj, [])
        if not path or path[-1] != room:
            path.append(room)

    def read(self, kind: str, args: tuple[str, ...]) -> None:
        if kind == "move":
            person, room = args
            self.person_room[person] = room
            for obj, who in self.carrier.items():
                if who == person:
                    self._object_seen_in(obj, room)
        elif kind == "take":
            person, obj = args
            self.carrier[obj] = person
            self._object_seen_in(obj, self.person_room.get(person))
        elif kind == "drop":
            self.carrier[args[1]] = None
        elif kind == "give":
            giver, obj, receiver = args
            self.carrier[obj] = receiver
            self.handovers.append((giver, obj, receiver))
            self._object_seen_in(obj, self.person_room.get(receiver))
        else:
            a, direction, b = args
            self.relations.append((a, direction, b))
            self.relations.append((b, OPPOSITE[direction], a))


def _latest(items: list, what: str):
    if not items:
        raise ValueError(f"the facts do not say {what}")
    return items[-1]


def solve_babi(facts: Sequence[str], question: str) -> str:
    """Answer a bAbI question (qa1-qa5 phrasing) from the fact sentences alone; the latest fact counts."""
    reader = _Reader()
    for sentence in facts:
        reader.read(*_parse_fact(sentence))
    q = question.strip()

    if m := re.fullmatch(rf"Where is {_NAME}\?", q):
        return _latest([reader.person_room[m[1]]] if m[1] in reader.person_room else [], f"where {m[1]} is")
    if m := re.fullmatch(rf"Where is the {_WORD}\?", q):
        return _latest(reader.path.get(m[1], []), f"where the {m[1]} is")
    if m := re.fullmatch(rf"Where was the {_WORD} before the {_WORD}\?", q):
        path = reader.path.get(m[1], [])
        visits = [i for i, room in enumerate(path) if room == m[2] and i > 0]
        return path[_latest(visits, f"where the {m[1]} was before the {m[2]}") - 1]
    if m := re.fullmatch(rf"What is (north|south|east|west) of the {_WORD}\?", q):
        return _latest([a for a, d, b in reader.relations if (d, b) == (m[1], m[2])], q)
    if m := re.fullmatch(rf"What is the {_WORD} (north|south|east|west) of\?", q):
        return _latest([b for a, d, b in reader.relations if (a, d) == (m[1], m[2])], q)

    gives = reader.handovers
    if m := re.fullmatch(rf"Who gave the {_WORD} to {_NAME}\?", q):
        return _latest([g for g, o, r in gives if (o, r) == (m[1], m[2])], q)
    if m := re.fullmatch(rf"Who did {_NAME} give the {_WORD} to\?", q):
        return _latest([r for g, o, r in gives if (g, o) == (m[1], m[2])], q)
    if m := re.fullmatch(rf"What did {_NAME} give to {_NAME}\?", q):
        return _latest([o for g, o, r in gives if (g, r) == (m[1], m[2])], q)
    if m := re.fullmatch(rf"Who received the {_WORD}\?", q):
        return _latest([r for g, o, r in gives if o == m[1]], q)
    if m := re.fullmatch(rf"Who gave the {_WORD}\?", q):
        return _latest([g for g, o, r in gives if o == m[1]], q)
    raise ValueError(f"not a bAbI question this solver knows: {question!r}")


# ---------------------------------------------------------------------------------------------------------
# Long-context samples.


@dataclass(frozen=True)
class BabiSample(PromptAnswer):
    """One BABILong prompt. ``len(prompt_ids) + len(answer_ids) == length`` exactly.

    ``fact_token_spans[i]``: ``(start, end)`` of ``facts[i]`` in ``prompt_ids`` (in story order);
    ``question_token_span``: the question line, at the end of the prompt. ``haystack_tokens``: how many of
    the ``length`` tokens are prose (the rest is preamble, facts, question and answer).
    """

    prompt_ids: list[int]
    answer: str
    answer_ids: list[int]
    task: str
    facts: tuple[str, ...]
    question: str
    fact_token_spans: list[tuple[int, int]]
    question_token_span: tuple[int, int]
    length: int
    haystack_tokens: int
    haystack: str
    seed: int


def make_babilong_sample(
    tokenizer: TextTokenizer,
    *,
    length: int,
    task: str,
    haystack: str | HaystackSource = "moby_dick",
    seed: int = 0,
    num_facts: int | None = None,
    split: str = "test",
) -> BabiSample:
    """A bAbI story hidden in prose, exactly ``length`` tokens in all (prompt + answer).

    The story depends only on ``(task, seed, num_facts, split)``, so one seed at several lengths gives the
    same facts and question under more or less noise. The prose gets ``length`` minus the tokens of the
    preamble, facts, question and answer; each fact goes, in story order, at a sentence boundary drawn
    uniformly from the prose (several may share one).
    """
    story = make_babi_story(task, seed=seed, num_facts=num_facts, split=split)
    source = get_haystack(haystack)
    rng = random.Random(f"babilong-{split}-{task}-{seed}")

    sep = piece_separator(tokenizer)
    question_line = f"\nQuestion: {story.question}\nAnswer:"
    preamble_ids = encode_piece(tokenizer, PREAMBLE + "\n")
    fact_ids = [encode_piece(tokenizer, sep + fact) for fact in story.facts]
    question_ids = encode_piece(tokenizer, question_line)
    answer_ids = encode_piece(tokenizer, sep + story.answer)
    fixed = len(preamble_ids) + sum(map(len, fact_ids)) + len(question_ids) + len(answer_ids)
    n_haystack = check_length(length, fixed, "the preamble, facts, question and answer")

    hay = sample_haystack(source, tokenizer, n_haystack, rng, sep)
    offsets = sorted(rng.choice(hay.boundaries) for _ in fact_ids)
    prompt_ids, spans = insert_pieces(preamble_ids, hay, list(zip(offsets, fact_ids)), question_ids)
    return BabiSample(
        prompt_ids=prompt_ids,
        answer=story.answer,
        answer_ids=answer_ids,
        task=task,
        facts=story.facts,
        question=story.question,
        fact_token_spans=spans,
        question_token_span=(len(prompt_ids) - len(question_ids), len(prompt_ids)),
        length=length,
        haystack_tokens=n_haystack,
        haystack=source.name,
        seed=seed,
    )


def babilong_grid(
    tokenizer: TextTokenizer,
    lengths: Sequence[int],
    tasks: Sequence[str] = TASKS,
    *,
    haystack: str | HaystackSource = "moby_dick",
    samples_per_cell: int = 1,
    seed: int = 0,
    num_facts: int | None = None,
) -> list[BabiSample]:
    """``samples_per_cell`` samples for every (task, length).

    Sample ``k`` of a task tells the same story at every length (only the amount of prose differs): story
    seed ``seed * samples_per_cell + k``, so ``seed=1, samples_per_cell=4`` tells the stories 4-7 of
    ``seed=0, samples_per_cell=8``.
    """
    if samples_per_cell < 1:
        raise ValueError(f"samples_per_cell must be >= 1, got {samples_per_cell}")
    check_distinct("lengths", lengths)
    check_distinct("tasks", tasks)
    return [
        make_babilong_sample(
            tokenizer,
            length=length,
            task=task,
            haystack=haystack,
            seed=seed * samples_per_cell + k,
            num_facts=num_facts,
        )
        for task in tasks
        for length in lengths
        for k in range(samples_per_cell)
    ]


def babilong_training_example(
    tokenizer: TextTokenizer,
    *,
    length: int,
    task: str,
    haystack: str | HaystackSource = "moby_dick",
    seed: int = 0,
    num_facts: int | None = None,
) -> TrainingExample:
    """A fine-tuning sequence of ``length`` tokens from the "train" stream (disjoint from the test stream)."""
    sample = make_babilong_sample(
        tokenizer,
        length=length,
        task=task,
        haystack=haystack,
        seed=seed,
        num_facts=num_facts,
        split="train",
    )
    return sample.training_example()
