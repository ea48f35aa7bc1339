"""A port already taken: one line naming the listener, the address and the flag, exit status 1.

``serve`` and ``serve --workers N`` as real processes, each of their two listeners held by a
test socket on a free port: listening (another gateway running), listening in a
``SO_REUSEPORT`` group (another ``serve --workers`` of the same user, which the kernel would let
the set join silently), or only bound (another gateway still starting: it listens a moment
later, which used to end the later gateway in a traceback, after its workers had started).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.policy_builder import session_policy
from tests.servers import wait_until

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 30

MODES = {"serve": (), "serve --workers 2": ("--workers", "2")}
LISTENERS = {
    "API": (
        "--port",
        "the API listener",
        "--port N to choose another port (0 picks a free one), or set GATEWAY_PORT=N",
    ),
    "operator": (
        "--admin-port",
        "the operator listener (/metrics, /admin/*, /healthz, /readyz)",
        "--admin-port N to choose another port (0 picks a free one), or set GATEWAY_ADMIN_PORT=N",
    ),
}
IN_USE = "the port is already in use (another gateway, or another program, holds it)"


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(session_policy())
    return str(path)


def holder(*, reuseport: bool = False, listen: bool = True) -> socket.socket:
    """A test socket on a free loopback port: a gateway running (listening), a set's group
    (``reuseport``), or a gateway still starting (bound with ``SO_REUSEADDR``, not yet listening)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    if listen:
        sock.listen()
    return sock


def serve(policy: str, mode: str, flag: str, port: int) -> list[str]:
    """``serve`` with ``flag`` on ``port`` and the other listener on port 0."""
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", policy, *MODES[mode]]
    other = "--admin-port" if flag == "--port" else "--port"
    return [*argv, flag, str(port), other, "0", "--log-level", "info"]


@dataclass
class Started:
    """A gateway process and what it wrote to stderr so far (read by a thread: a full pipe blocks it)."""

    proc: subprocess.Popen[bytes]
    lines: list[str] = field(default_factory=list)

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)


@contextmanager
def started(argv: list[str]) -> Iterator[Started]:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    running = Started(proc)
    assert proc.stderr is not None
    pipe = proc.stderr

    def read() -> None:
        for raw in pipe:
            running.lines.append(raw.decode(errors="replace").rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield running
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
        pipe.close()


def exit_of(running: Started) -> int | None:
    """The exit status once the process has ended within the deadline; None if it still runs."""
    deadline = time.monotonic() + DEADLINE_S
    while running.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return running.proc.poll()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "kind",
    ["listening", "in a reuseport group"],
    ids=["held by a running gateway", "held by another set of workers"],
)
@pytest.mark.parametrize("listener", LISTENERS, ids=["the API port", "the operator port"])
def test_a_taken_port_is_one_line_naming_the_listener_and_the_flag_and_exit_1(
    policy: str, mode: str, kind: str, listener: str
) -> None:
    flag, name, fix = LISTENERS[listener]
    with holder(reuseport=kind == "in a reuseport group") as taken:
        port = taken.getsockname()[1]
        with started(serve(policy, mode, flag, port)) as running:
            status = exit_of(running)
            lines = list(running.lines)
    assert status == 1, f"still running or exited {status}:\n" + "\n".join(lines)
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    assert lines[-1] == f"cannot start: {name} cannot listen on 127.0.0.1:{port}: {IN_USE}; pass {fix}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("listener", LISTENERS, ids=["the API port", "the operator port"])
def test_a_port_another_gateway_bound_first_but_listens_on_later_is_refused_to_it_not_to_us(
    policy: str, mode: str, listener: str
) -> None:
    """Two gateways starting at once: the other bound the port first (``SO_REUSEADDR``, both may) and
    listens a moment later. From its bind on the port is this gateway's: the other's ``listen``
    fails, and this one serves on."""
    flag, _, _ = LISTENERS[listener]
    with holder(listen=False) as other:
        port = other.getsockname()[1]
        with started(serve(policy, mode, flag, port)) as running:
            bound = "worker 0 started" if mode != "serve" else "listening: API on"
            wait_until(lambda: running.said(bound) or running.proc.poll() is not None, DEADLINE_S, what=bound)
            with pytest.raises(OSError, match="Address already in use"):
                other.listen()
            wait_until(
                lambda: (
                    (running.said("listening: API on") and running.said("Application startup complete"))
                    or running.proc.poll() is not None
                ),
                DEADLINE_S,
                what="the gateway to serve",
            )
            assert running.proc.poll() is None, "\n".join(running.lines)
