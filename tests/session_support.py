"""Crafting session bytes (`MemorySession.to_bytes`) for tests: what a tampered upload can be."""

from __future__ import annotations

import hashlib
import json

from titans.inference.session import SESSION_MAGIC


def rebuilt(data: bytes, edit_header, edit_blobs=lambda blobs: blobs) -> bytes:
    """Session bytes rebuilt from edit_header(header) and edit_blobs(blobs) (the states' bytes), the
    header's blob sizes set to match, under a checksum that matches."""
    start = len(SESSION_MAGIC)
    size = int.from_bytes(data[start : start + 8], "little")
    header = json.loads(data[start + 8 : start + 8 + size])
    blobs, pos = [], start + 8 + size
    for n in header["blobs"]:
        blobs.append(data[pos : pos + n])
        pos += n
    blobs = edit_blobs(blobs)
    head = json.dumps({**edit_header(header), "blobs": [len(b) for b in blobs]}).encode()
    body = SESSION_MAGIC + len(head).to_bytes(8, "little") + head + b"".join(blobs)
    return body + hashlib.sha256(body).digest()
