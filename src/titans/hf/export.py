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

import os
import shutil
import tempfile
from pathlib import Path

from titans._fs import ordinary_mode
from titans.data.tokenizers import Tokenizer
from titans.hf.modeling import TitansForCausalLM
from titans.hf.tokenization import special_token_ids, to_hf_tokenizer
from titans.models.lm import TitansLM


def save_pretrained(
    model: TitansLM, path: str | os.PathLike, tokenizer: Tokenizer | None = None
) -> list[Path]:
    """Save `model` (and `tokenizer`, when given) as a transformers folder; returns the files written.

    The tokenizer is converted before anything is written, so one that cannot be saved (a SentencePiece or
    tiktoken file) or that does not fit the model (more symbols than the model has ids) leaves no folder
    behind.
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
    if out.is_symlink() and out.is_dir():  # the folder it names is replaced, not the link
        out = Path(os.path.realpath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside `out`, then renamed into place: a kill or a failure part-way leaves the folder as it
    # was (a new config.json beside the old weights had loaded, their keys reported, as a random model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        TitansForCausalLM.from_titans(model, **ids).save_pretrained(tmp)
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(tmp)
        written = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
        for p in (tmp, *tmp.rglob("*")):  # transformers writes the weights 0600, tempfile the folder 0700
            ordinary_mode(p)
        if out.is_dir():
            _replace_folder(tmp, out)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / p for p in written]


def _replace_folder(new: Path, out: Path) -> None:
    """Put the folder `new` at `out`, an existing folder, by two renames; the files of `out` that `new`
    lacks are moved into it after (an export writes into a folder: a model card there stays)."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()  # a free name for the rename
    os.replace(out, old)
    os.replace(new, out)
    for p in sorted(old.rglob("*")):
        target = out / p.relative_to(old)
        if p.is_file() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, target)
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["save_pretrained"]
