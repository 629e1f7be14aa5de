"""A session store for `titans serve` that keeps every session in this process's memory: `memory://`.

Nothing survives a restart, so it suits tests and demos only; it shows what a store has to do. Importing
this module registers the scheme, so the server is started from a Python process that imports it first
(the ``titans`` command itself knows only the built-in schemes); from the repository root:

    PYTHONPATH=examples python -c "import sys, memory_store; from titans.cli import main; \
        sys.exit(main(['serve', '--checkpoint', 'runs/main', '--store', 'memory://']))"

or, from Python, ``open_store("memory://")``. docs/extending.md walks through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from titans.serving.stores import Record, SessionExists, VersionConflict, checksum, register_store


class MemoryStore:
    """Sessions in a dict, one lock around every change (a write is a compare-and-set on the version)."""

    kind = "memory"

    def __init__(self) -> None:
        self.url = "memory://"
        self._records: dict[str, Record] = {}
        self._lock = threading.Lock()

    def create(self, sid: str, owner: str, data: bytes | Sequence[bytes]) -> Record:
        blob = _join(data)
        now = time.time()
        record = Record(sid, owner, 1, checksum(blob), blob, now, now, size=len(blob))
        with self._lock:
            if sid in self._records:
                raise SessionExists(sid)
            self._records[sid] = record
        return record

    def owner(self, sid: str) -> str | None:
        record = self._records.get(sid)
        return None if record is None else record.owner

    def get(self, sid: str) -> Record | None:
        return self._records.get(sid)

    def put(self, sid: str, data: bytes | Sequence[bytes], *, expected_version: int) -> int:
        blob = _join(data)
        with self._lock:
            old = self._records.get(sid)
            if old is None or old.version != expected_version:
                raise VersionConflict(sid)
            version = old.version + 1
            self._records[sid] = Record(
                sid, old.owner, version, checksum(blob), blob, old.created, time.time(), size=len(blob)
            )
            return version

    def delete(self, sid: str, owner: str, changed_before: float | None = None) -> bool:
        """Delete the owner's session; with `changed_before`, only if not written since (an idle session's
        expiry must not delete one a request has just written)."""
        with self._lock:
            record = self._records.get(sid)
            if record is None or record.owner != owner:
                return False
            if changed_before is not None and record.updated >= changed_before:
                return False
            del self._records[sid]
            return True

    def usage(self, owner: str) -> tuple[int, int]:
        mine = [r for r in list(self._records.values()) if r.owner == owner]
        return len(mine), sum(r.size for r in mine)

    def expire(self, before: float) -> list[str]:
        with self._lock:
            gone = [sid for sid, r in self._records.items() if r.updated < before]
            for sid in gone:
                del self._records[sid]
        return gone

    def count(self) -> int:
        return len(self._records)

    def close(self) -> None:
        self._records.clear()


def _join(data: bytes | Sequence[bytes]) -> bytes:
    """A session's bytes, given whole or as its parts (a store may keep the parts apart to write less)."""
    return bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(map(bytes, data))


@register_store("memory")
def open_memory_store(url: str, pool_size: int) -> MemoryStore:
    return MemoryStore()
