"""Token streams: a text source tokenized into one flat array per split, cached on disk.

``load_token_streams(source, tokenizer)`` reads the documents of a source (``titans.data.sources``), splits
them into train / held-out by document id (``titans.data.split``), tokenizes every document and joins
them, each document FOLLOWED by the separator, into one flat numpy array per split (``uint16`` when the
vocabulary has <= 65536 symbols, else ``int32``).

Separator (``separator_ids``): the tokenizer's eos token when it has one. The byte tokenizer has no eos
and all 256 byte values are text, so documents are separated by the NUL byte (id 0, ``BYTE_SEPARATOR``),
which never occurs in the prose or Python sources used here. A non-byte tokenizer without an eos uses the
encoding of a blank line (``"\\n\\n"``), and is refused when that encodes to nothing.

Empty documents are left out by the sources (``titans.data.sources``), so the split never holds out only
empty text.

Digests: ``TokenStream.digest`` is a SHA-256 of a split's tokens (``token_digest``), and
``TokenStream.split_digests`` the (train, held-out) pair of the build it belongs to. Training checkpoints
record them (``TokenBatches.state_dict``), so ``--resume`` and ``titans eval ppl`` can tell when the text
was edited, or documents added or removed, since the run (a cheap source fingerprint cannot: a copied folder
has new modification times).

Byte count (for bits-per-byte): ``TokenStream.n_bytes`` is the UTF-8 byte count of the text the stream
encodes, counting each separator as one byte. For the byte tokenizer this equals the token count exactly.

Cache: with ``cache=True`` the arrays are stored under ``cache_dir/tokens/<name>-<key>/`` (``train.npy``,
``heldout.npy``, ``meta.json``), where the key hashes the source fingerprint, the tokenizer fingerprint,
the split settings and the format version (a file's fingerprint is its ``file_stamp``: size, modification
and change times, inode); a second run memory-maps them. An array whose file's stamp changed since it was
written is checked against its recorded digest (an untouched 1 GB entry is not hashed on every load).
Entries are written to a temp folder and renamed into place, so a crash never leaves a half-written entry;
a damaged entry is rebuilt.
A cache folder that cannot be written (read-only, no space, a file in its place) is warned about, and the
run goes on without it.
``default_cache_dir()`` is ``$TITANS_CACHE_DIR``, else ``$XDG_CACHE_HOME/titans``, else ``~/.cache/titans``.
Under torchrun, let rank 0 call ``load_token_streams`` first and the other ranks after a barrier (they then
read the cache); ranks that race all tokenize, and the first finished entry wins.

Public API (names are stable): ``TokenStream``, ``TokenStreams``, ``load_token_streams``,
``separator_ids``, ``encode_documents``, ``token_dtype``, ``token_digest``, ``default_cache_dir``,
``BYTE_SEPARATOR``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from titans._fs import ordinary_mode, write_text_atomic
from titans.data.sources import TextSource, file_stamp, load_source
from titans.data.split import DEFAULT_SALT, split_documents, split_tail
from titans.data.tokenizers import ByteTokenizer, Tokenizer

FORMAT_VERSION = 2  # 2: a UTF-8 byte-order mark is skipped, not read as a character
BYTE_SEPARATOR = 0
SPLITS = ("train", "heldout")
_BATCH_CHARS = 4_000_000  # tokenize documents in batches of about this many characters
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenStream:
    """One split of a source as a flat token array.

    ``tokens``: (n_tokens,) uint16 or int32, possibly a read-only memory map.
    ``n_bytes``: UTF-8 bytes of the encoded text (separators count one byte each).
    ``document_ids``: the documents in the stream, in order.
    ``digest``: ``token_digest(tokens)`` ("" when not computed); ``split_digests``: the (train, held-out)
    digests of the split this stream is one side of (("", "") when not from ``load_token_streams``).
    """

    tokens: np.ndarray
    n_bytes: int
    document_ids: tuple[str, ...]
    split: str
    source: str
    tokenizer: str
    digest: str = ""
    split_digests: tuple[str, str] = ("", "")

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / self.n_tokens

    def __len__(self) -> int:
        return self.n_tokens


class TokenStreams(NamedTuple):
    train: TokenStream
    heldout: TokenStream


def token_digest(tokens: np.ndarray) -> str:
    """SHA-256 (hex) of a token array's values and dtype: equal digests, equal streams."""
    h = hashlib.sha256(str(np.dtype(tokens.dtype)).encode())
    h.update(memoryview(np.ascontiguousarray(tokens)).cast("B"))
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def separator_ids(tokenizer: Tokenizer) -> list[int]:
    """Token ids placed after every document (see module docstring)."""
    if tokenizer.eos_id is not None:
        return [int(tokenizer.eos_id)]
    if isinstance(tokenizer, ByteTokenizer) or tokenizer.vocab_size == 256:
        return [BYTE_SEPARATOR]
    blank_line = list(tokenizer.encode("\n\n"))
    if not blank_line:  # documents would run into each other with no boundary between them
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has no eos token and encodes a blank line as nothing, so it has "
            "no way to mark where one document ends and the next begins: use a tokenizer with an eos token"
        )
    return blank_line


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text as int64 arrays; fast paths for bytes (numpy) and batch encoders."""
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
    batch = getattr(tokenizer, "encode_batch", None)
    encoded = batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in encoded]


def default_cache_dir() -> Path:
    if os.environ.get("TITANS_CACHE_DIR"):
        return Path(os.environ["TITANS_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "titans"


def _tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    fp = getattr(tokenizer, "fingerprint", None)
    return str(fp) if fp else f"{type(tokenizer).__qualname__}:{tokenizer.name}:{tokenizer.vocab_size}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:40] or "x"


class _SplitBuilder:
    """Accumulates one split's token arrays, separators and byte count."""

    def __init__(self, sep: np.ndarray, dtype: np.dtype):
        self.sep, self.dtype = sep.astype(dtype), dtype
        self.parts: list[np.ndarray] = []
        self.n_bytes = 0
        self.ids: list[str] = []

    def add(self, doc_id: str, text: str, ids: np.ndarray) -> None:
        self.parts += [ids.astype(self.dtype), self.sep]
        self.n_bytes += len(text.encode("utf-8")) + len(self.sep)
        self.ids.append(doc_id)


def _build(source: TextSource, tokenizer: Tokenizer, heldout_fraction: float, salt: str) -> dict:
    # document_ids() leaves empty documents out, so they are never the only held-out ones
    split = split_documents(source.document_ids(), heldout_fraction, salt=salt, source=source.spec)
    heldout = set(split.heldout_ids)
    dtype = token_dtype(tokenizer.vocab_size)
    sep = np.asarray(separator_ids(tokenizer), dtype=np.int64)
    builders = {name: _SplitBuilder(sep, dtype) for name in SPLITS}
    pending: list[tuple[str, str, str]] = []  # (split, doc id, text)

    def flush() -> None:
        arrays = encode_documents(tokenizer, [text for _, _, text in pending])
        for (name, doc_id, text), ids in zip(pending, arrays):
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise ValueError(
                    f"tokenizer {tokenizer.name!r} produced ids outside [0, {tokenizer.vocab_size}) "
                    f"for document {doc_id!r}"
                )
            builders[name].add(doc_id, text, ids)
        pending.clear()

    chars = 0
    for doc in source.documents():
        if not doc.text:
            continue  # (sources yield none) an empty document would contribute only a separator
        if split.tail_fraction is not None:
            head, tail = split_tail(doc.text, split.tail_fraction)
            pending += [("train", doc.id, head), ("heldout", doc.id, tail)]
        else:
            pending.append(("heldout" if doc.id in heldout else "train", doc.id, doc.text))
        chars += len(doc.text)
        if chars >= _BATCH_CHARS:
            flush()
            chars = 0
    flush()

    result = {}
    for name, b in builders.items():
        if not b.parts:
            raise ValueError(
                f"text source {source.spec!r} has no text for the {name} split (empty documents)"
            )
        tokens = np.concatenate(b.parts)
        result[name] = (tokens, b.n_bytes, b.ids, token_digest(tokens))
    return result


def _read_cache(entry: Path, tokenizer_name: str, spec: str) -> TokenStreams | None:
    try:
        meta = json.loads((entry / "meta.json").read_text())
        streams = {}
        for name in SPLITS:
            info = meta["splits"][name]
            tokens = np.load(entry / f"{name}.npy", mmap_mode="r")
            if tokens.shape != (info["n_tokens"],):
                raise ValueError(f"{name}.npy has shape {tokens.shape}, meta.json says {info['n_tokens']}")
            digest = info.get("digest")
            # an array changed since it was written (its file stamp differs) is hashed: one damaged but of
            # the right shape is found; an untouched one is not read whole (seconds a GB, on every load)
            if not digest or info.get("stamp") != file_stamp(entry / f"{name}.npy"):
                found = token_digest(tokens)
                if digest and found != digest:
                    raise ValueError(f"{name}.npy does not match the digest meta.json records")
                digest = found
            streams[name] = (tokens, int(info["n_bytes"]), tuple(info["document_ids"]), digest)
        return _streams(streams, spec, tokenizer_name)
    except Exception as e:  # noqa: BLE001 - the cache only saves time: any damage (an empty .npy raises
        # EOFError, a garbled header tokenize.TokenError) is rebuilt, never left to fail every later load
        log.warning("token cache %s is damaged (%s: %s); rebuilding it", entry, type(e).__name__, e)
        return None


def _streams(built: dict, spec: str, tokenizer_name: str) -> TokenStreams:
    """TokenStreams from {split: (tokens, n_bytes, ids, digest)}."""
    digests = (built["train"][3], built["heldout"][3])
    return TokenStreams(
        **{
            name: TokenStream(tokens, n_bytes, tuple(ids), name, spec, tokenizer_name, digest, digests)
            for name, (tokens, n_bytes, ids, digest) in built.items()
        }
    )


def _write_cache(entry: Path, built: dict, meta: dict, replace_damaged: bool) -> None:
    tmp = None
    try:  # the cache only saves time: any failure to write it is a warning
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        ordinary_mode(tmp)  # mkdtemp's folder is private; the cache entry is an ordinary folder
        meta = dict(meta, splits={})
        for name, (tokens, n_bytes, ids, digest) in built.items():
            with open(tmp / f"{name}.npy", "wb") as f:  # on disk before the folder is renamed into place
                np.save(f, tokens)
                f.flush()
                os.fsync(f.fileno())
            meta["splits"][name] = {
                "n_tokens": int(tokens.shape[0]),
                "n_bytes": n_bytes,
                "document_ids": ids,
                "digest": digest,
                "stamp": file_stamp(tmp / f"{name}.npy"),  # moving the folder into place keeps it
            }
        write_text_atomic(tmp / "meta.json", json.dumps(meta))  # flushed to disk too
        if replace_damaged:
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not entry.is_dir():
                raise
            # another process (e.g. another rank) finished the same entry first: keep theirs
    except OSError as e:
        log.warning("could not write token cache %s (%s); continuing without it", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_token_streams(
    source: str | TextSource,
    tokenizer: Tokenizer,
    *,
    heldout_fraction: float = 0.01,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    text_field: str = "text",
    salt: str = DEFAULT_SALT,
) -> TokenStreams:
    """Tokenize ``source`` into (train, heldout) token streams, from the cache when possible.

    ``source``: a spec for ``load_source`` (e.g. ``"builtin:stdlib"``) or a TextSource.
    ``heldout_fraction``: share of documents held out (by id hash, see ``titans.data.split``).
    ``cache_dir``: defaults to ``default_cache_dir()``; ``cache=False`` neither reads nor writes it.
    """
    src = load_source(source, text_field=text_field)
    meta = {
        "format": FORMAT_VERSION,
        "source": src.spec,
        "source_fingerprint": src.fingerprint(),
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": _tokenizer_fingerprint(tokenizer),
        "separator": separator_ids(tokenizer),
        "heldout_fraction": heldout_fraction,
        "salt": salt,
    }
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:20]
    entry = (
        Path(cache_dir or default_cache_dir()) / "tokens" / f"{_slug(src.spec)}-{_slug(tokenizer.name)}-{key}"
    )
    damaged = False
    if cache and _is_dir(entry):
        cached = _read_cache(entry, tokenizer.name, src.spec)
        if cached is not None:
            return cached
        damaged = True
    log.info("tokenizing %s with %s%s", src.spec, tokenizer.name, f" (cache: {entry})" if cache else "")
    built = _build(src, tokenizer, heldout_fraction, salt)
    if cache:
        _write_cache(entry, built, meta, replace_damaged=damaged)
    return _streams(built, src.spec, tokenizer.name)


def _is_dir(path: Path) -> bool:
    try:  # a folder that cannot be searched holds no cache entry we can use
        return path.is_dir()
    except OSError:
        return False
