"""Fused CPU kernels in C++ (`csrc/`), built on first use with `torch.utils.cpp_extension`.

- `causal_conv_silu_forward` / `_backward`: the memory's q/k/v causal depthwise conv + SiLU (titans.ops.conv)
  in one pass per direction.
- `state_mix_forward` / `_backward`: the chunk step's state update X' = mix @ X + U (titans.ops.memory),
  each direction in one pass over the state (and its gradient).

Each has a torch-op path beside it that computes the same (the reference its tests compare against); that
path runs wherever `kernels()` is None: off CPU, with no C++ compiler, after a failed build, or with
`TITANS_CPU_KERNELS=0`. The build is cached in torch's extensions folder under a name keyed by the CPU, the
sources, the compile flags and the torch version (`extension_name`): checkouts or versions that differ in
any of them keep a build each instead of rebuilding each other's, and a build says so on stderr first.

torch guards a build with a plain `lock` file that a killed builder leaves behind, after which every later
load waits on it forever. So builders here also hold an OS lock (`flock`, released when its holder dies) on
`<build>/.titans_build.lock`: its holder knows no live builder owns a leftover `lock` file, and clears it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

SOURCES = ("bindings.cpp", "causal_conv.cpp", "state_mix.cpp")
SOURCE_DIR = Path(__file__).with_name("csrc")
# -ffast-math lets the exp in SiLU vectorise (glibc's vector math); the kernels avoid inf arithmetic, which
# it assumes away (csrc/causal_conv.cpp). -march=native: built for this CPU, so the build's name carries the
# CPU's fingerprint (a home folder shared by machines with other CPUs gets one build per CPU, never
# another's instructions)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_MESSAGE = "titans: building the fused CPU kernels (once per machine and source version, ~40 s) ..."


def _cpu_fingerprint() -> str:
    """This CPU's model and instruction-set flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return "\n".join(lines)


def build_key(sources: Iterable[bytes], flags: Sequence[str], cpu: str, torch_version: str) -> str:
    """A short hash of everything a build depends on: the sources' bytes, the compile and link flags, the
    CPU (for -march=native) and the torch version (its headers and ABI)."""
    h = hashlib.sha256()
    for part in (*sources, "\0".join(flags).encode(), cpu.encode(), torch_version.encode()):
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two splits of the bytes collide
        h.update(part)
    return h.hexdigest()[:16]


def extension_name() -> str:
    """The name the kernels are built and cached under: `titans_cpu_kernels_<build_key>` for this
    checkout's sources on this CPU and torch."""
    import torch

    sources = [(SOURCE_DIR / name).read_bytes() for name in SOURCES]
    key = build_key(sources, CFLAGS + LDFLAGS, _cpu_fingerprint(), torch.__version__)
    return f"titans_cpu_kernels_{key}"


def extensions_root() -> Path:
    """The folder builds are cached in: $TORCH_EXTENSIONS_DIR, else torch's default for this Python."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def is_built(name: str, root: Path | None = None) -> bool:
    """Whether the extension `name` already has a built library under `root` (default `extensions_root`)."""
    folder = (root or extensions_root()) / name
    return any(folder.glob(f"{name}*.so")) or any(folder.glob(f"{name}*.pyd"))


@contextlib.contextmanager
def build_lock(folder: Path):
    """Hold the OS lock of the build in `folder`, clearing a `lock` file left by a builder that died.

    Every builder takes this lock before torch's own, so while it is held no live process can own torch's
    `lock` file; without `fcntl` (Windows) this only yields."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / ".titans_build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                print(f"titans: removing {stale}, left by a kernel build that was killed", file=sys.stderr)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def kernels():
    """The compiled kernel module, or None where it cannot be had (the reason is warned once)."""
    if os.environ.get("TITANS_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        name = extension_name()
        folder = extensions_root() / name
        if not is_built(name):
            print(BUILD_MESSAGE, file=sys.stderr, flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        with build_lock(folder):
            return load(
                name=name,
                sources=[str(SOURCE_DIR / source) for source in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(folder),
            )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch-op paths do the same work
        warnings.warn(
            f"titans: the fused CPU kernels could not be built ({type(e).__name__}: {e}); using the torch-op "
            "paths (slower, same results). TITANS_CPU_KERNELS=0 skips the build.",
            stacklevel=2,
        )
        return None


__all__ = [
    "BUILD_MESSAGE",
    "build_key",
    "build_lock",
    "extension_name",
    "extensions_root",
    "is_built",
    "kernels",
]
