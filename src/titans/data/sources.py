"""Text sources: where training text comes from, as an ordered list of named documents.

Nothing is downloaded at run time: every source reads files already on the machine.

Source specs understood by ``load_source(spec, *, text_field="text")``:

- ``builtin:stdlib``: the Python standard library (``.py`` files under ``sysconfig`` path ``stdlib`` of the
  running interpreter, ``site-packages``/``dist-packages``/``__pycache__`` skipped; ~30 MB). One document per
  file, id = path relative to the stdlib folder, sorted. The default training corpus.
- ``builtin:prose``: Moby-Dick chapters + State of the Union addresses (see ``titans.data.corpus``).
- a text file (any suffix; ``.gz`` is decompressed): one document, id = the file name.
- a directory: every non-empty ``*.txt``, ``*.md`` and ``*.py`` file below it, recursively, following
  symlinked folders (each real folder read once); hidden files and folders (``.name``: editor lock and swap
  files among them), ``__pycache__``, ``site-packages`` and broken symlinks skipped; one document per file,
  id = relative path, sorted.
- a glob (``corpus/**/*.rst``; ``**`` recurses, into symlinked folders too; ``*`` does not match hidden
  names): the matching files, sorted, each real file once, each read by its kind as if named alone: a
  ``.jsonl`` / ``.jsonl.gz`` file gives its records, id ``<relative path>:line-<n>``; any other file is
  one document, id = relative path (``.gz`` decompressed). A path that exists is a path, even when its
  name holds ``*``, ``?`` or ``[``.
- a ``.jsonl`` (or gzipped ``.jsonl.gz``) file: one document per non-blank line, text in field
  ``text_field``; id ``line-<n>``. Ids are line numbers, so a record inserted or removed above others moves
  them across the held-out split: add records at the end (``titans eval ppl`` and ``--resume`` refuse data
  that changed since the run).
- ``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face dataset via ``datasets.load_dataset`` (local folders and
  the local cache work offline); a folder written by ``Dataset.save_to_disk`` is read with
  ``datasets.load_from_disk``. SPLIT defaults to ``train``; use ``hf:NAME::SPLIT`` for a split without a
  config. One document per row, text in column ``text_field``; id ``row-<i>`` (a row number, as for
  ``.jsonl``). Needs ``titans[datasets]``.
- ``fasta:PATH`` (plain or gzipped FASTA; ``fasta:builtin`` is the Drosophila sample shipped in
  ``titans/data/genomes``): one document per record, id = its header, text = its sequence in upper case
  (``titans.data.dna``; use it with the ``dna`` tokenizer).

Public API (names are stable): ``Document``, ``TextSource`` (``spec``, ``fingerprint()``,
``document_ids()``, ``documents()``), ``FileSource``, ``JsonlSource``, ``HFDatasetSource``,
``InMemorySource`` (``from_texts``), ``load_source``, ``stdlib_files``.

Documents are decoded as UTF-8 (a text file that starts with a UTF-16 byte-order mark, as UTF-16) with
invalid bytes replaced (U+FFFD), and so are lone UTF-16 surrogates
that a JSON string escapes (``"\\ud83d"``, half an emoji); line endings are kept as they are. Empty
documents (an empty file, a record with an empty text) are no documents: ``document_ids()`` and
``documents()`` leave them out, so the held-out split never picks one. A damaged ``.gz`` file is a
ValueError naming it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from titans.data.corpus import prose_documents
from titans.data.dna import fasta_source
from titans.data.documents import Document, TextSource, file_stamp, load_hf_split
from titans.validation import did_you_mean

DEFAULT_SUFFIXES = (".txt", ".md", ".py")
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
_BUILTINS = ("builtin:stdlib", "builtin:prose")
_SURROGATE = re.compile("[\ud800-\udfff]")
_GZIP_ERRORS = (OSError, EOFError, zlib.error)  # bad header (BadGzipFile), truncated, corrupt stream
log = logging.getLogger(__name__)


def _sha(parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", errors="surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def _gzip_error(path: Path, e: BaseException) -> ValueError:
    return ValueError(f"{str(path)!r} is not a readable gzip file ({type(e).__name__}: {e}); "
                      "re-download or re-compress it")  # fmt: skip


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except _GZIP_ERRORS as e:
            raise _gzip_error(path, e) from None
    return data.decode(text_encoding(data[:3]), errors="replace")


_UTF16_MARKS = (b"\xff\xfe", b"\xfe\xff")  # the byte-order marks of Windows' "Unicode" text
_UTF8_MARK = b"\xef\xbb\xbf"  # the byte-order mark some Windows editors put before UTF-8
_MARKS = (*_UTF16_MARKS, _UTF8_MARK)


def text_encoding(head: bytes) -> str:
    """A text file's encoding from its first three bytes: UTF-16 after its byte-order mark (read as UTF-8,
    every other byte was a NUL), UTF-8 after its mark (the mark skipped, not read as a character), else
    UTF-8."""
    if head[:2] in _UTF16_MARKS:
        return "utf-16"
    return "utf-8-sig" if head.startswith(_UTF8_MARK) else "utf-8"


def open_text(path: str | Path) -> TextIO:
    """A text file opened for reading as training reads it: a ``.gz`` file decompressed, its encoding by
    `text_encoding`, bytes that do not decode as U+FFFD, line ends kept as they are."""
    path = Path(path)
    gz = path.suffix == ".gz"
    opener = gzip.open if gz else open
    try:
        with opener(path, "rb") as raw:
            encoding = text_encoding(raw.read(3))
    except _GZIP_ERRORS as e:
        if not gz or isinstance(e, FileNotFoundError):
            raise
        raise _gzip_error(path, e) from None
    return opener(path, "rt", encoding=encoding, errors="replace", newline="")


def _has_text(path: Path) -> bool:
    """Whether a file holds any text (a ``.gz`` file: any decompressed byte; a lone byte-order mark is
    none); a broken symlink holds none."""
    try:
        if path.stat().st_size == 0:
            return False
    except FileNotFoundError:
        return False
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
    except _GZIP_ERRORS as e:
        raise _gzip_error(path, e) from None
    return head != b"" and head not in _MARKS


def _valid_text(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


class InMemorySource(TextSource):
    """Documents already in memory (the built-in prose corpus, or texts a caller passes)."""

    def __init__(self, spec: str, docs: Sequence[Document], fingerprint: str | None = None):
        self.spec = spec
        # an empty text is no document; a lone surrogate (from a caller's string) becomes U+FFFD
        self._docs = tuple(Document(d.id, _valid_text(d.text)) for d in docs if d.text)
        self._fingerprint = fingerprint or _sha([x for d in self._docs for x in (d.id, d.text)])

    @classmethod
    def from_texts(cls, texts: Sequence[str], name: str = "memory") -> InMemorySource:
        """Documents ``doc-000000``, ``doc-000001``, ... with the given texts."""
        return cls(name, [Document(f"doc-{i:06d}", t) for i, t in enumerate(texts)])

    def fingerprint(self) -> str:
        return self._fingerprint

    def document_ids(self) -> list[str]:
        return [d.id for d in self._docs]

    def documents(self) -> Iterator[Document]:
        return iter(self._docs)


class FileSource(TextSource):
    """One document per file, ids = paths relative to ``root`` (POSIX separators); a ``.jsonl`` /
    ``.jsonl.gz`` file among them gives its records, ids ``<relative path>:line-<n>`` (see
    ``JsonlSource``). Files without text are left out."""

    def __init__(self, spec: str, root: Path, files: Sequence[Path], text_field: str = "text"):
        self.spec = spec
        self.root = root
        self.text_field = text_field
        self.files = [f for f in files if _has_text(f)]
        if not self.files:
            raise ValueError(f"text source {spec!r}: no files with text found")

    def _id(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def fingerprint(self) -> str:
        parts = []
        for f in self.files:
            parts += [self._id(f), *file_stamp(f)]
        if any(_is_jsonl(f) for f in self.files):  # which field is read changes the documents
            parts.append(self.text_field)
        return _sha(parts)

    def document_ids(self) -> list[str]:
        ids = []
        for f in self.files:
            if _is_jsonl(f):
                ids += [f"{self._id(f)}:{i}" for i in JsonlSource(f, self.text_field).document_ids()]
            else:
                ids.append(self._id(f))
        return ids

    def documents(self) -> Iterator[Document]:
        for f in self.files:
            if _is_jsonl(f):
                for doc in JsonlSource(f, self.text_field).documents():
                    yield Document(f"{self._id(f)}:{doc.id}", doc.text)
            else:
                yield Document(self._id(f), _read_text(f))


class JsonlSource(TextSource):
    """One document per non-blank line of a JSON-lines file (plain, or gzipped when its name ends in
    ``.gz``) whose field ``text_field`` holds a non-empty text; id ``line-<n>``."""

    def __init__(self, path: Path, text_field: str = "text"):
        self.spec = str(path)
        self.path = path
        self.text_field = text_field

    def fingerprint(self) -> str:
        return _sha([str(self.path.resolve()), *file_stamp(self.path), self.text_field])

    def _lines(self) -> Iterator[tuple[int, str]]:
        with open_text(self.path) as f:
            try:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield lineno, line
            except _GZIP_ERRORS as e:
                raise _gzip_error(self.path, e) from None

    def document_ids(self) -> list[str]:
        # the records must be read: one with an empty text is no document
        return [d.id for d in self.documents()]

    def documents(self) -> Iterator[Document]:
        for lineno, line in self._lines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.spec!r} line {lineno}: invalid JSON ({e})") from None
            if not isinstance(row, dict) or self.text_field not in row:
                raise ValueError(f"{self.spec!r} line {lineno}: no field {self.text_field!r}")
            text = row[self.text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{self.spec!r} line {lineno}: field {self.text_field!r} is "
                    f"{type(text).__name__}, not a string"
                )
            if text:
                yield Document(f"line-{lineno}", _valid_text(text))


class HFDatasetSource(TextSource):
    """One document per row of a Hugging Face dataset split; text in column ``text_field``."""

    def __init__(self, spec: str, text_field: str = "text"):
        self.spec, self.text_field = spec, text_field
        ds = load_hf_split(spec, "text source")
        if text_field not in ds.column_names:
            raise ValueError(
                f"text source {spec!r}: no column {text_field!r} (columns: {', '.join(ds.column_names)})"
            )
        feature = ds.features[text_field]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            # its values would all be skipped: "has no documents", which names neither column nor type
            raise ValueError(f"text source {spec!r}: column {text_field!r} holds {feature}, not strings")
        self.dataset = ds.select_columns([text_field])
        self._fingerprint = _sha([spec, text_field, str(getattr(ds, "_fingerprint", "")), str(len(ds))])

    def fingerprint(self) -> str:
        return self._fingerprint

    def document_ids(self) -> list[str]:
        # a row with an empty (or missing) text is no document; Arrow finds them without reading every
        # text into Python (a hub dataset can hold billions of bytes)
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self.dataset.with_format("arrow")[self.text_field]
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            return [d.id for d in self.documents()]
        keep = pc.fill_null(pc.greater(pc.utf8_length(column), 0), False)
        return [f"row-{i}" for i in np.flatnonzero(keep.to_numpy(zero_copy_only=False))]

    def documents(self) -> Iterator[Document]:
        i = 0
        for batch in self.dataset.iter(batch_size=1000):
            for text in batch[self.text_field]:
                if isinstance(text, str) and text:
                    yield Document(f"row-{i}", text)
                i += 1


def _walk_files(root: Path, suffixes: Sequence[str], skip_hidden: bool, follow_links: bool) -> list[Path]:
    """Files below ``root`` whose names end in one of ``suffixes``, sorted by relative path. Broken
    symlinks are skipped; ``follow_links``: symlinked folders are walked too, each real folder once (a link
    back up the tree is not followed). Each real file is read once: a symlinked file (or a hard path to
    the same file) after the first in sorted order is dropped, so one text is never on both sides of a
    train / held-out split."""
    found = []
    seen = {os.path.realpath(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_links):
        keep = []
        for d in sorted(dirnames):
            if d in _SKIP_DIRS or (skip_hidden and d.startswith(".")):
                continue
            if follow_links:
                real = os.path.realpath(os.path.join(dirpath, d))
                if real in seen:
                    continue
                seen.add(real)
            keep.append(d)
        dirnames[:] = keep
        for name in filenames:
            if not name.endswith(tuple(suffixes)) or (skip_hidden and name.startswith(".")):
                continue
            path = Path(dirpath, name)
            if not path.exists():
                log.warning("text source: skipping %s, a broken symlink", path)
            elif path.is_file():
                found.append(path)
    return _each_file_once(found, root)


def _each_file_once(found: list[Path], root: Path) -> list[Path]:
    """``found`` sorted by path relative to ``root``, each real file once (the first path that reaches
    it): a file reached again through a symlink is read once, never on both sides of a split."""
    files, seen = [], set()
    for f in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            files.append(f)
    return files


def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib folder of the running interpreter and its ``.py`` files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"builtin:stdlib: the standard library folder {str(root)!r} does not exist")
    # the default corpus: read exactly as it always was (no symlinked folders), so its split never moves
    return root, _walk_files(root, (".py",), skip_hidden=False, follow_links=False)


def _glob_source(spec: str, text_field: str) -> FileSource:
    found = [Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file()]
    if not found:
        raise FileNotFoundError(f"text source {spec!r}: the glob matches no files")
    # ids are relative to the folder before the first component holding a glob character
    plain = []
    for part in Path(os.path.expanduser(spec)).parts:
        if any(c in part for c in "*?["):
            break
        plain.append(part)
    root = Path(*plain) if plain else Path(".")
    files = _each_file_once(found, root)  # ``**`` follows symlinked folders, loops too
    if not any(_has_text(f) for f in files):
        raise ValueError(f"text source {spec!r}: the glob matches only empty files")
    return FileSource(spec, root, files, text_field=text_field)


def load_source(spec: str | TextSource, *, text_field: str = "text") -> TextSource:
    """Open the text source named by ``spec`` (see the module docstring); a TextSource passes through."""
    if isinstance(spec, TextSource):
        return spec
    spec = str(spec)
    if not spec.strip():  # Path("") is the current folder: never read it by accident
        raise ValueError(
            "text source: the spec is empty; give a file, folder, glob, builtin:, hf: or fasta: spec"
        )
    if spec == "builtin:stdlib":
        root, files = stdlib_files()
        return FileSource(spec, root, files)
    if spec == "builtin:prose":
        return InMemorySource(spec, prose_documents())  # fingerprint: a hash of the texts
    if spec.startswith("builtin:"):
        raise ValueError(
            f"unknown built-in text source {spec!r}; expected one of {', '.join(_BUILTINS)}"
            + did_you_mean(spec, _BUILTINS)
        )
    if spec.startswith("hf:"):
        return HFDatasetSource(spec, text_field=text_field)
    if spec.startswith("fasta:"):
        return fasta_source(spec)
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?[") and not os.path.lexists(path):  # an existing path is a path
        return _glob_source(spec, text_field)
    if path.is_dir():
        files = _walk_files(path, DEFAULT_SUFFIXES, skip_hidden=True, follow_links=True)
        if not files:  # (files without text are left out by FileSource)
            raise ValueError(
                f"text source {spec!r}: the directory has no {'/'.join('*' + s for s in DEFAULT_SUFFIXES)} "
                "files (pass a glob such as 'DIR/**/*.rst' for other kinds)"
            )
        return FileSource(spec, path, files)
    if path.is_file():
        if _is_jsonl(path):
            return JsonlSource(path, text_field=text_field)
        return FileSource(spec, path.parent, [path])
    raise FileNotFoundError(
        f"text source {spec!r}: no such file or directory (known specs: {', '.join(_BUILTINS)}, a path, "
        "a glob, a .jsonl file, hf:NAME[:CONFIG][:SPLIT] or fasta:PATH)"
    )
