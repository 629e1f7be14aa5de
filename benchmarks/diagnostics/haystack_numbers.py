"""How many numbers each haystack holds, and which pass-key prompts carry numbers besides their key.

    python benchmarks/diagnostics/haystack_numbers.py
    python benchmarks/diagnostics/haystack_numbers.py --lengths 1024,4096,16384 --samples 2 --seed 0
    python benchmarks/diagnostics/haystack_numbers.py --checkpoint RUN --haystacks essays --lengths 16384

First, per built-in haystack: digits per 1,000 characters of its text. Then, for the pass-key prompts of
``titans eval niah`` with the same ``--lengths`` / ``--samples`` / ``--seed`` (the defaults are those of
``benchmarks/niah_seeds.py``), per haystack, length and key: the other runs of three or more digits in the
prompt (the needle's depth moves the key, not the haystack text, so one line covers every depth). A model
trained on the noise haystack alone never saw a number there; this lists the prompts where it meets some.

With ``--checkpoint``, the model answers each key's prompts at five depths twice: on the haystack as it
is, and on the same haystack with every number taken out of its sentences (the key and the rest of the
text unchanged). Right answers on the second and not the first mean the haystack's numbers cause the misses.
"""

from __future__ import annotations

import argparse
import re

import torch

from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.args import int_list, str_list
from titans.evaluation.haystack import HaystackSource, get_haystack
from titans.evaluation.niah import make_niah_sample, niah_grid
from titans.evaluation.recipe import load_task_model
from titans.evaluation.runner import evaluate
from titans.evaluation.scoring import exact_match

NUMBER = re.compile(r"\d{3,}")
ANY_NUMBER = re.compile(r"\s*\d[\d,.]*")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def digits_per_1000(name: str) -> float:
    text = " ".join(get_haystack(name).sentences)
    return 1000.0 * sum(c.isdigit() for c in text) / len(text)


def key_samples(tokenizer, name: str, args: argparse.Namespace) -> list:
    """One prompt per key of ``titans eval niah``'s grid (its seed: the key and haystack at all depths)."""
    return niah_grid(
        tokenizer, args.lengths, [0.5], kind="passkey", haystack=name,
        samples_per_cell=args.samples, seed=args.seed,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--haystacks", type=str_list, default=["noise", "essays", "moby_dick"])
    p.add_argument("--lengths", type=int_list, default=[1024, 4096, 16384])
    p.add_argument("--samples", type=int, default=2, help="keys per length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", help="a pass-key model: its answers with and without the numbers")
    args = p.parse_args()
    if args.checkpoint:
        return compare_without_numbers(args)

    print("| haystack | digits per 1,000 characters |\n|---|---:|")
    for name in args.haystacks:
        print(f"| {name} | {digits_per_1000(name):.2f} |")

    tokenizer = ByteTokenizer()
    print("\n| haystack | length | key | other numbers in the prompt |\n|---|---:|---|---|")
    for name in args.haystacks:
        for s in key_samples(tokenizer, name, args):
            others = [n for n in NUMBER.findall(tokenizer.decode(s.prompt_ids)) if n != s.answer]
            shown = ", ".join(others[:8]) + (f", ... ({len(others)})" if len(others) > 8 else "")
            print(f"| {name} | {s.length} | {s.answer} | {shown or 'none'} |")


def without_numbers(source: HaystackSource) -> HaystackSource:
    """The same sentences with every number (and the space before it) taken out."""
    sentences = tuple(ANY_NUMBER.sub("", s).strip() or "." for s in source.sentences)
    return HaystackSource(f"{source.name} without numbers", sentences, source.random_start)


def compare_without_numbers(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model, tokenizer, _ = load_task_model(args.checkpoint, "cpu")
    model.eval()
    print("| haystack | length | key | answers (5 depths) | without its numbers |\n|---|---:|---|---|---|")
    for name in args.haystacks:
        sources = (get_haystack(name), without_numbers(get_haystack(name)))  # once a haystack, not a key
        for key in key_samples(tokenizer, name, args):
            row = []
            for source in sources:
                samples = [
                    make_niah_sample(tokenizer, length=key.length, depth=d, haystack=source, seed=key.seed)
                    for d in DEPTHS
                ]
                answers = evaluate(model, tokenizer, samples, batch_size=len(DEPTHS)).predictions
                right = sum(map(exact_match, answers, [key.answer] * len(answers)))
                row.append(f"{right}/{len(DEPTHS)} ({', '.join(a.strip() for a in answers)})")
            print(f"| {name} | {key.length} | {key.answer} | {row[0]} | {row[1]} |", flush=True)


if __name__ == "__main__":
    main()
