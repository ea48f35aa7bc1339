"""Every socket of a set of workers, bound by the supervisor and held for the set's whole life.

The API port is a group of ``SO_REUSEPORT`` sockets, one listening socket per worker: the
kernel hashes each new connection to one socket of the group, so connections spread evenly over
the workers whatever their arrival pattern. Why not one socket that every worker accepts from
(uvicorn's and gunicorn's ``--workers``): libuv (uvloop) accepts in a loop until the queue is
empty, so the worker that wakes first takes a whole burst of connections, and keep-alive clients
(every SDK's connection pool) stay on it for their life: one worker busy, the others idle.

Why the supervisor binds them, and keeps its own descriptor of each:

* ``--port 0`` gives one port for the whole set, and a port already taken fails once, at start,
  before any worker runs. A bound socket that never listens reserves the port for the set's
  whole life (even while every worker restarts), and no other program can bind it.
* Taken means taken by anyone, even another set of this user: ``SO_REUSEPORT`` lets every socket
  of the same user that sets it join a group, so a second ``serve --workers`` on the port would
  silently share the first one's connections. So the port is first bound alone, without
  ``SO_REUSEPORT`` (``_unshared``): held by anything listening there, that fails, and the start
  fails with it (``ListenerUnavailable``: the one line naming ``--port``).
* A worker that dies leaves its socket, and the connections the kernel queued on it, to its
  replacement: restarted at once (``supervisor.py``), it serves them a second later instead of
  their being reset.
* A worker that keeps dying is restarted after a growing delay; for that time its socket is
  closed (``close_api``), so the kernel sends new connections to the others. The connections
  queued on it are reset then, unless the host has ``net.ipv4.tcp_migrate_req=1`` (Linux 5.14+),
  which moves them to another socket of the group. It is opened again for the restart.
* Each worker's own operator listener is a loopback socket on a port the kernel picks, so the
  supervisor knows every worker's address before starting it.
"""

from __future__ import annotations

import socket

from gateway.server.serve import API, BACKLOG, ListenerUnavailable, bind_socket


def reuseport_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT``, listening unless told not to."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


class WorkerSockets:
    """The API group and the loopback operator sockets of ``count`` workers (module docstring).

    ``WorkerSockets("0.0.0.0", 8080, 4)``; ``ListenerUnavailable`` (nothing left open) when the
    port is taken."""

    def __init__(self, host: str, port: int, count: int) -> None:
        self.host = host
        self._api: list[socket.socket | None] = []
        self._admin: list[socket.socket] = []
        try:
            _unshared(host, port)
            self._reservation = reuseport_socket(host, port, listen=False)
        except OSError as exc:
            raise ListenerUnavailable(API, host, port, exc) from exc
        self.port: int = self._reservation.getsockname()[1]
        try:
            for _ in range(count):
                self._api.append(reuseport_socket(host, self.port))
                self._admin.append(_loopback())
        except OSError:
            self.close()
            raise

    def api(self, index: int) -> socket.socket:
        """Worker ``index``'s API socket, opened again if it was closed."""
        sock = self._api[index]
        if sock is None:
            sock = self._api[index] = reuseport_socket(self.host, self.port)
        return sock

    def close_api(self, index: int) -> None:
        """Take worker ``index``'s socket out of the group (see the module docstring)."""
        sock, self._api[index] = self._api[index], None
        if sock is not None:
            sock.close()

    def admin(self, index: int) -> socket.socket:
        return self._admin[index]

    def admin_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self._admin[index].getsockname()[1]}"

    def close(self) -> None:
        for index in range(len(self._api)):
            self.close_api(index)
        for sock in self._admin:
            sock.close()
        self._reservation.close()


def _unshared(host: str, port: int) -> None:
    """``OSError`` when something already listens on ``host:port``, even in a ``SO_REUSEPORT``
    group this user could join (module docstring). Port 0 is always free."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no holder
        probe.bind((host, port))


def _loopback() -> socket.socket:
    return bind_socket("127.0.0.1", 0)
