"""File modes for what the library writes through `tempfile` (atomic writes: write a temporary file or
folder, then rename it into place). `tempfile` creates them private (0600 files, 0700 folders); the final
files should have the mode an ordinary ``open()`` / ``mkdir()`` gives: 0666 / 0777 less the process umask.
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
