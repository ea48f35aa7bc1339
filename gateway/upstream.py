"""The upstream client: one pooled httpx client, per-phase timeouts, error translation.

httpx is the API; the transport underneath is aiohttp's (``httpx-aiohttp``), which costs a
third of httpcore's CPU per request on this workload (see pyproject). Requests go straight to
the transport as ``httpx.Request`` objects: the ``AsyncClient`` layer above it (URL merging,
cookie jar, auth and redirect hooks) costs a fifth of the gateway's CPU per request and its
cookie jar would even share one backend's cookies across tenants. The client is kept for
health checks and metric scrapes, where none of that matters. Client credentials
never go upstream: the request carries only the backend's own credential (read from the
environment variable the policy names) plus the gateway's request id.

``map_upstream_errors`` is the single place where httpx exceptions become gateway errors,
so that every caller sees only ``UpstreamError`` (502) and ``UpstreamTimeout`` (504).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import httpx
from httpx_aiohttp import AiohttpTransport

from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from gateway.policy.model import Backend
from gateway.types import Api


class TraceContext(Protocol):
    """Whatever propagates a trace to the backend (``gateway.tracing.AttemptSpan``)."""

    def inject_into(self, headers: list[tuple[bytes, bytes]]) -> None: ...


class MissingCredential(Exception):
    """A backend names a credential environment variable that is not set."""


@contextmanager
def map_upstream_errors(backend: str) -> Iterator[None]:
    """Translate transport failures talking to ``backend`` into gateway errors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        if exc.__cause__ is not None and not isinstance(exc.__cause__, TimeoutError):
            # httpx-aiohttp maps every aiohttp.ClientConnectionError (refused, reset) to
            # ConnectTimeout; only a real timeout underneath is one.
            raise UpstreamError(
                f"Backend '{backend}' failed: {type(exc.__cause__).__name__}.", code="upstream_connect_error"
            ) from exc
        raise UpstreamTimeout(f"Backend '{backend}' timed out ({type(exc).__name__}).") from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(
            f"Backend '{backend}' failed: {type(exc).__name__}.", code="upstream_connect_error"
        ) from exc
    except OSError as exc:
        raise UpstreamError(f"Backend '{backend}' failed: {exc.strerror or exc}.") from exc


@dataclass(frozen=True, slots=True)
class UpstreamTargets:
    """What requests to each backend carry: headers (its credential), timeouts, URL per API."""

    headers: Mapping[str, list[tuple[bytes, bytes]]]
    timeouts: Mapping[str, dict[str, float | None]]
    urls: Mapping[tuple[str, Api], httpx.URL]


class UpstreamClient:
    """Sends requests to backends over one connection pool shared by all of them."""

    def __init__(self, backends: Mapping[str, Backend], *, max_connections: int = 1000) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._transport = AiohttpTransport(limits=limits)
        self._client = httpx.AsyncClient(transport=self._transport, timeout=None)
        self._headers: dict[str, list[tuple[bytes, bytes]]] = {}
        self._timeouts: dict[str, dict[str, float | None]] = {}
        self._urls: dict[tuple[str, Api], httpx.URL] = {}
        self.configure(backends)

    def configure(self, backends: Mapping[str, Backend]) -> None:
        """Resolve each backend's credential and timeouts now; raise if a credential is missing."""
        self.install(self.prepare(backends))

    @staticmethod
    def prepare(backends: Mapping[str, Backend]) -> UpstreamTargets:
        """Each backend's headers (its credential), timeouts and URLs; raise ``MissingCredential``.

        Changes nothing: a reload prepares first and installs only when every part of it could
        be built (``gateway/runtime.py``)."""
        headers: dict[str, list[tuple[bytes, bytes]]] = {}
        timeouts: dict[str, dict[str, float | None]] = {}
        urls: dict[tuple[str, Api], httpx.URL] = {}
        for name, backend in backends.items():
            base = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
            if backend.credential_env:
                secret = os.environ.get(backend.credential_env)
                if not secret:
                    raise MissingCredential(
                        f"backend '{name}': environment variable {backend.credential_env} is not set"
                    )
                base.append((b"authorization", f"Bearer {secret}".encode()))
            headers[name] = base
            t = backend.timeouts
            timeouts[name] = {"connect": t.connect_s, "read": t.first_byte_s, "write": t.connect_s, "pool": None}
            for api in Api:
                urls[(name, api)] = httpx.URL(backend.url + api.value)
        return UpstreamTargets(headers, timeouts, urls)

    def install(self, targets: UpstreamTargets) -> None:
        """Use ``targets`` from now on.

        Merged, not replaced: a request granted a backend that a reload just removed still
        finds its credential and URL (removed backends are drained, not cut)."""
        self._headers = {**self._headers, **targets.headers}
        self._timeouts = {**self._timeouts, **targets.timeouts}
        self._urls = {**self._urls, **targets.urls}

    @property
    def http(self) -> httpx.AsyncClient:
        """The shared client, for health checks and metric scrapes."""
        return self._client

    async def open(
        self,
        backend: Backend,
        api: Api,
        body: bytes,
        *,
        engine_request_id: str,
        trace: TraceContext | None = None,
    ) -> httpx.Response:
        """POST ``body`` to ``backend``'s ``api``; return once the response headers arrived (body unread).

        ``engine_request_id`` goes as ``x-request-id`` (the engine's id for this attempt, never
        the client's); ``trace`` adds the W3C ``traceparent`` of the attempt's span.
        """
        headers = [*self._headers[backend.name], (b"x-request-id", engine_request_id.encode())]
        if trace is not None:
            trace.inject_into(headers)
        outgoing = httpx.Request(
            "POST",
            self._urls[(backend.name, api)],
            headers=headers,
            content=body,
            extensions={"timeout": self._timeouts[backend.name]},
        )
        with map_upstream_errors(backend.name):
            return await self._transport.handle_async_request(outgoing)

    async def read_all(self, backend: Backend, response: httpx.Response) -> bytes:
        """The whole body as sent (``accept-encoding: identity``): raw chunks, no decoder layer."""
        try:
            with map_upstream_errors(backend.name):
                return b"".join([chunk async for chunk in response.aiter_raw()])
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()


def backend_error(backend: Backend, status: int, body: bytes) -> GatewayError:
    """The error to show a client when ``backend`` answered ``status`` instead of 200.

    A 4xx means the backend judged the request itself invalid, so the client gets the
    backend's status and message; anything else is the backend's failure: a 502.
    """
    message = _error_message(body) or f"HTTP {status}"
    if 400 <= status < 500 and status not in (404, 408, 429):
        error = GatewayError(message, code="upstream_rejected")
        error.status = status
        error.error_type = "invalid_request_error"
        return error
    return UpstreamError(f"Backend '{backend.name}' answered {status}: {message}", code="upstream_error")


def _error_message(body: bytes) -> str | None:
    import orjson

    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode(errors="replace") or None
    if isinstance(document, dict):
        inner = document.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(document.get("message"), str):
            return str(document["message"])
        if isinstance(inner, str):
            return inner
    return None
