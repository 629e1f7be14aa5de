"""The server's OpenAPI document is its API: schemathesis (an OpenAPI fuzzer) generates requests from the
schema the running server publishes (boundary values, random valid and invalid bodies, and sequences that
follow its links: create a session, then use it) and checks every answer: no 5xx, no status the schema
does not declare, every body as its schema says, no schema-valid request refused.

A real uvicorn server on a loopback port with a tiny model (a byte vocabulary of 256, so that any text is
readable), a SQLite store and a key; the fuzzer's CLI in a process of its own, bounded in examples per
operation and in time.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("httpx", reason="the serve-test extra is not installed")
pytest.importorskip("schemathesis", reason="the serve-test extra (schemathesis) is not installed")

from serving_support import ThreadServer, make_checkpoint  # noqa: E402
from titans.runtime.loading import load_trained  # noqa: E402
from titans.serving.app import Limits, create_app  # noqa: E402
from titans.serving.auth import hash_key  # noqa: E402
from titans.serving.session import Engine  # noqa: E402
from titans.serving.stores import SQLiteStore  # noqa: E402

KEY = "fuzz-key"
SECONDS = 40  # the fuzzer's own budget; the phases share it

# The import route's body is a session in the library's binary format (a magic, a header, the tensors):
# its schema can say "bytes" but not "bytes of a session", so random bytes, valid for the schema, are a
# 422 there. That one status is accepted for that one route; every other check runs on it as on the rest.
CONFIG = """
[[operations]]
include-operation-id = "import_session"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "404", "409", "422", "429"]
"""


def test_the_server_keeps_the_contract_of_its_schema(tmp_path):
    model, tokenizer = load_trained(make_checkpoint(tmp_path / "run", vocab_size=256))
    engine = Engine(model, tokenizer, max_snapshots=2)
    store = SQLiteStore(tmp_path / "sessions.db")
    limits = Limits(max_body_bytes=1 << 16, max_tokens=4096, max_new_tokens=8)
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    app = create_app(engine, store, key_hashes=frozenset({hash_key(KEY)}), limits=limits, workers=1)
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",  # before the command: an option of schemathesis itself
        str(tmp_path / "schemathesis.toml"),
        "run",
        "--checks",
        "all",
        "--max-examples",
        "3",
        "--max-time",
        str(SECONDS),
        "--seed",
        "1",
        "--request-timeout",
        "30",
        "--no-color",
        "--header",
        f"Authorization: Bearer {KEY}",
    ]
    try:
        with ThreadServer(app) as server:
            run = subprocess.run(
                [*command, f"{server.url}/openapi.json"],
                capture_output=True,
                text=True,
                timeout=SECONDS + 60,
                cwd=tmp_path,  # its reports and caches
            )
    finally:
        store.close()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    # it did test: every operation, and sequences that follow the links from a created session
    assert "15 selected / 15 total" in out, out[-3000:]
    links = re.search(r"API Links:\s+(\d+) covered / (\d+) selected", out)
    assert links and int(links[1]) == int(links[2]) == 11, out[-3000:]
    generated = re.search(r"(\d+) generated", out)
    assert generated and int(generated[1]) >= 100, out[-3000:]
