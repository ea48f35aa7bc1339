"""A tenant's limits through a Redis outage and under a CPU hog, on three gateway processes (issue 28, item 4).

Usage::

    python -m loadtests.proofs.limits_outage [--rpm 60] [--rate 20] [--outage-s 10] [--window-s 60]
                                      [--hog-rate 50] [--hog-seconds 30] [--baseline 770bd5b]
                                      [--rt-requests 500] [--rt-rate 50]
                                      [--parts roundtrips,hog,outage] [--out loadtests/results/limits_outage]

Three gateway processes (``serve --workers 2`` and a ``serve``, pinned to core 1) share the real
Redis at 127.0.0.1:6379 under a private key prefix, through a proxy on a thread of this process
(``loadtests/harness/delay_proxy.py``); one simulated engine (core 0) answers in a few ms.

**outage**: a tenant with ``rpm`` (60) sends ``--rate`` requests a second (20: ten times its
limit), two thirds to the ``--workers 2`` port and one third to the other, so each process
gets a third. After a warm-up that empties its bucket, a window of ``--window-s`` (60 s) is
counted; ``--outage-s`` (10 s) into it starts at 20 s: the proxy drops every byte both ways (a
partition: calls time out, nothing fails fast), then passes them again. Reported: the requests
admitted (200) in the window, against the rpm (goal: at most 1.1 x) and against the same
window without an outage (the baseline run), for ``on_store_loss: share`` (the default) and
``open`` (each process the whole limit, the behaviour before).

**hog**: Redis healthy (a private ``redis-server`` on core 0), a process spinning on the
gateways' core; a tenant with limits it never
reaches (rpm 10^6, 1000 slots) sends ``--hog-rate`` requests a second for ``--hog-seconds``.
Reported: the limit store's fall-backs (operations answered by a process alone) of this tree
and of ``--baseline`` (the revision before), in the same run (goal: none).

**roundtrips**: one gateway process, its ledger syncs spaced to 5 s and no prefix view; the
proxy counts what it writes to Redis (a command, or a pipeline, is one write: a round trip)
while a tenant without limits, then one with rpm, tpm and max_concurrent, sends
``--rt-requests``. The difference per request is the limit store's cost (issue 28, item 5):
2.03 before leases (an admission and a settlement script each), a fraction of one with them
(``gateway/limitstore/lease.py``; ``loadtests/proofs/limits_round_trips.py`` measures it at 2,000 req/s,
before and after, without the HTTP path). At this low rate it is mostly the leases' renewals
(about two syncs a second per active tenant), which do not grow with the rate.

Each figure is printed with the machine's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from gateway.request.keys import hash_api_key
from loadtests.harness.delay_proxy import DelayProxy
from loadtests.harness.private_redis import PrivateRedis
from loadtests.harness.processes import (
    GATEWAY,
    admin_args,
    admin_url,
    checkout,
    labelled,
    metric_sum,
    metrics,
    pin,
    policy_file,
    process,
)
from loadtests.harness.shared_redis import REDIS_URL, drop_keys

MODEL = "sim-fixed"
KEY = "limits-outage-bench"
FREE = "limits-outage-free"
REDIS_PORT = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
OUTAGE_AT_S = 20.0
WARMUP_S = 15.0


def policy(engine_port: int, redis_url: str, prefix: str, limits: str, mode: str | None, extra: str = "") -> str:
    """One engine, tenant ``bench`` with ``limits`` (and a tenant ``free`` without), the limits in Redis."""
    loss = f", on_store_loss: {mode}" if mode else ""
    return f"""
version: limits-outage-bench
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 3000, itl_ms: 100, e2e_ms: 60000}}, queue: {{max_depth: 256, max_wait_s: 5}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 4096, max_output_tokens: 16}}
backends:
  - {{name: sim-0, url: "http://127.0.0.1:{engine_port}", kind: sim, models: [{MODEL}],
     capacity: {{max_concurrent: 1000, max_tokens_in_flight: 10000000, max_waiting: 1000}}}}
tenants:
  - {{name: bench, key_hashes: ["{hash_api_key(KEY)}"], models: ["*"], default_class: interactive, limits: {limits}}}
  - {{name: free, key_hashes: ["{hash_api_key(FREE)}"], models: ["*"], default_class: interactive}}
state: {{backend: redis, redis_url: "{redis_url}", key_prefix: "{prefix}"{loss}}}
{extra}
health_checks: {{interval_s: 30, timeout_s: 2}}
scrape: {{interval_s: 0}}
retry: {{max_retries: 0}}
breaker: {{consecutive_failures: null, failure_ratio: null}}
"""


@contextmanager
def fleet(
    args: argparse.Namespace, text: str, tree: Path | None = None, *, lone_only: bool = False
) -> Iterator[list[int]]:
    """The engine and the three gateway processes (two ports), or one (``lone_only``); ``tree``:
    another revision's code."""
    engine, pair, lone = args.port, args.port + 1, args.port + 2
    with ExitStack() as stack:
        path = stack.enter_context(policy_file(text))
        sim = [*pin(0), *GATEWAY, "sim", "--profile", "fixed", "--ttft-ms", "5", "--itl-ms", "1"]
        stack.enter_context(
            process([*sim, "--model", MODEL, "--port", str(engine)], f"http://127.0.0.1:{engine}/health")
        )
        shape = ((lone, 1),) if lone_only else ((pair, 2), (lone, 1))
        for port, workers in shape:
            argv = [*pin(1), *GATEWAY, "serve", "--policy", str(path), "--port", str(port), *admin_args(port)]
            argv += ["--workers", str(workers)] if workers > 1 else []
            stack.enter_context(process(argv, f"http://127.0.0.1:{port}/healthz", cwd=tree, timeout_s=60))
        yield [port for port, _ in shape]


async def send(
    rate: float, seconds: float, ports: list[int], answers: list[tuple[float, int, str]], key: str = KEY
) -> None:
    """``rate`` requests a second for ``seconds``, two thirds to the first port (two processes)."""
    rng = random.Random(7)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
    headers = {"authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one(port: int, at: float) -> None:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            try:
                async with session.post(url, json=body, headers=headers) as response:
                    payload = await response.json(content_type=None)
                    code = "" if response.status == 200 else str(payload.get("error", {}).get("code"))
                    answers.append((at, response.status, code))
            except (aiohttp.ClientError, TimeoutError) as exc:
                answers.append((at, 0, type(exc).__name__))

        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        start = loop.time()
        for i in range(int(rate * seconds)):
            at = start + i / rate
            if (delay := at - loop.time()) > 0:
                await asyncio.sleep(delay)
            port = ports[0] if len(ports) == 1 or rng.random() < 2 / 3 else ports[1]
            task = loop.create_task(one(port, time.monotonic()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)


def fallbacks(ports: list[int]) -> dict[str, Any]:
    samples = [metrics(admin_url(port)) for port in ports]
    errors: Counter[str] = Counter()
    for scrape in samples:
        for labels, value in labelled(scrape, "gateway_redis_errors_total").items():
            errors[dict(labels).get("operation", "")] += int(value)
    return {
        "fallback_operations": sum(metric_sum(s, "gateway_redis_fallback_operations_total") for s in samples),
        "redis_errors": sum(errors.values()),
        "redis_errors_by_operation": dict(errors),
    }


async def outage_run(args: argparse.Namespace, mode: str, outage: bool) -> dict[str, Any]:
    prefix = f"limits-outage-{uuid.uuid4().hex[:8]}:"
    load = os.getloadavg()
    with DelayProxy(upstream_port=REDIS_PORT) as proxy:
        text = policy(args.port, proxy.url, prefix, f"{{rpm: {args.rpm}}}", mode)
        try:
            with fleet(args, text) as ports:
                answers: list[tuple[float, int, str]] = []
                seconds = WARMUP_S + args.window_s + 2
                sender = asyncio.create_task(send(args.rate, seconds, ports, answers))
                window_start = time.monotonic() + WARMUP_S
                if outage:
                    await asyncio.sleep(WARMUP_S + OUTAGE_AT_S)
                    proxy.pause()
                    await asyncio.sleep(args.outage_s)
                    proxy.resume()
                await sender
                counters = fallbacks(ports)
        finally:
            drop_keys(REDIS_URL, prefix)
    window = [a for a in answers if window_start <= a[0] < window_start + args.window_s]
    admitted = sum(1 for _, status, _ in window if status == 200)
    return {
        "mode": mode,
        "outage_s": args.outage_s if outage else 0,
        "admitted_in_window": admitted,
        "times_rpm": admitted / args.rpm * 60 / args.window_s,
        "answers_in_window": dict(Counter(f"{status} {code}".strip() for _, status, code in window)),
        **counters,
        "load_average_start": load,
        "load_average_end": os.getloadavg(),
    }


@contextmanager
def hog() -> Iterator[None]:
    """A process spinning on the gateways' core."""
    spinner = subprocess.Popen([*pin(1), sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@contextmanager
def healthy_redis() -> Iterator[PrivateRedis]:
    """A Redis of the bench's own on core 0, away from the hog, and scheduled before anything else
    there when it can be (``chrt``, as root): on a shared 2-core machine a Redis that waits for
    the CPU behind the engine and the client is a slow Redis, and the store rightly falls back."""
    store = PrivateRedis()
    store.start()
    assert store.proc is not None
    pid = str(store.proc.pid)
    if pin(0):
        subprocess.run(["taskset", "-p", "-c", "0", pid], check=True, capture_output=True)
    subprocess.run(["chrt", "-f", "-p", "10", pid], check=False, capture_output=True)
    try:
        yield store
    finally:
        store.kill()


async def hog_run(args: argparse.Namespace, tree: Path | None, label: str) -> dict[str, Any]:
    load = os.getloadavg()
    with healthy_redis() as store:
        text = policy(args.port, store.url, "limits-hog:", "{rpm: 1000000, max_concurrent: 1000}", None)
        with fleet(args, text, tree) as ports, hog():
            answers: list[tuple[float, int, str]] = []
            await send(args.hog_rate, args.hog_seconds, ports, answers)
            counters = fallbacks(ports)
    return {
        "code": label,
        "requests": len(answers),
        "answers": dict(Counter(f"{status} {code}".strip() for _, status, code in answers)),
        **counters,
        "load_average_start": load,
        "load_average_end": os.getloadavg(),
    }


QUIET = "fleet: {sync_interval_s: 5, lease_ttl_s: 30, prefix_view: false}"
"""Background Redis traffic down to a few commands a second, so that what is left is per request."""


async def roundtrips_run(args: argparse.Namespace) -> dict[str, Any]:
    """Round trips to Redis per request from one gateway process (the commands, or pipelines, it
    writes, counted by the proxy in front of Redis): for a tenant with rpm, tpm and
    max_concurrent, for one without limits (what is left: ledger syncs, pings), and the difference."""
    prefix = f"limits-rt-{uuid.uuid4().hex[:8]}:"
    limits = "{rpm: 1000000, tpm: 1000000000, max_concurrent: 1000}"
    per_request: dict[str, float] = {}
    load = os.getloadavg()
    try:
        with DelayProxy(upstream_port=REDIS_PORT) as proxy:
            text = policy(args.port, proxy.url, prefix, limits, None, QUIET)
            with fleet(args, text, lone_only=True) as ports:
                for key, label in ((FREE, "no limits"), (KEY, "rpm, tpm and max_concurrent")):
                    before = proxy.sent
                    answers: list[tuple[float, int, str]] = []
                    await send(args.rt_rate, args.rt_requests / args.rt_rate, ports, answers, key)
                    served = sum(1 for _, status, _ in answers if status == 200)
                    per_request[label] = (proxy.sent - before) / served
    finally:
        drop_keys(REDIS_URL, prefix)
    limited, free = per_request["rpm, tpm and max_concurrent"], per_request["no limits"]
    return {"per_request": per_request, "limit_store_per_request": limited - free, "load_average_start": load}


def print_roundtrips(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nRound trips to Redis per request, one gateway process, {args.rt_requests} requests per tenant at "
        f"{args.rt_rate:g} req/s (ledger synced every 5 s, no prefix view); load average "
        f"{report['load_average_start'][0]:.2f}"
    )
    for label, value in report["per_request"].items():
        print(f"  {label:<30} {value:.2f}")
    print(f"  the limit store's (the difference): {report['limit_store_per_request']:.2f}")


def print_outage(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    baseline = next(r for r in runs if not r["outage_s"])["admitted_in_window"]
    print(
        f"\nrpm {args.rpm} over 3 gateway processes, {args.rate:g} req/s offered, window {args.window_s:g} s, "
        f"outage {args.outage_s:g} s from {OUTAGE_AT_S:g} s (proxy dropping every byte)"
    )
    header = f"{'on_store_loss':<14}{'outage':>8}{'admitted':>10}{'x rpm':>8}{'x no outage':>13}{'fall-backs':>12}"
    print(f"{header}  load avg")
    for r in runs:
        print(
            f"{r['mode']:<14}{r['outage_s']:>7g}s{r['admitted_in_window']:>10}{r['times_rpm']:>8.2f}"
            f"{r['admitted_in_window'] / baseline:>13.2f}{r['fallback_operations']:>12.0f}  "
            f"{r['load_average_start'][0]:.2f}"
        )


def print_hog(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nRedis healthy, a CPU hog on the gateways' core, {args.hog_rate:g} req/s for {args.hog_seconds:g} s "
        "(limits never reached)"
    )
    print(f"{'code':<22}{'requests':>10}{'fall-backs':>12}{'redis errors':>14}  load avg  errors by operation")
    for r in runs:
        print(
            f"{r['code']:<22}{r['requests']:>10}{r['fallback_operations']:>12.0f}{r['redis_errors']:>14.0f}  "
            f"{r['load_average_start'][0]:>8.2f}  {r['redis_errors_by_operation']}"
        )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"cpus": os.cpu_count()}
    parts = args.parts.split(",")
    if "roundtrips" in parts:
        report["roundtrips"] = await roundtrips_run(args)
        print_roundtrips(report["roundtrips"], args)
    if "hog" in parts:
        hogs = [await hog_run(args, None, "this tree")]
        with checkout(args.baseline) as tree:
            hogs.append(await hog_run(args, tree, f"{args.baseline} (before)"))
        report["hog"] = hogs
        print_hog(hogs, args)
    if "outage" in parts:
        outages = [
            await outage_run(args, "share", outage=False),
            await outage_run(args, "share", outage=True),
            await outage_run(args, "open", outage=True),
        ]
        report["outage"] = outages
        print_outage(outages, args)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rpm", type=int, default=60)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--outage-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--hog-rate", type=float, default=50.0)
    parser.add_argument("--hog-seconds", type=float, default=30.0)
    parser.add_argument("--baseline", default="770bd5b")
    parser.add_argument("--rt-requests", type=int, default=500)
    parser.add_argument("--rt-rate", type=float, default=50.0)
    parser.add_argument("--parts", default="roundtrips,hog,outage")
    parser.add_argument("--port", type=int, default=29410)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
