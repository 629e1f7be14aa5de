"""The HTTP API (FastAPI): sessions created, fed, queried, frozen, rolled back, forked, exported and
imported, each persisted in the store before its request returns; generation also streamed (server-sent
events).

    app = create_app(engine, store, key_hashes=load_api_keys("keys.txt"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Consistency: requests to one session are serialised in this process (`FairLimiter` runs one request of a
session at a time, and otherwise the oldest request first), different sessions run in parallel (the
model work runs on `workers` threads, or `workers` processes: `titans.serving.workers`, each with a copy
of the engine; the limits and turns stay here). Each change reads the record, applies the operation and
writes it back with compare-and-set on the record's version; if another server sharing the store wrote
in between, the change starts again from the newer record (up to `conflict_retries` times, then 409). So
an acknowledged change is applied exactly once and is in the store. A session idle past the key's
--session-ttl is deleted by the store's own check of its last change (`SessionStore.expire`, and
`delete(changed_before=...)` for the one a request finds idle), so a change written since another request
found it idle keeps it.

Shutdown (`SessionService.stop`, which `titans serve` calls when the server begins to stop): the
requests still waiting for a worker get 503 with Retry-After, nothing of them applied; the running ones
finish, and one still running when the graceful-shutdown time (--shutdown-timeout) ends gets 503 too.

Errors: every refused request gets a 4xx (or 503) whose body is `ErrorBody`, ``{"detail": ...}`` naming
the problem, and every status a route can answer is declared in the OpenAPI schema with that body: 401
no, unknown or non-ASCII key, 404 unknown session or one of another key, 409 a stored state that cannot
be read (damaged bytes, or a state of another model) or no such snapshot, 413 a body over the limit, 422 a
malformed body (not UTF-8 JSON, fields missing, of the wrong type or out of range, text that is not
valid Unicode, over the token limit, symbols the model cannot read), 408 a body that did not arrive in
time, 429 a per-key limit (`titans.serving.limits`, with Retry-After), 503 the store unreachable or too
slow, the model not warmed up yet, or the server shutting down. No answer holds a store URL, a file path
or an exception's text; the log holds them with passwords redacted.

Readiness: `GET /v1/health` is liveness (ok while the process serves HTTP); `GET /v1/ready` is ok once
the model has run a warm-up read and generation at start-up (its kernels built or loaded), and the
session routes answer 503 until then.

The sessions are `titans.inference.session.MemorySession`s, stored as their `to_bytes`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import multiprocessing
import pickle
import random
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from titans.inference.generation import continuation_text
from titans.inference.session import MemorySession, OtherWeightsError, SessionFormatError
from titans.models.decode_graph import decode_cycle
from titans.models.state import StateFileError
from titans.runtime.sampling import SAMPLING
from titans.serving.auth import ANONYMOUS, bearer_key, hash_key, key_problem
from titans.serving.errors import STATUS_MEANINGS, ApiError, redact
from titans.serving.limits import (
    BodyTimeout,
    FairLimiter,
    KeyGate,
    Limits,
    Quotas,
    ShuttingDown,
    Sweeper,
    TooBusy,
    check_room,
)
from titans.serving.session import (
    Engine,
    generate_json,
    known_digests,
    read_json,
    snapshots_json,
    stats_json,
)
from titans.serving.stores import (
    KnownParts,
    Record,
    SessionExists,
    SessionStore,
    StoreError,
    VersionConflict,
    open_store,
)
from titans.serving.workers import ProcessPool, WorkerDied, reuse_freed_memory

log = logging.getLogger("titans.serving")
T = TypeVar("T")
_SESSION_ID = re.compile(r"^[0-9a-f]{32}$")


class ErrorBody(BaseModel):
    """The body of every error answer (`titans.serving.errors`)."""

    detail: str = Field(description="what was wrong with the request, or why it could not be served")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route that can answer these error statuses, each with `ErrorBody`."""
    return {status: {"model": ErrorBody, "description": STATUS_MEANINGS[status]} for status in statuses}


# Sampling stays finite: logits / temperature overflow float32 below about 1e-38, and a nucleus under
# float32's smallest number keeps no token. Temperatures in (0, MIN_TEMPERATURE) sample greedily (as 0),
# top_p is at least MIN_TOP_P (which keeps only the most likely token unless the distribution is flat).
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-3


# ------------------------------------------------------------------------------------------ bodies
class _Body(BaseModel):
    # strict: a string is not a number nor a boolean, a boolean not a number; no NaN or infinity (the json
    # module reads them)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _json_integer(value: Any) -> Any:
    """An integer as JSON Schema has it: 2 or 2.0, not "2", true or 2.5 (those are refused by name)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def integer(**bounds: int) -> Any:
    """An integer field type with `bounds` (ge, le, lt), as `_json_integer` reads it (the bounds come first,
    so that the schema carries them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_json_integer)]


Positive = integer(ge=1)
Count = integer(ge=0)
# at most 2^53 - 1: every integer up to it is exact as a JSON number (a double), so a client or a schema
# validator that reads numbers as doubles compares a seed with the bound exactly
Seed = integer(ge=0, le=(1 << 53) - 1)


def _unicode_text(value: str) -> str:
    """Refuse a text that is not valid Unicode (a lone surrogate: JSON "\\ud800", or its UTF-8-like bytes
    ED A0 80), naming where; the text itself is never echoed."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid Unicode text: it holds a lone surrogate (U+{ord(value[e.start]):04X}) at character "
            f"{e.start} (only valid as half of a pair)"
        ) from None
    return value


class ReadBody(_Body):
    text: str = Field(min_length=1, description="text the memory reads (learns); at least one character")

    _check_text = field_validator("text")(_unicode_text)


class GenerateBody(_Body):
    prompt: str = Field(
        min_length=1, description="text read into the memory first, then continued (at least one character)"
    )
    max_new_tokens: Count = Field(64, description="tokens generated at most (the server's limit: maximum)")
    temperature: float = Field(
        SAMPLING.temperature,
        ge=0,
        le=MAX_TEMPERATURE,
        description=f"sampling temperature; 0, or anything below {MIN_TEMPERATURE}, samples greedily",
    )
    top_k: Positive | None = Field(
        SAMPLING.top_k, description="sample from the k most likely tokens (null: all)"
    )
    top_p: float | None = Field(
        None, ge=MIN_TOP_P, le=1, description="nucleus sampling threshold (null: off)"
    )
    greedy: bool = Field(False, description="always take the most likely token")
    seed: Seed | None = Field(None, description="sampling seed (null: random)")
    stop_at_eos: bool = Field(True, description="stop at the tokenizer's end-of-text token")

    _check_prompt = field_validator("prompt")(_unicode_text)


def _generate_body(max_new_tokens: int) -> type[GenerateBody]:
    """GenerateBody with this server's limit on max_new_tokens in its schema (so the schema is the API)."""
    return create_model(
        "GenerateBody",
        __base__=GenerateBody,
        max_new_tokens=(
            integer(ge=0, le=max_new_tokens),
            Field(
                min(64, max_new_tokens),
                description="tokens generated at most (this server's --max-new-tokens is the maximum)",
            ),
        ),
    )


class RollbackBody(_Body):
    snapshot: Positive = Field(description="k from GET .../snapshots (1: the state before the last change)")


class ForkBody(_Body):
    snapshot: Positive | None = Field(
        None, description="fork from snapshot k of GET .../snapshots (null: from the current state)"
    )


# ------------------------------------------------------------------------------------------ answers
class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")  # a newer server may say more


class Status(BaseModel):
    status: Literal["ok"]


class Created(_Answer):
    id: str = Field(description="the session's id (32 hex digits)")
    version: int


class Imported(Created):
    position: int = Field(description="tokens the session's memory has read")
    reads: int


class Forked(Imported):
    parent: str = Field(description="the id of the session it was forked from")


class Deleted(_Answer):
    id: str
    deleted: bool


class Changed(_Answer):
    """What a change answers: the new version and the session's course (read, generate and the rest add
    their own fields; docs/serving.md lists them)."""

    id: str
    version: int


class Snapshots(_Answer):
    id: str
    version: int
    snapshots: list[dict[str, Any]] = Field(description="newest first: k, position, reads, created")


# ------------------------------------------------------------------------------------------ errors
_STOPPING = "the server is shutting down; this request was not started (nothing was changed): retry"
STREAM_CUT = "stopped"  # the event that ends a streamed generation when the server's shutdown time is up
STREAM_CUT_MARGIN_S = 0.25  # how long before that time it is sent
_STREAM_CUT_DETAIL = (
    "the server stopped while this generation ran; it may or may not have been stored: check the session "
    "before sending it again"
)


def _not_found(sid: str) -> ApiError:
    if not _SESSION_ID.match(sid):  # not an id this server gives out: not echoed (it may be any length)
        return ApiError(404, "no session with that id (a session id is 32 hex digits)")
    return ApiError(404, f"no session {sid!r}")


def _damaged_record(sid: str, reason: str) -> ApiError:
    """The 409 of a record with a field that cannot be read (`reason`, logged only)."""
    log.error("stored record of session %s is damaged: %s", sid, reason)
    return ApiError(
        409,
        f"stored record of session {sid} is damaged (a field of it cannot be read); nothing was changed, "
        f"and the store's other sessions are not affected. DELETE /v1/sessions/{sid} removes it",
    )


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413, whether its Content-Length says so up front or
    it is streamed (chunked) past the limit; every body is read as JSON."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        option: str = "--max-body-bytes",
        larger: dict[str, tuple[int, str]] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.option = app, max_bytes, option
        self.larger = larger or {}  # path -> (limit, its option): routes that take whole sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") in self.larger:
            await BodyLimit(self.app, *self.larger[scope["path"]])(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if headers.get(b"content-type", b"").split(b";")[0].strip() != b"application/json":
            # every body of this API is JSON: read it as JSON whatever the client labelled it (curl -d
            # sends form-encoded), so a bad body gets the JSON error that names its problem
            raw = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope = {**scope, "headers": [*raw, (b"content-type", b"application/json")]}
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises an HTTPException met while reading the body
                    raise HTTPException(413, self._detail())
            return message

        await self.app(scope, limited, send)

    def _detail(self) -> str:
        return f"request body over the limit of {self.max_bytes} bytes ({self.option})"

    async def _refuse(self, send: Send) -> None:
        response = JSONResponse({"detail": self._detail()}, status_code=413)
        await response({"type": "http"}, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


class KeyFirst:
    """ASGI middleware: a request to the session routes without a valid key is answered 401 before its
    body is read (a route reads its body whole, up to --max-import-bytes for an import: a client without
    a key could make the server hold that much).

    A body of at most `keep_open_bytes` is then read and dropped by the HTTP server, and the connection
    serves the client's next request. A larger or chunked body, or one the client waits to send
    (`Expect: 100-continue`), is not read: the answer closes the connection. Closing is kept for those
    only, because closing a socket while request bytes are still arriving makes the kernel reset the
    connection, which can cost the client the 401 it was being sent."""

    def __init__(self, app: ASGIApp, owner: Callable[[str | None], str], keep_open_bytes: int) -> None:
        self.app, self.owner, self.keep_open_bytes = app, owner, keep_open_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/sessions"):
            # the first Authorization header, as the route's own check reads it
            header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), None)
            try:
                self.owner(None if header is None else header.decode("latin-1"))
            except ApiError as e:  # the same 401 as the routes' own check, the body left unread
                headers = dict(e.headers or {})
                if not self._body_is_small(scope):
                    headers["Connection"] = "close"
                await _json_error(e.status, e.detail, headers)(scope, _nothing, send)
                return
        await self.app(scope, receive, send)

    def _body_is_small(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        if b"transfer-encoding" in headers or headers.get(b"expect", b"").lower() == b"100-continue":
            return False
        length = headers.get(b"content-length", b"0").strip()
        return length.isdigit() and int(length) <= self.keep_open_bytes


class Utf8Body:
    """ASGI middleware: a JSON body is read as UTF-8 only, although FastAPI's `json.loads` of the bytes
    would read UTF-16 and UTF-32 too. Checked when the body's last chunk is read: its UnicodeDecodeError
    (or JSONDecodeError) goes where FastAPI's own errors of a body it cannot parse go, a 422 naming the
    byte (`_body_problem`). `skip`: the paths whose body is not JSON (import)."""

    def __init__(self, app: ASGIApp, skip: frozenset[str] = frozenset()) -> None:
        self.app, self.skip = app, skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.skip:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []  # at most --max-body-bytes (the body limit is outside)

        async def checked() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    # strict, but for a lone surrogate's bytes (ED A0 80), as json.loads reads them: the
                    # field that holds one is named by its own check
                    text = b"".join(chunks).decode("utf-8", "surrogatepass")
                    chunks.clear()
                    if "\x00" in text[:4]:  # what json.loads takes for UTF-16 or UTF-32 (no BOM)
                        json.loads(text)  # no JSON text holds a NUL: its error says where it fails
            return message

        await self.app(scope, checked, send)


# ------------------------------------------------------------------------------------------ the service
# a worker process's store connections: one for its job, one for the owner check beside it (docs: the
# server holds --store-pool + WORKER_STORE_POOL x --workers at most)
WORKER_STORE_POOL = 2
ROOM_STRIPES = 64  # locks a server's keys share for their quota checks (a key's: by a hash of it)
ROOM_WAIT_S = 60.0  # longer than any store write; past it the request is refused (503, see RoomLocks)
_ROOM_POLL_S = 0.25  # how often a wait for a quota lock looks whether its locks were replaced


class RoomLocks:
    """Serialise a key's quota checks with the writes they allow within a server: a create, fork or
    import (`check_room` on the sessions count, then the new record) or a change's stored bytes (then its
    write) waits for the key's other ones, so that concurrent requests of one key cannot each pass the
    check and together go past the limit. `locks`: threading locks, or multiprocessing ones shared by the
    worker processes (and the server's own, which runs the streamed generations); a key takes
    locks[crc32(key) % n] (the same in every process). Held only around the store's count and write, never
    the model's work.

    A request that cannot take its lock within ROOM_WAIT_S (a store that stalls) is refused with a 503
    and Retry-After, nothing changed: the check never runs unserialised. Worker processes get new locks
    whenever their pool is rebuilt (`SessionService.use_processes`, `renewed`): a worker killed while it
    held one takes it with it, and a wait in this process on such a lock moves to the new ones
    (`replaced_by`). A lock this process holds at that moment is handed on as it is, so the new workers
    wait for it too."""

    def __init__(self, locks: list[Any], *, _held: tuple[threading.Lock, list[int]] | None = None) -> None:
        self.locks = locks
        self.replaced_by: RoomLocks | None = None
        # per stripe, how many of this process's requests hold its lock; shared by the sets that replace
        # this one (with the guard that orders it against `renewed`)
        self._guard, self._held = _held or (threading.Lock(), [0] * len(locks))

    def renewed(self, locks: list[Any]) -> RoomLocks:
        """The set that replaces this one: `locks` (new ones), except that a stripe whose lock a request
        of this process holds now keeps that lock. Waits on this set move there (`replaced_by`)."""
        with self._guard:
            kept = [old if held else new for old, new, held in zip(self.locks, locks, self._held)]
            self.replaced_by = RoomLocks(kept, _held=(self._guard, self._held))
        return self.replaced_by

    @contextmanager
    def hold(self, owner: str) -> Iterator[None]:
        stripe = zlib.crc32(owner.encode()) % len(self.locks)
        lock = self.locks[stripe]
        deadline = time.monotonic() + ROOM_WAIT_S
        while not lock.acquire(timeout=max(0.0, min(_ROOM_POLL_S, deadline - time.monotonic()))):
            if self.replaced_by is not None:  # the pool was rebuilt: its holder may be a dead worker
                with self.replaced_by.hold(owner):
                    yield
                return
            if time.monotonic() >= deadline:
                log.warning("a key's quota lock was not free for %g s: its request refused", ROOM_WAIT_S)
                raise ApiError(
                    503,
                    "the session store is too slow to check this key's limits now; nothing was changed, "
                    "retry later",
                    {"Retry-After": "5"},
                )
        with self._guard:
            current = self.replaced_by is None
            if current:
                self._held[stripe] += 1
        if not current:  # replaced as it was taken: the new workers may not wait for this lock
            lock.release()
            with self.replaced_by.hold(owner):
                yield
            return
        try:
            yield
        finally:
            with self._guard:
                self._held[stripe] -= 1
            lock.release()


class SessionService:
    """The operations behind the routes: load, check ownership and integrity, apply, persist."""

    def __init__(
        self,
        engine: Engine,
        store: SessionStore,
        limits: Limits,
        workers: int,
        quotas: Quotas | None = None,
        room: RoomLocks | None = None,
    ) -> None:
        self.engine, self.store, self.limits = engine, store, limits
        self.quotas = quotas or Quotas()
        self.limiter = anyio.CapacityLimiter(workers)
        self.gate = KeyGate(self.quotas.max_concurrent)
        per_key = self.quotas.workers_per_key or max(1, workers // 2)
        self.fair = FairLimiter(workers, per_key)
        self.sweeper = Sweeper(store, self.quotas.session_ttl_s)
        self.room = room or RoomLocks([threading.Lock() for _ in range(ROOM_STRIPES)])
        self.processes: ProcessPool | None = None  # `use_processes`: the named operations run there
        self.stopping = False  # `stop`: the server is shutting down
        self.streams: set[asyncio.Queue] = set()  # the event queues of the streamed generations being sent
        self._threads_lock = threading.Lock()
        self._in_threads = 0  # `run` calls still running in a worker thread (`calls_in_threads`)

    def stop(self, grace_s: float | None = None) -> None:
        """The server began to stop (in the event loop's thread): the requests still waiting for a worker
        or for their session, and any that come later, are answered 503 with Retry-After at once, nothing
        of them applied; the running ones finish. `grace_s`: the server's graceful-shutdown time, after
        which it cancels what still runs; a streamed generation still being sent just before then ends
        with an `error` event (503) instead of being cut off."""
        self.stopping = True
        self.fair.close()
        if grace_s is not None:

            def cut() -> None:
                for events in list(self.streams):  # one line each, whether or not its client still reads
                    log.warning("a streamed generation was still running when the server stopped: ended 503")
                    events.put_nowait((STREAM_CUT, None))

            asyncio.get_running_loop().call_later(max(0.0, grace_s - STREAM_CUT_MARGIN_S), cut)

    def use_processes(self, n: int, torch_threads: int) -> None:
        """Run the named operations (`call`) in `n` worker processes, each with a copy of the engine and its
        own connections to the store (opened from its URL); streamed generations stay in this process. The
        quota locks are shared by them all (`RoomLocks`)."""
        engine = pickle.dumps(self.engine)

        def payload() -> _ChildSetup:  # for each set of processes: new quota locks (`RoomLocks`)
            locks = [multiprocessing.get_context("spawn").Lock() for _ in range(ROOM_STRIPES)]
            self.room = self.room.renewed(locks)
            setup = (self.store.url, self.limits, self.quotas, torch_threads, log.getEffectiveLevel())
            return _ChildSetup(engine, *setup, locks)

        self.processes = ProcessPool(n, _child_service, None, renew=payload)

    async def run(self, fn: Callable[[], T]) -> T:
        def counted() -> T:  # counted in the thread: a cancelled request's call runs on after it
            with self._threads_lock:
                self._in_threads += 1
            try:
                return fn()
            finally:
                with self._threads_lock:
                    self._in_threads -= 1

        return await anyio.to_thread.run_sync(counted, limiter=self.limiter)

    @property
    def calls_in_threads(self) -> int:
        """Operations still running in this process's worker threads: after the graceful-shutdown time
        they are the calls of requests already answered 503, which a thread cannot be stopped from."""
        with self._threads_lock:
            return self._in_threads

    async def call(self, name: str, *args: Any) -> Any:
        """The operation `name` (a method of this class) with `args`: in a worker process when the service
        has them, else in a worker thread."""
        if self.processes is None:
            return await self.run(functools.partial(getattr(self, name), *args))
        try:
            return await self.processes.call(name, *args)
        except WorkerDied as e:
            log.error("%s", e)
            # it may have died after its write reached the store: a blind retry could apply a read twice
            raise ApiError(
                503,
                "a worker of the server stopped while serving this request; it may or may not have been "
                "applied: check the session (its version in stats) before sending it again",
                {"Retry-After": "1"},
            ) from None

    # -------------------------------------------------------------- loading
    def _record(self, sid: str, owner: str) -> Record:
        if not _SESSION_ID.match(sid):
            raise _not_found(sid)
        record = self._owned_record(sid, owner)
        if self.sweeper.expired(record.updated):  # idle past --session-ttl: gone, even before a sweep
            # deleted by the store's own check of its last change (`Sweeper.expire_one`), not by this
            # copy's: a change written since it was read (a request that loaded the session before it
            # expired) keeps the session, and is what this request then sees
            self.sweeper.expire_one(sid, owner)
            record = self._owned_record(sid, owner)
            if self.sweeper.expired(record.updated):  # the sweep failed (the store is down): still gone
                raise _not_found(sid)
        return record

    def _owned_record(self, sid: str, owner: str) -> Record:
        # the owner first, alone: another key's session is as absent as a missing one, and answered as
        # fast (its state is never read)
        try:
            stored_owner = self.store.owner(sid)
            mine = stored_owner is not None and hmac.compare_digest(stored_owner, owner)
        except (ValueError, TypeError):  # an owner field that is not ASCII text: no key's session
            mine = False
        if not mine:
            raise _not_found(sid)
        try:
            record = self.store.get(sid)
        except (ValueError, TypeError) as e:  # a field of the record is not what it must be
            raise _damaged_record(sid, redact(str(e))) from e
        if record is None or not hmac.compare_digest(record.owner, owner):
            raise _not_found(sid)
        if record.version < 0:  # the stores' mark of a version they could not read (a version "x")
            raise _damaged_record(sid, "its version is not an integer")
        return record

    def _session(self, record: Record) -> MemorySession:
        if not record.intact:
            reason = "its bytes do not match their checksum"
        else:
            try:
                return self.engine.load(record.data, verified=True)  # intact: its sha256 matched
            except OtherWeightsError as e:  # a server with another checkpoint shares the store
                log.error("session %s (version %d): %s", record.id, record.version, e)
                raise ApiError(
                    409,
                    f"session {record.id} was stored by a server with other weights of this configuration "
                    f"(another checkpoint): {e}. Nothing was changed; a server with that checkpoint reads "
                    f"it, and DELETE /v1/sessions/{record.id} removes it",
                ) from None
            except ValueError as e:  # SessionFormatError (damaged bytes), or a state of another model
                reason = str(e)
        log.error(
            "stored state of session %s (version %d) is corrupted: %s", record.id, record.version, reason
        )
        raise ApiError(
            409,
            f"stored state of session {record.id} is corrupted ({reason}); nothing was changed, and the "
            f"store's other sessions are not affected. DELETE /v1/sessions/{record.id} removes it",
        )

    def load(self, sid: str, owner: str) -> tuple[Record, MemorySession]:
        record = self._record(sid, owner)
        return record, self._session(record)

    # -------------------------------------------------------------- operations
    def create(self, owner: str) -> dict[str, Any]:
        return self._insert(owner, self.engine.new_session().to_parts())

    def _insert(self, owner: str, parts: list[bytes | memoryview]) -> dict[str, Any]:
        """A new session of `owner` holding `parts` (`MemorySession.to_parts`) under a fresh id."""
        size = _stored_size(parts)
        with self.room.hold(owner):  # the count checked is the count until the record is in
            check_room(self.quotas, self.store.usage(owner), new_sessions=1, new_bytes=size)
            for _ in range(8):
                sid = uuid.uuid4().hex
                try:
                    record = self.store.create(sid, owner, parts)
                except SessionExists:
                    continue
                log.info("session %s created", sid)
                return {"id": sid, "version": record.version}
        raise ApiError(503, "could not pick a free session id")

    def change(self, sid: str, owner: str, op: Callable[[MemorySession], dict[str, Any]]) -> dict[str, Any]:
        """Apply `op` to the stored session and write it back (compare-and-set), starting again from the
        newer record when another server wrote in between."""
        for attempt in range(self.limits.conflict_retries):
            record, session = self.load(sid, owner)
            result = op(session)
            try:  # in parts, not joined: the unchanged states are views of the record's bytes, not copies
                parts = session.to_parts()
            except ValueError as e:  # a state holding NaN or inf: the model diverged on this input
                raise ApiError(422, f"session {sid} was not changed: {e}") from e
            # the record was checked whole (its sha256): its parts' digests hold; only new parts are hashed
            parts = KnownParts(parts, parts.sha256, known_digests(parts, record.data, record.parts))
            room = self.room.hold(owner) if self.quotas.max_bytes is not None else nullcontext()
            try:
                with room:  # the bytes checked are the bytes until this write is in
                    if self.quotas.max_bytes is not None:
                        grown = _stored_size(parts) - record.size
                        check_room(self.quotas, self.store.usage(owner), new_bytes=grown)
                    version = self.store.put(sid, parts, expected_version=record.version)
            except VersionConflict:
                time.sleep(random.uniform(0, 0.002 * (attempt + 1)))  # let the other writer finish
                continue
            return {"id": sid, "version": version, **result}
        raise ApiError(
            409,
            f"session {sid} was changed by another server {self.limits.conflict_retries} times while this "
            "request was applied; nothing was changed, send it again",
        )

    def fork(self, sid: str, owner: str, snapshot: int | None) -> dict[str, Any]:
        """A new session of `owner` from session `sid`'s current state or its snapshot k (with the
        snapshots older than it); `sid` is not changed."""
        _, session = self.load(sid, owner)
        if snapshot is not None:
            kept = len(session.snapshots)
            if snapshot > kept:  # a valid request the session's state cannot serve, as for rollback
                raise ApiError(
                    409,
                    f"no snapshot {snapshot}: session {sid} keeps {kept} snapshots (k counts back from 1, "
                    "the state before the last change)",
                )
            try:
                session.rollback(snapshot)  # on this copy only: nothing of `sid` is written
            except ValueError as e:
                raise ApiError(422, str(e)) from e
        try:
            parts = session.to_parts()
        except ValueError as e:
            raise ApiError(422, f"session {sid} cannot be forked: {e}") from e
        result = self._insert(owner, parts)
        log.info("session %s forked from %s", result["id"], sid)
        return {**result, "parent": sid, "position": session.position, "reads": session.reads}

    def export(self, sid: str, owner: str) -> bytes:
        """The session's bytes (`MemorySession.to_bytes`), checked to load first."""
        record, _ = self.load(sid, owner)
        return record.data

    def import_(self, owner: str, data: bytes) -> dict[str, Any]:
        """A new session of `owner` from bytes `MemorySession.to_bytes` wrote (for this model)."""
        try:  # every state decoded and checked: a snapshot is otherwise first read when rolled back to
            session = self.engine.load(data, check_snapshots=True)
        except (SessionFormatError, OtherWeightsError) as e:  # the session's own checks: fixed sentences
            raise ApiError(422, f"the body is not a session this server can load: {e}") from None
        except StateFileError as e:  # a state's bytes (its error may quote a library's own text)
            log.info("an imported state does not decode: %s", redact(str(e)))
            raise ApiError(
                422, "the body is not a session this server can load: one of its states is damaged"
            ) from None
        except (ValueError, TypeError) as e:  # a state that decodes, of a model with another config
            log.info("an imported session does not fit the model: %s", redact(str(e)))
            raise ApiError(
                422,
                "the body is not a session this server can load: its states are of another model (another "
                "configuration than this server's)",
            ) from None
        problem = self.engine.import_problem(session)
        if problem is not None:
            raise ApiError(422, f"the body is not a session this server can take: {problem}")
        # stored as the session writes itself, not as uploaded: the header's counters are then those of
        # the decoded states (the states' bytes are the upload's, not copied)
        result = self._insert(owner, session.to_parts())
        log.info("session %s imported", result["id"])
        return {**result, "position": session.position, "reads": session.reads}

    def delete(self, sid: str, owner: str) -> dict[str, Any]:
        if not _SESSION_ID.match(sid) or not self.store.delete(sid, owner):
            raise _not_found(sid)
        log.info("session %s deleted", sid)
        return {"id": sid, "deleted": True}

    # -------------------------------------------------------------- the routes' operations, by name
    def read(self, sid: str, owner: str, text: str) -> dict[str, Any]:
        ids = self.tokens(text, "text")
        return self.change(sid, owner, _guarded(functools.partial(read_json, ids=ids, once=True)))

    def generate(
        self, sid: str, owner: str, prompt: str, max_new_tokens: int, sampling: dict
    ) -> dict[str, Any]:
        ids = self.tokens(prompt, "prompt")

        def op(session: MemorySession) -> dict[str, Any]:
            return generate_json(self.engine, session, ids, max_new_tokens, **sampling)

        return self.change(sid, owner, _guarded(op))

    def stats(self, sid: str, owner: str) -> dict[str, Any]:
        record, session = self.load(sid, owner)
        return {"id": sid, "version": record.version, **stats_json(session)}

    def snapshots(self, sid: str, owner: str) -> dict[str, Any]:
        record, session = self.load(sid, owner)
        return {"id": sid, "version": record.version, "snapshots": snapshots_json(session)}

    def freeze(self, sid: str, owner: str, frozen: bool) -> dict[str, Any]:
        def op(session: MemorySession) -> dict[str, Any]:
            if frozen:
                session.freeze()
            else:
                session.unfreeze()
            return {"frozen": frozen}

        return self.change(sid, owner, op)

    def rollback(self, sid: str, owner: str, k: int) -> dict[str, Any]:
        def op(session: MemorySession) -> dict[str, Any]:
            kept = len(session.snapshots)
            if k > kept:  # a valid request the session's state cannot serve
                raise ApiError(
                    409,
                    f"no snapshot {k}: session {sid} keeps {kept} snapshots (k counts back from 1, the "
                    "state before the last change)",
                )
            session.rollback(k)
            return {"position": session.position, "reads": session.reads, "snapshots": len(session.snapshots)}

        return self.change(sid, owner, _guarded(op))

    def tokens(self, text: str, what: str) -> list[int]:
        ids = self.engine.encode(text)
        if len(ids) > self.limits.max_tokens:
            raise ApiError(
                422,
                f"the {what} holds {len(ids)} tokens; this server takes at most {self.limits.max_tokens} "
                "tokens per request (--max-tokens): send it in several requests",
            )
        if not ids:
            raise ApiError(422, f"the {what} holds no tokens")
        try:
            self.engine.check_tokens(ids)
        except ValueError as e:
            raise ApiError(422, str(e)) from e
        return ids


def _guarded(fn: Callable[[MemorySession], dict[str, Any]]) -> Callable[[MemorySession], dict[str, Any]]:
    """Session errors that are the request's fault as 422."""

    def op(session: MemorySession) -> dict[str, Any]:
        try:
            return fn(session)
        except (ValueError, FloatingPointError) as e:  # FloatingPointError: a write the guard undid
            raise ApiError(422, str(e)) from e

    return op


@dataclass(frozen=True)
class _ChildSetup:
    """What a worker process builds its `SessionService` from (pickled)."""

    engine: bytes  # the pickled Engine
    store_url: str
    limits: Limits
    quotas: Quotas
    torch_threads: int
    log_level: int  # the server's: its worker logs what it would
    room_locks: list[Any]  # `RoomLocks`: shared with the server (they cross at the process's spawn only)


def _child_service(setup: _ChildSetup) -> SessionService:
    """A worker process's service: the engine, warmed up; its own store connections (two: one job at a
    time, and the owner check beside it)."""
    import torch  # the worker's own torch settings (the app itself never calls torch)

    logging.basicConfig(level=setup.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(setup.torch_threads)
    reuse_freed_memory()
    engine: Engine = pickle.loads(setup.engine)
    warm_up(engine)
    store = open_store(setup.store_url, pool_size=WORKER_STORE_POOL)
    return SessionService(engine, store, setup.limits, 1, setup.quotas, RoomLocks(setup.room_locks))


def _stored_size(parts: list[bytes]) -> int:
    """Bytes `parts` take in a store that keeps each distinct part once. Equal parts are found by comparing
    bytes of equal length (distinct states differ within their first bytes), not by hashing every byte."""
    distinct: list[bytes] = []
    for part in parts:
        if not any(len(seen) == len(part) and seen == part for seen in distinct):
            distinct.append(part)
    return sum(len(part) for part in distinct)


def _owner_from(key_hashes: frozenset[str] | None) -> Callable[..., str]:
    def owner(authorization: str | None = Header(None, description="Bearer KEY")) -> str:
        if key_hashes is None:
            return ANONYMOUS
        key = bearer_key(authorization)
        if key is None:
            raise ApiError(
                401, "missing API key: send 'Authorization: Bearer KEY'", {"WWW-Authenticate": "Bearer"}
            )
        problem = key_problem(key)
        if problem is not None:
            raise ApiError(401, f"the API key {problem}", {"WWW-Authenticate": "Bearer"})
        digest = hash_key(key)
        if digest not in key_hashes:
            raise ApiError(401, "unknown API key", {"WWW-Authenticate": "Bearer"})
        return digest

    return owner


def warm_up(engine: Engine) -> None:
    """A read and a one-token generation on a throwaway session: the model's kernels are built or loaded,
    and its code paths run once, before the server says it is ready. With `engine.decode_graph`, a whole
    cycle of the chunk/segment phases is generated, writing and frozen: every step a request can run is
    compiled (or captured) now."""
    ids = list(range(min(engine.vocab_size, 16)))
    session = engine.new_session()
    session.read(ids)
    if not engine.decode_graph:
        session.generate(ids[:1], 1, greedy=True)
        return
    n = decode_cycle(engine.model) + 1
    for _ in range(2):  # the memory written, then read-only (a frozen session's model)
        session.generate(ids[:1], n, greedy=True, compiled=engine.decode_graph)
        session.freeze()


class Readiness:
    """Whether the model has passed its warm-up ("warming", "ready" or "failed")."""

    def __init__(self) -> None:
        self.state = "warming"

    def check(self) -> None:
        """Raise the 503 that the session routes answer before the warm-up has passed."""
        if self.state == "warming":
            raise ApiError(503, "the model is warming up: retry once /v1/ready says ok", {"Retry-After": "1"})
        if self.state == "failed":
            raise ApiError(503, "the model failed its warm-up: this server cannot serve (see its log)")


def _json_error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorBody(detail=detail).model_dump(), status_code=status, headers=headers)


def _validation_detail(exc: RequestValidationError, max_new_tokens: int) -> str:
    problems = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "")
            at = err.get("loc", ("", "?"))[-1]
            problems.append(f"the body is not valid JSON ({reason} at character {at})")
            continue
        # the message names the field and the rule, never the input (it may not even encode)
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        msg = err.get("msg", "invalid")
        if err.get("type") == "string_unicode":  # pydantic's words for a lone surrogate
            msg = "not valid Unicode text: it holds a lone surrogate (only valid as half of a pair)"
        if loc == ["max_new_tokens"] and err.get("type") == "less_than_equal":
            msg += f" (this server's limit, --max-new-tokens {max_new_tokens})"
        problems.append(f"{where}: {msg}")
    return "malformed request: " + "; ".join(problems)


def _body_problem(cause: BaseException | None) -> str:
    """Why FastAPI could not parse a body (it answers those with a bare 400)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 JSON (byte 0x{cause.object[cause.start]:02x} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON (nested too deeply)"
    return "the body could not be read as JSON"


def sampling(body: GenerateBody) -> dict[str, Any]:
    """The sampling arguments of `generate_json` for `body` (the same for a plain and a streamed
    generation): a temperature below MIN_TEMPERATURE samples greedily, as 0 does."""
    temperature = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
    return {
        "temperature": temperature,
        "top_k": body.top_k,
        "top_p": body.top_p,
        "greedy": body.greedy,
        "seed": body.seed,
        "stop_at_eos": body.stop_at_eos,
    }


def create_app(
    engine: Engine,
    store: SessionStore,
    *,
    key_hashes: frozenset[str] | None,
    limits: Limits | None = None,
    workers: int = 4,
    model_name: str = "",
    quotas: Quotas | None = None,
    warm: bool = True,
    worker_processes: bool = False,
    torch_threads: int = 1,
) -> FastAPI:
    """The API over `engine` and `store`. key_hashes: sha256 hashes of the accepted keys (`load_api_keys`);
    None: no keys, every request is one anonymous owner. quotas: per-key limits, idle sessions' lifetime
    and the slow-client timeout (`titans.serving.limits.Quotas`; default its defaults). warm: run
    `warm_up` when the app starts (its lifespan) before /v1/ready says ok; False: ready at once.
    worker_processes: the model work runs in `workers` processes (`SessionService.use_processes`, each
    with `torch_threads` torch threads; the store must open from its URL), else in `workers` threads of
    this one. model_name is logged, never answered."""
    limits = limits or Limits()
    service = SessionService(engine, store, limits, workers, quotas)
    if worker_processes:
        service.use_processes(workers, torch_threads)
    readiness = Readiness()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_warm())
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
            if service.processes is not None:
                service.processes.close()

    async def _warm() -> None:
        if not warm:
            readiness.state = "ready"
            return
        start = time.perf_counter()
        try:
            await service.run(lambda: warm_up(engine))
            if service.processes is not None:  # each warms up as it starts
                await service.processes.start()
        except Exception as e:  # any failure: the server stays alive (health) but never ready
            readiness.state = "failed"
            log.error("model %s failed its warm-up: %s", model_name, redact(repr(e)))
            return
        readiness.state = "ready"
        log.info("model %s warmed up in %.1f s: ready", model_name, time.perf_counter() - start)

    app = FastAPI(
        title="titans memory server",
        version="1",
        description=(
            "Per-session Titans memories: each session is a model state that learns the text it reads. "
            "Every route but /v1/health and /v1/ready needs `Authorization: Bearer KEY` (when the server "
            'has keys); a session belongs to the key that created it. Every error answers `{"detail": '
            '"..."}`, a sentence naming the problem.'
        ),
        lifespan=lifespan,
        # every route: the body limit and the body timeout read a body whatever the route (a GET too)
        responses=error_responses(408, 413),
    )
    app.state.service = service
    app.state.readiness = readiness
    app.state.stop = service.stop  # stop(grace_s): the server begins its shutdown (`titans serve` calls it)
    app.add_middleware(Utf8Body, skip=frozenset({"/v1/sessions/import"}))  # the body as the app reads it
    app.add_middleware(BodyTimeout, timeout_s=service.quotas.body_timeout_s)  # inside the body limit
    app.add_middleware(
        BodyLimit,
        max_bytes=limits.max_body_bytes,
        larger={"/v1/sessions/import": (limits.max_import_bytes, "--max-import-bytes")},
    )
    if key_hashes is not None:
        app.add_middleware(  # outside them all
            KeyFirst, owner=_owner_from(key_hashes), keep_open_bytes=limits.max_body_bytes
        )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _json_error(exc.status, exc.detail, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI's "There was an error parsing the body"
            return _json_error(422, "malformed request: " + _body_problem(exc.__cause__))
        return _json_error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(StoreError)
    async def _store_error(request: Request, exc: StoreError) -> JSONResponse:
        # the store's URL, password, file path and error text go to the log only
        log.error("store error: %s", redact(str(exc)))
        return _json_error(
            503, "the session store is unavailable; nothing was changed, retry later", {"Retry-After": "1"}
        )

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _json_error(422, _validation_detail(exc, limits.max_new_tokens))

    @app.exception_handler(TooBusy)
    async def _too_busy(request: Request, exc: TooBusy) -> JSONResponse:
        return _json_error(429, exc.detail, {"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s %s: %s", request.method, request.url.path, redact(repr(exc)))
        return _json_error(500, "internal error: the server's log has the details")

    # ---- per-key limits (titans.serving.limits): every route's work runs through `gated`
    async def gated(
        owner: str,
        job: Callable[[], T] | tuple,
        sid: str | None = None,
        counted: bool = False,
        streamed: bool = False,
    ) -> T:
        """`job` counted against the key's concurrent requests (`counted`: the caller holds its place
        already), serialised with the other requests of this key to session `sid` when given: a function
        run in a worker thread, or (name, *args), the service's operation `name` (`SessionService.call`: in
        a worker process when it has them). The line of a session is the key's own: another key's request
        naming the session never waits for it (nor delays it), and learns nothing of it but its 404.
        `streamed`: a streamed generation's job, whose cut at shutdown `SessionService.stop` logs."""
        service.sweeper.maybe_sweep()
        async with nullcontext() if counted else service.gate.hold(owner):
            try:
                async with service.fair.slot(owner, sid=None if sid is None else (owner, sid)):
                    if isinstance(job, tuple):
                        return await service.call(*job)
                    return await service.run(job)
            except ShuttingDown:
                raise ApiError(503, _STOPPING, {"Retry-After": "1"}) from None
            except asyncio.CancelledError:
                if not service.stopping:
                    raise
                # the server's graceful-shutdown time ran out while this request ran: it may or may not
                # have been applied (a job that started runs to its end)
                if not streamed:
                    log.warning("a request was still running when the server stopped: answered 503")
                raise ApiError(
                    503,
                    "the server stopped while this request ran; it may or may not have been applied: check "
                    "the session before sending it again",
                    {"Retry-After": "1"},
                ) from None

    async def locked(sid: str, owner: str, job: Callable[[], T] | tuple) -> T:
        return await gated(owner, job, sid)

    guarded = _guarded

    @app.get(
        "/v1/health", summary="liveness: ok while the server answers (no key needed)", operation_id="health"
    )
    async def health() -> Status:
        return Status(status="ok")

    @app.get(
        "/v1/ready",
        summary="readiness: ok once the model is loaded and warmed up, 503 before (no key needed)",
        operation_id="ready",
        responses=error_responses(503),
    )
    async def ready() -> Status:
        readiness.check()
        return Status(status="ok")

    # ---------------------------------------------------------------------- sessions
    def session_link(operation_id: str, description: str) -> dict[str, Any]:
        return {
            "operationId": operation_id,
            "parameters": {"sid": "$response.body#/id"},
            "description": description,
        }

    sessions = APIRouter(
        prefix="/v1/sessions",
        dependencies=[Depends(lambda: readiness.check())],
        responses=error_responses(401, 429, 503),  # 429: every route counts against the key's limits
    )
    owner_dep = Depends(_owner_from(key_hashes))
    generate_body = _generate_body(limits.max_new_tokens)
    on_session = error_responses(404, 409, 422)  # 422: a path id that is not a session id is a 404 instead

    @sessions.post(
        "",
        status_code=201,
        summary="create a session -> {id}",
        operation_id="create_session",
        responses={
            201: {
                "description": "the new session",
                "links": {
                    "ReadSession": session_link("read_session", "the new session reads a text"),
                    "GenerateInSession": session_link("generate_in_session", "the new session generates"),
                    "SessionStats": session_link("session_stats", "the new session's counters"),
                    "SessionSnapshots": session_link("session_snapshots", "the new session's snapshots"),
                    "FreezeSession": session_link("freeze_session", "freeze the new session"),
                    "UnfreezeSession": session_link("unfreeze_session", "unfreeze the new session"),
                    "RollbackSession": session_link("rollback_session", "roll the new session back"),
                    "DeleteSession": session_link("delete_session", "delete the new session"),
                    "ForkSession": session_link("fork_session", "a new session from the new session"),
                    "ExportSession": session_link("export_session", "the new session's bytes"),
                    "StreamInSession": session_link(
                        "stream_in_session", "the new session generates, streamed"
                    ),
                },
            },
            **error_responses(422),
        },
    )
    async def create(owner: str = owner_dep) -> Created:
        return Created(**await gated(owner, ("create", owner)))

    # before DELETE /{sid}: the path /v1/sessions/import is the import route's (an OPTIONS or a wrong method
    # there answers 405 with Allow: POST)
    add_session_routes(sessions, service, owner_dep, gated, locked, guarded, generate_body)

    @sessions.delete(
        "/{sid}",
        summary="delete a session and its snapshots",
        operation_id="delete_session",
        responses=error_responses(404, 422),
    )
    async def delete(sid: str, owner: str = owner_dep) -> Deleted:
        return Deleted(**await locked(sid, owner, ("delete", sid, owner)))

    @sessions.post(
        "/{sid}/read",
        summary="the memory reads (learns) a text",
        operation_id="read_session",
        responses=on_session,
    )
    async def read(sid: str, body: ReadBody, owner: str = owner_dep) -> Changed:
        return Changed(**await locked(sid, owner, ("read", sid, owner, body.text)))

    async def generate(sid: str, body: GenerateBody, owner: str = owner_dep) -> Changed:
        job = ("generate", sid, owner, body.prompt, body.max_new_tokens, sampling(body))
        return Changed(**await locked(sid, owner, job))

    # the body's class carries this server's max_new_tokens limit (in its schema too): annotated here, as
    # the module's postponed annotations would name a local FastAPI cannot resolve
    generate.__annotations__["body"] = generate_body
    sessions.post(
        "/{sid}/generate",
        summary="read a prompt into the memory, then continue it",
        operation_id="generate_in_session",
        responses=on_session,
    )(generate)

    @sessions.get(
        "/{sid}/stats",
        summary="counters, the guard's events, memory norms, a digest",
        operation_id="session_stats",
        responses=on_session,
    )
    async def stats(sid: str, owner: str = owner_dep) -> Changed:
        return Changed(**await gated(owner, ("stats", sid, owner)))

    @sessions.post(
        "/{sid}/freeze",
        summary="stop writing the memory (reads still work)",
        operation_id="freeze_session",
        responses=on_session,
    )
    async def freeze(sid: str, owner: str = owner_dep) -> Changed:
        return Changed(**await locked(sid, owner, ("freeze", sid, owner, True)))

    @sessions.post(
        "/{sid}/unfreeze",
        summary="write the memory again",
        operation_id="unfreeze_session",
        responses=on_session,
    )
    async def unfreeze(sid: str, owner: str = owner_dep) -> Changed:
        return Changed(**await locked(sid, owner, ("freeze", sid, owner, False)))

    @sessions.get(
        "/{sid}/snapshots",
        summary="the kept snapshots, newest first (k from 1)",
        operation_id="session_snapshots",
        responses=on_session,
    )
    async def snapshots(sid: str, owner: str = owner_dep) -> Snapshots:
        return Snapshots(**await gated(owner, ("snapshots", sid, owner)))

    @sessions.post(
        "/{sid}/rollback",
        summary="restore a snapshot, bit for bit",
        operation_id="rollback_session",
        responses=on_session,
    )
    async def rollback(sid: str, body: RollbackBody, owner: str = owner_dep) -> Changed:
        return Changed(**await locked(sid, owner, ("rollback", sid, owner, body.snapshot)))

    app.include_router(sessions)
    return app


# ------------------------------------------------------------------------------ fork, export, stream
def _event_schema(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    return {"properties": {"event": {"const": kind}, "data": json_data}}


# One server-sent event of POST .../generate/stream (OpenAPI 3.1: the schema of a text/event-stream
# describes each event, its `data` a JSON document of its own)
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "oneOf": [
        _event_schema(
            "token",
            {
                "type": "object",
                "required": ["id", "text"],
                "properties": {
                    "id": {"type": "integer", "description": "the token"},
                    "text": {"type": "string", "description": "the text it adds (empty while incomplete)"},
                },
            },
        ),
        _event_schema("done", {"$ref": "#/components/schemas/Changed"}),
        _event_schema(
            "error",
            {
                "type": "object",
                "required": ["status", "detail"],
                "properties": {"status": {"type": "integer"}, "detail": {"type": "string"}},
            },
        ),
    ],
}


def add_session_routes(
    sessions: APIRouter,
    service: SessionService,
    owner_dep: Any,
    gated: Callable[..., Any],
    locked: Callable[..., Any],
    guarded: Callable[..., Any],
    generate_body: type[GenerateBody],
) -> None:
    """Fork a session, export and import its bytes, and generate with the answer streamed (server-sent
    events), on the `sessions` router (its prefix /v1/sessions, its readiness check and its errors)."""
    engine = service.engine
    on_session = error_responses(404, 409, 422)
    streams: set[asyncio.Future] = set()  # streamed generations still running (held against collection)

    @sessions.post(
        "/{sid}/fork",
        status_code=201,
        summary="a new session from this one's memory (its current state or a snapshot)",
        operation_id="fork_session",
        responses={
            201: {"model": Forked, "description": "the new session"},
            **on_session,
        },
    )
    async def fork(sid: str, body: ForkBody | None = None, owner: str = owner_dep) -> Forked:
        snapshot = body.snapshot if body is not None else None
        return Forked(**await locked(sid, owner, ("fork", sid, owner, snapshot)))

    @sessions.get(
        "/{sid}/export",
        summary="the session's bytes (MemorySession.to_bytes)",
        operation_id="export_session",
        response_class=Response,
        responses={
            200: {
                "description": "the session's bytes, for POST /v1/sessions/import",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            },
            **on_session,
        },
    )
    async def export(sid: str, owner: str = owner_dep) -> Response:
        data = await locked(sid, owner, ("export", sid, owner))
        return Response(
            data,
            media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{sid}.session"'},
        )

    @sessions.post(
        "/import",
        status_code=201,
        summary="a new session from exported bytes (the body, application/octet-stream)",
        operation_id="import_session",
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "bytes of GET /v1/sessions/{sid}/export (MemorySession.to_bytes) of a session "
                "of this server's model; other bytes are a 422",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        responses={
            201: {"model": Imported, "description": "the new session"},
            **error_responses(422),
        },
    )
    async def import_session(request: Request, owner: str = owner_dep) -> Imported:
        # the key's place taken before the body is read: a key at --max-concurrent-per-key gets its 429
        # with its body unread (it would hold up to --max-import-bytes of memory per request otherwise)
        async with service.gate.hold(owner):
            try:
                data = await request.body()
            except ClientDisconnect:  # the client went away mid-body: nobody to answer, nothing to log
                log.debug("an import's client closed its connection before the body ended")
                raise ApiError(400, "the connection closed before the body ended") from None
            return Imported(**await gated(owner, ("import_", owner, data), counted=True))

    async def generate_stream(sid: str, body: GenerateBody, owner: str = owner_dep) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sent = False  # a token has gone to the client

        def on_token(token: int) -> None:
            nonlocal sent
            sent = True
            loop.call_soon_threadsafe(events.put_nowait, ("token", token))

        prompt: list[int] = []  # its ids, once read (before the first token): the text continues them

        def work() -> dict[str, Any]:
            ids = service.tokens(body.prompt, "prompt")
            prompt[:] = ids

            def op(session: MemorySession) -> dict[str, Any]:
                if sent:
                    # `change` runs op again from the newer record when another server wrote the session
                    # in between: a second generation would stream its tokens after the first one's, so
                    # that the client's text would not be the one stored
                    raise ApiError(
                        409,
                        f"session {sid} was changed on another server while this generation was streamed; "
                        "nothing was stored: send it again",
                    )
                return generate_json(
                    engine, session, ids, body.max_new_tokens, **sampling(body), on_token=on_token
                )

            return service.change(sid, owner, guarded(op))

        async def run() -> None:
            try:
                done = await gated(owner, work, sid, streamed=True)
                events.put_nowait(("done", Changed(**done).model_dump()))
            except Exception as e:  # noqa: BLE001 - handed to the response: an error status or event
                events.put_nowait(("error", e))
            finally:  # its last event is queued: nothing left to cut at shutdown (also if no one reads it)
                service.streams.discard(events)

        # the whole generation and its write run on whether or not the client stays to the end
        task = asyncio.ensure_future(run())
        streams.add(task)
        task.add_done_callback(streams.discard)
        service.streams.add(events)  # until its generation ends (`run`) or its last event is sent (`_sse`)
        kind, first = await events.get()
        if kind != "token":
            service.streams.discard(events)
        if kind == "error":
            raise first  # before any token: the answer is the error's own status
        if kind == STREAM_CUT:
            raise ApiError(503, _STREAM_CUT_DETAIL, {"Retry-After": "1"})
        return StreamingResponse(
            _sse(engine, body.stop_at_eos, (kind, first), events, service.streams, context=prompt),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    # the body's class carries this server's max_new_tokens limit, as the plain generate's does
    generate_stream.__annotations__["body"] = generate_body
    sessions.post(
        "/{sid}/generate/stream",
        summary="generate, the tokens sent as server-sent events as they come; the memory written at the end",
        operation_id="stream_in_session",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "events: token ({id, text}) as each comes, then done (the answer of "
                "/generate, once the session is stored) or error ({status, detail})",
                "content": {"text/event-stream": {"schema": _SSE_EVENT}},
            },
            **on_session,
        },
    )(generate_stream)


async def _sse(
    engine: Engine,
    stop_at_eos: bool,
    first: tuple[str, Any],
    events: asyncio.Queue,
    streams: set[asyncio.Queue] | None = None,
    context: Sequence[int] = (),
):
    """Server-sent events: ``token`` ({"id", "text"}: the text it adds), then ``done`` (the generate
    route's answer, once the session is stored) or ``error`` ({"status", "detail"}). The token texts add
    up to done's text: a token that adds no text yet (a character still incomplete, or the end-of-text
    token) is sent when the next one comes, and the last such one carries the rest of the answer (the
    text ended mid-character). `events` is taken out of `streams` once the last event is sent. `context`:
    the prompt's ids, which the text continues (`continuation_text`)."""
    ids: list[int] = []
    text = ""
    held: int | None = None  # the last token, sent with "" or with the answer's rest
    eos = engine.tokenizer.eos_id if stop_at_eos else None
    item = first
    try:
        while True:
            kind, value = item
            if kind == "token":
                ids.append(value)
                piece = ""
                if value != eos:
                    decoded = continuation_text(engine.tokenizer, context, [t for t in ids if t != eos])
                    if not decoded.endswith("\ufffd"):  # a character still incomplete waits for its bytes
                        piece, text = decoded[len(text) :], decoded
                if held is not None:
                    yield _event("token", {"id": held, "text": ""})
                    held = None
                if piece:
                    yield _event("token", {"id": value, "text": piece})
                else:
                    held = value
            elif kind == "done":
                if held is not None:  # the answer's text past the last whole character (U+FFFD where cut)
                    rest = value["text"][len(text) :] if value["text"].startswith(text) else ""
                    yield _event("token", {"id": held, "text": rest})
                yield _event("done", value)
                return
            else:
                if held is not None:
                    yield _event("token", {"id": held, "text": ""})
                if kind == STREAM_CUT:  # the server's shutdown time is up (logged by `SessionService.stop`)
                    status, detail = 503, _STREAM_CUT_DETAIL
                elif isinstance(value, ApiError):
                    status, detail = value.status, value.detail
                elif isinstance(value, TooBusy):  # the key's stored bytes: the memory was not written
                    status, detail = 429, value.detail
                elif isinstance(value, StoreError):
                    status, detail = 503, "the session store is unavailable; nothing was changed, retry later"
                    log.error("store error: %s", redact(str(value)))
                else:
                    status, detail = 500, "internal error: the server's log has the details"
                    log.error("streamed generation failed: %s", redact(repr(value)))
                yield _event("error", {"status": status, "detail": detail})
                return
            item = await events.get()
    finally:  # sent whole, or the client gone
        if streams is not None:
            streams.discard(events)


def _event(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


__all__ = [
    "ApiError",
    "BodyLimit",
    "ForkBody",
    "Forked",
    "GenerateBody",
    "Imported",
    "KeyFirst",
    "Limits",
    "MIN_TEMPERATURE",
    "MIN_TOP_P",
    "ReadBody",
    "RollbackBody",
    "Utf8Body",
    "add_session_routes",
    "create_app",
    "sampling",
    "warm_up",
]
