"""API keys: a file of keys, kept only as sha256 hashes; a session belongs to the hash of the key that
created it.

A key file holds one key per line: printable ASCII (letters, digits, punctuation, inner spaces), since
that is all an HTTP header carries reliably; surrounding whitespace and blank lines are ignored. The
server reads it once, keeps the hashes and forgets the keys. A request names its key in
``Authorization: Bearer KEY``; its hash must be one of the file's. A key with other characters is refused
in the file at start-up and in a request (401 naming the reason, never the key).
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


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key (a sentence starting after "the API key"), or None. Keys are printable
    ASCII: an HTTP header carries other characters only as bytes each client encodes its own way."""
    bad = next((c for c in key if not " " <= c <= "~"), None)
    if bad is None:
        return None
    what = "a control character" if ord(bad) < 0x20 or ord(bad) == 0x7F else "a non-ASCII character"
    return f"holds {what}: keys are printable ASCII (letters, digits, punctuation, spaces)"


def load_api_keys(path: str | Path) -> frozenset[str]:
    """The hashes of the keys in `path` (one per line). Refuses a missing or empty file, and a key that is
    not printable ASCII (naming its line, not the key)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--api-keys: no key file at {str(path)!r}")
    try:
        # lines end at "\n" only: splitlines() also cut at \x0b, \x1c, U+0085, U+2028 ..., making the
        # pieces of one key into shorter keys that each worked
        # bytes, not read_text(): its universal newlines made a lone "\r" a line end as well
        lines = [line.removesuffix("\r") for line in path.read_bytes().decode("utf-8").split("\n")]
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--api-keys: {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key:
            continue
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(f"--api-keys: the key on line {number} of {str(path)!r} {problem}")
        keys.append(key)
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


__all__ = ["ANONYMOUS", "bearer_key", "hash_key", "is_loopback", "key_problem", "load_api_keys"]
