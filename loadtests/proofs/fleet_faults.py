"""The fleet through faults, under load: the fleet issue's proof 5.

Usage::

    python -m loadtests.proofs.fleet_faults [--faults redis,replica,added] [--capacity 8] [--load 0.8]
                                     [--seconds 30] [--out loadtests/results/fleet/faults]

The setup of ``loadtests.proofs.fleet_capacity`` (two simulated engines of capacity C, gateway
processes sharing a Redis, the engines sampled at 20 Hz), but with a private ``redis-server``
that can be killed, and a load *below* capacity (``--load``, 0.8 of it by default), so that
any refusal is the fault's doing, not overload's. Each fault is a run of its own:

* ``redis``: Redis killed a quarter into the run, started again (empty) 10 s later. Goals: no
  request fails or is refused because of it, the engines never hold more than C, and every
  gateway syncs with the ledger again after it is back.
* ``replica``: the lone ``serve`` is SIGKILLed a third into the run and taken out of the
  flood's targets at once (as a Service drops an endpoint whose pod died; the seconds a real
  one takes are the load balancer's, not the gateway's). Goal: the part it held returns to
  the others within ``fleet.lease_ttl_s`` (2 s), read from their
  ``gateway_fleet_quota_requests``. The requests in flight on the killed process are lost with
  it (the client sees the connection drop) and are counted apart.
* ``added``: a ``serve`` is started a third into the run beside the ``--workers 2`` set and
  added to the flood's targets once healthy. Goal: it takes its part (its quota above 0) and
  serves requests, within a few syncs.

Every answer is counted by status, and the machine's load average is printed with each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from loadtests.harness.private_redis import PrivateRedis
from loadtests.harness.processes import (
    GATEWAY,
    admin_args,
    admin_url,
    metric_sum,
    metrics,
    pin,
    policy_file,
    process,
)
from loadtests.proofs.fleet_capacity import MODEL, SECONDS_PER_REQUEST, flood, policy, sample

LEASE_S = 2.0


def quota(port: int, backend: str) -> float:
    """The requests a gateway (all its workers) may hold on ``backend``."""
    return metric_sum(metrics(admin_url(port)), "gateway_fleet_quota_requests", backend=backend)


def syncs_ok(port: int) -> float:
    return metric_sum(metrics(admin_url(port)), "gateway_fleet_syncs_total", result="ok")


async def run_fault(args: argparse.Namespace, fault: str) -> dict[str, Any]:
    engine_ports = [args.engine_port, args.engine_port + 1]
    engines = [f"http://127.0.0.1:{port}" for port in engine_ports]
    store = PrivateRedis()
    store.start()
    load = os.getloadavg()
    text = policy(engine_ports, args.capacity, f"faults-{uuid.uuid4().hex[:8]}:").replace(
        "redis://127.0.0.1:6379/0", store.url
    )
    events: dict[str, Any] = {"fault": fault}
    with ExitStack() as stack:
        stack.callback(store.kill)
        path = stack.enter_context(policy_file(text))
        sim = [*pin(0), *GATEWAY, "sim", "--profile", "fixed", "--ttft-ms", "100", "--itl-ms", "20"]
        sim += ["--model", MODEL, "--port", str(engine_ports[0]), "--count", "2"]
        stack.enter_context(process(sim, engines[1] + "/health"))

        def serve(port: int, workers: int = 1) -> list[str]:
            argv = [*pin(1), *GATEWAY, "serve", "--policy", str(path), "--port", str(port), *admin_args(port)]
            return argv + (["--workers", str(workers)] if workers > 1 else [])

        pair, lone = args.gateway_port, args.gateway_port + 1
        stack.enter_context(process(serve(pair, 2), f"http://127.0.0.1:{pair}/healthz"))
        lone_proc = None
        if fault != "added":
            lone_proc = stack.enter_context(process(serve(lone), f"http://127.0.0.1:{lone}/healthz"))
        urls = [f"http://127.0.0.1:{pair}"] + ([f"http://127.0.0.1:{lone}"] if lone_proc else [])
        statuses: Counter[str] = Counter()
        by_url: Counter[str] = Counter()
        peaks: dict[str, dict[str, float]] = {}
        stopped = asyncio.Event()
        sampler = asyncio.create_task(sample(engines, 20.0, stopped, peaks))
        rate = args.load * 2 * args.capacity / SECONDS_PER_REQUEST
        loop = asyncio.get_running_loop()
        started = loop.time()
        load_task = asyncio.create_task(flood(urls, rate, args.seconds, statuses, seed=3, by_url=by_url))
        if fault == "redis":
            await asyncio.sleep(args.seconds / 4)
            before = [syncs_ok(pair), syncs_ok(lone)]
            store.kill()
            events["killed_at_s"] = loop.time() - started
            await asyncio.sleep(10)
            store.start()
            events["restarted_at_s"] = loop.time() - started
            resumed = await _until(lambda: syncs_ok(pair) > before[0] and syncs_ok(lone) > before[1], 10)
            events["coordination_resumed_after_s"] = resumed
        elif fault == "replica":
            await asyncio.sleep(args.seconds / 3)
            held = [quota(lone, f"sim-{i}") for i in range(2)]
            assert lone_proc is not None
            lone_proc.send_signal(signal.SIGKILL)
            urls.remove(f"http://127.0.0.1:{lone}")
            events["killed_replica_held"] = held
            back = await _until(lambda: all(quota(pair, f"sim-{i}") == args.capacity for i in range(2)), LEASE_S * 5)
            events["part_back_after_s"] = back
            events["lease_ttl_s"] = LEASE_S
        else:
            await asyncio.sleep(args.seconds / 3)
            stack.enter_context(process(serve(lone), f"http://127.0.0.1:{lone}/healthz"))
            added_at = loop.time()
            urls.append(f"http://127.0.0.1:{lone}")
            took = await _until(lambda: all(quota(lone, f"sim-{i}") > 0 for i in range(2)), 10)
            events["new_replica_took_its_part_after_s"] = took
            events["new_replica_quota"] = [quota(lone, f"sim-{i}") for i in range(2)]
            events["added_at_s"] = added_at - started
        await load_task
        stopped.set()
        samples = await sampler
    bounds_held = all(p["requests"] <= args.capacity and p["batch"] <= args.capacity * 0.5 for p in peaks.values())
    report = {
        **events,
        "rate": rate,
        "statuses": dict(statuses),
        "by_gateway": dict(by_url),
        "peaks": peaks,
        "samples": samples,
        "bounds_held": bounds_held,
        "load_average_start": load,
        "load_average_end": os.getloadavg(),
    }
    print(json.dumps(report, default=str), flush=True)
    return report


async def _until(condition: Any, within_s: float) -> float | None:
    """Seconds until ``condition()`` holds (polled every 20 ms, off the loop), None past ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if await asyncio.to_thread(condition):
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--faults", default="redis,replica,added")
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.8, help="the flood as a share of the fleet's capacity")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--engine-port", type=int, default=28921)
    parser.add_argument("--gateway-port", type=int, default=28930)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    reports = {fault: asyncio.run(run_fault(args, fault)) for fault in args.faults.split(",")}
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(reports, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
