"""DNA data for the study: a record-level train/test split, LM windows and a labelled classification task.

The classification task built from upstream-of-gene FASTA (such as the built-in Drosophila sample, every
record the 2,000 bases upstream of a transcription start, in the direction of transcription):

    label 1 "proximal": the last ``length`` bases of a record (just upstream of the transcription start:
        the core promoter region);
    label 0 "distal": the first ``length`` bases (1,750-2,000 bases upstream for length 250).

Labels come from the gene annotation, not from a model. They are noisy where genes lie close together
(a distal window can fall in a neighbouring gene's promoter). Windows with identical sequence (transcripts
that share a start) are kept once, and train/test are split by record, the same split as the language
model's, so no test record was seen in pre-training.
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
    """The proximal / distal task (see the module docstring)."""
    tok = DNATokenizer()
    seen: set[str] = set()
    xs, ys = [], []
    for r in records:
        if len(r.sequence) < 2 * length:
            raise ValueError(f"record {r.name!r} has {len(r.sequence)} bases, fewer than 2 x length={length}")
        for seq, label in ((r.sequence[-length:], 1), (r.sequence[:length], 0)):
            if seq in seen:
                continue
            seen.add(seq)
            xs.append(tok.encode(seq))
            ys.append(label)
    return ClassificationSet(np.asarray(xs, dtype=np.int64), np.asarray(ys, dtype=np.int64))


def markov_bits_per_base(train: list[np.ndarray], test: list[np.ndarray], order: int, seq_len: int) -> float:
    """Bits per base of an order-``order`` Markov chain (add-one counts) on the test windows of length
    ``seq_len``, scored on the same positions as the language models (each window's bases after its first,
    each with at most ``order`` bases of context inside the window)."""
    k = 8  # token ids < 8
    counts = np.ones((order + 1,) + (k,) * (order + 1))
    for s in train:
        for o in range(order + 1):
            idx = tuple(s[i : len(s) - o + i] for i in range(o + 1))
            np.add.at(counts[o][(0,) * (order - o)], idx, 1)
    windows = lm_windows(test, seq_len)
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
    "encode_records",
    "lm_windows",
    "markov_bits_per_base",
    "proximal_distal",
    "sample_lm_batch",
    "split_records",
]
