"""The CPU kernel build, shared: concurrent processes load one build and none rebuilds, a killed builder
leaves nothing that blocks the next, a finished build loads without torch's build machinery, and any
checkout with the same sources finds the same build. The process tests build a tiny extension (a second
to compile) through the same path as the kernels; one test builds the real kernels, once, in an empty
extensions folder."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from titans.ops import cpu_kernels

SRC = Path(__file__).resolve().parents[1] / "src"

# A Python extension module without torch's headers: it compiles in about a second.
TINY_SOURCE = r"""
#include <Python.h>
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define STR_(a) #a
#define STR(a) STR_(a)
static PyModuleDef tiny_module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&tiny_module);
  if (m) PyModule_AddIntConstant(m, "answer", 42);
  return m;
}
"""

# One process loading an extension: says `ready` once past its imports, waits for `go` to exist (so
# several start their load at once), then prints the library's inode and mtime. Modes: `tiny` (the tiny
# extension in sys.argv[3]), `kernels` (the real kernels, which it also runs), and `slow` (the tiny one,
# whose build hangs after writing a partial file: a builder to kill midway). `noload` first makes torch's
# build machinery raise if anything calls it.
WORKER = r"""
import os, sys, time
from pathlib import Path
import torch
import torch.utils.cpp_extension
from titans.ops import cpu_kernels as ck

mode, go, sources = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
if "noload" in sys.argv[4:]:
    def refuse(*a, **k):
        raise AssertionError("torch's build machinery ran")
    torch.utils.cpp_extension.load = refuse
if mode == "slow":
    def hang(ext, name, folder):
        (folder / "bindings.o").write_bytes(b"half")
        print("stage", folder, flush=True)
        time.sleep(600)
    ck.torch_build = hang
print("ready", flush=True)
if "elsewhere" in sys.argv[4:]:  # the same sources in another checkout, written later (a fresh clone)
    ck.SOURCE_DIR = sources / "csrc"
while not go.exists():
    time.sleep(0.01)
if mode == "kernels":
    module = ck.kernels()
    assert module is not None, "the kernels did not load"
    x, mix, out = torch.ones(1, 2, 3), torch.eye(2).expand(1, 2, 2).contiguous(), torch.ones(1, 2, 3)
    module.state_mix_forward(x, mix, out)
    assert torch.equal(out, torch.full((1, 2, 3), 2.0)), out  # mix @ x + U
    library = ck.library_path(ck.extension_name())
else:
    ext = ck.Extension("tiny", sources, ("tiny.cpp",))
    module = ck.ensure_built(ext, what="a tiny test extension")
    assert module.answer == 42
    library = ck.library_path(ext.name())
print("inode", library.stat().st_ino, library.stat().st_mtime_ns, flush=True)
"""


def env(root: Path, **extra: str) -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(root)}
    out.pop("TITANS_CPU_KERNELS", None)
    return {**out, **extra}


def start(mode: str, go: Path, sources: Path, root: Path, *flags: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, mode, str(go), str(sources), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(root, **extra),
        start_new_session=True,  # its own process group: a kill takes its compilers too
    )


def release(procs: list[subprocess.Popen], go: Path) -> None:
    """Start the loads of `procs` at once, when each is past its imports."""
    for proc in procs:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    go.touch()


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"a loader failed ({proc.returncode}):\n{out}\n{err[-3000:]}"
            results.append((out, err))
    finally:
        for proc in procs:  # on a failure, the others (and their compilers) too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def inodes(results: list[tuple[str, str]]) -> set[str]:
    return {
        line.split(" ", 1)[1] for out, _ in results for line in out.splitlines() if line.startswith("inode")
    }


def lines(results: list[tuple[str, str]], start: str) -> list[str]:
    return [line for _, err in results for line in err.splitlines() if line.startswith(start)]


@pytest.fixture
def compiler():
    if not (shutil.which("c++") or shutil.which("g++")) or not shutil.which("ninja"):
        pytest.skip("no C++ compiler or ninja: the torch-op paths are used")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    sources = tmp_path / "tiny-src"
    sources.mkdir()
    (sources / "tiny.cpp").write_text(TINY_SOURCE)
    return sources


def slow_compiler(folder: Path, seconds: float) -> str:
    """A compiler that takes `seconds` longer: a build long enough that processes started together meet."""
    script = folder / "slow-c++"
    real = shutil.which("c++") or shutil.which("g++")
    script.write_text(f'#!/bin/sh\n[ "$1" = --version ] || sleep {seconds}\nexec {real} "$@"\n')
    script.chmod(0o755)
    return str(script)


def test_processes_started_together_load_one_build_and_none_rebuilds(compiler, tiny, tmp_path, monkeypatch):
    """4 processes, an empty extensions folder, a build slowed by 2 s per step: one builds (one stderr
    line), the others say they wait, all load the same library file; a later process loads it without
    torch's build machinery and the file is untouched; only the finished build and its lock are left."""
    root, go = tmp_path / "extensions", tmp_path / "go"
    cxx = slow_compiler(tmp_path, 2)
    monkeypatch.setenv("CXX", cxx)
    procs = [start("tiny", go, tiny, root, CXX=cxx) for _ in range(4)]
    release(procs, go)
    results = finish(procs, timeout=120)
    builds = lines(results, "titans: building a tiny test extension")
    waits = lines(results, "titans: waiting for another process's build of a tiny test extension")
    assert len(builds) == 1, results
    assert 1 <= len(waits) <= 3, (
        results
    )  # those that arrived while it ran (on a loaded machine, maybe not all)
    assert all(len(err.splitlines()) <= 1 for _, err in results), results  # nothing else on stderr
    (seen,) = inodes(results)  # one library file, inode and mtime
    later = finish([start("tiny", go, tiny, root, "noload", CXX=cxx)], timeout=60)
    assert inodes(later) == {seen} and later[0][1] == ""  # loaded as it was, and silently
    name = cpu_kernels.Extension("tiny", tiny, ("tiny.cpp",)).name()
    assert sorted(p.name for p in root.iterdir()) == sorted([name, f".{name}.lock"])


def test_a_builder_killed_midway_leaves_nothing_that_blocks_the_next(compiler, tiny, tmp_path, capsys):
    """A builder SIGKILLed with a half-written build: the next load starts its own build at once (no
    waiting on a lock), removes the dead one's folder, and succeeds."""
    root, go = tmp_path / "extensions", tmp_path / "go"
    go.touch()
    proc = start("slow", go, tiny, root)
    stage = None
    deadline = time.monotonic() + 60
    while stage is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("stage "):
            stage = Path(line.split(" ", 1)[1].strip())
    assert stage is not None and (stage / "bindings.o").is_file(), proc.stderr.read()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    ext = cpu_kernels.Extension("tiny", tiny, ("tiny.cpp",))
    assert not cpu_kernels.is_built(ext.name(), root)  # nothing half-built where a finished build goes
    started = time.monotonic()
    module = cpu_kernels.ensure_built(ext, root, what="a tiny test extension")
    assert module.answer == 42
    assert time.monotonic() - started < 30  # the build's own seconds, no waiting on the dead builder
    err = capsys.readouterr().err
    assert "titans: building a tiny test extension" in err and "waiting" not in err
    assert not stage.exists()
    assert sorted(p.name for p in root.iterdir()) == sorted([ext.name(), f".{ext.name()}.lock"])


def test_a_failed_build_leaves_nothing_and_the_next_builds(compiler, tiny, tmp_path):
    """A compile error raises and leaves no folder behind; fixed sources then build."""
    root = tmp_path / "extensions"
    (tiny / "tiny.cpp").write_text("this is not C++\n")
    ext = cpu_kernels.Extension("tiny", tiny, ("tiny.cpp",))
    with pytest.raises(RuntimeError):
        cpu_kernels.ensure_built(ext, root)
    assert [p.name for p in root.iterdir()] == [f".{ext.name()}.lock"]
    (tiny / "tiny.cpp").write_text(TINY_SOURCE)
    assert cpu_kernels.ensure_built(ext, root).answer == 42


def test_checkouts_with_the_same_sources_share_a_build(tmp_path, monkeypatch):
    """The build's name follows the sources' bytes, not their folder or timestamps: a copy elsewhere
    (another checkout, a fresh clone) names the same build, an edited copy another."""
    name = cpu_kernels.extension_name()
    copy = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(cpu_kernels.SOURCE_DIR, copy)
    os.utime(copy / "state_mix.cpp", (1, 1))
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", copy)
    assert cpu_kernels.extension_name() == name
    (copy / "state_mix.cpp").write_text((copy / "state_mix.cpp").read_text() + "\n// edited\n")
    assert cpu_kernels.extension_name() != name
    # another compiler (or version) names another build
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", Path(cpu_kernels.__file__).with_name("csrc"))
    monkeypatch.setenv("CXX", str(tmp_path / "other-c++"))
    assert cpu_kernels.extension_name() != name


@pytest.mark.slow
def test_the_kernels_build_once_for_processes_started_together(compiler, tmp_path):
    """The real kernels, 3 processes started together: at most one build, the same library loaded by all
    and computing; later processes, from this checkout and from a copy of its sources elsewhere, load it
    without torch's build machinery and leave it untouched.

    Where `make setup` has built the kernels already (`titans kernels build`), the extensions folder starts
    with a copy of that build: building them again from scratch took 3-5 minutes of the suite on 2 cores,
    and one build among processes started together is shown above on the tiny extension, through the
    same path. Without it, the folder starts empty and the 3 processes build them once."""
    root, go = tmp_path / "extensions", tmp_path / "go"
    name = cpu_kernels.extension_name()
    built = cpu_kernels.library_path(name)
    if built.is_file():
        (root / name).mkdir(parents=True)
        shutil.copy2(built, root / name / built.name)
    procs = [start("kernels", go, tmp_path, root) for _ in range(3)]
    release(procs, go)
    results = finish(procs, timeout=900)
    assert len(lines(results, cpu_kernels.BUILD_MESSAGE)) == (0 if built.is_file() else 1), results
    (seen,) = inodes(results)
    later = finish([start("kernels", go, tmp_path, root, "noload")], timeout=60)
    assert inodes(later) == {seen} and later[0][1] == ""
    # a checkout elsewhere with the same sources (newer timestamps, other paths) loads the same build
    shutil.copytree(cpu_kernels.SOURCE_DIR, tmp_path / "csrc")
    elsewhere = finish([start("kernels", go, tmp_path, root, "noload", "elsewhere")], timeout=60)
    assert inodes(elsewhere) == {seen} and elsewhere[0][1] == ""


def test_titans_kernels_build_builds_ahead_of_time_and_says_where(tmp_path, monkeypatch, capsys):
    """`titans kernels build` (what `make setup` runs) builds the kernels, then finds them built; a failed
    build is an error naming its reason, exit status 2."""
    from titans.cli import main

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("TITANS_CPU_KERNELS", raising=False)
    built = []

    def fake_build(ext, name, folder):
        built.append(name)
        (folder / f"{name}{cpu_kernels.LIB_SUFFIX}").write_bytes(b"")
        return types.SimpleNamespace()

    monkeypatch.setattr(cpu_kernels, "torch_build", fake_build)
    monkeypatch.setattr(cpu_kernels, "import_library", lambda name, path: types.SimpleNamespace())
    library = cpu_kernels.library_path(cpu_kernels.extension_name(), tmp_path)
    try:
        assert main(["kernels", "build"]) == 0
        out, err = capsys.readouterr()
        assert out == f"titans kernels: the fused CPU kernels are built: {library}\n"
        assert err.startswith(cpu_kernels.BUILD_MESSAGE)
        assert main(["kernels", "build"]) == 0
        out, err = capsys.readouterr()
        assert out == f"titans kernels: the fused CPU kernels are already built: {library}\n" and err == ""
        assert len(built) == 1
        shutil.rmtree(library.parent)

        def broken(ext, name, folder):
            raise RuntimeError("Error building extension")

        monkeypatch.setattr(cpu_kernels, "torch_build", broken)
        assert main(["kernels", "build"]) == 2
        err = capsys.readouterr().err.splitlines()[-1]
        want = "titans kernels build: error: the fused CPU kernels could not be built (RuntimeError"
        assert err.startswith(want)
    finally:
        cpu_kernels.kernels.cache_clear()  # nothing fake stays cached for later tests


def test_a_build_finds_the_environment_s_ninja_when_path_has_none(compiler, tiny, tmp_path, monkeypatch):
    """`titans` started by its path without its environment activated (cron, systemd, a script): PATH has
    the compiler but not the environment's ninja (a dependency), and every build failed with "Ninja is
    required", so the slower torch-op paths ran. The build puts that ninja on PATH."""
    import ninja

    plain = tmp_path / "bin"  # the system's programs, but no ninja
    plain.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        for program in Path(folder).glob("*") if Path(folder).is_dir() else ():
            if program.name != "ninja" and not (plain / program.name).exists():
                (plain / program.name).symlink_to(program)
    monkeypatch.setenv("PATH", str(plain))
    assert shutil.which("ninja") is None
    ext = cpu_kernels.Extension("tiny", tiny, ("tiny.cpp",))
    assert cpu_kernels.ensure_built(ext, tmp_path / "extensions").answer == 42
    assert Path(shutil.which("ninja")).parent == Path(ninja.BIN_DIR)
