"""`titans dna study | classify` (docs/domains.md). DNA language modelling on its own is
`titans train --data fasta:PATH --tokenizer dna` (bits per byte there are bits per base).

- ``study``: variants pre-trained at equal budget on a FASTA file (default: the built-in Drosophila sample),
  bits per base on held-out records, then fine-tuned on the proximal / distal task; ``dna.json`` and
  ``dna.png`` into ``--out``.
- ``classify``: labelled sequences (GenomicsBenchmarks from the hub, ``hf:NAME[:CONFIG][:SPLIT]``, or a CSV
  / JSONL with ``seq`` and ``label`` columns): optionally pre-train on a FASTA file, fine-tune, report test
  accuracy as JSON.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from titans.data.dna import DNATokenizer, dm3_sample_path, load_labelled_sequences, read_fasta
from titans.dna.model import dna_config
from titans.dna.study import DNABudget, accuracy, finetune, plot_study, pretrain, run_study
from titans.dna.tasks import ClassificationSet, encode_records
from titans.models.config import VARIANTS
from titans.models.lm import TitansLM
from titans.validation import did_you_mean


def _budget(args) -> DNABudget:
    return DNABudget(**{f.name: getattr(args, f.name) for f in fields(DNABudget)})


def _fasta(spec: str) -> Path:
    return dm3_sample_path() if spec == "builtin" else Path(spec)


def cmd_study(args) -> int:
    torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(
            f"unknown variant(s) {bad}; expected from {', '.join(VARIANTS)}" + did_you_mean(bad[0], VARIANTS)
        )
    records = read_fasta(_fasta(args.fasta))
    result = run_study(
        records, variants, _budget(args), progress=not args.no_progress, log=lambda m: print(m, flush=True)
    )
    builtin = f"builtin (titans/data/genomes/{dm3_sample_path().name})"
    fasta = builtin if args.fasta == "builtin" else args.fasta
    result = {"command": "titans " + " ".join(sys.argv[1:]), "fasta": fasta, **result}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dna.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_study(result, out / "dna.png")
    print(study_table(result))
    print(f"wrote {out / 'dna.json'} and {out / 'dna.png'}")
    return 0


def study_table(result: dict) -> str:
    """The study's numbers as a table: one row per variant, then the reference baselines."""
    rows = [("model", "test bits/base", "test accuracy", "parameters")]
    for name, row in result["variants"].items():
        bits, acc = f"{row['test_bits_per_base']:.4f}", f"{row['test_accuracy']:.4f}"
        rows.append((name, bits, acc, f"{row['parameters']:,}"))
    ref = result["reference"]
    for k in (0, 2, 5):
        rows.append((f"order-{k} Markov", f"{ref[f'markov{k}_bits_per_base']:.4f}", "", ""))
    rows.append(("GC threshold", "", f"{ref['gc_threshold_accuracy']:.4f}", ""))
    rows.append(("majority class", "", f"{ref['majority_accuracy']:.4f}", ""))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))).rstrip()
        for r in rows
    )


def _labelled(spec: str, length: int | None) -> ClassificationSet:
    pairs = load_labelled_sequences(spec)
    if not pairs:
        raise ValueError(f"labelled sequences {spec!r}: no rows")
    tok = DNATokenizer()
    n = length or max(len(s) for s, _ in pairs)
    # left-pad with N to a common length (shorter sequences) and keep the last n bases (longer ones)
    x = np.stack(
        [np.asarray(tok.encode(("N" * max(0, n - len(s)) + s)[-n:]), dtype=np.int64) for s, _ in pairs]
    )
    return ClassificationSet(x, np.asarray([label for _, label in pairs], dtype=np.int64))


def cmd_classify(args) -> int:
    torch.set_num_threads(args.threads)
    budget = _budget(args)
    train = _labelled(args.train, args.length)
    test = _labelled(args.test, train.x.shape[1])
    if args.pretrain_fasta:
        lm, _ = pretrain(
            args.variant,
            encode_records(read_fasta(_fasta(args.pretrain_fasta))),
            budget,
            progress=not args.no_progress,
        )
    else:
        torch.manual_seed(budget.seed)
        lm = TitansLM(dna_config(args.variant, budget.dim, budget.depth, budget.heads, budget.window))
    clf = finetune(lm, train, budget, progress=not args.no_progress)
    print(
        json.dumps(
            {
                "variant": args.variant,
                "train": len(train.y),
                "test": len(test.y),
                "test_accuracy": accuracy(clf, test),
            },
            indent=2,
        )
    )
    return 0


def _budget_options(p) -> None:
    d = DNABudget()
    p.add_argument(
        "--pretrain-steps", dest="pretrain_steps", type=int, default=d.pretrain_steps, help="LM steps"
    )
    p.add_argument(
        "--finetune-steps", dest="finetune_steps", type=int, default=d.finetune_steps, help="classifier steps"
    )
    p.add_argument(
        "--batch-size", dest="batch_size", type=int, default=d.batch_size, help="sequences per step"
    )
    p.add_argument("--seq-len", dest="seq_len", type=int, default=d.seq_len, help="LM window length")
    p.add_argument(
        "--window-len",
        dest="window_len",
        type=int,
        default=d.window_len,
        help="proximal / distal window length (study)",
    )
    p.add_argument("--lr", type=float, default=d.lr, help="pre-training learning rate")
    p.add_argument(
        "--finetune-lr", dest="finetune_lr", type=float, default=d.finetune_lr, help="fine-tuning lr"
    )
    p.add_argument("--dim", type=int, default=d.dim, help="model width")
    p.add_argument("--depth", type=int, default=d.depth, help="blocks")
    p.add_argument("--heads", type=int, default=d.heads, help="attention / memory heads")
    p.add_argument("--window", type=int, default=d.window, help="sliding window (swa, mag, mal; mac segment)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed")
    p.add_argument(
        "--eval-windows",
        dest="eval_windows",
        type=int,
        default=d.eval_windows,
        help="held-out LM windows measured (study)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


def register(commands, evals) -> None:
    dna = commands.add_parser("dna", help="DNA: LM pre-training + classification study, classification")
    sub = dna.add_subparsers(dest="dna_command", metavar="SUBCOMMAND")
    sub.required = True
    p = sub.add_parser("study", help="variants side by side: bits per base and proximal/distal accuracy")
    p.add_argument(
        "--fasta", default="builtin", help="FASTA file (plain or .gz), or builtin (Drosophila sample)"
    )
    p.add_argument("--variants", default="lmm,transformer,swa", help="comma-separated model variants")
    p.add_argument("--out", default="results/dna", help="output folder")
    _budget_options(p)
    p.set_defaults(func=cmd_study)
    p = sub.add_parser("classify", help="fine-tune on labelled sequences (GenomicsBenchmarks format)")
    p.add_argument("--train", required=True, help="hf:NAME[:CONFIG][:SPLIT], or a CSV / JSONL (seq, label)")
    p.add_argument("--test", required=True, help="the test sequences, same forms")
    p.add_argument("--variant", default="lmm", choices=VARIANTS, help="model variant")
    p.add_argument(
        "--length", type=int, default=None, help="sequence length (default: the longest train one)"
    )
    p.add_argument("--pretrain-fasta", default=None, help="pre-train the LM on this FASTA first (or builtin)")
    _budget_options(p)
    p.set_defaults(func=cmd_classify)


__all__ = ["register"]
