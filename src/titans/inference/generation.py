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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import Tensor

from titans.inference.prefill import prefill
from titans.inference.state_io import expand_state, state_batch_size
from titans.models.lm import TitansLM, TitansState


class _Decodes(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDecoder:
    """Token ids in, text out as soon as it is complete: ``push(id)`` returns the new text (often "", while
    a character's bytes or a word's pieces are incomplete), ``finish()`` the rest. The pieces concatenate
    to ``tokenizer.decode(all ids)`` for byte-level tokenizers (bytes, byte-level BPE, SentencePiece with
    byte fallback).

    Each piece is decoded together with the tokens of the piece before it, so a tokenizer that decodes a
    word's leading space or a multi-byte character from context gets it right; text that ends in U+FFFD
    (an incomplete UTF-8 sequence) is held back until a later token completes it.
    """

    def __init__(self, tokenizer: _Decodes):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were emitted with the piece before the last one
        self._read = 0  # ids[:_read] have been emitted

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


def decode_step(model: TitansLM, tokens: Tensor, state: TitansState | None) -> tuple[Tensor, TitansState]:
    """One incremental step: tokens (B, 1) -> (logits of the next token (B, vocab), new state)."""
    logits, state = model(tokens, state)
    return logits[:, -1], state


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise ValueError(f"generate: temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"generate: top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p!r}")


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> Tensor:
    """Pick the next token of every row from logits (B, vocab) -> (B,) int64.

    greedy or temperature 0: argmax. Otherwise sample from softmax(logits / temperature) restricted to the
    top_k most likely tokens and to the smallest set whose probability reaches top_p (nucleus).
    """
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kept = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, kept.indices, kept.values)
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))  # the first is always kept
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _stop_tensor(stop_tokens: int | Iterable[int] | None, vocab: int, device) -> Tensor | None:
    if stop_tokens is None:
        return None
    ids = [stop_tokens] if isinstance(stop_tokens, int) else list(stop_tokens)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"generate: stop_tokens must be token ids in [0, {vocab}), got {bad}")
    return torch.tensor(ids, dtype=torch.int64, device=device) if ids else None


@torch.no_grad()
def generate(
    model: TitansLM,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    state: TitansState | None = None,
    greedy: bool = False,
    return_state: bool = False,
    piece_len: int | None = None,
    progress: bool = False,
    on_token: Callable[[Tensor], None] | None = None,
) -> Tensor | tuple[Tensor, TitansState]:
    """Continue each prompt row by up to `max_new_tokens` tokens.

    prompt: (B, T) int64, T >= 1, all rows the same length. state: continue from a state (e.g. a document
        read earlier, `titans.inference.state_io.load_state`); a batch-1 state is shared by all B rows.
    temperature / top_k / top_p / generator: sampling (see `sample_next`); greedy=True or temperature=0
        takes the argmax. A seeded `generator` reproduces samples.
    stop_tokens: a row that emits one of these ids is finished; its later positions repeat that stop
        token. Generation ends early once every row is finished, so the output may be shorter than
        T + max_new_tokens.
    return_state: also return the state after every returned token (prompt and generated), ready to
        continue; finished rows have consumed their padding stop tokens too.
    on_token: called with each new column (B,) as it is produced (streaming output).
    Returns out (B, T + n) with out[:, :T] == prompt, or (out, state).
    """
    if not isinstance(prompt, Tensor) or prompt.dim() != 2:
        shape = tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__
        raise ValueError(f"generate: prompt must be a (batch, seq) tensor of token ids, got {shape}")
    if prompt.shape[1] == 0:
        raise ValueError(
            "generate: the prompt is empty; give at least one token (the next-token logits come from the "
            "last prompt token, a saved state does not hold them)"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab = model.config.vocab_size
    _check_sampling(temperature, top_k, top_p)
    device = next(model.parameters()).device
    if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
        raise TypeError(f"generate: prompt must hold integer token ids, got dtype {prompt.dtype}")
    prompt = prompt.to(device=device, dtype=torch.int64)
    stops = _stop_tensor(stop_tokens, vocab, device)
    batch = prompt.shape[0]
    if state is not None:
        model.check_state(state)
        if state_batch_size(state) != batch:
            state = expand_state(state, batch)

    logits, state = prefill(model, prompt, state, piece_len=piece_len, progress=progress)
    columns = [prompt]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    pad = torch.zeros(batch, dtype=torch.int64, device=device)
    for step in range(max_new_tokens):
        token = sample_next(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, greedy=greedy
        )
        done = False
        if stops is not None:
            token = torch.where(finished, pad, token)
            newly = torch.isin(token, stops) & ~finished
            pad = torch.where(newly, token, pad)
            finished |= newly
            done = bool(finished.all())
        columns.append(token[:, None])
        if on_token is not None:
            on_token(token)
        last = done or step == max_new_tokens - 1
        if not last or return_state:  # the last token is only fed when the caller wants the state after it
            logits, state = decode_step(model, token[:, None], state)
        if done:
            break
    out = torch.cat(columns, dim=1)
    return (out, state) if return_state else out


__all__ = ["IncrementalDecoder", "decode_step", "generate", "sample_next"]
