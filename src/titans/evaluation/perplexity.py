"""Held-out language-modelling quality: mean token loss, perplexity and bits per byte.

    result = evaluate_perplexity(model, EvalWindows(stream, seq_len=512, num_windows=64), device="cpu")
    result.loss, result.ppl, result.bpb

Every window is read from a fresh memory state (``state=None``), as in training, so the numbers measure
what the model does with ``seq_len`` tokens of context. Under torch.distributed each rank evaluates its
share of the windows (``EvalWindows`` shards them) and the sums are all-reduced, so every rank returns the
same result.

``titans eval ppl --checkpoint C [--data SPEC] [--seq-len N] [--windows K]`` runs this on a checkpoint's own
held-out split, or on all of the text named by ``--data`` (see ``titans.data.sources``).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titans.data.loader import EvalWindows
from titans.data.sources import load_source
from titans.data.stream import TokenStream, encode_documents, separator_ids, token_dtype
from titans.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class PerplexityResult:
    """loss: mean next-token NLL (nats); ppl = exp(loss); bpb: bits per UTF-8 byte; tokens: targets scored."""

    loss: float
    ppl: float
    bpb: float | None
    tokens: int
    windows: int
    seq_len: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast to ``dtype`` on ``device``'s type; a no-op context when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate_perplexity(
    model: nn.Module,
    windows: EvalWindows,
    *,
    device: str | torch.device = "cpu",
    autocast_dtype: torch.dtype | None = None,
    lockstep: bool = False,
) -> PerplexityResult:
    """Score ``windows`` with ``model`` (``logits, state = model(tokens)``); see the module docstring.

    ``lockstep``: every rank runs the same number of forward passes (needed when the forward itself is a
    collective, as with FSDP); ranks with fewer windows repeat a batch whose loss is not counted.
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    distributed = dist.is_available() and dist.is_initialized()
    batches = list(windows)
    n_batches = len(batches)
    if lockstep and distributed:
        t = torch.tensor([n_batches], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n_batches = int(t.item())
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for i in range(n_batches):
            counted = i < len(batches)
            if counted:
                inputs, targets = batches[i]
            elif batches:  # lockstep padding: repeat a batch, not counted
                inputs, targets = batches[-1]
            else:  # this rank has no windows at all (fewer windows than ranks)
                inputs = targets = torch.zeros(1, windows.seq_len, dtype=torch.long)
            with autocast_context(device, autocast_dtype):
                logits, _ = model(inputs.to(device))
            nll = F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(), reduction="sum")
            if counted:
                nll_sum += nll.double()
                count += targets.numel()
    finally:
        model.train(was_training)
    if distributed:
        totals = torch.stack([nll_sum, count])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        nll_sum, count = totals[0], totals[1]
    if count.item() == 0:
        raise ValueError("evaluate_perplexity: no held-out windows to score")
    loss = float(nll_sum / count)
    bpb = windows.bits_per_byte(loss) if windows.bytes_per_token is not None else None
    return PerplexityResult(
        loss=loss,
        ppl=math.exp(min(loss, 700.0)),  # exp overflows a float past ~709
        bpb=bpb,
        tokens=int(count.item()),
        windows=windows.total_windows,
        seq_len=windows.seq_len,
    )


def whole_source_stream(spec: str, tokenizer: Tokenizer, text_field: str = "text") -> TokenStream:
    """All documents of a source as one token stream (each followed by the separator), for evaluating on
    text that is held out by construction (a file the model never saw)."""
    source = load_source(spec, text_field=text_field)
    sep = np.asarray(separator_ids(tokenizer), dtype=np.int64)
    parts, ids, n_bytes = [], [], 0
    docs = [d for d in source.documents() if d.text]
    for doc, tokens in zip(docs, encode_documents(tokenizer, [d.text for d in docs])):
        parts += [tokens, sep]
        ids.append(doc.id)
        n_bytes += len(doc.text.encode("utf-8")) + len(sep)
    if not parts:
        raise ValueError(f"text source {spec!r} holds no text")
    tokens = np.concatenate(parts).astype(token_dtype(tokenizer.vocab_size))
    return TokenStream(tokens, n_bytes, tuple(ids), "all", source.spec, tokenizer.name)


def run_ppl(args) -> int:
    """``titans eval ppl``: load a checkpoint, score held-out text, print and write JSON."""
    from titans.data.stream import load_token_streams
    from titans.training.distributed import resolve_device
    from titans.training.model_io import load_checkpoint_from, load_model

    loaded = load_checkpoint_from(args.checkpoint)
    checkpoint = loaded.path
    device = resolve_device(args.device)
    model, cfg, tokenizer = load_model(loaded, map_location=device)
    seq_len = args.seq_len or cfg.seq_len
    if args.data is None:
        stream = load_token_streams(
            cfg.data,
            tokenizer,
            heldout_fraction=cfg.heldout_fraction,
            cache_dir=cfg.cache_dir,
            text_field=cfg.text_field,
        ).heldout
        data_desc = f"{cfg.data} (held-out split)"
    else:
        stream = whole_source_stream(args.data, tokenizer, text_field=args.text_field)
        data_desc = args.data
    windows = EvalWindows(stream, seq_len=seq_len, num_windows=args.windows, batch_size=args.batch_size)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    result = evaluate_perplexity(model, windows, device=device, autocast_dtype=autocast)
    report = {"checkpoint": str(checkpoint), "data": data_desc, **result.to_dict()}
    bpb = f"{result.bpb:.4f}" if result.bpb is not None else "n/a"
    print(
        f"{data_desc}: {result.windows} windows x {result.seq_len} tokens  "
        f"loss {result.loss:.4f}  ppl {result.ppl:.3f}  bpb {bpb}"
    )
    out = Path(args.out) if args.out else checkpoint.parent.parent / "eval_ppl.json"  # the run folder
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def add_ppl_parser(evals) -> None:
    """Register ``titans eval ppl`` in the ``evals`` sub-parser collection."""
    p = evals.add_parser("ppl", help="held-out loss, perplexity and bits per byte of a checkpoint")
    p.add_argument(
        "--checkpoint", required=True, help="a checkpoint folder or a run folder (newest checkpoint)"
    )
    p.add_argument(
        "--data", default=None, help="text source to score in full (default: the checkpoint's held-out split)"
    )
    p.add_argument("--text-field", default="text", help="JSONL / dataset text field for --data")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--windows", type=int, default=64, help="number of windows, spread over the text")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    p.add_argument("--out", default=None, help="JSON output (default: RUN_DIR/eval_ppl.json)")
    p.set_defaults(func=run_ppl)
