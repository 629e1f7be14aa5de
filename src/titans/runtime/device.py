"""The device a command runs on, from its ``--device`` text, its CPU threads, and its float32 matmul
precision."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

CHOICES = "auto, cpu, cuda or cuda:N"


def _available(device_type: str) -> bool:
    """Whether torch has an accelerator of this type here (mps, xpu, ...); never for meta."""
    backend = getattr(torch, device_type, None)
    if device_type == "mps":
        return torch.backends.mps.is_available()
    return bool(getattr(backend, "is_available", lambda: False)())


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> cuda (this rank's GPU) when available, else cpu; ``cpu``, ``cuda`` or ``cuda:N``; another
    device type torch knows (e.g. ``mps``) only where this machine has it."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {spec!r}; choose {CHOICES}") from None
    if device.type not in ("cpu", "cuda") and not _available(device.type):
        raise ValueError(f"device {spec!r} is not available on this machine; choose {CHOICES}")
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


def set_cpu_threads(threads: int | None, option: str = "--threads") -> None:
    """torch's intra-op CPU threads from a command's option (None: torch's default), refusing < 1 and more
    than `max_cpu_threads()` (100,000 started that many threads, and the next thread the program needed
    failed: "can't start new thread")."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"{option} must be >= 1, got {threads}")
    if threads > max_cpu_threads():
        raise ValueError(
            f"{option} {threads} is more threads than this machine's {os.cpu_count()} cores can use; give at "
            f"most {max_cpu_threads()}"
        )
    torch.set_num_threads(threads)


def max_cpu_threads() -> int:
    """The most torch CPU threads (or server workers) a command takes: 4 per core, at least 64."""
    return max(64, 4 * (os.cpu_count() or 1))


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


__all__ = ["max_cpu_threads", "resolve_device", "set_cpu_threads", "tf32"]
