"""A ``redis-server`` of a bench's own, on a free port: to kill and start again.

The fault benches (``fleet_faults``, ``limits_outage``) take Redis away from a running fleet for
real, which the shared server at 127.0.0.1:6379 that the tests use must never go through.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import redis

from loadtests.harness.processes import free_port


class PrivateRedis:
    """A ``redis-server`` of the bench's own on a free port, to kill and start again."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
