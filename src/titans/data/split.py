"""Deterministic train / held-out split at the document level.

A document is held out when a stable hash of its id (BLAKE2b of ``salt + id``, read as a number in
[0, 1)) is below ``heldout_fraction``. The decision depends on nothing but the id, so it is the same on
every machine and run, and documents added to a source do not move the others across the split, as long
as (1) their ids stay the same: true of files (id = path) and of records appended at the end of a
``.jsonl`` file or dataset, not of records inserted above others (their ids are line / row numbers, see
``titans.data.sources``), and (2) the fallback below is not involved. Both sides are guaranteed non-empty:
if the hash puts every document on one side, the document with the lowest (highest) score moves to the
held-out (training) side; in a source that small a document added later can take that place (a new lowest
score), moving the old one back. Runs record digests of both splits (``titans.data.stream``), so
``--resume`` and ``titans eval ppl`` refuse data whose split has changed since.

A source with a single document cannot be split by id: then the held-out text is the document's
contiguous tail (its last ``heldout_fraction`` of characters, cut at a line start when one is there), and
``DocumentSplit.tail_fraction`` says so; ``split_tail`` makes the cut.

Public API (names are stable): ``DocumentSplit``, ``heldout_score``, ``split_documents``, ``split_tail``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_SALT = "titans-heldout-v1"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DocumentSplit:
    """Which document ids are for training and which are held out.

    ``tail_fraction`` is set only for a single-document source: that document is in both id lists and
    its tail (``split_tail``) is the held-out part.
    """

    train_ids: tuple[str, ...]
    heldout_ids: tuple[str, ...]
    tail_fraction: float | None = None


def heldout_score(doc_id: str, salt: str = DEFAULT_SALT) -> float:
    """A number in [0, 1), uniform over ids, stable across runs, machines and Python versions."""
    digest = hashlib.blake2b((salt + "\0" + doc_id).encode("utf-8", errors="surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big") / 2**64


def split_documents(
    ids: Sequence[str], heldout_fraction: float, salt: str = DEFAULT_SALT, source: str = "source"
) -> DocumentSplit:
    """Split document ``ids`` into (train, held-out); both sides non-empty (see module docstring)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if not ids:
        raise ValueError(f"text source {source!r} has no documents")
    if len(set(ids)) != len(ids):
        raise ValueError(f"text source {source!r} has duplicate document ids")
    if len(ids) == 1:
        log.warning(
            "text source %r has a single document: holding out its last %.1f%% (a contiguous tail region)",
            source,
            100 * heldout_fraction,
        )
        return DocumentSplit(tuple(ids), tuple(ids), tail_fraction=heldout_fraction)
    scores = {i: heldout_score(i, salt) for i in ids}
    heldout = {i for i in ids if scores[i] < heldout_fraction}
    if not heldout:
        heldout = {min(ids, key=scores.__getitem__)}
    if len(heldout) == len(ids):
        heldout.discard(max(ids, key=scores.__getitem__))
    return DocumentSplit(
        train_ids=tuple(i for i in ids if i not in heldout),
        heldout_ids=tuple(i for i in ids if i in heldout),
    )


def split_tail(text: str, fraction: float) -> tuple[str, str]:
    """Split one text into (head, tail) with ``tail`` about ``fraction`` of it; both non-empty.

    The cut moves forward to the next line start when one lies in the first half of the tail.
    """
    if len(text) < 2:
        raise ValueError(f"cannot split a {len(text)}-character document into train and held-out parts")
    cut = len(text) - max(1, round(len(text) * fraction))
    cut = min(max(cut, 1), len(text) - 1)
    newline = text.find("\n", cut - 1)
    if 0 <= newline < cut + (len(text) - cut) // 2:  # keep at least half the intended tail
        cut = newline + 1
    return text[:cut], text[cut:]
