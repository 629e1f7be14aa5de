"""`titans dna study | classify` (docs/domains.md). DNA language modelling on its own is
`titans train --data fasta:PATH --tokenizer dna` (bits per byte there are bits per base).

- ``study``: variants pre-trained at equal budget on a FASTA file (default: the built-in Drosophila sample),
  bits per base on held-out records, then fine-tuned on the proximal / distal task beside the same
  classifier trained from scratch, for each of ``--seeds``; ``dna.json`` (every seed's run and the mean
  and spread over the seeds, rewritten after each seed) and ``dna.png`` into ``--out``.
- ``classify``: labelled sequences (GenomicsBenchmarks from the hub, ``hf:NAME[:CONFIG][:SPLIT]``, or a CSV
  / JSONL with ``seq`` and ``label`` columns): optionally pre-train on a FASTA file, fine-tune, report test
  accuracy as JSON.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from titans._fs import lock_folder, write_text_atomic
from titans.data.dna import DNATokenizer, dm3_sample_path, load_labelled_sequences, read_fasta
from titans.dna.study import (
    DNABudget,
    accuracy,
    finetune,
    fresh_lm,
    plot_study,
    pretrain,
    run_study,
    study_data,
    summarise_seeds,
)
from titans.dna.tasks import ClassificationSet, encode_records
from titans.models.config import VARIANTS
from titans.runtime.device import set_cpu_threads
from titans.training.metrics import plot_or_skip
from titans.validation import check_distinct, did_you_mean, path_arg, seed_arg, seed_list


def _budget(args) -> DNABudget:
    given = {f.name: getattr(args, f.name) for f in fields(DNABudget)}
    if given["seed"] is None:  # --seed defaults to None to tell it from a given one (study: not with --seeds)
        del given["seed"]
    return DNABudget(**given)


def _fasta(spec: str) -> Path:
    return dm3_sample_path() if spec == "builtin" else Path(spec)


def _finished_runs(
    path: Path, budget: DNABudget, fasta: str, variants: list[str], scratch: bool, summary: dict
) -> dict:
    """seed -> run of an earlier ``dna.json`` at ``path`` made with the same data, variants and budget but
    the seed (and with classifiers from scratch when ``scratch``), and with the same split counts and
    reference baselines as ``summary`` (``StudyData.summary`` of this version: a run from a version that
    split or scored otherwise is not kept); {} when there is none."""
    if not path.is_file():
        return {}
    same = {k: v for k, v in asdict(budget).items() if k != "seed"}
    summary = json.loads(json.dumps(summary))  # as read back from JSON: lists, not tuples
    kept = {}
    try:
        doc = json.loads(path.read_text())
        for run in doc.get("runs", []):
            rows = run.get("variants", {})
            if (
                doc.get("fasta") == fasta
                and list(rows) == variants
                and {k: v for k, v in run["budget"].items() if k != "seed"} == same
                and all(("scratch" in row) == scratch for row in rows.values())
                and all(run.get(k) == v for k, v in summary.items())
            ):
                kept[run["budget"]["seed"]] = run
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:  # damaged, or not a study's
        raise ValueError(
            f"--resume: {str(path)!r} is not a readable dna study JSON ({type(e).__name__}: {e}); move it "
            "away to start the study again"
        ) from None
    return kept


def cmd_study(args) -> int:
    set_cpu_threads(args.threads)
    _budget(args)  # a bad budget option is refused before the baselines run
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants:  # ran no model and wrote an empty study over any earlier one
        raise ValueError(f"--variants: expected at least one variant, got {args.variants!r}")
    check_distinct("--variants", variants)  # one row per variant: a repeat trained twice, kept once
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(
            f"unknown variant(s) {bad}; expected from {', '.join(VARIANTS)}" + did_you_mean(bad[0], VARIANTS)
        )
    if args.seeds is not None and args.seed is not None:  # --seed had been dropped without a word
        raise ValueError("give --seed or --seeds, not both")
    seeds = [_budget(args).seed] if args.seeds is None else args.seeds
    records = read_fasta(_fasta(args.fasta))
    builtin = f"builtin (titans/data/genomes/{dm3_sample_path().name})"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # one study writes a folder: a second into it ran too, and the last to finish kept only its seeds
    in_use = f"--out {str(out)!r} is in use: another dna study writes it; wait for it, or give another --out"
    with lock_folder(out, in_use):
        return _study(args, out, records, variants, seeds, builtin)


def _study(args, out: Path, records, variants: list[str], seeds: list[int], builtin: str) -> int:
    fasta = builtin if args.fasta == "builtin" else args.fasta
    data = study_data(records, _budget(args))  # the split and references: the same for every seed
    done = (
        _finished_runs(out / "dna.json", _budget(args), fasta, variants, not args.no_scratch, data.summary)
        if args.resume
        else {}
    )
    # finished seeds not asked for again stay too, first (dna.json is rewritten after each seed: a stop
    # part-way keeps them): `--resume --seeds 2,3` extends a study of 0 and 1 (it rewrote dna.json with 2
    # and 3 alone, losing the finished seeds)
    seeds = [*sorted(s for s in done if s not in seeds), *seeds]
    runs: list[dict] = []
    for seed in seeds:
        if seed in done:
            print(f"seed {seed}: kept from {out / 'dna.json'} (--resume)", flush=True)
            runs.append(done[seed])
        else:
            budget = _budget(args)
            budget.seed = seed
            runs.append(
                run_study(
                    records,
                    variants,
                    budget,
                    progress=not args.no_progress,
                    log=lambda m, seed=seed: print(f"seed {seed}: {m}", flush=True),
                    scratch=not args.no_scratch,
                    data=data,
                )
            )
        doc = {
            "command": shlex.join(["titans", *getattr(args, "argv", sys.argv[1:])]),
            "fasta": fasta,
            "seeds": seeds[: len(runs)],
            "summary": summarise_seeds(runs),
            "runs": runs,
        }
        write_text_atomic(out / "dna.json", json.dumps(doc, indent=2) + "\n")  # after each seed
    drawn = plot_or_skip(lambda: plot_study(doc, out / "dna.png"), out / "dna.png")
    print(study_table(doc))
    print(f"wrote {out / 'dna.json'}" + (f" and {out / 'dna.png'}" if drawn else ""))
    return 0


def study_table(doc: dict) -> str:
    """The study's numbers as a table: one row per variant (mean +- standard deviation over the seeds),
    then the reference baselines (of the first seed's split: the same for every seed)."""
    rows = [("model", "test bits/base", "test accuracy", "from scratch", "parameters")]

    def cell(row: dict, key: str) -> str:
        if key not in row:
            return "-"
        m = row[key]
        return f"{m['mean']:.4f}" + (f" +- {m['std']:.4f}" if row["seeds"] > 1 else "")

    for name, row in doc["summary"].items():
        rows.append(
            (
                name,
                cell(row, "test_bits_per_base"),
                cell(row, "test_accuracy"),
                cell(row, "scratch_test_accuracy"),
                f"{row['parameters']:,}",
            )
        )
    ref = doc["runs"][0]["reference"]
    for k in (0, 2, 5):
        rows.append((f"order-{k} Markov", f"{ref[f'markov{k}_bits_per_base']:.4f}", "", "", ""))
    rows.append(("GC threshold", "", f"{ref['gc_threshold_accuracy']:.4f}", "", ""))
    rows.append(("majority class", "", f"{ref['majority_accuracy']:.4f}", "", ""))
    width = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))).rstrip()
        for r in rows
    )


def _labelled(spec: str, length: int | None) -> tuple[ClassificationSet, int]:
    """The labelled sequences of ``spec`` at one length (``length``, or the longest sequence's): a shorter
    sequence left-padded with N, a longer one cut to its last ``length`` bases; (the set, how many were
    cut)."""
    pairs = load_labelled_sequences(spec)
    if not pairs:
        raise ValueError(f"labelled sequences {spec!r}: no rows")
    if length is not None and length < 1:
        raise ValueError(f"--length must be >= 1, got {length}")
    tok = DNATokenizer()
    n = length if length is not None else max(len(s) for s, _ in pairs)
    # left-pad with N to a common length (shorter sequences) and keep the last n bases (longer ones)
    x = np.stack(
        [np.asarray(tok.encode(("N" * max(0, n - len(s)) + s)[-n:]), dtype=np.int64) for s, _ in pairs]
    )
    cut = sum(len(s) > n for s, _ in pairs)
    return ClassificationSet(x, np.asarray([label for _, label in pairs], dtype=np.int64)), cut


def cmd_classify(args) -> int:
    set_cpu_threads(args.threads)
    budget = _budget(args)
    train, train_cut = _labelled(args.train, args.length)
    length = train.x.shape[1]
    test, test_cut = _labelled(args.test, length)
    source = "--length" if args.length is not None else "the longest --train sequence"
    for option, cut, total in (("--train", train_cut, len(train.y)), ("--test", test_cut, len(test.y))):
        if cut:
            print(
                f"warning: {cut} of the {total} {option} sequences are longer than {length} bases "
                f"({source}) and were cut to their last {length} bases",
                file=sys.stderr,
            )
    classes = np.unique(train.y)
    if len(classes) < 2:
        raise ValueError(
            f"--train {args.train!r}: every row has the same label; classifying needs two classes"
        )
    unseen = sorted(set(test.y.tolist()) - set(train.y.tolist()))
    if unseen:
        raise ValueError(
            f"--test {args.test!r}: label(s) {unseen} never occur in --train, so can never be predicted"
        )
    # one output per class that occurs in training, whatever its id: labels {0, 10**9} are two outputs (the
    # head had one per id up to the largest, a billion)
    train = ClassificationSet(train.x, np.searchsorted(classes, train.y))
    test = ClassificationSet(test.x, np.searchsorted(classes, test.y))
    if args.pretrain_fasta:
        lm, _ = pretrain(
            args.variant,
            encode_records(read_fasta(_fasta(args.pretrain_fasta))),
            budget,
            progress=not args.no_progress,
        )
    else:
        lm = fresh_lm(args.variant, budget)
    clf, _ = finetune(lm, train, budget, progress=not args.no_progress)
    print(
        json.dumps(
            {
                "variant": args.variant,
                "train": len(train.y),
                "test": len(test.y),
                "classes": classes.tolist(),
                "length": length,
                "train_cut": train_cut,
                "test_cut": test_cut,
                "test_accuracy": accuracy(clf, test),
            },
            indent=2,
        )
    )
    return 0


def _budget_options(p, converges: bool) -> None:
    """The budget's options; `converges`: the command has `_convergence_options` (--patience, ...)."""
    d = DNABudget()
    p.add_argument(
        "--pretrain-steps", dest="pretrain_steps", type=int, default=d.pretrain_steps, help="LM steps"
    )
    p.add_argument(
        "--finetune-steps",
        "--max-finetune-steps",
        dest="finetune_steps",
        type=int,
        default=d.finetune_steps,
        help="classifier steps (at most, with --patience / --time-budget)"
        if converges
        else "classifier steps",
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
    p.add_argument("--seed", type=seed_arg, default=None, help=f"seed (default: {d.seed})")
    p.add_argument(
        "--eval-windows",
        dest="eval_windows",
        type=int,
        default=d.eval_windows,
        help="held-out LM windows measured (study)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


def _convergence_options(p) -> None:
    d = DNABudget()
    p.add_argument(
        "--val-every",
        dest="val_every",
        type=int,
        default=d.val_every,
        help="classifier training: validate every this many steps (the best weights are restored)",
    )
    p.add_argument(
        "--patience",
        type=int,
        default=d.patience,
        help="classifier training: stop after this many validations without improvement (default: never)",
    )
    p.add_argument(
        "--time-budget",
        dest="time_budget",
        type=float,
        default=d.time_budget,
        help="classifier training: wall seconds per model, validation included, at most (default: none)",
    )


def register(commands, evals) -> None:
    dna = commands.add_parser("dna", help="DNA: LM pre-training + classification study, classification")
    sub = dna.add_subparsers(dest="dna_command", metavar="SUBCOMMAND")
    sub.required = True
    p = sub.add_parser("study", help="variants side by side: bits per base and proximal/distal accuracy")
    p.add_argument(
        "--fasta", default="builtin", help="FASTA file (plain or .gz), or builtin (Drosophila sample)"
    )
    p.add_argument("--variants", default="lmm,transformer,swa", help="comma-separated model variants")
    p.add_argument("--out", type=path_arg, default="results/dna", help="output folder")
    p.add_argument(
        "--seeds", type=seed_list, default=None, help="comma-separated seeds, one run each (default: --seed)"
    )
    p.add_argument(
        "--no-scratch",
        action="store_true",
        help="no classifiers trained from scratch",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the seeds of --out's dna.json made with the same data, variants and budget (and the "
        "same split counts and reference baselines)",
    )
    _budget_options(p, converges=True)
    _convergence_options(p)
    p.set_defaults(func=cmd_study)
    p = sub.add_parser("classify", help="fine-tune on labelled sequences (GenomicsBenchmarks format)")
    p.add_argument("--train", required=True, help="hf:NAME[:CONFIG][:SPLIT], or a CSV / JSONL (seq, label)")
    p.add_argument("--test", required=True, help="the test sequences, same forms")
    p.add_argument("--variant", default="lmm", choices=VARIANTS, help="model variant")
    p.add_argument(
        "--length", type=int, default=None, help="sequence length (default: the longest train one)"
    )
    p.add_argument("--pretrain-fasta", default=None, help="pre-train the LM on this FASTA first (or builtin)")
    _budget_options(p, converges=False)
    p.set_defaults(func=cmd_classify, val_every=DNABudget.val_every, patience=None, time_budget=None)


__all__ = ["register"]
