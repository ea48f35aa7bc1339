"""A worker of ``serve --workers N``: one whole gateway, on the sockets its supervisor bound.

The supervisor runs ``python -m gateway.workers.child INDEX`` with the ``WorkerSpec`` in
``GATEWAY_WORKER_SPEC`` (``spec.py``); nobody else should. The worker loads the policy file as
it is now, builds its server with ``gateway/server/serve.py`` (the same listeners, guards, drain and
reload as a single gateway) from the two inherited sockets, and runs until it has drained.

Three things differ from a single gateway, and why:

* **Logs** carry ``[worker i]`` (uvicorn's lines too), so that N interleaved processes can be told
  apart; client responses never say which worker served them.
* **SIGHUP is ignored until the gateway installs its reload handler**: the supervisor forwards a
  SIGHUP to every worker, and one still starting would otherwise die of it (SIGHUP's default).
* **The lifeline**, a socket pair with the supervisor, for two things. A drained worker says so
  on it and waits until the supervisor closes it, which it does once every worker has drained:
  a worker with nothing in flight would otherwise close its share of the port while the others
  still drain, and the connections the kernel hashed to it would be refused or reset instead of
  answered 503 ``draining``. And the worker runs in its own session (a terminal's Ctrl-C reaches
  only the supervisor, which forwards it once), so nothing else would stop it if the supervisor
  were killed: at EOF before it drains (the supervisor is gone, however it died) it signals
  itself SIGTERM, and drains as on any SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading

from gateway.app import build_server
from gateway.policy.loader import PolicyError
from gateway.service import load_policy
from gateway.workers.spec import DRAINED, SPEC_ENV, WorkerSpec

log = logging.getLogger(__name__)

STARTUP_FAILURE = 3
"""The exit status of a worker that could not start (uvicorn's ``STARTUP_FAILURE``)."""


def main() -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the gateway installs its reload
    spec = WorkerSpec.decode(os.environ.pop(SPEC_ENV))
    settings = spec.settings
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [worker {settings.worker_index}] %(name)s %(message)s",
    )
    lifeline = Lifeline(socket.socket(fileno=spec.lifeline_fd))
    try:
        snapshot = load_policy(settings.policy_path)
    except PolicyError as exc:
        log.error("cannot start: %s", exc)
        return STARTUP_FAILURE
    sockets = (socket.socket(fileno=spec.api_fd), socket.socket(fileno=spec.admin_fd))
    built = build_server(settings, snapshot, sockets=sockets, after_drain=lifeline.drained)
    built.run()
    return 0 if built.server.started else STARTUP_FAILURE


class Lifeline:
    """The worker's end of its socket pair with the supervisor (see the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._gone = False
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        threading.Thread(target=self._watch, name="lifeline", daemon=True).start()

    def _watch(self) -> None:
        """Block until EOF (the supervisor never writes): release the drain, or begin one."""
        with contextlib.suppress(OSError):
            while self._sock.recv(64):
                pass
        with self._lock:
            self._gone, waiter = True, self._waiter
        if waiter is None:
            log.warning("the supervisor is gone: draining")
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            loop, released = waiter
            loop.call_soon_threadsafe(_resolve, released)

    async def drained(self) -> None:
        """Tell the supervisor this worker has drained; return once it releases the set (or is gone)."""
        released = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._gone:
                return
            self._waiter = (asyncio.get_running_loop(), released)
        try:
            self._sock.send(DRAINED)
        except OSError:
            return
        log.warning("waiting for the other workers to drain")
        await released


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


if __name__ == "__main__":
    sys.exit(main())
