"""Reading a request: headers of interest, the body under a byte limit, strict JSON.

The body limit is enforced while reading: a declared ``Content-Length`` over the limit is
refused before a byte of the body is read, and a chunked upload is refused at the first
chunk that crosses it, so a client can never make the gateway buffer more than the limit.
JSON is parsed with orjson (strict: no NaN, valid UTF-8 only) and its nesting depth checked
without recursion, so a hostile document cannot exhaust the stack.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Receive

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.json_bounds import SCAN_FROM_BYTES, check_structure

REQUEST_ID_PATTERN = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass(slots=True)
class RequestHeaders:
    """The few request headers the gateway acts on, found in one pass over the list."""

    authorization: bytes | None = None
    content_length: int | None = None
    request_id: str | None = None
    priority: bytes | None = None
    request_timeout: bytes | None = None
    session_id: bytes | None = None
    traceparent: bytes | None = None


_HEADER_FIELDS = {
    b"authorization": "authorization",
    b"x-request-id": "request_id",
    b"x-priority": "priority",
    b"x-request-timeout": "request_timeout",
    b"x-session-id": "session_id",
    b"traceparent": "traceparent",
}


def read_headers(raw_headers: list[tuple[bytes, bytes]]) -> RequestHeaders:
    """Pick out the headers of interest; an invalid ``x-request-id`` is replaced, not refused."""
    found = RequestHeaders()
    for name, value in raw_headers:
        if name == b"content-length":
            found.content_length = int(value) if value.isdigit() else -1
            continue
        attr = _HEADER_FIELDS.get(name)
        if attr is None:
            continue
        if attr == "request_id":
            if REQUEST_ID_PATTERN.match(value):
                found.request_id = value.decode()
        else:
            setattr(found, attr, value)
    if found.request_id is None:
        found.request_id = os.urandom(12).hex()
    return found


async def read_body(receive: Receive, declared_length: int | None, limit: int) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to exceed ``limit`` bytes."""
    if declared_length is not None and declared_length > limit:
        raise _too_large(f"declares {declared_length} bytes", limit)
    if declared_length == -1:
        raise InvalidRequest("Content-Length is not a number", code="invalid_header")
    message = await receive()
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
            raise InvalidRequest("client disconnected while sending the body", code="client_disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(f"exceeded {limit} bytes while being read", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body {what}; the limit is {limit} bytes.")


def parse_json_object(
    raw: bytes, max_depth: int, max_containers: int = 16_384, max_keys: int = 16_384
) -> dict[str, Any]:
    """Strict JSON to a dict; 400 on a syntax error, a non-object, or nesting over ``max_depth``.

    A large body's depth, containers and keys are checked on its bytes before it is parsed
    (``gateway/json_bounds.py``), so that a hostile one is refused before it costs a parse."""
    if not raw:
        raise InvalidRequest("Request body is empty; expected a JSON object.", code="invalid_json")
    scanned = len(raw) >= SCAN_FROM_BYTES
    if scanned:
        check_structure(raw, max_depth=max_depth, max_containers=max_containers, max_keys=max_keys)
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc):  # orjson's nesting limit (1024)
            raise _too_deep(max_depth) from exc
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(document, dict):
        raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
    if not scanned and _depth_exceeds(document, max_depth):
        raise _too_deep(max_depth)
    return document


def _too_deep(max_depth: int) -> InvalidRequest:
    return InvalidRequest(f"Request JSON is nested deeper than {max_depth} levels.", code="too_deep")


def _depth_exceeds(document: Any, max_depth: int) -> bool:
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False
