"""`titans eval context`: next-token loss against position in a long text.

    titans eval context --checkpoint RUN [--data SPEC] [--length 65536] [--windows N] [--compare RUN,RUN]

Does a model get better or worse the more of a long text it has read? Each window of ``length`` tokens is
streamed through the model in pieces of ``--piece`` tokens, threading its state (``logits, state =
model(x, state)``), so memory stays constant in the length; every position's next-token loss is kept and
averaged over the windows within log-spaced position buckets (``position_buckets``: [0, 256), [256, 1024),
then doubling). Position p is the p-th input token: its loss scores the prediction of token p + 1 from the
p + 1 tokens read so far.

A memory model is also scored as its frozen twin (``frozen_twin``: the same weights with the memory's
writes off, ``TitansConfig.memory_write=False``): the "writing - frozen" column is what test-time learning
adds at each distance (negative: the writes help). ``--compare`` scores more checkpoints (same tokenizer)
on the very same windows.

Windows (``ContextWindows``): by default ``windows`` stretches of the token stream spread evenly over it
(``context_windows``; documents joined by their separator, as in training); ``--per-document`` takes whole
documents of at least length + 1 tokens instead, each from its start (``document_windows``). The text is
the checkpoint's held-out split unless ``--data`` names a source (all of it is used).

Writes JSON (every bucket of every model, per window too, a finer curve, the settings) to ``--out``
(default RUN_DIR/eval_context.json) and a PNG of loss against position (log x axis) next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from titans._fs import check_writable
from titans.data.sources import load_source
from titans.data.split import split_documents, split_tail
from titans.data.stream import TokenStream, encode_documents
from titans.data.tokenizers import Tokenizer
from titans.evaluation.args import set_threads, str_list
from titans.evaluation.perplexity import (
    add_changed_data_arg,
    add_text_field_arg,
    check_has_heldout_split,
    heldout_description,
    heldout_split,
    text_field_of,
    whole_source_stream,
)
from titans.evaluation.reporting import command_line
from titans.evaluation.scoring import new_figure, render_table, save_figure, write_json
from titans.models.lm import TitansLM
from titans.runtime.checkpoint import EVAL_CONTEXT_FILE, Checkpoint, CheckpointError, run_folder_of
from titans.runtime.loading import (
    load_checkpoint_from,
    load_weights,
    same_tokenizer,
    tokenizer_from_record,
)
from titans.training.metrics import plot_or_skip
from titans.training.model_io import load_model
from titans.validation import check_int, path_arg

log = logging.getLogger(__name__)

FIRST_BUCKET = 256  # the first bucket, [0, 256); the second ends at 1024, then every bucket doubles
SECOND_BUCKET = 1024
PLOT_BINS_PER_OCTAVE = 4  # bins of the finer curve (JSON "curve", the PNG)
FIRST_PLOT_BIN = 16  # its first bin: single early positions are too few tokens for a readable curve

# ---------------------------------------------------------------------------------------------------------
# Positions


def position_buckets(length: int) -> list[tuple[int, int]]:
    """Log-spaced position buckets [lo, hi) covering [0, length): [0, 256), [256, 1024), [1024, 2048),
    [2048, 4096), ..., the last one ending at ``length`` (cut short where ``length`` is no power of two).
    None is empty; ``length <= 256`` is the one bucket [0, length)."""
    check_int("length", length)
    edges = [0]
    for edge in (FIRST_BUCKET, SECOND_BUCKET):
        if edge < length:
            edges.append(edge)
    edge = SECOND_BUCKET * 2
    while edge < length:
        edges.append(edge)
        edge *= 2
    edges.append(length)
    return list(zip(edges[:-1], edges[1:]))


def plot_bins(length: int, per_octave: int = PLOT_BINS_PER_OCTAVE) -> list[tuple[int, int]]:
    """Finer log-spaced position bins [lo, hi) covering [0, length), about ``per_octave`` per doubling of
    the tokens read (position + 1); the first bin holds the first ``FIRST_PLOT_BIN`` positions (where the
    length is over 4 times that), the next few positions get one bin each."""
    check_int("length", length)
    num = max(2, int(math.log2(length + 1) * per_octave) + 1)
    read = np.unique(np.round(np.geomspace(1, length + 1, num)).astype(np.int64))  # tokens read: 1 .. L+1
    edges = [int(r) - 1 for r in read]  # as positions: 0 .. L
    edges[0], edges[-1] = 0, length
    if length > 4 * FIRST_PLOT_BIN:
        edges = [0, FIRST_PLOT_BIN] + [e for e in edges if e > FIRST_PLOT_BIN]
    return list(zip(edges[:-1], edges[1:]))


def bucket_means(losses: np.ndarray, buckets: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """losses (W, L) -> (mean over windows and positions of each bucket (K,), mean of each window in each
    bucket (W, K)), in float64."""
    if losses.ndim != 2:
        raise ValueError(f"losses must be (windows, length), got shape {losses.shape}")
    per_window = np.stack([losses[:, lo:hi].astype(np.float64).mean(axis=1) for lo, hi in buckets], axis=1)
    return per_window.mean(axis=0), per_window


def _tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def bucket_label(bucket: tuple[int, int]) -> str:
    """(1024, 2048) -> "1K-2K"."""
    return f"{_tokens_label(bucket[0])}-{_tokens_label(bucket[1])}"


# ---------------------------------------------------------------------------------------------------------
# Windows


@dataclass(frozen=True)
class ContextWindows:
    """The windows every model is scored on.

    inputs, targets: (W, L) int64, targets[:, p] = the token after inputs[:, p].
    origins: where each window comes from: "token S" (its start in the stream) or a document id.
    mode: "stream" or "per-document". requested: the number of windows asked for (W may be fewer).
    """

    inputs: np.ndarray
    targets: np.ndarray
    origins: tuple[str, ...]
    mode: str
    requested: int

    @property
    def count(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def length(self) -> int:
        return int(self.inputs.shape[1])


def _too_short(what: str, have: int, length: int) -> str:
    allows = f"the longest length it allows is {have - 1}" if have >= 2 else "it allows no length at all"
    return f"{what} has {have} tokens; --length {length} needs {length + 1} (length + 1), {allows}"


def context_windows(
    tokens: TokenStream | np.ndarray, length: int, windows: int, *, what: str = "the text"
) -> ContextWindows:
    """``windows`` non-overlapping windows of ``length + 1`` tokens (inputs, and targets shifted by one)
    spread evenly over a token stream (as ``titans.data.loader.EvalWindows`` places them); fewer, with a
    warning, when the stream holds fewer. ``what`` names the stream in errors."""
    check_int("length", length)
    check_int("windows", windows)
    arr = np.asarray(tokens.tokens if isinstance(tokens, TokenStream) else tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat (n,) array, got shape {arr.shape}")
    n = int(arr.shape[0])
    if n < length + 1:
        raise ValueError(_too_short(what, n, length))
    available = (n - 1) // length
    count = min(windows, available)
    if count < windows:
        log.warning(
            "%s has room for %d windows of %d tokens; scoring %d, not %d", what, count, length, count, windows
        )
    starts = (np.arange(count, dtype=np.int64) * available) // count * length  # evenly spread, distinct
    rows = np.stack([arr[s : s + length + 1].astype(np.int64) for s in starts])
    origins = tuple(f"token {int(s)}" for s in starts)
    return ContextWindows(rows[:, :-1], rows[:, 1:], origins, "stream", windows)


def document_windows(
    documents: Iterable[tuple[str, np.ndarray]], length: int, windows: int, *, what: str = "the text"
) -> ContextWindows:
    """Per-document windows: of the documents ((id, tokens) pairs, in order) with at least ``length + 1``
    tokens, up to ``windows`` spread evenly over them, each taken from its start (its first length + 1
    tokens). Refuses, naming the longest document, when none is long enough."""
    check_int("length", length)
    check_int("windows", windows)
    long_enough: list[tuple[str, np.ndarray]] = []
    longest: tuple[str, int] | None = None
    for doc_id, tokens in documents:
        n = int(len(tokens))
        if longest is None or n > longest[1]:
            longest = (doc_id, n)
        if n >= length + 1:
            long_enough.append((doc_id, tokens))
    if longest is None:
        raise ValueError(f"{what} holds no documents")
    if not long_enough:
        raise ValueError(
            _too_short(
                f"no document of {what} is long enough: the longest, {longest[0]!r},", longest[1], length
            )
        )
    count = min(windows, len(long_enough))
    if count < windows:
        log.warning(
            "%s has %d documents of >= %d tokens; scoring %d, not %d", what, count, length + 1, count, windows
        )
    picks = (np.arange(count, dtype=np.int64) * len(long_enough)) // count  # evenly spread, distinct
    rows = np.stack([np.asarray(long_enough[i][1][: length + 1], dtype=np.int64) for i in picks])
    origins = tuple(long_enough[i][0] for i in picks)
    return ContextWindows(rows[:, :-1], rows[:, 1:], origins, "per-document", windows)


def source_documents(
    spec: str, tokenizer: Tokenizer, *, text_field: str = "text", heldout_fraction: float | None = None
) -> list[tuple[str, np.ndarray]]:
    """The non-empty documents of a source as (id, int64 token ids), in order. With ``heldout_fraction``:
    only the held-out part, as the trainer splits it (``titans.data.stream``): the held-out documents, or
    the tail of a single-document source."""
    source = load_source(spec, text_field=text_field)
    docs = [(d.id, d.text) for d in source.documents()]
    if heldout_fraction is not None:  # split over every id, empty documents too, as the trainer does
        split = split_documents([i for i, _ in docs], heldout_fraction, source=source.spec)
        if split.tail_fraction is not None:
            docs = [(i, split_tail(text, split.tail_fraction)[1]) for i, text in docs]
        else:
            heldout = set(split.heldout_ids)
            docs = [(i, text) for i, text in docs if i in heldout]
    docs = [(i, text) for i, text in docs if text]
    return list(zip([i for i, _ in docs], encode_documents(tokenizer, [text for _, text in docs])))


# ---------------------------------------------------------------------------------------------------------
# Scoring


def _as_ids(x: np.ndarray | Tensor, name: str) -> Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if not isinstance(t, Tensor) or t.dim() != 2:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a (windows, length) array of token ids, got {shape}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    return t.long()


@torch.no_grad()
def per_token_losses(
    model: TitansLM,
    inputs: np.ndarray | Tensor,
    targets: np.ndarray | Tensor,
    piece: int = 2048,
    *,
    batch_size: int = 8,
    device: torch.device | str | None = None,
) -> np.ndarray:
    """Next-token loss (nats) at every position: inputs, targets (W, L) -> (W, L) float32.

    Windows are scored ``batch_size`` at a time, each streamed from an empty state in pieces of ``piece``
    tokens with the state threaded through (eval mode, no gradients): only the state and one piece's
    logits are alive at once, so memory does not grow with L. Equal to one forward pass over the whole
    window (streaming does not depend on the cut). ``device``: the model is moved there (default: where
    it is).
    """
    check_int("piece", piece)
    check_int("batch_size", batch_size)
    x_all, y_all = _as_ids(inputs, "inputs"), _as_ids(targets, "targets")
    if x_all.shape != y_all.shape:
        raise ValueError(f"inputs {tuple(x_all.shape)} and targets {tuple(y_all.shape)} differ in shape")
    if device is not None:
        model.to(device)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    windows, length = x_all.shape
    out = np.empty((windows, length), dtype=np.float32)
    try:
        for b in range(0, windows, batch_size):
            x, y = x_all[b : b + batch_size].to(device), y_all[b : b + batch_size].to(device)
            state = None
            for s in range(0, length, piece):
                logits, state = model(x[:, s : s + piece], state)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: fp32 loss
                nll = F.cross_entropy(logits.flatten(0, 1), y[:, s : s + piece].flatten(), reduction="none")
                out[b : b + batch_size, s : s + piece] = nll.view(x.shape[0], -1).float().cpu().numpy()
    finally:
        model.train(was_training)
    return out


def frozen_twin(model: TitansLM) -> TitansLM | None:
    """The same model with the memory's writes off (``memory_write=False``: every token reads the
    memory's initial weights, nothing is learned at test time), on the model's device and dtype, in eval
    mode; None for a model without a memory, or whose memory never writes (it would be its own twin, its
    "writing - frozen" 0 by construction). The caller's RNG is left as it was."""
    cfg = model.config
    if not cfg.memory_write or not any(cfg.has_memory(i) for i in range(cfg.depth)):
        return None
    param = next(model.parameters())
    with torch.random.fork_rng(devices=[]):  # the fresh init is overwritten: do not move the caller's RNG
        twin = TitansLM(dataclasses.replace(cfg, memory_write=False))
    twin.to(device=param.device, dtype=param.dtype)  # before loading, so no weight is rounded on the way
    load_weights(twin, model.state_dict())
    return twin.eval()


# ---------------------------------------------------------------------------------------------------------
# Results


@dataclass
class ModelCurve:
    """One model's loss against position.

    bucket_loss: (K,) mean loss (nats/token) per bucket; window_loss: (W, K) per window and bucket;
    tokens: (K,) tokens scored per bucket (W x bucket width); curve: mean per ``plot_bins`` bin.
    """

    label: str
    variant: str
    frozen: bool
    bucket_loss: list[float]
    window_loss: list[list[float]]
    tokens: list[int]
    mean_loss: float
    curve: list[float]
    seconds: float | None = None
    checkpoint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def context_curve(
    label: str,
    losses: np.ndarray,
    *,
    variant: str,
    frozen: bool = False,
    seconds: float | None = None,
    checkpoint: str | None = None,
) -> ModelCurve:
    """Per-token losses (W, L) summarised over ``position_buckets(L)`` and ``plot_bins(L)``."""
    length = losses.shape[1]
    buckets = position_buckets(length)
    mean, per_window = bucket_means(losses, buckets)
    fine, _ = bucket_means(losses, plot_bins(length))
    return ModelCurve(
        label=label,
        variant=variant,
        frozen=frozen,
        bucket_loss=[float(v) for v in mean],
        window_loss=[[float(v) for v in row] for row in per_window],
        tokens=[int(losses.shape[0] * (hi - lo)) for lo, hi in buckets],
        mean_loss=float(losses.astype(np.float64).mean()),
        curve=[float(v) for v in fine],
        seconds=seconds,
        checkpoint=checkpoint,
    )


@dataclass
class ContextResult:
    """Every model's curve over the same windows; ``twin`` = (writing label, frozen label) when a frozen
    twin was scored."""

    length: int
    windows: int
    curves: list[ModelCurve] = field(default_factory=list)
    twin: tuple[str, str] | None = None

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return position_buckets(self.length)

    def curve(self, label: str) -> ModelCurve:
        for c in self.curves:
            if c.label == label:
                return c
        raise KeyError(f"no model labelled {label!r}; have {[c.label for c in self.curves]}")

    def writing_minus_frozen(self) -> list[float] | None:
        """Per bucket: the writing model's loss minus its frozen twin's (negative: the writes help)."""
        if self.twin is None:
            return None
        writing, frozen = (self.curve(label) for label in self.twin)
        return [w - f for w, f in zip(writing.bucket_loss, frozen.bucket_loss)]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "length": self.length,
            "windows": self.windows,
            "buckets": [list(b) for b in self.buckets],
            "bucket_labels": [bucket_label(b) for b in self.buckets],
            "models": {c.label: c.to_dict() for c in self.curves},
            "curve_bins": [list(b) for b in plot_bins(self.length)],
        }
        if self.twin is not None:
            out["writing_minus_frozen"] = {
                "writing": self.twin[0],
                "frozen": self.twin[1],
                "per_bucket": self.writing_minus_frozen(),
            }
        return out


def _unique(label: str, taken: set[str]) -> str:
    out, k = label, 2
    while out in taken:
        out, k = f"{label} #{k}", k + 1
    return out


ModelOrLoader = TitansLM | Callable[[], TitansLM]


def evaluate_context(
    models: Mapping[str, ModelOrLoader],
    windows: ContextWindows,
    *,
    piece: int = 2048,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    frozen: bool = True,
    on_curve: Callable[[ModelCurve], None] | None = None,
) -> ContextResult:
    """Score every model (label -> model, or a function loading it, called when its turn comes and dropped
    after) on the same windows. With ``frozen``, the first model's frozen twin is scored right after it,
    labelled "<variant> frozen twin" (skipped for a model without memory). ``on_curve`` sees each curve as
    it is finished (progress). A NaN or infinite loss (the model's outputs are not finite) is a ValueError
    naming the model, the window and the position."""
    if not models:
        raise ValueError("evaluate_context: no models to score")
    result = ContextResult(windows.length, windows.count)
    for i, (label, entry) in enumerate(models.items()):
        model = entry if isinstance(entry, TitansLM) else entry()
        todo = [(label, model, False)]
        if frozen and i == 0:
            twin = frozen_twin(model)
            if twin is not None:
                twin_label = _unique(f"{model.config.variant} frozen twin", set(models))
                todo.append((twin_label, twin, True))
                result.twin = (label, twin_label)
        for name, m, is_twin in todo:
            t0 = time.perf_counter()
            losses = per_token_losses(
                m, windows.inputs, windows.targets, piece, batch_size=batch_size, device=device
            )
            seconds = time.perf_counter() - t0
            _check_finite(name, losses, windows)
            curve = context_curve(name, losses, variant=m.config.variant, frozen=is_twin, seconds=seconds)
            result.curves.append(curve)
            if on_curve is not None:
                on_curve(curve)
        del model, todo
    return result


def _check_finite(label: str, losses: np.ndarray, windows: ContextWindows) -> None:
    """A NaN or infinite loss means the model's outputs are not finite: an error, not a curve of NaN."""
    bad = ~np.isfinite(losses)
    if bad.any():
        w, p = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{label}: the next-token loss is {losses[w, p]} at position {p} of window {w} "
            f"({windows.origins[w]}): the model's outputs are not finite (NaN or inf logits); "
            f"{int(bad.sum())} of {bad.size} positions"
        )


def format_context_table(result: ContextResult) -> str:
    """Bucket rows (and "all"), one loss column (nats/token) per model, and "writing - frozen" when a
    frozen twin was scored."""
    diff = result.writing_minus_frozen()
    head = ["positions"] + [c.label for c in result.curves] + (["writing - frozen"] if diff else [])
    lines = [head]
    for k, bucket in enumerate(result.buckets):
        row = [bucket_label(bucket)] + [f"{c.bucket_loss[k]:.4f}" for c in result.curves]
        lines.append(row + ([f"{diff[k]:+.4f}"] if diff else []))
    total = ["all"] + [f"{c.mean_loss:.4f}" for c in result.curves]
    if diff:
        writing, frozen = (result.curve(label) for label in result.twin)
        total.append(f"{writing.mean_loss - frozen.mean_loss:+.4f}")
    lines.append(total)
    return render_table(lines)


def plot_context(
    result: ContextResult, png_path: str | Path, *, title: str | None = None, train_length: int | None = None
) -> Path:
    """Save loss (nats/token) against tokens read (position + 1, log axis): each model's finer curve
    (``plot_bins``), a frozen twin dashed, and a dotted line at ``train_length``. Needs matplotlib."""
    bins = plot_bins(result.length)
    x = [math.sqrt((lo + 1) * hi) for lo, hi in bins]  # the geometric middle of the bin's tokens read
    fig = new_figure((7.5, 4.5))
    ax = fig.add_subplot()
    for c in result.curves:
        ax.plot(x, c.curve, linestyle="--" if c.frozen else "-", linewidth=1.5, label=c.label)
    if train_length is not None and train_length < result.length:
        ax.axvline(
            train_length, color="grey", linestyle=":", linewidth=1, label=f"training length {train_length}"
        )
    ax.set_xscale("log")
    ax.set_xlabel("tokens read (position + 1)")
    ax.set_ylabel("next-token loss (nats/token)")
    ax.set_title(title or f"loss against position: {result.windows} windows x {result.length} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, png_path)


# ---------------------------------------------------------------------------------------------------------
# titans eval context


def _saved_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """A trainer checkpoint's tokenizer, without building its model."""
    saved = ckpt.config
    if not {"train", "model"} <= set(saved):
        raise CheckpointError(
            f"{str(ckpt.path)!r} was not written by the titans trainer (no train/model config)"
        )
    record = saved.get("tokenizer") or {"spec": saved["train"].get("tokenizer", "bytes")}
    return tokenizer_from_record(record, ckpt.path)


def _other_heldout(cfg, mine: Checkpoint, other: Checkpoint) -> str | None:
    """How run ``other`` held out other text than ``mine`` (``cfg``: its TrainConfig), or None: by the
    held-out digests both checkpoints record, else by the data and the split settings."""
    digests = [(c.trainer_state.get("data") or {}).get("heldout") for c in (mine, other)]
    if all(digests):
        return None if digests[0] == digests[1] else "its held-out tokens differ"
    train = other.config.get("train", {})
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}  # a field its config predates
    for name in ("data", "heldout_fraction", "text_field"):
        theirs = train.get(name, defaults[name])
        if theirs != getattr(cfg, name):
            return f"{name} {theirs!r}, not {getattr(cfg, name)!r}"
    return None


def _describe(t: Tokenizer) -> str:
    return f"{t.name!r} ({t.vocab_size} symbols)"


def check_context_args(args: argparse.Namespace) -> None:
    """Refuse bad numbers and labels before any work."""
    for name in ("length", "windows", "piece", "batch_size"):
        check_int(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.labels is not None:
        want = 1 + len(args.compare or [])
        if len(args.labels) != want:
            raise ValueError(
                f"--labels: {len(args.labels)} label(s) for {want} model(s); give one for --checkpoint and "
                "one for each --compare run, in order"
            )
        if len(set(args.labels)) != want or any(not name.strip() for name in args.labels):
            raise ValueError(f"--labels must be distinct and non-empty, got {args.labels}")


def _load_windows(
    args: argparse.Namespace, cfg, tokenizer: Tokenizer, checkpoint: Checkpoint
) -> tuple[ContextWindows, str]:
    """The windows ``--data`` / ``--per-document`` ask for, and a description of the text. Without
    ``--data``, ``checkpoint``'s held-out split, checked against its record of its data (`heldout_split`)."""
    if args.data is None:  # the checkpoint's held-out split, as `titans eval ppl` scores it
        data_state = checkpoint.trainer_state.get("data") or {}
        # built (cached) also for --per-document: it checks the split is still the run's
        stream, change = heldout_split(cfg, tokenizer, data_state, allow_changed=args.allow_changed_data)
        desc, what = heldout_description(cfg, change), f"the held-out split of {cfg.data!r}"
        if args.per_document:
            docs = source_documents(
                cfg.data, tokenizer, text_field=cfg.text_field, heldout_fraction=cfg.heldout_fraction
            )
            return document_windows(docs, args.length, args.windows, what=what), desc
        return context_windows(stream, args.length, args.windows, what=what), desc
    what = f"text source {args.data!r}"
    if args.per_document:
        docs = source_documents(args.data, tokenizer, text_field=text_field_of(args))
        return document_windows(docs, args.length, args.windows, what=what), args.data
    stream = whole_source_stream(args.data, tokenizer, text_field=text_field_of(args))
    return context_windows(stream, args.length, args.windows, what=what), args.data


def run_context(args: argparse.Namespace) -> int:
    """``titans eval context``: score the checkpoint (its frozen twin, the compared runs) on long windows,
    print the table, write JSON and PNG."""
    set_threads(args)
    text_field_of(args)  # refused without --data before anything loads
    loaded = load_checkpoint_from(args.checkpoint)
    out = Path(args.out) if args.out else run_folder_of(loaded.path) / EVAL_CONTEXT_FILE
    check_writable(out, {"--data": args.data})  # first: a folder (`--out .`) is named as one
    png = out.with_suffix(".png")
    if png == out:
        raise ValueError(
            f"--out {args.out!r} ends in .png: the plot is written beside the JSON under that name"
        )
    check_writable(png, {"--data": args.data})
    model, cfg, tokenizer = load_model(loaded, map_location=args.device)
    compares: list[tuple[str, Checkpoint]] = []  # all checked before any scoring
    if args.data is None:
        check_has_heldout_split(loaded)
    for run in args.compare or []:
        other = load_checkpoint_from(run)
        other_tokenizer = _saved_tokenizer(other)
        if not same_tokenizer(tokenizer, other_tokenizer):
            raise ValueError(
                f"--compare {run!r} was trained with tokenizer {_describe(other_tokenizer)}, --checkpoint "
                f"with {_describe(tokenizer)}: losses over different tokens cannot be compared"
            )
        if args.data is None:  # each is scored on the --checkpoint's held-out split: none trained on it
            check_has_heldout_split(other)
            mismatch = _other_heldout(cfg, loaded, other)
            if mismatch:
                raise ValueError(
                    f"--compare {run!r} held out other text than --checkpoint ({mismatch}), so part of the "
                    "held-out split scored may be text it trained on: score all of them on other text "
                    "with --data"
                )
        compares.append((run, other))
    win, data_desc = _load_windows(args, cfg, tokenizer, loaded)
    if win.count < win.requested:
        print(
            f"note: {data_desc} has room for {win.count} windows of {win.length} tokens, not {win.requested}"
        )

    names = args.labels or [f"{model.config.variant} ({args.checkpoint})"] + [
        f"{other.config['model'].get('variant', '?')} ({run})" for run, other in compares
    ]
    label = names[0]
    models: dict[str, ModelOrLoader] = {label: model}
    paths = {label: str(loaded.path)}
    for name, (_, other) in zip(names[1:], compares):  # each built on the device only when its turn comes
        name = _unique(name, set(models))
        models[name] = lambda other=other: load_model(other, map_location=args.device)[0]
        paths[name] = str(other.path)
    print(
        f"{data_desc}: {win.count} {win.mode} windows x {win.length} tokens, "
        f"pieces of {args.piece} tokens, {win.count * win.length} tokens per model"
    )

    def report(curve: ModelCurve) -> None:
        print(f"  {curve.label}: loss {curve.mean_loss:.4f} nats/token ({curve.seconds:.1f}s)")

    result = evaluate_context(
        models,
        win,
        piece=args.piece,
        batch_size=args.batch_size,
        device=args.device,
        frozen=not args.no_frozen,
        on_curve=report,
    )
    for c in result.curves:  # the twin has the weights of the --checkpoint
        c.checkpoint = paths[label] if c.frozen else paths.get(c.label)

    payload = {
        "task": "context",
        "checkpoint": str(loaded.path),
        "step": loaded.step,
        "weights": loaded.weights_id,
        "compare": [str(other.path) for _, other in compares],
        "data": data_desc,
        "mode": win.mode,
        "piece": args.piece,
        "batch_size": args.batch_size,
        "windows_requested": win.requested,
        "train_seq_len": cfg.seq_len,
        "window_origins": list(win.origins),
        **result.to_dict(),  # length, windows, buckets, models, curve bins, writing - frozen
        "command": command_line(args),
    }
    write_json(out, payload)
    print("next-token loss (nats/token) by position")
    print(format_context_table(result))
    title = f"{data_desc}: {win.count} windows x {win.length} tokens"
    drawn = plot_or_skip(lambda: plot_context(result, png, title=title, train_length=cfg.seq_len), png)
    print(f"wrote {out} and {png}" if drawn else f"wrote {out}")
    return 0


def add_parser(evals) -> None:
    """Register ``titans eval context`` in the ``evals`` sub-parser collection."""
    p = evals.add_parser(
        "context", help="next-token loss against position in long texts (log-spaced buckets)"
    )
    p.add_argument(
        "--checkpoint",
        type=path_arg,
        required=True,
        help="a checkpoint folder or a run folder (newest checkpoint)",
    )
    p.add_argument(
        "--data", default=None, help="text source to use in full (default: the checkpoint's held-out split)"
    )
    add_text_field_arg(p)
    add_changed_data_arg(p)
    p.add_argument("--length", type=int, default=65536, help="tokens per window (positions scored)")
    p.add_argument("--windows", type=int, default=8, help="windows (spread over the text) or documents")
    p.add_argument(
        "--per-document",
        action="store_true",
        help="score documents of at least --length + 1 tokens, each from its start, not stretches of the "
        "joined stream",
    )
    p.add_argument(
        "--compare",
        type=str_list,
        default=None,
        metavar="RUN,RUN",
        help="more checkpoints (same tokenizer) scored on the same windows",
    )
    p.add_argument(
        "--labels",
        type=str_list,
        default=None,
        metavar="NAME,NAME",
        help="names of the models in the table, JSON and plot: --checkpoint's, then each --compare run's "
        "(default: variant (path))",
    )
    p.add_argument("--no-frozen", action="store_true", help="skip the frozen twin (memory writes off)")
    p.add_argument("--piece", type=int, default=2048, help="tokens per streamed forward call")
    p.add_argument("--batch-size", type=int, default=8, help="windows streamed together")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is best on a busy machine)"
    )
    p.add_argument(
        "--out",
        type=path_arg,
        default=None,
        help="JSON output, the PNG beside it (default: RUN_DIR/eval_context.json; a checkpoint folder "
        "outside a run: in it)",
    )
    p.set_defaults(func=run_context, check=check_context_args)
