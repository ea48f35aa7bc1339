"""Requests per second of the ``instant`` profile on one core.

Usage::

    python -m loadtests.proofs.sim_instant [--seconds 8] [--concurrency 64] [--port 18900]

One engine runs in a child process pinned to core 0; this process (the aiohttp client) pins
itself to core 1 and keeps `concurrency` keep-alive connections busy with non-streaming chat
completions (small prompt, ``max_tokens`` 16). The goal: at least 3,000 requests/s, so that the
simulator is never what a gateway benchmark measures.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

import aiohttp
import orjson
import uvloop

from loadtests.harness.processes import wait_until

BODY = orjson.dumps(
    {"model": "sim-model", "messages": [{"role": "user", "content": "Say hello in five words."}], "max_tokens": 16}
)


def _serve(port: int) -> None:
    os.sched_setaffinity(0, {0})
    from loadtests.sim.serve import serve_engines

    uvloop.run(serve_engines("instant", ports=[port]))


async def _drive(url: str, seconds: float, concurrency: int) -> tuple[int, int]:
    ok = errors = 0
    stop = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal ok, errors
            while time.monotonic() < stop:
                async with session.post(url, data=BODY, headers=headers) as response:
                    await response.read()
                    if response.status == 200:
                        ok += 1
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok, errors


def _cpu_seconds(pid: int | None) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--port", type=int, default=18900)
    args = parser.parse_args()
    server = mp.get_context("spawn").Process(target=_serve, args=(args.port,), daemon=True)
    server.start()
    try:
        wait_until(lambda: _port_open(args.port), timeout=20, what="the instant engine")
        os.sched_setaffinity(0, {1})
        url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
        uvloop.run(_drive(url, 1.0, args.concurrency))  # warm-up
        server_cpu, client_cpu = _cpu_seconds(server.pid), time.process_time()
        ok, errors = uvloop.run(_drive(url, args.seconds, args.concurrency))
        server_cpu = _cpu_seconds(server.pid) - server_cpu
        client_cpu = time.process_time() - client_cpu
    finally:
        server.terminate()
        server.join(5)
    rate = ok / args.seconds
    print("sim_instant: profile=instant, server pinned to core 0, aiohttp client pinned to core 1")
    print(f"  concurrency={args.concurrency} seconds={args.seconds} max_tokens=16 non-streaming chat")
    print(
        f"  requests ok={ok} errors={errors}  ->  {rate:,.0f} requests/s ({'PASS' if rate >= 3000 else 'FAIL'}"
        " vs goal 3,000/s)"
    )
    print(
        f"  CPU busy: server {server_cpu / args.seconds:.0%} of core 0,"
        f" client {client_cpu / args.seconds:.0%} of core 1"
    )
    print(
        f"  server CPU per request: {1e6 * server_cpu / max(ok, 1):.0f} us"
        f" (=> {ok / max(server_cpu, 1e-9):,.0f} requests/s per fully used core)"
    )


if __name__ == "__main__":
    main()
