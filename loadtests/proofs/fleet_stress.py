"""The fleet's capacity invariant under stress: three gateway processes, one engine, many runs.

Usage::

    python -m loadtests.proofs.fleet_stress [--runs 20] [--baseline-runs 5] [--capacities 4,8] [--starts 0,8]
                                     [--hogs 0,1] [--delays-ms 0,5,30] [--tokens 300] [--time-scale 0.05]
                                     [--sample-hz 25] [--out loadtests/results/fleet_stress]

What the issue saw, made a bench: one simulated engine (profile ``llama-3.1-8b-h100``, its own
batch limit far above the policy's, so that only the gateways bound it) declared in the policy
with ``max_concurrent`` C and 400,000 tokens; classes interactive (rank 0, queue wait 30 s) and
batch (rank 1, ``max_share`` 0.5, queue wait 60 s); two tenants, one of each class; routing
``least_load``; ``state.backend: redis`` under a key prefix of its own, through a TCP proxy that
delays every reply of Redis by 0, 5 or 30 ms. Three gateway processes: ``serve --workers 2`` and
a second ``serve``, all pinned to core 1 (the engine, Redis's proxy and the clients on core 0),
with or without a CPU hog pinned to core 1 beside them. A cell "at once" starts every process
afresh for each run and sends, as soon as both gateways answer ``/readyz``, 12 C chat requests
at once (``max_tokens`` 300, tenants alternating, spread over the three processes: two thirds to
the workers' port), and waits for every answer. A cell "after 8 s" starts its processes once
and sends each burst 8 s after the gateways were ready or the previous burst ended (the settled
fleet; the start-up race is the "at once" cells' part).

``python -m loadtests.proofs.fleet_stress --scenario fairness [options]`` runs the fairness scenario
instead (``loadtests/proofs/fleet_fairness.py``: a light tenant's time to first byte on one replica
while a neighbour floods another, against the light tenant alone).

Per run: the most requests the engine ever held (``sim:requests_held_max``, counted by the
engine at every submission: exact) and the most it was seen running (``vllm:num_requests_running``
sampled at ``--sample-hz``), the most batch requests it held, the answers by status, the
gateways' fleet syncs that failed and limit-store operations answered by the fallback. Per cell
(capacity, start, hog, Redis delay), over ``--runs`` runs: the peak (goal: never above C, batch
never above C/2), and, against ``--baseline-runs`` runs of one ``serve`` process alone in the
same conditions, the fleet's efficiency: requests served (goal: at least 0.95x one process's)
and refused (at most 1.05x). The engine runs ``--time-scale`` times faster than the profile (a
request of 300 tokens takes about 0.15 s at 0.05: the ledger re-grants faster than at the
profile's speed, the harsher case), which keeps 600 runs (twice as many when two halves of
the grid run side by side) within two hours.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from gateway.request.keys import hash_api_key
from loadtests.harness.delay_proxy import DelayProxy
from loadtests.harness.processes import GATEWAY, free_port, metric_sum, metrics, pin, policy_file
from loadtests.harness.processes import processes as all_running

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEYS = {"interactive": "stress-interactive-key", "batch": "stress-batch-key"}
GATEWAY_CORE, OTHERS_CORE = 1, 0


@dataclass(frozen=True, slots=True)
class Cell:
    capacity: int
    start_after_s: float
    hog: bool
    delay_ms: float

    @property
    def label(self) -> str:
        start = "at once" if not self.start_after_s else f"after {self.start_after_s:g}s"
        return f"C={self.capacity} {start} {'hog' if self.hog else 'no hog'} redis+{self.delay_ms:g}ms"


@dataclass(slots=True)
class Run:
    """One run's figures."""

    processes: int
    held_max: float = 0.0
    running_max: float = 0.0
    batch_max: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    sync_failures: float = 0.0
    fallbacks: float = 0.0
    samples: int = 0
    seconds: float = 0.0

    @property
    def served(self) -> int:
        return sum(n for key, n in self.statuses.items() if key.endswith(" 200"))

    @property
    def refused(self) -> int:
        return sum(n for key, n in self.statuses.items() if not key.endswith(" 200"))


def policy(engine_url: str, capacity: int, redis_url: str, prefix: str) -> str:
    tenants = "\n".join(
        f'  - {{name: {name}, key_hashes: ["{hash_api_key(key)}"], models: ["*"], default_class: {name}}}'
        for name, key in KEYS.items()
    )
    return f"""
version: fleet-stress
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 5000, itl_ms: 100, e2e_ms: 60000}}, queue: {{max_wait_s: 30}}}}
  batch: {{rank: 1, max_share: 0.5, slo: {{ttft_ms: 10000, itl_ms: 200, e2e_ms: 120000}}, queue: {{max_wait_s: 60}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 4096, max_output_tokens: 1024, routing: {{strategy: least_load}}}}
backends:
  - {{name: engine, url: "{engine_url}", kind: sim, models: [{MODEL}],
      engine_priority: true,
      capacity: {{max_concurrent: {capacity}, max_tokens_in_flight: 400000, max_waiting: 100000}}}}
tenants:
{tenants}
state: {{backend: redis, redis_url: "{redis_url}", key_prefix: "{prefix}", timeout_ms: 200}}
health_checks: {{interval_s: 30, timeout_s: 2}}
"""


@contextmanager
def hogging(on: bool) -> Iterator[None]:
    """A busy loop pinned to the gateways' core, while the block runs."""
    if not on:
        yield
        return
    hog = subprocess.Popen([*pin(GATEWAY_CORE), sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def fleet(
    path: Path, processes: int, tree: str | None = None
) -> tuple[list[tuple[list[str], str, dict[str, str] | None]], list[str], list[str]]:
    """``serve --workers 2`` plus one ``serve`` (three processes), or one ``serve``: their command
    lines and ready URLs, their API URLs (the workers' port listed twice: it is two processes)
    and operator URLs. ``tree``: run the gateway from that source tree (an older commit's
    checkout), for a before/after."""
    gateway = GATEWAY if tree is None else [sys.executable, "-P", "-m", "gateway"]  # -P: not the cwd's tree
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    specs: list[tuple[list[str], str, dict[str, str] | None]] = []
    apis: list[str] = []
    admins: list[str] = []
    for workers in [2, 1] if processes == 3 else [1]:
        port, admin = free_port(), free_port()
        argv = [*pin(GATEWAY_CORE), *gateway, "serve", "--policy", str(path), "--port", str(port)]
        argv += ["--admin-port", str(admin), *(["--workers", str(workers)] if workers > 1 else [])]
        specs.append((argv, f"http://127.0.0.1:{port}/readyz", env))
        apis += [f"http://127.0.0.1:{port}"] * workers
        admins.append(f"http://127.0.0.1:{admin}")
    return specs, apis, admins


async def burst(urls: list[str], count: int, tokens: int) -> Counter[str]:
    """``count`` requests at once, tenants alternating, spread over ``urls`` in turn."""
    statuses: Counter[str] = Counter()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one(url: str, tenant: str) -> None:
            body = {"model": MODEL, "max_tokens": tokens, "messages": [{"role": "user", "content": "hello " * 40}]}
            headers = {"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"}
            try:
                async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
                    payload = await response.read()
                    code = "" if response.status == 200 else json.loads(payload).get("error", {}).get("code", "")
                    statuses[f"{tenant} {response.status}{' ' + code if code else ''}"] += 1
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                statuses[f"{tenant} {type(exc).__name__}"] += 1

        tenants = itertools.cycle(KEYS)
        await asyncio.gather(*(one(urls[i % len(urls)], next(tenants)) for i in range(count)))
    return statuses


async def sampled(engine: str, hz: float, stop: asyncio.Event, run: Run) -> None:
    """The engine's running count, ``hz`` times a second, until ``stop``."""
    while not stop.is_set():
        samples = await asyncio.to_thread(metrics, engine)
        run.running_max = max(run.running_max, metric_sum(samples, "vllm:num_requests_running"))
        run.samples += 1
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1 / hz)


async def loaded(apis: list[str], engine: str, run: Run, args: argparse.Namespace, count: int) -> None:
    stop = asyncio.Event()
    sampler = asyncio.create_task(sampled(engine, args.sample_hz, stop, run))
    run.statuses = dict(await burst(apis, count, args.tokens))
    stop.set()
    await sampler


@contextmanager
def setup(cell: Cell, processes: int, args: argparse.Namespace) -> Iterator[tuple[str, list[str], list[str]]]:
    """One engine, Redis behind its delaying proxy, the hog if the cell has one, and the gateway
    processes, started together (the engine is always this tree's simulator: it counts what it
    held; a gateway is ready once it has seen the engine healthy) and stopped together: the
    engine's URL, the API URLs and the operator URLs."""
    engine_port = free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    with ExitStack() as stack:
        sim = [*pin(OTHERS_CORE), *GATEWAY, "sim", "--profile", "llama-3.1-8b-h100", "--port", str(engine_port)]
        proxy = stack.enter_context(DelayProxy(upstream_port=args.redis_port, delay_s=cell.delay_ms / 1000))
        prefix = f"stress-{uuid.uuid4().hex[:8]}:"
        path = stack.enter_context(policy_file(policy(engine, cell.capacity, proxy.url, prefix)))
        stack.enter_context(hogging(cell.hog))
        gateways, apis, admins = fleet(path, processes, args.gateway_pythonpath)
        engine_spec = ([*sim, "--time-scale", str(args.time_scale)], engine + "/health", None)
        stack.enter_context(all_running([engine_spec, *gateways]))
        yield engine, apis, admins


PORT_TAKEN = "port is already in use"
SETUP_ATTEMPTS = 3


def started(stack: ExitStack, cell: Cell, processes: int, args: argparse.Namespace) -> tuple[str, list[str], list[str]]:
    """``setup`` entered on ``stack``, started again on other ports (up to ``SETUP_ATTEMPTS``) when a
    port probed free was taken by another program before the process bound it: the machine is
    shared (a test suite may be running), and no run has begun yet, so nothing is measured twice."""
    for attempt in range(1, SETUP_ATTEMPTS + 1):
        try:
            return stack.enter_context(setup(cell, processes, args))
        except RuntimeError as exc:
            if PORT_TAKEN not in str(exc) or attempt == SETUP_ATTEMPTS:
                raise
            print(f"# {cell.label}: a probed port was taken before it was bound; started again", file=sys.stderr)
    raise AssertionError("unreachable")  # pragma: no cover


def measured(run: Run, engine: str, apis: list[str], admins: list[str], args: argparse.Namespace, count: int) -> Run:
    """One burst of ``count`` requests on a running setup; the engine's peaks are since it
    started, the gateways' counters are this burst's (the difference across it)."""
    started = time.monotonic()
    before = [_counters(admin) for admin in admins]
    asyncio.run(loaded(apis, engine, run, args, count))
    samples = metrics(engine)
    run.held_max = metric_sum(samples, "sim:requests_held_max")
    run.batch_max = metric_sum(samples, "sim:requests_held_max_by_priority", priority="1")
    for admin, (failures, fallbacks) in zip(admins, before, strict=True):
        now_failures, now_fallbacks = _counters(admin)
        run.sync_failures += now_failures - failures
        run.fallbacks += now_fallbacks - fallbacks
    run.seconds = time.monotonic() - started
    return run


def _counters(admin: str) -> tuple[float, float]:
    gateway = metrics(admin)
    return (
        metric_sum(gateway, "gateway_fleet_syncs_total", result="failed"),
        metric_sum(gateway, "gateway_redis_fallback_operations_total"),
    )


def one_run(cell: Cell, processes: int, args: argparse.Namespace) -> Run:
    """A cold run: every process started afresh, the burst as soon as all are ready."""
    with ExitStack() as stack:
        engine, apis, admins = started(stack, cell, processes, args)
        return measured(Run(processes), engine, apis, admins, args, 12 * cell.capacity)


def warm_runs(cell: Cell, args: argparse.Namespace) -> tuple[list[Run], list[Run]]:
    """The runs of a cell whose bursts start ``start_after_s`` after the gateways are ready: one
    fleet and one process alone, each started once for the cell (both idle while the other's
    burst runs); every burst, alternately on the fleet and (every few) on the process alone,
    starts ``start_after_s`` after the previous one has ended, when the fleet is settled. The
    engine counts its peak since it started: a run's peak is the cell's so far, so the first
    run over capacity, if any, marks every later one."""
    fleet_runs: list[Run] = []
    alone: list[Run] = []
    every = max(1, args.runs // max(1, args.baseline_runs))
    count = 12 * cell.capacity
    with ExitStack() as stack:
        three, one = started(stack, cell, 3, args), started(stack, cell, 1, args)
        for index in range(args.runs):
            time.sleep(cell.start_after_s)
            fleet_runs.append(measured(Run(3), *three, args, count))
            if index % every == every - 1 and len(alone) < args.baseline_runs:
                time.sleep(cell.start_after_s)
                alone.append(measured(Run(1), *one, args, count))
        while len(alone) < args.baseline_runs:
            time.sleep(cell.start_after_s)
            alone.append(measured(Run(1), *one, args, count))
    return fleet_runs, alone


def cold_runs(cell: Cell, args: argparse.Namespace) -> tuple[list[Run], list[Run]]:
    """A cell's runs started at once: every run from a cold start (the start-up race is the
    point), one process's runs interleaved with the fleet's (the same conditions, as near as can be)."""
    fleet_runs: list[Run] = []
    alone: list[Run] = []
    every = max(1, args.runs // max(1, args.baseline_runs))
    for index in range(args.runs):
        fleet_runs.append(one_run(cell, 3, args))
        if index % every == every - 1 and len(alone) < args.baseline_runs:
            alone.append(one_run(cell, 1, args))
    alone += [one_run(cell, 1, args) for _ in range(args.baseline_runs - len(alone))]
    return fleet_runs, alone


def cells(args: argparse.Namespace) -> list[Cell]:
    return [
        Cell(capacity, start, bool(hog), delay)
        for capacity in args.capacities
        for start in args.starts
        for hog in args.hogs
        for delay in args.delays_ms
    ]


def summary(cell: Cell, fleet_runs: list[Run], alone: list[Run]) -> dict[str, object]:
    served = sum(r.served for r in fleet_runs) / len(fleet_runs)
    refused = sum(r.refused for r in fleet_runs) / len(fleet_runs)
    alone_served = sum(r.served for r in alone) / len(alone) if alone else float("nan")
    alone_refused = sum(r.refused for r in alone) / len(alone) if alone else float("nan")
    return {
        "cell": cell.label,
        "runs": len(fleet_runs),
        "peak_held": max(r.held_max for r in fleet_runs),
        "peak_running_sampled": max(r.running_max for r in fleet_runs),
        "peak_batch": max(r.batch_max for r in fleet_runs),
        "runs_over_capacity": sum(r.held_max > cell.capacity for r in fleet_runs),
        "served_mean": served,
        "refused_mean": refused,
        "alone_served_mean": alone_served,
        "alone_refused_mean": alone_refused,
        "served_ratio": served / alone_served if alone_served else float("nan"),
        "refused_ratio": (refused / alone_refused) if alone_refused else (1.0 if refused == 0 else float("inf")),
        "sync_failures": sum(r.sync_failures for r in fleet_runs),
        "fallbacks": sum(r.fallbacks for r in fleet_runs),
        "peak_alone": max((r.held_max for r in alone), default=float("nan")),
        "load_average": os.getloadavg()[0],
        "seconds_per_run": sum(r.seconds for r in fleet_runs) / len(fleet_runs),
    }


def line(row: dict[str, object], capacity: int) -> str:
    return (
        f"{row['cell']:<38} runs {row['runs']:>3}  peak held {row['peak_held']:>4.0f}/{capacity}"
        f" (sampled running {row['peak_running_sampled']:>4.0f}, batch {row['peak_batch']:>3.0f}/{capacity // 2})"
        f"  over capacity in {row['runs_over_capacity']} runs | served {row['served_mean']:.1f} vs alone"
        f" {row['alone_served_mean']:.1f} (x{row['served_ratio']:.2f}), refused {row['refused_mean']:.1f} vs"
        f" {row['alone_refused_mean']:.1f} (x{row['refused_ratio']:.2f}) | sync failures {row['sync_failures']:.0f},"
        f" limit fallbacks {row['fallbacks']:.0f} | load {row['load_average']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:2] == ["--scenario", "fairness"]:  # the same bench's fairness scenario (its own options)
        from loadtests.proofs import fleet_fairness

        return fleet_fairness.main(args_in[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--baseline-runs", type=int, default=5)
    parser.add_argument("--capacities", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    parser.add_argument("--starts", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 8.0])
    parser.add_argument("--hogs", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    parser.add_argument("--delays-ms", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 5.0, 30.0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--sample-hz", type=float, default=25.0)
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--gateway-pythonpath", default=None, help="run the gateways from this source tree")
    parser.add_argument("--out", default=None, help="a folder for results.json and results.txt")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    header = (
        f"# python -m loadtests.proofs.fleet_stress {' '.join(argv if argv is not None else sys.argv[1:])}\n"
        f"# load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on {os.cpu_count()} cores"
    )
    print(header, flush=True)
    rows, runs = [], {}
    for cell in cells(args):
        if cell.start_after_s:
            fleet_runs, alone = warm_runs(cell, args)
        else:
            fleet_runs, alone = cold_runs(cell, args)
        runs[cell.label] = {"fleet": [asdict(r) for r in fleet_runs], "alone": [asdict(r) for r in alone]}
        row = summary(cell, fleet_runs, alone)
        rows.append(row)
        print(line(row, cell.capacity), flush=True)
        if out is not None:
            (out / "results.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    load_end = os.getloadavg()
    footer = f"# load average at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}"
    print(footer)
    if out is not None:
        text = "\n".join([header, *(line(r, int(str(r["cell"]).split()[0][2:])) for r in rows), footer])
        (out / "results.txt").write_text(text + "\n")
    return 0 if all(r["runs_over_capacity"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
