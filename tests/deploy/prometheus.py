"""A real Prometheus (Debian's package) on a loopback port, for the tests that scrape a gateway.

``run_prometheus`` starts the binary with the caller's flags (a config file, a data directory)
plus a free loopback listen address, logs to a file the assertions can name, and stops it at the
end of the block; ``Prometheus`` asks its HTTP API.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.deploy.conftest import binary
from tests.servers import free_port


class Prometheus:
    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector (or []) of ``promql``; [] too while the server starts or refuses it."""
        data = self.api("query", query=promql)
        if data is None:
            return []
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_error(self, promql: str) -> str | None:
        """Why Prometheus refuses ``promql`` (a parse or type error), None when it evaluates it."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        if response.status_code == 200:
            return None
        error: str = response.json().get("error", response.text)
        return error

    def api(self, path: str, **params: str) -> Any | None:
        """The ``data`` of ``GET /api/v1/<path>``; None while the server starts or on an error answer."""
        try:
            response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=5)
        except httpx.TransportError:
            return None  # still starting
        if response.status_code != 200:
            return None
        return response.json()["data"]


@contextmanager
def run_prometheus(flags: Sequence[str], log: Path) -> Iterator[Prometheus]:
    """``prometheus FLAGS --web.listen-address=127.0.0.1:<free port>``, its output in ``log``."""
    port = free_port()
    with logged_process([binary("prometheus"), *flags, f"--web.listen-address=127.0.0.1:{port}"], log):
        yield Prometheus(f"http://127.0.0.1:{port}", log)


@contextmanager
def logged_process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` running, its output in ``log``, until the block ends (terminated, then killed)."""
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
