"""`save_pretrained(model, path, tokenizer)`: a folder that transformers users load with the Auto classes.

The folder holds the weights and config (with `auto_map` and the remote code, see `TitansForCausalLM.
save_pretrained`), the generation config (eos and pad ids from the tokenizer, `special_token_ids`: no pad
id for bytes, each of which is text) and the tokenizer as a transformers fast tokenizer
(`titans.hf.tokenization.to_hf_tokenizer`). From it:

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)   # it reads the config, remote code
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)   # or after `import titans.hf`
    pipeline("text-generation", model=path, trust_remote_code=True)("def ", max_new_tokens=20)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from titans._fs import ordinary_mode
from titans.data.tokenizers import Tokenizer
from titans.hf.modeling import TitansForCausalLM
from titans.hf.tokenization import special_token_ids, to_hf_tokenizer
from titans.models.lm import TitansLM


def save_pretrained(
    model: TitansLM, path: str | os.PathLike, tokenizer: Tokenizer | None = None, *, overwrite: bool = True
) -> list[Path]:
    """Save `model` (and `tokenizer`, when given) as a transformers folder; returns the files written.

    The tokenizer is converted before anything is written, so one that cannot be saved (a SentencePiece or
    tiktoken file) or that does not fit the model (more symbols than the model has ids) leaves no folder
    behind. ``overwrite=False``: a folder that holds anything is refused (FileExistsError), also one that
    another writer fills while this export is written (the export is renamed into place in one step).
    """
    hf_tokenizer, ids = None, {}
    if tokenizer is not None:
        # a model may have more ids than its tokenizer (a vocabulary padded to a multiple of 64), not fewer
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"save_pretrained: tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} symbols, more "
                f"than the model's {model.config.vocab_size}"
            )
        hf_tokenizer = to_hf_tokenizer(tokenizer)
        ids = special_token_ids(tokenizer)
    out = Path(path).expanduser()
    # staged in a temporary folder, then moved into place: a failure while writing leaves `out` as it was
    # (a kill part-way had left a new config.json beside the old weights, which loaded as a random model)
    exists = out.is_dir()
    if exists and not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{str(out)!r} exists and is not empty")
    stage_in = out if exists else out.parent  # in `out` itself: its parent may be read-only or a mount's
    stage_in.mkdir(parents=True, exist_ok=True)
    with _sigterm_unwinds():
        return _export(model, out, hf_tokenizer, ids, exists, overwrite, stage_in)


def _export(
    model, out: Path, hf_tokenizer, ids: dict, exists: bool, overwrite: bool, stage_in: Path
) -> list[Path]:
    """`save_pretrained`'s writing: staged in a hidden folder in `stage_in`, then moved into `out`."""
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=stage_in))
    try:
        TitansForCausalLM.from_titans(model, **ids).save_pretrained(tmp)
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(tmp)
        written = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
        for p in (tmp, *tmp.rglob("*")):  # transformers writes the weights 0600, tempfile the folder 0700
            ordinary_mode(p)
        if exists:
            if not overwrite:
                _claim(out, tmp)
            _move_into(tmp, out, written, claimed=not overwrite)
        else:
            try:  # fails if another writer has filled `out` since (never replaces a folder with files)
                os.rename(tmp, out)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or overwrite:
                    raise
                raise FileExistsError(f"{str(out)!r} was written by another export meanwhile") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / p for p in written]


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM ends the export as Ctrl-C does, by an exception (SystemExit, status 143) that removes its
    staging folder on the way out: by default it killed the process at once and left a hidden
    ``.export-*`` folder, and the next export into that folder was refused as not empty. Only where
    SIGTERM has no handler yet, in the main thread (a server's or a trainer's own handler is kept)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _claim(out: Path, tmp: Path) -> None:
    """Take the empty folder `out` for this export (not overwriting): an empty config.json made only if
    none exists (O_EXCL), so of two exports into it the second is refused; files another writer put there
    meanwhile refuse it too. The export's own config.json replaces the marker, last."""
    try:
        os.close(os.open(out / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise FileExistsError(f"{str(out)!r} was written by another export meanwhile") from None
    others = [p for p in out.iterdir() if p.name != "config.json" and not p.name.startswith(".export-")]
    if others:
        (out / "config.json").unlink()
        raise FileExistsError(f"{str(out)!r} was written by another export meanwhile")


def _move_into(new: Path, out: Path, files: list[Path], claimed: bool = False) -> None:
    """Move the export's `files` from `new` into the existing folder `out`, each by a rename, config.json
    last, after the old one was removed first: stopped part-way, the folder has no config.json and does
    not load, rather than loading the new config with the old weights. The folder's other files, links
    and mode stay as they were. `claimed`: config.json is `_claim`'s empty marker, kept until replaced
    (removed, another export could claim the folder)."""
    config = Path("config.json")
    if not claimed:
        (out / config).unlink(missing_ok=True)
    for rel in sorted(files, key=lambda p: p == config):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(new / rel, out / rel)


__all__ = ["save_pretrained"]
