"""Forking a session, exporting and importing its bytes, and streamed generation (server-sent events):
a real uvicorn server on loopback, a real HTTP client, SQLite and Redis stores."""

from __future__ import annotations

import asyncio
import hashlib
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")

import httpx  # noqa: E402

from serving_support import ThreadServer, make_checkpoint, start_redis, stop_redis  # noqa: E402
from session_support import rebuilt  # noqa: E402
from titans.data.tokenizers import ByteTokenizer  # noqa: E402
from titans.inference.session import SESSION_MAGIC, MemorySession  # noqa: E402
from titans.models.state import state_digest  # noqa: E402
from titans.runtime.loading import load_trained  # noqa: E402
from titans.serving.app import Limits, _sse, create_app  # noqa: E402
from titans.serving.auth import hash_key  # noqa: E402
from titans.serving.errors import ApiError  # noqa: E402
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


def _resealed(data: bytes, edit) -> bytes:
    """Session bytes with their JSON header replaced by edit(header) (a value, or bytes as they are) and
    a checksum that matches: what a crafted import body can be."""
    start = len(SESSION_MAGIC)
    size = int.from_bytes(data[start : start + 8], "little")
    header = json.loads(data[start + 8 : start + 8 + size])
    head = edit(header)
    head = head if isinstance(head, bytes) else json.dumps(head).encode()
    body = SESSION_MAGIC + len(head).to_bytes(8, "little") + head + data[start + 8 + size : -32]
    return body + hashlib.sha256(body).digest()


def test_a_crafted_import_header_is_a_422_naming_the_field(server, http, engine):
    """Bytes with a matching checksum and a header field missing, of the wrong type or out of range are
    refused with a 422 whose fixed sentence names the field (no Python error text), on a connection that
    serves the next request; no session is made. (They were 500s, or a 201 whose session answered every
    later request 500.)"""
    url = server.url
    sid = new(http, url)
    read(http, url, sid)
    data = http.get(f"{url}/v1/sessions/{sid}/export", headers=A).content
    usage = server.store.usage(hash_key(KEY_A))

    def without(key):
        return lambda h: {k: v for k, v in h.items() if k != key}

    def setting(key, value):
        return lambda h: {**h, key: value}

    cases = {
        "max_snapshots": without("max_snapshots"),
        "probe": without("probe"),
        "frozen": setting("frozen", "yes"),
        "probe_loss": setting("probe_loss", "x"),
        "events[0]": setting("events", [{}]),
        "events": setting("events", 5),
        "guard_max_rise": lambda h: json.dumps({**h, "guard_max_rise": float("nan")}).encode(),
        "tokens_generated": lambda h: (
            json.dumps(h).replace('"tokens_generated": 0', '"tokens_generated": 1e400', 1).encode()
        ),
        "reads": setting("reads", "x"),
        "position": setting("position", -5),
        "created": setting("created", "x"),
        "piece_len": setting("piece_len", 0),
        "snapshots[0]": setting("snapshots", [{"state": 99}]),
        "not a JSON object": lambda h: [1, 2],
        "not JSON": lambda h: b'{"format": [[[[' * 10000,
        "format": setting("format", "1"),
    }
    for field, edit in cases.items():
        r = http.post(f"{url}/v1/sessions/import", headers=A, content=_resealed(data, edit))
        detail = r.json()["detail"]
        assert r.status_code == 422, (field, r.status_code, detail)
        assert detail.startswith("the body is not a session this server can load: session bytes: "), detail
        assert field in detail and "Error" not in detail and "convert" not in detail, (field, detail)
    # a state's bytes damaged under a matching checksum: a fixed sentence, not the decoder's words
    start = len(SESSION_MAGIC)
    head_end = start + 8 + int.from_bytes(data[start : start + 8], "little")
    body = bytearray(data[:-32])
    body[head_end + 40] ^= 0xFF
    r = http.post(f"{url}/v1/sessions/import", headers=A, content=bytes(body) + hashlib.sha256(body).digest())
    assert r.status_code == 422, r.text
    assert r.json()["detail"].endswith("one of its states is damaged"), r.text
    assert server.store.usage(hash_key(KEY_A)) == usage  # nothing was stored
    assert http.post(f"{url}/v1/sessions/import", headers=A, content=data).status_code == 201


def test_an_import_is_checked_and_stored_state_by_state(server, http, engine):
    """An import's snapshots are decoded and its counters checked on the way in. A damaged snapshot was
    stored and then failed every rollback and fork to it; blobs of no state were stored (each later load
    read them all, the quota counted them once); a snapshot's position and the counters were taken from
    the header, so a rollback answered a position /stats then contradicted, and tokens_read went negative."""
    url = server.url
    sid = new(http, url)
    read(http, url, sid)
    read(http, url, sid, "Whenever it is a damp, drizzly November in my soul.")
    data = http.get(f"{url}/v1/sessions/{sid}/export", headers=A).content
    usage = server.store.usage(hash_key(KEY_A))

    def flip(blobs):  # a byte in the middle of the last blob, snapshot 1's state
        last = bytearray(blobs[-1])
        last[len(last) // 2] ^= 0xFF
        return [*blobs[:-1], bytes(last)]

    same = lambda h: h  # noqa: E731
    refused = {
        "one of its states is damaged": rebuilt(data, same, flip),
        "session bytes: damaged header (blobs": rebuilt(data, same, lambda b: [*b, b[-1]]),
        "tokens_generated": rebuilt(data, lambda h: {**h, "tokens_generated": 10**12, "reads": 10**12}),
    }
    for want, body in refused.items():
        r = http.post(f"{url}/v1/sessions/import", headers=A, content=body)
        assert r.status_code == 422 and want in r.json()["detail"], (want, r.text)
        assert "checksum" not in r.json()["detail"]
    assert server.store.usage(hash_key(KEY_A)) == usage  # nothing was stored

    # a snapshot's position is its state's, whatever the header says
    original = http.get(f"{url}/v1/sessions/{sid}/snapshots", headers=A).json()["snapshots"]
    lying = rebuilt(
        data,
        lambda h: {
            **h,
            "snapshots": [s if s["state"] is None else {**s, "position": 999_999} for s in h["snapshots"]],
        },
    )
    r = http.post(f"{url}/v1/sessions/import", headers=A, content=lying)
    assert r.status_code == 201, r.text
    copy = r.json()["id"]
    assert http.get(f"{url}/v1/sessions/{copy}/snapshots", headers=A).json()["snapshots"] == original
    r = http.post(f"{url}/v1/sessions/{copy}/rollback", headers=A, json={"snapshot": 1})
    assert r.status_code == 200, r.text
    assert r.json()["position"] == stats(http, url, copy)["position"] == original[0]["position"]


def test_an_import_cannot_bring_settings_past_the_servers_limits(server, http, engine):
    """Imported bytes carry their session's settings: more snapshots than the server keeps, pieces of one
    token a model call, a guard probe the server does not have (every read runs it in full: a 2-token read
    took 38 s with a 20,000-token probe) or more events than a session keeps are refused with a 422 naming
    the setting, and nothing is stored. The server's own settings import as before."""
    url = server.url
    sid = new(http, url)
    read(http, url, sid)
    data = http.get(f"{url}/v1/sessions/{sid}/export", headers=A).content
    usage = server.store.usage(hash_key(KEY_A))

    def setting(key, value):
        return lambda h: {**h, key: value}

    event = {
        "kind": "freeze",
        "reason": "x",
        "position": 0,
        "time": 0.0,
        "probe_before": None,
        "probe_after": None,
    }
    cases = {
        "snapshots": setting("max_snapshots", engine.max_snapshots + 1),
        "pieces of 1 tokens": setting("piece_len", 1),
        "probe text other than this server's": setting("probe", list(range(2, 40))),
        "events": setting("events", [event] * (MemorySession.max_events + 1)),
    }
    for words, edit in cases.items():
        r = http.post(f"{url}/v1/sessions/import", headers=A, content=_resealed(data, edit))
        assert r.status_code == 422, (words, r.status_code, r.text)
        detail = r.json()["detail"]
        assert detail.startswith("the body is not a session this server can take: ") and words in detail, (
            detail
        )
    assert server.store.usage(hash_key(KEY_A)) == usage
    assert http.post(f"{url}/v1/sessions/import", headers=A, content=data).status_code == 201


def test_an_import_into_a_guarded_server_must_be_guarded_as_its_sessions(engine):
    """On a server with --guard-probe, imported bytes of an unguarded session, or of one whose guard allows
    a larger rise, were taken as they were: the one way a client had to an unguarded session there."""
    probe = "The whale was white. Ahab chased it."
    guarded = Engine(engine.model, engine.tokenizer, max_snapshots=4, probe=probe, guard_max_rise=0.05)
    assert guarded.import_problem(guarded.new_session()) is None
    assert "is not guarded, and this server guards every session" in guarded.import_problem(
        MemorySession(engine.model, snapshots=2)
    )
    loose = MemorySession(engine.model, snapshots=2, probe=guarded.probe, guard_max_rise=1e12)
    assert "allows the probe loss to rise by 1e+12; this server's by at most 0.05" in guarded.import_problem(
        loose
    )
    stricter = MemorySession(engine.model, snapshots=2, probe=guarded.probe, guard_max_rise=0.01)
    assert guarded.import_problem(stricter) is None
    assert engine.import_problem(MemorySession(engine.model, snapshots=2)) is None  # an unguarded server


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


def test_a_stream_whose_session_another_server_changed_ends_in_a_409_and_sends_no_token_twice(
    server, http, monkeypatch
):
    """`change` applies a request again from the newer record when another server wrote the session in
    between: a streamed generation whose tokens went out already must not stream a second generation.
    It ends with an error event (409, nothing stored); the other server's write stays."""
    url = server.url
    sid = new(http, url)
    read(http, url, sid)
    store, put = server.store, server.store.put
    competing = []

    def put_after_another_server(sid_: str, data, *, expected_version: int) -> int:
        if not competing:  # another server writes the session first (its own record, rewritten)
            competing.append(put(sid_, store.get(sid_).data, expected_version=expected_version))
        return put(sid_, data, expected_version=expected_version)

    monkeypatch.setattr(store, "put", put_after_another_server)
    before = stats(http, url, sid)
    body = {"prompt": "The sea", "max_new_tokens": 12, "greedy": True, "stop_at_eos": False}
    with http.stream("POST", f"{url}/v1/sessions/{sid}/generate/stream", headers=A, json=body) as r:
        assert r.status_code == 200
        r.read()
    events = events_of(r)
    assert [kind for kind, _ in events] == ["token"] * 12 + ["error"], events
    error = events[-1][1]
    assert error["status"] == 409 and "changed on another server" in error["detail"], error
    after = stats(http, url, sid)
    assert competing == [before["version"] + 1] and after["version"] == before["version"] + 1
    assert after["state_sha256"] == before["state_sha256"] and after["position"] == before["position"]

    # a plain generate is applied again from the newer record (nothing was sent yet): 200, stored once
    competing.clear()
    r = http.post(f"{url}/v1/sessions/{sid}/generate", headers=A, json=body)
    assert r.status_code == 200 and r.json()["version"] == after["version"] + 2, r.text


def test_streamed_token_texts_add_up_to_the_answer_that_ends_mid_character():
    """A byte tokenizer splits a character over several tokens: a token that leaves one incomplete adds
    no text yet, and when the answer ends mid-character the last token carries the rest (U+FFFD), so the
    token texts add up to done's text in every case; one event per token, in order."""
    tokenizer = ByteTokenizer()
    engine = SimpleNamespace(tokenizer=tokenizer)

    async def stream(ids: list[int], end: str = "done") -> list[tuple[str, dict]]:
        queue: asyncio.Queue = asyncio.Queue()
        for token in ids[1:]:
            queue.put_nowait(("token", token))
        text = tokenizer.decode(ids)
        queue.put_nowait(("done", {"text": text}) if end == "done" else ("error", ApiError(409, "x")))
        first = ("token", ids[0])
        out = [chunk async for chunk in _sse(engine, False, first, queue)]
        return events_of(httpx.Response(200, content=b"".join(out)))

    euro = list("€".encode())  # 3 bytes
    for ids in (
        [65, *euro],  # whole
        [65, *euro[:2]],  # cut after 2 of 3 bytes
        [*euro[:1]],  # one token, cut
        [65, 0xFF],  # a byte no character starts with
        [*euro, *euro[:1]],
        [*euro[:2], 66],  # a cut character, then another: U+FFFD, then B
    ):
        events = asyncio.run(stream(ids))
        tokens = [data for kind, data in events if kind == "token"]
        assert [t["id"] for t in tokens] == ids and events[-1][0] == "done"
        assert "".join(t["text"] for t in tokens) == events[-1][1]["text"] == tokenizer.decode(ids), ids
    events = asyncio.run(stream([65, *euro[:2]], end="error"))  # an error: every token still sent once
    assert [kind for kind, _ in events] == ["token"] * 3 + ["error"]
