"""Held-out language-modelling quality: mean token loss, perplexity and bits per byte.

    result = evaluate_perplexity(model, EvalWindows(stream, seq_len=512, num_windows=64), device="cpu")
    result.loss, result.ppl, result.bpb

Every window is read from a fresh memory state (``state=None``), as in training, so the numbers measure
what the model does with ``seq_len`` tokens of context. Under torch.distributed each rank evaluates its
share of the windows (``EvalWindows`` shards them) and the sums are all-reduced, so every rank returns the
same result.

The trainer scores its held-out windows with this; ``titans eval ppl`` (``titans.evaluation.perplexity``)
runs it on a saved checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titans.data.loader import EvalWindows


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
