"""The HTTP API (FastAPI): sessions created, fed, queried, frozen and rolled back, each persisted in the
store before its request returns.

    app = create_app(engine, store, key_hashes=load_api_keys("keys.txt"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Consistency: requests to one session are serialised in this process (an asyncio lock per session id),
different sessions run in parallel (the model work runs in a pool of `workers` threads). Each change
reads the record, applies the operation and writes it back with compare-and-set on the record's
version; if another server sharing the store wrote in between, the change starts again from the newer
record (up to `conflict_retries` times, then 409). So an acknowledged change is applied exactly once
and is in the store.

Errors: every refused request gets a 4xx (or 503 when the store is unreachable) with ``{"detail": ...}``
naming the problem: 401 no or unknown key, 404 unknown session or one of another key, 409 a stored state
that cannot be read (damaged bytes, or a state of another model), 413 a body over the limit, 422 a
malformed body, a text over the token limit, symbols the model cannot read, no such snapshot; 408 a body
that did not arrive in time, 429 a per-key limit (`titans.serving.limits`, with Retry-After).

The sessions are `titans.inference.session.MemorySession`s, stored as their `to_bytes`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from titans.inference.session import MemorySession
from titans.runtime.sampling import SAMPLING
from titans.serving.auth import ANONYMOUS, bearer_key, hash_key
from titans.serving.limits import BodyTimeout, FairLimiter, KeyGate, Quotas, Sweeper, TooBusy, check_room
from titans.serving.session import (
    Engine,
    generate_json,
    read_json,
    session_parts,
    snapshots_json,
    stats_json,
)
from titans.serving.stores import Record, SessionExists, SessionStore, StoreError, VersionConflict

log = logging.getLogger("titans.serving")
T = TypeVar("T")
_SESSION_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_body_bytes: int = 1 << 20
    max_tokens: int = 16384  # tokens of text (read) or prompt (generate) per request
    max_new_tokens: int = 1024
    conflict_retries: int = 20
    max_import_bytes: int = 256 << 20  # a whole session's bytes (POST /v1/sessions/import)


# ------------------------------------------------------------------------------------------ bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReadBody(_Body):
    text: str = Field(description="text the memory reads (learns)")


class GenerateBody(_Body):
    prompt: str = Field(description="text read into the memory first, then continued (at least one token)")
    max_new_tokens: int = Field(64, ge=0, description="tokens generated at most")
    temperature: float = Field(SAMPLING.temperature, ge=0, description="sampling temperature (0: greedy)")
    top_k: int | None = Field(
        SAMPLING.top_k, ge=1, description="sample from the k most likely tokens (null: all)"
    )
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling threshold (null: off)")
    greedy: bool = Field(False, description="always take the most likely token")
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="sampling seed (null: random)")
    stop_at_eos: bool = Field(True, description="stop at the tokenizer's end-of-text token")


class RollbackBody(_Body):
    snapshot: int = Field(ge=1, description="k from GET .../snapshots (1: the state before the last change)")


class ForkBody(_Body):
    snapshot: int | None = Field(
        None, ge=1, description="fork from snapshot k of GET .../snapshots (null: from the current state)"
    )


# ------------------------------------------------------------------------------------------ errors
class ApiError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def _not_found(sid: str) -> ApiError:
    return ApiError(404, f"no session {sid!r}")


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


# ------------------------------------------------------------------------------------------ locks
class SessionLocks:
    """One asyncio lock per session id while anyone holds or waits for it (then it is dropped)."""

    def __init__(self) -> None:
        self._locks: dict[str, list] = {}

    @asynccontextmanager
    async def hold(self, sid: str):
        entry = self._locks.setdefault(sid, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[sid]


# ------------------------------------------------------------------------------------------ the service
class SessionService:
    """The operations behind the routes: load, check ownership and integrity, apply, persist."""

    def __init__(
        self, engine: Engine, store: SessionStore, limits: Limits, workers: int, quotas: Quotas | None = None
    ) -> None:
        self.engine, self.store, self.limits = engine, store, limits
        self.quotas = quotas or Quotas()
        self.locks = SessionLocks()
        self.limiter = anyio.CapacityLimiter(workers)
        self.gate = KeyGate(self.quotas.max_concurrent)
        per_key = self.quotas.workers_per_key or max(1, workers // 2)
        self.fair = FairLimiter(workers, per_key)
        self.sweeper = Sweeper(store, self.quotas.session_ttl_s)

    async def run(self, fn: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(fn, limiter=self.limiter)

    # -------------------------------------------------------------- loading
    def _record(self, sid: str, owner: str) -> Record:
        if not _SESSION_ID.match(sid):
            raise _not_found(sid)
        # the owner first, alone: another key's session is as absent as a missing one, and answered as
        # fast (its state is never read)
        stored_owner = self.store.owner(sid)
        if stored_owner is None or not hmac.compare_digest(stored_owner, owner):
            raise _not_found(sid)
        record = self.store.get(sid)
        if record is None or not hmac.compare_digest(record.owner, owner):
            raise _not_found(sid)
        if self.sweeper.expired(record.updated):  # idle past --session-ttl: gone, even before a sweep
            self.store.delete(sid, owner)
            raise _not_found(sid)
        return record

    def _session(self, record: Record) -> MemorySession:
        if not record.intact:
            reason = "its bytes do not match their checksum"
        else:
            try:
                return self.engine.load(record.data)
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
        return self._insert(owner, self.engine.new_session().to_bytes())

    def _insert(self, owner: str, data: bytes) -> dict[str, Any]:
        """A new session of `owner` holding `data` (session bytes) under a fresh id."""
        parts = session_parts(data)
        check_room(self.quotas, self.store.usage(owner), new_sessions=1, new_bytes=_stored_size(parts))
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
            try:
                data = session.to_bytes()
            except ValueError as e:  # a state holding NaN or inf: the model diverged on this input
                raise ApiError(422, f"session {sid} was not changed: {e}") from e
            parts = session_parts(data)
            if self.quotas.max_bytes is not None:
                grown = _stored_size(parts) - record.size
                check_room(self.quotas, self.store.usage(owner), new_bytes=grown)
            try:
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
            try:
                session.rollback(snapshot)  # on this copy only: nothing of `sid` is written
            except ValueError as e:
                raise ApiError(422, str(e)) from e
        try:
            data = session.to_bytes()
        except ValueError as e:
            raise ApiError(422, f"session {sid} cannot be forked: {e}") from e
        result = self._insert(owner, data)
        log.info("session %s forked from %s", result["id"], sid)
        return {**result, "parent": sid, "position": session.position, "reads": session.reads}

    def export(self, sid: str, owner: str) -> bytes:
        """The session's bytes (`MemorySession.to_bytes`), checked to load first."""
        record, _ = self.load(sid, owner)
        return record.data

    def import_(self, owner: str, data: bytes) -> dict[str, Any]:
        """A new session of `owner` from bytes `MemorySession.to_bytes` wrote (for this model)."""
        try:
            session = self.engine.load(data)
        except (ValueError, TypeError) as e:  # SessionFormatError, or a session of another model
            raise ApiError(422, f"the body is not a session this server can load: {e}") from e
        result = self._insert(owner, data)
        log.info("session %s imported", result["id"])
        return {**result, "position": session.position, "reads": session.reads}

    def delete(self, sid: str, owner: str) -> dict[str, Any]:
        if not _SESSION_ID.match(sid) or not self.store.delete(sid, owner):
            raise _not_found(sid)
        log.info("session %s deleted", sid)
        return {"id": sid, "deleted": True}

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


def _stored_size(parts: list[bytes]) -> int:
    """Bytes `parts` take in a store that keeps each distinct part once."""
    return sum({bytes(p): len(p) for p in parts}.values())


def _owner_from(key_hashes: frozenset[str] | None) -> Callable[..., str]:
    def owner(authorization: str | None = Header(None, description="Bearer KEY")) -> str:
        if key_hashes is None:
            return ANONYMOUS
        key = bearer_key(authorization)
        if key is None:
            raise HTTPException(
                401, "missing API key: send 'Authorization: Bearer KEY'", {"WWW-Authenticate": "Bearer"}
            )
        digest = hash_key(key)
        if digest not in key_hashes:
            raise HTTPException(401, "unknown API key", {"WWW-Authenticate": "Bearer"})
        return digest

    return owner


def create_app(
    engine: Engine,
    store: SessionStore,
    *,
    key_hashes: frozenset[str] | None,
    limits: Limits | None = None,
    workers: int = 4,
    model_name: str = "",
    quotas: Quotas | None = None,
) -> FastAPI:
    """The API over `engine` and `store`. key_hashes: sha256 hashes of the accepted keys (`load_api_keys`);
    None: no keys, every request is one anonymous owner. quotas: per-key limits, idle sessions' lifetime
    and the slow-client timeout (`titans.serving.limits.Quotas`; default its defaults)."""
    limits = limits or Limits()
    service = SessionService(engine, store, limits, workers, quotas)
    app = FastAPI(
        title="titans memory server",
        version="1",
        description=(
            "Per-session Titans memories: each session is a model state that learns the text it reads. "
            "Every route but /v1/health needs `Authorization: Bearer KEY` (when the server has keys); a "
            "session belongs to the key that created it."
        ),
    )
    app.state.service = service
    app.add_middleware(BodyTimeout, timeout_s=service.quotas.body_timeout_s)  # inside the body limit
    app.add_middleware(
        BodyLimit,
        max_bytes=limits.max_body_bytes,
        larger={"/v1/sessions/import": (limits.max_import_bytes, "--max-import-bytes")},
    )
    owner_dep = Depends(_owner_from(key_hashes))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(StoreError)
    async def _store_error(request: Request, exc: StoreError) -> JSONResponse:
        log.error("store error: %s", exc)
        return JSONResponse({"detail": f"the session store is unavailable: {exc}"}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                reason = (err.get("ctx") or {}).get("error", "")
                at = err.get("loc", ("", "?"))[-1]
                problems.append(f"the body is not valid JSON ({reason} at character {at})")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        return JSONResponse({"detail": "malformed request: " + "; ".join(problems)}, status_code=422)

    # ---- per-key limits (titans.serving.limits): every route's work runs through `gated`
    @app.exception_handler(TooBusy)
    async def _too_busy(request: Request, exc: TooBusy) -> JSONResponse:
        return JSONResponse(
            {"detail": exc.detail}, status_code=429, headers={"Retry-After": str(exc.retry_after_s)}
        )

    async def gated(owner: str, fn: Callable[[], T], sid: str | None = None) -> T:
        """`fn` in a worker thread, counted against the key's concurrent requests; serialised with the
        other requests to session `sid` when given."""
        service.sweeper.maybe_sweep()
        async with service.gate.hold(owner):
            if sid is None:
                async with service.fair.slot(owner):
                    return await service.run(fn)
            async with service.locks.hold(sid), service.fair.slot(owner):
                return await service.run(fn)

    async def locked(sid: str, owner: str, fn: Callable[[], T]) -> T:
        return await gated(owner, fn, sid)

    def guarded(fn: Callable[[MemorySession], dict[str, Any]]) -> Callable[[MemorySession], dict[str, Any]]:
        """Session errors that are the request's fault as 422."""

        def op(session: MemorySession) -> dict[str, Any]:
            try:
                return fn(session)
            except (ValueError, FloatingPointError) as e:  # FloatingPointError: a write the guard undid
                raise ApiError(422, str(e)) from e

        return op

    @app.get("/v1/health", summary="liveness (no key needed)")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "store": store.kind}

    @app.post("/v1/sessions", status_code=201, summary="create a session -> {id}")
    async def create(owner: str = owner_dep) -> dict[str, Any]:
        return await gated(owner, lambda: service.create(owner))

    @app.delete("/v1/sessions/{sid}", summary="delete a session and its snapshots")
    async def delete(sid: str, owner: str = owner_dep) -> dict[str, Any]:
        return await locked(sid, owner, lambda: service.delete(sid, owner))

    @app.post("/v1/sessions/{sid}/read", summary="the memory reads (learns) a text")
    async def read(sid: str, body: ReadBody, owner: str = owner_dep) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            ids = service.tokens(body.text, "text")
            return service.change(sid, owner, guarded(lambda s: read_json(s, ids)))

        return await locked(sid, owner, work)

    @app.post("/v1/sessions/{sid}/generate", summary="read a prompt into the memory, then continue it")
    async def generate(sid: str, body: GenerateBody, owner: str = owner_dep) -> dict[str, Any]:
        if body.max_new_tokens > limits.max_new_tokens:
            raise ApiError(
                422,
                f"max_new_tokens {body.max_new_tokens} is over this server's limit of "
                f"{limits.max_new_tokens} (--max-new-tokens)",
            )

        def work() -> dict[str, Any]:
            ids = service.tokens(body.prompt, "prompt")

            def op(session: MemorySession) -> dict[str, Any]:
                return generate_json(
                    engine,
                    session,
                    ids,
                    body.max_new_tokens,
                    temperature=body.temperature,
                    top_k=body.top_k,
                    top_p=body.top_p,
                    greedy=body.greedy,
                    seed=body.seed,
                    stop_at_eos=body.stop_at_eos,
                )

            return service.change(sid, owner, guarded(op))

        return await locked(sid, owner, work)

    @app.get("/v1/sessions/{sid}/stats", summary="counters, the guard's events, memory norms, a digest")
    async def stats(sid: str, owner: str = owner_dep) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            record, session = service.load(sid, owner)
            return {"id": sid, "version": record.version, **stats_json(session)}

        return await gated(owner, work)

    @app.post("/v1/sessions/{sid}/freeze", summary="stop writing the memory (reads still work)")
    async def freeze(sid: str, owner: str = owner_dep) -> dict[str, Any]:
        def op(session: MemorySession) -> dict[str, Any]:
            session.freeze()
            return {"frozen": True}

        return await locked(sid, owner, lambda: service.change(sid, owner, op))

    @app.post("/v1/sessions/{sid}/unfreeze", summary="write the memory again")
    async def unfreeze(sid: str, owner: str = owner_dep) -> dict[str, Any]:
        def op(session: MemorySession) -> dict[str, Any]:
            session.unfreeze()
            return {"frozen": False}

        return await locked(sid, owner, lambda: service.change(sid, owner, op))

    @app.get("/v1/sessions/{sid}/snapshots", summary="the kept snapshots, newest first (k from 1)")
    async def snapshots(sid: str, owner: str = owner_dep) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            record, session = service.load(sid, owner)
            return {"id": sid, "version": record.version, "snapshots": snapshots_json(session)}

        return await gated(owner, work)

    @app.post("/v1/sessions/{sid}/rollback", summary="restore a snapshot, bit for bit")
    async def rollback(sid: str, body: RollbackBody, owner: str = owner_dep) -> dict[str, Any]:
        def op(session: MemorySession) -> dict[str, Any]:
            session.rollback(body.snapshot)
            return {"position": session.position, "reads": session.reads, "snapshots": len(session.snapshots)}

        return await locked(sid, owner, lambda: service.change(sid, owner, guarded(op)))

    add_session_routes(app, service, owner_dep, gated, locked, guarded)
    return app


# ------------------------------------------------------------------------------ fork, export, stream
def add_session_routes(app: FastAPI, service: SessionService, owner_dep, gated, locked, guarded) -> None:
    """Fork a session, export and import its bytes, and generate with the answer streamed (server-sent
    events)."""
    engine, limits = service.engine, service.limits

    @app.post("/v1/sessions/{sid}/fork", status_code=201, summary="a new session from this one's memory")
    async def fork(sid: str, body: ForkBody | None = None, owner: str = owner_dep) -> dict[str, Any]:
        snapshot = body.snapshot if body is not None else None
        return await locked(sid, owner, lambda: service.fork(sid, owner, snapshot))

    @app.get(
        "/v1/sessions/{sid}/export",
        summary="the session's bytes (MemorySession.to_bytes)",
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    async def export(sid: str, owner: str = owner_dep) -> Response:
        data = await locked(sid, owner, lambda: service.export(sid, owner))
        return Response(
            data,
            media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{sid}.session"'},
        )

    @app.post(
        "/v1/sessions/import",
        status_code=201,
        summary="a new session from exported bytes (the body, application/octet-stream)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
    )
    async def import_session(request: Request, owner: str = owner_dep) -> dict[str, Any]:
        data = await request.body()
        return await gated(owner, lambda: service.import_(owner, data))

    @app.post(
        "/v1/sessions/{sid}/generate/stream",
        summary="generate, the tokens sent as server-sent events as they come; the memory written at the end",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def generate_stream(sid: str, body: GenerateBody, owner: str = owner_dep) -> StreamingResponse:
        if body.max_new_tokens > limits.max_new_tokens:
            raise ApiError(
                422,
                f"max_new_tokens {body.max_new_tokens} is over this server's limit of "
                f"{limits.max_new_tokens} (--max-new-tokens)",
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_token(token: int) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("token", token))

        def work() -> dict[str, Any]:
            ids = service.tokens(body.prompt, "prompt")

            def op(session: MemorySession) -> dict[str, Any]:
                return generate_json(
                    engine,
                    session,
                    ids,
                    body.max_new_tokens,
                    temperature=body.temperature,
                    top_k=body.top_k,
                    top_p=body.top_p,
                    greedy=body.greedy,
                    seed=body.seed,
                    stop_at_eos=body.stop_at_eos,
                    on_token=on_token,
                )

            return service.change(sid, owner, guarded(op))

        async def run() -> None:
            try:
                events.put_nowait(("done", await locked(sid, owner, work)))
            except Exception as e:  # noqa: BLE001 - handed to the response: an error status or event
                events.put_nowait(("error", e))

        # the whole generation and its write run on whether or not the client stays to the end
        task = asyncio.ensure_future(run())
        app.state.streams = getattr(app.state, "streams", set()) | {task}
        task.add_done_callback(lambda t: app.state.streams.discard(t))
        kind, first = await events.get()
        if kind == "error":
            raise first  # before any token: the answer is the error's own status
        return StreamingResponse(
            _sse(engine, body.stop_at_eos, (kind, first), events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


async def _sse(engine: Engine, stop_at_eos: bool, first: tuple[str, Any], events: asyncio.Queue):
    """Server-sent events: ``token`` ({"id", "text"}: the text it adds), then ``done`` (the generate
    route's answer, once the session is stored) or ``error`` ({"status", "detail"})."""
    ids: list[int] = []
    text = ""
    eos = engine.tokenizer.eos_id if stop_at_eos else None
    item = first
    while True:
        kind, value = item
        if kind == "token":
            ids.append(value)
            piece = ""
            if value != eos:
                decoded = engine.tokenizer.decode([t for t in ids if t != eos])
                if not decoded.endswith("\ufffd"):  # a character still incomplete waits for its bytes
                    piece, text = decoded[len(text) :], decoded
            yield _event("token", {"id": value, "text": piece})
        elif kind == "done":
            yield _event("done", value)
            return
        else:
            status, detail = (value.status, value.detail) if isinstance(value, ApiError) else (503, "")
            if isinstance(value, StoreError):
                detail = "the session store is unavailable"
            elif not isinstance(value, ApiError):
                status, detail = 500, "the generation failed"
                log.error("streamed generation failed: %r", value)
            yield _event("error", {"status": status, "detail": detail})
            return
        item = await events.get()


def _event(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


__all__ = [
    "ApiError",
    "BodyLimit",
    "ForkBody",
    "GenerateBody",
    "Limits",
    "ReadBody",
    "RollbackBody",
    "add_session_routes",
    "create_app",
]
