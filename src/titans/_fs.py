"""File modes for what the library writes through `tempfile` (atomic writes: write a temporary file or
folder, then rename it into place). `tempfile` creates them private (0600 files, 0700 folders); the final
files should have the mode an ordinary ``open()`` / ``mkdir()`` gives: 0666 / 0777 less the process umask.
And safetensors files written byte-reproducibly (`save_safetensors`).
"""

from __future__ import annotations

import os
from pathlib import Path


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
