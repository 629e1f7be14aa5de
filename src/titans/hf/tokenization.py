"""Our tokenizers as `transformers` tokenizers, so a saved folder works with `AutoTokenizer` and `pipeline`.

`to_hf_tokenizer(tokenizer) -> PreTrainedTokenizerFast` builds, with the `tokenizers` library, a fast
tokenizer that gives the same ids as ours:

- `ByteTokenizer`: a byte-level BPE with no merges whose 256 symbols have the ids of the bytes they stand
  for. It has no special tokens: every id is a byte of text (a special token would be matched in raw text,
  so a real character would encode as it). Nor has it a pad token: transformers reads every id equal to
  the pad id as padding, and a NUL byte is text. Batching prompts, which pads, is refused for want of one.
- `DNATokenizer`: one token per base, either case, with `<pad>`, `<eos>` and `<cls>` as special tokens.
  Like ours it has no unknown token: a letter other than A, C, G, T, N is an error ("Missing [UNK]
  token"), never a silent gap. Text that spells a special token ("<eos>") is text too, so an error, and
  decoding drops the special ids, as ours does.
- `HFTokenizer` (a `tokenizers` JSON file, e.g. one written by `train_bpe`): the file itself, with its eos
  as eos and pad token, less its post-processor (ours never adds the BOS/EOS of a template; transformers'
  add_special_tokens=True would).

Each returns the attention mask with the ids (`model_input_names`), so a batch padded by the tokenizer or by
the pipeline's batching reaches `TitansForCausalLM.forward` with its zeros, which it refuses (Titans states
are per-row streams); there are no token type ids.

SentencePiece and tiktoken files are refused with a ValueError that says so (transformers converts them
through its own slow tokenizer classes, which need packages this wrapper does not install).

`special_token_ids(tokenizer) -> dict` gives the `eos_token_id` / `pad_token_id` to write in the model's
config, so that `generate` and `pipeline` stop as our generation does and read as padding only an id that
never stands for text.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerFast

from titans.data.dna import BASES, SPECIALS, DNATokenizer
from titans.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer


def _byte_tokenizer():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    # ByteLevel maps every byte to one printable character; the BPE vocabulary gives that character the
    # byte's value as id, and with no merges every byte stays one token
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    from_char = _bytes_to_unicode()
    vocab = {from_char[b]: b for b in range(256)}
    if set(vocab) != set(alphabet):  # the library's table is GPT-2's; guard against it ever changing
        raise RuntimeError("tokenizers' ByteLevel alphabet is not GPT-2's byte table")
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to a printable character (the one `ByteLevel` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _dna_tokenizer():
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({b: len(SPECIALS) + i for i, b in enumerate(BASES)})
    tok = RustTokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # lower case is soft-masking, the same base
    tok.normalizer = normalizers.Sequence([normalizers.Replace(b.lower(), b) for b in BASES])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # decoding drops the special tokens, as ours does (they stand for no base)
    tok.decoder = decoders.Sequence([*(decoders.Replace(s, "") for s in SPECIALS), decoders.Fuse()])
    return tok


def to_hf_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` that encodes text to the ids `tokenizer` gives (see module docstring)."""
    # the mask travels with the ids so that the forward sees, and refuses, padding
    model_input_names = ["input_ids", "attention_mask"]
    common: dict[str, Any] = {"clean_up_tokenization_spaces": False, "model_input_names": model_input_names}
    if isinstance(tokenizer, ByteTokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer(), **common)
    if isinstance(tokenizer, DNATokenizer):
        pad, eos, cls = SPECIALS
        # split_special_tokens: text that spells "<eos>" is ordinary text (an error: '<' is no base), as ours
        return PreTrainedTokenizerFast(
            tokenizer_object=_dna_tokenizer(),
            pad_token=pad,
            eos_token=eos,
            cls_token=cls,
            split_special_tokens=True,
            **common,
        )
    if isinstance(tokenizer, HFTokenizer):
        from tokenizers import Tokenizer as RustTokenizer

        eos = None if tokenizer.eos_id is None else tokenizer._tok.id_to_token(tokenizer.eos_id)
        # no post-processor: ours encodes without special tokens (no BOS/EOS from a template), and
        # transformers' add_special_tokens=True would otherwise add them
        rust = RustTokenizer.from_file(str(tokenizer.path))
        rust.post_processor = None
        # split_special_tokens: text that spells "<|endoftext|>" is ordinary text, as in HFTokenizer
        return PreTrainedTokenizerFast(
            tokenizer_object=rust,
            eos_token=eos,
            pad_token=eos,
            split_special_tokens=True,
            **common,
        )
    raise ValueError(
        f"tokenizer {tokenizer.name!r} ({type(tokenizer).__name__}) cannot be saved as a transformers "
        "tokenizer: bytes, dna and tokenizers JSON files (e.g. from train_bpe) can"
    )


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """`eos_token_id` (the tokenizer's eos, or None) and `pad_token_id` (its pad token, else its eos, else
    None) for the model's config, the ids the transformers tokenizer has as eos and pad token.

    The pad id is never one that stands for text (the NUL byte training placed between byte documents, or
    the encoded blank line of a tokenizer without eos): `generate` builds its attention mask as
    `input_ids != pad_token_id`, so such a prompt would read as padded and be refused.
    """
    eos = tokenizer.eos_id
    pad = getattr(tokenizer, "pad_id", None)
    if pad is None:
        pad = eos
    return {
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
    }


__all__ = ["special_token_ids", "to_hf_tokenizer"]
