"""The memory server end to end: a real uvicorn server (in a thread) on a loopback port, a real HTTP client,
a real store (SQLite in a file, and a Redis server started here), and a tiny checkpoint.

What is checked against a direct computation: the surprise a read reports, the text a generate returns
(greedy, from the session's memory), the bit-identity of a rollback, and that a frozen session's memory
weights do not move. And every bad request gets its 4xx without changing the stored session.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")

import httpx  # noqa: E402
import torch

from serving_support import ThreadServer, make_checkpoint, start_redis, stop_redis, wait_healthy  # noqa: E402
from titans.inference.session import MemorySession, SessionFormatError  # noqa: E402
from titans.models.state import state_digest, state_tensors  # noqa: E402
from titans.models.streaming import generate, prefill  # noqa: E402
from titans.runtime.loading import load_trained  # noqa: E402
from titans.serving.app import Limits, create_app  # noqa: E402
from titans.serving.auth import hash_key  # noqa: E402
from titans.serving.session import Engine, session_parts  # noqa: E402
from titans.serving.stores import RedisStore, SQLiteStore, checksum  # noqa: E402

KEY_A, KEY_B = "key-of-a", "key of b (any string)"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
DOC = "The whale was white. Ahab chased it across three oceans, for forty years, with one leg.\n" * 3
# what the model computes does not depend on the store: those tests run on one
SQLITE_ONLY = pytest.mark.parametrize("served", ["sqlite"], indirect=True)
LIMITS = Limits(max_body_bytes=4096, max_tokens=600, max_new_tokens=40)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serving") / "run")


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    model, tokenizer = load_trained(checkpoint)
    return Engine(model, tokenizer, max_snapshots=3)


@dataclass
class Served:
    url: str
    store: SQLiteStore | RedisStore
    engine: Engine
    http: httpx.Client  # one client: its connections are reused

    def post(self, path: str, headers=A, **kwargs) -> httpx.Response:
        return self.http.post(f"{self.url}{path}", headers=headers, **kwargs)

    def get(self, path: str, headers=A) -> httpx.Response:
        return self.http.get(f"{self.url}{path}", headers=headers)

    def new(self, headers=A) -> str:
        r = self.post("/v1/sessions", headers)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def read(self, sid: str, text: str, headers=A) -> dict:
        r = self.post(f"/v1/sessions/{sid}/read", headers, json={"text": text})
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self, sid: str) -> dict:
        r = self.get(f"/v1/sessions/{sid}/stats")
        assert r.status_code == 200, r.text
        return r.json()

    def session(self, sid: str) -> MemorySession:
        """The session as the store holds it (read past the server)."""
        return self.engine.load(self.store.get(sid).data)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def served(request, engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"store-{request.param}")
    redis_server = None
    if request.param == "sqlite":
        store = SQLiteStore(folder / "sessions.db")
    else:
        redis_server, url = start_redis(folder)
        store = RedisStore(url)
    keys = frozenset({hash_key(KEY_A), hash_key(KEY_B)})
    app = create_app(engine, store, key_hashes=keys, limits=LIMITS, workers=2)
    try:
        with ThreadServer(app) as server, httpx.Client(timeout=60) as http:
            yield Served(server.url, store, engine, http)
    finally:
        store.close()
        if redis_server is not None:
            stop_redis(redis_server)


def assert_bit_identical(a, b) -> None:
    ta, tb = state_tensors(a), state_tensors(b)
    assert a.position == b.position and ta.keys() == tb.keys()
    for name, t in ta.items():
        assert t.dtype == tb[name].dtype and torch.equal(t, tb[name]), name
    assert state_digest(a) == state_digest(b)


# ------------------------------------------------------------------------------------------ what it computes
@SQLITE_ONLY
def test_a_read_reports_the_surprise_of_a_direct_pass(served):
    sid = served.new()
    got = served.read(sid, DOC)
    ids = served.engine.encode(DOC)
    with torch.no_grad():
        out = served.engine.model.forward_with_stats(torch.tensor([ids]))
    surprise = torch.cat([s.surprise.reshape(-1) for s in out.stats]).double()
    assert got["tokens"] == len(ids) and got["position"] == len(ids) and got["version"] == 2
    assert got["surprise"]["mean"] == pytest.approx(float(surprise.mean()), rel=1e-5)
    assert got["surprise"]["p95"] == pytest.approx(float(torch.quantile(surprise, 0.95)), rel=1e-5)
    assert got["surprise"]["max"] == pytest.approx(float(surprise.max()), rel=1e-6)
    # the stored state is the state of that pass
    state = served.session(sid).state
    assert state.position == len(ids)
    _, want = prefill(served.engine.model, torch.tensor([ids]))
    got_tensors, want_tensors = state_tensors(state), state_tensors(want)
    assert got_tensors.keys() == want_tensors.keys()
    for name, t in got_tensors.items():
        torch.testing.assert_close(t, want_tensors[name], rtol=1e-5, atol=1e-6)


@SQLITE_ONLY
def test_generate_continues_from_the_session_memory(served):
    sid = served.new()
    served.read(sid, DOC)
    prompt = "Who chased the whale? "
    r = served.post(
        f"/v1/sessions/{sid}/generate", json={"prompt": prompt, "max_new_tokens": 12, "greedy": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    model, enc = served.engine.model, served.engine.encode
    _, state = prefill(model, torch.tensor([enc(DOC)]))
    want = generate(model, torch.tensor([enc(prompt)]), 12, greedy=True, state=state)[0, len(enc(prompt)) :]
    assert body["text"] == served.engine.tokenizer.decode(want.tolist())
    assert body["new_tokens"] == 12 and body["position"] == len(enc(DOC)) + len(enc(prompt)) + 12
    # seeded sampling: the same seed from the same state gives the same text
    served.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 1})
    samples = []
    for _ in range(2):
        body = {"prompt": prompt, "max_new_tokens": 8, "temperature": 1.0, "top_k": 20, "seed": 7}
        samples.append(served.post(f"/v1/sessions/{sid}/generate", json=body).json()["text"])
        served.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 1})
    assert samples[0] == samples[1]


@SQLITE_ONLY
def test_rollback_restores_a_bit_identical_state(served):
    sid = served.new()
    served.read(sid, DOC)
    after_doc, state_after_doc = served.stats(sid), served.session(sid).state
    served.read(sid, "A second text, about something else entirely.")
    served.read(sid, "And a third.")
    snaps = served.get(f"/v1/sessions/{sid}/snapshots").json()["snapshots"]
    # k counts back from 1 (the state before the last change), as `MemorySession.rollback` does
    assert [s["k"] for s in snaps] == [1, 2, 3] and snaps[1]["position"] == after_doc["position"]
    r = served.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 2})
    assert r.status_code == 200, r.text
    back = served.stats(sid)
    assert_bit_identical(served.session(sid).state, state_after_doc)
    assert back["state_sha256"] == after_doc["state_sha256"]
    assert (back["position"], back["reads"]) == (after_doc["position"], after_doc["reads"])
    assert back["version"] == after_doc["version"] + 3  # the rollback is a change of its own
    # the snapshot newer than the one restored is gone, the older ones are kept
    assert [s["position"] for s in served.get(f"/v1/sessions/{sid}/snapshots").json()["snapshots"]] == [0]
    # the same read from the restored state gives the same state again, bit for bit
    served.read(sid, "A second text, about something else entirely.")
    first = served.engine.new_session()
    first.read(served.engine.encode(DOC))
    first.read(served.engine.encode("A second text, about something else entirely."))
    assert_bit_identical(served.session(sid).state, first.state)


@SQLITE_ONLY
def test_a_frozen_session_reads_without_writing_its_memory(served):
    sid = served.new()
    served.read(sid, DOC)
    before = served.session(sid).state
    assert served.post(f"/v1/sessions/{sid}/freeze").json()["frozen"] is True
    got = served.read(sid, "New facts the memory must not learn.")
    assert got["frozen"] is True and got["surprise"]["mean"] > 0
    after = served.session(sid).state
    assert after.position == before.position + len("New facts the memory must not learn.")
    for b, a in zip(before.layers, after.layers):
        for wb, wa in zip((*b.memory.weights, *b.memory.momentum), (*a.memory.weights, *a.memory.momentum)):
            assert torch.equal(wb, wa)
    stats = served.stats(sid)
    assert stats["frozen"] is True and [e["kind"] for e in stats["events"]] == ["freeze"]
    assert stats["reads"] == 2 and stats["snapshots"] == 2  # a frozen read is a change: kept as a snapshot
    served.post(f"/v1/sessions/{sid}/unfreeze")
    served.read(sid, "Now it learns again.")
    learned = served.session(sid).state
    assert not torch.equal(learned.layers[0].memory.weights[0], after.layers[0].memory.weights[0])


def test_a_guarded_server_undoes_a_diverging_write(checkpoint, tmp_path):
    """`titans serve --guard-probe`: a read whose write diverges (an inner learning rate raised 200-fold,
    unclipped) is undone and the session frozen; the answer and /stats carry the guard's event."""
    model, tokenizer = load_trained(checkpoint)
    for block in model.blocks:
        block.memory.max_lr, block.memory.surprise_clip = 200.0, None
    engine = Engine(model, tokenizer, probe="The whale was white. Ahab chased it.")
    store = SQLiteStore(tmp_path / "sessions.db")
    app = create_app(engine, store, key_hashes=None, limits=LIMITS, workers=1)
    try:
        with ThreadServer(app) as server, httpx.Client(timeout=60) as http:
            sid = http.post(f"{server.url}/v1/sessions").json()["id"]
            r = http.post(f"{server.url}/v1/sessions/{sid}/read", json={"text": DOC})
            assert r.status_code == 200, r.text
            got = r.json()
            assert not got["kept"] and got["frozen"] and got["position"] == 0 and got["version"] == 2
            assert got["event"]["kind"] == "guard" and "diverged" in got["event"]["reason"]
            stats = http.get(f"{server.url}/v1/sessions/{sid}/stats").json()
            assert stats["guarded"] and stats["frozen"] and [e["kind"] for e in stats["events"]] == ["guard"]
            assert stats["state_sha256"] == state_digest(None)  # the state before the write: none yet
    finally:
        store.close()


# ------------------------------------------------------------------------------------------ access
def test_another_key_cannot_touch_a_session(served):
    sid = served.new(A)
    served.read(sid, "private", A)
    version = served.stats(sid)["version"]
    attempts = [
        ("post", f"/v1/sessions/{sid}/read", {"text": "intrusion"}),
        ("post", f"/v1/sessions/{sid}/generate", {"prompt": "x", "max_new_tokens": 2}),
        ("get", f"/v1/sessions/{sid}/stats", None),
        ("get", f"/v1/sessions/{sid}/snapshots", None),
        ("post", f"/v1/sessions/{sid}/freeze", None),
        ("post", f"/v1/sessions/{sid}/unfreeze", None),
        ("post", f"/v1/sessions/{sid}/rollback", {"snapshot": 1}),
        ("delete", f"/v1/sessions/{sid}", None),
    ]
    missing = "0" * 32
    for method, path, body in attempts:
        r = served.http.request(method, f"{served.url}{path}", headers=B, json=body)
        assert r.status_code == 404, (path, r.text)  # as absent as a session that does not exist:
        other = served.http.request(method, f"{served.url}{path.replace(sid, missing)}", headers=B, json=body)
        assert (other.status_code, other.json()["detail"]) == (404, r.json()["detail"].replace(sid, missing))
    for method, path, body in attempts[::4]:
        for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": f"Basic {KEY_A}"}):
            r = served.http.request(method, f"{served.url}{path}", headers=headers, json=body)
            assert r.status_code == 401, (path, headers, r.text)
    assert served.stats(sid)["version"] == version  # untouched
    # only hashes are kept: the store holds no key
    record = served.store.get(sid)
    assert record.owner == hash_key(KEY_A) and KEY_A.encode() not in record.data


# ------------------------------------------------------------------------------------------ bad requests
def test_bad_requests_get_a_clear_4xx_and_change_nothing(served):
    sid = served.new()
    served.read(sid, DOC)
    before = served.stats(sid)
    url = f"{served.url}/v1/sessions/{sid}"
    cases = [
        # (what, response, status, words in the detail)
        (
            "malformed JSON",
            served.http.post(f"{url}/read", headers=A, content=b'{"text": "abc'),
            422,
            "not valid JSON",
        ),
        ("not an object", served.http.post(f"{url}/read", headers=A, json=["abc"]), 422, "malformed"),
        ("a field missing", served.http.post(f"{url}/read", headers=A, json={}), 422, "text: Field required"),
        (
            "an unknown field",
            served.http.post(f"{url}/read", headers=A, json={"text": "a", "x": 1}),
            422,
            "x: Extra",
        ),
        ("a wrong type", served.http.post(f"{url}/read", headers=A, json={"text": 3}), 422, "text:"),
        (
            "empty text",
            served.http.post(f"{url}/read", headers=A, json={"text": ""}),
            422,
            "text: String should have at least 1 character",
        ),
        # a byte-level tokenizer and a model of 128 symbols: 'é' encodes to ids the model does not have
        (
            "ids out of range",
            served.http.post(f"{url}/read", headers=A, json={"text": "café"}),
            422,
            "token id 195",
        ),
        (
            "too many tokens",
            served.http.post(f"{url}/read", headers=A, json={"text": "a" * 601}),
            422,
            "at most 600",
        ),
        (
            "oversize body",
            served.http.post(f"{url}/read", headers=A, json={"text": "a" * 5000}),
            413,
            "4096 bytes",
        ),
        (
            "oversize streamed body",
            served.http.post(f"{url}/read", headers=A, content=iter([b'{"text": "', b"a" * 5000, b'"}'])),
            413,
            "4096 bytes",
        ),
        (
            "max_new_tokens over the limit",
            served.http.post(f"{url}/generate", headers=A, json={"prompt": "a", "max_new_tokens": 41}),
            422,
            "max_new_tokens: Input should be less than or equal to 40 (this server's limit, --max-new-tokens",
        ),
        (
            "bad sampling",
            served.http.post(
                f"{url}/generate", headers=A, json={"prompt": "a", "temperature": -1, "top_p": 2}
            ),
            422,
            "temperature",
        ),
        (
            "no such snapshot",
            served.http.post(f"{url}/rollback", headers=A, json={"snapshot": 3}),
            409,  # a valid request that the session's state cannot serve
            "no snapshot 3",
        ),
        (
            "snapshot 0 (k counts from 1)",
            served.http.post(f"{url}/rollback", headers=A, json={"snapshot": 0}),
            422,
            "snapshot",
        ),
        (
            "unknown session",
            served.http.post(f"{served.url}/v1/sessions/{'f' * 32}/read", headers=A, json={"text": "a"}),
            404,
            "no session",
        ),
        ("not a session id", served.http.get(f"{served.url}/v1/sessions/..%2Fetc/stats", headers=A), 404, ""),
        (
            "a 4,000-character id (not echoed back)",
            served.http.post(f"{served.url}/v1/sessions/{'a' * 4000}/read", headers=A, json={"text": "a"}),
            404,
            "no session with that id (a session id is 32 hex digits)",
        ),
    ]
    for what, r, status, words in cases + edge_cases(served, url):
        assert r.status_code == status, (what, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json", (what, r.headers)
        assert set(r.json()) == {"detail"} and words in r.json()["detail"], (what, r.text)
    after = served.stats(sid)
    assert after["version"] == before["version"] and after["state_sha256"] == before["state_sha256"]


def deeply_nested(send):
    """send() with the interpreter's recursion limit at Python's default (1000), which the 1,500 levels of
    `edge_cases`' body pass: a process that compiled with inductor has it at 2,000 (torch raises it), and
    the server thread shares it."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        return send()
    finally:
        sys.setrecursionlimit(limit)


def edge_cases(served: Served, url: str) -> list[tuple[str, httpx.Response, int, str]]:
    """Bodies at the edge of what JSON and Unicode allow, and values at the edge of their types: each a
    JSON 422 that names its problem."""
    post = served.http.post
    generate = f"{url}/generate"
    surrogate = "not valid Unicode text: it holds a lone surrogate"
    deep = b"[" * 1500 + b"]" * 1500  # within the body limit, past json's recursion limit
    return [
        # "\ud800" is valid JSON that decodes to a string UTF-8 cannot encode
        (
            "a lone surrogate (escape)",
            post(f"{url}/read", headers=A, content=b'{"text": "a\\ud800"}'),
            422,
            surrogate,
        ),
        (
            "a lone surrogate (bytes)",
            post(f"{url}/read", headers=A, content=b'{"text": "a\xed\xa0\x80"}'),
            422,
            surrogate,
        ),
        (
            "a lone surrogate in a prompt",
            post(generate, headers=A, content=b'{"prompt": "a\\ud800", "max_new_tokens": 1}'),
            422,
            "prompt: " + surrogate,
        ),
        (
            "not UTF-8",
            post(f"{url}/read", headers=A, content=b'{"text": "a\xff"}'),
            422,
            "not UTF-8 JSON (byte 0xff",
        ),
        (  # json.loads of bytes reads UTF-16 and UTF-32 too: the server reads UTF-8 only
            "UTF-16 JSON",
            post(f"{url}/read", headers=A, content=json.dumps({"text": "hi"}).encode("utf-16")),
            422,
            "not UTF-8 JSON (byte 0xff at byte 0)",
        ),
        (
            "UTF-16 JSON without a byte order mark",  # valid UTF-8 bytes (NULs), not JSON as UTF-8
            post(f"{url}/read", headers=A, content=json.dumps({"text": "hi"}).encode("utf-16-le")),
            422,
            "not valid JSON (Expecting property name enclosed in double quotes at character 1)",
        ),
        (
            "deeply nested",
            deeply_nested(lambda: post(f"{url}/read", headers=A, content=b'{"text": ' + deep + b"}")),
            422,
            "nested too deeply",
        ),
        (
            "NaN",
            post(generate, headers=A, content=b'{"prompt": "a", "temperature": NaN}'),
            422,
            "temperature:",
        ),
        (
            "Infinity",
            post(generate, headers=A, content=b'{"prompt": "a", "temperature": Infinity}'),
            422,
            "temperature:",
        ),
        (
            "temperature too high",
            post(generate, headers=A, json={"prompt": "a", "temperature": 1e300}),
            422,
            "temperature:",
        ),
        (
            "top_p below 0.001",
            post(generate, headers=A, json={"prompt": "a", "top_p": 1e-300}),
            422,
            "top_p: Input should be greater than or equal to 0.001",
        ),
        # strict types: an integer field takes integers only
        (
            "an int as a string",
            post(generate, headers=A, json={"prompt": "a", "max_new_tokens": "2"}),
            422,
            "max_new_tokens: Input should be a valid integer",
        ),
        (
            "an int as a bool",
            post(generate, headers=A, json={"prompt": "a", "max_new_tokens": True}),
            422,
            "max_new_tokens: Input should be a valid integer",
        ),
        (
            "an int as a float",
            post(generate, headers=A, json={"prompt": "a", "seed": 2.5}),
            422,
            "seed: Input should be a valid integer",
        ),
        (
            "a bool as a string",
            post(generate, headers=A, json={"prompt": "a", "greedy": "true"}),
            422,
            "greedy: Input should be a valid boolean",
        ),
        (
            "a snapshot as a string",
            post(f"{url}/rollback", headers=A, json={"snapshot": "1"}),
            422,
            "snapshot: Input should be a valid integer",
        ),
        (
            "empty prompt",
            post(generate, headers=A, json={"prompt": ""}),
            422,
            "prompt: String should have at least 1 character",
        ),
    ]


def test_a_bad_request_keeps_the_connection(served):
    """A refused request is answered in JSON on the same connection, which serves the next request."""
    import http.client

    conn = http.client.HTTPConnection(served.url.removeprefix("http://"), timeout=60)
    try:
        sid = served.new()
        for body in (b'{"text": "\\ud800"}', b'{"text": "\xed\xa0\x80"}', b'{"text": "\xff"}', b"[" * 1500):
            conn.request("POST", f"/v1/sessions/{sid}/read", body=body, headers=A)
            sock = conn.sock
            r = conn.getresponse()
            assert r.status == 422 and "detail" in json.loads(r.read()), body[:20]
            assert not r.will_close and conn.sock is sock  # kept alive
        conn.request("GET", f"/v1/sessions/{sid}/stats", headers=A)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["reads"] == 0 and conn.sock is sock
    finally:
        conn.close()


@SQLITE_ONLY
def test_tiny_sampling_values_stay_finite(served):
    """A temperature under 0.001 samples greedily (logits / 1e-39 would overflow float32): the text is the
    greedy one, whatever the seed."""
    sid = served.new()
    served.read(sid, DOC)
    texts = []
    for extra in ({"greedy": True}, {"temperature": 1e-39, "seed": 1}, {"temperature": 1e-300, "seed": 2}):
        body = {"prompt": "Who chased the whale? ", "max_new_tokens": 8, "stop_at_eos": False, **extra}
        r = served.post(f"/v1/sessions/{sid}/generate", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["text"])
        served.post(f"/v1/sessions/{sid}/rollback", json={"snapshot": 1})
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) == 8
    # the smallest top_p allowed keeps the most likely token: greedy as well
    body = {"prompt": "Who chased the whale? ", "max_new_tokens": 8, "stop_at_eos": False, "top_p": 0.001}
    r = served.post(f"/v1/sessions/{sid}/generate", json={**body, "temperature": 1.0, "seed": 3})
    assert r.status_code == 200 and r.json()["text"] == texts[0], r.text


def test_a_non_ascii_key_is_refused_clearly(served, tmp_path):
    from titans.serving.auth import load_api_keys

    for key in ("clé".encode(), b"key\x01"):
        r = served.http.post(f"{served.url}/v1/sessions", headers={"Authorization": b"Bearer " + key})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert "keys are printable ASCII" in r.json()["detail"] and "cl" not in r.json()["detail"]
    keys = tmp_path / "keys.txt"
    keys.write_text("fine-key\n  \nclé\n", encoding="utf-8")
    with pytest.raises(ValueError, match="the key on line 3 .* holds a non-ASCII character") as e:
        load_api_keys(keys)
    assert "clé" not in str(e.value)
    # a control or line-separator character inside a key split it into shorter keys that each worked
    # a lone "\r" too: read as text, universal newlines made it a line end ("gamma\rdelta": two keys)
    for inside, what in (
        ("\x1c", "a control character"),
        ("\x85", "a non-ASCII character"),
        ("\r", "a control"),
    ):
        keys.write_bytes(f"goodkey\r\nsecret{inside}part2\n".encode())
        with pytest.raises(ValueError, match=f"the key on line 2 .* holds {what}"):
            load_api_keys(keys)
    keys.write_bytes(b"goodkey\r\nother-key\r\n")  # Windows line ends stay line ends
    assert load_api_keys(keys) == {hash_key("goodkey"), hash_key("other-key")}


def test_a_record_with_a_damaged_field_is_a_409(served):
    """A stored version that is not an integer (a record another program wrote) is refused like other damage,
    and DELETE still removes it."""
    for bad in ("x", 2.5):  # 2.5 was read as 2: every later write a version conflict ("changed 20 times")
        sid = served.new()
        if isinstance(served.store, SQLiteStore):
            served.store._run("UPDATE sessions SET version = ? WHERE id = ?", (bad, sid))
        else:
            served.store.client.hset(served.store.prefix + sid, "version", str(bad))
        for method, path, body in [("post", "read", {"text": "more"}), ("get", "stats", None)]:
            r = served.http.request(method, f"{served.url}/v1/sessions/{sid}/{path}", headers=A, json=body)
            assert r.status_code == 409, r.text
            assert f"stored record of session {sid} is damaged" in r.json()["detail"], r.text
        assert served.http.delete(f"{served.url}/v1/sessions/{sid}", headers=A).status_code == 200


def test_a_corrupted_stored_state_is_refused_and_reported(served, caplog):
    damaged, fine = served.new(), served.new()
    served.read(damaged, DOC)
    served.read(fine, DOC)
    record = served.store.get(damaged)
    flipped = bytearray(record.data)
    flipped[len(flipped) // 2] ^= 0x01  # one bit in the middle of a tensor

    def damage_a_part() -> bytes:  # as a failing disk would: one bit of a stored state flips
        store, part = served.store, max(record.parts, key=lambda d: len(parts[d]))
        bad = bytearray(parts[part])
        bad[len(bad) // 2] ^= 0x01
        if isinstance(store, SQLiteStore):
            store._run("UPDATE parts SET data = ? WHERE sid = ? AND digest = ?", (bytes(bad), damaged, part))
        else:
            store.client.hset(store.prefix + "parts:" + damaged, part, bytes(bad))
        return served.store.get(damaged).data

    def rewrite_whole() -> bytes:  # as another program would: damaged bytes with a matching checksum
        served.store.put(damaged, bytes(flipped), expected_version=served.store.get(damaged).version)
        assert served.store.get(damaged).intact
        return bytes(flipped)

    parts = {checksum(p): p for p in session_parts(record.data)}
    assert set(parts) == set(record.parts) and len(parts) > 2  # the states are parts of their own
    # bytes that no longer match the record's checksum, and bytes rewritten with a matching checksum
    # that the session's own checks refuse
    for damage in (damage_a_part, rewrite_whole):
        data = damage()
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="titans.serving"):
            for method, path, body in [
                ("post", "read", {"text": "more"}),
                ("get", "stats", None),
                ("post", "rollback", {"snapshot": 1}),
            ]:
                r = served.http.request(
                    method, f"{served.url}/v1/sessions/{damaged}/{path}", headers=A, json=body
                )
                assert r.status_code == 409, r.text
                assert f"stored state of session {damaged} is corrupted" in r.json()["detail"]
        assert any(damaged in rec.getMessage() and "corrupted" in rec.getMessage() for rec in caplog.records)
        assert served.store.get(damaged).data == data  # refused, not overwritten
        assert served.read(fine, "still fine")["tokens"] == len("still fine")  # the rest of the store works
    r = served.http.delete(f"{served.url}/v1/sessions/{damaged}", headers=A)
    assert r.status_code == 200 and served.store.get(damaged) is None


# ------------------------------------------------------------------------------------------ the rest
@SQLITE_ONLY
def test_the_api_is_described(served):
    """The schema is the API: every status a route answers is declared with the one error body, and the
    created session's id links to the routes that use it."""
    assert served.http.get(f"{served.url}/docs").status_code == 200
    schema = served.http.get(f"{served.url}/openapi.json").json()
    paths = schema["paths"]
    assert "HTTPValidationError" not in json.dumps(schema)  # 422 has the error body too
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path, methods in paths.items():
        for method, op in methods.items():
            declared = {int(s) for s in op["responses"] if s[0] in "45"}
            want = (
                {503} if path in ("/v1/ready",) else set() if path == "/v1/health" else {401, 422, 429, 503}
            )
            if "{sid}" in path:
                want |= {404} if method == "delete" else {404, 409}
            want |= {408, 413}  # a body too slow or too large: on every route, one without a body too
            assert want <= declared, (method, path, declared)
            for status in declared:
                body = op["responses"][str(status)]["content"]["application/json"]["schema"]
                assert body == error, (method, path, status, body)
    # a route without a body answers the limits all the same (a body sent to it is read)
    over = b"{" + b" " * (LIMITS.max_body_bytes + 1) + b"}"
    for method, path in (
        ("GET", "/v1/health"),
        ("POST", "/v1/sessions"),
        ("GET", f"/v1/sessions/{'0' * 32}/stats"),
    ):
        r = served.http.request(method, f"{served.url}{path}", headers=A, content=over)
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["detail"], (path, r.text)
    generate = paths["/v1/sessions/{sid}/generate"]["post"]["requestBody"]["content"]["application/json"]
    stream = paths["/v1/sessions/{sid}/generate/stream"]["post"]["requestBody"]["content"]["application/json"]
    assert stream["schema"] == generate["schema"]  # the same body, with the server's limit
    body = schema["components"]["schemas"][generate["schema"]["$ref"].rsplit("/", 1)[1]]["properties"]
    assert (
        body["max_new_tokens"]["maximum"] == LIMITS.max_new_tokens
        and body["top_p"]["anyOf"][0]["minimum"] == 1e-3
    )
    links = paths["/v1/sessions"]["post"]["responses"]["201"]["links"]
    ops = {op["operationId"] for path in paths.values() for op in path.values()}
    # every route that takes a session id (import makes a session from bytes instead)
    assert {link["operationId"] for link in links.values()} == ops - {
        "health",
        "ready",
        "create_session",
        "import_session",
    }
    assert all(link["parameters"] == {"sid": "$response.body#/id"} for link in links.values())


@SQLITE_ONLY
def test_health_and_ready_say_only_ok(served):
    for path in ("/v1/health", "/v1/ready"):
        r = served.http.get(f"{served.url}{path}")  # no key
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


def test_ready_waits_for_the_warm_up(engine, tmp_path, monkeypatch):
    """/v1/health answers at once; /v1/ready and the session routes answer 503 until the model's warm-up
    has run, and a failed warm-up leaves the server live but never ready."""
    import threading

    import titans.serving.app as app_module

    release, ran = threading.Event(), []

    def slow_warm_up(engine: Engine) -> None:
        release.wait(30)
        ran.append(True)

    store = SQLiteStore(tmp_path / "sessions.db")
    monkeypatch.setattr(app_module, "warm_up", slow_warm_up)
    app = create_app(engine, store, key_hashes=None, limits=LIMITS, workers=1)
    try:
        with ThreadServer(app, wait_for="/v1/health") as server, httpx.Client(timeout=60) as http:
            r = http.get(f"{server.url}/v1/ready")
            assert r.status_code == 503 and "warming up" in r.json()["detail"], r.text
            r = http.post(f"{server.url}/v1/sessions")
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            release.set()
            wait_healthy(server.url, 30)
            assert ran and http.post(f"{server.url}/v1/sessions").status_code == 201

        def broken(engine: Engine) -> None:
            raise RuntimeError(f"kernel build failed in {tmp_path}")

        monkeypatch.setattr(app_module, "warm_up", broken)
        app = create_app(engine, store, key_hashes=None, limits=LIMITS, workers=1)
        with ThreadServer(app, wait_for="/v1/health") as server, httpx.Client(timeout=60) as http:
            for _ in range(100):
                r = http.get(f"{server.url}/v1/ready")
                if "failed" in r.text:
                    break
                time.sleep(0.05)
            assert r.status_code == 503 and "failed its warm-up" in r.json()["detail"], r.text
            assert str(tmp_path) not in r.text
            assert http.get(f"{server.url}/v1/health").json() == {"status": "ok"}
    finally:
        store.close()


def test_a_store_error_answers_503_without_the_path(engine, tmp_path, caplog):
    """A locked SQLite file (another program holds its write lock past the busy timeout): 503 naming the
    store as unavailable, never its path; the path is in the server's log for the operator."""
    import sqlite3

    folder = tmp_path / "private-folder-name"
    store = SQLiteStore(folder / "sessions.db", busy_timeout_s=0.2)
    app = create_app(engine, store, key_hashes=None, limits=LIMITS, workers=1, model_name=str(tmp_path))
    blocker = None
    try:
        with ThreadServer(app) as server, httpx.Client(timeout=60) as http:
            sid = http.post(f"{server.url}/v1/sessions").json()["id"]
            blocker = sqlite3.connect(folder / "sessions.db", isolation_level=None)
            blocker.execute("BEGIN EXCLUSIVE")
            with caplog.at_level(logging.ERROR, logger="titans.serving"):
                for r in (
                    http.post(f"{server.url}/v1/sessions/{sid}/read", json={"text": "abc"}),
                    http.post(f"{server.url}/v1/sessions"),
                ):
                    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                    assert r.json() == {
                        "detail": "the session store is unavailable; nothing was changed, retry later"
                    }
            assert any("private-folder-name" in rec.getMessage() for rec in caplog.records)
            blocker.execute("ROLLBACK")
            assert http.post(f"{server.url}/v1/sessions/{sid}/read", json={"text": "abc"}).status_code == 200
            assert str(tmp_path) not in http.get(f"{server.url}/v1/health").text
    finally:
        if blocker is not None:
            blocker.close()
        store.close()


def test_stored_sessions_are_the_library_sessions_bytes(engine):
    """The store holds `MemorySession.to_bytes`: a session loaded and written again gives the same bytes
    (its states are not decoded and encoded again), and damage is refused by the session's own checks."""
    session = engine.new_session()
    session.read(engine.encode(DOC))
    session.read(engine.encode("more"))
    session.freeze()
    data = session.to_bytes()
    again = engine.load(data)
    assert isinstance(again, MemorySession) and again.frozen and again.snapshots == session.snapshots
    assert again.to_bytes() == data and again.state.position == len(engine.encode(DOC + "more"))
    for bad, words in [(data[:-5], "checksum"), (b"x" + data[1:], "magic"), (data[:20], "checksum")]:
        with pytest.raises(SessionFormatError, match=words):
            engine.load(bad)


def test_the_server_refuses_to_start_without_keys_on_a_public_host(tmp_path):
    from titans.cli import build_parser
    from titans.serving.auth import load_api_keys
    from titans.serving.cli import check_serve_args

    def args(*extra):
        return build_parser().parse_args(["serve", "--checkpoint", "x", *extra])

    with pytest.raises(ValueError, match="refusing to serve without API keys"):
        check_serve_args(args("--host", "0.0.0.0"))
    check_serve_args(args("--host", "0.0.0.0", "--no-auth"))  # said explicitly
    check_serve_args(args("--host", "127.0.0.1"))  # loopback: only this machine
    check_serve_args(args("--host", "::1"))
    with pytest.raises(ValueError, match="guard-max-rise"):
        check_serve_args(args("--guard-max-rise", "-0.1"))
    with pytest.raises(ValueError, match="contradict"):
        check_serve_args(args("--no-auth", "--api-keys", "k"))
    keys = tmp_path / "keys.txt"
    keys.write_text("  alpha \n\nbeta\n")
    assert load_api_keys(keys) == {hash_key("alpha"), hash_key("beta")}
    keys.write_text("\n \n")
    with pytest.raises(ValueError, match="holds no keys"):
        load_api_keys(keys)


def test_store_urls_are_logged_without_their_password():
    from titans.serving.errors import redact, redact_url

    assert redact_url("redis://:hunter2@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert redact_url("rediss://user:hunter2@host/1") == "rediss://user:***@host/1"
    assert (
        redact_url("unix:///run/redis.sock?db=0&password=hunter2")
        == "unix:///run/redis.sock?db=0&password=***"
    )
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"  # nothing to hide
    assert redact_url("sqlite:///sessions.db") == "sqlite:///sessions.db"
    line = "cannot reach the session store unix://:hunter2@/tmp/r.sock?db=0: Error 111; redis://u:p@h/0"
    assert (
        redact(line)
        == "cannot reach the session store unix://:***@/tmp/r.sock?db=0: Error 111; redis://u:***@h/0"
    )
    assert "hunter2" not in redact("rediss://h/0?db=1&Password=hunter2")


def test_a_session_stored_by_a_server_of_other_weights_is_refused(checkpoint, tmp_path):
    """Two servers sharing a store with two checkpoints of one configuration: the second read the first's
    sessions (200) and went on from a memory written through other weights' projections, which it reads
    as noise. Each session records its server's weights: 409 on the other server, 422 on import."""
    model, tokenizer = load_trained(checkpoint)
    mine, other = "a" * 64, "b" * 64
    store = SQLiteStore(tmp_path / "shared.db")
    keys = frozenset({hash_key(KEY_A)})
    apps = [
        create_app(Engine(model, tokenizer, weights=w), store, key_hashes=keys, limits=LIMITS, workers=1)
        for w in (mine, other)
    ]
    try:
        with ThreadServer(apps[0]) as a, ThreadServer(apps[1]) as b, httpx.Client(timeout=60) as http:
            sid = http.post(f"{a.url}/v1/sessions", headers=A).json()["id"]
            assert (
                http.post(f"{a.url}/v1/sessions/{sid}/read", headers=A, json={"text": DOC}).status_code == 200
            )
            r = http.post(f"{b.url}/v1/sessions/{sid}/read", headers=A, json={"text": "more"})
            assert r.status_code == 409 and "stored by a server with other weights" in r.json()["detail"], (
                r.text
            )
            assert "aaaaaaaaaaaa..." in r.json()["detail"]
            data = http.get(f"{a.url}/v1/sessions/{sid}/export", headers=A).content
            r = http.post(f"{b.url}/v1/sessions/import", headers=A, content=data)
            assert r.status_code == 422 and "other weights" in r.json()["detail"], r.text
            assert store.get(sid).version == 2  # refused, not written
            # a session stored without weights (before they were recorded) loads, and takes the server's
            unrecorded = MemorySession(model).to_bytes()
            r = http.post(f"{b.url}/v1/sessions/import", headers=A, content=unrecorded)
            assert r.status_code == 201, r.text
            assert MemorySession.from_bytes(model, store.get(r.json()["id"]).data).weights == other
    finally:
        store.close()
