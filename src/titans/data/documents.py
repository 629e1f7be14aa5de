"""The kinds every text source shares: `Document`, the `TextSource` interface, and what more than one kind
of source reads with (`file_stamp`, `load_hf_split`). `titans.data.sources` opens sources by spec (its
`load_source`) and re-exports these names; the built-in prose (`corpus`) and FASTA (`dna`) sources build
on them here, below `sources`, which dispatches to both."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


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


def file_stamp(path: Path) -> list[str]:
    """What a source fingerprint knows of a file without reading it: its size, modification time, change
    time and inode. The change time is set by every write and by a reset of the modification time (``cp -p``,
    ``rsync -a``, ``touch -d``), and a rewrite-and-rename gives a new inode, so an edit that keeps the size
    and modification time still changes the stamp; a copy does too (its text is tokenized again)."""
    st = path.stat()
    return [str(st.st_size), str(st.st_mtime_ns), str(st.st_ctime_ns), str(st.st_ino)]


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


__all__ = ["Document", "TextSource", "file_stamp", "load_hf_split"]
