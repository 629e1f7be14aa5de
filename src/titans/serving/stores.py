"""Where sessions live between requests: one SQLite file (the default), or a Redis server shared by many
servers.

Every record holds the session's bytes, the sha256 of those bytes, the owner (the sha256 of the key that
created it), and a version. A write names the version it started from and succeeds only if the record
still has it (compare-and-set: SQLite ``UPDATE ... WHERE version = ?``, a Lua script on Redis); it then
holds version + 1. Two servers sharing a store therefore cannot lose an update: the second writer gets
`VersionConflict` and starts again from the newer record.

    store = open_store("sqlite:///sessions.db")          # or redis://HOST:PORT/DB, unix:///path.sock?db=0
    store.create(sid, owner, data)                       # version 1
    record = store.get(sid)                              # Record | None; record.intact checks the sha256
    store.put(sid, data, expected_version=record.version)  # -> new version, or VersionConflict
    store.delete(sid, owner)                             # -> whether it was there (and owned)

A write returns only once the store holds it: SQLite in WAL mode with ``synchronous=FULL`` (the commit
is on disk), Redis once the server has applied it (on disk as its own persistence settings say).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class StoreError(RuntimeError):
    """The store cannot be reached or refuses to work (a locked or full disk, Redis down)."""


class VersionConflict(Exception):
    """Another writer changed the record since it was read."""


class SessionExists(Exception):
    """`create` with an id that is taken."""


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Record:
    id: str
    owner: str
    version: int
    checksum: str
    data: bytes
    created: float
    updated: float

    @property
    def intact(self) -> bool:
        """Whether the bytes still have the checksum they were written with."""
        return checksum(self.data) == self.checksum


class SessionStore(Protocol):
    url: str
    kind: str

    def create(self, sid: str, owner: str, data: bytes) -> Record: ...
    def get(self, sid: str) -> Record | None: ...
    def put(self, sid: str, data: bytes, *, expected_version: int) -> int: ...
    def delete(self, sid: str, owner: str) -> bool: ...
    def count(self) -> int: ...
    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ SQLite
class SQLiteStore:
    """Sessions in one SQLite file (WAL mode: readers never wait for the writer; one connection per
    thread)."""

    kind = "sqlite"

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path).expanduser()
        self.url = f"sqlite:///{self.path}"
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = self._conn()
            conn.execute(
                "CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
                "version INTEGER NOT NULL, checksum TEXT NOT NULL, data BLOB NOT NULL, "
                "created REAL NOT NULL, updated REAL NOT NULL)"
            )
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open the session store {self.url}: {e}") from e

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # autocommit (isolation_level=None): each statement is its own transaction
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # an acknowledged write survives a crash of the machine
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def _run(self, sql: str, args: tuple) -> sqlite3.Cursor:
        try:
            return self._conn().execute(sql, args)
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as e:
            raise StoreError(f"session store {self.url}: {e}") from e

    def create(self, sid: str, owner: str, data: bytes) -> Record:
        now = time.time()
        digest = checksum(data)
        try:
            self._run(
                "INSERT INTO sessions (id, owner, version, checksum, data, created, updated) "
                "VALUES (?, ?, 1, ?, ?, ?, ?)",
                (sid, owner, digest, data, now, now),
            )
        except sqlite3.IntegrityError as e:
            raise SessionExists(sid) from e
        return Record(sid, owner, 1, digest, data, now, now)

    def get(self, sid: str) -> Record | None:
        row = self._run(
            "SELECT id, owner, version, checksum, data, created, updated FROM sessions WHERE id = ?", (sid,)
        ).fetchone()
        if row is None:
            return None
        return Record(row[0], row[1], int(row[2]), row[3], bytes(row[4]), float(row[5]), float(row[6]))

    def put(self, sid: str, data: bytes, *, expected_version: int) -> int:
        cur = self._run(
            "UPDATE sessions SET data = ?, checksum = ?, version = version + 1, updated = ? "
            "WHERE id = ? AND version = ?",
            (data, checksum(data), time.time(), sid, expected_version),
        )
        if cur.rowcount != 1:
            raise VersionConflict(sid)
        return expected_version + 1

    def delete(self, sid: str, owner: str) -> bool:
        return self._run("DELETE FROM sessions WHERE id = ? AND owner = ?", (sid, owner)).rowcount == 1

    def count(self) -> int:
        return int(self._run("SELECT COUNT(*) FROM sessions", ()).fetchone()[0])

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()


# ------------------------------------------------------------------------------------------ Redis
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'version', 1, 'checksum', ARGV[2], 'data', ARGV[3],
           'created', ARGV[4], 'updated', ARGV[4])
return 1
"""
# -1: no such record; -2: another version; else the new version
_PUT = """
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return -1 end
if v ~= ARGV[1] then return -2 end
local nv = tonumber(v) + 1
redis.call('HSET', KEYS[1], 'version', nv, 'checksum', ARGV[2], 'data', ARGV[3], 'updated', ARGV[4])
return nv
"""
_DELETE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_FIELDS = ("owner", "version", "checksum", "data", "created", "updated")


class RedisStore:
    """Sessions in Redis, one hash per session under ``PREFIX + id``; writes are Lua scripts (atomic)."""

    kind = "redis"

    def __init__(self, url: str, *, prefix: str = "titans:session:", timeout_s: float = 30.0) -> None:
        import redis  # the optional `serve` extra; only a Redis store needs it

        self.url = url
        self.prefix = prefix
        self._errors = (redis.RedisError, OSError)
        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
            self.client.ping()
        except (*self._errors, ValueError) as e:
            raise StoreError(f"cannot reach the session store {url}: {e}") from e
        self._create = self.client.register_script(_CREATE)
        self._put = self.client.register_script(_PUT)
        self._delete = self.client.register_script(_DELETE)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise StoreError(f"session store {self.url}: {e}") from e

    def create(self, sid: str, owner: str, data: bytes) -> Record:
        now = time.time()
        digest = checksum(data)
        if not self._call(self._create, keys=[self.prefix + sid], args=[owner, digest, data, repr(now)]):
            raise SessionExists(sid)
        return Record(sid, owner, 1, digest, data, now, now)

    def get(self, sid: str) -> Record | None:
        values = self._call(self.client.hmget, self.prefix + sid, _FIELDS)
        if values[0] is None:
            return None
        owner, version, digest, data, created, updated = values
        return Record(
            sid,
            owner.decode(),
            int(version),
            digest.decode(),
            bytes(data or b""),
            float(created),
            float(updated),
        )

    def put(self, sid: str, data: bytes, *, expected_version: int) -> int:
        args = [str(expected_version), checksum(data), data, repr(time.time())]
        result = int(self._call(self._put, keys=[self.prefix + sid], args=args))
        if result < 0:
            raise VersionConflict(sid)
        return result

    def delete(self, sid: str, owner: str) -> bool:
        return bool(self._call(self._delete, keys=[self.prefix + sid], args=[owner]))

    def count(self) -> int:
        return sum(1 for _ in self._call(self.client.scan_iter, match=self.prefix + "*", count=1000))

    def close(self) -> None:
        self.client.close()


# ------------------------------------------------------------------------------------------ URLs
def open_store(url: str) -> SessionStore:
    """A store from its URL: ``sqlite:///PATH`` (``sqlite:////abs/path`` for an absolute path),
    ``redis://[:password@]HOST:PORT/DB``, ``rediss://...`` (TLS), or ``unix:///path/redis.sock?db=N``."""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path:
            raise ValueError(f"--store {url!r}: no file path after sqlite:///")
        return SQLiteStore(path)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url)
    raise ValueError(
        f"--store {url!r}: expected sqlite:///PATH, redis://HOST:PORT/DB, rediss://... or unix:///SOCKET"
    )


__all__ = [
    "Record",
    "RedisStore",
    "SQLiteStore",
    "SessionExists",
    "SessionStore",
    "StoreError",
    "VersionConflict",
    "checksum",
    "open_store",
]
