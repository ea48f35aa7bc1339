"""Fair queuing across replicas: a light tenant's time to first byte while a neighbour floods.

Usage::

    python -m loadtests.proofs.fleet_fairness [--seconds 20] [--flood 16] [--light-rate 2] [--capacity 8]
                                       [--time-scale 1] [--repeats 2] [--tree PATH] [--baseline-tree PATH]
                                       [--out loadtests/results/fleet_fairness]

What the issue saw, made a bench. One simulated engine (profile ``llama-3.1-8b-h100``, its own
batch limit far above the policy's) declared with ``max_concurrent`` C (8); one class,
interactive (TTFT objective 1 s, no ``max_wait_s``: the wait budget is the objective less the
measured dispatch-to-first-token tail, so the wait estimate decides refusals); two tenants of
weight 1, ``heavy`` and ``light``; ``state.backend: redis`` on the local Redis under a key
prefix of its own. Gateways are real ``serve`` processes pinned to core 1 (the engine and the
clients on core 0).

Scenarios, each with its own processes started afresh:

* **fleet**: two replicas (two ``serve``); the light tenant streams at ``--light-rate``
  requests a second (regular arrivals, ``max_tokens`` 100) through replica 2, alone for
  ``--seconds``, then again while the heavy tenant keeps ``--flood`` streams (``max_tokens``
  300) in flight through replica 1 (each stream followed at once by the next; a refusal waits
  its ``Retry-After``, at most 0.25 s); the two phases alternate ``--repeats`` times;
* **one process**, the control: the same on one ``serve`` (the flood through the same process);
* with ``--baseline-tree`` (an older checkout, e.g. ``git archive d09cf7b``), the flood phases
  of both again with that tree's gateway, for a before/after in the same run.

Per phase: the light tenant's time to first byte (the first SSE event with content) P50, P95
and P99, its completions (200s with the stream whole) and refusals by code; the flood's
completions; each gateway's fleet syncs a second (``gateway_fleet_syncs_total``). Per scenario,
flood over alone for each figure. Goal (issue 28): in the fleet, the light tenant's P50 and P95
within 1.25x of alone; within one process, no ``deadline_unmeetable`` for the light tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from gateway.request.keys import hash_api_key
from loadtests.harness.processes import GATEWAY, free_port, metric_sum, metrics, pin, policy_file, process

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEYS = {"heavy": "fairness-heavy-key", "light": "fairness-light-key"}
GATEWAY_CORE, OTHERS_CORE = 1, 0
REDIS_URL = "redis://127.0.0.1:6379/0"
LIGHT_TOKENS, HEAVY_TOKENS = 100, 300


def policy(engine_url: str, capacity: int, prefix: str) -> str:
    tenants = "\n".join(
        f'  - {{name: {name}, key_hashes: ["{hash_api_key(key)}"], models: ["*"], default_class: interactive}}'
        for name, key in KEYS.items()
    )
    return f"""
version: fleet-fairness
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 1000, itl_ms: 100, e2e_ms: 60000}}, queue: {{max_depth: 256}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 4096, max_output_tokens: 1024, routing: {{strategy: least_load}}}}
backends:
  - {{name: engine, url: "{engine_url}", kind: sim, models: [{MODEL}],
      capacity: {{max_concurrent: {capacity}, max_tokens_in_flight: 400000, max_waiting: 100000}}}}
tenants:
{tenants}
state: {{backend: redis, redis_url: "{REDIS_URL}", key_prefix: "{prefix}", timeout_ms: 200}}
health_checks: {{interval_s: 30, timeout_s: 2}}
"""


@dataclass(slots=True)
class Phase:
    """One phase's figures: the light tenant's requests, the flood's, the gateways' syncs."""

    name: str
    ttfb_ms: list[float] = field(default_factory=list)
    light: Counter[str] = field(default_factory=Counter)
    heavy: Counter[str] = field(default_factory=Counter)
    syncs: list[float] = field(default_factory=list)
    """Fleet syncs each gateway made while the light tenant was measured."""
    queued: float = 0.0
    """Requests the light tenant's gateway dispatched after more than 5 ms in its queue (every tenant's)."""
    seconds: float = 0.0
    load_average: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "phase": self.name,
            "light_ttfb_ms": {"p50": pct(self.ttfb_ms, 50), "p95": pct(self.ttfb_ms, 95), "p99": pct(self.ttfb_ms, 99)},
            "light_sent": sum(self.light.values()),
            "light_completed": self.light["200"],
            "light_refused": {k: v for k, v in self.light.items() if k != "200"},
            "heavy_completed": self.heavy["200"],
            "heavy_refused": {k: v for k, v in self.heavy.items() if k != "200"},
            "queued_over_5ms_at_light_gateway": int(self.queued),
            "syncs_per_s_per_process": [round(n / self.seconds, 1) if self.seconds else 0.0 for n in self.syncs],
            "seconds": round(self.seconds, 1),
            "load_average": self.load_average,
        }


def pct(values: list[float], q: float) -> float:
    """The nearest-rank percentile (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def stream(session: aiohttp.ClientSession, url: str, tenant: str, tokens: int) -> tuple[str, float | None, float]:
    """One streamed chat request: its outcome ('200' whole, else the status and error code), the
    time to its first content event, and its Retry-After (0 when none)."""
    body = {
        "model": MODEL,
        "max_tokens": tokens,
        "stream": True,
        "messages": [{"role": "user", "content": f"{tenant} says hello " * 20}],
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    started = time.monotonic()
    first: float | None = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status != 200:
                payload = await response.read()
                code = json.loads(payload).get("error", {}).get("code", "") if payload else ""
                return f"{response.status} {code}".strip(), None, float(response.headers.get("retry-after", 0))
            done = False
            async for line in response.content:
                if (
                    first is None
                    and line.startswith(b"data: {")
                    and b'"content":"' in line
                    and b'"content":""' not in line
                ):
                    first = time.monotonic() - started
                done = done or line.startswith(b"data: [DONE]")
            return ("200" if done else "cut"), first, 0.0
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return type(exc).__name__, None, 0.0


async def light_client(url: str, rate: float, seconds: float, phase: Phase) -> None:
    """Requests at regular intervals of 1/rate, each on its own, for ``seconds``."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one() -> None:
            outcome, first, _ = await stream(session, url, "light", LIGHT_TOKENS)
            phase.light[outcome] += 1
            if outcome == "200" and first is not None:
                phase.ttfb_ms.append(first * 1000)

        tasks = []
        start = time.monotonic()
        for i in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)


async def flood_client(url: str, streams: int, stop: asyncio.Event, phase: Phase) -> None:
    """``streams`` streams in flight at all times until ``stop``; a refusal waits its Retry-After (at most 0.25 s)."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def loop() -> None:
            while not stop.is_set():
                outcome, _, retry_after = await stream(session, url, "heavy", HEAVY_TOKENS)
                phase.heavy[outcome] += 1
                if outcome != "200":
                    await asyncio.sleep(min(retry_after, 0.25) or 0.05)

        await asyncio.gather(*(loop() for _ in range(streams)))


def syncs(admins: list[str]) -> list[float]:
    """Each gateway's fleet syncs so far, then the light tenant's gateway's dispatches that queued over 5 ms."""
    scraped = [metrics(admin) for admin in admins]
    light = scraped[-1]
    queued = metric_sum(light, "gateway_queue_wait_seconds_count") - metric_sum(
        light, "gateway_queue_wait_seconds_bucket", le="0.005"
    )
    return [*(metric_sum(one, "gateway_fleet_syncs_total") for one in scraped), queued]


async def run_phase(
    phase: Phase, light_url: str, flood_url: str | None, admins: list[str], args: argparse.Namespace
) -> None:
    """One measurement into ``phase`` (a phase repeated adds to its figures)."""
    stop = asyncio.Event()
    flood = None
    if flood_url is not None:
        flood = asyncio.create_task(flood_client(flood_url, args.flood, stop, phase))
        await asyncio.sleep(args.warmup)  # the flood at its steady state before the light tenant is measured
    before, started = await asyncio.to_thread(syncs, admins), time.monotonic()
    await light_client(light_url, args.light_rate, args.seconds, phase)
    after = await asyncio.to_thread(syncs, admins)
    phase.seconds += time.monotonic() - started
    deltas = [b - a for a, b in zip(before, after, strict=True)]
    phase.queued += deltas.pop()
    phase.syncs = [x + y for x, y in zip(phase.syncs, deltas, strict=True)] if phase.syncs else deltas
    phase.load_average = max(phase.load_average, os.getloadavg()[0])
    stop.set()
    if flood is not None:
        await flood


@contextmanager
def gateways(path: Path, count: int, tree: str | None) -> Iterator[tuple[list[str], list[str]]]:
    """``count`` ``serve`` processes (from ``tree`` when given): their API and operator URLs."""
    env = dict(os.environ)
    gateway = GATEWAY
    if tree is not None:
        env["PYTHONPATH"] = tree
        gateway = [sys.executable, "-P", "-m", "gateway"]  # -P: not the working directory's tree
    with ExitStack() as stack:
        apis, admins = [], []
        for _ in range(count):
            port, admin = free_port(), free_port()
            argv = [*pin(GATEWAY_CORE), *gateway, "serve", "--policy", str(path), "--port", str(port)]
            stack.enter_context(
                process([*argv, "--admin-port", str(admin)], f"http://127.0.0.1:{port}/readyz", timeout_s=60, env=env)
            )
            apis.append(f"http://127.0.0.1:{port}")
            admins.append(f"http://127.0.0.1:{admin}")
        yield apis, admins


def scenario(replicas: int, tree: str | None, label: str, phases: list[str], args: argparse.Namespace) -> list[Phase]:
    """Start an engine and ``replicas`` gateways afresh; run ``phases`` ('alone', 'flood') in turn,
    ``--repeats`` times (alternating, so that both see the same conditions, as near as can be)."""
    engine_port = free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    prefix = f"fairness-{uuid.uuid4().hex[:8]}:"
    out = {kind: Phase(f"{label} {kind}") for kind in phases}
    with ExitStack() as stack:
        sim = [*pin(OTHERS_CORE), *GATEWAY, "sim", "--profile", "llama-3.1-8b-h100", "--port", str(engine_port)]
        sim_env = dict(os.environ) if args.tree is None else {**os.environ, "PYTHONPATH": args.tree}
        stack.enter_context(process([*sim, "--time-scale", str(args.time_scale)], engine + "/health", env=sim_env))
        path = stack.enter_context(policy_file(policy(engine, args.capacity, prefix)))
        apis, admins = stack.enter_context(gateways(path, replicas, tree))
        light_url, flood_url = apis[-1], apis[0]
        try:
            for _ in range(args.repeats):
                for kind in phases:
                    flooding = flood_url if kind == "flood" else None
                    asyncio.run(run_phase(out[kind], light_url, flooding, admins, args))
        finally:
            drop(prefix)
    for phase in out.values():
        print(line(phase.summary()), flush=True)
    return list(out.values())


def drop(prefix: str) -> None:
    with redis.Redis.from_url(REDIS_URL, socket_timeout=2) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def line(row: dict[str, Any]) -> str:
    t = row["light_ttfb_ms"]
    refused = ", ".join(f"{k} x{v}" for k, v in sorted(row["light_refused"].items())) or "none"
    return (
        f"{row['phase']:<28} light TTFB ms P50 {t['p50']:7.1f} P95 {t['p95']:7.1f} P99 {t['p99']:7.1f} | light"
        f" completed {row['light_completed']:>3}/{row['light_sent']:<3} refused {refused} | heavy completed"
        f" {row['heavy_completed']:>4} | queued >5ms at light's {row['queued_over_5ms_at_light_gateway']:>3}"
        f" | syncs/s per process {row['syncs_per_s_per_process']} | load"
        f" {row['load_average']:.2f}"
    )


def ratios(alone: dict[str, Any], flood: dict[str, Any]) -> dict[str, float]:
    a, f = alone["light_ttfb_ms"], flood["light_ttfb_ms"]
    out = {f"ttfb_{q}": f[q] / a[q] if a[q] else float("nan") for q in ("p50", "p95", "p99")}
    out["completions"] = (
        flood["light_completed"] / alone["light_completed"] if alone["light_completed"] else float("nan")
    )
    return out


def ratio_line(label: str, r: dict[str, float]) -> str:
    return (
        f"{label:<28} flood / alone: TTFB P50 x{r['ttfb_p50']:.2f} P95 x{r['ttfb_p95']:.2f} P99 x{r['ttfb_p99']:.2f},"
        f" completions x{r['completions']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the light tenant sends, per phase")
    parser.add_argument("--warmup", type=float, default=3.0, help="the flood's head start before measuring")
    parser.add_argument("--repeats", type=int, default=2, help="each phase this many times, alternating")
    parser.add_argument("--flood", type=int, default=16)
    parser.add_argument("--light-rate", type=float, default=2.0)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--tree", default=None, help="run the gateways and the engine from this source tree")
    parser.add_argument("--baseline-tree", default=None, help="also run the flood phases with this tree's gateway")
    parser.add_argument("--fleet-only", action="store_true", help="skip the one-process control")
    parser.add_argument("--out", default=None, help="a folder for results.json and results.txt")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    header = (
        f"# python -m loadtests.proofs.fleet_fairness {' '.join(argv if argv is not None else sys.argv[1:])}\n"
        f"# load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on {os.cpu_count()} cores"
    )
    print(header, flush=True)
    results: dict[str, list[Phase]] = {"fleet": scenario(2, args.tree, "fleet (2 replicas)", ["alone", "flood"], args)}
    if not args.fleet_only:
        results["one process"] = scenario(1, args.tree, "one process", ["alone", "flood"], args)
    if args.baseline_tree:
        results["fleet, baseline"] = scenario(2, args.baseline_tree, "fleet, baseline", ["flood"], args)
        if not args.fleet_only:
            results["one process, baseline"] = scenario(1, args.baseline_tree, "one process, baseline", ["flood"], args)
    rows = {name: [p.summary() for p in phases] for name, phases in results.items()}
    lines = [header, *(line(row) for phases in rows.values() for row in phases)]
    summary: dict[str, Any] = {"rows": rows, "ratios": {}}
    for name in [name for name in ("fleet", "one process") if name in rows]:
        alone, flood = rows[name]
        summary["ratios"][name] = ratios(alone, flood)
        lines.append(ratio_line(name, summary["ratios"][name]))
    for name in ("fleet", "one process"):
        baseline = rows.get(f"{name}, baseline")
        if baseline and name in rows:
            summary["ratios"][f"{name}, baseline"] = ratios(rows[name][0], baseline[0])
            lines.append(ratio_line(f"{name}, baseline", summary["ratios"][f"{name}, baseline"]))
    load_end = os.getloadavg()
    footer = f"# load average at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}"
    lines.append(footer)
    print("\n".join(lines[len(lines) - len(summary["ratios"]) - 1 :]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"argv": sys.argv[1:], **summary}, indent=1))
        (out / "results.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
