"""Can one core run four simulated engines with 32 streams each and keep their step times?

Usage::

    python -m loadtests.proofs.sim_capacity [--scales 1,4] [--seconds 10] [--profile llama-3.1-8b-h100]

For each time scale, four engines run in one child process pinned to core 0 (one event loop,
four uvicorn servers); this process pins itself to core 1 and keeps 4 × 32 streaming chat
completions open (a light aiohttp client that only counts SSE events). Printed per scale:

* step lag P50/P99/max: how late each step's wake-up ran against its absolute roofline deadline;
* busy/wall: simulated step time over wall time, per engine (1.0 = the GPU timeline was kept);
* achieved tokens/s at the client vs expected tokens/s (the engines' generated tokens divided by
  their simulated busy time, i.e. what the roofline allows for the batches that actually ran).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

import aiohttp
import orjson
import uvloop

from loadtests.harness.processes import wait_until

ENGINES, STREAMS = 4, 32
PROMPT = " ".join(f"w{i}" for i in range(200))


def _snapshot(apps: list[Any]) -> list[tuple[float, float, int, int]]:
    """(wall, busy, steps, tokens) per engine."""
    now = time.monotonic()
    return [(now, a.engine.busy_seconds, a.engine.steps, a.engine.tokens_out) for a in apps]


def _serve(profile: str, ports: list[int], scale: float, mark: Event, stop: Event, out: Queue[Any]) -> None:
    os.sched_setaffinity(0, {0})
    from loadtests.sim.serve import build_servers
    from loadtests.sim.server import build_engine_app

    async def run() -> None:
        apps = [build_engine_app(profile, time_scale=scale, index=i) for i in range(len(ports))]
        servers = build_servers(apps, host="127.0.0.1", ports=ports)
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        while not mark.is_set():  # noqa: ASYNC110 (a multiprocessing Event cannot be awaited)
            await asyncio.sleep(0.05)
        engines: list[Any] = [a.engine for a in apps]
        first, lag_from = _snapshot(apps), [len(e.lag_samples) for e in engines]
        while not stop.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        last = _snapshot(apps)
        stats = []
        for engine, a, b, skip in zip(engines, first, last, lag_from, strict=True):
            lag = list(engine.lag_samples)[skip:]
            stats.append(
                {"lag": lag, "wall": b[0] - a[0], "busy": b[1] - a[1], "steps": b[2] - a[2], "tokens": b[3] - a[3]}
            )
        out.put(stats)
        for s in servers:
            s.should_exit = True
        await asyncio.wait(tasks, timeout=5)

    uvloop.run(run())


async def _drive(
    ports: list[int], seconds: float, max_tokens: int, mark: Event, stop_event: Event, warmup: float
) -> tuple[int, float]:
    """Keep every stream slot busy for `seconds`; count tokens after `warmup` (then set `mark`)."""
    tokens = 0
    stop = time.monotonic() + seconds

    async def marker() -> None:
        nonlocal tokens
        await asyncio.sleep(warmup)
        tokens = 0
        mark.set()
        await asyncio.sleep(seconds - warmup)
        stop_event.set()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def stream(port: int, slot: int) -> None:
            nonlocal tokens
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            n = 0
            while time.monotonic() < stop:
                body = orjson.dumps(
                    {
                        "model": "meta-llama/Llama-3.1-8B-Instruct",
                        "max_tokens": max_tokens,
                        "stream": True,
                        "messages": [{"role": "user", "content": f"{slot} {n} {PROMPT}"}],
                    }
                )
                n += 1
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as response:
                    async for chunk in response.content.iter_any():
                        tokens += chunk.count(b"data: ")
                        if time.monotonic() >= stop:
                            return
                tokens -= 2  # the role chunk and [DONE]

        await asyncio.gather(marker(), *(stream(p, s) for p in ports for s in range(STREAMS)))
        return tokens, seconds - warmup


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_scale(profile: str, scale: float, seconds: float, base_port: int, max_tokens: int) -> None:
    ctx = mp.get_context("spawn")
    ports = [base_port + i for i in range(ENGINES)]
    mark, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=_serve, args=(profile, ports, scale, mark, stop, out), daemon=True)
    server.start()
    try:
        wait_until(lambda: all(_port_open(p) for p in ports), timeout=30, what="the engines")
        os.sched_setaffinity(0, {1})
        tokens, wall = uvloop.run(_drive(ports, seconds + 1.5 * scale, max_tokens, mark, stop, 1.5 * scale))
        stats = out.get(timeout=30)
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.terminate()
    lag = [x for s in stats for x in s["lag"]]
    print(
        f"time scale {scale:g}: {ENGINES} engines x {STREAMS} streams, profile {profile}, max_tokens {max_tokens},"
        f" {seconds:g} s measured (+ warm-up)"
    )
    print(
        f"  step lag  P50 {1000 * _pct(lag, 0.5):.2f} ms  P99 {1000 * _pct(lag, 0.99):.2f} ms"
        f"  max {1000 * max(lag):.2f} ms  over {len(lag)} steps"
    )
    step_ms = 1000 * statistics.fmean(s["busy"] / s["steps"] for s in stats)
    busy = [s["busy"] / s["wall"] for s in stats]
    expected = sum(s["tokens"] / s["busy"] for s in stats)
    engine_rate = sum(s["tokens"] / s["wall"] for s in stats)
    print(
        f"  mean step {step_ms:.2f} ms (roofline x scale); busy/wall per engine: " + ", ".join(f"{b:.3f}" for b in busy)
    )
    print(
        f"  tokens/s: client {tokens / wall:,.0f}, engines {engine_rate:,.0f}, expected (roofline, always busy)"
        f" {expected:,.0f}  ->  achieved/expected {engine_rate / expected:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="1,4")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=18950)
    args = parser.parse_args()
    for scale in (float(s) for s in args.scales.split(",")):
        run_scale(args.profile, scale, args.seconds, args.port, args.max_tokens)


if __name__ == "__main__":
    main()
