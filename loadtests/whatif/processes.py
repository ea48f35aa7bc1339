"""Real processes for a staged side: started, awaited until they answer, scraped, stopped.

A what-if side is a real gateway process in front of simulated engines in processes of their
own (``stage.py``), read through their ``/metrics`` (``replay.py``). These helpers live here, in
the command, because a command may not import the bench's harness (``loadtests/harness/``); the
harness re-exports them for the proofs and the tests, so that there is one of each.

A process is stopped with SIGINT (which lets a wrapping profiler write its output), then SIGKILL
after a grace period.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
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


def bindable(port: int) -> bool:
    """Whether a loopback port is free right now (it can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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
