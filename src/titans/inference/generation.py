"""Autoregressive generation through the streaming state.

    out = generate(model, prompt, max_new_tokens=50, temperature=0.8, top_k=50)    # (B, T + n)

The prompt is read with chunked prefill, then each new token goes through the model alone, threading the
state: the cost per token is constant for the memory and sliding-window variants (the memory learns from
the generated tokens too, exactly as it would had they been in the prompt).

Streaming: ``on_token`` is called with every new column as it is sampled; `IncrementalDecoder` turns one
row's token ids into text pieces as they complete (``titans generate`` prints them as they come):

    decoder = IncrementalDecoder(tokenizer)
    generate(model, prompt, 50, on_token=lambda t: print(decoder.push(int(t[0])), end="", flush=True))
    print(decoder.finish())

Batches: all prompts of a batch have the same length (Titans states are per-row streams at one
position; there is no padding). Generate rows of different lengths in separate calls.

The decoding loop lives in `titans.models.streaming` (`TitansLM.generate` is the same call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from titans.data.tokenizers import CONTEXT_TOKENS, continuation_text
from titans.models.streaming import decode_step, generate, sample_next


class _Decodes(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDecoder:
    """Token ids in, text out as soon as it is complete: ``push(id)`` returns the new text (often "", while
    a character's bytes or a word's pieces are incomplete), ``finish()`` the rest. The pieces concatenate
    to ``tokenizer.decode(all ids)`` for byte-level tokenizers (bytes, byte-level BPE, SentencePiece with
    byte fallback).

    Each piece is decoded together with the tokens of the piece before it, so a tokenizer that decodes a
    word's leading space or a multi-byte character from context gets it right; text that ends in U+FFFD
    (an incomplete UTF-8 sequence) is held back until a later token completes it. ``context``: the ids
    the text continues (the prompt, already shown): the first piece is decoded after its last tokens, so
    that a SentencePiece tokenizer keeps the space its first word's "▁" stands for.
    """

    def __init__(self, tokenizer: _Decodes, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(i) for i in list(context)[-CONTEXT_TOKENS:]]
        if tokenizer.decode(self.ids).endswith("\ufffd"):  # a context cut mid-character: decoded alone
            self.ids = []
        self._prefix = 0  # ids[_prefix:_read] were emitted with the piece before the last one
        self._read = len(self.ids)  # ids[:_read] have been emitted (or shown before: the context)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        done = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd") and text.startswith(done):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(done) :]
        return ""

    def finish(self) -> str:
        """The text not emitted yet (an incomplete character at the end comes out as U+FFFD)."""
        done = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(done) :]


__all__ = ["IncrementalDecoder", "continuation_text", "decode_step", "generate", "sample_next"]
