"""Where sessions live between requests: one SQLite file (the default), or a Redis server shared by many
servers.

A record is the session's bytes cut into parts (`titans.serving.session.session_parts`: the header, each
kept state, the trailer), each part stored once per session under its sha256, plus the list of those
digests, the sha256 of the whole, the owner (the sha256 of the key that created it), its size and a
version. A write stores only the parts the record does not hold yet and drops the parts it no longer
names, so a read that adds one state writes that state and a small header, not every snapshot again.
A write names the version it started from and succeeds only if the record still has it (compare-and-set,
in one SQLite transaction or one Lua script on Redis: atomic); it then holds version + 1. Two servers
sharing a store therefore cannot lose an update: the second writer gets `VersionConflict` and starts again
from the newer record.

    store = open_store("sqlite:///sessions.db")          # or redis://HOST:PORT/DB, unix:///path.sock?db=0
    store.create(sid, owner, parts)                      # version 1; parts: bytes or a list of bytes
    store.owner(sid)                                     # the owner only (no state read), or None
    record = store.get(sid)                              # Record | None; record.intact checks the sha256
    store.put(sid, parts, expected_version=record.version)  # -> new version, or VersionConflict
    store.delete(sid, owner)                             # -> whether it was there (and owned)
    store.delete(sid, owner, changed_before=t)           # only if not changed since t (one idle session)
    store.usage(owner)                                   # (sessions, stored bytes) of one owner
    store.expire(before)                                 # delete the sessions last changed before a time

A write returns only once the store holds it: SQLite in WAL mode with ``synchronous=FULL`` (the commit
is on disk), Redis once the server has applied it (on disk as its own persistence settings say).
Connections are pooled (at most `pool_size` per store) and closed by `close`.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DEFAULT_POOL_SIZE = 8


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
    parts: tuple[str, ...] = ()  # the digests of the parts `data` was joined from (empty: one legacy blob)
    missing: bool = False  # a part the record names is not in the store
    size: int = 0  # bytes the record takes in the store (each distinct part once)

    @property
    def intact(self) -> bool:
        """Whether the bytes still have the checksum they were written with (and every part is there)."""
        return not self.missing and checksum(self.data) == self.checksum


class KnownParts(list):
    """Parts (bytes) with what their writer already knows of them: `checksum`, the SHA-256 (hex) of their
    joined bytes, and `digests`, per part its SHA-256 (hex) or None. The stores here hash only the parts
    whose digest is not known (a session's new state, not the snapshots it kept); any other store sees a
    list of bytes. The writer vouches for them: they are stored as given."""

    def __init__(self, parts: Sequence[bytes], checksum: str, digests: Sequence[str | None]) -> None:
        super().__init__(parts)
        if len(digests) != len(self):
            raise ValueError(f"KnownParts: {len(digests)} digests for {len(self)} parts")
        self.checksum, self.digests = checksum, list(digests)


@dataclass(frozen=True)
class _Parts:
    """A record's bytes as stored: digests in order, the distinct parts by digest, sizes."""

    order: tuple[str, ...]
    blobs: dict[str, bytes | memoryview]
    checksum: str
    size: int  # bytes stored (distinct parts)

    @classmethod
    def of(cls, data: bytes | Sequence[bytes]) -> _Parts:
        pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        known = data.digests if isinstance(data, KnownParts) else [None] * len(pieces)
        whole = None if isinstance(data, KnownParts) else hashlib.sha256()
        blobs: dict[str, bytes | memoryview] = {}
        order = []
        for piece, digest in zip(pieces, known, strict=True):
            piece = _frozen(piece)
            if whole is not None:
                whole.update(piece)
            digest = digest or checksum(piece)
            blobs.setdefault(digest, piece)
            order.append(digest)
        total = data.checksum if whole is None else whole.hexdigest()
        return cls(tuple(order), blobs, total, sum(len(b) for b in blobs.values()))

    def joined(self) -> bytes:
        return b"".join(self.blobs[d] for d in self.order)


def _frozen(piece: bytes | bytearray | memoryview) -> bytes | memoryview:
    """`piece` as bytes that cannot change after they are hashed: bytes, or a read-only byte view of
    immutable bytes (a session's unchanged states are views of the record they were read from: stored
    from the view, they are not copied); anything else copied."""
    if isinstance(piece, bytes):
        return piece
    if (
        isinstance(piece, memoryview)
        and piece.readonly
        and isinstance(piece.obj, bytes)
        and piece.format == "B"
        and piece.contiguous
    ):
        return piece
    return bytes(piece)


def _assemble(order: Sequence[str], found: dict[str, bytes]) -> tuple[bytes, bool]:
    """(the bytes of the parts in `order`, whether one is missing). A part that does not match its digest
    is found by `Record.intact`: the whole record's sha256 covers it (one pass over the bytes, not two)."""
    missing = any(d not in found for d in order)
    return b"".join(found.get(d, b"") for d in order), missing


class SessionStore(Protocol):
    url: str
    kind: str

    def create(self, sid: str, owner: str, data: bytes | Sequence[bytes]) -> Record: ...
    def owner(self, sid: str) -> str | None: ...
    def get(self, sid: str) -> Record | None: ...
    def put(self, sid: str, data: bytes | Sequence[bytes], *, expected_version: int) -> int: ...
    def delete(self, sid: str, owner: str, changed_before: float | None = None) -> bool: ...
    def usage(self, owner: str) -> tuple[int, int]: ...
    def expire(self, before: float) -> list[str]: ...
    def count(self) -> int: ...
    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ SQLite
class _ConnectionPool:
    """At most `size` connections, lent to one thread at a time and kept for the next (threads of a
    pool come and go: a connection per thread would leak one file descriptor set per retired thread)."""

    def __init__(self, connect, size: int, what: str) -> None:
        if size < 1:
            raise ValueError(f"pool_size must be >= 1, got {size}")
        self._connect, self.size, self._what = connect, size, what
        self._idle: list[sqlite3.Connection] = []
        self._open = 0
        self._closed = False
        self._cv = threading.Condition()

    @property
    def open(self) -> int:
        """Connections open now (idle or lent)."""
        return self._open

    @contextmanager
    def lend(self) -> Iterator[sqlite3.Connection]:
        with self._cv:
            while not self._idle and self._open >= self.size and not self._closed:
                self._cv.wait()
            if self._closed:
                raise StoreError(f"session store {self._what} is closed")
            conn = self._idle.pop() if self._idle else None
            if conn is None:
                self._open += 1
        if conn is None:
            try:
                conn = self._connect()
            except BaseException:
                with self._cv:
                    self._open -= 1
                    self._cv.notify()
                raise
        try:
            yield conn
        finally:
            if conn.in_transaction:  # an error in the middle of a transaction: nothing of it stays
                with suppress(sqlite3.Error):
                    conn.rollback()
            with self._cv:
                if self._closed:
                    conn.close()
                    self._open -= 1
                else:
                    self._idle.append(conn)
                self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for conn in self._idle:
                conn.close()
            self._open -= len(self._idle)
            self._idle.clear()
            self._cv.notify_all()


class SQLiteStore:
    """Sessions in one SQLite file (WAL mode: readers never wait for the writer), on a pool of at most
    `pool_size` connections. Tables: ``sessions`` (one row per session: owner, version, checksum, the
    digests of its parts, size, times) and ``parts`` (one row per distinct part of a session)."""

    kind = "sqlite"

    def __init__(
        self, path: str | Path, *, busy_timeout_s: float = 30.0, pool_size: int = DEFAULT_POOL_SIZE
    ) -> None:
        self.path = Path(path).expanduser()
        self.url = f"sqlite:///{self.path}"
        self.busy_timeout_s = busy_timeout_s
        self.pool = _ConnectionPool(self._connect, pool_size, self.url)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.pool.lend() as conn:
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
                    "version INTEGER NOT NULL, checksum TEXT NOT NULL, data BLOB NOT NULL, "
                    "created REAL NOT NULL, updated REAL NOT NULL)"
                )
                columns = {row[1] for row in conn.execute("PRAGMA table_info(sessions)")}
                if "parts" not in columns:  # a store written before parts: its records stay readable
                    conn.execute("ALTER TABLE sessions ADD COLUMN parts TEXT")
                if "size" not in columns:
                    conn.execute("ALTER TABLE sessions ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
                # a rowid table: its rows (whole states) are far larger than a page
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS parts (sid TEXT NOT NULL, digest TEXT NOT NULL, "
                    "data BLOB NOT NULL, UNIQUE (sid, digest))"
                )
                conn.execute("CREATE INDEX IF NOT EXISTS sessions_owner ON sessions (owner)")
                # the sweep's search for idle sessions (`expire`), inside its write transaction
                conn.execute("CREATE INDEX IF NOT EXISTS sessions_updated ON sessions (updated)")
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open the session store {self.url}: {e}") from e

    def _connect(self) -> sqlite3.Connection:
        # autocommit (isolation_level=None): each statement is its own transaction unless BEGIN says
        conn = sqlite3.connect(
            self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # an acknowledged write survives a crash of the machine
        # some builds zero every freed page (secure_delete=1): a dropped snapshot would cost as many page
        # writes as a new one. FAST clears deleted content only where no extra page is written
        conn.execute("PRAGMA secure_delete=FAST")
        return conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE: the write lock taken up front), committed at the end,
        rolled back on any error."""
        try:
            with self.pool.lend() as conn:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
        except (sqlite3.IntegrityError, VersionConflict, SessionExists):
            raise
        except sqlite3.Error as e:
            raise StoreError(f"session store {self.url}: {e}") from e

    def _run(self, sql: str, args: tuple) -> list[tuple]:
        try:
            with self.pool.lend() as conn:
                cur = conn.execute(sql, args)
                return cur.fetchall() if cur.description else [(cur.rowcount,)]
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as e:
            raise StoreError(f"session store {self.url}: {e}") from e

    @staticmethod
    def _store_parts(conn: sqlite3.Connection, sid: str, parts: _Parts, held: set[str]) -> None:
        conn.executemany(
            "INSERT OR REPLACE INTO parts (sid, digest, data) VALUES (?, ?, ?)",
            [(sid, d, b) for d, b in parts.blobs.items() if d not in held],
        )
        conn.executemany(
            "DELETE FROM parts WHERE sid = ? AND digest = ?",
            [(sid, d) for d in held - parts.blobs.keys()],
        )

    def create(self, sid: str, owner: str, data: bytes | Sequence[bytes]) -> Record:
        now = time.time()
        parts = _Parts.of(data)
        try:
            with self._transaction() as conn:
                conn.execute(
                    "INSERT INTO sessions (id, owner, version, checksum, data, created, updated, parts, "
                    "size) VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?)",
                    (sid, owner, parts.checksum, b"", now, now, json.dumps(parts.order), parts.size),
                )
                conn.execute("DELETE FROM parts WHERE sid = ?", (sid,))  # none, unless left by a bug
                self._store_parts(conn, sid, parts, set())
        except sqlite3.IntegrityError as e:
            raise SessionExists(sid) from e
        return Record(sid, owner, 1, parts.checksum, parts.joined(), now, now, parts.order, size=parts.size)

    def owner(self, sid: str) -> str | None:
        rows = self._run("SELECT owner FROM sessions WHERE id = ?", (sid,))
        return rows[0][0] if rows else None

    def get(self, sid: str) -> Record | None:
        try:
            with self.pool.lend() as conn:
                conn.execute("BEGIN")  # the row and its parts from one snapshot of the file
                row = conn.execute(
                    "SELECT id, owner, version, checksum, data, created, updated, parts, size FROM "
                    "sessions WHERE id = ?",
                    (sid,),
                ).fetchone()
                found = {}
                if row is not None and row[7] is not None:
                    found = {
                        d: bytes(b)
                        for d, b in conn.execute("SELECT digest, data FROM parts WHERE sid = ?", (sid,))
                    }
                conn.execute("COMMIT")
        except sqlite3.Error as e:
            raise StoreError(f"session store {self.url}: {e}") from e
        if row is None:
            return None
        order, missing, data = (), False, bytes(row[4])
        if row[7] is not None:
            try:
                order = tuple(json.loads(row[7]))
            except ValueError:
                order, missing = (), True
            data, damaged = _assemble(order, found)
            missing = missing or damaged
        # a damaged version (text, or 2.5, which int() would truncate) refuses the record, not a crash
        version = row[2] if isinstance(row[2], int) else -1
        missing = missing or version < 0
        size = int(row[8] or 0) + len(row[4])
        times = float(row[5]), float(row[6])
        return Record(row[0], row[1], version, row[3], data, *times, order, missing, size)

    def put(self, sid: str, data: bytes | Sequence[bytes], *, expected_version: int) -> int:
        parts = _Parts.of(data)
        with self._transaction() as conn:
            row = conn.execute("SELECT version FROM sessions WHERE id = ?", (sid,)).fetchone()
            if row is None or row[0] != expected_version:
                raise VersionConflict(sid)
            held = {d for (d,) in conn.execute("SELECT digest FROM parts WHERE sid = ?", (sid,))}
            self._store_parts(conn, sid, parts, held)
            conn.execute(
                "UPDATE sessions SET data = ?, checksum = ?, parts = ?, size = ?, version = version + 1, "
                "updated = ? WHERE id = ?",
                (b"", parts.checksum, json.dumps(parts.order), parts.size, time.time(), sid),
            )
        return expected_version + 1

    def delete(self, sid: str, owner: str, changed_before: float | None = None) -> bool:
        with self._transaction() as conn:
            if changed_before is None:
                gone = conn.execute("DELETE FROM sessions WHERE id = ? AND owner = ?", (sid, owner)).rowcount
            else:
                gone = conn.execute(
                    "DELETE FROM sessions WHERE id = ? AND owner = ? AND updated < ?",
                    (sid, owner, changed_before),
                ).rowcount
            if gone:
                conn.execute("DELETE FROM parts WHERE sid = ?", (sid,))
        return gone == 1

    def usage(self, owner: str) -> tuple[int, int]:
        rows = self._run(
            "SELECT COUNT(*), COALESCE(SUM(size + LENGTH(data)), 0) FROM sessions WHERE owner = ?", (owner,)
        )
        return int(rows[0][0]), int(rows[0][1])

    def expire(self, before: float) -> list[str]:
        with self._transaction() as conn:
            sids = [sid for (sid,) in conn.execute("SELECT id FROM sessions WHERE updated < ?", (before,))]
            conn.executemany("DELETE FROM parts WHERE sid = ?", [(s,) for s in sids])
            conn.executemany("DELETE FROM sessions WHERE id = ?", [(s,) for s in sids])
        return sids

    def count(self) -> int:
        return int(self._run("SELECT COUNT(*) FROM sessions", ())[0][0])

    def close(self) -> None:
        self.pool.close()


# ------------------------------------------------------------------------------------------ Redis
# KEYS: the record, its parts, the owner's index (session id -> size), the index of last changes.
# ARGV: owner, checksum, parts (digests joined by spaces), size, now, sid, then digest, bytes pairs
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'version', 1, 'checksum', ARGV[2], 'parts', ARGV[3],
           'size', ARGV[4], 'created', ARGV[5], 'updated', ARGV[5])
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[3], ARGV[6], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[6])
return 1
"""
# KEYS[3] is here the owner index's prefix (the owner is read from the record: single-node Redis).
# ARGV: expected version, checksum, parts, size, now, sid, then digest, bytes pairs of the parts sent.
# -1: no such record; -2: another version; -3: a part not sent is not held; else the new version
_PUT = """
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return -1 end
if v ~= ARGV[1] then return -2 end
local sent = {}
for i = 7, #ARGV, 2 do sent[ARGV[i]] = true end
local keep = {}
for d in string.gmatch(ARGV[3], '%S+') do
  keep[d] = true
  if not sent[d] and redis.call('HEXISTS', KEYS[2], d) == 0 then return -3 end
end
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
for _, d in ipairs(redis.call('HKEYS', KEYS[2])) do
  if not keep[d] then redis.call('HDEL', KEYS[2], d) end
end
local nv = tonumber(v) + 1
redis.call('HSET', KEYS[1], 'version', nv, 'checksum', ARGV[2], 'parts', ARGV[3], 'size', ARGV[4],
           'updated', ARGV[5])
redis.call('HDEL', KEYS[1], 'data')
local owner = redis.call('HGET', KEYS[1], 'owner')
redis.call('HSET', KEYS[3] .. owner, ARGV[6], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[6])
return nv
"""
# KEYS: the record, its parts, the owner's index, the index of changes; ARGV: owner, sid, [changed before]
_DELETE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[3] and tonumber(redis.call('HGET', KEYS[1], 'updated')) >= tonumber(ARGV[3]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
return 1
"""
_FIELDS = ("owner", "version", "checksum", "data", "created", "updated", "parts", "size")


class RedisStore:
    """Sessions in Redis: a hash per session under ``PREFIX + id`` (owner, version, checksum, the digests
    of its parts, size, times), its parts in a hash under ``PREFIX + "parts:" + id``, every owner's sessions
    and sizes in a hash under ``PREFIX + "owner:" + owner``, last changes in a sorted set under
    ``PREFIX + "index:changed"``. Writes are Lua scripts (atomic); at most `pool_size` connections."""

    kind = "redis"
    _SEEN = 4096  # records whose part digests are remembered (a write sends only the new parts)

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "titans:session:",
        timeout_s: float = 30.0,
        pool_size: int = DEFAULT_POOL_SIZE,
    ) -> None:
        import redis  # the optional `serve` extra; only a Redis store needs it

        self.url = url
        self.prefix = prefix
        self._errors = (redis.RedisError, OSError)
        self._seen: OrderedDict[str, tuple[int, frozenset[str]]] = OrderedDict()
        self._seen_lock = threading.Lock()
        try:
            pool = redis.BlockingConnectionPool.from_url(
                url,
                max_connections=pool_size,
                timeout=timeout_s,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
            )
            self.client = redis.Redis(connection_pool=pool)
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

    def _keys(self, sid: str, owner_key: str) -> list[str]:
        return [self.prefix + sid, self.prefix + "parts:" + sid, owner_key, self.prefix + "index:changed"]

    def _remember(self, sid: str, version: int, parts: Sequence[str]) -> None:
        with self._seen_lock:
            self._seen[sid] = (version, frozenset(parts))
            self._seen.move_to_end(sid)
            while len(self._seen) > self._SEEN:
                self._seen.popitem(last=False)

    def create(self, sid: str, owner: str, data: bytes | Sequence[bytes]) -> Record:
        now = time.time()
        parts = _Parts.of(data)
        pairs = [x for item in parts.blobs.items() for x in item]
        args = [owner, parts.checksum, " ".join(parts.order), parts.size, repr(now), sid, *pairs]
        created = self._call(self._create, keys=self._keys(sid, self.prefix + "owner:" + owner), args=args)
        if not created:
            raise SessionExists(sid)
        self._remember(sid, 1, parts.order)
        return Record(sid, owner, 1, parts.checksum, parts.joined(), now, now, parts.order, size=parts.size)

    def owner(self, sid: str) -> str | None:
        owner = self._call(self.client.hget, self.prefix + sid, "owner")
        return None if owner is None else owner.decode()

    def get(self, sid: str) -> Record | None:
        pipe = self.client.pipeline(transaction=True)  # the record and its parts at one moment
        pipe.hmget(self.prefix + sid, _FIELDS)
        pipe.hgetall(self.prefix + "parts:" + sid)
        values, found = self._call(pipe.execute)
        if values[0] is None:
            return None
        owner, version, digest, data, created, updated, parts, size = values
        order: tuple[str, ...] = ()
        missing = False
        data = bytes(data or b"")
        if parts is not None:
            order = tuple(parts.decode().split())
            data, missing = _assemble(order, {k.decode(): bytes(v) for k, v in found.items()})
        try:
            version = int(version)
        except (TypeError, ValueError):
            version, missing = -1, True  # a damaged version: the record is refused, not a crash
        record = Record(
            sid, owner.decode(), version, (digest or b"").decode(), data, float(created or 0),
            float(updated or 0), order, missing, int(size or 0) + (0 if parts is not None else len(data)),
        )  # fmt: skip
        if not missing:
            self._remember(sid, version, order)
        return record

    def put(self, sid: str, data: bytes | Sequence[bytes], *, expected_version: int) -> int:
        parts = _Parts.of(data)
        with self._seen_lock:
            version, held = self._seen.get(sid, (None, frozenset()))
        if version != expected_version:
            held = frozenset()
        for _ in range(2):
            pairs = [x for d, b in parts.blobs.items() if d not in held for x in (d, b)]
            args = [str(expected_version), parts.checksum, " ".join(parts.order), parts.size]
            result = int(
                self._call(
                    self._put,
                    keys=self._keys(sid, self.prefix + "owner:"),
                    args=[*args, repr(time.time()), sid, *pairs],
                )
            )
            if result != -3:
                break
            held = frozenset()  # the parts this server remembered are gone: send them all
        if result < 0:
            raise VersionConflict(sid)
        self._remember(sid, result, parts.order)
        return result

    def delete(self, sid: str, owner: str, changed_before: float | None = None) -> bool:
        keys = self._keys(sid, self.prefix + "owner:" + owner)
        args = [owner, sid] if changed_before is None else [owner, sid, repr(changed_before)]
        return bool(self._call(self._delete, keys=keys, args=args))

    def usage(self, owner: str) -> tuple[int, int]:
        sizes = self._call(self.client.hvals, self.prefix + "owner:" + owner)
        return len(sizes), sum(int(s) for s in sizes)

    def expire(self, before: float) -> list[str]:
        sids = [
            s.decode()
            for s in self._call(self.client.zrangebyscore, self.prefix + "index:changed", 0, before)
        ]
        gone = []
        for sid in sids:
            owner = self.owner(sid)
            if owner is None:
                self._call(self.client.zrem, self.prefix + "index:changed", sid)
                continue
            keys = self._keys(sid, self.prefix + "owner:" + owner)
            if self._call(self._delete, keys=keys, args=[owner, sid, repr(before)]):
                gone.append(sid)
        return gone

    def count(self) -> int:
        n = 0
        for key in self._call(self.client.scan_iter, match=self.prefix + "*", count=1000):
            n += b":" not in key[len(self.prefix) :]  # not an index nor a record's parts
        return n

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()


# ------------------------------------------------------------------------------------------ URLs
# ------------------------------------------------------------------------------------------ by URL
# URL scheme -> a function (url, pool_size) -> SessionStore; `register_store` adds one, `open_store` reads
STORES: dict[str, Callable[[str, int], SessionStore]] = {}


def register_store(*schemes: str) -> Callable:
    """Register an opener `(url, pool_size) -> SessionStore` for URLs that start with ``scheme://``; a
    taken scheme is refused (docs/extending.md has a whole store)."""

    def register(opener: Callable[[str, int], SessionStore]) -> Callable[[str, int], SessionStore]:
        for scheme in schemes:
            if scheme in STORES:
                raise ValueError(f"store scheme {scheme!r} is taken by {STORES[scheme].__qualname__}")
            STORES[scheme] = opener
        return opener

    return register


@register_store("sqlite")
def _open_sqlite(url: str, pool_size: int) -> SQLiteStore:
    path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else ""
    if not path:
        raise ValueError(f"--store {url!r}: expected sqlite:///PATH (sqlite:////abs/path), a file path")
    return SQLiteStore(path, pool_size=pool_size)


@register_store("redis", "rediss", "unix")
def _open_redis(url: str, pool_size: int) -> RedisStore:
    return RedisStore(url, pool_size=pool_size)


def open_store(url: str, *, pool_size: int = DEFAULT_POOL_SIZE) -> SessionStore:
    """A store from its URL: ``sqlite:///PATH`` (``sqlite:////abs/path`` for an absolute path),
    ``redis://[:password@]HOST:PORT/DB``, ``rediss://...`` (TLS), ``unix:///path/redis.sock?db=N``, or the
    scheme of a store added with `register_store`; at most `pool_size` connections."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in STORES:
        known = ", ".join(f"{name}://" for name in STORES)
        raise ValueError(f"--store: unknown store URL (expected one of {known})")
    rest = url.split("://", 1)[1]
    where, query = rest.split("/", 1)[0], rest.partition("?")[2]
    if any(c.isspace() for c in where + query):
        # a valid URL has none there; Redis's parser took a password with a space all the same, and the
        # redaction of logged URLs (`redact`) ends a password at whitespace: the rest would be logged
        raise ValueError(
            "--store: the URL's host part or query holds whitespace (a password with a space?): "
            "percent-encode it (a space is %20)"
        )
    return STORES[scheme](url, pool_size)


__all__ = [
    "DEFAULT_POOL_SIZE",
    "KnownParts",
    "Record",
    "RedisStore",
    "STORES",
    "SQLiteStore",
    "SessionExists",
    "SessionStore",
    "StoreError",
    "VersionConflict",
    "checksum",
    "open_store",
    "register_store",
]
