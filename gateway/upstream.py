"""The upstream client: one pooled httpx client, per-phase timeouts, error translation.

httpx is the API; the transport underneath is aiohttp's (``httpx-aiohttp``), which costs a
third of httpcore's CPU per request on this workload (see pyproject). Requests go straight to
the transport as ``httpx.Request`` objects: the ``AsyncClient`` layer above it (URL merging,
cookie jar, auth and redirect hooks) costs a fifth of the gateway's CPU per request and its
cookie jar would even share one backend's cookies across tenants. The client is kept for
health checks and metric scrapes, where none of that matters. Client credentials
never go upstream: the request carries only the backend's own credential (read from the
environment variable the policy names), the engine request id and the trace context.

The engine request id: vLLM takes the incoming ``x-request-id`` as its own request id, and
duplicate ids (a client that reuses its ids, a retry or a migrated stream of one request)
have crashed some vLLM versions. So the client's id never goes upstream: every attempt sends
a fresh ``gw-`` + 96 random bits (``new_engine_request_id``), and the gateway writes both ids
together (a debug line per attempt, the warning line of a failure, the attempt's span).

``map_upstream_errors`` is the single place where httpx exceptions become gateway errors,
so that every caller sees only ``UpstreamError`` (502) and ``UpstreamTimeout`` (504).
A backend's own error answer becomes the gateway's error in ``error_for`` (the rule is in
``gateway/upstream_errors.py``): its body is read bounded in bytes and in time, and nothing
of it reaches the client but a sanitised excerpt of a rejection's JSON message.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from gateway.dialects.base import Dialect
from gateway.dialects.registry import DIALECTS
from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from gateway.policy.model import Backend
from gateway.retry import parse_retry_after
from gateway.upstream_errors import Redactor, UpstreamFault, answer_error, status_error

log = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error answer read at most: enough for any excerpt
FaultReport = Callable[[UpstreamFault], None]  # ``upstream_errors.FaultLog`` of the attempt


class TraceContext(Protocol):
    """Whatever propagates a trace to the backend and records the attempt (``gateway.tracing.AttemptSpan``)."""

    def inject_into(self, headers: list[tuple[bytes, bytes]]) -> None: ...

    def engine_request(self, engine_request_id: str) -> None: ...


def new_engine_request_id() -> str:
    """A fresh id for one attempt, sent to the engine as ``x-request-id`` (module docstring)."""
    return "gw-" + os.urandom(12).hex()


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
        # The class name only: an OS error's text can name hosts and certificates.
        raise UpstreamError(f"Backend '{backend}' failed: {type(exc).__name__}.") from exc


@dataclass(frozen=True, slots=True)
class UpstreamTargets:
    """What requests to each backend carry (headers with its credential, timeouts, URL per API path),
    and what error excerpts must hide (credentials, backend host names)."""

    headers: Mapping[str, list[tuple[bytes, bytes]]]
    timeouts: Mapping[str, dict[str, float | None]]
    urls: Mapping[tuple[str, str], httpx.URL]
    secrets: frozenset[str]
    hosts: frozenset[str]


class UpstreamClient:
    """Sends requests to backends over one connection pool shared by all of them."""

    def __init__(self, backends: Mapping[str, Backend], *, max_connections: int = 1000) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._transport = AiohttpTransport(limits=limits)
        self._client = httpx.AsyncClient(transport=self._transport, timeout=None)
        self._headers: dict[str, list[tuple[bytes, bytes]]] = {}
        self._timeouts: dict[str, dict[str, float | None]] = {}
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._secrets: frozenset[str] = frozenset()
        self._hosts: frozenset[str] = frozenset()
        self.redactor = Redactor()
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
        urls: dict[tuple[str, str], httpx.URL] = {}
        secrets: set[str] = set()
        hosts: set[str] = set()
        for name, backend in backends.items():
            base = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
            if backend.credential_env:
                secret = os.environ.get(backend.credential_env)
                if not secret:
                    raise MissingCredential(
                        f"backend '{name}': environment variable {backend.credential_env} is not set"
                    )
                base.append((b"authorization", f"Bearer {secret}".encode()))
                secrets.add(secret)
            url = httpx.URL(backend.url)
            hosts.update(part for part in (url.host, url.username) if part)
            if url.password:
                secrets.add(url.password)
            headers[name] = base
            t = backend.timeouts
            timeouts[name] = {"connect": t.connect_s, "read": t.first_byte_s, "write": t.connect_s, "pool": None}
            for path in DIALECTS:
                urls[(name, path)] = httpx.URL(backend.url + path)
        return UpstreamTargets(headers, timeouts, urls, frozenset(secrets), frozenset(hosts))

    def install(self, targets: UpstreamTargets) -> None:
        """Use ``targets`` from now on.

        Merged, not replaced: a request granted a backend that a reload just removed still
        finds its credential and URL (removed backends are drained, not cut), and the redactor
        keeps hiding a removed backend's secrets from error excerpts."""
        self._headers = {**self._headers, **targets.headers}
        self._timeouts = {**self._timeouts, **targets.timeouts}
        self._urls = {**self._urls, **targets.urls}
        self._secrets, self._hosts = self._secrets | targets.secrets, self._hosts | targets.hosts
        self.redactor = Redactor(self._secrets, self._hosts)

    @property
    def http(self) -> httpx.AsyncClient:
        """The shared client, for health checks and metric scrapes."""
        return self._client

    async def open(
        self,
        backend: Backend,
        api: Dialect,
        body: bytes,
        *,
        request_id: str,
        engine_request_id: str,
        trace: TraceContext | None = None,
    ) -> httpx.Response:
        """POST ``body`` to ``backend``'s ``api``; return once the response headers arrived (body unread).

        ``engine_request_id`` (``new_engine_request_id``, one per attempt) is the engine's
        ``x-request-id``, never the client's ``request_id`` (both are logged together);
        ``trace`` adds the W3C ``traceparent`` of the attempt's span (sampled requests only)
        and records the engine's id on it.
        """
        headers = [*self._headers[backend.name], (b"x-request-id", engine_request_id.encode())]
        if trace is not None:
            trace.inject_into(headers)
            trace.engine_request(engine_request_id)
        log.debug("request %s: attempt on backend %s is engine request %s", request_id, backend.name, engine_request_id)
        outgoing = httpx.Request(
            "POST",
            self._urls[(backend.name, api.path)],
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

    async def error_for(self, backend: Backend, response: httpx.Response, report: FaultReport) -> GatewayError:
        """The gateway's error for a non-200 answer; its status and an excerpt go to ``report`` only."""
        body = await read_error_body(response, time_limit_s=backend.timeouts.first_byte_s)
        retry_after_s = parse_retry_after(response.headers)
        error, fault = status_error(response.status_code, body, self.redactor, retry_after_s=retry_after_s)
        report(fault)
        return error

    def answer(self, body: bytes, report: FaultReport, api: Dialect) -> dict[str, Any]:
        """The JSON object of a whole 200 answer; raises the gateway's error when it is none.

        A 200 whose body is not an answer of ``api`` (an HTML page, an error object, an echo
        holding the gateway's credential) is the backend's failure, reported like an error answer.
        """
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            document = None
        problem = answer_error(body, document, self.redactor, api.is_answer)
        if problem is not None:
            error, fault = problem
            report(fault)
            raise error
        assert isinstance(document, dict)
        return document

    async def aclose(self) -> None:
        await self._client.aclose()


async def read_error_body(response: httpx.Response, *, time_limit_s: float, limit: int = ERROR_BODY_LIMIT) -> bytes:
    """At most ``limit`` bytes of an error answer, read within ``time_limit_s``; closes the response.

    Bounded both ways because the body is only read to be described: a backend that sends
    gigabytes, or one byte a minute, gets its status mapped on what arrived in time. A read
    that fails keeps what it had, too (the status is what counts).
    """
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(time_limit_s):
            async for chunk in response.aiter_raw():
                parts.append(chunk)
                size += len(chunk)
                if size >= limit:
                    break
    except (TimeoutError, httpx.HTTPError, OSError):
        pass
    finally:
        await response.aclose()
    return b"".join(parts)[:limit]
