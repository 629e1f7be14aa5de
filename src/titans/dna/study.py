"""DNA study: pre-train nucleotide LMs of several variants at equal budget, measure bits per base on held-out
records, then fine-tune each as a classifier (``SequenceClassifier``) on the proximal / distal task and
measure test accuracy (``titans.dna.tasks``); beside each, the same classifier trained from scratch (no
pre-training) under the same rules. Order-k Markov chains and a GC-content threshold are the reference
points that need no network.

Records are split three ways (``split_study_records``): every fifth record is a test record; of the rest,
every eighth is a validation record, held out of pre-training and fine-tuning alike, whose proximal /
distal windows decide early stopping. A val or test record identical to a record of an earlier split
(train, then val) is dropped, and a proximal / distal window identical to one of an earlier split is left
out of the later one (``titans.dna.tasks``), so no val or test sequence was seen in training; the numbers
dropped are in the results (``dropped``). Records too short for the proximal / distal pair are left out
of the task only. Both trainings run on the package's training loop (``titans.training.loop.TrainLoop``):
AdamW without weight decay, the gradient norm clipped to 1, a NaN or inf loss stopped with an error naming
the step. Classifier training follows the convergence rules of forecasting
(``titans.training.early_stopping``): the validation cross-entropy every ``val_every`` steps, early stopping
after ``patience`` checks without improvement, ``finetune_steps`` and ``time_budget`` seconds at most, the
best weights restored.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from titans.data.dna import FastaRecord
from titans.dna.model import SequenceClassifier, dna_config, lm_bits_per_base
from titans.dna.tasks import (
    ClassificationSet,
    drop_repeated_records,
    encode_records,
    markov_bits_per_base,
    proximal_distal_splits,
    sample_lm_batch,
    spaced_windows,
    split_records,
)
from titans.models.lm import TitansLM
from titans.training.early_stopping import EarlyStopping
from titans.training.loop import TrainLoop
from titans.training.metrics import save_plot
from titans.validation import check_int

VAL_EVERY_RECORD = 8  # of the training records, every eighth is a validation record


@dataclass
class DNABudget:
    """The budget every variant gets: pre-training and fine-tuning steps, batch, lengths, sizes."""

    pretrain_steps: int = 150
    finetune_steps: int = 80
    batch_size: int = 16
    seq_len: int = 256
    window_len: int = 250
    lr: float = 1e-3
    finetune_lr: float = 5e-4
    dim: int = 64
    depth: int = 2
    heads: int = 4
    window: int = 64
    seed: int = 0
    eval_windows: int = 256  # held-out LM windows measured (evenly spaced over the test records)
    val_every: int = 20  # classifier training: validation every this many steps (with a validation set)
    patience: int | None = None  # classifier training: early stopping after this many checks (None: never)
    time_budget: float | None = None  # classifier training: wall seconds at most (None: no limit)

    def __post_init__(self) -> None:
        # seq_len: a window predicts its tokens after the first, so it needs two
        counts = ("pretrain_steps", "finetune_steps", "batch_size", "window_len", "dim", "depth", "heads")
        for name in (*counts, "window", "eval_windows", "val_every"):
            check_int(f"DNABudget.{name}", getattr(self, name))
        check_int("DNABudget.seq_len", self.seq_len, 2)
        check_int("DNABudget.patience", self.patience, none_ok=True)
        for name in ("lr", "finetune_lr"):
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"DNABudget.{name} must be a positive number, got {getattr(self, name)!r}")
        if self.time_budget is not None and not 0 < self.time_budget < math.inf:  # inf: not strict JSON
            raise ValueError(
                f"DNABudget.time_budget must be finite seconds > 0 or None, got {self.time_budget!r}"
            )


def pretrain(
    variant: str,
    train: list[np.ndarray],
    budget: DNABudget,
    progress: bool = False,
    *,
    handle_signals: bool = False,
) -> tuple[TitansLM, list[float]]:
    """A nucleotide LM trained for ``budget.pretrain_steps`` steps of random windows; (model, per-step
    training bits per base). ``handle_signals``: a SIGTERM / SIGINT stops it after the current step (fewer
    losses); without it a signal has its usual effect (KeyboardInterrupt)."""
    lm = fresh_lm(variant, budget)
    rng = np.random.default_rng(budget.seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=budget.lr, weight_decay=0.0)
    losses: list[float] = []

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        logits, _ = model(x[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    TrainLoop(
        lm,
        opt,
        total_steps=budget.pretrain_steps,
        batches=lambda step: torch.from_numpy(sample_lm_batch(train, budget.seq_len, budget.batch_size, rng)),
        loss_fn=loss_fn,
        grad_clip=1.0,
        on_step=lambda step, loss, grad_norm, aux: losses.append(loss.item() / math.log(2)),
        handle_signals=handle_signals,
        progress=progress,
        progress_desc=f"pretrain {variant}",
        progress_leave=False,
        failure_hint=lambda: f"pre-training {variant} (try a lower lr)",
    ).run()
    return lm, losses


@torch.no_grad()
def accuracy(model: nn.Module, data: ClassificationSet, batch_size: int = 64) -> float:
    model.eval()
    right = 0
    for i in range(0, len(data.y), batch_size):
        pred = model(torch.from_numpy(data.x[i : i + batch_size])).argmax(-1).numpy()
        right += int((pred == data.y[i : i + batch_size]).sum())
    return right / len(data.y)


@torch.no_grad()
def mean_loss(model: nn.Module, data: ClassificationSet, batch_size: int = 64) -> float:
    """Mean cross-entropy of ``model`` over ``data``."""
    model.eval()
    total = 0.0
    for i in range(0, len(data.y), batch_size):
        logits = model(torch.from_numpy(data.x[i : i + batch_size]))
        y = torch.from_numpy(data.y[i : i + batch_size])
        total += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
    return total / len(data.y)


def finetune(
    lm: TitansLM,
    train: ClassificationSet,
    budget: DNABudget,
    progress: bool = False,
    *,
    val: ClassificationSet | None = None,
    handle_signals: bool = False,
) -> tuple[SequenceClassifier, dict]:
    """All of ``lm`` plus a new pooled head, trained on ``train`` for at most ``budget.finetune_steps``
    steps; with ``val``, under the convergence rules (module docstring: the best weights by validation
    loss are returned). ``handle_signals``: a SIGTERM / SIGINT stops it after the current step.
    Returns (classifier, record: best_step, best_seconds, steps_done, stopped_by, val_loss, ...)."""
    if val is None and (budget.patience is not None or budget.time_budget is not None):
        raise ValueError("finetune: patience and time_budget need a validation set (val)")
    torch.manual_seed(budget.seed)
    rng = np.random.default_rng(budget.seed + 1)
    clf = SequenceClassifier(lm, num_classes=int(train.y.max()) + 1)
    opt = torch.optim.AdamW(clf.parameters(), lr=budget.finetune_lr, weight_decay=0.0)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = rng.integers(0, len(train.y), budget.batch_size)
        return torch.from_numpy(train.x[idx]), torch.from_numpy(train.y[idx])

    stopper = EarlyStopping(clf, lambda: mean_loss(clf, val), budget.patience) if val is not None else None
    if stopper is not None:
        stopper.check(0)
    loop = TrainLoop(
        clf,
        opt,
        total_steps=budget.finetune_steps,
        batches=batch,
        loss_fn=lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1]),
        grad_clip=1.0,
        eval_every=budget.val_every if stopper is not None else None,
        evaluate=stopper.check if stopper is not None else None,
        time_budget_s=budget.time_budget,
        handle_signals=handle_signals,
        progress=progress,
        progress_desc=f"finetune {lm.config.variant}",
        progress_leave=False,
        failure_hint=lambda: f"fine-tuning {lm.config.variant} (try a lower finetune_lr)",
    )
    t0 = time.perf_counter()
    if stopper is None:
        done = loop.run()
        return clf, {"steps_done": done.step, "train_seconds": time.perf_counter() - t0}
    stopper.loop = loop
    done = loop.run()
    stopped_by = stopper.finish(done)
    record = {
        "best_step": stopper.best_step,
        "best_seconds": stopper.best_seconds,
        "steps_done": done.step,
        "improving_at_end": stopper.best_step == done.step,
        "val_loss": stopper.best,
        "val_accuracy": accuracy(clf, val),
        "train_seconds": stopper.train_seconds,
        "val_curve": stopper.history,
    }
    if stopped_by is not None:
        record["stopped_by"] = stopped_by
    return clf, record


def fresh_lm(variant: str, budget: DNABudget) -> TitansLM:
    """An untrained nucleotide LM of ``variant`` at ``budget``'s size (the from-scratch classifier's
    backbone), seeded as pre-training seeds its own."""
    torch.manual_seed(budget.seed)
    return TitansLM(dna_config(variant, budget.dim, budget.depth, budget.heads, budget.window))


def gc_threshold_accuracy(train: ClassificationSet, test: ClassificationSet) -> float:
    """Accuracy of the best single GC-fraction threshold (and direction) on train, applied to test."""

    def gc(x: np.ndarray) -> np.ndarray:
        return np.isin(x, (4, 5)).mean(axis=1)  # C and G ids

    g, y = gc(train.x), train.y
    best = (0.0, 0.5, 1)
    for t in np.unique(g):
        for sign in (1, -1):
            acc = float(((sign * (g - t) > 0) == (y == 1)).mean())
            if acc > best[0]:
                best = (acc, float(t), sign)
    _, t, sign = best
    return float(((sign * (gc(test.x) - t) > 0) == (test.y == 1)).mean())


def min_study_records() -> int:
    """The fewest records whose split (``split_study_records``) leaves no part empty."""
    n = 1
    while True:
        train, test = split_records(list(range(n)))
        train, val = split_records(train, VAL_EVERY_RECORD)
        if train and val and test:
            return n
        n += 1


def split_study_records(
    records: list[FastaRecord],
) -> tuple[list[FastaRecord], list[FastaRecord], list[FastaRecord], dict[str, int]]:
    """(train, val, test, dropped): every fifth record a test record, every eighth of the rest a validation
    record; a val record identical to a train record and a test record identical to a train or val record
    are dropped (``dropped``: how many of each). Refuses, naming the counts, a split left empty."""
    least = min_study_records()
    if len(records) < least:
        raise ValueError(
            f"the DNA study needs at least {least} FASTA records (every 5th is a test record, every "
            f"{VAL_EVERY_RECORD}th of the rest a validation record), got {len(records)}"
        )
    train, test = split_records(records)
    train, val = split_records(train, VAL_EVERY_RECORD)
    val, val_dropped = drop_repeated_records(val, train)
    test, test_dropped = drop_repeated_records(test, train, val)
    for name, kept, dropped in (("val", val, val_dropped), ("test", test, test_dropped)):
        if not kept:
            raise ValueError(
                f"the DNA study has no {name} record left: all {dropped} are identical to records of an "
                f"earlier split ({len(records)} records in all)"
            )
    return train, val, test, {"val": val_dropped, "test": test_dropped}


@dataclass
class StudyData:
    """What every seed of a study at one budget shares: the split, the LM's training sequences and test
    windows, the proximal / distal sets, and ``summary``: the counts and reference baselines, as they
    appear in each seed's results (a resumed study keeps a seed only where they are the same)."""

    train_seqs: list[np.ndarray]
    test_windows: np.ndarray
    tasks: tuple[ClassificationSet, ClassificationSet, ClassificationSet]  # train, val, test
    summary: dict
    left_out: dict[str, list[int]]


def study_data(records: list[FastaRecord], budget: DNABudget) -> StudyData:
    """The split and the reference baselines of ``records`` at ``budget`` (no training; seconds)."""
    train_recs, val_recs, test_recs, dropped = split_study_records(records)
    train_seqs, test_seqs = encode_records(train_recs), encode_records(test_recs)
    # the language models and the Markov reference are scored on the same evenly spaced test windows
    test_windows = spaced_windows(test_seqs, budget.seq_len, budget.eval_windows)
    (cls_train, cls_val, cls_test), left_out = proximal_distal_splits(
        [train_recs, val_recs, test_recs], budget.window_len
    )
    for i, (name, recs, task) in enumerate(
        (("train", train_recs, cls_train), ("val", val_recs, cls_val), ("test", test_recs, cls_test))
    ):
        if not len(task.y):
            raise ValueError(
                f"the proximal / distal task has no {name} window: {left_out['short_records'][i]} of the "
                f"{len(recs)} {name} records are shorter than 2 x window_len={budget.window_len} bases, "
                f"{left_out['seen_in_earlier_split'][i]} windows repeat an earlier split's"
            )
    summary = {
        "records": {"train": len(train_recs), "val": len(val_recs), "test": len(test_recs)},
        "dropped": {
            "records_identical_to_an_earlier_split": dropped,
            "task_windows_identical_to_an_earlier_split": dict(
                zip(("val", "test"), left_out["seen_in_earlier_split"][1:])
            ),
            "task_windows_repeated_within_the_split": dict(
                zip(("train", "val", "test"), left_out["repeated_in_split"])
            ),
            "records_too_short_for_the_task": dict(zip(("train", "val", "test"), left_out["short_records"])),
        },
        "lm_test_windows": int(len(test_windows)),
        "classification": {
            "train": int(len(cls_train.y)),
            "val": int(len(cls_val.y)),
            "test": int(len(cls_test.y)),
            "test_positive_fraction": float(cls_test.y.mean()),
        },
        "reference": {
            **{
                f"markov{k}_bits_per_base": markov_bits_per_base(train_seqs, test_windows, k)
                for k in (0, 2, 5)
            },
            "gc_threshold_accuracy": gc_threshold_accuracy(cls_train, cls_test),
            "majority_accuracy": float(max(cls_test.y.mean(), 1 - cls_test.y.mean())),
        },
    }
    return StudyData(train_seqs, test_windows, (cls_train, cls_val, cls_test), summary, left_out)


def run_study(
    records: list[FastaRecord],
    variants: list[str],
    budget: DNABudget,
    progress: bool = False,
    log=print,
    *,
    scratch: bool = True,
    data: StudyData | None = None,
) -> dict:
    """Every variant pre-trained and fine-tuned at ``budget`` and (``scratch``) trained from scratch as a
    classifier under the same rules; the JSON-ready results. ``data``: ``study_data(records, budget)``,
    when the caller has it already."""
    data = study_data(records, budget) if data is None else data
    train_seqs, test_windows, left_out = data.train_seqs, data.test_windows, data.left_out
    cls_train, cls_val, cls_test = data.tasks
    out: dict = {"budget": asdict(budget), **data.summary, "variants": {}}
    dropped = out["dropped"]["records_identical_to_an_earlier_split"]
    short = sum(left_out["short_records"])
    val_seen, test_seen = left_out["seen_in_earlier_split"][1:]
    if dropped["val"] or dropped["test"] or val_seen or test_seen or short:
        log(
            f"dropped: {dropped['val']} val and {dropped['test']} test records identical to records of an "
            f"earlier split; {val_seen} val and {test_seen} test proximal / distal windows identical to an "
            f"earlier split's; {short} records shorter than 2 x window_len={budget.window_len} left out of "
            "the proximal / distal task (kept for the language model)"
        )
    log("reference: " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in out["reference"].items()))
    for variant in variants:
        t0 = time.perf_counter()
        lm, losses = pretrain(variant, train_seqs, budget, progress)
        bpb = lm_bits_per_base(lm, test_windows)
        t1 = time.perf_counter()
        clf, tuned = finetune(lm, cls_train, budget, progress, val=cls_val)
        acc = accuracy(clf, cls_test)
        row = {
            "parameters": sum(p.numel() for p in lm.parameters()),
            "test_bits_per_base": bpb,
            "final_train_bits_per_base": float(np.mean(losses[-10:])),
            "train_curve_bits_per_base": [
                float(np.mean(losses[i : i + 10])) for i in range(0, len(losses), 10)
            ],
            "test_accuracy": acc,
            "pretrain_seconds": t1 - t0,
            "finetune_seconds": time.perf_counter() - t1,
            "finetune": tuned,
        }
        line = (
            f"{variant:12s} bits/base {bpb:.4f}  accuracy {acc:.4f} (best step {tuned.get('best_step')})  "
            f"({row['pretrain_seconds']:.0f}s + {row['finetune_seconds']:.0f}s)"
        )
        if scratch:
            clf, fresh = finetune(fresh_lm(variant, budget), cls_train, budget, progress, val=cls_val)
            row["scratch_test_accuracy"] = accuracy(clf, cls_test)
            row["scratch"] = fresh
            line += (
                f"; from scratch {row['scratch_test_accuracy']:.4f} (best step {fresh.get('best_step')}, "
                f"{fresh['train_seconds']:.0f}s)"
            )
        out["variants"][variant] = row
        log(line)
    return out


def summarise_seeds(runs: list[dict]) -> dict:
    """Per variant, over the seeds' ``run_study`` results: mean, sample standard deviation (``std``, 0 for
    one seed), standard error of the mean (``sem``) and the values of each measure."""
    summary: dict = {}
    for variant in runs[0]["variants"]:
        rows = [r["variants"][variant] for r in runs if variant in r["variants"]]
        summary[variant] = {"parameters": rows[0]["parameters"], "seeds": len(rows)}
        for key in ("test_bits_per_base", "test_accuracy", "scratch_test_accuracy"):
            values = [row[key] for row in rows if key in row]
            if values:
                std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
                summary[variant][key] = {
                    "mean": float(np.mean(values)),
                    "std": std,
                    "sem": std / math.sqrt(len(values)),
                    "values": values,
                }
    return summary


def plot_study(doc: dict, path) -> None:
    """Pre-training curves (bits per base) of the first seed and the test accuracy per variant (mean over
    the seeds, the bars one standard deviation), fine-tuned and from scratch, with the reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result, summary = doc["runs"][0], doc["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, row in result["variants"].items():
        curve = row["train_curve_bits_per_base"]
        a.plot(
            [10 * i + 5 for i in range(len(curve))],
            curve,
            label=f"{name} (test {row['test_bits_per_base']:.3f})",
        )
    ref = result["reference"]
    for k, style in ((0, ":"), (5, "--")):
        a.axhline(
            ref[f"markov{k}_bits_per_base"], color="grey", ls=style, lw=1, label=f"order-{k} Markov (test)"
        )
    a.set_xlabel("pre-training step")
    a.set_ylabel("train bits per base")
    a.legend(fontsize=7)
    names = list(summary)
    x = np.arange(len(names))
    for shift, key, label, color in (
        (-0.2, "test_accuracy", "pre-trained", "tab:blue"),
        (0.2, "scratch_test_accuracy", "from scratch", "tab:orange"),
    ):
        if all(key in summary[n] for n in names):
            b.bar(
                x + shift,
                [summary[n][key]["mean"] for n in names],
                0.4,
                yerr=[summary[n][key]["std"] for n in names],
                color=color,
                label=label,
            )
    b.set_xticks(x, names)
    b.axhline(ref["gc_threshold_accuracy"], color="grey", ls="--", lw=1, label="GC threshold")
    b.axhline(ref["majority_accuracy"], color="grey", ls=":", lw=1, label="majority")
    b.set_ylim(0.4, 1.0)
    b.set_xlabel("variant")
    b.set_ylabel("test accuracy (proximal vs distal)")
    b.legend(fontsize=7)
    save_plot(fig, path, dpi=90)
    plt.close(fig)


__all__ = [
    "VAL_EVERY_RECORD",
    "DNABudget",
    "StudyData",
    "accuracy",
    "finetune",
    "fresh_lm",
    "mean_loss",
    "gc_threshold_accuracy",
    "min_study_records",
    "plot_study",
    "pretrain",
    "run_study",
    "study_data",
    "split_study_records",
    "summarise_seeds",
]
