"""What the server says when it refuses a request, and what it never says.

Every error answer has one shape, ``{"detail": "..."}`` (a sentence naming the problem; its HTTP schema
is `titans.serving.app.ErrorBody`), whatever the status; what each status means is here. Nothing secret or
internal reaches a client: a store's URL and its password, file paths and exception texts stay in the
server's log (store URLs there with their password replaced by ``***``, `redact`).
"""

from __future__ import annotations

import re

# Plain Python (no serve extra): `titans serve --help` and its option checks import this module too.


class ApiError(Exception):
    """A refused request: `status` and the `detail` the client gets."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers

    def __reduce__(self):  # pickled whole: it crosses from a worker process (titans.serving.workers)
        return type(self), (self.status, self.detail, self.headers)


# What each status means on this API (the OpenAPI descriptions of the error answers).
STATUS_MEANINGS: dict[int, str] = {
    401: "no API key, an unknown one, or one that is not printable ASCII",
    404: "no such session (another key's session is as absent as a missing one)",
    408: "the request body did not arrive within the server's time (--body-timeout); the connection is "
    "closed",
    409: "the stored state of the session is damaged or of another model, it was changed by other servers "
    "too often while this request was applied, or it has no such snapshot; nothing was changed",
    413: "the request body is over the server's limit (--max-body-bytes; --max-import-bytes for an import)",
    422: "a malformed request: not UTF-8 JSON, too deeply nested, a field missing, of the wrong type or out "
    "of range, a text that is not valid Unicode, over the token limit or with symbols the model cannot read, "
    "or imported bytes that are not a session of this server's model",
    429: "this key is over one of its limits (sessions, stored bytes, concurrent work): retry after the "
    "Retry-After header's seconds",
    503: "the session store cannot be reached, or the model is not ready yet (see /v1/ready)",
}

_SECRET_QUERY = {"password", "pass", "pwd", "secret", "token", "access_token", "key", "api_key"}
# scheme://user:password@host... anywhere in a text (a log line, an exception's message)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/?#@:]*):(?P<pw>[^\s/?#@]*)@")
_QUERY_SECRET = re.compile(
    r"(?P<key>[?&](?:" + "|".join(sorted(_SECRET_QUERY)) + r")=)(?P<value>[^&#\s]*)", re.I
)


def redact_url(url: str) -> str:
    """`url` with its password, and any secret query parameter (``?password=...``), replaced by ``***``:
    ``redis://:hunter2@host:6379/0`` -> ``redis://:***@host:6379/0``. What the server logs of a store.
    (A password holding ``@``, ``/`` or ``?`` is percent-encoded in a valid URL.)"""
    return redact(url)


def redact(text: str) -> str:
    """`text` with the password of every URL in it replaced by ``***`` (for log lines that quote a URL,
    such as a store's error)."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}***", text)


__all__ = ["ApiError", "STATUS_MEANINGS", "redact", "redact_url"]
