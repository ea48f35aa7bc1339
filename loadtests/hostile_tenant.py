"""What a tenant sending large invalid bodies does to another tenant's latency, in one run.

Usage::

    python -m loadtests.hostile_tenant [--victim-rate 20] [--abuser-rate 12] [--phase-s 5] [--rounds 3]
                                       [--shapes many_messages,tiny_parts,deep_nesting,many_numbers,many_keys]
                                       [--abuser-rpm 100000] [--gateway-pythonpath DIR] [--out FILE]

A zero-delay simulated engine (profile ``instant``) and the gateway, each its own process, the
gateway pinned alone to one core. The victim tenant sends small chat requests, open-loop
Poisson at ``--victim-rate``; in alternate phases ("alone", "attacked") the abuser tenant also
sends ``--abuser-rate`` bodies a second of about 900 KiB each, every one invalid (``n: 0``, or
refused for its structure first), rotating through ``--shapes``, from a client process of its
own (so that sending them costs the victim's client nothing). Reported: the victim's P50,
P95 and P99 in each mode and their ratio attacked/alone, the abuser's answers, the gateway's
CPU per abuser request (the CPU of attacked phases less that of alone phases), and the
machine's load average at start and end (the machine is shared: read the ratio, not the
absolute figures). The abuser's ``rpm`` is high by default, so the figure is the CPU bound
per request, not the rate limit; lower it to see invalid requests charged to its rate.

``--gateway-pythonpath`` runs the gateway from another source tree (a checkout of an older
commit), for a before/after in the same conditions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import Queue
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from gateway.keys import hash_api_key
from loadtests.harness import cpu_seconds, pin, policy_file, process

MODEL = "sim-instant"
VICTIM_KEY, ABUSER_KEY = "victim-bench-key", "abuser-bench-key"
VICTIM_BODY = orjson.dumps(
    {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "A short question about latency."}]}
)
TARGET_BYTES = 900 * 1024


def hostile_body(shape: str) -> bytes:
    """About 900 KiB of ``shape``, invalid (``n: 0``) even when its structure passes."""
    body: dict[str, Any] = {"model": MODEL, "n": 0, "messages": [{"role": "user", "content": "x"}]}
    if shape == "many_messages":
        body["messages"] = [{"role": "user", "content": "hi"}] * (TARGET_BYTES // 31)
    elif shape == "tiny_parts":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "a"}] * (TARGET_BYTES // 27)}]
    elif shape == "deep_nesting":
        node: Any = 1
        for _ in range(28):
            node = [node]
        body["tools"] = [node] * (TARGET_BYTES // 59)
    elif shape == "many_numbers":
        body["logit_bias"] = [1] * (TARGET_BYTES // 2)
    elif shape == "many_keys":
        body.update({f"k{i}": 1 for i in range(TARGET_BYTES // 10)})
    elif shape == "giant_string":
        body["messages"] = [{"role": "user", "content": "x" * TARGET_BYTES}]
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return orjson.dumps(body)


def policy(backend_url: str, abuser_rpm: int) -> str:
    return f"""
version: hostile-tenant-bench
limits: {{max_body_bytes: 1048576}}
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 8192, max_output_tokens: 4096}}
backends:
  - {{name: instant, url: "{backend_url}", kind: sim, models: [{MODEL}],
      capacity: {{max_concurrent: 100000, max_tokens_in_flight: 100000000}}}}
tenants:
  - {{name: victim, key_hashes: ["{hash_api_key(VICTIM_KEY)}"], models: ["*"], default_class: interactive}}
  - {{name: abuser, key_hashes: ["{hash_api_key(ABUSER_KEY)}"], models: ["*"], default_class: interactive,
      limits: {{rpm: {abuser_rpm}}}}}
health_checks: {{interval_s: 30, timeout_s: 2}}
"""


@dataclass
class Mode:
    """One mode's figures, accumulated over rounds."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    abuser: Counter[str] = field(default_factory=Counter)
    abuser_sent: int = 0
    cpu_s: float = 0.0
    seconds: float = 0.0


async def _victim(session: aiohttp.ClientSession, url: str, mode: Mode) -> None:
    started = time.perf_counter()
    try:
        async with session.post(url, data=VICTIM_BODY, headers=_headers(VICTIM_KEY)) as response:
            await response.read()
            if response.status != 200:
                mode.errors[f"HTTP {response.status}"] += 1
                return
    except aiohttp.ClientError as exc:
        mode.errors[type(exc).__name__] += 1
        return
    mode.latencies.append(time.perf_counter() - started)


async def _abuser(session: aiohttp.ClientSession, url: str, body: bytes, mode: Mode) -> None:
    try:
        async with session.post(url, data=body, headers=_headers(ABUSER_KEY)) as response:
            payload = await response.read()
            code = orjson.loads(payload).get("error", {}).get("code") if response.status != 200 else "ok"
            mode.abuser[f"{response.status} {code}"] += 1
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        mode.abuser[type(exc).__name__] += 1


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


async def _arrivals(rate: float, seconds: float, seed: int, launch: Any) -> None:
    """Open-loop Poisson arrivals: ``launch()`` at each, never waiting for an answer."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    tasks: set[asyncio.Task[None]] = set()
    start = loop.time()
    next_at = start + rng.expovariate(rate)
    while next_at < start + seconds:
        await asyncio.sleep(max(0.0, next_at - loop.time()))
        task = loop.create_task(launch())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=30)


async def _phase(
    session: aiohttp.ClientSession, args: argparse.Namespace, mode: Mode, attacked: bool, seed: int
) -> None:
    before, started = cpu_seconds(args.gateway_pid), time.perf_counter()
    if attacked:
        args.control.put((args.phase_s, seed + 1))
    await _arrivals(args.victim_rate, args.phase_s, seed, lambda: _victim(session, args.url, mode))
    if attacked:
        sent, answers = await asyncio.get_running_loop().run_in_executor(None, args.results.get)
        mode.abuser_sent += sent
        mode.abuser.update(answers)
    mode.cpu_s += cpu_seconds(args.gateway_pid) - before
    mode.seconds += time.perf_counter() - started


def _abuser_process(url: str, bodies: list[bytes], rate: float, control: Queue[Any], results: Queue[Any]) -> None:
    """The abuser, a client process of its own: one attack of ``(seconds, seed)`` per command."""

    async def serve() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            loop = asyncio.get_running_loop()
            while (command := await loop.run_in_executor(None, control.get)) is not None:
                seconds, seed = command
                mode, sent = Mode(), 0

                def attack(mode: Mode = mode) -> Any:
                    nonlocal sent
                    sent += 1
                    return _abuser(session, url, bodies[sent % len(bodies)], mode)

                await _arrivals(rate, seconds, seed, attack)
                results.put((sent, dict(mode.abuser)))

    asyncio.run(serve())


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    modes = {"alone": Mode(), "attacked": Mode()}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _phase(session, args, Mode(), attacked=False, seed=0)  # warm up
        for round_no in range(args.rounds):
            for name in ("alone", "attacked"):
                await _phase(session, args, modes[name], attacked=name == "attacked", seed=round_no * 7)
    alone, attacked = modes["alone"], modes["attacked"]
    cpu_alone_per_s = alone.cpu_s / alone.seconds
    extra_cpu = attacked.cpu_s - cpu_alone_per_s * attacked.seconds
    report: dict[str, Any] = {
        name: {
            "victim_requests": len(m.latencies),
            "victim_errors": dict(m.errors),
            "p50_ms": _pct(m.latencies, 50),
            "p95_ms": _pct(m.latencies, 95),
            "p99_ms": _pct(m.latencies, 99),
            "gateway_cpu_share": m.cpu_s / m.seconds,
        }
        for name, m in modes.items()
    }
    report["ratio_attacked_over_alone"] = {
        f"p{q}": _pct(attacked.latencies, q) / _pct(alone.latencies, q) for q in (50, 95, 99)
    }
    report["abuser_answers"] = dict(attacked.abuser)
    report["abuser_sent"] = attacked.abuser_sent
    report["gateway_cpu_ms_per_abuser_request"] = extra_cpu * 1000 / max(attacked.abuser_sent, 1)
    return report


def _print(report: dict[str, Any], args: argparse.Namespace) -> None:
    for name in ("alone", "attacked"):
        r = report[name]
        print(
            f"victim {name:>8}: P50 {r['p50_ms']:7.2f} ms  P95 {r['p95_ms']:7.2f} ms  P99 {r['p99_ms']:7.2f} ms  "
            f"({r['victim_requests']} requests, errors {r['victim_errors'] or 0}, gateway CPU "
            f"{r['gateway_cpu_share'] * 100:.0f}% of a core)"
        )
    ratio = report["ratio_attacked_over_alone"]
    print(
        f"ratio attacked/alone: P50 {ratio['p50']:.2f}x  P95 {ratio['p95']:.2f}x  P99 {ratio['p99']:.2f}x  | abuser: "
        f"{report['abuser_sent']} sent at {args.abuser_rate}/s, answers {report['abuser_answers']}, "
        f"gateway CPU {report['gateway_cpu_ms_per_abuser_request']:.1f} ms per abuser request"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--victim-rate", type=float, default=20.0)
    parser.add_argument("--abuser-rate", type=float, default=12.0)
    parser.add_argument("--phase-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="many_messages,tiny_parts,deep_nesting,many_numbers,many_keys")
    parser.add_argument("--abuser-rpm", type=int, default=100_000)
    parser.add_argument("--backend-port", type=int, default=18601)
    parser.add_argument("--gateway-port", type=int, default=18600)
    parser.add_argument("--gateway-pythonpath", default=None, help="run the gateway from this source tree")
    parser.add_argument("--out", default=None, help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    args.bodies = [hostile_body(shape) for shape in args.shapes.split(",")]
    backend = f"http://127.0.0.1:{args.backend_port}"
    gateway = f"http://127.0.0.1:{args.gateway_port}"
    args.url = gateway + "/v1/chat/completions"
    exe = [sys.executable, "-m", "gateway"]
    env = dict(os.environ)
    gateway_exe = exe
    if args.gateway_pythonpath:
        env["PYTHONPATH"] = args.gateway_pythonpath
        gateway_exe = [sys.executable, "-P", "-m", "gateway"]  # -P: not the working directory's tree
    load_before = os.getloadavg()
    with policy_file(policy(backend, args.abuser_rpm)) as path:
        sim = [*pin(0), *exe, "sim", "--profile", "instant", "--model", MODEL, "--port", str(args.backend_port)]
        serve = [*pin(1), *gateway_exe, "serve", "--policy", str(path), "--port", str(args.gateway_port)]
        if len(pin(0)):
            os.sched_setaffinity(0, {0})
        context = multiprocessing.get_context("spawn")
        args.control, args.results = context.Queue(), context.Queue()
        abuser = context.Process(
            target=_abuser_process, args=(args.url, args.bodies, args.abuser_rate, args.control, args.results)
        )
        with process(sim, backend + "/health"), process(serve, gateway + "/healthz", env=env) as gateway_proc:
            args.gateway_pid = gateway_proc.pid
            abuser.start()
            print(
                f"hostile tenant: victim {args.victim_rate}/s small chats, abuser {args.abuser_rate}/s invalid bodies "
                f"of ~{len(args.bodies[0]) // 1024} KiB ({args.shapes}), phases of {args.phase_s}s x {args.rounds} "
                f"rounds, alternating; gateway from {args.gateway_pythonpath or 'this tree'}",
                flush=True,
            )
            try:
                report = asyncio.run(_run(args))
            finally:
                args.control.put(None)
                abuser.join(timeout=30)
    report["load_average"] = {"start": load_before, "end": os.getloadavg()}
    print(f"load average (1, 5, 15 min): start {load_before}, end {report['load_average']['end']}")
    _print(report, args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
