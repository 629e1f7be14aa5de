"""Serving: per-session memories over HTTP, persisted in a store (`titans serve`, docs/serving.md).

- `titans.serving.session`: `Engine` (the model, the tokenizer, the settings of new sessions) and the JSON
  answers of the routes. The sessions are `titans.inference.session.MemorySession`s (read, generate,
  freeze, snapshots, rollback, the guard, bytes).
- `titans.serving.stores`: `SQLiteStore`, `RedisStore`, `open_store(url)`: versioned records with
  compare-and-set writes, each session's states stored as parts of their own, pooled connections.
- `titans.serving.limits`: per-key quotas (sessions, stored bytes, requests at once), fair workers, idle
  session expiry, slow-client timeouts.
- `titans.serving.auth`: API keys as sha256 hashes.
- `titans.serving.errors`: the one error body of every refused request, and `redact` (store URLs in log
  lines without their password).
- `titans.serving.app`: `create_app(engine, store, key_hashes=...)`, the FastAPI app (needs the `serve`
  extra, so it is not imported here).
"""

from titans.serving.auth import hash_key, load_api_keys
from titans.serving.session import Engine
from titans.serving.stores import RedisStore, SQLiteStore, StoreError, VersionConflict, open_store

__all__ = [
    "Engine",
    "RedisStore",
    "SQLiteStore",
    "StoreError",
    "VersionConflict",
    "hash_key",
    "load_api_keys",
    "open_store",
]
