"""The one way the gateway's HTTP server is built: two listeners, guarded connections, a drain.

``server_for(settings, make_app)`` binds the API listener (``host:port``) and the operator
listener (``admin_host:admin_port``: ``/metrics``, ``/admin/*`` and the probes), and returns a
``GatewayServer`` whose ``run()`` (or ``await serve()``) serves both from one uvicorn server and
one event loop. ``serve``, ``demo`` and the tests all go through it (by ``gateway.app.build_server``,
which hands it the gateway's app), so the tests exercise the production protocol
(``gateway/server/connections.py``) and configuration.

Why the app is handed in (``make_app``, given the listeners whose connections ``/metrics``
counts) rather than imported: the app sits above the server in the stage order
(``tests/test_import_graph.py``), since it serves the operator's endpoints from here; the server
needs of it only an ASGI application and what a drain needs (``ServedApp``).

With ``--workers N`` (``gateway/workers/``) each worker is built here too, from the two sockets
its supervisor bound for it (``sockets=``): its share of the API port and its own operator
listener on loopback, which only the supervisor calls.

Each listener's socket listens as soon as it is bound, before the application starts: two
processes may bind one port with ``SO_REUSEADDR`` until one of them listens, so a port only
bound is not yet ours, and a gateway that started beside another would learn it at its first
``listen`` (a traceback, after its workers had started). A port that cannot be bound is one
line naming the listener, the address, why, and the flag that moves it (``ListenerUnavailable``).

The operator listener has its own small connection bound, so a flood on the API port never
takes a scrape or an admin call's connection, and API clients never take the operator's.
The API listener's bound is lowered, with a warning, when the process may not open that many
files: connections must be refused by the guard, cleanly, before ``accept`` fails for lack of a
descriptor (after trying to raise the soft limit to what is needed, as Go's runtime does).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.config import LOGGING_CONFIG

from gateway.server.connections import ConnectionLimits, GuardedHttpToolsProtocol, Listener, Listeners
from gateway.server.lifecycle import Drainable, DrainingServer
from gateway.settings import Settings

log = logging.getLogger(__name__)

FD_RESERVE = 256
"""Descriptors kept for everything but client and upstream connections: the policy file, logs,
Redis, the trace exporter, the listening sockets, the event loop's own."""
BACKLOG = 4096
"""Each listening socket's accept queue (uvicorn's ``backlog``)."""


@dataclass(frozen=True, slots=True)
class ListenerFlags:
    """How an operator names one listener and moves it: ``API`` and ``OPERATOR``."""

    name: str
    port_flag: str
    port_env: str
    host_flag: str


API = ListenerFlags("the API listener", "--port", "GATEWAY_PORT", "--host")
OPERATOR = ListenerFlags(
    "the operator listener (/metrics, /admin/*, /healthz, /readyz)",
    "--admin-port",
    "GATEWAY_ADMIN_PORT",
    "--admin-host",
)


class ListenerUnavailable(OSError):
    """A listener whose address cannot be bound, said in one line an operator can act on: which
    listener, which address, why, and what to pass instead (``serve`` prints it and exits 1).
    ``ListenerUnavailable(OPERATOR, "127.0.0.1", 9464, error)``."""

    def __init__(self, listener: ListenerFlags, host: str, port: int, cause: OSError) -> None:
        code = cause.errno or 0
        if code == errno.EADDRINUSE:
            why = "the port is already in use (another gateway, or another program, holds it)"
        elif code == errno.EACCES:
            why = "permission denied (a port below 1024 needs privileges)"
        elif code == errno.EADDRNOTAVAIL:
            why = "no interface of this host has that address"
        else:
            why = os.strerror(code) if code else str(cause)
        if code == errno.EADDRNOTAVAIL:
            fix = f"pass {listener.host_flag} with an address of this host"
        else:
            fix = (
                f"pass {listener.port_flag} N to choose another port (0 picks a free one), or set {listener.port_env}=N"
            )
        super().__init__(code, f"{listener.name} cannot listen on {host}:{port}: {why}; {fix}")

    def __str__(self) -> str:
        return str(self.strerror)  # the line itself, without OSError's "[Errno 98] "


class ServedApp(Protocol):
    """What the server needs of the application it serves (``gateway.app.GatewayApp``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...

    def drainable(self) -> Drainable | None:
        """What a drain needs (``lifecycle.py``); None until the application has started."""
        ...


@dataclass
class GatewayServer:
    """A built, bound, not yet running gateway server."""

    settings: Settings
    app: ServedApp
    server: DrainingServer
    sockets: list[socket.socket]
    listeners: Listeners
    api_url: str
    admin_url: str
    closed: bool = field(default=False, init=False)

    def run(self) -> None:
        """Serve until SIGTERM (drained) or SIGINT; blocks."""
        self._announce()
        try:
            self.server.run(sockets=self.sockets)
        finally:
            self.close()

    def _announce(self) -> None:
        """Where it listens, once (with port 0 the only way to learn the ports the kernel gave).
        A worker says it otherwise: "listening:" is the supervisor's line, with the public operator
        listener (``tests/servers.py`` reads it)."""
        settings = self.settings
        if settings.workers > 1:
            log.info(
                "worker %d of %d serving: API on %s, its operator listener on %s",
                settings.worker_index,
                settings.workers,
                self.api_url,
                self.admin_url,
            )
            return
        log.info("listening: API on %s, operator on %s", self.api_url, self.admin_url)

    async def serve(self) -> None:
        self._announce()
        try:
            await self.server.serve(sockets=self.sockets)
        finally:
            self.close()

    def close(self) -> None:
        """Close the listening sockets (uvicorn closes them too once it ran; twice is harmless)."""
        for sock in self.sockets:
            sock.close()
        self.closed = True


def server_for(
    settings: Settings,
    make_app: Callable[[Listeners], ServedApp],
    *,
    sockets: tuple[socket.socket, socket.socket] | None = None,
    after_drain: Callable[[], Awaitable[None]] | None = None,
) -> GatewayServer:
    """Bind both listeners and build the app (``make_app(listeners)``) and its server; ``OSError``
    when a port is taken. A worker's (``gateway/workers/child.py``) gives ``sockets``, the API and
    operator sockets its supervisor bound, and ``after_drain``, its wait for the other workers
    (``DrainingServer``)."""
    api_socket, admin_socket = sockets if sockets is not None else bind_listeners(settings)
    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        keepalive_timeout_s=settings.keepalive_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        max_connections=fit_to_file_limit(settings),
    )
    listeners = Listeners()
    listeners.add(Listener("api", limits), api_socket.getsockname())
    admin_limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        keepalive_timeout_s=settings.keepalive_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        max_connections=settings.admin_max_connections,
    )
    listeners.add(Listener("admin", admin_limits, operator=True), admin_socket.getsockname())
    app = make_app(listeners)
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=GuardedHttpToolsProtocol.bound_to(listeners),
        ws="none",  # no WebSocket endpoint; an upgrade would also take the connection out of its guard
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
        backlog=BACKLOG,
        proxy_headers=False,  # the gateway never reads the client address; saves work per request
        # A worker's uvicorn lines go through the root logger, so they carry its "[worker i]" too.
        log_config=LOGGING_CONFIG if settings.workers == 1 else None,
    )
    server = DrainingServer(config, app.drainable, after_drain)
    listening = [api_socket, admin_socket]
    return GatewayServer(settings, app, server, listening, listeners, _url(api_socket), _url(admin_socket))


def bind_listeners(settings: Settings) -> tuple[socket.socket, socket.socket]:
    """The API and operator sockets of ``settings``, listening; ``ListenerUnavailable`` (neither
    left open) when one cannot be."""
    api_socket = listen_on(API, settings.host, settings.port)
    try:
        admin_socket = listen_on(OPERATOR, settings.admin_host, settings.admin_port)
    except OSError:
        api_socket.close()
        raise
    return api_socket, admin_socket


def listen_on(listener: ListenerFlags, host: str, port: int) -> socket.socket:
    """``bind_socket``, its failure said as ``listener``'s (``ListenerUnavailable``)."""
    try:
        return bind_socket(host, port)
    except OSError as exc:
        raise ListenerUnavailable(listener, host, port, exc) from exc


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket, listening at once (module docstring; uvicorn's own ``Config.bind_socket``,
    for any number of listeners)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


def fit_to_file_limit(settings: Settings) -> int:
    """The API listener's connection bound, lowered to what the descriptor limit allows."""
    others = settings.admin_max_connections + settings.max_upstream_connections + FD_RESERVE
    needed = settings.max_connections + others
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return settings.max_connections
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError):
        pass
    if soft >= needed:
        return settings.max_connections
    bound = max(1, soft - others)
    log.warning(
        "max_connections lowered from %d to %d: the process may open %d files (ulimit -n), "
        "and %d go to the operator listener, upstream connections and the rest",
        settings.max_connections,
        bound,
        soft,
        others,
    )
    return bound


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return base_url(host, port)


def base_url(host: str, port: int) -> str:
    """``http://host:port`` to reach a listener bound to ``host`` (a wildcard: from this machine)."""
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
