"""The built-in public-domain prose corpus shipped in ``titans/data/corpus/`` (see PROVENANCE.md there).

- Moby-Dick (Melville, 1851): one document per chapter, ids ``moby-dick/chapter-001`` ... ``-135``.
- 233 State of the Union addresses (1790-2021): one document per address, ids ``sotu/<year>_<name>_<party>``
  (the ``=== ...`` header line of each address; the header itself is not part of the text).

Public API (names are stable; the evaluation generators read haystack text through it):

- ``prose_documents(which="all") -> tuple[Document, ...]``: ``which`` is ``"all"``, ``"moby-dick"`` or
  ``"sotu"``; Moby-Dick chapters come first, in book order, then the addresses in file order.
- ``prose_text(which="all", separator="\\n\\n") -> str``: the same documents joined into one string.

Both are cached in memory after the first call (about 12 MB of text).
"""

from __future__ import annotations

import functools
import gzip
import re
from importlib import resources

from titans.data.documents import Document

_CHAPTER = re.compile(r"^CHAPTER (\d+)\.", re.MULTILINE)
_ADDRESS = re.compile(r"^=== (\S+)[ \t]*$", re.MULTILINE)
_WHICH = ("all", "moby-dick", "sotu")


def _corpus_bytes(name: str) -> bytes:
    return resources.files("titans.data").joinpath("corpus", name).read_bytes()


@functools.lru_cache(maxsize=1)
def _moby_dick() -> tuple[Document, ...]:
    text = _corpus_bytes("moby-dick.txt").decode("utf-8")
    heads = list(_CHAPTER.finditer(text))
    if not heads:
        raise RuntimeError("moby-dick.txt: no 'CHAPTER n.' headings found; is the corpus file intact?")
    docs = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        docs.append(Document(f"moby-dick/chapter-{int(m.group(1)):03d}", text[m.start() : end].strip()))
    return tuple(docs)


@functools.lru_cache(maxsize=1)
def _sotu() -> tuple[Document, ...]:
    text = gzip.decompress(_corpus_bytes("sotu.txt.gz")).decode("utf-8")
    heads = list(_ADDRESS.finditer(text))
    if not heads:
        raise RuntimeError("sotu.txt.gz: no '=== YEAR_NAME_TYPE' headers found; is the corpus file intact?")
    docs = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        docs.append(Document(f"sotu/{m.group(1)}", text[m.end() : end].strip()))
    return tuple(docs)


def prose_documents(which: str = "all") -> tuple[Document, ...]:
    """Built-in prose: ``"all"`` (Moby-Dick chapters, then the addresses), ``"moby-dick"`` or ``"sotu"``."""
    if which == "moby-dick":
        return _moby_dick()
    if which == "sotu":
        return _sotu()
    if which == "all":
        return _moby_dick() + _sotu()
    raise ValueError(f"unknown prose collection {which!r}; expected one of {', '.join(_WHICH)}")


def prose_text(which: str = "all", separator: str = "\n\n") -> str:
    """All built-in prose documents of ``which`` joined by ``separator`` into one string."""
    return separator.join(d.text for d in prose_documents(which))
