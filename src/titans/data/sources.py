"""Text sources: where training text comes from, as an ordered list of named documents.

Nothing is downloaded at run time: every source reads files already on the machine.

Source specs understood by ``load_source(spec, *, text_field="text")``:

- ``builtin:stdlib``: the Python standard library (``.py`` files under ``sysconfig`` path ``stdlib`` of the
  running interpreter, ``site-packages``/``dist-packages``/``__pycache__`` skipped; ~30 MB). One document per
  file, id = path relative to the stdlib folder, sorted. The default training corpus.
- ``builtin:prose``: Moby-Dick chapters + State of the Union addresses (see ``titans.data.corpus``).
- a text file (any suffix; ``.gz`` is decompressed): one document, id = the file name.
- a directory: every non-empty ``*.txt``, ``*.md`` and ``*.py`` file below it, recursively, hidden
  folders, ``__pycache__`` and ``site-packages`` skipped; one document per file, id = relative path, sorted.
- a glob (``corpus/**/*.rst``; ``**`` recurses): the matching files, as for a directory.
- a ``.jsonl`` file: one document per non-blank line, text in field ``text_field``; id ``line-<n>``.
- ``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face dataset via ``datasets.load_dataset`` (local folders and
  the local cache work offline); a folder written by ``Dataset.save_to_disk`` is read with
  ``datasets.load_from_disk``. SPLIT defaults to ``train``; use ``hf:NAME::SPLIT`` for a split without a
  config. One document per row, text in column ``text_field``; id ``row-<i>``. Needs ``titans[datasets]``.
- ``fasta:PATH`` (plain or gzipped FASTA; ``fasta:builtin`` is the Drosophila sample shipped in
  ``titans/data/genomes``): one document per record, id = its header, text = its sequence in upper case
  (``titans.data.dna``; use it with the ``dna`` tokenizer).

Public API (names are stable): ``Document``, ``TextSource`` (``spec``, ``fingerprint()``,
``document_ids()``, ``documents()``), ``FileSource``, ``JsonlSource``, ``HFDatasetSource``,
``InMemorySource`` (``from_texts``), ``load_source``, ``stdlib_files``.

Documents are decoded as UTF-8 with invalid bytes replaced (U+FFFD); line endings are kept as they are.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from titans.validation import did_you_mean

DEFAULT_SUFFIXES = (".txt", ".md", ".py")
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
_BUILTINS = ("builtin:stdlib", "builtin:prose")


@dataclass(frozen=True)
class Document:
    """One unit of text; the held-out split is decided per document id."""

    id: str
    text: str


class TextSource(ABC):
    """An ordered collection of uniquely named documents."""

    spec: str

    @abstractmethod
    def fingerprint(self) -> str:
        """A cheap string that changes when the documents change (used to key token caches)."""

    @abstractmethod
    def document_ids(self) -> list[str]:
        """All document ids, in the order ``documents()`` yields them."""

    @abstractmethod
    def documents(self) -> Iterator[Document]:
        """The documents, in ``document_ids()`` order."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def _sha(parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", errors="surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


class InMemorySource(TextSource):
    """Documents already in memory (the built-in prose corpus, or texts a caller passes)."""

    def __init__(self, spec: str, docs: Sequence[Document], fingerprint: str | None = None):
        self.spec = spec
        self._docs = tuple(docs)
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
    """One document per file; ids are paths relative to ``root`` (POSIX separators)."""

    def __init__(self, spec: str, root: Path, files: Sequence[Path]):
        if not files:
            raise ValueError(f"text source {spec!r}: no files found")
        self.spec = spec
        self.root = root
        self.files = list(files)

    def _id(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def fingerprint(self) -> str:
        parts = []
        for f in self.files:
            st = f.stat()
            parts += [self._id(f), str(st.st_size), str(st.st_mtime_ns)]
        return _sha(parts)

    def document_ids(self) -> list[str]:
        return [self._id(f) for f in self.files]

    def documents(self) -> Iterator[Document]:
        for f in self.files:
            yield Document(self._id(f), _read_text(f))


class JsonlSource(TextSource):
    """One document per non-blank line of a JSON-lines file; text in field ``text_field``."""

    def __init__(self, path: Path, text_field: str = "text"):
        self.spec = str(path)
        self.path = path
        self.text_field = text_field

    def fingerprint(self) -> str:
        st = self.path.stat()
        return _sha([str(self.path.resolve()), str(st.st_size), str(st.st_mtime_ns), self.text_field])

    def _lines(self) -> Iterator[tuple[int, str]]:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line

    def document_ids(self) -> list[str]:
        return [f"line-{n}" for n, _ in self._lines()]

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
            yield Document(f"line-{lineno}", text)


def load_hf_split(spec: str, what: str):
    """The split that ``hf:NAME[:CONFIG][:SPLIT]`` names (default split "train"): a hub dataset through
    ``datasets``, a folder written by ``save_to_disk`` (a dataset, or a dataset dict to take the split
    from), or a folder of data files. Errors start with `what` and the spec."""
    parts = spec[len("hf:") :].split(":")
    if len(parts) > 3 or not parts[0]:
        raise ValueError(f"bad dataset spec {spec!r}: expected hf:NAME[:CONFIG][:SPLIT]")
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"{what} {spec!r} needs the Hugging Face 'datasets' package: "
            "pip install datasets (or pip install 'titans[datasets]')"
        ) from e
    name = parts[0]
    config = (parts[1] or None) if len(parts) > 1 else None
    split = (parts[2] or "train") if len(parts) > 2 else "train"
    try:
        saved = ("dataset_info.json", "dataset_dict.json")  # else a folder of data files: load_dataset
        if Path(name).is_dir() and any((Path(name) / f).is_file() for f in saved):
            ds = datasets.load_from_disk(name)
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(path=name, name=config, split=split)
    except Exception as e:  # offline misses, unknown names and bad splits raise many exception types
        raise ValueError(f"{what} {spec!r}: cannot load dataset ({type(e).__name__}: {e})") from e


class HFDatasetSource(TextSource):
    """One document per row of a Hugging Face dataset split; text in column ``text_field``."""

    def __init__(self, spec: str, text_field: str = "text"):
        self.spec, self.text_field = spec, text_field
        ds = load_hf_split(spec, "text source")
        if text_field not in ds.column_names:
            raise ValueError(
                f"text source {spec!r}: no column {text_field!r} (columns: {', '.join(ds.column_names)})"
            )
        self.dataset = ds.select_columns([text_field])
        self._fingerprint = _sha([spec, text_field, str(getattr(ds, "_fingerprint", "")), str(len(ds))])

    def fingerprint(self) -> str:
        return self._fingerprint

    def document_ids(self) -> list[str]:
        return [f"row-{i}" for i in range(len(self.dataset))]

    def documents(self) -> Iterator[Document]:
        i = 0
        for batch in self.dataset.iter(batch_size=1000):
            for text in batch[self.text_field]:
                yield Document(f"row-{i}", text if isinstance(text, str) else "")
                i += 1


def _walk_files(root: Path, suffixes: Sequence[str], skip_hidden: bool) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not (skip_hidden and d.startswith("."))]
        found += [Path(dirpath, f) for f in filenames if f.endswith(tuple(suffixes))]
    found = [p for p in found if p.stat().st_size > 0]  # empty files hold no document
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib folder of the running interpreter and its ``.py`` files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"builtin:stdlib: the standard library folder {str(root)!r} does not exist")
    return root, _walk_files(root, (".py",), skip_hidden=False)


def _glob_source(spec: str) -> FileSource:
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
    if not files:
        raise FileNotFoundError(f"text source {spec!r}: the glob matches no files")
    # ids are relative to the folder before the first component holding a glob character
    plain = []
    for part in Path(os.path.expanduser(spec)).parts:
        if any(c in part for c in "*?["):
            break
        plain.append(part)
    root = Path(*plain) if plain else Path(".")
    return FileSource(spec, root, sorted(files, key=lambda p: p.relative_to(root).as_posix()))


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
        from titans.data.corpus import prose_documents  # corpus imports this module: import it on use

        return InMemorySource(spec, prose_documents())  # fingerprint: a hash of the texts
    if spec.startswith("builtin:"):
        raise ValueError(
            f"unknown built-in text source {spec!r}; expected one of {', '.join(_BUILTINS)}"
            + did_you_mean(spec, _BUILTINS)
        )
    if spec.startswith("hf:"):
        return HFDatasetSource(spec, text_field=text_field)
    if spec.startswith("fasta:"):
        from titans.data.dna import fasta_source  # dna imports this module: import it on use

        return fasta_source(spec)
    if any(c in spec for c in "*?["):
        return _glob_source(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        files = _walk_files(path, DEFAULT_SUFFIXES, skip_hidden=True)
        if not files:
            raise ValueError(
                f"text source {spec!r}: the directory has no {'/'.join('*' + s for s in DEFAULT_SUFFIXES)} "
                "files (pass a glob such as 'DIR/**/*.rst' for other kinds)"
            )
        return FileSource(spec, path, files)
    if path.is_file():
        if path.suffix == ".jsonl":
            return JsonlSource(path, text_field=text_field)
        return FileSource(spec, path.parent, [path])
    raise FileNotFoundError(
        f"text source {spec!r}: no such file or directory (known specs: {', '.join(_BUILTINS)}, a path, "
        "a glob, a .jsonl file, hf:NAME[:CONFIG][:SPLIT] or fasta:PATH)"
    )
