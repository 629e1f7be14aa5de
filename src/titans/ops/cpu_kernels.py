"""Fused CPU kernels in C++ (`csrc/`), built on first use with `torch.utils.cpp_extension`.

- `causal_conv_silu_forward` / `_backward`: the memory's q/k/v causal depthwise conv + SiLU (titans.ops.conv)
  in one pass per direction.
- `state_mix_forward` / `_backward`: the chunk step's state update X' = mix @ X + U (titans.ops.memory),
  each direction in one pass over the state (and its gradient).

Each has a torch-op path beside it that computes the same (the reference its tests compare against); that
path runs wherever `kernels()` is None: off CPU, with no C++ compiler, after a failed build, or with
`TITANS_CPU_KERNELS=0`. The build takes about 30 s once per CPU and is cached in torch's extensions folder.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path

SOURCES = ("bindings.cpp", "causal_conv.cpp", "state_mix.cpp")


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


@functools.cache
def kernels():
    """The compiled kernel module, or None where it cannot be had (the reason is warned once)."""
    if os.environ.get("TITANS_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        folder = Path(__file__).with_name("csrc")
        # -ffast-math lets the exp in SiLU vectorise (glibc's vector math). -march=native: built for this
        # CPU, so the build's name carries the CPU's fingerprint (a home folder shared by machines with
        # other CPUs gets one build per CPU, never another's instructions)
        return load(
            name=f"titans_cpu_kernels_{_cpu_fingerprint()}",
            sources=[str(folder / name) for name in SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch-op paths do the same work
        warnings.warn(
            f"titans: the fused CPU kernels could not be built ({type(e).__name__}: {e}); using the torch-op "
            "paths (slower, same results). TITANS_CPU_KERNELS=0 skips the build.",
            stacklevel=2,
        )
        return None


__all__ = ["kernels"]
