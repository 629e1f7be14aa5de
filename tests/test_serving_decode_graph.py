"""The server's generation through fixed state buffers (`titans serve --decode-graph`): a real uvicorn
server on loopback, a real HTTP client and SQLite store, against a server of the same weights that decodes
eagerly. The warm-up behind /v1/ready builds every phase's step (of the model and of its frozen twin), so
no request builds one; the generated text, and the state each server stores after it, agree."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")

import httpx  # noqa: E402
import torch  # noqa: E402

from serving_support import ThreadServer, make_checkpoint  # noqa: E402
from titans.inference.session import frozen_twin  # noqa: E402
from titans.models.state import state_tensors  # noqa: E402
from titans.runtime.loading import load_trained  # noqa: E402
from titans.serving.app import Limits, create_app  # noqa: E402
from titans.serving.session import Engine  # noqa: E402
from titans.serving.stores import SQLiteStore  # noqa: E402

DOC = "The whale was white. Ahab chased it across three oceans, for forty years, with one leg.\n"
PROMPT = "Who chased the whale? "


def _decoders(model) -> list:
    return [d for free in model.__dict__.get("_static_decoders", {}).values() for d in free]


def _serve_and_generate(checkpoint, folder, decode_graph):
    """Generate greedily through a fresh server (40 tokens: chunks of 8, segments of 16), freeze the session
    and sample (seeded); returns (the answers without the session id, the stored state)."""
    model, tokenizer = load_trained(checkpoint)
    engine = Engine(model, tokenizer, decode_graph=decode_graph)
    store = SQLiteStore(folder / "sessions.db")
    app = create_app(engine, store, key_hashes=None, limits=Limits(max_new_tokens=40), workers=2)
    phases = None
    try:
        with ThreadServer(app) as server, httpx.Client(timeout=60) as http:
            if decode_graph:  # the warm-up built every phase's step, writing and frozen
                phases = [set(d._steps) for m in (model, frozen_twin(model)) for d in _decoders(m)]
                assert phases == [
                    {(False, False), (True, False), (True, True)},
                    {(False, False), (False, True)},
                ]
            sid = http.post(f"{server.url}/v1/sessions").json()["id"]
            assert http.post(f"{server.url}/v1/sessions/{sid}/read", json={"text": DOC}).status_code == 200
            body = {"prompt": PROMPT, "max_new_tokens": 40, "greedy": True, "stop_at_eos": False}
            answers = [http.post(f"{server.url}/v1/sessions/{sid}/generate", json=body).json()]
            assert http.post(f"{server.url}/v1/sessions/{sid}/freeze").status_code == 200
            body = {**body, "greedy": False, "temperature": 1.0, "top_k": None, "seed": 5}  # varied tokens
            answers.append(http.post(f"{server.url}/v1/sessions/{sid}/generate", json=body).json())
            if decode_graph:  # the requests built no step: they ran the warm-up's
                assert [set(d._steps) for m in (model, frozen_twin(model)) for d in _decoders(m)] == phases
                assert all(d.version > 0 for m in (model, frozen_twin(model)) for d in _decoders(m))
            state = engine.load(store.get(sid).data).state
    finally:
        store.close()
    return [{k: v for k, v in a.items() if k != "id"} for a in answers], state


def test_server_generates_through_the_decode_graph_as_eagerly(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "run")
    (tmp_path / "eager").mkdir(), (tmp_path / "graph").mkdir()
    want, want_state = _serve_and_generate(checkpoint, tmp_path / "eager", None)
    got, got_state = _serve_and_generate(checkpoint, tmp_path / "graph", "eager")
    assert [a["new_tokens"] for a in got] == [40, 40]
    assert got == want  # the texts, counts and positions
    a, b = state_tensors(got_state), state_tensors(want_state)
    assert got_state.position == want_state.position and a.keys() == b.keys()
    for name, t in a.items():
        torch.testing.assert_close(t, b[name], rtol=1e-5, atol=1e-5, msg=name)


def test_serve_option_and_refusals(tmp_path):
    from titans.cli import build_parser
    from titans.serving.cli import build_app

    checkpoint = make_checkpoint(tmp_path / "run")
    args = build_parser().parse_args(
        [
            "serve",
            "--checkpoint",
            str(checkpoint),
            "--store",
            f"sqlite:///{tmp_path / 's.db'}",
            "--decode-graph",
        ]
    )
    assert args.decode_graph == "compile"
    app, store = build_app(args)
    store.close()
    model, tokenizer = load_trained(checkpoint)
    with pytest.raises(ValueError, match="needs a CUDA model"):
        Engine(model, tokenizer, decode_graph="cuda_graph")
    with pytest.raises(ValueError, match="decode_graph must be None or one of"):
        Engine(model, tokenizer, decode_graph="graph")
