"""The client's side of one request: the response as it is sent, status line first.

Why a type of its own: whether the response has started decides what a failure can still
become (a JSON error with its own status before, an SSE error event after), and the
rate-limit headers admission adds must go on whichever response is sent. One object owns
those facts; the pipeline and the attempts only call ``start``, ``respond`` and ``fail``.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Send

from gateway.errors import GatewayError

Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
COMMON_HEADERS: Headers = [(b"x-content-type-options", b"nosniff")]


class ClientResponse:
    """Sends one response to the client; remembers whether it started and with what status."""

    __slots__ = ("extra_headers", "render", "request_id", "send", "started", "status")

    def __init__(
        self, send: Send, request_id: str, render: Callable[[GatewayError], bytes] = GatewayError.body
    ) -> None:
        self.send = send
        self.request_id = request_id
        self.render = render
        """The error body in the request's API's shape (``Dialect.error_body``)."""
        self.started = False
        self.status = 0
        self.extra_headers: Headers = []
        """Headers every response of this request carries (``x-ratelimit-*`` from admission)."""

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.status = status
        headers.append((b"x-request-id", self.request_id.encode()))
        headers.extend(COMMON_HEADERS)
        headers.extend(self.extra_headers)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def respond(self, status: int, body: bytes, headers: Headers) -> None:
        headers.append((b"content-length", str(len(body)).encode()))
        await self.start(status, headers)
        await self.send({"type": "http.response.body", "body": body})

    async def fail(self, error: GatewayError) -> None:
        """Render ``error`` as the whole response (the response must not have started)."""
        headers = [*JSON_HEADERS, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        if error.headers:
            self.extra_headers = [h for h in self.extra_headers if h[0].decode() not in error.headers]
        await self.respond(error.status, self.render(error), headers)
