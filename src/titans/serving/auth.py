"""API keys: a file of keys, kept only as sha256 hashes; a session belongs to the hash of the key that
created it.

A key file holds one key per line (any string; surrounding whitespace and blank lines are ignored). The
server reads it once, keeps the hashes and forgets the keys. A request names its key in
``Authorization: Bearer KEY``; its hash must be one of the file's.
"""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path

# The owner of every session of a server started without keys (`--no-auth`, or a loopback host).
ANONYMOUS = hashlib.sha256(b"").hexdigest()


def hash_key(key: str) -> str:
    """The sha256 hex digest of a key (what the server and the store keep)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def load_api_keys(path: str | Path) -> frozenset[str]:
    """The hashes of the keys in `path` (one per line). Refuses a missing or empty file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--api-keys: no key file at {str(path)!r}")
    keys = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    keys = [k for k in keys if k]
    if not keys:
        raise ValueError(f"--api-keys: {str(path)!r} holds no keys (one key per line)")
    return frozenset(hash_key(k) for k in keys)


def bearer_key(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None (absent, another scheme, empty)."""
    if not header:
        return None
    scheme, _, key = header.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["ANONYMOUS", "bearer_key", "hash_key", "is_loopback", "load_api_keys"]
