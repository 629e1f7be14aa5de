"""The data of the local lm-eval tasks in this folder, from the held-out documents of `builtin:prose`.

    python benchmarks/lm_eval_tasks/make_data.py            # writes benchmarks/lm_eval_tasks/data/*.jsonl

- ``prose_heldout.jsonl``: the held-out documents (the trainer's split of ``builtin:prose`` at its default
  ``heldout_fraction`` 0.01: one Moby-Dick chapter and four State of the Union addresses, about 297K
  characters), one ``{"text": ...}`` per document: task ``titans_prose_ppl`` (wikitext-style rolling
  loglikelihood: word and byte perplexity, bits per byte).
- ``prose_cloze.jsonl``: ``--items`` four-way sentence completions from the same documents: the text before
  a sentence plus the sentence's first half, and four second halves (the true one and three of other
  sentences, in random order): task ``titans_prose_cloze`` (accuracy, chance 25%).

No hub access: lm-eval reads the files with its ``json`` dataset loader (``dataset_path: json``). The task
YAMLs name the files relative to the repository root, so run lm-eval from there (with
``--include_path benchmarks/lm_eval_tasks``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from titans.data.sources import load_source
from titans.data.split import split_documents

HERE = Path(__file__).resolve().parent
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def heldout_documents(spec: str = "builtin:prose", fraction: float = 0.01) -> list[str]:
    docs = [d for d in load_source(spec).documents() if d.text]
    held = set(split_documents([d.id for d in docs], fraction).heldout_ids)
    return [d.text for d in docs if d.id in held]


def cloze_items(texts: list[str], n: int, seed: int, context_chars: int = 400) -> list[dict]:
    """Sentence completions: context = up to ``context_chars`` before a sentence + its first half."""
    rng = random.Random(seed)
    pool = []  # (text before the sentence, first half, second half)
    for text in texts:
        pos = 0
        for sentence in _SENTENCE_END.split(text):
            start = text.find(sentence, pos)
            pos = start + len(sentence)
            words = sentence.split()
            if not 10 <= len(words) <= 40 or start < context_chars:
                continue
            half = len(words) // 2
            before = " ".join(text[start - context_chars : start].split()[1:])  # from a whole word on
            pool.append((before, " ".join(words[:half]), " ".join(words[half:])))
    if len(pool) < max(n, 4):
        raise ValueError(f"only {len(pool)} usable sentences for {n} items")
    items = []
    for i in rng.sample(range(len(pool)), n):
        before, first, second = pool[i]
        others = [pool[j][2] for j in rng.sample(range(len(pool)), 8) if j != i and pool[j][2] != second][:3]
        choices = [second, *others]
        rng.shuffle(choices)
        items.append({"context": f"{before} {first}", "choices": choices, "answer": choices.index(second)})
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE / "data"), help="folder for the jsonl files")
    p.add_argument("--items", type=int, default=200, help="cloze items")
    p.add_argument("--seed", type=int, default=0, help="seed of the item choice and the choice order")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = heldout_documents()
    (out / "prose_heldout.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    items = cloze_items(texts, args.items, args.seed)
    (out / "prose_cloze.jsonl").write_text("".join(json.dumps(d) + "\n" for d in items))
    chars = sum(map(len, texts))
    print(f"wrote {len(texts)} documents ({chars} characters) and {len(items)} cloze items to {out}")


if __name__ == "__main__":
    main()
