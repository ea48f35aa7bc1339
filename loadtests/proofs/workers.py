"""One gateway process against ``serve --workers 2``, in one run: CPU per request and throughput.

Usage::

    python -m loadtests.proofs.workers [--rates 250,400] [--phase-s 5] [--rounds 3] [--connections 64]
                                [--out loadtests/results/workers/NAME]

It starts a zero-delay simulated engine (profile ``instant``), then ``serve --workers 1`` and
``serve --workers 2`` in front of it, side by side, and for each rate R sends an open-loop
Poisson load of R per gateway process to each, in short alternating phases (several rounds, so
that both see the same machine noise): R req/s to the one process, 2R to the two workers, so
that every process works at the same pace (a process's CPU per request falls as its load rises:
more requests share each turn of its event loop, and the ceiling is a process at full load).
The load goes over a pool of ``--connections`` keep-alive connections, requests assigned to
them in turn, as many clients would hold them; the kernel spreads those connections over the
workers (``gateway/workers/sockets.py``), and the split is reported from the merged
``/metrics`` (``gateway_requests_total`` by ``worker``).

What it reports per rate and mode: latency P50 and P99, errors, the throughput achieved (answers
per second of the phase), and the CPU the gateway's processes used per request (from ``/proc``:
every worker, and the supervisor apart). Why CPU per request: on a machine where the load
generator and the engine share the gateway's cores (this one has 2), a throughput ceiling
measures the machine, not the gateway. The ceiling each mode would reach with its own cores is
``cores / CPU per request``: one worker is bound by one core (one event loop), N workers by N;
the scale-out figure is ``N x CPU per request of one worker / CPU per request of N workers``
(the goal of the issue: at least 1.7 for 2 workers). On a machine with free cores, raise
``--rates`` until one process saturates: the achieved throughput is then the ceiling itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from loadtests.harness.processes import admin_args, admin_url, cpu_seconds, labelled, metrics, process
from loadtests.proofs.overhead import API_KEY, CHAT_BODY, MODEL, _policy

MODES = {"one process": 1, "2 workers": 2}


@dataclass
class Phase:
    """One mode at one rate, accumulated over rounds (latencies in seconds)."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    seconds: float = 0.0
    workers_cpu_s: float = 0.0
    supervisor_cpu_s: float = 0.0
    by_worker: Counter[str] = field(default_factory=Counter)


@dataclass
class Gateway:
    """A running ``serve``: its URL, and the pids whose CPU counts (the supervisor's apart)."""

    url: str
    port: int
    workers: int
    pid: int

    def worker_pids(self) -> list[int]:
        return children(self.pid) if self.workers > 1 else [self.pid]

    def cpu(self) -> tuple[float, float]:
        """(CPU seconds of the workers, of the supervisor) so far."""
        workers = sum(cpu_seconds(pid) for pid in self.worker_pids())
        return workers, cpu_seconds(self.pid) if self.workers > 1 else 0.0

    def served_by_worker(self) -> Counter[str]:
        samples = labelled(metrics(admin_url(self.port)), "gateway_requests_total")
        served: Counter[str] = Counter()
        for labels, value in samples.items():
            served[dict(labels).get("worker", "0")] += int(value)
        return served


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    found.append(int(entry.name))
    return found


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, out: Phase) -> None:
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    try:
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            if response.status != 200:
                out.errors[f"HTTP {response.status}"] += 1
                return
    except aiohttp.ClientError as exc:
        out.errors[type(exc).__name__] += 1
        return
    out.latencies.append(time.perf_counter() - start)


async def _phase(
    sessions: list[aiohttp.ClientSession], url: str, rate: float, seconds: float, out: Phase, seed: int
) -> None:
    """Open-loop Poisson arrivals at ``rate`` for ``seconds``, each on the next connection in turn."""
    body = json.dumps(CHAT_BODY).encode()
    rng = random.Random(seed)
    pool = itertools.cycle(sessions)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    start = next_at = loop.time()
    while next_at < start + seconds:
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = loop.create_task(_one(next(pool), url, body, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        out.sent += 1
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    out.seconds += loop.time() - start


async def _measure(
    gateway: Gateway, sessions: list[aiohttp.ClientSession], rate: float, seconds: float, seed: int, out: Phase
) -> None:
    """One phase against ``gateway``: its load, the CPU its processes used, who served it."""
    before = gateway.served_by_worker()
    workers_before, supervisor_before = gateway.cpu()
    await _phase(sessions, gateway.url + "/v1/chat/completions", rate, seconds, out, seed)
    workers_after, supervisor_after = gateway.cpu()
    out.workers_cpu_s += workers_after - workers_before
    out.supervisor_cpu_s += supervisor_after - supervisor_before
    out.by_worker.update(gateway.served_by_worker() - before)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def _figures(phase: Phase) -> dict[str, object]:
    done = len(phase.latencies)
    cpu_ms = (phase.workers_cpu_s + phase.supervisor_cpu_s) * 1000 / done if done else float("nan")
    return {
        "sent": phase.sent,
        "answered": done,
        "errors": dict(phase.errors),
        "throughput_per_s": done / phase.seconds if phase.seconds else 0.0,
        "p50_ms": _pct(phase.latencies, 50),
        "p99_ms": _pct(phase.latencies, 99),
        "cpu_ms_per_request": cpu_ms,
        "supervisor_cpu_ms_per_request": phase.supervisor_cpu_s * 1000 / done if done else float("nan"),
        "served_by_worker": dict(sorted(phase.by_worker.items())),
    }


def _compare(results: dict[str, Phase]) -> dict[str, object]:
    """Each mode's figures, the ceiling each would reach on its own cores, and the scale-out."""
    out: dict[str, object] = {mode: _figures(phase) for mode, phase in results.items()}
    one = out["one process"]["cpu_ms_per_request"]  # type: ignore[index]
    two = out["2 workers"]["cpu_ms_per_request"]  # type: ignore[index]
    out["ceiling_one_core_per_s"] = 1000 / one
    out["ceiling_two_cores_per_s"] = 2 * 1000 / two
    out["scale_out"] = 2 * one / two
    return out


def _print(rate: float, report: dict[str, object]) -> None:
    for mode in MODES:
        f = report[mode]
        assert isinstance(f, dict)
        print(
            f"{rate * MODES[mode]:>6.0f} req/s | {mode:<11} | P50 {f['p50_ms']:6.2f} P99 {f['p99_ms']:7.2f} ms "
            f"| {f['throughput_per_s']:7.1f} answers/s, errors {sum(f['errors'].values())} "
            f"| CPU {f['cpu_ms_per_request']:.3f} ms/req (supervisor {f['supervisor_cpu_ms_per_request']:.3f}) "
            f"| by worker {f['served_by_worker']}",
            flush=True,
        )
    print(
        f"{'':>6} ceilings on their own cores: one process {report['ceiling_one_core_per_s']:.0f} req/s (1 core), "
        f"2 workers {report['ceiling_two_cores_per_s']:.0f} req/s (2 cores): scale-out x{report['scale_out']:.2f}",
        flush=True,
    )


async def _run(args: argparse.Namespace, gateways: dict[str, Gateway]) -> dict[str, object]:
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=60))
        for _ in range(args.connections)
    ]
    report: dict[str, object] = {}
    try:
        for gateway in gateways.values():  # open the connections and warm both up
            await _phase(sessions, gateway.url + "/v1/chat/completions", 100, 1.0, Phase(), 0)
        for rate in args.rates:
            results = {mode: Phase() for mode in gateways}
            for round_no in range(args.rounds):
                for mode, gateway in gateways.items():
                    load = rate * gateway.workers  # the same load on each process
                    await _measure(gateway, sessions, load, args.phase_s, round_no, results[mode])
            report[str(rate)] = _compare(results)
            _print(rate, report[str(rate)])  # type: ignore[arg-type]
    finally:
        for session in sessions:
            await session.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rates", default="250,400", help="req/s per gateway process")
    parser.add_argument("--phase-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--backend-port", type=int, default=18601)
    parser.add_argument("--port", type=int, default=18600, help="one process; 2 workers on PORT + 10")
    parser.add_argument("--out", default=None, help="write the figures as JSON to OUT.json")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    backend = f"http://127.0.0.1:{args.backend_port}"
    exe = [sys.executable, "-m", "gateway"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as policy:
        policy.write(_policy(backend))
    sim = [*exe, "sim", "--profile", "instant", "--model", MODEL, "--port", str(args.backend_port)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(sim, backend + "/health"))
        gateways = {}
        for offset, (mode, workers) in enumerate(MODES.items()):
            port = args.port + 10 * offset
            serve = [*exe, "serve", "--policy", policy.name, "--port", str(port), "--workers", str(workers)]
            proc = stack.enter_context(process([*serve, *admin_args(port)], admin_url(port) + "/readyz", timeout_s=60))
            gateways[mode] = Gateway(f"http://127.0.0.1:{port}", port, workers, proc.pid)
        cores = os.cpu_count()
        print(
            f"workers benchmark: {cores} cores, load average "
            + " ".join(f"{x:.2f}" for x in os.getloadavg())
            + f"; backend {backend} (instant); one process on {gateways['one process'].url}, 2 workers on "
            f"{gateways['2 workers'].url}; {args.connections} keep-alive connections; open-loop phases of "
            f"{args.phase_s}s x {args.rounds} rounds per mode, alternating; nothing pinned",
            flush=True,
        )
        report = asyncio.run(_run(args, gateways))
    report["cores"] = cores
    report["load_average"] = list(os.getloadavg())
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    os.unlink(policy.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
