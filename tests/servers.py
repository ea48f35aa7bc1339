"""Real servers on loopback ports for the tests.

`serve_in_thread` runs an ASGI app under uvicorn (uvloop, httptools) in a background thread
and returns once the server accepts connections; `serve_gateway_in_thread` does the same for
the gateway, built exactly as `inference-gateway serve` builds it (`gateway/server.py`: both
listeners, the guarded protocol) and remembers its operator listener's URL for `admin_url`;
`wait_until` polls a condition with a deadline, which is how tests synchronise (never a bare
sleep).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from gateway.policy.snapshot import PolicySnapshot
from gateway.server import GatewayServer, build_server
from gateway.settings import Settings

ADMIN_URLS: dict[str, str] = {}
"""API URL -> operator listener URL of every gateway `serve_gateway_in_thread` is running."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `condition` until it holds; fail the test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


@contextmanager
def serve_in_thread(app: Any, port: int | None = None, **config: Any) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 in a thread; yield its base URL; stop it on exit."""
    port = port or free_port()
    cfg = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning", **config
    )
    server = uvicorn.Server(cfg)
    with _running(server, server.run, f"server on port {port}"):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def serve_gateway_in_thread(settings: Settings, snapshot: PolicySnapshot | None = None) -> Iterator[GatewayServer]:
    """The gateway of `settings` (give it port=0 and admin_port=0: free ports) in a thread."""
    built = build_server(settings, snapshot)
    ADMIN_URLS[built.api_url] = built.admin_url
    try:
        with _running(built.server, built.run, f"gateway on {built.api_url}"):
            yield built
    finally:
        ADMIN_URLS.pop(built.api_url, None)
        built.close()


def admin_url(api_url: str) -> str:
    """The operator listener (/metrics, /admin/*) of the test gateway serving `api_url`."""
    return ADMIN_URLS.get(api_url, api_url)


@contextmanager
def _running(server: uvicorn.Server, run: Callable[[], None], what: str) -> Iterator[None]:
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what=f"{what} to start")
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)
