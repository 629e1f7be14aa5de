"""DNA: FASTA reading, a nucleotide tokenizer, and the built-in Drosophila sample.

- ``read_fasta(path)`` -> list of ``FastaRecord(name, sequence)``; plain or ``.gz``. Sequences are upper-cased
  (lower case is soft-masking: repeats, not another letter). Letters other than A, C, G, T and N are
  refused with the record, line and column named (``ambiguous="N"`` maps IUPAC ambiguity codes to N).
- ``DNATokenizer``: one token per base, ids ``<pad>`` 0, ``<eos>`` 1, ``<cls>`` 2, A 3, C 4, G 5, T 6, N 7
  (vocab 8). ``decode(encode(s)) == s.upper()``; unknown letters raise, naming the letter and position.
  Same interface as the text tokenizers (``titans.data.tokenizers``): ``load_tokenizer("dna")``.
- ``FastaSource``: a FASTA file as a text source, one document per record (``fasta:PATH`` in
  ``load_source``), so ``titans train --data fasta:PATH --tokenizer dna`` trains a DNA language model: one
  byte per base, so the trainer's bits per byte are bits per base.
- ``DM3_SAMPLE``: the path of the built-in sample, 530 records of 2,000 bases upstream of D. melanogaster
  transcription starts (``titans/data/genomes/PROVENANCE.md``); also ``fasta:builtin``.
- ``GenomicsBenchmarks`` data (Grešová et al., 2023; on the Hugging Face hub, e.g.
  ``katarinagresova/Genomic_Benchmarks_human_nontata_promoters``, columns ``seq`` and ``label``):
  ``load_labelled_sequences(spec)`` reads ``hf:NAME[:CONFIG][:SPLIT]`` through ``datasets`` or a local
  CSV / JSONL with those columns.
"""

from __future__ import annotations

import gzip
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from titans.data.documents import Document, TextSource, file_stamp, load_hf_split

BASES = "ACGTN"
SPECIALS = ("<pad>", "<eos>", "<cls>")
IUPAC_AMBIGUOUS = set("RYSWKMBDHV")
DM3_SAMPLE_NAME = "dm3_upstream2000.sample.fa.gz"


def dm3_sample_path() -> Path:
    """The built-in sample FASTA (see ``titans/data/genomes/PROVENANCE.md``)."""
    return Path(str(resources.files("titans.data") / "genomes" / DM3_SAMPLE_NAME))


@dataclass(frozen=True)
class FastaRecord:
    name: str  # the header line without '>'
    sequence: str  # upper case, only A C G T N


def _open_text(path: Path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    # utf-8-sig: a byte-order mark (Windows editors write one) is skipped, not read as characters before
    # the first header
    return (
        gzip.open(path, "rt", encoding="utf-8-sig", errors="replace")
        if gz
        else open(path, encoding="utf-8-sig", errors="replace")
    )


def read_fasta(path: str | Path, ambiguous: str = "error") -> list[FastaRecord]:
    """Every record of a FASTA file (see the module docstring). ``ambiguous``: "error" or "N"."""
    if ambiguous not in ("error", "N"):
        raise ValueError(f"read_fasta: ambiguous must be 'error' or 'N', got {ambiguous!r}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"FASTA file {str(path)!r}: no such file")
    records: list[FastaRecord] = []
    name: str | None = None
    parts: list[str] = []
    allowed = set(BASES)
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith(";"):
                continue
            if line.startswith(">"):
                if name is not None:
                    records.append(FastaRecord(name, "".join(parts)))
                name, parts = line[1:].strip(), []
                continue
            if name is None:
                raise ValueError(
                    f"FASTA file {str(path)!r}: sequence before the first '>' header (line {lineno})"
                )
            # an ASCII letter's upper case only: "ſ".upper() is "S" (an IUPAC code), "ß".upper() "SS"
            seq = "".join(c.upper() if c.isascii() else c for c in line)
            bad = set(seq) - allowed
            if bad:
                if ambiguous == "N" and bad <= IUPAC_AMBIGUOUS:
                    seq = "".join("N" if c in IUPAC_AMBIGUOUS else c for c in seq)
                else:
                    # the first letter refused: with ambiguous='N' the IUPAC codes before it are accepted
                    accepted = allowed | IUPAC_AMBIGUOUS if ambiguous == "N" else allowed
                    col = next(i for i, c in enumerate(seq) if c not in accepted)
                    raise ValueError(
                        f"FASTA file {str(path)!r}: unknown letter {line[col]!r} in record {name!r} at line "
                        f"{lineno}, column {col + 1} (expected A, C, G, T or N"
                        + ("; ambiguous='N' maps IUPAC codes to N)" if seq[col] in IUPAC_AMBIGUOUS else ")")
                    )
            parts.append(seq)
    if name is not None:
        records.append(FastaRecord(name, "".join(parts)))
    if not records:
        raise ValueError(f"FASTA file {str(path)!r}: no records (no '>' header line)")
    empty = [r.name for r in records if not r.sequence]
    if empty:
        raise ValueError(f"FASTA file {str(path)!r}: record {empty[0]!r} has no sequence")
    return records


class DNATokenizer:
    """One token per base (see the module docstring)."""

    name = "dna"
    vocab_size = len(SPECIALS) + len(BASES)
    pad_id, eos_id, cls_id = 0, 1, 2
    fingerprint = "dna:" + ",".join(SPECIALS) + "," + BASES

    def __init__(self) -> None:
        self._table = {c: i + len(SPECIALS) for i, c in enumerate(BASES)}
        self._table.update({c.lower(): i for c, i in self._table.items()})
        self._letters = SPECIALS + tuple(BASES)

    def encode(self, text: str) -> list[int]:
        table = self._table
        try:
            return [table[c] for c in text]
        except KeyError:
            pos = next(i for i, c in enumerate(text) if c not in table)
            raise ValueError(
                f"DNATokenizer: unknown letter {text[pos]!r} at position {pos} (expected A, C, G, T or N, "
                "either case)"
            ) from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if not 0 <= i < len(self._letters):
                raise ValueError(f"DNATokenizer: id {i} outside [0, {len(self._letters)})")
            if i >= len(SPECIALS):
                out.append(self._letters[i])
        return "".join(out)


class FastaSource(TextSource):
    """A FASTA file as documents: one per record, id = the record's header, text = its sequence."""

    def __init__(self, spec: str, path: Path):
        self.spec = spec
        self.path = path
        self._records = read_fasta(path)
        names = [r.name for r in self._records]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"FASTA file {str(path)!r}: record name {dup!r} appears more than once")

    def fingerprint(self) -> str:
        stamp = "|".join(file_stamp(self.path))
        return hashlib.sha256(f"fasta|{self.path.resolve()}|{stamp}".encode()).hexdigest()

    def document_ids(self) -> list[str]:
        return [r.name for r in self._records]

    def documents(self) -> Iterator[Document]:
        for r in self._records:
            yield Document(r.name, r.sequence)


def fasta_source(spec: str) -> FastaSource:
    """``fasta:PATH`` or ``fasta:builtin`` (the Drosophila sample)."""
    target = spec.split(":", 1)[1]
    return FastaSource(spec, dm3_sample_path() if target == "builtin" else Path(target).expanduser())


def load_labelled_sequences(
    spec: str, seq_field: str = "seq", label_field: str = "label"
) -> list[tuple[str, int]]:
    """(sequence, label) pairs from ``hf:NAME[:CONFIG][:SPLIT]`` (GenomicsBenchmarks on the hub, through
    ``datasets``) or a local ``.csv`` / ``.jsonl`` file with columns ``seq_field`` and ``label_field``."""
    if spec.startswith("hf:"):
        rows = load_hf_split(spec, "labelled sequences")
        columns = set(rows.column_names)
    else:
        import pandas as pd

        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"labelled sequences {spec!r}: no such file")
        if path.suffix == ".jsonl":
            frame = pd.read_json(path, lines=True, dtype=False)
        else:  # every cell as written: an empty cell or "NA" is not turned into NaN (or "NAN")
            frame = pd.read_csv(path, dtype={seq_field: str}, keep_default_na=False)
        rows, columns = frame.to_dict("records"), set(frame.columns)
    missing = [c for c in (seq_field, label_field) if c not in columns]
    if missing:
        raise ValueError(f"labelled sequences {spec!r}: no column(s) {missing} (columns: {sorted(columns)})")
    tok = DNATokenizer()
    out = []
    for i, row in enumerate(rows):
        seq = row[seq_field]
        if not isinstance(seq, str) or not seq:
            if isinstance(seq, str):
                what = "empty"
            elif seq is None or (isinstance(seq, float) and math.isnan(seq)):
                what = "missing (null)"
            else:
                what = f"not a sequence ({seq!r})"
            raise ValueError(f"labelled sequences {spec!r}, row {i}: column {seq_field!r} is {what}")
        try:
            tok.encode(seq)
        except ValueError as e:
            raise ValueError(f"labelled sequences {spec!r}, row {i}: {e}") from None
        label = row[label_field]
        value = _class_id(label)
        if value is None:
            raise ValueError(
                f"labelled sequences {spec!r}, row {i}: the label {label!r} is not a class id "
                "(an integer >= 0)"
            )
        if value > _MAX_CLASS_ID:
            raise ValueError(
                f"labelled sequences {spec!r}, row {i}: the label {label!r} is too large a class id "
                f"(at most {_MAX_CLASS_ID}, the largest int64)"
            )
        out.append((seq.upper(), value))
    return out


_MAX_CLASS_ID = 2**63 - 1  # the largest int64


def _class_id(label) -> int | None:
    """``label`` as a class id: an integer >= 0 (2.0 from a CSV column with gaps, or "3", reads as one too;
    1e300 too, which the caller refuses as larger than int64); None for anything else (text, NaN, inf, 1.5,
    -1)."""
    if isinstance(label, (int, np.integer)):
        value = int(label)
    else:
        try:
            number = float(label)
        except (TypeError, ValueError, OverflowError):
            return None
        if not math.isfinite(number) or not number.is_integer():
            return None
        value = int(number)
    return value if value >= 0 else None


__all__ = [
    "BASES",
    "SPECIALS",
    "DNATokenizer",
    "FastaRecord",
    "FastaSource",
    "dm3_sample_path",
    "fasta_source",
    "load_labelled_sequences",
    "read_fasta",
]
