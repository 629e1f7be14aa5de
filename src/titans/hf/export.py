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
from pathlib import Path

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
    before = {p for p in out.rglob("*") if p.is_file()} if out.is_dir() else set()
    times = {p: p.stat().st_mtime_ns for p in before}
    TitansForCausalLM.from_titans(model, **ids).save_pretrained(out)
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(out)
    return sorted(
        p for p in out.rglob("*") if p.is_file() and (p not in before or p.stat().st_mtime_ns != times[p])
    )


__all__ = ["save_pretrained"]
