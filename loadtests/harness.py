"""Processes for benchmarks: simulated engines and the gateway, each its own OS process.

Benchmarks measure real processes (the gateway's CPU and memory are its own, a killed engine
is really gone), started here, waited on until they answer, and stopped with SIGINT (which
lets a wrapping profiler write its output) then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

GATEWAY = [sys.executable, "-m", "gateway"]
ADMIN_PORT_OFFSET = 1000
"""A bench's gateway on port P serves /metrics on its operator listener at P + 1000, so that
gateways running side by side never compete for the default operator port."""


def admin_args(port: int) -> list[str]:
    """The ``serve`` flags that put the operator listener of a gateway on ``port`` at its bench port."""
    return ["--admin-port", str(port + ADMIN_PORT_OFFSET)]


def admin_url(port: int) -> str:
    """Where the gateway serving on ``port`` answers /metrics (see ``admin_args``)."""
    return f"http://127.0.0.1:{port + ADMIN_PORT_OFFSET}"


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def bindable(port: int) -> bool:
    """Whether a loopback port is free right now (it can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pin(cpu: int) -> list[str]:
    """A ``taskset`` prefix pinning a command to one core (nothing on a one-core machine)."""
    return ["taskset", "-c", str(cpu)] if (os.cpu_count() or 1) > 1 else []


@contextmanager
def process(
    argv: list[str],
    ready_url: str,
    *,
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (in ``env``, else this process's environment; in ``cwd``) until the block ends;
    enter once ``ready_url`` answers 200."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=cwd)
        try:
            wait_ready(proc, ready_url, log, timeout_s)
            yield proc
        finally:
            stop(proc)


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
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="gateway-baseline-") as folder:
        archive = subprocess.run(["git", "-C", str(root), "archive", revision], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        yield Path(folder)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: IO[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}: {log.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


@contextmanager
def policy_file(text: str) -> Iterator[Path]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(text)
    try:
        yield Path(fh.name)
    finally:
        os.unlink(fh.name)


Labels = tuple[tuple[str, str], ...]
"""A sample's labels, sorted by name."""
Samples = dict[tuple[str, Labels], float]
"""Every sample of one scrape, keyed by (name, labels)."""


def families(base_url: str) -> list[Metric]:
    """The metric families on the Prometheus endpoint at ``base_url`` (its /metrics), as parsed by
    ``prometheus_client`` (a counter's family name without its ``_total``)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def metrics(base_url: str) -> Samples:
    """Every sample of the Prometheus endpoint at ``base_url``, keyed by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families(base_url)
        for sample in family.samples
    }


def labelled(samples: Samples, name: str) -> dict[Labels, float]:
    """Each sample called ``name``, by its labels."""
    return {labels: value for (n, labels), value in samples.items() if n == name}


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    wanted = labels.items()
    return sum(value for have, value in labelled(samples, name).items() if wanted <= dict(have).items())


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc."""
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
