"""The upstream client: one pooled connection set, per-phase timeouts, error translation.

Two clients, each where it fits:

* the data plane (``open``, the inference requests): ``gateway/upstream/wire.py``, a lean HTTP/1.1
  client made for this one job (pooled keep-alive connections, httptools parsing, one write per
  request, no timer operation per chunk). Measured in the same run (``loadtests/harness/minimal_proxy.py
  --client``, README "Hot path"), it costs less CPU per request than aiohttp's client called
  directly, which costs less than httpx's API over aiohttp's transport (``httpx-aiohttp``). It
  keeps no cookies (a backend's cookies must never be shared across tenants) and never
  decompresses (``accept-encoding: identity``; bytes pass through as sent).
* everything around it (health checks, metric scrapes): httpx over aiohttp's transport
  (``http``), where a request a second makes the API's comfort worth more than its cost.

Client credentials
never go upstream: the request carries only the backend's own credential (read from the
environment variable the policy names), the engine request id and the trace context.

The engine request id: vLLM takes the incoming ``x-request-id`` as its own request id, and
duplicate ids (a client that reuses its ids, a retry or a migrated stream of one request)
have crashed some vLLM versions. So the client's id never goes upstream: every attempt sends
a fresh ``gw-`` + 96 random bits (``new_engine_request_id``), and the gateway writes both ids
together (a debug line per attempt, the warning line of a failure, the attempt's span).

``map_upstream_errors`` is the single place where transport exceptions become gateway errors,
so that every caller sees only ``UpstreamError`` (502) and ``UpstreamTimeout`` (504).
A backend's own error answer becomes the gateway's error in ``error_for`` (the rule is in
``gateway/upstream/errors.py``): its body is read bounded in bytes and in time, and nothing
of it reaches the client but a sanitised excerpt of a rejection's JSON message.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
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
from gateway.upstream.errors import Redactor, UpstreamFault, answer_error, status_error
from gateway.upstream.retry import parse_retry_after
from gateway.upstream.wire import Connection, ConnectionFailed, ConnectionPool, Origin, head_prefix, request_head

log = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error answer read at most: enough for any excerpt
FaultReport = Callable[[UpstreamFault], None]  # ``upstream_errors.FaultLog`` of the attempt


class TraceContext(Protocol):
    """Whatever propagates a trace to the backend and records the attempt (``telemetry.tracing.AttemptSpan``)."""

    def inject(self, headers: MutableMapping[str, str]) -> None: ...

    def engine_request(self, engine_request_id: str) -> None: ...


def new_engine_request_id() -> str:
    """A fresh id for one attempt, sent to the engine as ``x-request-id`` (module docstring)."""
    return "gw-" + os.urandom(12).hex()


class MissingCredential(Exception):
    """A backend names a credential environment variable that is not set."""


@contextmanager
def map_upstream_errors(backend: str) -> Iterator[None]:
    """Translate transport failures talking to ``backend`` into gateway errors.

    Timeouts are ``UpstreamTimeout`` (504); a connect timeout keeps ``wire.ConnectTimeout`` as
    its cause, which says the request was never sent (``gateway/upstream/retry.py``). Every other failure
    of the connection (refused, reset, closed, a body cut short, an answer that is not HTTP) is
    ``UpstreamError`` with code ``upstream_connect_error``: the caller knows whether the headers
    had arrived, which decides whether it may be retried.
    """
    try:
        yield
    except TimeoutError as exc:  # wire.ConnectTimeout, wire.ReadTimeout
        raise UpstreamTimeout(f"Backend '{backend}' timed out ({type(exc).__name__}).") from exc
    except (ConnectionFailed, httpx.HTTPError) as exc:
        raise UpstreamError(f"Backend '{backend}' failed: {exc}.", code="upstream_connect_error") from exc
    except OSError as exc:
        # The class name only: an OS error's text can name hosts and certificates.
        raise UpstreamError(f"Backend '{backend}' failed: {type(exc).__name__}.") from exc


class UpstreamResponse:
    """One backend's answer as the data plane reads it: status and headers arrived, body unread.

    A thin face over a ``wire.Connection``: ``read_some`` returns the body as it arrives (as sent:
    no decoding), ``stream`` wraps it for the relay, ``aclose`` hands the connection back to the
    pool when the whole answer arrived and closes it otherwise."""

    __slots__ = ("_connection", "_headers")

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._headers: dict[str, str] | None = None

    @property
    def status_code(self) -> int:
        return self._connection.status

    @property
    def headers(self) -> Mapping[str, str]:
        """Names in lower case (``retry-after``); built when asked, which only error answers are."""
        if self._headers is None:
            self._headers = {
                name.decode("latin-1").lower(): value.decode("latin-1") for name, value in self._connection.headers
            }
        return self._headers

    async def read_some(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); b"" at its end.
        Failures raise ``wire``'s errors."""
        return await self._connection.read()

    async def read(self) -> bytes:
        parts = []
        while data := await self._connection.read():
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def stream(self, backend: str, stall_s: float) -> StreamChunks:
        """The body of a stream, chunk by chunk, as the relay reads it (``StreamChunks``).

        From now on a wait of ``stall_s`` for the backend's next byte ends it, in place of the
        first-byte timeout. The connection's own read timer does it, stopped while the gateway's
        client reads slowly, so it measures the backend only; no timer operation per relayed
        chunk (two per chunk cost a twentieth of a stream's CPU)."""
        self._connection.read_timeout = stall_s
        return StreamChunks(self._connection, backend, stall_s)

    async def aclose(self) -> None:
        self._connection.finish()


class StreamChunks:
    """A stream's body, chunk by chunk; a gap longer than ``stall_s`` ends it with a 504
    ``upstream_stalled`` (the client reading slowly is no gap: ``UpstreamResponse.stream``), a
    connection lost mid-way with a 502 ``upstream_disconnected``.

    An iterator object, not an async generator over ``chunks()``: one frame less for every
    relayed chunk, and the errors are mapped where they are raised."""

    __slots__ = ("_backend", "_connection", "_stall_s")

    def __init__(self, connection: Connection, backend: str, stall_s: float) -> None:
        self._connection = connection
        self._backend = backend
        self._stall_s = stall_s

    def __aiter__(self) -> StreamChunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            data = await self._connection.read()
        except TimeoutError:
            raise UpstreamTimeout(
                f"Backend '{self._backend}' sent nothing for {self._stall_s:g}s in the middle of the stream.",
                code="upstream_stalled",
            ) from None
        except ConnectionFailed as exc:
            raise UpstreamError(
                f"Backend '{self._backend}' dropped the connection in the middle of the stream.",
                code="upstream_disconnected",
            ) from exc
        if not data:
            raise StopAsyncIteration
        return data


@dataclass(frozen=True, slots=True)
class BackendTarget:
    """How to reach one backend: its origin, the head of a request per API path (its credential
    included), and its timeouts."""

    origin: Origin
    heads: Mapping[str, bytes]
    connect_s: float
    first_byte_s: float


@dataclass(frozen=True, slots=True)
class UpstreamTargets:
    """Every backend's ``BackendTarget``, and what error excerpts must hide (credentials, backend
    host names)."""

    backends: Mapping[str, BackendTarget]
    secrets: frozenset[str]
    hosts: frozenset[str]


class UpstreamClient:
    """Sends requests to backends over one connection pool shared by all of them (module docstring)."""

    def __init__(self, backends: Mapping[str, Backend], *, max_connections: int = 1000) -> None:
        self._pool = ConnectionPool(max_connections=max_connections)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(transport=AiohttpTransport(limits=limits), timeout=None)
        self._targets: dict[str, BackendTarget] = {}
        self._secrets: frozenset[str] = frozenset()
        self._hosts: frozenset[str] = frozenset()
        self.redactor = Redactor()
        self.configure(backends)

    def configure(self, backends: Mapping[str, Backend]) -> None:
        """Resolve each backend's credential and timeouts now; raise if a credential is missing."""
        self.install(self.prepare(backends))

    @staticmethod
    def prepare(backends: Mapping[str, Backend]) -> UpstreamTargets:
        """Each backend's origin, request heads (its credential) and timeouts; raise ``MissingCredential``.

        Changes nothing: a reload prepares first and installs only when every part of it could
        be built (``gateway/runtime.py``)."""
        targets: dict[str, BackendTarget] = {}
        secrets: set[str] = set()
        hosts: set[str] = set()
        tls = None
        for name, backend in backends.items():
            fixed = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
            if backend.credential_env:
                secret = os.environ.get(backend.credential_env)
                if not secret:
                    raise MissingCredential(
                        f"backend '{name}': environment variable {backend.credential_env} is not set"
                    )
                fixed.append((b"authorization", f"Bearer {secret}".encode()))
                secrets.add(secret)
            url = httpx.URL(backend.url)
            hosts.update(part for part in (url.host, url.username) if part)
            if url.password:
                secrets.add(url.password)
            if url.scheme == "https" and tls is None:
                tls = httpx.create_ssl_context()  # the CA bundle httpx verifies with (certifi)
            origin = Origin(
                url.host, url.port or (443 if url.scheme == "https" else 80), tls if url.scheme == "https" else None
            )
            base = url.raw_path.split(b"?", 1)[0].rstrip(b"/")
            heads = {path: head_prefix(base + path.encode(), origin, fixed) for path in DIALECTS}
            t = backend.timeouts
            targets[name] = BackendTarget(origin, heads, t.connect_s, t.first_byte_s)
        return UpstreamTargets(targets, frozenset(secrets), frozenset(hosts))

    def install(self, targets: UpstreamTargets) -> None:
        """Use ``targets`` from now on.

        Merged, not replaced: a request granted a backend that a reload just removed still
        finds its credential and URL (removed backends are drained, not cut), and the redactor
        keeps hiding a removed backend's secrets from error excerpts."""
        self._targets = {**self._targets, **targets.backends}
        self._secrets, self._hosts = self._secrets | targets.secrets, self._hosts | targets.hosts
        self.redactor = Redactor(self._secrets, self._hosts)

    @property
    def http(self) -> httpx.AsyncClient:
        """The httpx client, for health checks and metric scrapes."""
        return self._client

    @property
    def open_connections(self) -> int:
        """Connections of the data plane open now (in use or idle)."""
        return self._pool.open_connections

    async def open(
        self,
        backend: Backend,
        api: Dialect,
        body: bytes,
        *,
        request_id: str,
        engine_request_id: str,
        trace: TraceContext | None = None,
    ) -> UpstreamResponse:
        """POST ``body`` to ``backend``'s ``api``; return once the response headers arrived (body unread).

        ``engine_request_id`` (``new_engine_request_id``, one per attempt) is the engine's
        ``x-request-id``, never the client's ``request_id`` (both are logged together);
        ``trace`` adds the W3C ``traceparent`` of the attempt's span (sampled requests only)
        and records the engine's id on it.
        """
        target = self._targets[backend.name]
        headers = {"x-request-id": engine_request_id}
        if trace is not None:
            trace.inject(headers)
            trace.engine_request(engine_request_id)
        log.debug("request %s: attempt on backend %s is engine request %s", request_id, backend.name, engine_request_id)
        head = request_head(target.heads[api.path], headers, len(body))
        with map_upstream_errors(backend.name):
            connection = await self._pool.request(
                target.origin, head, body, connect_s=target.connect_s, read_timeout=target.first_byte_s
            )
        return UpstreamResponse(connection)

    async def read_all(self, backend: Backend, response: UpstreamResponse) -> bytes:
        """The whole body as sent (``accept-encoding: identity``): no decoder layer."""
        try:
            with map_upstream_errors(backend.name):
                return await response.read()
        finally:
            await response.aclose()

    async def error_for(self, backend: Backend, response: UpstreamResponse, report: FaultReport) -> GatewayError:
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
        await self._pool.aclose()


async def read_error_body(response: UpstreamResponse, *, time_limit_s: float, limit: int = ERROR_BODY_LIMIT) -> bytes:
    """At most ``limit`` bytes of an error answer, read within ``time_limit_s``; closes the response.

    Bounded both ways because the body is only read to be described: a backend that sends
    gigabytes, or one byte a minute, gets its status mapped on what arrived in time. A read
    that fails keeps what it had, too (the status is what counts).
    """
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(time_limit_s):
            while chunk := await response.read_some():
                parts.append(chunk)
                size += len(chunk)
                if size >= limit:
                    break
    except (TimeoutError, OSError):
        pass
    finally:
        await response.aclose()
    return b"".join(parts)[:limit]
