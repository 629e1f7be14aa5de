"""File modes for what the library writes through `tempfile` (atomic writes: write a temporary file or
folder, then rename it into place). `tempfile` creates them private (0600 files, 0700 folders); the final
files should have the mode an ordinary ``open()`` / ``mkdir()`` gives: 0666 / 0777 less the process umask.
A text file written atomically (`write_text_atomic`), and safetensors files written byte-reproducibly
(`save_safetensors`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
import warnings
from pathlib import Path

LOCK_FILE = ".lock"  # held (flock) by the one process that writes a folder (a run, a study's output)


# what flock answers on a filesystem without locks (errno.ENOTSUP is EOPNOTSUPP on Linux)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def lock_folder(folder: str | Path, in_use: str):
    """An exclusive lock on `folder` for one writer: its open ``LOCK_FILE`` (a context manager), released
    when closed or when the process ends, however it ends (the kernel drops a dead process's flock).
    Another writer holds it: FileExistsError(`in_use`). A filesystem without locks (some network mounts
    answer ENOLCK or EOPNOTSUPP) gets a warning and the folder unlocked: a second writer goes undetected
    there, which is better than refusing every run on such a mount."""
    f = open(Path(folder) / LOCK_FILE, "ab")  # noqa: SIM115 - held open for as long as the lock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise FileExistsError(in_use) from None
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            f.close()
            raise
        warnings.warn(
            f"cannot lock {str(folder)!r} ({e.strerror.lower()}: the filesystem has no file locks); "
            "a second process writing it at the same time would not be detected",
            stacklevel=2,
        )
    return f


def current_umask() -> int:
    """The process umask (read from /proc where there is one: setting it to read it races with threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ordinary_mode(path: str | Path) -> None:
    """Give a file made by `tempfile` the mode ``open()`` would have given it (a folder: ``mkdir()``)."""
    base = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, base & ~current_umask())


def atomic_target(path: str | Path) -> Path:
    """The file an atomic write of ``path`` replaces: a symlink's target (renaming over the link would
    replace the link and leave its target as it was), and only a regular file or a new name: renaming
    over a device (``/dev/null``, ``/dev/full``), a FIFO or a folder would replace it, so that is refused
    (IsADirectoryError for a folder, else ValueError), naming ``path``."""
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder; give a file name", str(path))
    if target.exists() and not target.is_file():
        raise ValueError(
            f"{str(path)!r} is not a regular file (a device, FIFO or socket); give a file name to write"
        )
    return target


def check_writable(path: str | Path, inputs: dict[str, str | Path | None] | None = None) -> None:
    """Refuse, before the work that produces it, a file that could not be written at `path`: its folder is
    made (as the write would make it) and a temporary file created there and removed; a folder or device
    at `path` is refused (`atomic_target`). A command that scored for minutes and then failed to write its
    result lost the work. Folders it made for the probe are removed again (the write makes them): a command
    refused after this check leaves nothing behind. `inputs` ({option: path}): files the command reads,
    which `path` must not be (the output would replace its own input)."""
    given, path = path, atomic_target(path)
    for option, source in (inputs or {}).items():
        if source is not None and os.path.isfile(source) and os.path.realpath(source) == str(path):
            raise ValueError(f"{str(given)!r} is the {option} file: writing it would replace that input")
    made = [p for p in (path.parent, *path.parent.parents) if not p.exists()]  # deepest first
    try:
        _check_writable_in(path)
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _check_writable_in(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:  # a file where its folder should be
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)) from e
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path.parent)) from e
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    os.close(fd)
    os.unlink(probe)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` all or nothing (`write_bytes_atomic`)."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` all or nothing: a temporary file in the same folder, flushed to disk,
    then renamed over ``path``. A write that fails part-way (a full disk) or a kill leaves the previous
    file as it was, never a truncated one; the file gets the mode ``open()`` would have given it. A symlink
    is written through (its target replaced); a device or folder at ``path`` is refused (`atomic_target`)."""
    given, path = Path(path), atomic_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # named after the file asked for, not its hidden temporary
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        ordinary_mode(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:  # a write: name the file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    with contextlib.suppress(OSError):  # the rename itself to disk; not every file system opens folders
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return given


def _canonical_header(header: bytes) -> bytes | None:
    """A safetensors header with its metadata in sorted key order, padded to the same length (None if the
    canonical form would be longer: a writer escaping differently)."""
    import json

    parsed = json.loads(header)
    parsed["__metadata__"] = dict(sorted(parsed.get("__metadata__", {}).items()))
    canonical = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False).encode()
    return canonical.ljust(len(header), b" ") if len(canonical) <= len(header) else None


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file`, with the header's metadata in sorted key order.

    safetensors keeps metadata in a hash map whose order changes from process to process, so two saves
    of the same tensors would differ in bytes (and in sha256). The header is rewritten in place with the
    keys sorted: the same characters in another order, so its length, and every tensor's offset, stay."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = _canonical_header(f.read(size))
        if header is not None:
            f.seek(8)
            f.write(header)


def safetensors_bytes(tensors: dict, metadata: dict[str, str]) -> bytes:
    """`safetensors.torch.save` (the file's bytes in memory), reproducible as `save_safetensors` is."""
    from safetensors.torch import save

    data = bytearray(save(tensors, metadata=metadata))
    size = int.from_bytes(data[:8], "little")
    header = _canonical_header(bytes(data[8 : 8 + size]))
    if header is not None:
        data[8 : 8 + size] = header
    return bytes(data)
