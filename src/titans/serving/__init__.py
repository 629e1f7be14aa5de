"""Serving: per-session memories over HTTP, persisted in a store (`titans serve`, docs/serving.md).

- `titans.serving.session`: `Engine` (the model, its frozen twin, the tokenizer) and `MemorySession`
  (read, generate, freeze, snapshots, rollback, bytes): the only module that touches the model.
- `titans.serving.stores`: `SQLiteStore`, `RedisStore`, `open_store(url)`: versioned records with
  compare-and-set writes.
- `titans.serving.auth`: API keys as sha256 hashes.
- `titans.serving.app`: `create_app(engine, store, key_hashes=...)`, the FastAPI app (needs the `serve`
  extra, so it is not imported here).
"""

from titans.serving.auth import hash_key, load_api_keys
from titans.serving.session import Engine, MemorySession, SessionDataError
from titans.serving.stores import RedisStore, SQLiteStore, StoreError, VersionConflict, open_store

__all__ = [
    "Engine",
    "MemorySession",
    "RedisStore",
    "SQLiteStore",
    "SessionDataError",
    "StoreError",
    "VersionConflict",
    "hash_key",
    "load_api_keys",
    "open_store",
]
