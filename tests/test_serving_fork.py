"""Forking a session, exporting and importing its bytes, and streamed generation (server-sent events):
a real uvicorn server on loopback, a real HTTP client, SQLite and Redis stores."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")

import httpx  # noqa: E402

from serving_support import ThreadServer, make_checkpoint, start_redis, stop_redis  # noqa: E402
from titans.inference.session import MemorySession  # noqa: E402
from titans.models.state import state_digest  # noqa: E402
from titans.runtime.loading import load_trained  # noqa: E402
from titans.serving.app import Limits, create_app  # noqa: E402
from titans.serving.auth import hash_key  # noqa: E402
from titans.serving.limits import Quotas  # noqa: E402
from titans.serving.session import Engine  # noqa: E402
from titans.serving.stores import RedisStore, SQLiteStore  # noqa: E402

KEY_A, KEY_B = "fork-key-a", "fork-key-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
TEXT = "Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    model, tokenizer = load_trained(make_checkpoint(tmp_path_factory.mktemp("fork") / "run"))
    return Engine(model, tokenizer, max_snapshots=4)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def server(request, engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"fork-{request.param}")
    redis_server = None
    if request.param == "sqlite":
        store = SQLiteStore(folder / "sessions.db")
    else:
        redis_server, url = start_redis(folder)
        store = RedisStore(url)
    keys = frozenset({hash_key(KEY_A), hash_key(KEY_B)})
    limits = Limits(max_body_bytes=4096, max_import_bytes=4 << 20, max_new_tokens=40)
    app = create_app(engine, store, key_hashes=keys, limits=limits, workers=2, quotas=Quotas(max_sessions=50))
    try:
        with ThreadServer(app) as s:
            s.store = store
            yield s
    finally:
        store.close()
        if redis_server is not None:
            stop_redis(redis_server)


@pytest.fixture
def http():
    with httpx.Client(timeout=60) as client:
        yield client


def new(http, url, headers=A) -> str:
    r = http.post(f"{url}/v1/sessions", headers=headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def stats(http, url, sid, headers=A) -> dict:
    r = http.get(f"{url}/v1/sessions/{sid}/stats", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def read(http, url, sid, text=TEXT, headers=A) -> dict:
    r = http.post(f"{url}/v1/sessions/{sid}/read", headers=headers, json={"text": text})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_fork_starts_from_the_parents_memory_and_goes_its_own_way(server, http):
    url = server.url
    parent = new(http, url)
    read(http, url, parent)
    before_last = stats(http, url, parent)["state_sha256"]
    read(http, url, parent, "Whenever it is a damp, drizzly November in my soul.")
    parent_stats = stats(http, url, parent)

    r = http.post(f"{url}/v1/sessions/{parent}/fork", headers=A)
    assert r.status_code == 201, r.text
    child = r.json()["id"]
    assert child != parent and r.json()["parent"] == parent and r.json()["reads"] == 2
    assert stats(http, url, child)["state_sha256"] == parent_stats["state_sha256"]
    read(http, url, child, "a branch of its own")
    assert stats(http, url, child)["state_sha256"] != parent_stats["state_sha256"]
    assert stats(http, url, parent) == parent_stats  # the parent is untouched

    r = http.post(f"{url}/v1/sessions/{parent}/fork", headers=A, json={"snapshot": 1})
    assert r.status_code == 201, r.text
    older = r.json()["id"]
    assert stats(http, url, older)["state_sha256"] == before_last and stats(http, url, older)["reads"] == 1
    assert stats(http, url, parent) == parent_stats

    # another key's session forks like a missing one; a snapshot it does not have is a 409 (as for rollback)
    missing = "0" * 32
    foreign = http.post(f"{url}/v1/sessions/{parent}/fork", headers=B)
    absent = http.post(f"{url}/v1/sessions/{missing}/fork", headers=B)
    assert foreign.status_code == absent.status_code == 404
    assert foreign.json()["detail"] == absent.json()["detail"].replace(missing, parent)
    r = http.post(f"{url}/v1/sessions/{parent}/fork", headers=A, json={"snapshot": 9})
    assert r.status_code == 409 and "snapshot 9" in r.json()["detail"]


def test_export_and_import_carry_a_session_bit_for_bit(server, http, engine):
    url = server.url
    sid = new(http, url)
    read(http, url, sid)
    assert http.post(f"{url}/v1/sessions/{sid}/freeze", headers=A).status_code == 200
    original = stats(http, url, sid)

    r = http.get(f"{url}/v1/sessions/{sid}/export", headers=A)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    session = MemorySession.from_bytes(engine.model, r.content)  # the library's own session format
    assert state_digest(session.state) == original["state_sha256"] and session.frozen
    assert len(r.content) > 4096  # larger than the JSON body limit: import has its own

    imported = http.post(
        f"{url}/v1/sessions/import",
        headers={**B, "Content-Type": "application/octet-stream"},
        content=r.content,
    )
    assert imported.status_code == 201, imported.text
    copy = imported.json()["id"]
    mine = stats(http, url, copy, B)
    assert mine["state_sha256"] == original["state_sha256"] and mine["frozen"] and mine["reads"] == 1
    assert http.get(f"{url}/v1/sessions/{copy}/stats", headers=A).status_code == 404  # B's now
    read(http, url, copy, "and on", B)

    damaged = bytearray(r.content)
    damaged[len(damaged) // 2] ^= 1
    for bad in (bytes(damaged), b"not a session", b""):
        r2 = http.post(f"{url}/v1/sessions/import", headers=B, content=bad)
        assert r2.status_code == 422 and "not a session this server can load" in r2.json()["detail"]
    r2 = http.post(f"{url}/v1/sessions/import", headers=B, content=b"x" * (5 << 20))
    assert r2.status_code == 413 and "--max-import-bytes" in r2.json()["detail"]
    assert http.get(f"{url}/v1/sessions/{'0' * 32}/export", headers=A).status_code == 404


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_streamed_generation_sends_its_tokens_then_stores_the_memory(server, http):
    url = server.url
    sid = new(http, url)
    read(http, url, sid)
    twin = http.post(f"{url}/v1/sessions/{sid}/fork", headers=A).json()["id"]
    body = {"prompt": "The sea", "max_new_tokens": 12, "greedy": True, "stop_at_eos": False}

    plain = http.post(f"{url}/v1/sessions/{twin}/generate", headers=A, json=body)
    assert plain.status_code == 200, plain.text
    version = stats(http, url, sid)["version"]
    with http.stream("POST", f"{url}/v1/sessions/{sid}/generate/stream", headers=A, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        r.read()
    events = events_of(r)
    tokens = [data for kind, data in events if kind == "token"]
    assert [kind for kind, _ in events] == ["token"] * 12 + ["done"]
    done = events[-1][1]
    assert "".join(t["text"] for t in tokens) == done["text"] == plain.json()["text"]
    assert done["version"] == version + 1 and done["new_tokens"] == 12
    # the memory written is the one the plain generate wrote from the same state
    assert stats(http, url, sid)["state_sha256"] == stats(http, url, twin)["state_sha256"]

    # refused before any token: the error's own status, as JSON
    r = http.post(f"{url}/v1/sessions/{'0' * 32}/generate/stream", headers=A, json=body)
    assert r.status_code == 404 and "no session" in r.json()["detail"]
    r = http.post(f"{url}/v1/sessions/{sid}/generate/stream", headers=A, json={**body, "max_new_tokens": 99})
    assert r.status_code == 422 and "--max-new-tokens" in r.json()["detail"]


def test_fork_and_stream_take_bodies_as_strict_as_the_other_routes(server, http):
    """The fork body's snapshot is a JSON Schema integer of at least 1, and the stream takes generate's
    body and sampling rules: a temperature too small to divide by samples greedily instead of failing."""
    url = server.url
    sid = new(http, url)
    read(http, url, sid)
    for bad in ({"snapshot": "1"}, {"snapshot": True}, {"snapshot": 1.5}, {"snapshot": 0}, {"other": 1}):
        r = http.post(f"{url}/v1/sessions/{sid}/fork", headers=A, json=bad)
        assert r.status_code == 422 and r.json()["detail"].startswith("malformed request: "), (bad, r.text)
    r = http.post(f"{url}/v1/sessions/{sid}/fork", headers=A, json={"snapshot": 1.0})  # 1.0 is an integer
    assert r.status_code == 201, r.text
    twin = http.post(f"{url}/v1/sessions/{sid}/fork", headers=A).json()["id"]

    body = {"prompt": "The sea", "max_new_tokens": 6, "stop_at_eos": False}
    greedy = http.post(f"{url}/v1/sessions/{twin}/generate", headers=A, json={**body, "greedy": True})
    assert greedy.status_code == 200, greedy.text
    tiny = {**body, "temperature": 1e-39, "top_p": 1e-3}
    with http.stream("POST", f"{url}/v1/sessions/{sid}/generate/stream", headers=A, json=tiny) as r:
        assert r.status_code == 200, r.read()
        r.read()
    events = events_of(r)
    assert events[-1][0] == "done" and events[-1][1]["text"] == greedy.json()["text"]
    for bad in ({"prompt": "\ud800"}, {"prompt": ""}, {**body, "top_p": 1e-300}, {**body, "seed": "1"}):
        content = json.dumps(bad)  # "\\ud800" escaped: a lone surrogate as JSON writes it
        r = http.post(f"{url}/v1/sessions/{sid}/generate/stream", headers=A, content=content)
        assert r.status_code == 422 and r.json()["detail"].startswith("malformed request: "), (bad, r.text)
