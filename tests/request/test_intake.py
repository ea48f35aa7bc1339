"""Reading a request: the body-size limit (declared, actual, chunked), strict JSON (no repeated
key), request ids, headers that must come once, the content type, and clients that leave.

What the SDK cannot send (oversized, malformed and chunked bodies) goes over httpx or, where
even httpx would not do it (a body that never ends), over a raw socket.
"""

from __future__ import annotations

import json
import random
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.request import intake
from gateway.request.intake import check_headers, parse_json_object, read_headers
from tests.conftest import CHAT_MODEL, KEY_ACME, KEY_GLOBEX, MAX_BODY_BYTES, BackendServer, StartGateway, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import wait_until

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
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: gateway",
        f"Authorization: Bearer {KEY_ACME}",
        "Content-Type: application/json",
    ]
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
    """A chat body whose ``guided_json`` (any JSON value) nests ``levels`` arrays."""
    return b'{"model": "test/chat", "messages": [{"role": "user", "content": "Hi"}], "guided_json": ' + (
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
    # The object is level 1 and "guided_json" adds 7 levels of arrays: 8 in all, the policy's limit.
    assert http.post("/v1/chat/completions", content=nested(7)).status_code == 200
    assert backend.received[-1].body["guided_json"] == [[[[[[[]]]]]]]


# --- request ids ----------------------------------------------------------------------------


def test_a_valid_client_request_id_is_echoed_and_never_sent_to_the_engine(
    http: httpx.Client, backend: FakeBackend
) -> None:
    response = http.post("/v1/chat/completions", content=valid_chat(), headers={"x-request-id": "client-id.42:a_b"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-id.42:a_b"
    assert backend.received[-1].headers["x-request-id"].startswith("gw-")  # tests/upstream/test_client.py


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
    assert backend.received[-1].headers["x-request-id"].startswith("gw-")


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


# --- duplicate JSON keys --------------------------------------------------------------------

CHAT_HEAD = b'{"model": "test/chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4'

DUPLICATE_KEYS = [
    pytest.param(CHAT_HEAD + b', "max_tokens": 8}', "max_tokens", id="a repeated top-level key"),
    pytest.param(
        b'{"model": "test/chat", "messages": [{"role": "user", "content": "Hi", "content": "Bye"}]}',
        "content",
        id="a repeated key inside a message",
    ),
    pytest.param(
        CHAT_HEAD + b', "response_format": {"type": "json_schema", "json_schema": {"name": "a", "name": "b"}}}',
        "name",
        id="a repeated key three objects deep",
    ),
    pytest.param(CHAT_HEAD + b', "mod\\u0065l": "test/other"}', "model", id="a key repeated under an escape"),
    pytest.param(
        CHAT_HEAD + b', "user": "time: 10:30", "user": "a:b:c"}', "user", id="a repeated key whose values hold colons"
    ),
    pytest.param(CHAT_HEAD + b', "user": "\\u003a", "user": "x"}', "user", id="a repeated key beside a colon escape"),
    pytest.param(
        b'{"model":"test/chat","messages":[{"role":"user","content":"Hi"}],"user":"a","user":"b"}',
        "user",
        id="a repeated key in compact JSON",
    ),
    pytest.param(CHAT_HEAD + b', "seed": 1' + b"0" * 300 + b', "seed": 2}', "seed", id="a repeat after a huge number"),
]


@pytest.mark.parametrize(("body", "key"), DUPLICATE_KEYS)
def test_a_key_repeated_anywhere_in_the_body_is_a_400_naming_it(
    http: httpx.Client, backend: FakeBackend, body: bytes, key: str
) -> None:
    response = http.post("/v1/chat/completions", content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "duplicate_key"
    assert f"'{key}'" in error["message"]
    assert backend.received == []


UNIQUE_KEYS = [
    pytest.param(CHAT_HEAD + b', "user": "a \\\\u003a b"}', id="an escaped backslash before u003a is text"),
    pytest.param(CHAT_HEAD + b', "user": "\\u003a\\u003A:"}', id="colon escapes in a value"),
    pytest.param(CHAT_HEAD + b', "user": "k:v", "guided_json": {"a:b": {"c": ":"}}}', id="colons in keys and values"),
    pytest.param(
        CHAT_HEAD + b', "guided_json": [{"a": 1}, {"a": 2}], "stop": ["x", "x"]}',
        id="the same key in sibling objects",
    ),
]


@pytest.mark.parametrize("body", UNIQUE_KEYS)
def test_a_body_without_a_repeated_key_passes_whatever_colons_it_holds(
    http: httpx.Client, backend: FakeBackend, body: bytes
) -> None:
    assert http.post("/v1/chat/completions", content=body).status_code == 200
    forwarded = {k: v for k, v in backend.received[-1].body.items() if k != "cache_salt"}
    assert forwarded == orjson.loads(body)


def random_json_text(rng: random.Random) -> tuple[bytes, bool]:
    """A random JSON object as text (random spacing, colons, escapes), and whether it repeats a key."""
    duplicated = False

    def text(depth: int) -> str:
        nonlocal duplicated
        roll = rng.random()
        if depth < 4 and roll < 0.3:
            keys = [rng.choice(["a", "b", "c:d", "\\u0061", "e\\u003af", "k"]) for _ in range(rng.randint(0, 5))]
            unique = {json.loads(f'"{key}"') for key in keys}
            duplicated = duplicated or len(unique) < len(keys)
            return "{" + ",".join(f'{space()}"{key}"{space()}:{space()}{text(depth + 1)}' for key in keys) + "}"
        if depth < 4 and roll < 0.5:
            return "[" + ",".join(text(depth + 1) for _ in range(rng.randint(0, 4))) + "]"
        if roll < 0.8:
            pieces = ["x", ":", "\\u003a", "\\u003A", "\\\\u003a", "\\\\", "\\u003c", " ", "\\n"]
            return '"' + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) + '"'
        return rng.choice(["1", "-2.5e3", "true", "null", "12345678901234567890"])

    def space() -> str:
        return rng.choice(["", "", " ", "\n  "])

    body = ""
    while not body.startswith("{"):
        duplicated = False
        body = text(0)
    return body.encode(), duplicated


def refuses_duplicate(raw: bytes) -> bool:
    try:
        parse_json_object(raw, max_depth=32)
    except InvalidRequest as error:
        return error.code == "duplicate_key"
    return False


def test_the_duplicate_check_agrees_with_an_exact_parser_on_random_documents() -> None:
    rng = random.Random(20240607)
    verdicts = {True: 0, False: 0}
    for _ in range(3000):
        raw, duplicated = random_json_text(rng)
        assert refuses_duplicate(raw) == duplicated, raw
        verdicts[duplicated] += 1
    assert min(verdicts.values()) > 300  # both kinds were drawn often


def large_document(text: str) -> dict[str, Any]:
    """About 200 KiB of chat: 100 messages of ``text`` repeated."""
    return {"model": "m", "messages": [{"role": "user", "content": text * (2000 // len(text))}] * 100}


SHAPES = [
    pytest.param(json.dumps(large_document("a \\u003a b: ")), id="spaced, an escaped backslash before u003a"),
    pytest.param(json.dumps(large_document("time@ 10:30 ")).replace("@", "\\u003a"), id="spaced, colon escapes"),
    pytest.param(json.dumps(large_document("caf\u00e9: ")), id="spaced, every non-ASCII character escaped"),
    pytest.param(json.dumps(large_document('\\\\: \\"q\\" ')), id="spaced, escaped backslashes and quotes"),
    pytest.param(json.dumps(large_document("x: "), indent=2), id="pretty-printed"),
]


@pytest.mark.parametrize("text", SHAPES)
def test_no_body_shape_forces_a_second_parse(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """The duplicate check costs the same C passes on every shape: the hooked parse (16 ms for a
    900 KiB body) runs for no body without a repeated key, however it is spaced or escaped."""

    def second_parse(raw: bytes) -> None:
        raise AssertionError("the hooked json parse ran")

    monkeypatch.setattr(intake, "_refuse_duplicate_keys", second_parse)
    raw = text.encode()
    assert parse_json_object(raw, max_depth=32) == json.loads(raw)


def test_a_large_body_with_a_repeated_key_is_refused_without_a_second_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    def second_parse(raw: bytes) -> None:
        raise AssertionError("the hooked json parse ran")

    monkeypatch.setattr(intake, "_refuse_duplicate_keys", second_parse)
    raw = json.dumps(large_document("a \\u003a b: "))[:-1].encode() + b', "model": "n"}'
    with pytest.raises(InvalidRequest) as refused:
        parse_json_object(raw, max_depth=32)
    assert refused.value.code == "duplicate_key"
    assert "same key twice" in refused.value.message


# --- headers that must come once, and the content type ----------------------------------------

DUPLICATE_HEADERS = [
    pytest.param("authorization", f"Bearer {KEY_ACME}", f"Bearer {KEY_GLOBEX}", id="two different keys"),
    pytest.param("authorization", f"Bearer {KEY_ACME}", f"Bearer {KEY_ACME}", id="the same key twice"),
    pytest.param("x-priority", "batch", "interactive", id="two priorities"),
    pytest.param("x-request-timeout", "5", "500", id="two deadlines"),
    pytest.param("x-session-id", "one", "two", id="two sessions"),
    pytest.param("content-type", "application/json", "application/json", id="two content types"),
]


@pytest.mark.parametrize(("name", "first", "second"), DUPLICATE_HEADERS)
def test_a_header_the_gateway_acts_on_sent_twice_is_a_400(
    gateway_url: str, backend: FakeBackend, name: str, first: str, second: str
) -> None:
    headers = [("authorization", f"Bearer {KEY_ACME}"), ("content-type", "application/json")]
    headers = [h for h in headers if h[0] != name] + [(name, first), (name, second)]
    response = httpx.post(gateway_url + "/v1/chat/completions", content=valid_chat(), headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("duplicate_header", name)
    assert backend.received == []


def test_a_repeated_content_length_is_noted_and_refused() -> None:
    # uvicorn's HTTP parsers refuse it before the gateway sees it; the gateway's own check stays.
    headers = read_headers([(b"content-length", b"10"), (b"content-length", b"10")])
    with pytest.raises(InvalidRequest) as refused:
        check_headers(headers)
    assert (refused.value.code, refused.value.param) == ("duplicate_header", "content-length")


CONTENT_TYPES = [
    pytest.param(None, 415, id="no content type is a 415"),
    pytest.param("text/plain", 415, id="text/plain (a browser's simple request) is a 415"),
    pytest.param("application/x-www-form-urlencoded", 415, id="a form (curl -d without -H) is a 415"),
    pytest.param("multipart/form-data; boundary=x", 415, id="multipart is a 415"),
    pytest.param("application/jsonl", 415, id="a lookalike type is a 415"),
    pytest.param("application/json; charset=latin-1", 415, id="JSON in another charset is a 415"),
    pytest.param("application/json", 200, id="application/json is accepted"),
    pytest.param("Application/JSON", 200, id="the type is case-insensitive"),
    pytest.param("application/json; charset=utf-8", 200, id="a utf-8 charset is accepted"),
    pytest.param('application/json;charset="UTF-8"', 200, id="a quoted UTF-8 charset is accepted"),
]


@pytest.mark.parametrize(("content_type", "status"), CONTENT_TYPES)
def test_inference_endpoints_take_json_bodies_only(
    gateway_url: str, backend: FakeBackend, content_type: str | None, status: int
) -> None:
    headers = {"authorization": f"Bearer {KEY_ACME}"}
    if content_type is not None:
        headers["content-type"] = content_type
    response = httpx.post(gateway_url + "/v1/chat/completions", content=valid_chat(), headers=headers)
    assert response.status_code == status, response.text
    if status == 415:
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_media_type")
        assert backend.received == []


def test_the_key_is_checked_before_the_content_type(gateway_url: str, backend: FakeBackend) -> None:
    response = httpx.post(
        gateway_url + "/v1/chat/completions", content=valid_chat(), headers={"content-type": "text/plain"}
    )
    assert response.status_code == 401


# --- a client that leaves while sending -------------------------------------------------------


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"", id="before the first body byte"),
        pytest.param(b'{"model": "test/ch', id="in the middle of the body"),
    ],
)
def test_a_client_that_leaves_while_sending_is_a_disconnect_not_invalid_json(
    gateway_url: str, backend: FakeBackend, sent: bytes
) -> None:
    before = {
        o: metric(gateway_url, "gateway_requests_total", outcome=o) for o in ("client_disconnected", "invalid_json")
    }
    with connect(gateway_url) as sock:
        sock.sendall(request_head("/v1/chat/completions", {"Content-Length": "100"}) + sent)
        sock.shutdown(socket.SHUT_WR)
    wait_until(
        lambda: (
            metric(gateway_url, "gateway_requests_total", outcome="client_disconnected")
            == before["client_disconnected"] + 1
        ),
        what="the disconnect to be recorded",
    )
    assert metric(gateway_url, "gateway_requests_total", outcome="invalid_json") == before["invalid_json"]
    assert backend.received == []


def test_a_body_of_more_numbers_than_any_prompt_needs_is_refused_before_parsing(
    start_gateway: StartGateway, backend_server: BackendServer, backend: FakeBackend
) -> None:
    """The test policy's largest prompt is 64 tokens: no list needs more than that plus the keys
    and containers the other bounds allow (32,832 values with ``max_json_values`` unset), so a
    body of 40,000 numbers is refused on its bytes, before it is parsed."""
    policy = session_policy(backend_server.url, limits={"max_body_bytes": 1_048_576})
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "logit_bias": [1] * 40_000}
    headers = {"authorization": f"Bearer {KEY_ACME}", "content-type": "application/json"}
    with start_gateway(policy, health_checks=False) as url:
        response = httpx.post(f"{url}/v1/chat/completions", content=orjson.dumps(body), headers=headers, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "too_complex"
    assert "the limit is 32832" in error["message"]
    assert backend.received == []
