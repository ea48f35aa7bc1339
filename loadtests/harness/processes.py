"""Processes for benchmarks: simulated engines and the gateway, each its own OS process.

Benchmarks measure real processes (the gateway's CPU and memory are its own, a killed engine
is really gone), started here, waited on until they answer, and stopped with SIGINT (which
lets a wrapping profiler write its output) then SIGKILL after a grace period.

Starting one process, waiting on it, stopping it and scraping its /metrics are
``loadtests/whatif/processes.py``'s (the what-if command stages real processes too, and a command
may not import the harness); they are re-exported here so that a proof or a test finds every
process helper in one place. What only the proofs and the tests need is defined here: many
processes at once, free ports, core pinning, a baseline checkout, a policy file, CPU and memory.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from loadtests.whatif.processes import (
    ADMIN_PORT_OFFSET,
    GATEWAY,
    Labels,
    Samples,
    admin_args,
    admin_url,
    bindable,
    families,
    labelled,
    metric_sum,
    metrics,
    process,
    stop,
    wait_ready,
)

__all__ = [
    "ADMIN_PORT_OFFSET",
    "GATEWAY",
    "Labels",
    "Samples",
    "admin_args",
    "admin_url",
    "bindable",
    "checkout",
    "cpu_seconds",
    "families",
    "free_port",
    "labelled",
    "metric_sum",
    "metrics",
    "pin",
    "policy_file",
    "process",
    "processes",
    "rss_bytes",
    "stop",
    "stop_all",
    "wait_ready",
    "wait_until",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` until it holds; raise ``AssertionError`` naming ``what`` after ``timeout`` seconds.

    How a test or a proof waits on something started elsewhere (a server in a thread, an engine
    in another process): on the condition itself, with a deadline, never a bare sleep. An
    ``AssertionError`` because a test that times out fails with it (``tests/servers.py``
    re-exports this for the tests)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def pin(cpu: int) -> list[str]:
    """A ``taskset`` prefix pinning a command to one core (nothing on a one-core machine)."""
    return ["taskset", "-c", str(cpu)] if (os.cpu_count() or 1) > 1 else []


@contextmanager
def processes(
    specs: list[tuple[list[str], str, dict[str, str] | None]], *, timeout_s: float = 60.0
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``process`` for many at once (command line, ready URL, environment or None for this
    process's): all started together, each awaited until its ready URL
    answers 200, all stopped together (SIGINT to every one, then the waits). A bench that starts
    and stops a whole fleet per run spends its time in start-up and drain otherwise."""
    with ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in specs]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for (argv, _, env), log in zip(specs, logs, strict=True):
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env))
            for proc, (_, url, _), log in zip(procs, specs, logs, strict=True):
                wait_ready(proc, url, log, timeout_s)
            yield procs
        finally:
            stop_all(procs)


def stop_all(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGINT to every process still running, then wait for each (SIGKILL past ``grace_s``)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def checkout(revision: str) -> Iterator[Path]:
    """The tree of git ``revision`` of this repository in a temporary folder (for a baseline run)."""
    with tempfile.TemporaryDirectory(prefix="gateway-baseline-") as folder:
        archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        yield Path(folder)


@contextmanager
def policy_file(text: str) -> Iterator[Path]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(text)
    try:
        yield Path(fh.name)
    finally:
        os.unlink(fh.name)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc."""
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
