"""The device a command runs on, from its ``--device`` text, and its float32 matmul precision."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Within: float32 matrix products on CUDA use TF32 tensor cores (`enabled`) or exact float32: torch's
    matmuls and convolutions, and the memory's Triton kernels, whose dots follow torch's flag. The flags
    are process-wide; each comes back to its value on exit."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


__all__ = ["resolve_device", "tf32"]
