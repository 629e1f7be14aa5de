"""Run a model on long-context samples: chunked prefill, greedy decoding, scoring.

    result = evaluate(model, tokenizer, samples, by="depth")     # NIAH; by="task" for BABILong
    print(format_table(result.table))

``model`` is anything called as ``logits, state = model(tokens, state=None)`` with tokens (B, T) int64 and
logits (B, T, vocab), where passing the returned state on continues the same sequences (``TitansLM`` does).
A prompt is read in pieces of ``prefill_chunk`` tokens under ``torch.no_grad``, so memory stays bounded by
the model's state (constant for the memory and sliding-window variants, a KV cache for full attention) and
one piece's logits; the answer is then decoded greedily, one token per call, through the same state.

Samples of equal prompt length are batched together (no padding: a padding token would be written into a
neural memory). A sample only needs ``prompt_ids``, ``answer``, ``max_new_tokens`` and the attributes the
table is keyed by (``length`` and ``depth`` or ``task``), as ``NeedleSample`` and ``BabiSample`` have.
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from titans.evaluation.haystack import TextTokenizer
from titans.evaluation.scoring import MATCHERS, AccuracyTable, table_from_samples
from titans.models.lm import TitansLM


class StreamingModel(Protocol):
    def __call__(self, tokens: Tensor, state: Any = None) -> tuple[Tensor, Any]: ...


class EvalSample(Protocol):
    prompt_ids: list[int]
    answer: str
    length: int

    @property
    def max_new_tokens(self) -> int: ...


def _model_device(model: Any) -> torch.device:
    params = getattr(model, "parameters", None)
    if params is not None:
        for p in params():
            return p.device
    return torch.device("cpu")


def _accepts_last_only(model: Any) -> bool:
    """Whether ``model`` takes ``last_only=`` (``TitansLM`` does: logits of the last position only, which
    spares the output head on the rest of a prompt piece). A model that only follows `StreamingModel`,
    ``model(tokens, state=None)``, is called without it."""
    # torch.compile and (Distributed)DataParallel wrappers forward **kwargs: ask the model they wrap
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module) or isinstance(
        model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    ):
        model = getattr(model, "_orig_mod", None) or model.module
    if isinstance(model, TitansLM):
        return True
    # a module's __call__ takes (*args, **kwargs) whatever its forward takes: read the forward's
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin or C callable): the protocol only
        return False
    return any(p.name == "last_only" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@torch.no_grad()
def prefill(model: StreamingModel, prompt: Tensor, *, prefill_chunk: int = 2048) -> tuple[Tensor, Any]:
    """Read ``prompt`` (B, T) in pieces of ``prefill_chunk`` tokens; return the last position's logits
    (B, vocab) and the state after the whole prompt."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prefill: prompt must be a non-empty (batch, seq) tensor, got {tuple(prompt.shape)}"
        )
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    extra = {"last_only": True} if _accepts_last_only(model) else {}
    state = None
    for start in range(0, prompt.shape[1], prefill_chunk):
        logits, state = model(prompt[:, start : start + prefill_chunk], state=state, **extra)
    return logits[:, -1], state


@torch.no_grad()
def greedy_generate(
    model: StreamingModel, prompt: Tensor, max_new_tokens: int, *, prefill_chunk: int = 2048
) -> Tensor:
    """Greedy continuation of ``prompt`` (B, T): returns the (B, max_new_tokens) generated ids.

    Logits that are NaN or infinite are a ValueError: their argmax is no answer the model gave (a NaN row
    decodes as token 0), so it must not be scored as one."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    last, state = prefill(model, prompt, prefill_chunk=prefill_chunk)
    out = []
    finite = torch.ones((), dtype=torch.bool, device=last.device)  # checked once, after the loop: no syncs
    for i in range(max_new_tokens):
        finite &= torch.isfinite(last).all()
        token = last.argmax(-1, keepdim=True)  # (B, 1)
        out.append(token)
        if i + 1 < max_new_tokens:  # the last token's logits are never needed
            logits, state = model(token, state=state)
            last = logits[:, -1]
    if not bool(finite):
        raise ValueError(
            f"the model's logits are not finite (NaN or inf) on a prompt of {prompt.shape[1]} tokens: "
            "no answer can be decoded from them"
        )
    return torch.cat(out, dim=1)


def predict(
    model: StreamingModel,
    tokenizer: TextTokenizer,
    samples: Sequence[EvalSample],
    *,
    batch_size: int = 8,
    prefill_chunk: int = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Decoded greedy answers, one per sample (``sample.max_new_tokens`` tokens each), in sample order.

    ``progress(done, total)`` is called after every batch.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(model, torch.nn.Module):
        model.eval()
    device = _model_device(model)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"sample {i} has an empty prompt")
        groups[len(s.prompt_ids)].append(i)
    predictions: list[str | None] = [None] * len(samples)
    done = 0
    for indices in groups.values():
        for start in range(0, len(indices), batch_size):
            batch = indices[start : start + batch_size]
            prompt = torch.tensor([samples[i].prompt_ids for i in batch], dtype=torch.long, device=device)
            n_new = max(samples[i].max_new_tokens for i in batch)
            generated = greedy_generate(model, prompt, n_new, prefill_chunk=prefill_chunk).tolist()
            for i, ids in zip(batch, generated):
                predictions[i] = tokenizer.decode(ids[: samples[i].max_new_tokens])
            done += len(batch)
            if progress is not None:
                progress(done, len(samples))
    return predictions  # type: ignore[return-value]


@dataclass
class EvalResult:
    """Per-sample predictions and their ``length x by`` accuracy table."""

    table: AccuracyTable
    predictions: list[str]
    correct: list[bool]
    seconds: float

    def records(self, samples: Sequence[Any], by: str | None) -> list[dict]:
        """One JSON-able dict per sample (length, the column key, answer, prediction, correct)."""
        rows = []
        for s, p, ok in zip(samples, self.predictions, self.correct):
            row = {"length": s.length, "answer": s.answer, "prediction": p, "correct": ok}
            if by is not None:
                row[by] = getattr(s, by)
            rows.append(row)
        return rows


def evaluate(
    model: StreamingModel,
    tokenizer: TextTokenizer,
    samples: Sequence[EvalSample],
    *,
    by: str | None = "depth",
    match: str = "exact",
    batch_size: int = 8,
    prefill_chunk: int = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Predict every sample and score it (``scoring`` rules: "exact", "prefix" or "contains")."""
    if match not in MATCHERS:
        raise ValueError(f"unknown match rule {match!r}: use one of {tuple(MATCHERS)}")
    if not samples:
        raise ValueError("evaluate: no samples")
    t0 = time.perf_counter()
    predictions = predict(
        model, tokenizer, samples, batch_size=batch_size, prefill_chunk=prefill_chunk, progress=progress
    )
    seconds = time.perf_counter() - t0
    table = table_from_samples(samples, predictions, by=by, match=match)
    correct = [MATCHERS[match](p, s.answer) for s, p in zip(samples, predictions)]
    return EvalResult(table, predictions, correct, seconds)
