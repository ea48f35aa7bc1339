"""Real servers on loopback ports for the tests.

`serve_in_thread` runs an ASGI app under uvicorn (uvloop, httptools) in a background thread
and returns once the server accepts connections; `wait_until` polls a condition with a
deadline, which is how tests synchronise (never a bare sleep).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


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
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what=f"server on port {port} to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
