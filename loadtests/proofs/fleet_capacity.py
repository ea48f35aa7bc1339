"""Several gateway processes, one capacity: the fleet issue's proof 1, measured at the engines.

Usage::

    python -m loadtests.proofs.fleet_capacity [--capacity 8] [--overload 5] [--seconds 20] [--sample-hz 20]
                                       [--out loadtests/results/fleet/capacity]

Two simulated engines (profile ``fixed``: 100 ms to the first token, 20 ms a token, 64 tokens,
no batch limit of their own, so that only the gateways bound them) behind three gateway
processes sharing Redis (``state.backend: redis``, ``gateway/fleet/``): one ``serve --workers 2``
and one ``serve`` of its own when the gateway has ``--workers``, else three ``serve``. The
policy gives each engine ``max_concurrent`` C and batch ``max_share`` 0.5; the engines receive
each request's class rank as ``priority`` (``engine_priority``), which the simulator counts.

An open-loop Poisson flood at ``--overload`` times the fleet's capacity (2 C requests at once,
each ~1.4 s: ~11 req/s at C 8), half interactive and half batch tenants, every request sent to
one of the three gateways at random. Meanwhile each engine's own ``/metrics`` is sampled at
``--sample-hz``: requests in the engine (running or waiting) and batch ones among them.

Reported, with the machine's load average: the most each engine ever held and the most batch
requests it held (goals: never above C, never above 0.5 C), every answer by status (goal: only
200 and explicit 429/503 refusals, nothing lost), and the engines' peak against C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import uuid
from collections import Counter
from contextlib import ExitStack, suppress
from pathlib import Path

import aiohttp

from gateway.request.keys import hash_api_key
from loadtests.harness.processes import GATEWAY, admin_args, metrics, pin, policy_file, process

MODEL = "sim-fixed"
KEYS = {"interactive": "fleet-bench-interactive", "batch": "fleet-bench-batch"}
TOKENS = 64
SECONDS_PER_REQUEST = 0.1 + TOKENS * 0.02


def policy(engine_ports: list[int], capacity: int, prefix: str, shared: bool = True) -> str:
    backends = "\n".join(
        f'  - {{name: sim-{i}, url: "http://127.0.0.1:{port}", kind: sim, models: [{MODEL}], engine_priority: true,'
        f" capacity: {{max_concurrent: {capacity}, max_tokens_in_flight: 10000000, max_waiting: 1000}}}}"
        for i, port in enumerate(engine_ports)
    )
    tenants = "\n".join(
        f'  - {{name: {name}, key_hashes: ["{hash_api_key(key)}"], models: ["*"], default_class: {name}}}'
        for name, key in KEYS.items()
    )
    state = f'state: {{backend: redis, redis_url: "redis://127.0.0.1:6379/0", key_prefix: "{prefix}", timeout_ms: 500}}'
    return f"""
version: fleet-capacity-bench
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 3000, itl_ms: 100, e2e_ms: 60000}}, queue: {{max_depth: 64, max_wait_s: 5}}}}
  batch: {{rank: 1, max_share: 0.5, slo: {{ttft_ms: 10000, itl_ms: 200, e2e_ms: 120000}},
          queue: {{max_depth: 64, max_wait_s: 10}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 4096, max_output_tokens: {TOKENS}}}
backends:
{backends}
tenants:
{tenants}
{state if shared else ""}
fleet: {{sync_interval_s: 0.05, lease_ttl_s: 2}}
health_checks: {{interval_s: 30, timeout_s: 2}}
scrape: {{interval_s: 0}}
retry: {{max_retries: 0}}
breaker: {{consecutive_failures: null, failure_ratio: null}}
"""


def has_workers() -> bool:
    done = subprocess.run([*GATEWAY, "serve", "--help"], capture_output=True, text=True, timeout=60)
    return "--workers" in done.stdout


async def flood(
    urls: list[str], rate: float, seconds: float, statuses: Counter[str], seed: int, by_url: Counter[str] | None = None
) -> None:
    """Poisson arrivals at ``rate`` for ``seconds``, each to a gateway picked from ``urls`` when it
    is sent (a caller may change the list meanwhile, as a load balancer's endpoints change)."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(url: str, tenant: str) -> None:
            body = {"model": MODEL, "max_tokens": TOKENS, "messages": [{"role": "user", "content": "hello " * 20}]}
            headers = {"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"}
            try:
                async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
                    await response.read()
                    statuses[f"{tenant} {response.status}"] += 1
                    if by_url is not None:
                        by_url[f"{url} {response.status}"] += 1
            except aiohttp.ClientError as exc:
                statuses[f"{tenant} {type(exc).__name__}"] += 1
                if by_url is not None:
                    by_url[f"{url} {type(exc).__name__}"] += 1

        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        start = loop.time()
        next_at = start
        while next_at < start + seconds:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(one(rng.choice(urls), rng.choice(list(KEYS))))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(tasks, timeout=120)


async def sample(engines: list[str], hz: float, stop: asyncio.Event, peaks: dict[str, dict[str, float]]) -> int:
    count = 0
    while not stop.is_set():
        for url in engines:
            samples = await asyncio.to_thread(metrics, url)
            held = batch = 0.0
            for (name, labels), value in samples.items():
                if name == "sim:num_requests_by_priority":
                    held += value
                    if dict(labels).get("priority") == "1":
                        batch += value
            peak = peaks.setdefault(url, {"requests": 0.0, "batch": 0.0})
            peak["requests"] = max(peak["requests"], held)
            peak["batch"] = max(peak["batch"], batch)
        count += 1
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1 / hz)
    return count


async def measure(args: argparse.Namespace, gateways: list[str], engines: list[str]) -> dict[str, object]:
    statuses: Counter[str] = Counter()
    peaks: dict[str, dict[str, float]] = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(engines, args.sample_hz, stop, peaks))
    rate = args.overload * 2 * args.capacity / SECONDS_PER_REQUEST
    await flood(gateways, rate, args.seconds, statuses, seed=1)
    stop.set()
    samples = await sampler
    return {"rate": rate, "capacity": args.capacity, "statuses": dict(statuses), "peaks": peaks, "samples": samples}


def run(args: argparse.Namespace, shared: bool) -> dict[str, object]:
    """One flood against the three gateway processes; ``shared`` puts the capacity in Redis."""
    engine_ports = [args.engine_port, args.engine_port + 1]
    engines = [f"http://127.0.0.1:{port}" for port in engine_ports]
    prefix = f"fleet-bench-{uuid.uuid4().hex[:8]}:"
    workers = has_workers()
    ports = [args.gateway_port, args.gateway_port + 1] if workers else [args.gateway_port + i for i in range(3)]
    load = os.getloadavg()
    with ExitStack() as stack:
        path = stack.enter_context(policy_file(policy(engine_ports, args.capacity, prefix, shared)))
        sim = [*pin(0), *GATEWAY, "sim", "--profile", "fixed", "--ttft-ms", "100", "--itl-ms", "20"]
        sim += ["--model", MODEL, "--port", str(engine_ports[0]), "--count", "2"]
        stack.enter_context(process(sim, engines[1] + "/health"))
        for i, port in enumerate(ports):
            serve = [*pin(1), *GATEWAY, "serve", "--policy", str(path), "--port", str(port), *admin_args(port)]
            if workers and i == 0:
                serve += ["--workers", "2"]
            stack.enter_context(process(serve, f"http://127.0.0.1:{port}/healthz"))
        shape = "one `serve --workers 2` and one `serve`" if workers else "three `serve`"
        store = "sharing Redis" if shared else "with no shared store (each takes the whole capacity: the baseline)"
        print(
            f"fleet capacity: {shape} {store}, 2 engines of capacity {args.capacity} each, "
            f"flood at {args.overload:g}x capacity for {args.seconds:g}s; "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
            flush=True,
        )
        report = asyncio.run(measure(args, [f"http://127.0.0.1:{p}" for p in ports], engines))
    report.update(gateways=shape, shared=shared, load_average_start=load, load_average_end=os.getloadavg())
    peaks = report["peaks"]
    assert isinstance(peaks, dict)
    for url, peak in peaks.items():
        print(
            f"  engine {url}: most requests held {peak['requests']:.0f} (capacity {args.capacity}), "
            f"most batch held {peak['batch']:.0f} (max_share 0.5: {args.capacity * 0.5:g})",
            flush=True,
        )
    print(f"  answers: {report['statuses']}; {report['samples']} samples per engine at {args.sample_hz:g} Hz")
    statuses = report["statuses"]
    assert isinstance(statuses, dict)
    held = all(p["requests"] <= args.capacity and p["batch"] <= args.capacity * 0.5 for p in peaks.values())
    answered = all(key.split()[1] in ("200", "429", "503") for key in statuses)
    report.update(bounds_held=held, all_answered=answered)
    print(f"  bounds held: {held}; every request answered with 200/429/503: {answered}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--overload", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--sample-hz", type=float, default=20.0)
    parser.add_argument("--engine-port", type=int, default=28901)
    parser.add_argument("--gateway-port", type=int, default=28910)
    parser.add_argument("--baseline", action="store_true", help="also run without a shared store, for contrast")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    reports = {"shared": run(args, shared=True)}
    if args.baseline:
        reports["baseline"] = run(args, shared=False)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(reports, indent=2, default=str))
    shared = reports["shared"]
    return 0 if shared["bounds_held"] and shared["all_answered"] else 1


if __name__ == "__main__":
    sys.exit(main())
