"""The device a command runs on, from its ``--device`` text."""

from __future__ import annotations

import torch


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> cuda (this rank's GPU) when available, else cpu; any other spec as torch reads it."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r}: this process wants GPU {device.index} (local rank {local_rank}) but the"
                f" machine has {torch.cuda.device_count()}; start at most one process per GPU"
                " (torchrun --nproc_per_node), or pass --device cpu"
            )
    return device


__all__ = ["resolve_device"]
