"""Reading a request: headers of interest, the body under a byte limit, strict JSON.

The body limit is enforced while reading: a declared ``Content-Length`` over the limit is
refused before a byte of the body is read, and a chunked upload is refused at the first
chunk that crosses it, so a client can never make the gateway buffer more than the limit.
JSON is parsed with orjson (strict: no NaN, valid UTF-8 only) and its nesting depth checked
without recursion, so a hostile document cannot exhaust the stack.

Nothing is left for two readers to disagree on. A header the gateway acts on (the key, the
priority, the deadline, the session, the body's length and type) must come once: with two
``Authorization`` lines one component could read the first and another the last, so the
request is refused (400 ``duplicate_header``). The same holds for a key repeated in a JSON
object, at any depth (400 ``duplicate_key``): orjson keeps the last one, a lookup-by-scan
parser (simdjson's on-demand API) the first, a strict one refuses, so a backend could act on
another request than the one the gateway judged. A client that leaves before sending a byte of its body
is a disconnect (``ClientDisconnected``), not a malformed request.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Receive

from gateway.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from gateway.request.json_bounds import SCAN_FROM_BYTES, Scan, check_structure

REQUEST_ID_PATTERN = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass(slots=True)
class RequestHeaders:
    """The few request headers the gateway acts on, found in one pass over the list."""

    authorization: bytes | None = None
    api_key: bytes | None = None
    """``x-api-key``: the key as Anthropic's SDK sends it (``credential``)."""
    content_length: int | None = None
    request_id: str | None = None
    priority: bytes | None = None
    request_timeout: bytes | None = None
    session_id: bytes | None = None
    traceparent: bytes | None = None
    content_type: bytes | None = None
    duplicate: bytes | None = None
    """The first header of those the gateway acts on that came more than once."""


_HEADER_FIELDS = {
    b"authorization": "authorization",
    b"x-api-key": "api_key",
    b"x-request-id": "request_id",
    b"x-priority": "priority",
    b"x-request-timeout": "request_timeout",
    b"x-session-id": "session_id",
    b"traceparent": "traceparent",
    b"content-type": "content_type",
}
_SINGLE_HEADERS = frozenset(
    {b"authorization", b"x-api-key", b"x-priority", b"x-request-timeout", b"x-session-id", b"content-type"}
)


def read_headers(raw_headers: list[tuple[bytes, bytes]]) -> RequestHeaders:
    """Pick out the headers of interest; an invalid ``x-request-id`` is replaced, not refused.

    A repeated header that must come once is noted in ``duplicate`` (the first value is kept);
    ``check_headers`` refuses the request for it.
    """
    found = RequestHeaders()
    for name, value in raw_headers:
        if name == b"content-length":
            if found.content_length is not None:
                found.duplicate = found.duplicate or name
            found.content_length = int(value) if value.isdigit() else -1
            continue
        attr = _HEADER_FIELDS.get(name)
        if attr is None:
            continue
        if attr == "request_id":
            if REQUEST_ID_PATTERN.match(value):
                found.request_id = value.decode()
        elif name in _SINGLE_HEADERS and getattr(found, attr) is not None:
            found.duplicate = found.duplicate or name
        else:
            setattr(found, attr, value)
    if found.request_id is None:
        found.request_id = os.urandom(12).hex()
    return found


def check_headers(headers: RequestHeaders) -> None:
    """400 ``duplicate_header`` when a header the gateway acts on came more than once."""
    if headers.duplicate is not None:
        name = headers.duplicate.decode()
        raise InvalidRequest(
            f"The header '{name}' appears more than once; send it once.", code="duplicate_header", param=name
        )


def credential(headers: RequestHeaders) -> bytes | None:
    """The client's key as an ``Authorization`` value: the bearer header, or ``x-api-key`` (how
    Anthropic's SDK and the agents built on it send it). Both at once is a 400 unless they agree:
    a request must not name two tenants."""
    api_key = headers.api_key
    if api_key is None:
        return headers.authorization
    as_bearer = b"Bearer " + api_key.strip()
    if headers.authorization is not None and headers.authorization.strip() != as_bearer:
        raise InvalidRequest(
            "Send the API key once: 'Authorization: Bearer <key>' or 'x-api-key: <key>', not two different keys.",
            code="invalid_header",
            param="x-api-key",
        )
    return as_bearer


def require_json_content_type(headers: RequestHeaders) -> None:
    """415 unless the body is declared ``application/json`` (a ``charset`` must be UTF-8).

    Besides saying what the body is, this shuts the browser's simple requests out (CSRF): a
    cross-site form, or a ``fetch`` that skips the CORS preflight, can only send ``text/plain``,
    form or multipart bodies, so no page a user visits can make their browser post one here.
    (A browser never adds the bearer key on its own either; this is the second lock.)
    """
    value = headers.content_type
    if value is None:
        raise UnsupportedMediaType("Send the body as JSON with 'Content-Type: application/json'.")
    media_type, _, parameters = value.partition(b";")
    if media_type.strip().lower() != b"application/json":
        shown = media_type.strip()[:64].decode(errors="replace")
        raise UnsupportedMediaType(f"Content-Type '{shown}' is not supported; send 'application/json'.")
    for parameter in parameters.split(b";"):
        key, _, charset = parameter.partition(b"=")
        if key.strip().lower() == b"charset" and charset.strip().strip(b'"').lower() not in (b"utf-8", b"utf8"):
            raise UnsupportedMediaType("A JSON body must be UTF-8; send 'charset=utf-8' or no charset.")


async def read_body(receive: Receive, declared_length: int | None, limit: int) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to exceed ``limit`` bytes."""
    if declared_length is not None and declared_length > limit:
        raise _too_large(f"declares {declared_length} bytes", limit)
    if declared_length == -1:
        raise InvalidRequest("Content-Length is not a number", code="invalid_header")
    message = await receive()
    if message["type"] == "http.disconnect":  # gone, or cut by the body deadline (gateway/server/connections.py)
        raise ClientDisconnected()
    body: bytes = message.get("body", b"")
    if len(body) > limit:
        raise _too_large(f"exceeded {limit} bytes while being read", limit)
    if not message.get("more_body", False):
        return body
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(f"exceeded {limit} bytes while being read", limit)
        chunks.append(chunk)
    return b"".join(chunks)


class ClientDisconnected(Exception):
    """The client went away; nothing is sent back, the outcome is recorded as such."""


def _too_large(what: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body {what}; the limit is {limit} bytes.")


def parse_json_object(
    raw: bytes,
    max_depth: int,
    max_containers: int = 16_384,
    max_keys: int = 16_384,
    max_values: int | None = None,
) -> dict[str, Any]:
    """Strict JSON to a dict; 400 on a syntax error, a non-object, a duplicate key, or nesting
    over ``max_depth``.

    A large body's depth, containers and keys are checked on its bytes before it is parsed
    (``gateway/request/json_bounds.py``), so that a hostile one is refused before it costs a parse."""
    if not raw:
        raise InvalidRequest("Request body is empty; expected a JSON object.", code="invalid_json")
    scanned: Scan | None = None
    if len(raw) >= SCAN_FROM_BYTES:
        scanned = check_structure(
            raw, max_depth=max_depth, max_containers=max_containers, max_keys=max_keys, max_values=max_values
        )
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc):  # orjson's nesting limit (1024)
            raise _too_deep(max_depth) from exc
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(document, dict):
        raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
    if scanned is None and _depth_exceeds(document, max_depth):
        raise _too_deep(max_depth)
    if not _surely_unique(raw, document, scanned):
        raise _refuse_duplicate(raw)
    return document


def _too_deep(max_depth: int) -> InvalidRequest:
    return InvalidRequest(f"Request JSON is nested deeper than {max_depth} levels.", code="too_deep")


def _depth_exceeds(document: Any, max_depth: int) -> bool:
    """Nesting over ``max_depth``, without recursion. A long array of scalars (token ids, say)
    is classified by ``set(map(type, ...))`` at C speed rather than element by element."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if type(node) is dict else node
        if len(children) > _BULK and set(map(type, children)) <= _SCALARS:
            continue
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
    return False


_BULK = 32
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _surely_unique(raw: bytes, document: dict[str, Any], scanned: Scan | None) -> bool:
    """True when no object in ``raw`` held a repeated key, decided exactly at a cost that depends
    on the body's size alone (a few C passes over its bytes), whatever its shape.

    Parsing drops a repeated key's earlier members, never adds any, so the document
    re-serialised (compact) keeps every member of ``raw`` exactly when nothing was dropped:

    * when it equals ``raw`` byte for byte, nothing was (the common case: the OpenAI SDKs and
      ``JSON.stringify`` send compact JSON, which is what orjson writes back);
    * otherwise count ``:``. Outside strings JSON has one only between a key and its value;
      inside, a literal ``:`` or the escape ``\\u003a``. The re-serialisation writes every
      member's ``:`` and every string's colons literally, so without a dropped member it has
      exactly the ``:`` of ``raw`` plus its colon escapes, and a dropped member takes at least its
      own ``:`` away. The escapes are counted exactly: by the structure scan of a large body
      (``gateway/request/json_bounds.py``, which counts every ``:`` in the same pass), by
      ``_colon_escapes`` for a small one.

    Exactness is what keeps the cost flat: a count that could be wrong had to be settled by a
    second, hooked parse (``json.loads``, 16 ms of CPU for a 900 KiB body), which any tenant
    could force with one escaped backslash in a spaced body, raising another tenant's P99 fivefold.
    """
    try:
        compact = orjson.dumps(document)
    except orjson.JSONEncodeError:  # nested past orjson's writer (254 levels): decide exactly
        return _slowly_unique(raw)
    if compact == raw:
        return True
    if scanned is not None:
        return compact.count(b":") == scanned.colons + scanned.colon_escapes
    return compact.count(b":") == raw.count(b":") + _colon_escapes(raw)


def _colon_escapes(raw: bytes) -> int:
    """How many ``\\u003a`` escapes (either case) the strings of a small ``raw`` hold, exactly: escaped
    backslashes are removed first, as a JSON reader consumes them (``\\\\u003a`` is a backslash
    and the text ``u003a``); every backslash left starts an escape."""
    if b"\\u003" not in raw:
        return 0
    if b"\\\\" in raw:
        raw = raw.replace(b"\\\\", b"")
    return raw.count(b"\\u003a") + raw.count(b"\\u003A")


def _slowly_unique(raw: bytes) -> bool:
    """The exact parse, for what orjson cannot write back (nesting past 254 levels)."""
    try:
        _refuse_duplicate_keys(raw)
    except InvalidRequest as error:
        if error.code == "duplicate_key":
            return False
        raise
    return True


NAME_DUPLICATE_UP_TO_BYTES = SCAN_FROM_BYTES
"""A body up to this size has its repeated key named in the error (one more, hooked, parse: about
20 us a KiB); a larger one is refused without the name, so that no body shape costs more than another."""


def _refuse_duplicate(raw: bytes) -> InvalidRequest:
    """400 ``duplicate_key``, naming the key when the body is small enough to find it cheaply."""
    if len(raw) <= NAME_DUPLICATE_UP_TO_BYTES:
        _refuse_duplicate_keys(raw)
    return InvalidRequest(
        "An object of the request body holds the same key twice; send each key once.", code="duplicate_key"
    )


def _refuse_duplicate_keys(raw: bytes) -> None:
    """400 ``duplicate_key`` naming the first repeated key; the exact (slow) path, rarely taken."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if key in seen:
                shown = key if len(key) <= 64 else key[:64] + "..."
                raise InvalidRequest(
                    f"The key '{shown}' appears twice in one object of the request body; send each key once.",
                    code="duplicate_key",
                )
            seen[key] = value
        return seen

    try:  # orjson accepted the text (numbers within a double's range): this parser should too
        json.loads(raw, object_pairs_hook=pairs)
    except ValueError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
