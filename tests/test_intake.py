"""Reading a request: the body-size limit (declared, actual, chunked), strict JSON, request ids.

What the SDK cannot send (oversized, malformed and chunked bodies) goes over httpx or, where
even httpx would not do it (a body that never ends), over a raw socket.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.conftest import CHAT_MODEL, KEY_ACME, MAX_BODY_BYTES
from tests.fake_backend import FakeBackend

FRESH_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        document: dict[str, Any] = orjson.loads(self.body)["error"]
        return document


def connect(base_url: str) -> socket.socket:
    parts = urlsplit(base_url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=3)
    return sock


def request_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", f"Authorization: Bearer {KEY_ACME}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def read_response(sock: socket.socket) -> RawResponse:
    """Read one HTTP/1.1 response (Content-Length or chunked body) within the socket's timeout."""
    with sock.makefile("rb") as reader:
        try:
            status_line = reader.readline()
        except TimeoutError:
            status_line = b""
        if not status_line:
            pytest.fail("no response before the socket timeout: the gateway waited for the rest of the body")
        headers: dict[str, str] = {}
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(reader.readline().strip(), 16):
                body += reader.read(size)
                reader.readline()
        else:
            body = reader.read(int(headers["content-length"]))
    return RawResponse(int(status_line.split()[1]), headers, body)


def valid_chat(padding: int = 0) -> bytes:
    """A valid chat body, padded with an ignored field to reach a given size."""
    body: dict[str, Any] = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    if padding:
        body["user"] = "x" * padding
    return orjson.dumps(body)


# --- the body-size limit ------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_with_413_naming_the_limit(http: httpx.Client, backend: FakeBackend) -> None:
    response = http.post("/v1/chat/completions", content=valid_chat(padding=MAX_BODY_BYTES))
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert str(MAX_BODY_BYTES) in error["message"]
    assert backend.received == []


def test_a_body_exactly_at_the_limit_is_accepted(http: httpx.Client, backend: FakeBackend) -> None:
    overhead = len(valid_chat(padding=1)) - 1
    body = valid_chat(padding=MAX_BODY_BYTES - overhead)
    assert len(body) == MAX_BODY_BYTES
    assert http.post("/v1/chat/completions", content=body).status_code == 200


def test_a_declared_content_length_over_the_limit_is_refused_before_any_body_byte(
    gateway_url: str, backend: FakeBackend
) -> None:
    with connect(gateway_url) as sock:
        head = request_head("/v1/chat/completions", {"Content-Length": str(10 * MAX_BODY_BYTES)})
        sock.sendall(head)  # and not one byte of the body
        response = read_response(sock)
    assert response.status == 413
    assert str(MAX_BODY_BYTES) in response.error()["message"]
    assert "x-request-id" in response.headers
    assert backend.received == []


def test_a_chunked_upload_is_refused_at_the_first_chunk_over_the_limit(gateway_url: str, backend: FakeBackend) -> None:
    with connect(gateway_url) as sock:
        head = request_head("/v1/chat/completions", {"Transfer-Encoding": "chunked"})
        sock.sendall(head + chunk(b" " * (MAX_BODY_BYTES // 2)) + chunk(b" " * (MAX_BODY_BYTES // 2 + 1)))
        # The rest of the body (and its terminating zero-size chunk) is never sent, so an
        # answer now proves the gateway refused without waiting for the end of the body.
        response = read_response(sock)
    assert response.status == 413
    error = response.error()
    assert error["code"] == "request_too_large"
    assert str(MAX_BODY_BYTES) in error["message"]
    assert backend.received == []


def test_a_chunked_upload_under_the_limit_is_accepted(http: httpx.Client, backend: FakeBackend) -> None:
    body = valid_chat(padding=1000)

    def pieces() -> Iterator[bytes]:  # an iterator makes httpx send Transfer-Encoding: chunked
        for start in range(0, len(body), 100):
            yield body[start : start + 100]

    response = http.post("/v1/chat/completions", content=pieces())
    assert response.status_code == 200
    assert backend.received[-1].body["user"] == "x" * 1000


# --- strict JSON and hostile bodies ---------------------------------------------------------

MESSAGES = '"messages": [{"role": "user", "content": "Hi"}]'


def nested(levels: int) -> bytes:
    return b'{"model": "test/chat", "messages": [{"role": "user", "content": "Hi"}], "x": ' + (
        b"[" * levels + b"]" * levels + b"}"
    )


HOSTILE_BODIES = [
    pytest.param(b"", id="an empty body"),
    pytest.param(b"{", id="a truncated object"),
    pytest.param(b"\xff\xfe{}", id="invalid UTF-8"),
    pytest.param(b'{"model": "test/chat\xed\xa0\x80", ' + MESSAGES.encode() + b"}", id="a lone surrogate in UTF-8"),
    pytest.param(b'{"model": "test/chat", ' + MESSAGES.encode() + b', "max_tokens": NaN}', id="NaN as max_tokens"),
    pytest.param(b'{"model": "test/chat", ' + MESSAGES.encode() + b', "max_tokens": 1e999}', id="infinity"),
    pytest.param(
        b'{"model": "test/chat", ' + MESSAGES.encode() + b', "max_tokens": ' + b"9" * 400 + b"}",
        id="a 400-digit max_tokens",
    ),
    pytest.param(b'{"model": "test/chat", ' + MESSAGES.encode() + b', "n": -1}', id="a negative n"),
    pytest.param(b'{"model": "test/chat", ' + MESSAGES.encode() + b', "max_tokens": 8.5}', id="a float max_tokens"),
    pytest.param(b'{"model": "test/chat", ' + MESSAGES.encode() + b', "max_tokens": true}', id="a boolean max_tokens"),
    pytest.param(b"[" * 10000 + b"]" * 10000, id="10000 nested arrays"),
    pytest.param(b'{"a":' * 10000 + b"1" + b"}" * 10000, id="10000 nested objects"),
    pytest.param(nested(20), id="nesting over the policy depth inside a valid request"),
    pytest.param(b'{"model": "test/chat", "messages": [["user", "Hi"]]}', id="an array as a messages entry"),
    pytest.param(b'{"model": "test/chat", "messages": [null]}', id="null as a messages entry"),
    pytest.param(b'{"model": "test/chat", "messages": {"role": "user"}}', id="an object as messages"),
    pytest.param(b'{"model": "test/chat", "messages": []}', id="no messages"),
    pytest.param(b'{"model": null, ' + MESSAGES.encode() + b"}", id="a null model"),
    pytest.param(b'{"model": ["test/chat"], ' + MESSAGES.encode() + b"}", id="an array as model"),
    pytest.param(b'{"model": "", ' + MESSAGES.encode() + b"}", id="an empty model"),
    pytest.param(b"{" + MESSAGES.encode() + b"}", id="no model"),
    pytest.param(b'{"model": "' + b"m" * 5000 + b'", ' + MESSAGES.encode() + b"}", id="a 5000-character model"),
    pytest.param(b'{"model": "test/chat", "messages": [{"role": 1, "content": "Hi"}]}', id="a numeric role"),
    pytest.param(b'{"model": "test/chat", "messages": [{"role": "user", "content": 5}]}', id="a numeric content"),
    pytest.param(b'{"model": "test/chat", ' + MESSAGES.encode() + b', "stream": "yes"}', id="a string as stream"),
    pytest.param(
        b'{"model": "test/chat", ' + MESSAGES.encode() + b', "stream": true, "stream_options": []}',
        id="an array as stream_options",
    ),
    pytest.param(
        b'{"model": "test/chat", ' + MESSAGES.encode() + b', "stream": true, "stream_options": {"include_usage": 1}}',
        id="a number as include_usage",
    ),
    pytest.param(b'"just a string"', id="a JSON string"),
    pytest.param(b"null", id="JSON null"),
    pytest.param(b"12345", id="a JSON number"),
    pytest.param(b"[]", id="a JSON array"),
    pytest.param(b"{}{}", id="two objects back to back"),
    pytest.param(b'{"model": "test/chat", "model": 1, ' + MESSAGES.encode() + b"}", id="a duplicate key"),
    pytest.param(b"\x00\x01\x02", id="binary bytes"),
    pytest.param(b'{"model": "test/chat", ' + MESSAGES.encode() + b", // comment\n}", id="a JSON comment"),
]


@pytest.mark.parametrize("body", HOSTILE_BODIES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_hostile_body_gets_a_4xx_in_openai_shape_never_a_500_or_a_hang(
    http: httpx.Client, backend: FakeBackend, path: str, body: bytes
) -> None:
    response = http.post(path, content=body, headers={"content-type": "application/json"}, timeout=5)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert backend.received == []


INVALID_JSON = [
    pytest.param(b"", "invalid_json", "empty", id="an empty body is invalid JSON"),
    pytest.param(b'{"model": ', "invalid_json", "not valid JSON", id="a truncated body is invalid JSON"),
    pytest.param(b"\xff\xfe", "invalid_json", "not valid JSON", id="invalid UTF-8 is invalid JSON"),
    pytest.param(b'{"max_tokens": NaN}', "invalid_json", "not valid JSON", id="NaN is invalid JSON"),
    pytest.param(b"[1, 2]", "invalid_json", "must be a JSON object", id="an array is not an object"),
    pytest.param(b'"text"', "invalid_json", "must be a JSON object", id="a string is not an object"),
    pytest.param(nested(8), "too_deep", "deeper than 8 levels", id="nesting one level over the limit is too deep"),
    pytest.param(b"[" * 10000 + b"]" * 10000, "too_deep", "deeper than 8 levels", id="10000 levels are too deep"),
]


@pytest.mark.parametrize(("body", "code", "message"), INVALID_JSON)
def test_a_body_that_is_not_an_acceptable_json_object_is_a_400(
    http: httpx.Client, body: bytes, code: str, message: str
) -> None:
    response = http.post("/v1/chat/completions", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert message in error["message"]


def test_nesting_at_the_depth_limit_is_accepted(http: httpx.Client, backend: FakeBackend) -> None:
    # The object is level 1 and "x" adds 7 levels of arrays: 8 in all, the policy's limit.
    assert http.post("/v1/chat/completions", content=nested(7)).status_code == 200
    assert backend.received[-1].body["x"] == [[[[[[[]]]]]]]


# --- request ids ----------------------------------------------------------------------------


def test_a_valid_client_request_id_is_echoed_and_forwarded_upstream(http: httpx.Client, backend: FakeBackend) -> None:
    response = http.post("/v1/chat/completions", content=valid_chat(), headers={"x-request-id": "client-id.42:a_b"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-id.42:a_b"
    assert backend.received[-1].headers["x-request-id"] == "client-id.42:a_b"


@pytest.mark.parametrize(
    "request_id",
    [
        pytest.param("has spaces in it", id="an id with spaces is replaced"),
        pytest.param("x" * 200, id="a 200-character id is replaced"),
        pytest.param("semi;colon", id="an id with a semicolon is replaced"),
        pytest.param('quote"d', id="an id with a quote is replaced"),
    ],
)
def test_an_invalid_client_request_id_is_replaced_with_a_fresh_one(
    http: httpx.Client, backend: FakeBackend, request_id: str
) -> None:
    response = http.post("/v1/chat/completions", content=valid_chat(), headers={"x-request-id": request_id})
    assert response.status_code == 200
    fresh = response.headers["x-request-id"]
    assert fresh != request_id
    assert FRESH_ID.match(fresh)
    assert backend.received[-1].headers["x-request-id"] == fresh


def test_each_request_without_an_id_gets_a_different_fresh_one(http: httpx.Client, backend: FakeBackend) -> None:
    ids = {http.post("/v1/chat/completions", content=valid_chat()).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


EVERY_KIND_OF_RESPONSE = [
    pytest.param("POST", "/v1/chat/completions", valid_chat(), {}, 200, id="a completed chat carries a request id"),
    pytest.param("POST", "/v1/chat/completions", b"{", {}, 400, id="a 400 carries a request id"),
    pytest.param(
        "POST", "/v1/chat/completions", valid_chat(), {"authorization": ""}, 401, id="a 401 carries a request id"
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        b'{"model": "nope", ' + MESSAGES.encode() + b"}",
        {},
        404,
        id="an unknown model 404 carries a request id",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        valid_chat(padding=MAX_BODY_BYTES),
        {},
        413,
        id="a 413 carries a request id",
    ),
    pytest.param("GET", "/v1/chat/completions", None, {}, 405, id="a 405 carries a request id"),
    pytest.param("GET", "/v1/nothing-here", None, {}, 404, id="an unknown path 404 carries a request id"),
    pytest.param("GET", "/v1/models", None, {}, 200, id="the model list carries a request id"),
    pytest.param("GET", "/v1/models", None, {"authorization": ""}, 401, id="a model list 401 carries a request id"),
    pytest.param("GET", "/healthz", None, {}, 200, id="healthz carries a request id"),
    pytest.param("GET", "/readyz", None, {}, 200, id="readyz carries a request id"),
    pytest.param("GET", "/metrics", None, {}, 404, id="metrics, not served on the API listener, carry a request id"),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), EVERY_KIND_OF_RESPONSE)
def test_every_response_carries_a_request_id(
    http: httpx.Client,
    backend: FakeBackend,
    method: str,
    path: str,
    body: bytes | None,
    headers: dict[str, str],
    status: int,
) -> None:
    fresh = http.request(method, path, content=body, headers=headers)
    assert fresh.status_code == status
    assert FRESH_ID.match(fresh.headers.get("x-request-id", "")), f"no x-request-id on {fresh.status_code}"
    echoed = http.request(method, path, content=body, headers={**headers, "x-request-id": "mine-123"})
    assert echoed.status_code == status
    assert echoed.headers.get("x-request-id") == "mine-123"
