"""What one key may hold and do on a server, and how long a session or a slow client may wait.

    quotas = Quotas(max_sessions=100, max_bytes=1 << 30, max_concurrent=2, session_ttl_s=7 * 86400)
    gate = KeyGate(quotas.max_concurrent)
    async with gate.hold(owner):        # TooBusy (a 429 with Retry-After) when the key has too much running
        ...

- sessions and stored bytes per key: checked before a session is created or changed (`check_room`); a
  request that would go past them is refused with nothing changed. Within a server a key's checks and
  the writes they allow run one at a time (`titans.serving.app.RoomLocks`); servers sharing a store each
  check the store's count, so concurrent requests of one key on several servers may pass a limit by at
  most their number (bounded by `max_concurrent` per server).
- concurrent work per key: requests of one key in this server at once (running, or waiting for a
  worker or for their session); one more is refused at once. The workers themselves are shared fairly
  (`FairLimiter`): waiting keys take turns, those running fewer than `workers_per_key` first.
- idle sessions: a session not changed for `session_ttl_s` seconds is deleted (refused as missing from
  then on, and swept from the store while the server runs).
- slow clients: a request head not received within a timeout closes the connection
  (`head_timeout_protocol`); a body not received within `body_timeout_s` gets 408 and its connection
  closed (`BodyTimeout`); idle keep-alive connections are closed by uvicorn after its keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the serve extra; `titans serve --help` reads this module's defaults without it
    from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_body_bytes: int = 1 << 20
    max_tokens: int = 16384  # tokens of text (read) or prompt (generate) per request
    max_new_tokens: int = 1024
    conflict_retries: int = 20
    max_import_bytes: int = 256 << 20  # a whole session's bytes (POST /v1/sessions/import)


log = logging.getLogger("titans.serving")

DEFAULT_MAX_SESSIONS = 1000
DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_MAX_CONCURRENT = 64
DEFAULT_SESSION_TTL_S = 30 * 86400.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Quotas:
    """Per-key limits (None: no limit). max_bytes counts the bytes a key's sessions take in the store
    (each distinct state once)."""

    max_sessions: int | None = DEFAULT_MAX_SESSIONS
    max_bytes: int | None = DEFAULT_MAX_BYTES
    max_concurrent: int | None = DEFAULT_MAX_CONCURRENT
    session_ttl_s: float | None = DEFAULT_SESSION_TTL_S
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    workers_per_key: int | None = None  # None: half the workers (at least 1)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_bytes", "max_concurrent", "workers_per_key"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Quotas.{name} must be an int >= 1 or None, got {value!r}")
        for name in ("session_ttl_s", "body_timeout_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"Quotas.{name} must be a number of seconds > 0 or None, got {value!r}")


UNLIMITED = Quotas(None, None, None, None, None)  # workers still shared fairly (half each)


class ShuttingDown(Exception):
    """A request that had not started when the server began to stop: a 503 with Retry-After."""


class TooBusy(Exception):
    """A request past a key's limit: a 429 whose Retry-After says when to try again (seconds)."""

    def __init__(self, detail: str, retry_after_s: int) -> None:
        super().__init__(detail)
        self.detail, self.retry_after_s = detail, max(1, int(retry_after_s))

    def __reduce__(self):  # pickled whole: it crosses from a worker process (titans.serving.workers)
        return type(self), (self.detail, self.retry_after_s)


def check_room(quotas: Quotas, usage: tuple[int, int], *, new_sessions: int = 0, new_bytes: int = 0) -> None:
    """Refuse (TooBusy) a change that would take a key with `usage` (sessions, bytes) past its quotas."""
    sessions, stored = usage
    later = 60  # room comes back when the key deletes sessions (or they expire): no time to promise
    if quotas.max_sessions is not None and new_sessions and sessions + new_sessions > quotas.max_sessions:
        raise TooBusy(
            f"this key holds {sessions} sessions, the limit is {quotas.max_sessions} "
            "(--max-sessions-per-key): delete sessions it no longer needs",
            later,
        )
    if quotas.max_bytes is not None and new_bytes > 0 and stored + new_bytes > quotas.max_bytes:
        raise TooBusy(
            f"this key's sessions take {stored} bytes in the store; this change would take them past the "
            f"limit of {quotas.max_bytes} (--max-bytes-per-key): delete sessions it no longer needs",
            later,
        )


class KeyGate:
    """At most `limit` requests of one key at once (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._running: dict[str, int] = {}

    def running(self, owner: str) -> int:
        return self._running.get(owner, 0)

    @asynccontextmanager
    async def hold(self, owner: str) -> AsyncIterator[None]:
        n = self._running.get(owner, 0)
        if self.limit is not None and n >= self.limit:
            raise TooBusy(
                f"this key has {n} requests running, the limit is {self.limit} (--max-concurrent-per-key): "
                "wait for one to finish",
                1,
            )
        self._running[owner] = n + 1
        try:
            yield
        finally:
            left = self._running[owner] - 1
            if left:
                self._running[owner] = left
            else:
                del self._running[owner]


class FairLimiter:
    """`total` worker slots shared by keys, with the requests of one session run one at a time.

    When slots free up, the waiting keys get them in turn (round-robin), not in order of arrival, and a
    key already running `per_key` requests only after the keys below that: a key with many queued
    requests delays another key's request by at most the rest of one running request. A key alone may use
    every slot (no slot stays idle while work that may run waits).

    Within a key, the request that asked first goes first among those that may run: a request whose
    session is busy (`sid` given, and another request of that session running) waits in line, keeps its
    place, and runs as soon as its session is free if it is then the oldest. (With a lock per session
    taken before joining the line, each request of a busy session would join at the back once the one
    before it ended: a session with k requests waiting would make its last one wait k trips through the
    whole line, p99 4-5x the median under a steady load.)"""

    def __init__(self, total: int, per_key: int | None = None) -> None:
        if total < 1:
            raise ValueError(f"FairLimiter: total must be >= 1, got {total}")
        self.total = total
        self.per_key = min(total, per_key) if per_key is not None else total
        self.free = total
        self._used: dict[str, int] = {}
        self._busy: set[Hashable] = set()  # sessions with a request running
        # per waiting key, longest-waiting key first: its requests (session, future), oldest first
        self._waiting: OrderedDict[str, list[tuple[Hashable | None, asyncio.Future]]] = OrderedDict()
        self.closed = False

    def close(self) -> None:
        """The server is stopping: every waiting request, and every later one, raises `ShuttingDown`
        (the running ones finish)."""
        self.closed = True
        waiting, self._waiting = self._waiting, OrderedDict()
        for queue in waiting.values():
            for _, future in queue:
                if not future.done():
                    future.set_exception(ShuttingDown())

    @asynccontextmanager
    async def slot(self, key: str, sid: Hashable | None = None) -> AsyncIterator[None]:
        """Run when a slot is free and session `sid` (any hashable: the caller decides what one session
        is) runs nothing else. Raises `ShuttingDown` once `close` was called, for a request waiting then
        or arriving after."""
        if self.closed:
            raise ShuttingDown()
        future = asyncio.get_running_loop().create_future()
        entry = (sid, future)
        self._waiting.setdefault(key, []).append(entry)
        self._dispatch()
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._give(key, sid)  # granted as it was cancelled: hand it on
            else:
                queue = self._waiting.get(key)
                if queue is not None and entry in queue:
                    queue.remove(entry)
                    if not queue:
                        del self._waiting[key]
            raise
        try:
            yield
        finally:
            self._give(key, sid)

    def _give(self, key: str, sid: Hashable | None) -> None:
        self.free += 1
        left = self._used[key] - 1
        if left:
            self._used[key] = left
        else:
            del self._used[key]
        self._busy.discard(sid)
        self._dispatch()

    def _next(self, key: str) -> int | None:
        """The index of the oldest request of `key` that may run (its session not busy), or None."""
        return next((i for i, (sid, _) in enumerate(self._waiting[key]) if sid not in self._busy), None)

    def _dispatch(self) -> None:
        while self.free:
            # the longest-waiting key under its share with a request that may run, else the longest-waiting
            ready = [(k, i) for k in self._waiting if (i := self._next(k)) is not None]
            if not ready:
                return
            key, i = next(((k, i) for k, i in ready if self._used.get(k, 0) < self.per_key), ready[0])
            queue = self._waiting.pop(key)
            sid, future = queue.pop(i)
            if queue:
                self._waiting[key] = queue  # back of the line
            if future.done():  # cancelled while it waited (its request is gone): no slot to hand it
                continue
            self.free -= 1
            self._used[key] = self._used.get(key, 0) + 1
            if sid is not None:
                self._busy.add(sid)
            future.set_result(None)


class Sweeper:
    """Deletes the sessions of `store` not changed for `ttl_s` seconds, at most once per `every_s`
    seconds, in a thread of its own (started by `maybe_sweep`, which requests call)."""

    def __init__(self, store, ttl_s: float | None, every_s: float | None = None) -> None:
        self.store, self.ttl_s = store, ttl_s
        self.every_s = every_s if every_s is not None else (min(60.0, ttl_s / 4) if ttl_s else 0.0)
        self._last = 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def expired(self, updated: float) -> bool:
        return self.ttl_s is not None and updated < time.time() - self.ttl_s

    def maybe_sweep(self) -> None:
        if self.ttl_s is None:
            return
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s or (self._thread is not None and self._thread.is_alive()):
                return
            self._last = now
            self._thread = threading.Thread(target=self.sweep, name="titans-session-sweep", daemon=True)
            self._thread.start()

    def sweep(self) -> list[str]:
        """Delete the expired sessions now: their ids."""
        if self.ttl_s is None:
            return []
        try:
            gone = self.store.expire(time.time() - self.ttl_s)
        except Exception as e:  # a store that is down now: the next sweep tries again
            log.warning("sweeping idle sessions failed: %s", type(e).__name__)
            return []
        if gone:
            log.info("%d idle sessions expired", len(gone))
        return gone

    def expire_one(self, sid: str, owner: str) -> None:
        """Delete session `sid` if it is still idle past the TTL: the store checks its last change in the
        same step as the delete, so a change written since it was found idle keeps it. A store that is down
        leaves it (the next sweep tries again)."""
        if self.ttl_s is None:
            return
        try:
            self.store.delete(sid, owner, changed_before=time.time() - self.ttl_s)
        except Exception as e:
            log.warning("expiring an idle session failed: %s", type(e).__name__)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


class BodyTimeout:
    """ASGI middleware: a request whose body has not fully arrived `timeout_s` seconds after the request
    started gets 408 and its connection closed (a slow or stalled client holds no worker and no
    connection slot for longer). The body is not read here: the deadline applies to the app's own reads
    of it, so a route may refuse a request (a key over its limits) before its body is read at all."""

    def __init__(self, app: ASGIApp, timeout_s: float | None) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout_s is None:
            await self.app(scope, receive, send)
            return
        import anyio  # the serve extra, there whenever an app is
        from starlette.exceptions import HTTPException

        deadline = anyio.current_time() + self.timeout_s
        arrived = False  # the whole body: later receives wait for the client to go (not timed)

        async def timed() -> Message:
            nonlocal arrived
            if arrived:
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    arrived = True
                return message
            # FastAPI re-raises an HTTPException met while reading the body; its handler answers it
            raise HTTPException(
                408,
                f"the request body did not arrive within {self.timeout_s:g} s (--body-timeout)",
                headers={"Connection": "close"},
            )

        await self.app(scope, timed, send)


def head_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline on a request's head: a connection that has not sent a whole
    request line and headers `timeout_s` seconds after it opened (or after it sent the first bytes of its
    next request) is closed. uvicorn times out idle keep-alive connections, but not a client that trickles
    a head in, nor one that connects and sends nothing. Pass it as ``uvicorn.run(..., http=...)``."""
    if not 0 < timeout_s < float("inf"):
        raise ValueError(
            f"head_timeout_protocol: timeout_s must be a number of seconds > 0, got {timeout_s!r}"
        )
    from uvicorn.protocols.http.h11_impl import H11Protocol  # the serve extra

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watching()
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

        def _watch_head(self) -> None:
            if not self._waiting_for_head():
                self._stop_watching()
            elif self._head_timer is None:  # the deadline runs from the head's first byte (or the connect)
                self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _stop_watching(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self._waiting_for_head():
                self.transport.close()

    return HeadTimeoutProtocol


__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_TTL_S",
    "UNLIMITED",
    "BodyTimeout",
    "FairLimiter",
    "KeyGate",
    "Limits",
    "Quotas",
    "ShuttingDown",
    "Sweeper",
    "TooBusy",
    "check_room",
    "head_timeout_protocol",
]
