"""How many numbers each haystack holds, and which pass-key prompts carry numbers besides their key.

    python benchmarks/diagnostics/haystack_numbers.py
    python benchmarks/diagnostics/haystack_numbers.py --lengths 1024,4096,16384 --samples 2 --seed 0

First, per built-in haystack: digits per 1,000 characters of its text. Then, for the pass-key prompts of
``titans eval niah`` with the same ``--lengths`` / ``--samples`` / ``--seed`` (the defaults are those of
``benchmarks/niah_seeds.py``), per haystack, length and key: the other runs of three or more digits in the
prompt (the needle's depth moves the key, not the haystack text, so one line covers every depth). A model
trained on the noise haystack alone never saw a number there; this lists the prompts where it meets some.
"""

from __future__ import annotations

import argparse
import re

from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.args import int_list, str_list
from titans.evaluation.haystack import HAYSTACK_NAMES, get_haystack
from titans.evaluation.niah import niah_grid

NUMBER = re.compile(r"\d{3,}")


def digits_per_1000(name: str) -> float:
    text = " ".join(get_haystack(name).sentences)
    return 1000.0 * sum(c.isdigit() for c in text) / len(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--haystacks", type=str_list, default=["noise", "essays", "moby_dick"])
    p.add_argument("--lengths", type=int_list, default=[1024, 4096, 16384])
    p.add_argument("--samples", type=int, default=2, help="keys per length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    print("| haystack | digits per 1,000 characters |\n|---|---:|")
    for name in HAYSTACK_NAMES:
        print(f"| {name} | {digits_per_1000(name):.2f} |")

    tokenizer = ByteTokenizer()
    print("\n| haystack | length | key | other numbers in the prompt |\n|---|---:|---|---|")
    for name in args.haystacks:
        samples = niah_grid(
            tokenizer, args.lengths, [0.5], kind="passkey", haystack=name,
            samples_per_cell=args.samples, seed=args.seed,
        )  # fmt: skip
        for s in samples:
            others = [n for n in NUMBER.findall(tokenizer.decode(s.prompt_ids)) if n != s.answer]
            shown = ", ".join(others[:8]) + (f", ... ({len(others)})" if len(others) > 8 else "")
            print(f"| {name} | {s.length} | {s.answer} | {shown or 'none'} |")


if __name__ == "__main__":
    main()
