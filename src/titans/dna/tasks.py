"""DNA data for the study: a record-level train/test split, LM windows and a labelled classification task.

The classification task built from upstream-of-gene FASTA (such as the built-in Drosophila sample, every
record the 2,000 bases upstream of a transcription start, in the direction of transcription):

    label 1 "proximal": the last ``length`` bases of a record (just upstream of the transcription start:
        the core promoter region);
    label 0 "distal": the first ``length`` bases (1,750-2,000 bases upstream for length 250).

Labels come from the gene annotation, not from a model. They are noisy where genes lie close together
(a distal window can fall in a neighbouring gene's promoter). Records shorter than 2 x ``length`` have no
such pair and are left out of the task. Train/val/test are split by record, the same split as the language
model's; a val or test record identical to a record of an earlier split (train, then val) is dropped
(``drop_repeated_records``), and the task's windows are built in the order train, val, test with one set
of the windows kept so far, so a window with the sequence of an earlier one (transcripts that share a
start) is kept once, in the earliest split: no val or test sequence was seen in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from titans.data.dna import DNATokenizer, FastaRecord


def split_records(
    records: list[FastaRecord], test_every: int = 5
) -> tuple[list[FastaRecord], list[FastaRecord]]:
    """Every ``test_every``-th record (1-based: records 5, 10, ...) is a test record, the rest train."""
    if test_every < 2:
        raise ValueError(f"test_every must be >= 2, got {test_every}")
    test = [r for i, r in enumerate(records) if i % test_every == test_every - 1]
    train = [r for i, r in enumerate(records) if i % test_every != test_every - 1]
    return train, test


def drop_repeated_records(
    records: list[FastaRecord], *earlier: list[FastaRecord]
) -> tuple[list[FastaRecord], int]:
    """``records`` without those whose sequence is that of a record in one of the ``earlier`` lists;
    (the records kept, the number dropped)."""
    seen = {r.sequence for recs in earlier for r in recs}
    kept = [r for r in records if r.sequence not in seen]
    return kept, len(records) - len(kept)


def encode_records(records: list[FastaRecord]) -> list[np.ndarray]:
    tok = DNATokenizer()
    return [np.asarray(tok.encode(r.sequence), dtype=np.int64) for r in records]


def lm_windows(seqs: list[np.ndarray], seq_len: int) -> np.ndarray:
    """Non-overlapping windows (N, seq_len) of every sequence (a record's tail shorter than seq_len is left
    out), for evaluation."""
    rows = [s[i : i + seq_len] for s in seqs for i in range(0, len(s) - seq_len + 1, seq_len)]
    if not rows:
        raise ValueError(f"no sequence is at least seq_len={seq_len} bases long")
    return np.stack(rows)


def spaced_windows(seqs: list[np.ndarray], seq_len: int, count: int) -> np.ndarray:
    """At most ``count`` of ``lm_windows(seqs, seq_len)``, evenly spaced so every part of the sequences
    counts: the held-out windows the study scores the language models and the Markov reference on."""
    windows = lm_windows(seqs, seq_len)
    if len(windows) > count:
        windows = windows[np.linspace(0, len(windows) - 1, count).astype(int)]
    return windows


def sample_lm_batch(
    seqs: list[np.ndarray], seq_len: int, batch_size: int, rng: np.random.Generator
) -> np.ndarray:
    """(batch_size, seq_len) random windows, a record drawn in proportion to its length."""
    lengths = np.array([max(0, len(s) - seq_len + 1) for s in seqs], dtype=np.float64)
    if lengths.sum() == 0:
        raise ValueError(f"no sequence is at least seq_len={seq_len} bases long")
    which = rng.choice(len(seqs), size=batch_size, p=lengths / lengths.sum())
    return np.stack([seqs[i][(o := rng.integers(0, lengths[i])) : o + seq_len] for i in which])


@dataclass(frozen=True)
class ClassificationSet:
    x: np.ndarray  # (N, length) token ids
    y: np.ndarray  # (N,) 0 distal, 1 proximal


def proximal_distal(records: list[FastaRecord], length: int = 250) -> ClassificationSet:
    """The proximal / distal task of ``records`` (see the module docstring); records shorter than
    2 x ``length`` are left out."""
    (task,), _ = proximal_distal_splits([records], length)
    return task


def proximal_distal_splits(
    splits: list[list[FastaRecord]], length: int = 250
) -> tuple[list[ClassificationSet], dict[str, list[int]]]:
    """The proximal / distal task of each split, built in the order given (train, val, test) with one set
    of the windows kept so far: a window identical to one already kept, in an earlier split or earlier in
    its own, is left out. Returns the tasks and, per split, the counts left out: ``short_records``
    (records shorter than 2 x ``length``), ``seen_in_earlier_split`` and ``repeated_in_split`` (windows)."""
    tok = DNATokenizer()
    seen: set[str] = set()
    tasks = []
    counts: dict[str, list[int]] = {"short_records": [], "seen_in_earlier_split": [], "repeated_in_split": []}
    for records in splits:
        earlier, here = seen, set()
        xs, ys = [], []
        short = in_earlier = repeated = 0
        for r in records:
            if len(r.sequence) < 2 * length:
                short += 1
                continue
            for seq, label in ((r.sequence[-length:], 1), (r.sequence[:length], 0)):
                if seq in earlier:
                    in_earlier += 1
                elif seq in here:
                    repeated += 1
                else:
                    here.add(seq)
                    xs.append(tok.encode(seq))
                    ys.append(label)
        seen = earlier | here
        x = np.asarray(xs, dtype=np.int64).reshape(len(xs), length)
        tasks.append(ClassificationSet(x, np.asarray(ys, dtype=np.int64)))
        for key, n in zip(counts, (short, in_earlier, repeated)):
            counts[key].append(n)
    return tasks, counts


def markov_bits_per_base(train: list[np.ndarray], windows: np.ndarray, order: int) -> float:
    """Bits per base of an order-``order`` Markov chain (add-one counts from ``train``) on the test
    ``windows`` (N, seq_len), the language models' windows (``spaced_windows``), scored on the same
    positions: each window's bases after its first, each with at most ``order`` bases of context inside
    the window."""
    k = 8  # token ids < 8
    counts = np.ones((order + 1,) + (k,) * (order + 1))
    for s in train:
        for o in range(order + 1):
            idx = tuple(s[i : len(s) - o + i] for i in range(o + 1))
            np.add.at(counts[o][(0,) * (order - o)], idx, 1)
    total = 0.0
    n = 0
    for w in windows:
        for t in range(1, len(w)):
            o = min(order, t)
            table = counts[o][(0,) * (order - o)]
            ctx = tuple(w[t - o : t])
            row = table[ctx][3:8]  # the five bases
            total -= math.log2(row[w[t] - 3] / row.sum())
            n += 1
    return total / n


__all__ = [
    "ClassificationSet",
    "drop_repeated_records",
    "encode_records",
    "lm_windows",
    "markov_bits_per_base",
    "proximal_distal",
    "proximal_distal_splits",
    "sample_lm_batch",
    "spaced_windows",
    "split_records",
]
