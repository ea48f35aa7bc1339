"""Connection guards: deadlines, bounds on a request's head, a bound on open connections.

What uvicorn 0.54 with httptools enforces by itself, and what it leaves open (its
``protocols/http/httptools_impl.py`` and ``server.py``):

* ``timeout_keep_alive`` closes a connection idle *after a response*; a connection that never
  sends a request, or trickles one byte a second, has no deadline at all.
* ``limit_concurrency`` is checked when a request's headers are complete, so silent sockets never
  reach it; it counts connections and refuses without ever freeing an idle one.
* ``h11_max_incomplete_event_size`` bounds headers under h11 only. httptools has no bound, and
  accumulates each header value by ``bytes`` concatenation: a 32 MiB header is held whole. Nor
  does it bound the number of headers: each costs a Python call in uvicorn, then work in the
  application that reads the list, so 5,000 tiny ones cost 35 times a normal refusal.
* Nothing bounds the time a body takes.

The rules added here, per listener (``ConnectionLimits``, from ``Settings``):

1. **Header deadline**: ``header_timeout_s`` from the connection's start, or from the first byte
   of the next request on a kept-alive connection, to the end of the headers. On expiry the
   connection is closed, after a 408 when part of a request had arrived.
2. **Head size**: the request line and headers of every request are counted, and past
   ``max_header_bytes`` bytes or ``max_headers`` header lines the client gets 431 with
   ``connection: close`` and nothing more is parsed. Two counts make it hold across reads and
   pipelined requests. Bytes are counted as they arrive, before the parser buffers
   them: a read that starts inside a head counts whole against it (so an unfinished header can
   never grow past the bound), as far as the bound; past it the parser gets only the rest of the
   budget. A head that starts inside a read (a pipelined request after the previous body, or
   after the previous head) is counted as the parser reports it: its URL, and each header's name
   and value plus 3 for the colon and the line end, never more than its bytes; its next read
   then counts on from there. The parser's callbacks check both bounds at each header, and
   raising from one stops httptools at once (``_GuardedParser``), so the rest of a head with
   5,000 headers is never parsed.
3. **Body deadline**: ``body_timeout_s`` from the end of the headers to the end of the body. On
   expiry the application's ``receive()`` returns ``http.disconnect`` (the request ends and
   releases what it holds), and the client gets a 408, or only the close when its response had
   already started.
4. **Keep-alive**: ``keepalive_timeout_s`` of idleness after a response (uvicorn's own timer).
5. **Open connections**: at most ``max_connections``. A new connection at the bound closes the
   connection idle the longest (waiting for its first request, for the next one after a
   response, or holding part of a request's headers), one that never completed a request first,
   the way nginx reuses idle connections. Only when none is idle is the newcomer refused: its
   request is answered 503 ``too_many_connections`` with ``Retry-After``, then closed. A flood of
   silent sockets therefore can never lock out a real client or a health probe.

These answers always close the connection, and none is written into another response: a
pipelined request refused for its head is answered after the responses to the requests before
it, which are served as usual. A 431 or a 408 closes after a linger (``LINGER_S``, nginx's
lingering close): the connection is half-closed and what the client still sends is read and
dropped, so that its unread bytes do not make the close a reset that destroys the answer.
Every close is counted by listener and reason (``Listeners.closed_connections``, exported as
``gateway_connections_closed_total``) and logged at warning level at most once per
``LOG_INTERVAL_S`` per listener and reason.

The operator listener's connections carry the ASGI scope extension ``OPERATOR_EXTENSION``, which
is how the application tells its two listeners apart (``is_operator_request``). Every request
carries a ``CycleDisconnectSignal`` under ``DISCONNECT_EXTENSION``: the application learns that its
client left from a callback, instead of a task per request waiting on ``receive()`` for
``http.disconnect`` (the protocol is the pipeline's: ``gateway/request/disconnect.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol, cast

import httptools
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import GatewayError, HeadersTooLarge, Overloaded, RequestTimeout
from gateway.request.disconnect import DISCONNECT_EXTENSION

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
OPERATOR_EXTENSION = "gateway.operator_listener"
REFUSAL_RETRY_AFTER_S = 1.0
LINGER_S = 2.0
"""How long a connection refused for its head (or its header deadline) still reads, and drops,
what its client sends after the answer: enough for the bytes in flight to arrive and the client
to read the answer; nginx lingers up to 30 s (``lingering_time``)."""


class Reason(StrEnum):
    """Why the gateway closed a client connection (the ``reason`` label)."""

    HEADER_TIMEOUT = "header_timeout"
    HEADER_TOO_LARGE = "header_too_large"  # by bytes or by header lines (431 either way)
    BODY_TIMEOUT = "body_timeout"
    KEEPALIVE_TIMEOUT = "keepalive_timeout"
    EVICTED_IDLE = "evicted_idle"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """One listener's guards. ``ConnectionLimits(header_timeout_s=10, ..., max_connections=10000)``."""

    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    max_header_bytes: int
    max_headers: int
    max_connections: int


def is_operator_request(scope: Scope) -> bool:
    """Whether the request came in on the operator listener (``/metrics``, ``/admin/*``)."""
    extensions = scope.get("extensions")
    return extensions is not None and OPERATOR_EXTENSION in extensions


class CycleDisconnectSignal:
    """One response cycle's ``DisconnectSignal`` (``gateway/request/disconnect.py``): calls its
    listener once, when the client's connection is lost before the response completed.

    ``listen`` also resumes reading the socket, as ``receive()`` does, so that the peer's close is
    seen even when uvicorn paused reading after a large body."""

    __slots__ = ("_listener", "_resume_reading", "cycle", "fired")

    def __init__(self, cycle: Any, resume_reading: Callable[[], None]) -> None:
        self.cycle = cycle
        self._resume_reading = resume_reading
        self._listener: Callable[[], None] | None = None
        self.fired = False

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` when the client leaves (at once if it already has)."""
        if self.fired:
            listener()
            return
        self._listener = listener
        self._resume_reading()

    def clear(self) -> None:
        self._listener = None

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        listener, self._listener = self._listener, None
        if listener is not None:
            listener()


class Guarded(Protocol):
    """What a listener needs from one of its connections."""

    client: tuple[str, int] | None

    def evict(self) -> None: ...


class Listener:
    """One listening socket's connections: the bound, the idle ones by age, the closes by reason.

    Idle connections sit in two queues ordered by when they became idle: ``_fresh`` (never
    completed a request: silent sockets, slow headers, and refused newcomers) and ``_kept``
    (idle after a response). A connection leaves them while a request is in progress.
    """

    def __init__(self, name: str, limits: ConnectionLimits, *, operator: bool = False) -> None:
        self.name = name
        self.limits = limits
        self.operator = operator
        self.refusal = Refusal(name, limits.max_connections)
        self.closed: dict[Reason, int] = dict.fromkeys(Reason, 0)
        self._members: dict[Guarded, None] = {}
        self._fresh: dict[Guarded, None] = {}
        self._kept: dict[Guarded, None] = {}
        self._log = ThrottledLog(LOG_INTERVAL_S)

    @property
    def open(self) -> int:
        return len(self._members)

    def admit(self, connection: Guarded) -> bool:
        """Register a new connection; False when it must be refused (the bound, nothing idle)."""
        admitted = True
        if len(self._members) >= self.limits.max_connections:
            victim = next(iter(self._fresh), None) or next(iter(self._kept), None)
            if victim is None:
                admitted = False
                self.record(Reason.REFUSED, connection.client)
            else:
                self.left(victim)
                self.record(Reason.EVICTED_IDLE, victim.client)
                victim.evict()
        self._members[connection] = None
        self._fresh[connection] = None
        return admitted

    def busy(self, connection: Guarded) -> None:
        """A request's headers are complete: not idle until its response is."""
        self._fresh.pop(connection, None)
        self._kept.pop(connection, None)

    def idle(self, connection: Guarded) -> None:
        """A response completed and nothing else is in progress: idle, the newest of the idle."""
        self._fresh.pop(connection, None)
        if connection in self._members:
            self._kept[connection] = None

    def left(self, connection: Guarded) -> None:
        self._members.pop(connection, None)
        self._fresh.pop(connection, None)
        self._kept.pop(connection, None)

    def record(self, reason: Reason, client: tuple[str, int] | None) -> None:
        self.closed[reason] += 1
        if reason is Reason.KEEPALIVE_TIMEOUT:  # routine, not worth a log line
            return
        held = self._log.due(reason)
        if held is not None:
            peer = f"{client[0]}:{client[1]}" if client else "-"
            more = f" ({held} more since the last report)" if held else ""
            log.warning("%s listener: %s: connection from %s%s", self.name, _describe(reason, self.limits), peer, more)


def _describe(reason: Reason, limits: ConnectionLimits) -> str:
    descriptions = {
        Reason.HEADER_TIMEOUT: f"request headers incomplete after {limits.header_timeout_s:g}s",
        Reason.HEADER_TOO_LARGE: (
            f"request headers over {limits.max_header_bytes} bytes or {limits.max_headers} lines (431)"
        ),
        Reason.BODY_TIMEOUT: f"request body incomplete after {limits.body_timeout_s:g}s (408)",
        Reason.EVICTED_IDLE: f"closed as the longest idle, for a new connection at {limits.max_connections} open",
        Reason.REFUSED: f"refused (503): {limits.max_connections} connections open and none idle",
    }
    return descriptions.get(reason, reason.value)


class ThrottledLog:
    """At most one log line per ``interval_s`` per reason, and a count of the lines held back:
    a flood of bad connections must not become a flood of log lines."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[Reason, float] = {}
        self._held: dict[Reason, int] = {}

    def due(self, reason: Reason) -> int | None:
        """None when a line for ``reason`` went out less than ``interval_s`` ago (this one is held
        back); otherwise the number held back since that line."""
        now = self._clock()
        last = self._last.get(reason)
        if last is not None and now - last < self._interval_s:
            self._held[reason] = self._held.get(reason, 0) + 1
            return None
        self._last[reason] = now
        return self._held.pop(reason, 0)


class Listeners:
    """Every listener of one server, found from a connection's local address."""

    def __init__(self) -> None:
        self.all: list[Listener] = []
        self._by_port: dict[int, list[tuple[str, Listener]]] = {}

    def add(self, listener: Listener, address: tuple[Any, ...]) -> None:
        """``address`` is the listening socket's ``getsockname()`` (its host may be a wildcard)."""
        self.all.append(listener)
        self._by_port.setdefault(address[1], []).append((address[0], listener))

    def find(self, local: object) -> Listener:
        """The listener a connection arrived on, from its local ``(ip, port, ...)`` address."""
        if isinstance(local, tuple) and len(local) >= 2:
            candidates = self._by_port.get(local[1], ())
            for host, listener in candidates:
                if host == local[0]:
                    return listener
            if candidates:
                return candidates[0][1]
        return self.all[0]

    def open_connections(self) -> Mapping[str, int]:
        return {listener.name: listener.open for listener in self.all}

    def closed_connections(self) -> Mapping[tuple[str, str], int]:
        return {(li.name, reason.value): n for li in self.all for reason, n in li.closed.items()}


class Refusal:
    """The ASGI answer to a request on a connection refused at the bound: 503, then close."""

    def __init__(self, listener: str, bound: int) -> None:
        error = Overloaded(
            f"The gateway has {bound} connections open on its {listener} listener and none idle; retry shortly.",
            status=503,
            code="too_many_connections",
            retry_after_s=REFUSAL_RETRY_AFTER_S,
        )
        self._status = error.status
        self._body = error.body()
        self._headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self._body)).encode()),
            (b"connection", b"close"),
            *((name.encode(), value.encode()) for name, value in error.headers.items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self._status, "headers": self._headers})
        await send({"type": "http.response.body", "body": self._body})


_NO_DEADLINE, _HEADER_DEADLINE, _BODY_DEADLINE = 0, 1, 2
_HEADER_LINE_OVERHEAD = 3
"""Bytes of a header line besides its name and value that every line has: the colon and CRLF."""


def _too_many_bytes(limits: ConnectionLimits) -> HeadersTooLarge:
    return HeadersTooLarge(f"The request line and headers exceed {limits.max_header_bytes} bytes.")


class _HeadRefused(Exception):
    """Raised by a parser callback when a head passes a bound: it stops httptools at once."""


class _GuardedParser(httptools.HttpRequestParser):
    """httptools' request parser, stopped by the guards.

    A callback that raises makes ``feed_data`` raise ``HttpParserCallbackError``, which uvicorn
    answers with a 400 and a warning line per request; this parser swallows the guards' own
    ``_HeadRefused`` instead, so the protocol answers the refusal (431) itself."""

    def feed_data(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        try:
            super().feed_data(data)
        except httptools.HttpParserCallbackError as error:
            if not isinstance(error.__context__, _HeadRefused):
                raise


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guards of the module docstring.

    Build one class per server with ``bound_to(listeners)`` and give it to ``uvicorn.Config(http=...)``.
    The hot path pays attribute checks only: a request that arrives in one read arms no timer,
    and each header costs one more Python call (two additions, two comparisons) than uvicorn's.
    """

    listeners: ClassVar[Listeners]

    @classmethod
    def bound_to(cls, listeners: Listeners) -> type[GuardedHttpToolsProtocol]:
        return cast(type[GuardedHttpToolsProtocol], type(cls.__name__, (cls,), {"listeners": listeners}))

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.parser = _GuardedParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets its own
        self.listener: Listener = self.listeners.all[0]
        self.limits = self.listener.limits
        self._max_headers, self._max_header_bytes = self.limits.max_headers, self.limits.max_header_bytes
        self._reading_body = False
        self._request_begun = False  # bytes of a request whose headers are not complete yet
        self._heads = 0  # requests whose headers completed on this connection
        self._head_bytes = 0  # of the head in progress (or the next one): counted as they arrive
        self._head_seen = 0  # of the head in progress: what the parser reported of it
        self._head_lines = 0
        self._refusal: GatewayError | None = None  # the answer due before the close, once refused
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_kind = _NO_DEADLINE
        self._signals: list[CycleDisconnectSignal] = []  # of the requests whose response is not complete

    # Connection events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        listener = self.listener = self.listeners.find(transport.get_extra_info("sockname"))
        limits = self.limits = listener.limits
        self._max_headers, self._max_header_bytes = limits.max_headers, limits.max_header_bytes  # read per header
        # uvicorn annotates it int; its timer (loop.call_later) takes any number of seconds.
        self.timeout_keep_alive = limits.keepalive_timeout_s  # type: ignore[assignment]
        if not listener.admit(self):
            self.app = cast("ASGI3Application", listener.refusal)
        self._arm(_HEADER_DEADLINE)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._disarm()
        self.listener.left(self)
        self._fire_signals()

    def _fire_signals(self) -> None:
        signals, self._signals = self._signals, []
        for signal in signals:
            if not signal.cycle.response_complete:
                signal.fire()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: nothing more is parsed
        if not self._reading_body:
            if self._head_bytes + len(data) > self.limits.max_header_bytes:
                self._receive_past_budget(data)
                return
            self._head_bytes += len(data)
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        super().data_received(data)
        if self._refusal is not None:
            self._refuse()
            return
        if self._request_begun and self._head_bytes < self._head_seen:
            self._head_bytes = self._head_seen  # a head that began inside this read: what the parser saw
        self._rearm()

    def _receive_past_budget(self, data: bytes) -> None:
        """Feed the parser up to the header budget; 431 unless the head ended within it."""
        allowed = self.limits.max_header_bytes - self._head_bytes
        self._head_bytes += allowed
        heads = self._heads
        if allowed:
            self._feed(data[:allowed])
        if self.transport.is_closing() or self._refusal is not None:
            return
        if self._heads == heads:
            self._refusal = _too_many_bytes(self.limits)
            self._refuse()
            return
        self.data_received(data[allowed:])  # a body, or the next request's head (counted afresh)

    def _stop(self, error: GatewayError) -> NoReturn:
        """Refuse the head being parsed: from a parser callback, which this stops."""
        self._refusal = error
        raise _HeadRefused

    def _refuse(self) -> None:
        """Count the refused head, then answer it and close: at once, or once the requests before
        it are answered (``on_response_complete``)."""
        self.listener.record(Reason.HEADER_TOO_LARGE, self.client)
        self._disarm()
        if self._busy():
            self.flow.pause_reading()
        else:
            self._close_with_refusal()

    def _close_with_refusal(self) -> None:
        """Write the refusal, then close after a linger: half-closed, reading and dropping what
        the client still sends for up to ``LINGER_S``. Closing with its bytes unread would send a
        reset, which can destroy the answer before the client reads it (nginx's lingering close)."""
        assert self._refusal is not None
        self._write_error(self._refusal)
        transport = self.transport
        self._disarm()
        self._unset_keepalive_if_required()
        if transport.can_write_eof():
            transport.write_eof()  # the client reads the answer, then its end; its close ends ours
            self._deadline = self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def evict(self) -> None:
        """Closed by the listener at its bound, as the longest idle connection."""
        self._disarm()
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.listener.record(Reason.KEEPALIVE_TIMEOUT, self.client)
        super().timeout_keep_alive_handler()

    # Parser and response events (uvicorn's callbacks)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        self._head_seen = self._head_lines = 0
        self.scope["extensions"] = {OPERATOR_EXTENSION: {}} if self.listener.operator else {}

    def on_url(self, url: bytes) -> None:
        self._head_seen += len(url)
        if self._head_seen > self.limits.max_header_bytes:
            self._stop(_too_many_bytes(self.limits))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._reading_body:  # not a chunked body's trailer
            self._head_lines += 1
            self._head_seen += len(name) + len(value) + _HEADER_LINE_OVERHEAD
            if self._head_lines > self._max_headers or self._head_seen > self._max_header_bytes:
                self._stop(self._head_too_large())
        HttpToolsProtocol.on_header(self, name, value)  # not super(): this runs for every header

    def _head_too_large(self) -> HeadersTooLarge:
        limits = self.limits
        if self._head_lines > limits.max_headers:
            return HeadersTooLarge(f"The request has more than {limits.max_headers} header lines.")
        return _too_many_bytes(limits)

    def on_headers_complete(self) -> None:
        self._reading_body = True
        self._request_begun = False
        self._heads += 1
        self.listener.busy(self)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade uvicorn answered itself
            signal = CycleDisconnectSignal(cycle, self.flow.resume_reading)
            self._signals.append(signal)
            extensions: dict[str, Any] = self.scope["extensions"]  # uvicorn types its values narrowly
            extensions[DISCONNECT_EXTENSION] = signal

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_body = False
        self._head_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._signals = [s for s in self._signals if not s.cycle.response_complete]
        if self.transport.is_closing():
            return
        if self._refusal is not None:
            if not self._busy():
                self._close_with_refusal()  # the requests before the refused one are answered
            return
        if not self._busy():
            self.listener.idle(self)
        self._rearm()

    # Deadlines

    def _busy(self) -> bool:
        """A request is in progress (its response not complete), or one waits behind it."""
        cycle = self.cycle
        return bool(self.pipeline) or (cycle is not None and not cycle.response_complete)

    def _rearm(self) -> None:
        """Put the deadline the connection's state calls for (module docstring, rules 1, 3, 4).

        Runs after every read and response: the common case (a request in progress, no
        deadline) costs two attribute checks."""
        cycle = self.cycle
        if self._reading_body:
            # A pipelined request's body is not read (uvicorn pauses) until its turn comes.
            kind = _NO_DEADLINE if self.pipeline else _BODY_DEADLINE
        elif self.pipeline or (cycle is not None and not cycle.response_complete):
            kind = _NO_DEADLINE  # a request in progress; the next one's head waits its turn
        elif self._request_begun or self._heads == 0:
            kind = _HEADER_DEADLINE
            self._unset_keepalive_if_required()  # the next request began while the last response was sent
        else:
            kind = _NO_DEADLINE  # idle after a response: uvicorn's keep-alive timer runs
            if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
        if kind != self._deadline_kind:
            self._disarm()
            if not self.transport.is_closing():
                self._arm(kind)

    def _arm(self, kind: int) -> None:
        limits = self.listener.limits
        self._deadline_kind = kind
        if kind == _HEADER_DEADLINE:
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)
        elif kind == _BODY_DEADLINE:
            self._deadline = self.loop.call_later(limits.body_timeout_s, self._body_too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_kind = _NO_DEADLINE

    def _headers_too_slow(self) -> None:
        self._deadline, self._deadline_kind = None, _NO_DEADLINE
        if self.transport.is_closing():
            return
        self.listener.record(Reason.HEADER_TIMEOUT, self.client)
        if self._request_begun:  # never busy: this deadline runs only between requests
            seconds = self.listener.limits.header_timeout_s
            self._refusal = RequestTimeout(f"The request headers did not arrive within {seconds:g}s.")
            self._close_with_refusal()
        else:
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._deadline, self._deadline_kind = None, _NO_DEADLINE
        if self.transport.is_closing():
            return
        self.listener.record(Reason.BODY_TIMEOUT, self.client)
        cycle = self.cycle
        answer = not cycle.response_started
        cycle.disconnected = True  # the app's receive() now returns http.disconnect; its sends are dropped
        cycle.message_event.set()
        self._fire_signals()
        if answer:
            seconds = self.listener.limits.body_timeout_s
            self._write_error(RequestTimeout(f"The request body did not arrive within {seconds:g}s."))
        self.transport.close()

    def _write_error(self, error: GatewayError) -> None:
        body = error.body()
        head = [STATUS_LINE[error.status]]
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *((name.encode(), value.encode()) for name, value in error.headers.items()),
        ]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"\r\n", body]
        self.transport.write(b"".join(head))
