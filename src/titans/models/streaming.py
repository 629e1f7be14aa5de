"""Streaming a model over tokens: chunked prefill, one decoding step, sampling, generation.

    logits, state = prefill(model, tokens, state=None, piece_len=None)
    out = generate(model, prompt, max_new_tokens=50, temperature=0.8, top_k=50)    # (B, T + n)

Prefill: `tokens` is a (B, T) tensor or numpy array, or an iterable of pieces (a streaming reader:
tensors (B, t) or (t,), lists or numpy arrays of ids; a list is always pieces of one stream, its rows read
one after the other), so the whole prompt never needs to be in memory. Pieces are re-cut to
`piece_len` tokens and fed through the model under `torch.no_grad()`, threading the state. Memory stays
bounded by the state plus one piece (the state of the memory and sliding-window variants does not grow
with context; the full-attention baseline's KV cache does). Streaming equals one parallel pass, so the
result does not depend on how the input is cut.

Generation reads the prompt with chunked prefill, then feeds each new token through the model alone,
threading the state: the cost per token is constant for the memory and sliding-window variants (the
memory learns from the generated tokens too, exactly as it would had they been in the prompt). All prompts
of a batch have the same length (Titans states are per-row streams at one position; there is no
padding): generate rows of different lengths in separate calls.

`titans.inference` re-exports these (`titans.inference.prefill`, `titans.inference.generation`), and
`TitansLM.generate` is `generate`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from titans.models.ids import check_token_dtype
from titans.models.state import TitansState, expand_state, state_batch_size
from titans.validation import check_int

if TYPE_CHECKING:  # TitansLM.generate calls into this module
    from titans.models.lm import TitansLM

# Default piece size: batch x piece_len x vocab near this many elements. Prefill computes the last
# position's logits only, so this now just bounds a piece's activations (shorter for large vocabularies).
_LOGITS_BUDGET = 1 << 24


def default_piece_len(model: TitansLM, batch_size: int = 1) -> int:
    """A piece length that is a multiple of the chunk size (and MAC segment) with batch x length x vocab
    near 16M: 4096 tokens for a byte vocabulary, about 512 for a 32K vocabulary."""
    cfg = model.config
    unit = cfg.spec.streaming_unit(cfg)
    target = max(64, min(4096, _LOGITS_BUDGET // max(1, batch_size * cfg.vocab_size)))
    return max(unit, target // unit * unit)


def _as_piece(item, batch_size: int | None, index: int, own: bool = False) -> Tensor:
    """One piece from a reader as a (B, t) int64 tensor; a 1-D piece is batch 1. own: never share memory
    with `item` (a reader may refill its array or tensor for the next piece)."""
    if isinstance(item, Tensor):
        t = item
    elif isinstance(item, np.ndarray):
        # a copy of a read-only array (np.frombuffer): torch warns on sharing memory it may not write
        t = torch.from_numpy(np.ascontiguousarray(item) if item.flags.writeable else np.array(item))
    elif isinstance(item, (list, tuple)):
        # no dtype: int64 would truncate floats and turn bools into 0 / 1 (the check below refuses them)
        try:
            t = torch.tensor(item)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"prefill: piece {index} is not a list of integer token ids ({e})") from None
    else:
        kind = type(item).__name__
        raise TypeError(f"prefill: piece {index} is a {kind}; expected a tensor, array or list")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"prefill: piece {index} must be (batch, len) or (len,), got shape {tuple(t.shape)}")
    if t.numel():  # an empty list comes out float32: it is no ids, so no wrong ones
        check_token_dtype(t, "prefill", f"piece {index}")
    if batch_size is not None and t.shape[0] != batch_size:
        raise ValueError(f"prefill: piece {index} has batch {t.shape[0]}, earlier pieces had {batch_size}")
    out = t.long()
    if own and out is t and not isinstance(item, (list, tuple)):  # int64: t.long() is t, item's memory
        out = out.clone()
    return out


def _whole(tokens) -> bool:
    """Whether `tokens` is the whole input (a tensor or numpy array: (B, T), or (T,) for batch 1) rather than
    an iterable of pieces (a reader, a list of pieces)."""
    return isinstance(tokens, (Tensor, np.ndarray))


def _whole_shape(tokens) -> tuple[int, int] | None:
    """(B, T) of a whole input (`_whole`) of 1 or 2 dims, else None."""
    if _whole(tokens) and tokens.ndim in (1, 2):
        return (1, tokens.shape[0]) if tokens.ndim == 1 else (tokens.shape[0], tokens.shape[1])
    return None


def iter_pieces(tokens: Tensor | np.ndarray | Iterable, piece_len: int) -> Iterator[Tensor]:
    """Re-cut the input into (B, <= piece_len) int64 pieces, in order.

    tokens: the whole input, a tensor or numpy array (B, T) (or (T,): batch 1); or an iterable of pieces
    (a reader; a list of pieces), each a tensor, numpy array or list of ids, (B, t) or (t,). A list is
    always pieces: a list of rows [[...], [...]] is one sequence, the rows read one after the other (pass
    a tensor or array for a batch of rows). Small pieces from a reader are buffered (one model call per
    `piece_len` tokens) in copies of their own, so a reader may refill one array or tensor for every piece;
    empty pieces are skipped. A piece yielded from a reader's item shares no memory with it.
    """
    if _whole(tokens):
        tokens = _as_piece(tokens, None, 0)
        for start in range(0, tokens.shape[1], piece_len):
            yield tokens[:, start : start + piece_len]
        return
    if isinstance(tokens, (str, bytes)):
        raise TypeError("prefill: got text; tokenize it first (tokens are integer ids)")
    buffer: list[Tensor] = []
    buffered = 0
    batch_size = None
    for i, item in enumerate(tokens):
        piece = _as_piece(item, batch_size, i, own=True)
        batch_size = piece.shape[0]
        if piece.shape[1] == 0:
            continue
        buffer.append(piece)
        buffered += piece.shape[1]
        if buffered >= piece_len:
            joined = torch.cat(buffer, dim=1) if len(buffer) > 1 else buffer[0]
            full = buffered // piece_len * piece_len
            for start in range(0, full, piece_len):
                yield joined[:, start : start + piece_len]
            rest = joined[:, full:]
            buffer, buffered = ([rest.clone()] if rest.shape[1] else []), rest.shape[1]
    if buffered:
        yield torch.cat(buffer, dim=1)


@torch.no_grad()
def prefill(
    model: TitansLM,
    tokens: Tensor | Iterable,
    state: TitansState | None = None,
    *,
    piece_len: int | None = None,
    progress: bool = False,
    total: int | None = None,
) -> tuple[Tensor | None, TitansState | None]:
    """Feed `tokens` through `model` piece by piece, threading `state`.

    tokens: (B, T) integer tensor or numpy array ((T,): batch 1), or an iterable of pieces (a list is
        always pieces, its rows one sequence: see `iter_pieces`).
    piece_len: tokens per model call (default `default_piece_len`); any value gives the same result.
    progress: show a tqdm bar (tokens); `total` sets its length for a reader of known size.
    Returns (logits of the last token (B, vocab), state after all tokens). With no tokens at all:
    (None, state) — the state unchanged.
    """
    shape = _whole_shape(tokens)
    if piece_len is None:
        piece_len = default_piece_len(model, shape[0] if shape else 1)
    check_int("prefill: piece_len", piece_len)
    if shape is not None and total is None:
        total = shape[1]
    device = next(model.parameters()).device
    last = None
    bar = None
    if progress:
        from tqdm.auto import tqdm  # only for the progress bar

        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prefill", dynamic_ncols=True)
    try:
        for piece in iter_pieces(tokens, piece_len):
            logits, state = model(piece.to(device), state, last_only=True)
            last = logits[:, -1]
            if bar is not None:
                bar.update(piece.shape[1])
    finally:
        if bar is not None:
            bar.close()
    return last, state


def decode_step(model: TitansLM, tokens: Tensor, state: TitansState | None) -> tuple[Tensor, TitansState]:
    """One incremental step: tokens (B, 1) -> (logits of the next token (B, vocab), new state)."""
    logits, state = model(tokens, state)
    return logits[:, -1], state


def check_sampling(
    temperature: float, top_k: int | None, top_p: float | None, caller: str = "generate"
) -> tuple[float, int | None, float | None]:
    """Refuse sampling options outside their ranges (a ValueError starting with `caller`); returns them as
    Python numbers (numpy scalars are numbers too)."""
    if (
        not isinstance(temperature, numbers.Real)
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(f"{caller}: temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1
    ):
        raise ValueError(f"{caller}: top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1
    ):
        raise ValueError(f"{caller}: top_p must be a number in (0, 1] or None, got {top_p!r}")
    return (
        float(temperature),
        None if top_k is None else int(top_k),
        None if top_p is None else float(top_p),
    )


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
    top_k most likely tokens and to the smallest set whose probability reaches top_p (nucleus; it always
    holds the most likely token). The logits must be finite: a row with a NaN or inf has no distribution
    (`generate` checks them). Options out of range (a negative or NaN temperature, top_k < 1, top_p outside
    (0, 1]) raise ValueError, as in `generate`.
    """
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p, "sample_next")
    return _sample(logits, temperature, top_k, top_p, generator, greedy)


def _sample(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    greedy: bool,
) -> Tensor:
    """`sample_next` without its checks: for `generate`'s loop, whose options were checked once."""
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # each row's max at 0: dividing by a tiny temperature sends the others to -inf, never the max to inf
    logits = logits - logits.amax(dim=-1, keepdim=True)
    if top_k is not None and top_k < logits.shape[-1]:
        # before the temperature: a huge one makes the tempered logits equal, hiding which are the top k
        kept = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, kept.indices, kept.values)
    # within the dtype's normal range: a subnormal temperature may be flushed to 0 (0 / 0 at the max), one
    # past its largest rounds to inf (-inf / inf for the tokens top_k dropped)
    info = torch.finfo(logits.dtype)
    logits = logits / min(max(temperature, info.tiny), info.max)
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the more likely tokens
        drop = before >= top_p
        drop[..., 0] = False  # the most likely token stays even where top_p rounds to 0 in the logits' dtype
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _token_id(value: object) -> int | None:
    """`value` as a token id (a Python or numpy integer, a 0-d integer tensor), else None (a bool, a float,
    anything else)."""
    if isinstance(value, Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _stop_tensor(stop_tokens: int | Iterable[int] | Tensor | None, vocab: int, device) -> Tensor | None:
    """stop_tokens (an id, an iterable of ids, a tensor or array of ids) -> (n,) int64, or None."""
    if stop_tokens is None:
        return None
    if isinstance(stop_tokens, (Tensor, np.ndarray)):
        stop_tokens = stop_tokens.tolist()  # Python numbers: an int for a 0-d tensor of an id
    if _token_id(stop_tokens) is not None:
        items = [stop_tokens]
    elif isinstance(stop_tokens, Iterable) and not isinstance(stop_tokens, (str, bytes)):
        items = list(stop_tokens)
    else:
        raise ValueError(
            f"generate: stop_tokens must be a token id or an iterable of ids, got {stop_tokens!r}"
        )
    ids = [_token_id(item) for item in items]
    bad = [item if i is None else i for item, i in zip(items, ids) if i is None or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"generate: stop_tokens must be token ids in [0, {vocab}), got {bad}")
    return torch.tensor(ids, dtype=torch.int64, device=device) if ids else None


def _non_finite(decoder) -> ValueError:
    """The error for next-token logits with a NaN or +inf (or a row of -inf): a static decoder's own
    (`check_finite` raises it) when its memory diverged, as the eager memory's check would have, else one
    on the logits. Both say "non-finite", which a session's guard reads."""
    if decoder is not None:
        decoder.check_finite()
    return ValueError(
        "generate: the next-token logits hold a non-finite value (nan or inf): no token can be drawn from "
        "them (inside a model, it usually means the parameters or the state have diverged)"
    )


def _sample_loop(
    model, prompt, logits, max_new_tokens, stops, on_token, return_state, sampling, *, state, decoder=None
) -> tuple[list[Tensor], TitansState | None]:
    """`generate`'s loop: sample, feed back (eagerly, or through `decoder`); returns (columns, state), the
    state the eager steps' (a decoder's stays in its buffers).

    Non-finite logits refuse the run (`_non_finite`). They are flagged on the device at every token and
    the flag read on the host only before each `on_token` call (which reads the token anyway) and once at
    the end: no token drawn from them is passed on or returned, and without `on_token` the check adds no
    host sync per token (the static steps have none)."""
    batch, device = prompt.shape[0], prompt.device
    columns = [prompt]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    pad = torch.zeros(batch, dtype=torch.int64, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)  # no non-finite logits so far
    sampled = not (sampling["greedy"] or sampling["temperature"] == 0)
    for step in range(max_new_tokens):
        # a row's max is NaN where it holds a NaN, inf where it holds +inf (a reduction far cheaper than
        # isfinite(logits).all() over a large vocabulary); a -inf among finite logits is a 0 probability
        ok = torch.isfinite(logits.amax(dim=-1)).all()
        finite &= ok
        if sampled:
            # multinomial refuses a non-finite row (on CUDA with a device-side assert, which ends the
            # process's CUDA use): draw from uniform logits instead, a token that is never passed on
            logits = torch.where(ok, logits, 0.0)
        token = _sample(logits, **sampling)
        done = False
        if stops is not None:
            token = torch.where(finished, pad, token)
            newly = torch.isin(token, stops) & ~finished
            pad = torch.where(newly, token, pad)
            finished |= newly
            done = bool(finished.all())
        columns.append(token[:, None])
        if on_token is not None:
            if not finite:
                raise _non_finite(decoder)
            on_token(token)
        last = done or step == max_new_tokens - 1
        if not last or return_state:  # the last token is only fed when the caller wants the state after it
            if decoder is None:
                logits, state = decode_step(model, token[:, None], state)
            else:
                logits = decoder.step(token[:, None], check_ids=False)  # drawn from the vocab's logits
        if done:
            break
    if not finite:
        raise _non_finite(decoder)
    return columns, state


@torch.no_grad()
def generate(
    model: TitansLM,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: int | Iterable[int] | Tensor | None = None,
    generator: torch.Generator | None = None,
    state: TitansState | None = None,
    greedy: bool = False,
    return_state: bool = False,
    piece_len: int | None = None,
    progress: bool = False,
    on_token: Callable[[Tensor], None] | None = None,
    compiled: bool | str = False,
    guards: str = "full",
) -> Tensor | tuple[Tensor, TitansState]:
    """Continue each prompt row by up to `max_new_tokens` tokens.

    prompt: (B, T) int64, T >= 1, all rows the same length. state: continue from a state (e.g. a document
        read earlier, `titans.models.state.load_state`); a batch-1 state is shared by all B rows.
    temperature / top_k / top_p / generator: sampling (see `sample_next`); greedy=True or temperature=0
        takes the argmax. A seeded `generator` reproduces samples.
    stop_tokens: an id or ids (ints, numpy integers, a tensor or array of ids); a row that emits one is
        finished and its later positions repeat that stop token. Generation ends early once every row is
        finished, so the output may be shorter than T + max_new_tokens.
    return_state: also return the state after every returned token (prompt and generated), ready to
        continue; finished rows have consumed their padding stop tokens too.
    on_token: called with each new column (B,) as it is produced (streaming output).
    compiled: decode through fixed state buffers (`titans.models.decode_graph.StaticDecoder`): True or
        "compile" compiles each step with torch.compile, "cuda_graph" replays CUDA graphs, "eager" runs the
        static step as it is; the same tokens as the default eager steps, up to float rounding. False (the
        default): eager steps. Any other value, and "cuda_graph" for a model off CUDA, is refused, whatever
        max_new_tokens.
    guards: with compiled, which of torch.compile's guards each step checks (`StaticDecoder`'s guards:
        "full" or "state"); checked even without compiled.
    Next-token logits with a NaN or inf raise ValueError ("non-finite") before any token drawn from them
    reaches `on_token` (see `_sample_loop`).
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
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, numbers.Integral)
        or max_new_tokens < 0
    ):
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    vocab = model.config.vocab_size
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    from titans.models.decode_graph import (  # same layer; it imports the blocks
        GUARDS,
        MODES,
        check_static_decoding,
        checkout,
    )

    if not (isinstance(compiled, bool) or (isinstance(compiled, str) and compiled in MODES)):
        raise ValueError(f"generate: compiled must be False, True or one of {MODES}, got {compiled!r}")
    if not (isinstance(guards, str) and guards in GUARDS):
        raise ValueError(f"generate: guards must be one of {GUARDS}, got {guards!r}")
    if on_token is not None and not callable(on_token):  # before the prompt is read, not after
        raise TypeError(f"generate: on_token must be a function of each new column or None, got {on_token!r}")
    device = next(model.parameters()).device
    if compiled == "cuda_graph" and device.type != "cuda":  # as StaticDecoder does, whatever max_new_tokens
        raise ValueError(f"generate: compiled='cuda_graph' needs a CUDA model, this one is on {device}")
    if compiled:  # also before the prompt is read, whatever max_new_tokens
        check_static_decoding(model, "generate")
    check_token_dtype(prompt, "generate", "prompt")
    prompt = prompt.to(device=device, dtype=torch.int64)
    stops = _stop_tensor(stop_tokens, vocab, device)
    batch = prompt.shape[0]
    if state is not None:
        model.check_state(state)
        if state_batch_size(state) != batch:
            state = expand_state(state, batch)

    logits, state = prefill(model, prompt, state, piece_len=piece_len, progress=progress)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, greedy=greedy)
    loop = (model, prompt, logits, max_new_tokens, stops, on_token, return_state, sampling)
    if compiled and max_new_tokens > int(not return_state):
        with checkout(model, state, "compile" if compiled is True else compiled, guards) as decoder:
            columns, _ = _sample_loop(*loop, state=None, decoder=decoder)
            decoder.check_finite()  # the steps skip the eager memory's per-token check
            if return_state:
                state = decoder.state()
    else:
        columns, state = _sample_loop(*loop, state=state)
    out = torch.cat(columns, dim=1)
    return (out, state) if return_state else out


__all__ = [
    "check_sampling",
    "decode_step",
    "default_piece_len",
    "generate",
    "iter_pieces",
    "prefill",
    "sample_next",
]
