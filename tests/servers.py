"""Real servers on loopback ports for the tests.

`serve_in_thread` runs an ASGI app under uvicorn (uvloop, httptools) in a background thread
and returns once the server accepts connections (`server_in_thread` yields the server too, for
a test that stops it half-way); `serve_gateway_in_thread` does the same for the gateway, built
exactly as `inference-gateway serve` builds it (`gateway/server/serve.py`: both listeners, the guarded
protocol) and remembers its operator listener's URL for `admin_url`; `serve_in_process` runs
`python -m gateway serve ...` as a child process on ports the child itself picks; `wait_until`
polls a condition with a deadline, which is how tests synchronise (never a bare sleep; it is the
harness's, `loadtests/harness/processes.py`, re-exported here).
`metric`, `samples` and `metric_types` read a server's /metrics, with the parser the benchmarks
use (`loadtests.harness.processes`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import uvicorn

from gateway.app import build_server
from gateway.policy.snapshot import PolicySnapshot
from gateway.server.serve import GatewayServer
from gateway.settings import Settings
from loadtests.harness.processes import Labels, Samples, families, labelled, metric_sum, metrics
from loadtests.harness.processes import wait_until as wait_until  # re-exported: the tests import it from here

ADMIN_URLS: dict[str, str] = {}
"""API URL -> operator listener URL of every gateway `serve_gateway_in_thread` is running."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serve_in_thread(app: Any, port: int | None = None, **config: Any) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 in a thread; yield its base URL; stop it on exit."""
    with server_in_thread(app, port, **config) as running:
        yield running.url


@dataclass
class ThreadServer:
    """A uvicorn server running in a thread of this process (see ``server_in_thread``)."""

    url: str
    server: uvicorn.Server

    def stop_listening(self) -> None:
        """Begin uvicorn's shutdown: within its next tick (0.1 s) the port refuses connections and
        idle keep-alive connections close; responses in flight go on to their end."""
        self.server.should_exit = True


@contextmanager
def server_in_thread(app: Any, port: int | None = None, **config: Any) -> Iterator[ThreadServer]:
    """``serve_in_thread``, yielding the server too, for a test that stops it half-way (a backend that dies)."""
    port = port or free_port()
    cfg = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning", **config
    )
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what=f"server on port {port} to start")
    try:
        yield ThreadServer(f"http://127.0.0.1:{port}", server)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


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


def scrape(url: str) -> Samples:
    """Every sample on the /metrics of `url`: the operator listener of the test gateway serving
    `url`, else `url` itself (an engine, or the operator listener of a gateway process)."""
    return metrics(admin_url(url))


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when none), from `url`
    (see `scrape`)."""
    return metric_sum(scrape(url), name, **labels)


def samples(url: str, name: str) -> dict[Labels, float]:
    """Each sample called `name` on the /metrics of `url` (see `scrape`), by its sorted labels."""
    return labelled(scrape(url), name)


def metric_types(url: str) -> dict[str, str]:
    """The type of each metric family on the /metrics of `url` (see `scrape`), even one without a
    sample yet; a counter is named without its `_total`."""
    return {family.name: family.type for family in families(admin_url(url))}


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


# What the gateway logs (at INFO) once it listens (``gateway/server/serve.py``): with ``--port 0 --admin-port 0``
# the ports the kernel gave it.
_LISTENING = re.compile(r"listening: API on (http://\S+), operator on (http://\S+)")


@dataclass
class ChildServer:
    """A server in a child process: the process, its base URL, and what it wrote to stderr so far."""

    proc: subprocess.Popen[bytes]
    url: str = ""
    admin_url: str = ""
    lines: list[str] = field(default_factory=list)

    def stderr(self, last: int = 40) -> str:
        """The child's last ``last`` stderr lines, for the message of a failing assertion."""
        return "\n".join(self.lines[-last:])


@contextmanager
def serve_in_process(argv: list[str], timeout: float = 30.0) -> Iterator[ChildServer]:
    """Run ``argv`` (a gateway told ``--port 0 --admin-port 0 --log-level info``) until the block
    ends; enter once it answers ``/healthz``, with its URLs from its log; kill it on exit if it
    still runs. (The URLs are logged when the sockets are bound, before the application has
    started: connections are refused until then.)

    Why port 0: a port taken by the parent and handed to the child can be taken by someone else
    (any outgoing connection of a busy test run) before the child binds it; then the child
    exits and the parent waits for nothing. Why a reader thread: a child writing to a pipe
    nobody reads blocks once the pipe's buffer (64 KiB) is full, in the middle of a log line.
    """
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    child = ChildServer(proc)
    assert proc.stderr is not None
    reader = threading.Thread(target=_drain, args=(proc.stderr, child), name="child-stderr", daemon=True)
    reader.start()
    try:
        try:
            wait_until(lambda: bool(child.url) or proc.poll() is not None, timeout, what=f"{argv!r} to listen")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its stderr:\n{child.stderr()}") from None
        if not child.url:
            raise AssertionError(f"{argv!r} exited {proc.returncode} before listening:\n{child.stderr()}")
        try:
            wait_until(lambda: _answers(child.url + "/healthz") or proc.poll() is not None, timeout, what="/healthz")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its stderr:\n{child.stderr()}") from None
        yield child
    finally:
        _stop(proc, child, reader)


ORPHAN_DRAIN_S = 30.0
"""How long the workers of a killed supervisor get to drain and exit (they have nothing in flight
once the test is over) before they are killed and the test fails for them."""


def _stop(proc: subprocess.Popen[bytes], child: ChildServer, reader: threading.Thread) -> None:
    """Kill the child; give its own children (a supervisor's workers, which drain and exit when it
    dies) ``ORPHAN_DRAIN_S``; then kill them and fail if they were still there.

    Why not just close the pipe after the kill: the workers hold its write end, and closing a
    buffered reader another thread is blocked on waits for that read, in C, where no signal (nor
    pytest-timeout's alarm) reaches it; a worker that never exits then hangs the whole run."""
    descendants = descendant_pids(proc.pid)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not any(process_runs(pid) for pid in descendants), ORPHAN_DRAIN_S, what="its children")
    lingering = [pid for pid in descendants if process_runs(pid)]
    for pid in lingering:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=10)
    if not reader.is_alive():
        assert proc.stderr is not None
        proc.stderr.close()
    if lingering:
        raise AssertionError(
            f"processes {lingering} of {proc.args!r} were still running {ORPHAN_DRAIN_S:.0f}s after it was "
            f"killed (now killed); its stderr:\n{child.stderr(80)}"
        )
    if reader.is_alive():
        raise AssertionError(f"something still holds the stderr of {proc.args!r} open after every process exited")


def descendant_pids(root: int) -> list[int]:
    """Every live process below ``root`` (children, their children...), from ``/proc``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found: list[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def process_runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting to be reaped, has stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200  # type: ignore[no-any-return]
    except OSError:
        return False


def _drain(pipe: IO[bytes], child: ChildServer) -> None:
    """Read the child's stderr to its end (the child closes it when it exits)."""
    for raw in pipe:
        line = raw.decode(errors="replace").rstrip()
        child.lines.append(line)
        found = _LISTENING.search(line)
        if found and not child.url:
            child.admin_url = found.group(2)
            child.url = found.group(1)
