"""Fused CPU kernels in C++ (`csrc/`), built once per machine and shared by every process that uses them.

- `causal_conv_silu_forward` / `_backward`: the memory's q/k/v causal depthwise conv + SiLU (titans.ops.conv)
  in one pass per direction.
- `state_mix_forward` / `_backward`: the chunk step's state update X' = mix @ X + U (titans.ops.memory),
  each direction in one pass over the state (and its gradient).
- `chunk_step_forward`: the memory's chunk step without autograd (titans.ops.memory.chunk, depth 1 or 2,
  the l2 inner loss), the element-wise work between its matmuls in fused loops.

Each has a torch-op path beside it that computes the same (the reference its tests compare against); that
path runs wherever `kernels()` is None: off CPU, with no C++ compiler, after a failed build, or with
`TITANS_CPU_KERNELS=0`.

How a build is found, made and shared (`ensure_built`):
- Its folder in the extensions root (`extensions_root`) is named by a hash of what the library depends on
  (`build_key`): the sources' bytes, the compile and link flags, the compiler's version, the torch
  version, Python's extension ABI and the CPU (`-march=native`). Not where the sources or torch are: any
  number of checkouts and environments with the same sources share one build.
- A finished build is imported as a plain extension module (importlib): torch's build machinery (ninja,
  which rebuilds when the command's paths or the sources' timestamps differ) never runs on it, so no
  process relinks a library another has loaded.
- A build runs in a fresh temporary folder, under an OS lock (`flock`, released when its holder dies), and
  is renamed into place whole once it succeeded: a build killed midway leaves only its temporary folder,
  which the next builder removes, and never a lock that blocks anyone. Processes that find a build under
  way wait for it, and say so on stderr in one line, as a builder does.
- `titans kernels build` builds ahead of time (`make setup` runs it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

SOURCES = ("bindings.cpp", "causal_conv.cpp", "state_mix.cpp", "chunk_step.cpp")
# included by the sources (not compiled on their own): their bytes are part of the build's key too
HEADERS = ("activations.h",)
SOURCE_DIR = Path(__file__).with_name("csrc")
# -ffast-math lets the exp in SiLU vectorise (glibc's vector math); the kernels avoid inf arithmetic, which
# it assumes away (csrc/causal_conv.cpp). -march=native: built for this CPU, so the build's key carries the
# CPU's fingerprint (a home folder shared by machines with other CPUs gets one build per CPU, never
# another's instructions)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
PREFIX = "titans_cpu_kernels"
# the start of the one stderr line a process prints when it builds, and when it waits for another's build
BUILD_MESSAGE = "titans: building the fused CPU kernels"
WAIT_MESSAGE = "titans: waiting for another process's build of the fused CPU kernels"
LIB_SUFFIX = ".pyd" if sys.platform == "win32" else ".so"


def _cpu_fingerprint() -> str:
    """This CPU's model and instruction-set flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return "\n".join(lines)


def compiler() -> str:
    """The C++ compiler torch's build uses: $CXX, else `c++`."""
    return os.environ.get("CXX", "c++")


@functools.cache
def compiler_version(cxx: str) -> str:
    """`cxx --version`'s output, or "" where it cannot be run (the build then fails and says why)."""
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def build_key(
    sources: Iterable[bytes],
    flags: Sequence[str],
    cpu: str,
    torch_version: str,
    compiler_id: str = "",
    python_abi: str = "",
) -> str:
    """A short hash of everything a build depends on: the sources' bytes, the compile and link flags, the
    CPU (for -march=native), the torch version (its headers and ABI), the compiler's identity and version,
    and Python's extension ABI. Nothing about where the files are: equal inputs anywhere share a build."""
    h = hashlib.sha256()
    parts = (*sources, "\0".join(flags).encode(), cpu.encode(), torch_version.encode())
    for part in (*parts, compiler_id.encode(), python_abi.encode()):
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two splits of the bytes collide
        h.update(part)
    return h.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Extension:
    """A C++ extension module built from `sources` in `source_dir` (each source defines nothing for
    Python but through `PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)` or `PyInit_` of that name), which may
    include `headers` from the same folder."""

    prefix: str
    source_dir: Path
    sources: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()

    def name(self) -> str:
        """`<prefix>_<build_key>`: the module's name, its folder's and its library's."""
        import torch

        cxx = compiler()
        key = build_key(
            [(self.source_dir / source).read_bytes() for source in (*self.sources, *self.headers)],
            self.cflags + self.ldflags,
            _cpu_fingerprint(),
            torch.__version__,
            f"{cxx}\n{compiler_version(cxx)}",
            sysconfig.get_config_var("EXT_SUFFIX") or sys.version,
        )
        return f"{self.prefix}_{key}"


KERNELS = Extension(PREFIX, SOURCE_DIR, SOURCES, CFLAGS, LDFLAGS, HEADERS)


def extension_name() -> str:
    """The name the kernels are built and cached under: `titans_cpu_kernels_<build_key>`."""
    return dataclasses.replace(KERNELS, source_dir=SOURCE_DIR).name()


def extensions_root() -> Path:
    """The folder builds are cached in: $TORCH_EXTENSIONS_DIR, else torch's default for this Python."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def library_path(name: str, root: Path | None = None) -> Path:
    """Where the finished build of extension `name` keeps its library (it exists only once complete)."""
    return (root or extensions_root()) / name / f"{name}{LIB_SUFFIX}"


def is_built(name: str, root: Path | None = None) -> bool:
    """Whether the extension `name` has a finished build under `root` (default `extensions_root`)."""
    return library_path(name, root).is_file()


def import_library(name: str, path: Path) -> ModuleType:
    """Import the extension module `name` from its library `path`: a plain dlopen, no build step."""
    import torch  # noqa: F401  (its libraries, which the extension links against, are loaded first)

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def builder_lock(path: Path, on_wait: str | None = None) -> Iterator[None]:
    """Hold the OS lock on the file `path` (created if missing), printing `on_wait` on stderr first when
    another process holds it. The OS releases it when its holder dies, so a killed builder never leaves a
    lock behind; without `fcntl` (Windows) this only yields (builders then race, and the first rename
    wins)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                print(on_wait, file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stage_prefix(name: str) -> str:
    return f".{name}.build-"


def ninja_on_path() -> None:
    """Put the environment's own ninja (the `ninja` package, a dependency) on PATH when PATH has none:
    torch's build runs `ninja` by name, and a program started by its path without the environment
    activated (cron, systemd, a script) has no ninja on PATH, so every build failed ("Ninja is required")
    and the slower torch-op paths ran."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja

        folders = [ninja.BIN_DIR, str(Path(sys.executable).parent)]
    except (ImportError, AttributeError):
        folders = [str(Path(sys.executable).parent)]
    found = next((f for f in folders if shutil.which("ninja", path=f) is not None), None)
    if found is not None:
        os.environ["PATH"] = os.pathsep.join(p for p in (found, os.environ.get("PATH")) if p)


def torch_build(ext: Extension, name: str, folder: Path) -> ModuleType:
    """Build `ext` as module `name` in `folder` with torch's `load` (ninja and the C++ compiler), and
    import it."""
    from torch.utils import cpp_extension

    ninja_on_path()

    # torch renames a second build of one name in a process (`name_v1`) when its folder differs; each
    # build here has a fresh folder, and must keep the name its library is looked up by
    versions = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versions is not None and isinstance(getattr(versions, "entries", None), dict):
        versions.entries.pop(name, None)
    return cpp_extension.load(
        name=name,
        sources=[str(ext.source_dir / source) for source in ext.sources],
        extra_cflags=list(ext.cflags),
        extra_ldflags=list(ext.ldflags),
        build_directory=str(folder),
    )


def ensure_built(
    ext: Extension = KERNELS, root: Path | None = None, what: str = "the fused CPU kernels"
) -> ModuleType:
    """The module of `ext`, imported from its finished build in `root` (default `extensions_root`),
    built there first when there is none (or waited for while another process builds it).

    Raises what the build raises (no compiler, a compile error); nothing is left behind then but the
    build's temporary folder, which the next builder removes."""
    root = root or extensions_root()
    name = ext.name()
    library = library_path(name, root)
    if library.is_file():
        return import_library(name, library)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    waiting = WAIT_MESSAGE.replace("the fused CPU kernels", what) + f" ({final}) ..."
    with builder_lock(root / f".{name}.lock", on_wait=waiting):
        if library.is_file():  # built by the process this one waited for
            return import_library(name, library)
        # only lock holders build, so any stage left here is a dead builder's
        for stale in root.glob(_stage_prefix(name) + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        building = BUILD_MESSAGE.replace("the fused CPU kernels", what)
        print(
            f"{building} into {final} (once per source version, compiler, torch and CPU; a minute or so) ...",
            file=sys.stderr,
            flush=True,
        )
        stage = Path(tempfile.mkdtemp(prefix=_stage_prefix(name), dir=root))
        try:
            module = torch_build(ext, name, stage)
            if not (stage / library.name).is_file():
                raise RuntimeError(f"the build of {name} made no {library.name}")
            for path in stage.iterdir():  # the finished folder holds the library and its build file only
                if path.name not in (library.name, "build.ninja"):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            os.chmod(stage, 0o755)  # mkdtemp's 0o700 would hide the build from other users sharing the root
            try:
                os.rename(stage, final)
            except OSError:  # another builder's rename came first (no OS lock here): keep theirs
                if not library.is_file():
                    raise
                shutil.rmtree(stage, ignore_errors=True)
            module.__file__ = str(library)
            return module
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled kernel module, or None where it cannot be had (the reason is warned once)."""
    if os.environ.get("TITANS_CPU_KERNELS", "1") == "0":
        return None
    try:
        return ensure_built(dataclasses.replace(KERNELS, source_dir=SOURCE_DIR))
    except Exception as e:  # no compiler, no ninja, a failed build: the torch-op paths do the same work
        warnings.warn(
            f"titans: the fused CPU kernels could not be built ({type(e).__name__}: {e}); using the torch-op "
            "paths (slower, same results). TITANS_CPU_KERNELS=0 skips the build.",
            stacklevel=2,
        )
        return None


def build_command(args) -> int:
    """`titans kernels build`: build the kernels now (or find them built), and say where they are."""
    if os.environ.get("TITANS_CPU_KERNELS", "1") == "0":
        print("titans kernels: TITANS_CPU_KERNELS=0: the kernels are off, nothing to build")
        return 0
    name = extension_name()
    found = is_built(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed build: its reason as the error, exit status 2
        kernels.cache_clear()
        try:
            kernels()
        except UserWarning as e:
            raise OSError(str(e).removeprefix("titans: ")) from None
    state = "already built" if found else "built"
    print(f"titans kernels: the fused CPU kernels are {state}: {library_path(name)}")
    return 0


def register(commands, evals) -> None:
    p = commands.add_parser(
        "kernels", help="build the fused CPU kernels ahead of time (otherwise their first use does)"
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    build = actions.add_parser(
        "build",
        help="build them into torch's extensions folder ($TORCH_EXTENSIONS_DIR), or find them built there",
    )
    build.set_defaults(func=build_command)


__all__ = [
    "BUILD_MESSAGE",
    "KERNELS",
    "WAIT_MESSAGE",
    "Extension",
    "build_key",
    "builder_lock",
    "ensure_built",
    "extension_name",
    "extensions_root",
    "import_library",
    "is_built",
    "kernels",
    "library_path",
]
